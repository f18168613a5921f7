"""A server's decode step, as a new user times it: one call at T = 1 (and T = 4) with an
incoming state, B = 1, float32, Qwen3-Next's heads (Hk=16, Hv=32, D=128), in a fresh process
without tuned entries (``GDNGEN_NO_TUNED=1`` unless ``--tuned``): median of ``--repeats`` after
two warm calls, each call synchronised (``mx.eval`` / ``block_until_ready``).

Per framework, in one process, interleaved round-robin:

* MLX: ``gdngen.mlx.gated_delta`` and ``load_tuned("mlx")`` called eagerly, against mlx-lm's
  ``gated_delta_ops`` (the per-token ops loop mlx-lm runs without a Metal kernel);
* JAX: ``gdngen.jax.gated_delta`` and ``load_tuned("jax")`` called eagerly, and the plain call
  under the user's own ``jax.jit``, against one jitted ``lax.scan`` step of the textbook
  recurrence (``bench_small_t.textbook_scan``).

Prints ``baseline / call`` (>= 1: gdngen is not slower). Run from the repo root::

    python benchmarks/bench_decode_step.py [--frameworks mlx,jax] [--seq-lens 1,4]
        [--repeats 7] [--tuned] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

HK, HV, D = 16, 32, 128


def inputs(T: int, seed: int = 0):
    from gdngen.problem import Problem
    from gdngen.tools.timing import make_inputs

    arrays = make_inputs(Problem(HK, HV, D, D), 1, T, seed)
    return {n: arrays[n] for n in ("q", "k", "v", "g", "beta", "initial_state")}


def mlx_fns():
    import mlx.core as mx
    from mlx_lm.models.gated_delta import gated_delta_ops

    import gdngen
    from gdngen.mlx import gated_delta

    tuned = gdngen.load_tuned("mlx")
    scale = D ** -0.5

    def call(fn):
        def run(a):
            y, s = fn(a["q"], a["k"], a["v"], a["g"], a["beta"], a["initial_state"],
                      scale=scale)
            mx.eval(y, s)
        return run

    def baseline(a):
        y, s = gated_delta_ops(a["q"] * scale, a["k"], a["v"], mx.exp(a["g"]), a["beta"],
                               a["initial_state"])
        mx.eval(y, s)

    return {"gated_delta": call(gated_delta), "load_tuned": call(tuned),
            "baseline": baseline}, lambda x: mx.array(x)


def jax_fns():
    import jax
    import jax.numpy as jnp
    from bench_small_t import textbook_scan

    import gdngen
    from gdngen.jax import gated_delta

    tuned = gdngen.load_tuned("jax")
    scale = D ** -0.5

    def call(fn):
        def run(a):
            jax.block_until_ready(fn(a["q"], a["k"], a["v"], a["g"], a["beta"],
                                     a["initial_state"], scale=scale))
        return run

    jitted = jax.jit(lambda q, k, v, g, b, s: gated_delta(q, k, v, g, b, s, scale=scale))
    scan = jax.jit(lambda q, k, v, g, b, s: textbook_scan(q, k, v, g, b, s, scale=scale))
    return {"gated_delta": call(gated_delta), "load_tuned": call(tuned),
            "jit(gated_delta)": call(lambda *a, scale: jitted(*a)),
            "baseline": call(lambda *a, scale: scan(*a))}, jnp.asarray


def measure(framework: str, T: int, repeats: int) -> dict:
    fns, to_array = mlx_fns() if framework == "mlx" else jax_fns()
    a = {n: to_array(x) for n, x in inputs(T).items()}
    for fn in fns.values():  # two warm calls each (the first compiles)
        fn(a)
        fn(a)
    times = {n: [] for n in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn(a)
            times[name].append(time.perf_counter() - start)
    ms = {n: statistics.median(t) * 1e3 for n, t in times.items()}
    spread = {n: max(t) / min(t) for n, t in times.items()}
    return {"framework": framework, "T": T, "ms": ms, "spread": spread,
            "baseline_over": {n: ms["baseline"] / ms[n] for n in fns if n != "baseline"}}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--frameworks", default="mlx,jax")
    parser.add_argument("--seq-lens", default="1,4")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--tuned", action="store_true", help="keep the tuned cache")
    parser.add_argument("--json", action="store_true")
    ns = parser.parse_args(argv)
    if not ns.tuned:
        os.environ["GDNGEN_NO_TUNED"] = "1"
    rows = [measure(fw, int(T), ns.repeats) for fw in ns.frameworks.split(",")
            for T in ns.seq_lens.split(",")]
    if ns.json:
        json.dump(rows, sys.stdout, indent=2)
        return 0
    print(f"decode step, B=1 Hk={HK} Hv={HV} D={D} float32, incoming state, median of "
          f"{ns.repeats} after two warm calls (max/min spread in brackets); "
          f"{'tuned cache' if ns.tuned else 'no tuned entries'}")
    for r in rows:
        base = "mlx-lm gated_delta_ops" if r["framework"] == "mlx" else "jitted lax.scan"
        print(f"{r['framework']} T={r['T']}: baseline ({base}) {r['ms']['baseline']:.3f} ms "
              f"[{r['spread']['baseline']:.2f}]")
        for name, ratio in r["baseline_over"].items():
            print(f"    {name:18} {r['ms'][name]:8.3f} ms [{r['spread'][name]:.2f}]  "
                  f"baseline/call {ratio:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
