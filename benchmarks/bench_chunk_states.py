"""A prefill that keeps a state per ``--every`` tokens for prefix caching
(``return_states="chunks"``) on a backend whose chunk kernels give them (``chunk_states``, e.g.
ffi_cpu), against the same call on the portable path (xla) and against the backend's plain
call (final state only), in one process, interleaved: forward only, as a server prefills.

B = 1, ``--seq`` tokens (default 4096), Qwen3-Next's heads by default (Hk=16, Hv=32, D=128),
float32, median of ``--repeats`` after one warm call. Prints ``other / kernel chunks``. Run
from the repo root::

    python benchmarks/bench_chunk_states.py [--backend ffi_cpu] [--seq 4096] [--every 256]
        [--heads 16,32,128] [--repeats 5] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import numpy as np


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", default="ffi_cpu")
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--every", type=int, default=256)
    parser.add_argument("--heads", default="16,32,128")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)

    import jax
    import jax.numpy as jnp

    from gdngen import registry
    from gdngen.jax import gated_delta
    from gdngen.problem import Problem

    Hk, Hv, D = (int(n) for n in args.heads.split(","))
    T, rng = args.seq, np.random.default_rng(0)
    k = rng.standard_normal((1, T, Hk, D))
    arrays = [jnp.asarray(x, jnp.float32) for x in (
        rng.standard_normal((1, T, Hk, D)), k / np.linalg.norm(k, axis=-1, keepdims=True),
        rng.standard_normal((1, T, Hv, D)), -rng.uniform(0.01, 0.3, (1, T, Hv)),
        rng.uniform(0.1, 1.0, (1, T, Hv)), rng.standard_normal((1, Hv, D, D)))]
    problem = Problem(Hk, Hv, D, D)
    kernel, portable = (registry.default_variant(b, problem) for b in (args.backend, "xla"))
    chunks = {"return_states": "chunks", "checkpoint_every": args.every}
    cases = {
        "kernel chunks": jax.jit(lambda *a: gated_delta(*a, variant=kernel, **chunks)),
        "portable chunks": jax.jit(lambda *a: gated_delta(*a, variant=portable, **chunks)),
        "kernel final only": jax.jit(lambda *a: gated_delta(*a, variant=kernel)),
    }
    times = {name: [] for name in cases}
    for fn in cases.values():
        jax.block_until_ready(fn(*arrays))
    for _ in range(args.repeats):
        for name, fn in cases.items():
            start = time.perf_counter()
            jax.block_until_ready(fn(*arrays))
            times[name].append(time.perf_counter() - start)
    result = {name: {"median_ms": 1e3 * statistics.median(t), "spread": max(t) / min(t)}
              for name, t in times.items()}
    base = result["kernel chunks"]["median_ms"]
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"prefill T={T} keeping a state per {args.every} tokens, Hk={Hk} Hv={Hv} D={D}, "
          f"{args.backend}; median of {args.repeats} (max/min spread in brackets)")
    for name, r in result.items():
        print(f"  {name:18s} {r['median_ms']:9.1f} ms [{r['spread']:.2f}]  "
              f"{r['median_ms'] / base:5.2f}x kernel chunks")
    return 0


if __name__ == "__main__":
    sys.exit(main())
