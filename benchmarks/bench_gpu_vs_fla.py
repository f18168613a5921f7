"""gdngen's generated Pallas GPU kernels against fla's Triton ``chunk_gated_delta_rule`` on one
NVIDIA GPU (H100/H200), forward + backward, bfloat16, D = 128.

One prepared run, in order (every step writes its files under ``--out``, default ``$OUT``):

1. validate: ``gdngen.tools.build`` renders, lowers and validates candidate variants of the
   benchmark problem against the float64 reference on the hard battery cases
   (``build/manifest.json``);
2. tune: ``gdngen.tune`` searches the pallas_gpu space with a small Optuna budget at
   T = ``--tune-seq``, B = 1, per head count (every trial behind the validation gate); the
   tuned entries go to ``tuned/<device>.json``;
3. time: forward + backward of the tuned variant (gdngen, ``block_until_ready``, warm-up,
   median; `gdngen.tools.timing.time_fwd_bwd`) and of fla (CUDA events, warm-up, median) at every
   B x T x H of the grid, Hk = Hv = H (fla's layout), with the FLOP count of `gdngen.flops`
   and a minimal-traffic byte count, so the ratio can be read against the roofline.
   Rows go to ``results.json`` / ``results.md`` after every point, fla's to ``fla.json``.

torch and fla are optional (fla from a wheel carried into the run): without them, or without
CUDA, only gdngen is reported. ``--budget-s`` stops the timing grid early (rows so far kept).
``--dry-run`` runs the same steps at toy sizes in Pallas interpret mode, without tuning (a
smoke test of the script; no GPU needed).

    python benchmarks/bench_gpu_vs_fla.py [--out DIR] [--batches 1,2,4,8]
        [--seq-lens 4096,8192,16384,32768] [--heads 16,32] [--trials 6] [--dry-run]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

DIM = 128
DTYPE = "bfloat16"
#: battery cases each candidate is validated on before tuning (near-singular T, hard decay,
#: exact 0/1 gates, a ragged tail).
VALIDATION_CASES = ("identical_keys", "hard_decay", "gates_exact_one_and_zero", "ragged")


def _ints(text: str) -> list[int]:
    values = [int(x) for x in text.split(",") if x.strip()]
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive ints, got {text!r}")
    return values


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "bench_gpu_vs_fla_out"),
                        help="output folder (default: $OUT, else ./bench_gpu_vs_fla_out)")
    parser.add_argument("--batches", type=_ints, default=[1, 2, 4, 8])
    parser.add_argument("--seq-lens", type=_ints, default=[4096, 8192, 16384, 32768])
    parser.add_argument("--heads", type=_ints, default=[16, 32], help="value heads (= key heads)")
    parser.add_argument("--tune-seq", type=int, default=4096)
    parser.add_argument("--precision", choices=("ieee", "tf32", "bf16"), default="bf16",
                        help="least accurate matmul policy the tuner may pick")
    parser.add_argument("--trials", type=int, default=6, help="Optuna trials per head count")
    parser.add_argument("--candidates", type=int, default=8,
                        help="variants validated in step 1 (the default plus an even spread)")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--budget-s", type=float, default=420.0,
                        help="wall seconds for the timing grid; later points are skipped")
    parser.add_argument("--dry-run", action="store_true",
                        help="toy sizes in interpret mode, no tuning, no GPU needed")
    args = parser.parse_args(argv)
    if args.dry_run:
        args.batches, args.seq_lens, args.heads = [1], [64], [2]
        args.repeats, args.warmup, args.candidates = 1, 1, 2
    return args


# ------------------------------------------------------------------------------ counts


def counts(B: int, T: int, H: int, D: int, chunk: int, itemsize: int = 2) -> dict:
    """FLOPs of the chunkwise algorithm (`gdngen.flops`, forward + backward) and the bytes a
    minimal implementation must move: q, k, v, g, beta read by forward and backward, y written
    and dy read, the five input gradients written (activations at ``itemsize``, gates and beta
    float32). ``state_bytes``: the per-chunk float32 states the chunkwise method adds on top
    (entering states written and read back, state cotangents written: three passes)."""
    from gdngen.flops import chunkwise_flops

    activations = B * T * H * D * itemsize
    per_step = B * T * H * 4
    minimal = 3 * activations * 2 + 2 * activations + 3 * activations + 2 * per_step * 3
    states = B * H * (-(-T // chunk)) * D * D * 4
    flops = chunkwise_flops(B, T, H, H, D, D, chunk)
    return {"flops": flops, "bytes": minimal, "state_bytes": 3 * states,
            "intensity": flops / (minimal + 3 * states)}


# ------------------------------------------------------------------------------ steps


def candidates(problem, device: str, limit: int, dry_run: bool):
    """The default variant plus an even spread over the device's space (at most ``limit``)."""
    from gdngen.registry import default_variant, variants

    space = (variants("pallas_gpu", problem, device) if not dry_run
             else [v for v in variants("pallas_gpu", problem, "h200")
                   if v["num_warps"] == 4 and v["num_stages"] == 2])
    default = default_variant("pallas_gpu", problem, device if not dry_run else "h200")
    step = max(1, len(space) // max(1, limit - 1))
    chosen = [default] + [v for v in space[::step] if v != default]
    return chosen[:limit]


def validate_candidates(problem, variants, out: Path, dry_run: bool) -> list[dict]:
    from gdngen.cases import Case
    from gdngen.tools import build

    cases = list(VALIDATION_CASES)
    if dry_run:
        cases = [Case("smoke", "toy: identical keys, initial state", B=1, T=20, Hk=1, Hv=2,
                      Dk=32, Dv=32, chunk_size=16, gates="constant_0.95",
                      beta_range=(1.0, 1.0), identical_keys=True, has_initial_state=True)]
    results = build.build("pallas_gpu", problem, out / "build", cases=cases,
                          variant_list=variants)
    return [{"variant": r.variant.name(), "status": r.status, "lowering": r.lowering,
             "worst": r.worst, "tolerance": r.tolerance} for r in results]


def tune_heads(device: str, problem, args, out: Path):
    from gdngen import tune

    target = tune.Target(device, "jax", "pallas_gpu", problem, args.precision,
                         args.tune_seq, 1)
    settings = tune.Settings(trials=args.trials, repeats=3, confirm_repeats=3,
                             trial_timeout=300.0)
    return tune.tune(target, settings, storage=str(out / "studies.journal"),
                     cache_dir=out / "tuned")


def time_gdngen(variant, problem, B: int, T: int, args) -> dict:
    from gdngen.tools.timing import time_fwd_bwd, variant_fn

    timing = time_fwd_bwd("jax", {"gdngen": variant_fn("jax", variant)}, problem, batch=B,
                          seq_len=T, precision=args.precision, repeats=args.repeats,
                          warmup=args.warmup)["gdngen"]
    return {"median_ms": timing.median_s * 1e3, "first_ms": timing.first_s * 1e3}


def fla_available() -> str | None:
    """None when fla can run here, else why not."""
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "torch sees no CUDA device"
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule  # noqa: F401
    except ImportError as e:
        return f"fla is not importable ({e})"
    return None


def time_fla(B: int, T: int, H: int, D: int, args) -> dict:
    """fla's chunk_gated_delta_rule forward + backward, CUDA-event timing, median."""
    import torch
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    gen = torch.Generator(device="cuda").manual_seed(0)
    dev, bf16 = "cuda", torch.bfloat16

    def randn(*shape):
        return torch.randn(*shape, device=dev, generator=gen)

    q = torch.nn.functional.normalize(randn(B, T, H, D), dim=-1).to(bf16).requires_grad_()
    k = torch.nn.functional.normalize(randn(B, T, H, D), dim=-1).to(bf16).requires_grad_()
    v = randn(B, T, H, D).to(bf16).requires_grad_()
    g = torch.log(torch.empty(B, T, H, device=dev).uniform_(0.9, 0.999, generator=gen))
    g.requires_grad_()
    beta = torch.empty(B, T, H, device=dev).uniform_(0.1, 0.9, generator=gen).to(bf16)
    beta.requires_grad_()
    s0 = (0.1 * randn(B, H, D, D)).requires_grad_()
    dy, ds = randn(B, T, H, D).to(bf16), randn(B, H, D, D)

    def step():
        y, state = chunk_gated_delta_rule(q, k, v, g, beta, scale=D ** -0.5, initial_state=s0,
                                          output_final_state=True)
        torch.autograd.grad([y, state], [q, k, v, g, beta, s0], [dy, ds])

    for _ in range(args.warmup):
        step()
    torch.cuda.synchronize()
    times = []
    for _ in range(args.repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return {"median_ms": statistics.median(times), "times_ms": times}


def write_table(rows: list[dict], out: Path, header: dict) -> None:
    from gdngen.fileio import atomic_write_text

    atomic_write_text(out / "results.json", json.dumps({**header, "rows": rows}, indent=2))
    title = (f"# gdngen pallas_gpu vs fla on {header['device']} "
             f"({DTYPE}, D={header['dim']}, fwd+bwd)")
    lines = [title, "",
             ("| B | T | H | gdngen variant | gdngen ms | fla ms | fla/gdngen | gdngen TFLOP/s "
              "| FLOP/byte |"), "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        fla = r.get("fla_ms")
        fla_ms = "-" if fla is None else f"{fla:.2f}"
        ratio = "-" if fla is None else f"{fla / r['gdngen_ms']:.2f}"
        tflops = r["flops"] / r["gdngen_ms"] / 1e9
        lines.append(f"| {r['B']} | {r['T']} | {r['H']} | {r['variant']} | "
                     f"{r['gdngen_ms']:.2f} | {fla_ms} | {ratio} | {tflops:.1f} | "
                     f"{r['intensity']:.0f} |")
    if header.get("fla_skipped"):
        lines += ["", f"fla not timed: {header['fla_skipped']}"]
    atomic_write_text(out / "results.md", "\n".join(lines) + "\n")


def main(argv=None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    from gdngen import settings

    if args.dry_run:
        os.environ[settings.ENV_INTERPRET] = "1"
    from gdngen import devices
    from gdngen.backends.pallas import gpu as pallas_gpu
    from gdngen.fileio import atomic_write_text
    from gdngen.problem import Problem
    from gdngen.registry import default_variant

    device = devices.detect("jax")
    if device not in ("a100", "h100", "h200") and not args.dry_run:
        print(f"error: needs an NVIDIA a100/h100/h200, jax runs on {device}", file=sys.stderr)
        return 2
    device = "h200" if args.dry_run else device
    dim = 32 if args.dry_run else DIM
    fla_skipped = fla_available()
    header = {"device": device, "dtype": DTYPE, "dim": dim, "precision": args.precision,
              "dry_run": args.dry_run, "fla_skipped": fla_skipped, "validation": {},
              "tuned": {}}
    rows, fla_rows = [], []
    best = {}
    for H in args.heads:
        problem = Problem(H, H, dim, dim, DTYPE)
        header["validation"][H] = validate_candidates(
            problem, candidates(problem, device, args.candidates, args.dry_run), out,
            args.dry_run)
        if args.dry_run:
            best[H] = default_variant("pallas_gpu", problem, "h200")
        else:
            summary = tune_heads(device, problem, args, out)
            header["tuned"][H] = summary.to_json()
            best[H] = summary.best or default_variant("pallas_gpu", problem, device)
        atomic_write_text(out / "results.json", json.dumps({**header, "rows": rows}, indent=2))
    started = time.monotonic()
    for H in args.heads:
        problem = Problem(H, H, dim, dim, DTYPE)
        chunk = pallas_gpu.kernel_params(best[H], problem)["chunk_size"]
        for T in args.seq_lens:
            for B in args.batches:
                if time.monotonic() - started > args.budget_s:
                    header["stopped"] = f"timing budget of {args.budget_s:g} s spent"
                    break
                row = {"B": B, "T": T, "H": H, "variant": best[H].name(),
                       **counts(B, T, H, dim, chunk)}
                row["gdngen_ms"] = time_gdngen(best[H], problem, B, T, args)["median_ms"]
                if fla_skipped is None:
                    fla = time_fla(B, T, H, dim, args)
                    row["fla_ms"] = fla["median_ms"]
                    fla_rows.append({"B": B, "T": T, "H": H, **fla})
                    atomic_write_text(out / "fla.json", json.dumps(fla_rows, indent=2))
                rows.append(row)
                write_table(rows, out, header)
                print(json.dumps(row), flush=True)
    write_table(rows, out, header)
    print(f"wrote {out / 'results.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
