"""Accuracy of the serving outputs against the float64 reference, on every backend that runs
here (the generated ones in interpret mode / the Metal simulator off-device), outputs poisoned
(``GDNGEN_POISON_OUTPUTS=1``), fresh random inputs, scalar and per-channel gates:

* ``pool``: ``state_indices`` over a pool (decode rows, T = 1 and a short prefill T = 7, one
  padding row): y and the written rows (the untouched rows must come back bit for bit);
* ``output rows``: ``output_state_indices`` (rows read and rows written apart, one padding row
  each way): y and the written rows (every other row must come back bit for bit);
* ``mixed batch``: a server step's decode and prefill rows (lengths 1, 1, 300, 1, 77) as one
  packed row (``cu_seqlens``) over a pool of 64: y and the written rows;
* ``steps``: ``return_states="steps"`` over a verify window of 8 steps (one masked, one reset):
  y and the state after every step;
* ``chunks``: ``return_states="chunks", checkpoint_every=<the variant's chunk>`` over three
  chunks and a tail: y and the checkpointed states;
* ``bf16 state``: ``state_dtype="bfloat16"`` with a pool: the returned rows against float64
  from the same (bfloat16-rounded) starting rows: bfloat16's own resolution, not an error of
  the kernels.

Prints the worst relative L2 error (`gdngen.validate.relative_error`) per backend and output.
Run from the repo root::

    python benchmarks/accuracy_serving.py [--backends xla,mlx,...] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

os.environ.setdefault("GDNGEN_POISON_OUTPUTS", "1")

HK, HV, DK, DV, P = 2, 4, 32, 32, 8


def _inputs(rng, B, T, vector, reset=None, masked=None):
    k = rng.standard_normal((B, T, HK, DK))
    g = -rng.uniform(0.02, 0.6, (B, T, HV, DK) if vector else (B, T, HV))
    if reset is not None:
        g[reset] = -np.inf
    mask = np.ones((B, T), bool)
    if masked is not None:
        mask[masked] = False
    return {"q": rng.standard_normal((B, T, HK, DK)).astype(np.float32),
            "k": (k / np.linalg.norm(k, axis=-1, keepdims=True)).astype(np.float32),
            "v": rng.standard_normal((B, T, HV, DV)).astype(np.float32),
            "g": g.astype(np.float32), "beta": rng.uniform(0.1, 1.0, (B, T, HV)).astype(np.float32),
            "mask": mask}


def _entry(framework):
    if framework == "jax":
        import jax.numpy as jnp

        from gdngen.jax import gated_delta
        return gated_delta, jnp.asarray, np.asarray
    import mlx.core as mx

    from gdngen.mlx import gated_delta
    return gated_delta, mx.array, lambda x: np.array(x.astype(mx.float32))


def _to_float32(numpy, x):
    return np.asarray(numpy(x), np.float32)


def measure(backend: str, gate: str, seed: int = 0) -> dict:
    """``{output: worst relative error}`` of ``backend`` at ``gate`` ("scalar" | "vector")."""
    from gdngen import registry
    from gdngen.algebra import reference
    from gdngen.problem import Problem
    from gdngen.validate import relative_error

    spec = registry.get(backend)
    problem = Problem(HK, HV, DK, DV, gate=gate)
    variant = registry.default_variant(backend, problem)
    gated_delta, array, numpy = _entry(spec.framework)
    rng = np.random.default_rng(seed)
    vector, scale = gate == "vector", DK ** -0.5
    names = ("q", "k", "v", "g", "beta")
    out = {}

    # pool: decode and a short prefill, a padding row
    worst = 0.0
    for T in (1, 7):
        x = _inputs(rng, 3, T, vector)
        pool = rng.standard_normal((P, HV, DV, DK)).astype(np.float32)
        idx = np.array([5, -1, 2], np.int32)
        y, got = gated_delta(*(array(x[n]) for n in names), array(pool),
                             state_indices=array(idx), scale=scale, variant=variant)
        starts = np.stack([pool[i] if i >= 0 else np.zeros_like(pool[0]) for i in idx])
        y_ref, final = reference.forward(*(x[n] for n in names), starts, scale=scale)
        got = _to_float32(numpy, got)
        untouched = [i for i in range(P) if i not in (5, 2)]
        if not np.array_equal(got[untouched], pool[untouched]):
            raise AssertionError(f"{backend}: untouched pool rows changed")
        worst = max(worst, relative_error(numpy(y), y_ref),
                    relative_error(got[[5, 2]], final[[0, 2]]))
    out["pool"] = worst

    # output rows: read rows 5, (zero), 2, 4; write rows 1, 3, (nothing), 5
    x = _inputs(rng, 4, 3, vector)
    pool = rng.standard_normal((P, HV, DV, DK)).astype(np.float32)
    idx, written = np.array([5, -1, 2, 4], np.int32), np.array([1, 3, -1, 5], np.int32)
    y, got = gated_delta(*(array(x[n]) for n in names), array(pool), state_indices=array(idx),
                         output_state_indices=array(written), scale=scale, variant=variant)
    starts = np.stack([pool[i] if i >= 0 else np.zeros_like(pool[0]) for i in idx])
    y_ref, final = reference.forward(*(x[n] for n in names), starts, scale=scale)
    got = _to_float32(numpy, got)
    kept = [i for i in range(P) if i not in (1, 3, 5)]
    if not np.array_equal(got[kept], pool[kept]):
        raise AssertionError(f"{backend}: pool rows outside output_state_indices changed")
    out["output rows"] = max(relative_error(numpy(y), y_ref),
                             relative_error(got[[1, 3, 5]], final[[0, 1, 3]]))

    # a server's mixed batch: decode and prefill rows as one packed row over the pool
    lengths = (1, 1, 300, 1, 77)
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    x = _inputs(rng, 1, int(cu[-1]), vector)
    pool = rng.standard_normal((64, HV, DV, DK)).astype(np.float32)
    idx = np.array([7, 0, -1, 33, 12], np.int32)
    y, got = gated_delta(*(array(x[n]) for n in names), array(pool), state_indices=array(idx),
                         cu_seqlens=array(cu), scale=scale, variant=variant)
    starts = np.stack([pool[i] if i >= 0 else np.zeros_like(pool[0]) for i in idx])
    ref = reference.packed_vjp(*(x[n] for n in names), starts, None, None, cu, scale=scale)
    got, live = _to_float32(numpy, got), [b for b, i in enumerate(idx) if i >= 0]
    out["mixed batch"] = max(relative_error(numpy(y), ref["y"]),
                             relative_error(got[idx[live]], ref["final_state"][live]))

    # steps: a verify window with a masked step and an exact reset
    T = 8
    x = _inputs(rng, 2, T, vector, reset=(0, 3), masked=(1, 5))
    s0 = rng.standard_normal((2, HV, DV, DK)).astype(np.float32)
    y, states = gated_delta(*(array(x[n]) for n in names), array(s0), mask=array(x["mask"]),
                            scale=scale, variant=variant, return_states="steps")
    y_ref, _ = reference.forward(*(x[n] for n in names), s0, mask=x["mask"], scale=scale)
    states = _to_float32(numpy, states)
    worst = relative_error(numpy(y), y_ref)
    for t in range(T):
        _, ref = reference.forward(*(x[n][:, :t + 1] for n in names), s0,
                                   mask=x["mask"][:, :t + 1], scale=scale)
        worst = max(worst, relative_error(states[:, t], ref))
    out["steps"] = worst

    # chunks: three chunks and a tail, a checkpoint per chunk
    C = int(variant.get("chunk_size") or 64)
    T = 3 * C + 5
    x = _inputs(rng, 1, T, vector)
    s0 = rng.standard_normal((1, HV, DV, DK)).astype(np.float32)
    y, states = gated_delta(*(array(x[n]) for n in names), array(s0), scale=scale,
                            variant=variant, return_states="chunks", checkpoint_every=C)
    y_ref, _ = reference.forward(*(x[n] for n in names), s0, scale=scale)
    states = _to_float32(numpy, states)
    worst = relative_error(numpy(y), y_ref)
    for i, t in enumerate([C, 2 * C, 3 * C, T]):
        _, ref = reference.forward(*(x[n][:, :t] for n in names), s0, scale=scale)
        worst = max(worst, relative_error(states[:, i], ref))
    out["chunks"] = worst

    # bfloat16 storage of a pool
    x = _inputs(rng, 3, 1, vector)
    pool = rng.standard_normal((P, HV, DV, DK)).astype(np.float32)
    idx = np.array([1, 6, 3], np.int32)
    stored = array(pool).astype(_bf16(spec.framework))
    rounded = _to_float32(numpy, stored)  # before the call: MLX updates the pool in place
    _, got = gated_delta(*(array(x[n]) for n in names), stored, state_indices=array(idx),
                         scale=scale, variant=variant, state_dtype="bfloat16")
    _, final = reference.forward(*(x[n] for n in names), rounded[idx], scale=scale)
    out["bf16 state"] = relative_error(_to_float32(numpy, got)[idx], final)
    return out


def _bf16(framework):
    if framework == "jax":
        import jax.numpy as jnp
        return jnp.bfloat16
    import mlx.core as mx
    return mx.bfloat16


def main(argv=None) -> int:
    import warnings

    from gdngen import registry
    from gdngen.problem import Problem

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backends", default=",".join(registry.names()))
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    warnings.simplefilter("ignore", RuntimeWarning)  # interpret-mode notices
    results = {}
    for backend in args.backends.split(","):
        for gate in ("scalar", "vector"):
            ok, why = registry.get(backend).capability(Problem(HK, HV, DK, DV, gate=gate))
            if not ok:
                results[f"{backend} {gate}"] = {"skipped": why}
                continue
            results[f"{backend} {gate}"] = measure(backend, gate)
    if args.json:
        print(json.dumps(results, indent=2))
        return 0
    columns = ("pool", "output rows", "mixed batch", "steps", "chunks", "bf16 state")
    print(f"worst relative error vs float64 (Hk={HK} Hv={HV} D={DK}, outputs poisoned)")
    print(f"{'backend gate':22s}" + "".join(f"{c:>13s}" for c in columns))
    for name, row in results.items():
        if "skipped" in row:
            print(f"{name:22s}  skipped: {row['skipped']}")
            continue
        print(f"{name:22s}" + "".join(f"{row[c]:13.2e}" for c in columns))
    return 0


if __name__ == "__main__":
    sys.exit(main())
