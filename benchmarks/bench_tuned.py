"""Tuned vs default variant vs sequential baseline at the model presets' shapes.

For each framework, preset and sequence length T this times forward+backward (the gradient of
``sum(y * dy) + sum(final_state * dfinal_state)`` w.r.t. all six inputs) of

* tuned: the variant `gdngen.load_tuned` dispatches to (the tuned cache entry of the attached
  device, this preset's shape class and T's bucket);
* default: the backend's default variant;
* sequential: the baseline of ``gdngen bench`` (``lax.scan`` for JAX, mlx_lm's per-step
  ``gated_delta_ops`` for MLX), skipped above ``--baseline-max-T``;

in one process per framework, interleaved run by run (`gdngen.tools.timing.time_fwd_bwd`), median
of ``--repeats`` after a warm-up. Without ``--seq`` each preset runs at the T buckets the cache
has entries for. The target is tuned >= 1.3x faster than default on at least one preset.

    python benchmarks/bench_tuned.py [--framework jax|mlx|all] [--model qwen3-next ...]
                                     [--seq 1024,2048] [--repeats 5] [--json] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

TARGET_SPEEDUP = 1.3
_TAG = "BENCH_TUNED_ROWS "
ROOT = Path(__file__).resolve().parent.parent


def planned_lengths(framework: str, device: str, preset, seq_lens) -> list[int]:
    """``seq_lens`` if given, else the T buckets tuned for this preset (or [1024])."""
    from gdngen import cache
    from gdngen.registry import runnable

    if seq_lens:
        return list(seq_lens)
    problem = preset.problem()
    backends = runnable(framework, problem, device)
    tuned = sorted({e["seq_bucket"] for e in cache.load(device).entries.values()
                    if e["backend"] in backends and e["problem"] == problem.to_json()
                    and e["precision"] == "ieee"})
    return tuned or [1024]


def measure(framework: str, models, seq_lens, repeats: int, baseline_max_t: int) -> list[dict]:
    """Rows for one framework, measured in this process."""
    from gdngen import devices, dispatch, presets
    from gdngen.shape import CallShape
    from gdngen.tools import timing

    device = devices.detect(framework)
    rows = []
    for name in models:
        preset = presets.get_preset(name)
        problem = preset.problem()
        for T in planned_lengths(framework, device, preset, seq_lens):
            shape = CallShape(1, T, problem.Hk, problem.Hv, problem.Dk, problem.Dv,
                              problem.gate == "vector")
            choice = dispatch.choose(framework, shape, problem.dtype, device=device)
            default = dispatch.default_choice(framework, problem, device)[0]
            fns = {"default": timing.variant_fn(framework, default)}
            if choice.variant != default:
                fns["tuned"] = timing.variant_fn(framework, choice.variant)
            if T <= baseline_max_t:
                fns["sequential"] = timing.sequential_fn(framework)
            print(f"[bench_tuned] {framework} {name} T={T}: {sorted(fns)}", file=sys.stderr,
                  flush=True)
            res = timing.time_fwd_bwd(framework, fns, problem, batch=1, seq_len=T,
                                      repeats=repeats)
            ms = {k: v.median_s * 1e3 for k, v in res.items()}
            tuned_ms = ms.get("tuned", ms["default"])
            rows.append({
                "framework": framework, "device": device, "model": name, "T": T,
                "problem": problem.key(), "tuned_variant": choice.variant.name(),
                "choice": choice.source, "reason": choice.reason, "tuned_ms": tuned_ms,
                "default_ms": ms["default"], "sequential_ms": ms.get("sequential"),
                "tuned_vs_default": ms["default"] / tuned_ms,
                "tuned_vs_sequential": (ms["sequential"] / tuned_ms
                                        if "sequential" in ms else None),
                "repeats": repeats,
                "spread_ms": {k: [round(t * 1e3, 1) for t in v.times_s] for k, v in res.items()},
            })
    return rows


def _in_subprocess(framework: str, ns) -> list[dict]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    cmd = [sys.executable, __file__, "--worker", framework, "--repeats", str(ns.repeats),
           "--baseline-max-T", str(ns.baseline_max_t)]
    for model in ns.model:
        cmd += ["--model", model]
    if ns.seq:
        cmd += ["--seq", ns.seq]
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, env=env, check=False)
    tagged = [ln for ln in proc.stdout.splitlines() if ln.startswith(_TAG)]
    if proc.returncode != 0 or not tagged:
        raise RuntimeError(f"bench_tuned worker for {framework} failed (exit {proc.returncode})")
    return json.loads(tagged[-1][len(_TAG):])


def print_table(rows: list[dict]) -> None:
    from gdngen.tables import render_table

    cells = []
    for r in rows:
        seq = "—" if r["sequential_ms"] is None else f"{r['sequential_ms']:.0f}"
        vs_seq = "—" if r["tuned_vs_sequential"] is None else f"{r['tuned_vs_sequential']:.2f}x"
        variant = r["tuned_variant"] + ("" if r["choice"] == "tuned" else " (default: untuned)")
        cells.append((r["framework"], r["model"], str(r["T"]), variant, f"{r['tuned_ms']:.0f}",
                      f"{r['default_ms']:.0f}", seq, f"{r['tuned_vs_default']:.2f}x", vs_seq))
    print(render_table("tuned vs default vs sequential (fwd+bwd, median ms)",
                       ("framework", "model", "T", "tuned variant", "tuned", "default",
                        "sequential", "tuned/default", "seq/tuned"), cells), end="")


def main(argv=None) -> int:
    from gdngen import presets
    from gdngen.tools import bench

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--framework", choices=["jax", "mlx", "all"], default="all")
    p.add_argument("--model", action="append", choices=sorted(presets.PRESETS))
    p.add_argument("--seq", default=None, help="comma-separated T (default: the tuned buckets)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--baseline-max-T", dest="baseline_max_t", type=int, default=1024)
    p.add_argument("--json", action="store_true")
    p.add_argument("--out", help="also write the rows as JSON to this file (atomically)")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    ns = p.parse_args(argv)
    ns.model = ns.model or ["qwen3-next", "qwen3.5"]
    seq_lens = [int(t) for t in ns.seq.split(",")] if ns.seq else None
    if ns.worker:
        rows = measure(ns.worker, ns.model, seq_lens, ns.repeats, ns.baseline_max_t)
        print(_TAG + json.dumps(rows), flush=True)
        return 0
    frameworks = bench.available_frameworks() if ns.framework == "all" else (ns.framework,)
    rows = [row for fw in frameworks for row in _in_subprocess(fw, ns)]
    if ns.out:
        bench.write_json(rows, ns.out)
    if ns.json:
        print(json.dumps(rows, indent=2))
    else:
        print_table(rows)
    met = [r for r in rows if r["tuned_vs_default"] >= TARGET_SPEEDUP]
    print(f"target tuned >= {TARGET_SPEEDUP}x default: " + (
        "met by " + ", ".join(f"{r['framework']} {r['model']} T={r['T']} "
                              f"({r['tuned_vs_default']:.2f}x)" for r in met)
        if met else "not met"), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
