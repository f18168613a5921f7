"""Decode and short prefill: the forward alone, with an incoming state, at the lengths a
generating model calls (T = 1..64) and at training lengths (T >= 512).

Per framework, every callable runs on the same inputs in one process, interleaved round-robin
(`gdngen.tools.timing.time_forward`: jitted for JAX, eager for MLX as models call it), median of
``--repeats``:

* ``gdngen``: the plain ``gdngen.<framework>.gated_delta`` call (tuned entry, else default);
  its kernel path and crossover come from ``load_tuned().explain``;
* ``chunkwise``: the same variant with ``recurrent_below=0`` (the chunk kernels at every T:
  what every call ran before the recurrent path);
* baseline: JAX a jitted ``lax.scan`` of the textbook step (written here); MLX mlx-lm's own
  ``gated_delta_ops`` (its per-step ops loop).

The table gives ``baseline / gdngen`` and ``chunkwise / gdngen`` (>= 1: gdngen is faster) and
prints each T's chosen path. Run from the repo root::

    python benchmarks/bench_small_t.py [--frameworks jax,mlx] [--seq-lens 1,4,16,64,512]
        [--heads 16,32] [--dim 128] [--repeats 15] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys


def textbook_scan(q, k, v, g, beta, initial_state, *, scale, gate="log"):
    """The recurrence as a user writes it: a ``lax.scan`` over T of the mlx-lm step."""
    import jax
    import jax.numpy as jnp

    assert gate == "log"
    r = v.shape[2] // q.shape[2]
    q, k = (jnp.repeat(x.astype(jnp.float32), r, axis=2) for x in (q, k))

    def step(S, xs):
        q_t, k_t, v_t, g_t, b_t = xs
        S = S * jnp.exp(g_t)[..., None, None]
        kv = jnp.sum(S * k_t[..., None, :], axis=-1)
        S = S + ((v_t - kv) * b_t[..., None])[..., None] * k_t[..., None, :]
        return S, jnp.sum(S * q_t[..., None, :], axis=-1) * scale

    xs = tuple(jnp.swapaxes(x, 0, 1) for x in (q, k, v, g, beta))
    S, y = jax.lax.scan(step, initial_state, xs)
    return jnp.swapaxes(y, 0, 1), S


def mlx_lm_ops(q, k, v, g, beta, initial_state, *, scale, gate="log"):
    import mlx.core as mx
    from mlx_lm.models.gated_delta import gated_delta_ops

    return gated_delta_ops(q * scale, k, v, mx.exp(g), beta, initial_state)


def run(framework: str, problem, seq_lens, repeats: int) -> list[dict]:
    import gdngen
    from gdngen import dispatch
    from gdngen.shape import CallShape
    from gdngen.tools.timing import time_forward, variant_fn

    tuned = gdngen.load_tuned(framework)
    if framework == "jax":
        from gdngen.jax import gated_delta as plain
    else:
        from gdngen.mlx import gated_delta as plain
    baseline = textbook_scan if framework == "jax" else mlx_lm_ops
    rows = []
    for T in seq_lens:
        shape = CallShape(1, T, problem.Hk, problem.Hv, problem.Dk, problem.Dv, False)
        choice = dispatch.choose(framework, shape, problem.dtype, device=tuned.device)
        choice = choice.for_length(T)
        fns = {"gdngen": plain, "chunkwise": variant_fn(
            framework, choice.variant.replace(recurrent_below=0)), "baseline": baseline}
        timings = time_forward(framework, fns, problem, batch=1, seq_len=T, repeats=repeats)
        ms = {n: t.median_s * 1e3 for n, t in timings.items()}
        spread = {n: max(t.times_s) / min(t.times_s) for n, t in timings.items()}
        rows.append({"framework": framework, "T": T, "variant": str(choice.variant),
                     "source": choice.source, "path": choice.kernel_path, "ms": ms,
                     "spread": spread, "baseline_over_gdngen": ms["baseline"] / ms["gdngen"],
                     "chunkwise_over_gdngen": ms["chunkwise"] / ms["gdngen"]})
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--frameworks", default="jax,mlx")
    parser.add_argument("--seq-lens", default="1,4,16,64,512")
    parser.add_argument("--heads", default="16,32", help="Hk,Hv")
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--json", action="store_true")
    ns = parser.parse_args(argv)
    from gdngen.problem import Problem

    hk, hv = (int(x) for x in ns.heads.split(","))
    problem = Problem(hk, hv, ns.dim, ns.dim)
    rows = []
    for framework in ns.frameworks.split(","):
        rows += run(framework, problem, [int(t) for t in ns.seq_lens.split(",")], ns.repeats)
    if ns.json:
        json.dump(rows, sys.stdout, indent=2)
        return 0
    base = {"jax": "lax.scan", "mlx": "mlx-lm ops"}
    print(f"forward with an incoming state, B=1 Hk={hk} Hv={hv} D={ns.dim} float32, median of "
          f"{ns.repeats} (max/min spread in brackets)")
    print(f"{'fw':4} {'T':>5} {'gdngen ms':>14} {'chunkwise ms':>14} {'baseline ms':>14} "
          f"{'base/gdngen':>11} {'chunk/gdngen':>12}  path")
    for r in rows:
        ms, sp = r["ms"], r["spread"]
        print(f"{r['framework']:4} {r['T']:>5} {ms['gdngen']:>8.2f} [{sp['gdngen']:.2f}] "
              f"{ms['chunkwise']:>8.2f} [{sp['chunkwise']:.2f}] {ms['baseline']:>8.2f} "
              f"[{sp['baseline']:.2f}] {r['baseline_over_gdngen']:>10.2f}x "
              f"{r['chunkwise_over_gdngen']:>11.2f}x  {r['path']} ({base[r['framework']]} "
              f"baseline; {r['variant']}, {r['source']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
