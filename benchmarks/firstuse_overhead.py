"""First-use validation's cost: the first call of a process with an empty verdict folder (the
check included) against the same call with ``GDNGEN_VALIDATE=off`` (each in fresh processes,
alternated), and the steady state: jitted calls at T=1 and T=2048 with a stored passed verdict
against ``off`` (alternated in fresh processes), and `gdngen.firstuse.admitted`'s own cost per
call (what an MLX call, which dispatches per call, pays).

    python benchmarks/firstuse_overhead.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

CHILD = r"""
import json, sys, time
import numpy as np, jax, jax.numpy as jnp
import gdngen.jax
T, reps = int(sys.argv[1]), int(sys.argv[2])
B, Hk, Hv, Dk, Dv = 1, 2, 4, 64, 64
r = np.random.default_rng(0)
k = r.standard_normal((B, T, Hk, Dk)); k /= np.linalg.norm(k, axis=-1, keepdims=True)
a = [jnp.asarray(x, jnp.float32) for x in (r.standard_normal((B, T, Hk, Dk)), k,
     r.standard_normal((B, T, Hv, Dv)), -r.uniform(0.01, 0.5, (B, T, Hv)),
     r.uniform(0, 1, (B, T, Hv)))]
f = jax.jit(gdngen.jax.gated_delta)
t = time.perf_counter(); jax.block_until_ready(f(*a)); first = time.perf_counter() - t
times = []
for _ in range(reps):
    t = time.perf_counter(); jax.block_until_ready(f(*a)); times.append(time.perf_counter() - t)
print(json.dumps({"first_s": first, "median_s": sorted(times)[len(times) // 2]}))
"""


def child(T: int, mode: str, cache: str, reps: int) -> dict:
    env = dict(os.environ, GDNGEN_VALIDATE=mode, GDNGEN_CACHE_DIR=cache, GDNGEN_NO_TUNED="1",
               JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-c", CHILD, str(T), str(reps)], env=env, text=True,
                         capture_output=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def admitted_cost(n: int = 20000) -> float:
    os.environ["GDNGEN_VALIDATE"] = "first-use"
    from gdngen import firstuse, registry
    from gdngen.call import Call
    from gdngen.problem import Problem
    from gdngen.shape import CallShape

    problem = Problem(2, 4, 64, 64, "float32", "scalar")
    call = Call("jax", CallShape(1, 1, 2, 4, 64, 64, False), "float32")
    variant = registry.default_variant("ffi_cpu", problem)
    firstuse._BY_CALL[(variant, call, None, "ieee", "first-use")] = firstuse.Verdict(True, {})
    t = time.perf_counter()
    for _ in range(n):
        firstuse.admitted(call, variant)
    return (time.perf_counter() - t) / n


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    rows = {}
    for T, reps in ((1, 200), (2048, 10)):
        for _ in range(args.repeats):
            for mode in ("first-use", "off"):
                with tempfile.TemporaryDirectory() as cold:  # empty: the check runs
                    rows.setdefault((T, mode, "cold"), []).append(child(T, mode, cold, reps))
    warm = tempfile.mkdtemp()
    child(1, "first-use", warm, 1), child(2048, "first-use", warm, 1)  # verdicts stored
    for T, reps in ((1, 200), (2048, 10)):
        for _ in range(args.repeats):
            for mode in ("first-use", "off"):
                rows.setdefault((T, mode, "warm"), []).append(child(T, mode, warm, reps))
    print("T     mode       cache  first call s (each run)      steady median ms (each run)")
    for (T, mode, cache), runs in sorted(rows.items()):
        first = " ".join(f"{r['first_s']:.2f}" for r in runs)
        steady = " ".join(f"{1e3 * r['median_s']:.3f}" for r in runs)
        print(f"{T:<5} {mode:<10} {cache:<6} {first:<28} {steady}")
    print(f"gdngen.firstuse.admitted, a stored passed verdict: {1e6 * admitted_cost():.2f} us "
          "a call")


if __name__ == "__main__":
    main()
