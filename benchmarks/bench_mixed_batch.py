"""A server step's mixed batch: decode rows (one token) and prefill rows as one packed call over
a state pool, against the decode rows and the prefill rows as two calls, both frameworks, in one
process, interleaved.

Lengths ``--lengths`` (default 1,1,300,1,77) over a pool of ``--pool`` states (default 64);
each row reads and writes its own pool row (``state_indices``); forward only, float32, the
default variant of the attached device (eager calls: JAX runs each as one compiled step):

* mixed: ``gated_delta(..., pool, cu_seqlens=all rows, state_indices=all rows)``;
* two calls: the decode rows as B rows of T = 1, then the prefill rows packed, the pool passed
  from the first call to the second.

Median of ``--repeats`` after two warm calls; prints two calls / mixed (>= 1: the mixed call is
not slower). Run from the repo root::

    python benchmarks/bench_mixed_batch.py [--lengths 1,1,300,1,77] [--pool 64] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_pool import _time

HK, HV, D = 4, 8, 128


def _inputs(lengths, pool, seed=0):
    rng = np.random.default_rng(seed)
    T = sum(lengths)
    k = rng.standard_normal((1, T, HK, D))
    x = {"q": rng.standard_normal((1, T, HK, D)),
         "k": k / np.linalg.norm(k, axis=-1, keepdims=True),
         "v": rng.standard_normal((1, T, HV, D)),
         "g": -rng.uniform(0.01, 0.5, (1, T, HV)),
         "beta": rng.uniform(0.1, 0.9, (1, T, HV))}
    x = {n: a.astype(np.float32) for n, a in x.items()}
    x["pool"] = (0.1 * rng.standard_normal((pool, HV, D, D))).astype(np.float32)
    x["rows"] = rng.permutation(pool)[:len(lengths)].astype(np.int32)
    return x


def _split(x, lengths):
    """(decode arrays [B,1,...], their rows), (prefill arrays [1,T',...], cu_seqlens, rows)."""
    cu = np.concatenate([[0], np.cumsum(lengths)])
    decode = [i for i, n in enumerate(lengths) if n == 1]
    prefill = [i for i, n in enumerate(lengths) if n != 1]
    names = ("q", "k", "v", "g", "beta")
    dec = {n: np.concatenate([x[n][:, cu[i]:cu[i + 1]] for i in decode], axis=0)
           for n in names}
    pre = {n: np.concatenate([x[n][:, cu[i]:cu[i + 1]] for i in prefill], axis=1)
           for n in names}
    pre_cu = np.concatenate([[0], np.cumsum([lengths[i] for i in prefill])]).astype(np.int32)
    return (dec, x["rows"][decode]), (pre, pre_cu, x["rows"][prefill])


def run(framework, x, lengths, repeats):
    if framework == "jax":
        import jax.numpy as jnp

        from gdngen.jax import gated_delta as call

        array = jnp.asarray

        def done(out):
            return [o.block_until_ready() for o in out]
    else:
        import mlx.core as mx

        from gdngen.mlx import gated_delta as call

        array = mx.array

        def done(out):
            mx.eval(*out)
            return out
    names = ("q", "k", "v", "g", "beta")
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    (dec, dec_rows), (pre, pre_cu, pre_rows) = _split(x, lengths)
    mixed_args = [array(x[n]) for n in names]
    dec_args, pre_args = [array(dec[n]) for n in names], [array(pre[n]) for n in names]
    cu_a, pre_cu_a = array(cu), array(pre_cu)
    rows, dec_rows, pre_rows = array(x["rows"]), array(dec_rows), array(pre_rows)
    pool = [array(x["pool"])]
    scale = D ** -0.5

    def mixed():
        _, pool[0] = done(call(*mixed_args, pool[0], cu_seqlens=cu_a, state_indices=rows,
                               scale=scale))

    def two_calls():
        _, p = done(call(*dec_args, pool[0], state_indices=dec_rows, scale=scale))
        _, pool[0] = done(call(*pre_args, p, cu_seqlens=pre_cu_a, state_indices=pre_rows,
                               scale=scale))

    return _time({"mixed": mixed, "two calls": two_calls}, repeats)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", default="1,1,300,1,77")
    parser.add_argument("--pool", type=int, default=64)
    parser.add_argument("--frameworks", default="jax,mlx")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--json", action="store_true")
    ns = parser.parse_args(argv)
    lengths = [int(n) for n in ns.lengths.split(",")]
    x = _inputs(lengths, ns.pool)
    results = {}
    for fw in ns.frameworks.split(","):
        timing = run(fw, x, lengths, ns.repeats)
        results[fw] = {"ms": {n: t[0] for n, t in timing.items()},
                       "spread": {n: t[1] for n, t in timing.items()},
                       "two_calls_over_mixed": timing["two calls"][0] / timing["mixed"][0]}
    if ns.json:
        json.dump(results, sys.stdout, indent=2)
        return 0
    print(f"mixed batch, lengths {lengths}, pool of {ns.pool}, Hk={HK} Hv={HV} D={D}, "
          f"forward; median of {ns.repeats} (max/min spread in brackets)")
    for fw, r in results.items():
        print(f"{fw}: two calls / mixed {r['two_calls_over_mixed']:.2f}x")
        for name in ("mixed", "two calls"):
            print(f"    {name:10} {r['ms'][name]:8.2f} ms [{r['spread'][name]:.2f}]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
