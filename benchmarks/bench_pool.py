"""A server's decode step over a state pool: ``state_indices`` against gathering and scattering
the rows by hand around a plain call, both frameworks, in one process, interleaved.

``--rows`` requests (default 32) decode one token each (T = 1) from a pool of ``--pool`` states
(default 256), Qwen3-Next's heads (Hk=16, Hv=32, D=128), float32:

* JAX, both jitted with the pool donated: ``gated_delta(..., pool, state_indices=rows)``
  against ``s = pool[rows]; y, f = gated_delta(..., s); pool.at[rows].set(f)``. Memory: the
  compiled step's own figures (``memory_analysis()``: temporaries, and whether the pool's
  buffer is aliased to the output);
* MLX, eager: the same two forms (``pool[rows] = f`` by hand). Memory: ``mx.get_peak_memory``
  above what was resident before the step.

Median of ``--repeats`` after two warm calls; prints the ratios (by hand / state_indices).
Run from the repo root::

    python benchmarks/bench_pool.py [--rows 32] [--pool 256] [--repeats 15] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import numpy as np

HK, HV, D = 16, 32, 128


def _inputs(rows: int, pool: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    k = rng.standard_normal((rows, 1, HK, D))
    x = {"q": rng.standard_normal((rows, 1, HK, D)),
         "k": k / np.linalg.norm(k, axis=-1, keepdims=True),
         "v": rng.standard_normal((rows, 1, HV, D)),
         "g": -rng.uniform(0.01, 0.5, (rows, 1, HV)),
         "beta": rng.uniform(0.1, 0.9, (rows, 1, HV))}
    x = {n: a.astype(np.float32) for n, a in x.items()}
    x["pool"] = (0.1 * rng.standard_normal((pool, HV, D, D))).astype(np.float32)
    x["rows"] = rng.permutation(pool)[:rows].astype(np.int32)
    return x


def _time(fns: dict, repeats: int) -> dict:
    for fn in fns.values():
        fn()
        fn()
    times = {n: [] for n in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {n: (statistics.median(t) * 1e3, max(t) / min(t)) for n, t in times.items()}


def run_jax(x, repeats):
    import jax
    import jax.numpy as jnp

    from gdngen.jax import gated_delta

    scale = D ** -0.5

    def pooled(pool, rows, q, k, v, g, beta):
        return gated_delta(q, k, v, g, beta, pool, state_indices=rows, scale=scale)

    def by_hand(pool, rows, q, k, v, g, beta):
        y, final = gated_delta(q, k, v, g, beta, pool[rows], scale=scale)
        return y, pool.at[rows].set(final)

    steps = {n: jax.jit(f, donate_argnums=0) for n, f in
             (("state_indices", pooled), ("by hand", by_hand))}
    args = [jnp.asarray(x[n]) for n in ("rows", "q", "k", "v", "g", "beta")]
    pools = {n: jnp.asarray(x["pool"]) for n in steps}
    memory = {}
    for name, step in steps.items():
        compiled = step.lower(pools[name], *args).compile()
        stats = compiled.memory_analysis()
        memory[name] = {"temp_MiB": stats.temp_size_in_bytes / 2 ** 20,
                        "aliased_MiB": stats.alias_size_in_bytes / 2 ** 20}

    def caller(name):
        def fn():
            _, pools[name] = steps[name](pools[name], *args)
            jax.block_until_ready(pools[name])
        return fn

    return _time({n: caller(n) for n in steps}, repeats), memory


def run_mlx(x, repeats):
    import mlx.core as mx

    from gdngen.mlx import gated_delta

    scale = D ** -0.5
    args = [mx.array(x[n]) for n in ("q", "k", "v", "g", "beta")]
    rows = mx.array(x["rows"])
    pools = {"state_indices": mx.array(x["pool"]), "by hand": mx.array(x["pool"])}
    mx.eval(list(pools.values()))

    def pooled():
        y, pools["state_indices"] = gated_delta(*args, pools["state_indices"],
                                                state_indices=rows, scale=scale)
        mx.eval(y, pools["state_indices"])

    def by_hand():
        pool = pools["by hand"]
        y, final = gated_delta(*args, pool[rows], scale=scale)
        pool[rows] = final
        mx.eval(y, pool)

    fns = {"state_indices": pooled, "by hand": by_hand}
    memory = {}
    for name, fn in fns.items():
        fn()
        mx.clear_cache()
        resident = mx.get_active_memory()
        mx.reset_peak_memory()
        fn()
        memory[name] = {"peak_above_resident_MiB": (mx.get_peak_memory() - resident) / 2 ** 20}
    return _time(fns, repeats), memory


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--pool", type=int, default=256)
    parser.add_argument("--frameworks", default="jax,mlx")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--json", action="store_true")
    ns = parser.parse_args(argv)
    x = _inputs(ns.rows, ns.pool)
    results = {}
    for fw in ns.frameworks.split(","):
        timing, memory = (run_jax if fw == "jax" else run_mlx)(x, ns.repeats)
        results[fw] = {"ms": {n: t[0] for n, t in timing.items()},
                       "spread": {n: t[1] for n, t in timing.items()}, "memory": memory,
                       "by_hand_over_state_indices":
                           timing["by hand"][0] / timing["state_indices"][0]}
    if ns.json:
        json.dump(results, sys.stdout, indent=2)
        return 0
    pool_mib = ns.pool * HV * D * D * 4 / 2 ** 20
    print(f"decode step of {ns.rows} rows (T=1) over a pool of {ns.pool} states "
          f"({pool_mib:.0f} MiB float32), Hk={HK} Hv={HV} D={D}; median of {ns.repeats} "
          "(max/min spread in brackets)")
    for fw, r in results.items():
        print(f"{fw}: by hand / state_indices {r['by_hand_over_state_indices']:.2f}x")
        for name in ("state_indices", "by hand"):
            mem = ", ".join(f"{k} {v:.1f}" for k, v in r["memory"][name].items())
            print(f"    {name:14} {r['ms'][name]:8.2f} ms [{r['spread'][name]:.2f}]  {mem}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
