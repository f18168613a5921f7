"""The Python steps of ``benchmarks/device/nvidia.sh`` (docs/DEVICE.md); run by that script,
one subcommand per step, each writing its JSON under the script's work folder:

* ``env``: versions, the attached device, whether fla can run;
* ``battery``: the validation battery (`gdngen.validate.check_case`, as ``gdngen validate
  --backend pallas_gpu`` runs it) at each dtype, one case at a time, the JSON rewritten after
  every case so that a time box that runs out keeps what was checked;
* ``tune-args``: the ``gdngen tune`` arguments of a model (the shell passes them on);
* ``offdevice``: ``gdngen`` with the attached-device check relaxed (dry run only: Pallas
  interpret mode on this CPU stands in for the GPU);
* ``compare``: forward and forward+backward times of the tuned variant
  (`gdngen.tools.timing.time_forward` / `time_fwd_bwd`, inputs drawn on the accelerator) against
  fla's ``chunk_gated_delta_rule`` (Qwen3-Next heads) and ``chunk_kda`` (Kimi-Linear heads, per-
  channel gates), CUDA events, at FlashQLA's published H200 shapes, the JSON rewritten after
  every measurement;
* ``summary``: ``results.json`` and ``summary.md`` in ``$OUT`` from whatever the steps left
  (imports no framework: it runs after a step that crashed or ran out of time).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import platform
import statistics
import sys
import time
import traceback
from pathlib import Path

BACKEND = "pallas_gpu"
DTYPE = "bfloat16"
#: matmul policy bound of the tuner: fla's kernels take bfloat16 operands, so may gdngen's
PRECISION = "bf16"
TUNE_SEQ = 4096
#: the models of the run: preset name -> (fla function, its module)
FLA_FUNCTIONS = {"qwen3-next": ("fla.ops.gated_delta_rule", "chunk_gated_delta_rule"),
                 "kimi-linear": ("fla.ops.kda", "chunk_kda")}
#: dry run: toy heads of the same gate kinds, interpret mode (Hk, Hv, D)
DRY_HEADS = {"qwen3-next": (1, 2, 32), "kimi-linear": (2, 2, 32)}
DRY_SEQ = 64

# FlashQLA's published H200 benchmark (github.com/QwenLM/FlashQLA,
# benchmark/benchmark_results_H200.txt: H200, d=128, bf16, torch 2.9.1, fla 0.5.1, CUDA-graph
# timing; "35B/9B/4B TP1" rows, h_qk=16, h_v=32, i.e. Qwen3-Next's heads). Its equal-length
# rows as dense [B, T]: (model, B, T) in the order this run times them (most telling first,
# the timing budget stops the list early), with the published forward ms of FlashQLA and
# fla and, where the table has a one-sequence backward row, the backward ms of both.
# Kimi-Linear has no published row; it is timed at the first shapes for the same comparison.
SHAPES = (("qwen3-next", 1, 4096), ("kimi-linear", 1, 4096), ("qwen3-next", 1, 8192),
          ("qwen3-next", 1, 32768), ("qwen3-next", 8, 4096), ("qwen3-next", 4, 8192),
          ("qwen3-next", 1, 16384), ("kimi-linear", 1, 32768), ("qwen3-next", 4, 2048),
          ("qwen3-next", 8, 1024), ("kimi-linear", 8, 4096))
PUBLISHED = {  # (B, T) -> {"flashqla_fwd", "fla_fwd"[, "flashqla_bwd", "fla_bwd"]} in ms
    (1, 4096): {"flashqla_fwd": 0.173, "fla_fwd": 0.247},
    (1, 8192): {"flashqla_fwd": 0.280, "fla_fwd": 0.472, "flashqla_bwd": 0.789,
                "fla_bwd": 1.444},
    (1, 16384): {"flashqla_fwd": 0.472, "fla_fwd": 0.930},
    (1, 32768): {"flashqla_fwd": 0.877, "fla_fwd": 1.890, "flashqla_bwd": 2.515,
                 "fla_bwd": 5.697},
    (4, 8192): {"flashqla_fwd": 0.611, "fla_fwd": 1.898},
    (8, 4096): {"flashqla_fwd": 0.619, "fla_fwd": 1.914},
    (4, 2048): {"flashqla_fwd": 0.167, "fla_fwd": 0.485},
    (8, 1024): {"flashqla_fwd": 0.178, "fla_fwd": 0.501},
}
PUBLISHED_SOURCE = ("FlashQLA benchmark/benchmark_results_H200.txt (H200, fla 0.5.1, "
                    "CUDA graphs, Hk=16 Hv=32 D=128)")


def problem_of(model: str, dry_run: bool):
    """The `Problem` a model is tuned and timed for (toy heads in a dry run)."""
    from gdngen import presets
    from gdngen.problem import Problem

    if dry_run:
        hk, hv, d = DRY_HEADS[model]
        return Problem(hk, hv, d, d, DTYPE, presets.get_preset(model).gate)
    return presets.get_preset(model).problem(DTYPE)


def tune_args(model: str, dry_run: bool) -> list[str]:
    """``gdngen tune`` arguments for ``model`` (the shell adds budget and folders)."""
    common = ["--backend", BACKEND, "--framework", "jax", "--dtype", DTYPE,
              "--precision", PRECISION]
    if dry_run:
        hk, hv, d = DRY_HEADS[model]
        gate = "vector" if model == "kimi-linear" else "scalar"
        return ["--heads", f"{hk},{hv}", "--dim", f"{d},{d}", "--gate", gate,
                "--seq", str(DRY_SEQ), *common]
    return ["--model", model, "--seq", str(TUNE_SEQ), *common]


def _write(path: Path, data) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str))
    os.replace(tmp, path)


def _read(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


# ------------------------------------------------------------------------------ env


def _version(name: str):
    import importlib.metadata

    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def fla_unavailable(model: str = "qwen3-next") -> str | None:
    """None when fla's kernel for ``model`` can run here, else why not."""
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "torch sees no CUDA device (fla's Triton kernels need one)"
    module, name = FLA_FUNCTIONS[model]
    try:
        getattr(__import__(module, fromlist=[name]), name)
    except Exception as e:  # noqa: BLE001 - ImportError, or fla failing in its own import
        return f"fla is not importable ({type(e).__name__}: {e})"
    return None


def cmd_env(args) -> int:
    info = {"python": sys.version.split()[0], "platform": platform.platform(),
            "dry_run": args.dry_run, "device": args.device,
            "versions": {n: _version(n) for n in (
                "jax", "jaxlib", "jax-cuda13-plugin", "jax-cuda12-plugin", "torch", "triton",
                "optuna", "sqlalchemy", "fla-core", "flash-linear-attention")}}
    try:
        from gdngen import _version as gv
        from gdngen import devices

        info["gdngen"] = gv.__version__
        found = devices.detect_framework("jax")
        info["jax_device"] = {"registry": found.name, "description": found.description}
    except Exception as e:  # noqa: BLE001 - recorded: the run goes on and says why
        info["jax_device"] = {"error": f"{type(e).__name__}: {e}"}
    info["fla"] = {m: fla_unavailable(m) or "ok" for m in FLA_FUNCTIONS}
    _write(Path(args.out), info)
    print(json.dumps(info, indent=2))
    return 0 if "error" not in info["jax_device"] else 1


# ------------------------------------------------------------------------------ battery


def _battery_plan(args):
    """(variant, [(dtype, case name)]): what `gdngen validate --backend pallas_gpu` checks (the
    default variant of its default problem, rendered for each case's shapes) at each dtype."""
    from gdngen import cases as cases_mod
    from gdngen import registry
    from gdngen.problem import Problem

    variant = registry.default_variant(BACKEND, Problem.parse("Hk=2,Hv=4,Dk=128,Dv=128"))
    selected = ([cases_mod.get_case(n) for n in args.cases.split(",")] if args.cases
                else list(cases_mod.BATTERY))
    if "vector" not in registry.get(BACKEND).gates:
        selected = [c for c in selected if not c.vector_gate]
    return variant, [(dtype, c.name) for c in selected for dtype in args.dtypes.split(",")]


def _battery_worker(args, variant, items, out: Path) -> int:
    """Check ``items`` in order until the budget is spent; ``out`` rewritten after each."""
    from gdngen import validate

    deadline = time.monotonic() + args.budget_s
    rows, failed = [], 0
    for dtype, name in items:
        row = {"dtype": dtype, "case": name}
        if time.monotonic() > deadline:
            rows.append({**row, "status": "not run (time budget)"})
            continue
        t0 = time.monotonic()
        try:
            r = validate.check_case(BACKEND, name, dtype=dtype, variant=variant)
            quantity, worst = r.worst
            row.update(status="pass" if r.passed else "FAIL", worst_quantity=quantity,
                       worst=worst, tolerance=r.tolerance, errors=r.errors)
        except Exception as e:  # noqa: BLE001 - a case that cannot run is a result
            row.update(status="ERROR", error=f"{type(e).__name__}: {e}"[:2000])
            traceback.print_exc()
        row["seconds"] = round(time.monotonic() - t0, 2)
        failed += row["status"] in ("FAIL", "ERROR")
        rows.append(row)
        _write(out, rows)
        print(f"{dtype:9s} {name:28s} {row['status']:5s} "
              f"{row.get('worst', float('nan')):.2e} (tol {row.get('tolerance', 0):.0e}) "
              f"{row['seconds']:.1f}s", flush=True)
    _write(out, rows)
    return 1 if failed else 0


def cmd_battery(args) -> int:
    """The battery in ``args.jobs`` processes (the (dtype, case) items dealt round-robin:
    compiling is one core's work per process), merged into ``args.out`` every few seconds."""
    import subprocess

    out = Path(args.out)
    variant, items = _battery_plan(args)
    if args.worker is not None:
        index, jobs = (int(x) for x in args.worker.split("/"))
        return _battery_worker(args, variant, items[index::jobs], out)
    parts = [out.with_name(f"{out.stem}.part{i}.json") for i in range(args.jobs)]
    argv = [sys.executable, __file__, "battery", "--dtypes", args.dtypes,
            "--budget-s", str(args.budget_s)] + (["--cases", args.cases] if args.cases else [])
    procs = [subprocess.Popen(argv + ["--out", str(part), "--worker", f"{i}/{args.jobs}"])
             for i, part in enumerate(parts)]

    def merge() -> None:
        done = {}
        for part in parts:
            for row in _read(part) or []:
                done[row["dtype"], row["case"]] = row
        report = {"backend": BACKEND, "variant": variant.to_json(), "budget_s": args.budget_s,
                  "jobs": args.jobs, "interpret": os.environ.get("GDNGEN_INTERPRET") == "1",
                  "dtypes": {}}
        for dtype, name in items:
            report["dtypes"].setdefault(dtype, []).append(
                done.get((dtype, name), {"dtype": dtype, "case": name, "status": "not run"}))
        _write(out, report)

    while any(p.poll() is None for p in procs):
        merge()
        time.sleep(2)
    merge()
    return max(p.returncode for p in procs)


# ------------------------------------------------------------------------------ offdevice


def cmd_offdevice(args) -> int:
    """``gdngen ARGS`` where the device named need not be attached (dry run only)."""
    import click

    from gdngen import devices
    from gdngen.tools.cli import main

    if os.environ.get("GDNGEN_INTERPRET") != "1":
        print("offdevice is for dry runs (GDNGEN_INTERPRET=1)", file=sys.stderr)
        return 2
    devices.require_attached = lambda name, framework: devices.get_device(name)
    try:
        return main(args.rest, standalone_mode=False) or 0
    except click.ClickException as e:  # as the gdngen command would say it
        e.show()
        return e.exit_code


# ------------------------------------------------------------------------------ compare


def tuned_variant(device: str, problem, tuned_dir: str | None, seq_len: int):
    """(variant, where it came from): the tuned entry of ``problem`` at ``seq_len`` in
    ``tuned_dir``, else the device's default variant."""
    from gdngen import cache, registry
    from gdngen.variant import Variant

    reason = "no tuned folder"
    if tuned_dir and Path(tuned_dir).is_dir():
        found = cache.lookup(device, (BACKEND,), problem, PRECISION, seq_len,
                             dirs=(Path(tuned_dir),))
        if found.entry is not None:
            return Variant.from_json(found.entry["variant"]), "tuned: " + found.reason
        reason = found.reason
    return registry.default_variant(BACKEND, problem, device), f"default ({reason})"


def device_inputs(problem, B: int, T: int, seed: int = 0) -> dict:
    """`gdngen.tools.timing.make_inputs`' arrays, drawn by jax on the default device."""
    import jax
    import jax.numpy as jnp

    keys = jax.random.split(jax.random.PRNGKey(seed), 8)
    Hk, Hv, Dk, Dv = problem.Hk, problem.Hv, problem.Dk, problem.Dv

    def unit(key, shape):
        x = jax.random.normal(key, shape, jnp.float32)
        return x / jnp.linalg.norm(x, axis=-1, keepdims=True)

    gate_shape = (B, T, Hv, Dk) if problem.gate == "vector" else (B, T, Hv)
    return {
        "q": unit(keys[0], (B, T, Hk, Dk)), "k": unit(keys[1], (B, T, Hk, Dk)),
        "v": jax.random.normal(keys[2], (B, T, Hv, Dv)),
        "g": jnp.log(jax.random.uniform(keys[3], gate_shape, minval=0.9, maxval=0.999)),
        "beta": jax.random.uniform(keys[4], (B, T, Hv), minval=0.1, maxval=0.9),
        "initial_state": 0.1 * jax.random.normal(keys[5], (B, Hv, Dv, Dk)),
        "dy": jax.random.normal(keys[6], (B, T, Hv, Dv)),
        "dfinal_state": jax.random.normal(keys[7], (B, Hv, Dv, Dk)),
    }


def time_gdngen(variant, problem, B: int, T: int, repeats: int, warmup: int) -> dict:
    import jax

    from gdngen.tools import timing

    inputs = device_inputs(problem, B, T)
    jax.block_until_ready(inputs)
    fns = {"gdngen": timing.variant_fn("jax", variant)}
    kw = {"batch": B, "seq_len": T, "precision": PRECISION, "repeats": repeats,
          "warmup": warmup, "inputs": inputs}
    fwd = timing.time_forward("jax", fns, problem, **kw)["gdngen"]
    both = timing.time_fwd_bwd("jax", fns, problem, **kw)["gdngen"]
    return {"fwd_ms": fwd.median_s * 1e3, "fwd_bwd_ms": both.median_s * 1e3,
            "fwd_first_s": fwd.first_s, "fwd_bwd_first_s": both.first_s}


def time_fla(model: str, problem, B: int, T: int, repeats: int, warmup: int) -> dict:
    """fla's kernel for ``model``: forward alone (no autograd) and forward + backward of the
    same loss as gdngen's (gradients of q, k, v, g, beta, initial state), CUDA events, median;
    torch's cached blocks are released after (jax allocates beside it)."""
    import torch

    try:
        return _fla_times(model, problem, B, T, repeats, warmup)
    finally:
        torch.cuda.empty_cache()


def _fla_times(model: str, problem, B: int, T: int, repeats: int, warmup: int) -> dict:
    import torch

    module, name = FLA_FUNCTIONS[model]
    fn = getattr(__import__(module, fromlist=[name]), name)
    gen = torch.Generator(device="cuda").manual_seed(0)
    bf16, Hk, Hv, Dk, Dv = torch.bfloat16, problem.Hk, problem.Hv, problem.Dk, problem.Dv

    def randn(*shape):
        return torch.randn(*shape, device="cuda", generator=gen)

    def uniform(lo, hi, *shape):
        return torch.empty(*shape, device="cuda").uniform_(lo, hi, generator=gen)

    norm = torch.nn.functional.normalize
    q = norm(randn(B, T, Hk, Dk), dim=-1).to(bf16)
    k = norm(randn(B, T, Hk, Dk), dim=-1).to(bf16)
    v = randn(B, T, Hv, Dv).to(bf16)
    g = torch.log(uniform(0.9, 0.999, *((B, T, Hv, Dk) if problem.gate == "vector"
                                        else (B, T, Hv))))
    beta = uniform(0.1, 0.9, B, T, Hv).to(bf16)
    s0 = 0.1 * randn(B, Hv, Dk, Dv)
    dy, ds = randn(B, T, Hv, Dv).to(bf16), randn(B, Hv, Dk, Dv)
    leaves = [x.requires_grad_() for x in (q, k, v, g, beta, s0)]

    def call():
        return fn(q, k, v, g, beta, scale=Dk ** -0.5, initial_state=s0,
                  output_final_state=True)

    def forward():
        with torch.no_grad():
            call()

    def forward_backward():
        y, state = call()
        torch.autograd.grad([y, state], leaves, [dy, ds])

    out = {}
    for label, step in (("fwd", forward), ("fwd_bwd", forward_backward)):
        t0 = time.perf_counter()
        for _ in range(warmup):  # the first call runs fla's Triton autotuning
            step()
        torch.cuda.synchronize()
        out[f"{label}_first_s"] = time.perf_counter() - t0
        times = []
        for _ in range(repeats):
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        out[f"{label}_ms"] = statistics.median(times)
    return out


def cmd_compare(args) -> int:
    out = Path(args.out)
    started = time.monotonic()
    models = tuple(FLA_FUNCTIONS)
    report = {"device": args.device, "dtype": DTYPE, "precision": PRECISION,
              "dry_run": args.dry_run, "budget_s": args.budget_s, "variants": {},
              "fla_skipped": {}, "published_source": PUBLISHED_SOURCE,
              "timing": ("gdngen: wall clock around a jitted call and block_until_ready, "
                         "median; fla: CUDA events, median; both after warm-up; the same "
                         "input distributions (gdngen.tools.timing.make_inputs)"),
              "rows": []}
    problems = {m: problem_of(m, args.dry_run) for m in models}
    for m in models:
        variant, source = tuned_variant(args.device, problems[m], args.tuned_dir,
                                        DRY_SEQ if args.dry_run else TUNE_SEQ)
        report["variants"][m] = {"problem": problems[m].to_json(), "variant": variant.to_json(),
                                 "name": variant.name(), "source": source}
        why = ("dry run: fla's kernels are CUDA only, not run" if args.dry_run
               else fla_unavailable(m))
        if why:
            report["fla_skipped"][m] = why
            print(f"fla comparison skipped for {m}: {why}", flush=True)
    _write(out, report)
    shapes = ([(m, 1, DRY_SEQ) for m in models] if args.dry_run else SHAPES)
    errors = 0
    from gdngen.variant import Variant

    for model, B, T in shapes:
        if time.monotonic() - started > args.budget_s:
            report["stopped"] = (f"timing budget of {args.budget_s:g} s spent before "
                                 f"{model} B={B} T={T}")
            print(report["stopped"], flush=True)
            break
        problem = problems[model]
        variant = Variant.from_json(report["variants"][model]["variant"])
        row = {"model": model, "B": B, "T": T, "Hk": problem.Hk, "Hv": problem.Hv,
               "D": problem.Dk, "variant": variant.name()}
        if not args.dry_run and model == "qwen3-next":
            row["published"] = PUBLISHED.get((B, T))
        report["rows"].append(row)
        measure = (("gdngen", functools.partial(time_gdngen, variant, problem, B, T,
                                                 args.repeats, args.warmup)),
                   ("fla", functools.partial(time_fla, model, problem, B, T, args.repeats,
                                             args.warmup)))
        for who, run in measure:
            if who == "fla" and model in report["fla_skipped"]:
                continue
            try:
                row[who] = run()
            except Exception as e:  # noqa: BLE001 - recorded; the next measurement runs
                errors += 1
                row[who] = {"error": f"{type(e).__name__}: {e}"[:2000]}
                traceback.print_exc()
            _write(out, report)
        print(json.dumps(row), flush=True)
    _write(out, report)
    return 1 if errors else 0


# ------------------------------------------------------------------------------ summary


def _ms(x) -> str:
    return "-" if x is None else f"{x:.3f}"


def _ratio(a, b) -> str:
    return "-" if not a or not b else f"{a / b:.2f}"


def summarize(work: Path, out: Path) -> dict:
    """``out/results.json`` and ``out/summary.md`` from the step files in ``work``."""
    steps = []
    log = work / "steps.jsonl"
    if log.exists():
        for line in log.read_text().splitlines():
            with contextlib.suppress(ValueError):  # a line cut short by a killed step
                steps.append(json.loads(line))
    results = {"steps": steps, "env": _read(work / "env.json"),
               "battery": _read(work / "battery.json"), "tuned": _read(work / "tuned.json"),
               "compare": _read(work / "compare.json")}
    _write(out / "results.json", results)
    env = results["env"] or {}
    lines = [f"# gdngen device run on {env.get('device', '?')}"
             + (" (DRY RUN: CPU, Pallas interpret mode, toy sizes)" if env.get("dry_run")
                else ""), ""]
    if env:
        v = env.get("versions", {})
        lines += [(f"Python {env.get('python')}, gdngen {env.get('gdngen')}, "
                   f"jax {v.get('jax')}, torch {v.get('torch')}, triton {v.get('triton')}, "
                   f"fla-core {v.get('fla-core')}, optuna {v.get('optuna')}; "
                   f"jax device: {env.get('jax_device')}"), ""]
    lines += ["## Steps", "", "| step | status | seconds | box s |", "|---|---|---|---|"]
    for s in steps:
        status = ("ok" if s["rc"] == 0 else "TIMED OUT" if s.get("timed_out")
                  else "skipped" if s["rc"] is None else f"FAILED (rc {s['rc']})")
        lines.append(f"| {s['step']} | {status}{': ' + s['note'] if s.get('note') else ''} | "
                     f"{s.get('seconds', '-')} | {s.get('box_s', '-')} |")
    battery = results["battery"]
    if battery:
        lines += ["", (f"## Battery ({battery['backend']}, "
                       f"{'interpret mode' if battery.get('interpret') else 'Triton on the GPU'}"
                       ", default variant, float64 reference)"), "",
                  "| dtype | passed | failed | not run | worst (case, quantity) |",
                  "|---|---|---|---|---|"]
        for dtype, rows in battery["dtypes"].items():
            run = [r for r in rows if "worst" in r or r["status"] == "ERROR"]
            bad = [r["case"] for r in rows if r["status"] in ("FAIL", "ERROR")]
            worst = max((r for r in run if "worst" in r), key=lambda r: r["worst"],
                        default=None)
            worst_txt = ("-" if worst is None else
                         f"{worst['worst']:.2e} ({worst['case']}, {worst['worst_quantity']}; "
                         f"tol {worst['tolerance']:.0e})")
            lines.append(f"| {dtype} | {len(run) - len(bad)} | {len(bad)}"
                         f"{' (' + ', '.join(bad) + ')' if bad else ''} | "
                         f"{len(rows) - len(run)} | {worst_txt} |")
    tuned = results["tuned"]
    if tuned:
        lines += ["", "## Tuned entries", "",
                  ("| problem | variant | best ms | default ms | speedup | "
                   "trials run/failed/infeasible | worst err |"),
                  "|---|---|---|---|---|---|---|"]
        for _, e in sorted(tuned.get("entries", {}).items()):
            p = e["problem"]
            params = ", ".join(f"{k}={v}" for k, v in sorted(e["variant"]["params"].items()))
            t = e.get("trials") or {}
            lines.append(f"| Hk={p['Hk']} Hv={p['Hv']} D={p['Dk']} {p['gate']} T={e['seq_len']}"
                         f" | {params} | {_ms(e['best_ms'])} | {_ms(e['default_ms'])} | "
                         f"{e['speedup']:.2f} | {t.get('run', 0)}/{t.get('failed', 0)}/"
                         f"{t.get('infeasible', 0)} | "
                         f"{e.get('worst_error', 0):.1e} |")
    compare = results["compare"]
    if compare:
        lines += ["", f"## gdngen vs fla ({compare['dtype']}, times in ms, medians)", "",
                  ("| model | B | T | gdngen fwd | fla fwd | fla/gdngen | gdngen fwd+bwd | "
                   "fla fwd+bwd | fla/gdngen | published fwd FlashQLA / fla |"),
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for r in compare["rows"]:
            g, f = r.get("gdngen") or {}, r.get("fla") or {}
            pub = r.get("published") or {}
            lines.append(
                f"| {r['model']} | {r['B']} | {r['T']} | {g.get('error', _ms(g.get('fwd_ms')))}"
                f" | {f.get('error', _ms(f.get('fwd_ms')))} | "
                f"{_ratio(f.get('fwd_ms'), g.get('fwd_ms'))} | {_ms(g.get('fwd_bwd_ms'))} | "
                f"{_ms(f.get('fwd_bwd_ms'))} | {_ratio(f.get('fwd_bwd_ms'), g.get('fwd_bwd_ms'))}"
                f" | {_ms(pub.get('flashqla_fwd'))} / {_ms(pub.get('fla_fwd'))} |")
        for m, v in compare.get("variants", {}).items():
            lines.append(f"\n{m}: {v['name']} ({v['source']})")
        for m, why in compare.get("fla_skipped", {}).items():
            lines.append(f"\nfla not timed for {m}: {why}")
        if compare.get("stopped"):
            lines.append(f"\n{compare['stopped']}")
        lines.append(f"\nTiming: {compare['timing']}. Published column: "
                     f"{compare['published_source']}.")
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    return results


def cmd_summary(args) -> int:
    work, out = Path(args.work), Path(args.out)
    tuned_dir = Path(args.tuned_dir) if args.tuned_dir else None
    if tuned_dir is not None and (tuned_dir / f"{args.device}.json").exists():
        data = _read(tuned_dir / f"{args.device}.json")
        if isinstance(data, dict):
            _write(work / "tuned.json", {"file": f"{args.device}.json",
                                         "entries": data.get("entries", data)})
    summarize(work, out)
    print((out / "summary.md").read_text())
    return 0


def cmd_record(args) -> int:
    """Append one step's outcome to ``steps.jsonl``."""
    rc = None if args.rc == "skipped" else int(args.rc)
    entry = {"step": args.step, "rc": rc, "timed_out": rc in (124, 137),
             "seconds": args.seconds, "box_s": args.box, "note": args.note or ""}
    with open(Path(args.work) / "steps.jsonl", "a") as f:
        f.write(json.dumps(entry) + "\n")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("env")
    p.add_argument("--out", required=True)
    p.add_argument("--device", required=True)
    p.add_argument("--dry-run", action="store_true")
    p = sub.add_parser("battery")
    p.add_argument("--out", required=True)
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--cases", default=None, help="comma-separated (default: the battery)")
    p.add_argument("--budget-s", type=float, default=150.0)
    p.add_argument("--jobs", type=int, default=4, help="processes sharing the items")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # I/N: one of --jobs
    p = sub.add_parser("tune-args")
    p.add_argument("model", choices=sorted(FLA_FUNCTIONS))
    p.add_argument("--dry-run", action="store_true")
    p = sub.add_parser("offdevice")
    p.add_argument("rest", nargs=argparse.REMAINDER)
    p = sub.add_parser("compare")
    p.add_argument("--out", required=True)
    p.add_argument("--device", required=True)
    p.add_argument("--tuned-dir", default=None)
    p.add_argument("--budget-s", type=float, default=110.0)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--dry-run", action="store_true")
    p = sub.add_parser("summary")
    p.add_argument("--work", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--device", required=True)
    p.add_argument("--tuned-dir", default=None)
    p = sub.add_parser("record")
    p.add_argument("--work", required=True)
    p.add_argument("--step", required=True)
    p.add_argument("--rc", required=True)
    p.add_argument("--seconds", type=float, default=None)
    p.add_argument("--box", type=float, default=None)
    p.add_argument("--note", default="")
    args = parser.parse_args(argv)
    if args.cmd == "tune-args":
        print(" ".join(tune_args(args.model, args.dry_run)))
        return 0
    return {"env": cmd_env, "battery": cmd_battery, "offdevice": cmd_offdevice,
            "compare": cmd_compare, "summary": cmd_summary, "record": cmd_record}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
