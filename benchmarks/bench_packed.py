"""Packed sequences: forward+backward of one packed row against one dense call of the same T.

One row of ``--sequences`` documents of mixed lengths (drawn once from ``--seed``: cut points
uniform over the row, so lengths from a few steps to several chunks, boundaries anywhere)
totalling ``--seq-len`` steps, against one dense call of that T (B = 1), per framework, on the
same inputs in one process, timed interleaved (`gdngen.tools.timing.time_fwd_bwd`: the gradient of
``sum(y * dy) + sum(final_state * dfinal_state)`` with respect to q, k, v, g, beta and the
initial state; median of ``--repeats``):

* ``dense``: the plain ``gdngen.<framework>.gated_delta`` call (tuned entry, else the default
  variant: on a CPU host with a compiler JAX's default is the generated ffi_cpu kernels);
* ``dense_portable``: the dense call of the portable backend's default variant (xla / mlx),
  the chunk path the packed row runs on;
* ``packed``: the same arrays with ``cu_seqlens`` and one initial state per sequence, an
  input of its own ``[N, Hv, Dv, Dk]`` as a packed training step has them (the row's initial
  state repeated as data, and its ``dfinal_state`` as every final state's cotangent), so every
  per-sequence initial and final state is computed and differentiated;
* ``packed_no_state``: ``cu_seqlens`` with ``initial_state=None`` (fla's packed training),
  the final states still in the loss;
* ``dense_scalar_gates`` (``--gate vector`` only): the dense call with scalar gates ``[B, T,
  Hv]`` at the same shape, in the same rotation: what per-channel gates cost over scalar ones
  (``vector_over_scalar``).

``--gate vector`` runs per-channel gates ``[B, T, Hv, Dk]`` (Kimi Delta Attention).
Ratios are ``packed / dense`` (<= 1.2 scalar, <= 1.25 per-channel: `TARGETS`): of the
medians, and the median of the ratios within each round (``paired``: the calls of one round
run back to back, so a slow spell of a noisy host weighs on both). Run from the repo root::

    python benchmarks/bench_packed.py [--frameworks jax,mlx] [--seq-len 4096]
        [--sequences 16] [--heads 4,8] [--dim 128] [--gate scalar|vector] [--repeats 5]
        [--json]
"""

from __future__ import annotations

import argparse
import json

import numpy as np

#: issue 37's targets, packed over dense: scalar gates 1.2x, per-channel gates 1.25x
TARGETS = {"scalar": 1.2, "vector": 1.25}


def packed_offsets(seq_len: int, sequences: int, seed: int) -> np.ndarray:
    """``cu_seqlens`` int32 of ``sequences`` non-empty sequences totalling ``seq_len``."""
    if not 1 <= sequences <= seq_len:
        raise ValueError(f"--sequences must be in 1..{seq_len}, got {sequences}")
    rng = np.random.default_rng(seed)
    cuts = np.sort(rng.choice(np.arange(1, seq_len), size=sequences - 1, replace=False))
    return np.concatenate([[0], cuts, [seq_len]]).astype(np.int32)


def _fns(framework: str, problem, offsets: np.ndarray):
    from gdngen import registry
    from gdngen.tools.timing import variant_fn

    if framework == "jax":
        import jax.numpy as jnp

        from gdngen.jax import gated_delta
        cu = jnp.asarray(offsets)
    else:
        import mlx.core as mx

        from gdngen.mlx import gated_delta
        cu = mx.array(offsets)
    portable = registry.default_variant(registry.portable(framework), problem)

    def packed(q, k, v, g, beta, initial_state, *, scale, gate):
        return gated_delta(q, k, v, g, beta, initial_state, scale=scale, gate=gate,
                           cu_seqlens=cu)

    def packed_no_state(q, k, v, g, beta, initial_state, *, scale, gate):
        return gated_delta(q, k, v, g, beta, None, scale=scale, gate=gate, cu_seqlens=cu)

    return {"dense": gated_delta, "dense_portable": variant_fn(framework, portable),
            "packed": packed, "packed_no_state": packed_no_state}


def run(frameworks, seq_len, sequences, heads, dim, repeats, seed, gate="scalar"):
    from gdngen.entry import load_tuned
    from gdngen.problem import Problem
    from gdngen.tools.timing import make_inputs, time_fwd_bwd

    Hk, Hv = heads
    problem = Problem(Hk, Hv, dim, dim, "float32", gate)
    offsets = packed_offsets(seq_len, sequences, seed)
    rows = []
    for framework in frameworks:
        fns = _fns(framework, problem, offsets)
        inputs = make_inputs(problem, 1, seq_len)
        N = len(offsets) - 1  # the packed row's own initial states and their cotangents
        per_sequence = {n: np.repeat(inputs[n], N, axis=0)
                        for n in ("initial_state", "dfinal_state")}
        call_inputs = {"packed": per_sequence}
        if gate == "vector":  # the dense call at scalar gates, same shape and rotation
            fns["dense_scalar_gates"] = fns["dense"]
            call_inputs["dense_scalar_gates"] = {"g": np.ascontiguousarray(inputs["g"][..., 0])}
        timings = time_fwd_bwd(framework, fns, problem, batch=1, seq_len=seq_len,
                               repeats=repeats, settle=True, inputs=inputs,
                               call_inputs=call_inputs)
        medians = {name: t.median_s for name, t in timings.items()}
        dense_times = np.array(timings["dense"].times_s)
        paired = {name: float(np.median(np.array(timings[name].times_s) / dense_times))
                  for name in ("packed", "packed_no_state")}
        spread = max(max(t.times_s) / min(t.times_s) for t in timings.values())
        dense_path = str(load_tuned(framework).explain(
            *_shapes(framework, problem, seq_len), scale=dim ** -0.5, gate="log"))
        if gate == "vector":
            paired["vector_over_scalar"] = float(np.median(
                dense_times / np.array(timings["dense_scalar_gates"].times_s)))
        rows.append({"framework": framework, "gate": gate, "T": seq_len,
                     "lengths": np.diff(offsets).tolist(),
                     "median_s": medians, "max_over_min": spread, "dense_choice": dense_path,
                     "packed_over_dense": medians["packed"] / medians["dense"],
                     "packed_over_dense_portable":
                         medians["packed"] / medians["dense_portable"],
                     "packed_no_state_over_dense": medians["packed_no_state"] / medians["dense"],
                     "packed_over_dense_paired": paired["packed"],
                     "packed_no_state_over_dense_paired": paired["packed_no_state"],
                     **({"vector_over_scalar": medians["dense"]
                         / medians["dense_scalar_gates"],
                         "vector_over_scalar_paired": paired["vector_over_scalar"]}
                        if gate == "vector" else {}),
                     "timings": {n: t.to_json() for n, t in timings.items()}})
    return rows


def _shapes(framework, problem, T):
    """Zero arrays of the dense call's shapes (for `explain`, which reads only shapes)."""
    mod = __import__("jax.numpy" if framework == "jax" else "mlx.core", fromlist=["zeros"])
    return (mod.zeros((1, T, problem.Hk, problem.Dk)), mod.zeros((1, T, problem.Hk, problem.Dk)),
            mod.zeros((1, T, problem.Hv, problem.Dv)),
            mod.zeros((1, T, problem.Hv) + ((problem.Dk,) if problem.gate == "vector" else ())),
            mod.zeros((1, T, problem.Hv)))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--frameworks", default="jax,mlx")
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--sequences", type=int, default=16)
    parser.add_argument("--heads", default="4,8", help="Hk,Hv")
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--gate", choices=("scalar", "vector"), default="scalar",
                        help="vector: per-channel gates [B, T, Hv, Dk] (issue 37's per-channel "
                             "packed target is <= 1.25x)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    heads = tuple(int(h) for h in args.heads.split(","))
    rows = run(args.frameworks.split(","), args.seq_len, args.sequences, heads, args.dim,
               args.repeats, args.seed, args.gate)
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    for row in rows:
        print(f"{row['framework']}  gate={row['gate']}  T={row['T']}  "
              f"{len(row['lengths'])} sequences, lengths {row['lengths']}")
        print(f"  dense: {row['dense_choice']}")
        for name, median in row["median_s"].items():
            print(f"  {name:16s} {median * 1e3:9.1f} ms")
        for key in ("packed_over_dense", "packed_over_dense_paired",
                    "packed_over_dense_portable", "packed_no_state_over_dense",
                    "packed_no_state_over_dense_paired"):
            target = TARGETS[row["gate"]]
            ok = "met" if row[key] <= target else "NOT met"
            print(f"  {key:34s} {row[key]:.3f}  (target <= {target}: {ok})")
        for key in ("vector_over_scalar", "vector_over_scalar_paired"):
            if key in row:  # dense per-channel over dense scalar gates (no target)
                print(f"  {key:34s} {row[key]:.3f}")
        print(f"  noise: worst max/min over repeats {row['max_over_min']:.2f}")


if __name__ == "__main__":
    main()
