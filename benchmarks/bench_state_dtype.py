"""The error bfloat16 state storage (``state_dtype="bfloat16"``) adds over a long decode.

A decode of ``--steps`` tokens, one ``gdngen.jax.gated_delta`` call per token (T = 1, jitted,
the state stored between steps as a server would), with the state kept in float32 and in
bfloat16, against the float64 reference (`gdngen.algebra.reference.forward` over the whole
sequence). Inputs as a trained layer sees them: unit keys, beta = sigmoid(N(0, 1)), log g =
-U(lo, hi) (``--gates``). Prints the relative L2 error of every step's y and of the final
state, and its growth over the steps. Run from the repo root::

    python benchmarks/bench_state_dtype.py [--steps 4096] [--heads 16,32] [--dim 128]
        [--gates 0.001,0.05] [--json]
"""

from __future__ import annotations

import argparse
import json

import numpy as np


def _inputs(steps, hk, hv, d, gates, seed=0):
    rng = np.random.default_rng(seed)
    k = rng.standard_normal((1, steps, hk, d))
    lo, hi = gates
    return {"q": rng.standard_normal((1, steps, hk, d)).astype(np.float32),
            "k": (k / np.linalg.norm(k, axis=-1, keepdims=True)).astype(np.float32),
            "v": rng.standard_normal((1, steps, hv, d)).astype(np.float32),
            "g": -rng.uniform(lo, hi, (1, steps, hv)).astype(np.float32),
            "beta": (1 / (1 + np.exp(-rng.standard_normal((1, steps, hv))))).astype(
                np.float32)}


def decode(x, state_dtype, scale):
    """Per-step y ``[steps, Hv, Dv]`` and the final state, one jitted T = 1 call a step."""
    import jax
    import jax.numpy as jnp

    from gdngen.jax import gated_delta

    steps, hv, d = x["v"].shape[1], x["v"].shape[2], x["v"].shape[3]

    @jax.jit
    def step(state, q, k, v, g, beta):
        return gated_delta(q, k, v, g, beta, state, scale=scale, state_dtype=state_dtype)

    state = jnp.zeros((1, hv, d, x["q"].shape[3]), jnp.dtype(state_dtype))
    arrays = {n: jnp.asarray(a) for n, a in x.items()}
    ys = []
    for t in range(steps):
        y, state = step(state, *(arrays[n][:, t:t + 1] for n in ("q", "k", "v", "g", "beta")))
        ys.append(y[0, 0])
    return np.asarray(jnp.stack(ys), np.float64), np.asarray(state.astype(jnp.float32),
                                                            np.float64)


def _rel(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=4096)
    p.add_argument("--heads", default="16,32")
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--gates", default="0.001,0.05", help="log g ~ -U(lo, hi)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    from gdngen.algebra import reference

    hk, hv = (int(h) for h in args.heads.split(","))
    gates = tuple(float(g) for g in args.gates.split(","))
    x = _inputs(args.steps, hk, hv, args.dim, gates)
    scale = args.dim ** -0.5
    y_ref, s_ref = reference.forward(x["q"], x["k"], x["v"], x["g"], x["beta"], None,
                                     scale=scale)
    y_ref = y_ref[0]
    rows = {}
    for dtype in ("float32", "bfloat16"):
        y, s = decode(x, dtype, scale)
        marks = [m for m in (64, 512, 1024, 2048, args.steps) if m <= args.steps]
        rows[dtype] = {"y": _rel(y, y_ref), "final_state": _rel(s, s_ref[0]),
                       "y_by_step": {m: _rel(y[m - 1], y_ref[m - 1]) for m in marks}}
    if args.json:
        print(json.dumps({"steps": args.steps, "heads": [hk, hv], "dim": args.dim,
                          "gates": gates, "errors": rows}, indent=1))
        return
    print(f"{args.steps} decode steps, Hk={hk} Hv={hv} D={args.dim}, log g ~ -U{gates}: "
          "relative L2 error against float64")
    for dtype, r in rows.items():
        steps = ", ".join(f"t={m}: {e:.1e}" for m, e in r["y_by_step"].items())
        print(f"  state {dtype:8s}  y (all steps) {r['y']:.2e}  final state "
              f"{r['final_state']:.2e}  y at {steps}")


if __name__ == "__main__":
    main()
