"""What an untuned user gets: plain ``gdngen.jax.gated_delta`` (no variant, no tuned entry)
against a textbook jnp chunked implementation and against ``lax.scan``, forward + backward.

The textbook implementation is the one a user would write from the GatedDeltaNet paper (fla's
naive ``chunk_gated_delta_rule`` in jnp): in-chunk decays as ``exp`` of differences of the
chunk's cumulative log gates, ``(I + A)^-1`` by ``jax.scipy.linalg.solve_triangular``, C = 64,
the state walked with ``lax.scan`` and the backward left to JAX's autodiff. It is checked
against the float64 reference before it is timed.

All callables are timed in one process on the same inputs, interleaved round-robin
(`gdngen.tools.timing.time_fwd_bwd`; ``--settle``: each timed run preceded by an untimed one of the
same callable), median of ``--repeats``; the table gives each one's ratio to
the plain call from the same run. Run from the repo root::

    python benchmarks/bench_default.py [--seq-lens 2048,4096] [--scan-max-t 2048] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np


def textbook_chunked(q, k, v, g, beta, initial_state, *, scale, gate="log", chunk=64):
    """Chunked gated delta rule in plain jnp (scalar log gates; shapes as gdngen's API)."""
    import jax
    import jax.numpy as jnp
    from jax.scipy.linalg import solve_triangular

    assert gate == "log"
    B, T, Hk, _ = q.shape
    Hv, Dv = v.shape[2], v.shape[3]
    r = Hv // Hk
    pad = -T % chunk
    N = (T + pad) // chunk

    def chunks(x):  # [B, T, H, ...] -> [N, B, H, C, ...]
        x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        x = x.reshape((B, N, chunk) + x.shape[2:])
        return jnp.moveaxis(jnp.moveaxis(x, 1, 0), 2, 3)

    q = jnp.repeat(q.astype(jnp.float32), r, axis=2) * scale
    k = jnp.repeat(k.astype(jnp.float32), r, axis=2)
    qc, kc, vc = chunks(q), chunks(k), chunks(v.astype(jnp.float32))
    gc, bc = chunks(g.astype(jnp.float32)), chunks(beta.astype(jnp.float32))
    G = jnp.cumsum(gc, axis=-1)                                    # [N, B, H, C]
    tril = jnp.tril(jnp.ones((chunk, chunk), bool))
    L = jnp.where(tril, jnp.exp(G[..., :, None] - G[..., None, :]), 0.0)
    A = jnp.where(tril & ~jnp.eye(chunk, dtype=bool),
                  bc[..., :, None] * (kc @ jnp.swapaxes(kc, -1, -2)) * L, 0.0)
    eye = jnp.eye(chunk, dtype=jnp.float32)
    Tinv = solve_triangular(eye + A, jnp.broadcast_to(eye, A.shape), lower=True,
                            unit_diagonal=True)
    U = Tinv @ (vc * bc[..., None])                                 # [N, B, H, C, Dv]
    W = Tinv @ (kc * (bc * jnp.exp(G))[..., None])                  # [N, B, H, C, Dk]
    QK = jnp.where(tril, (qc @ jnp.swapaxes(kc, -1, -2)) * L, 0.0)

    def step(S, xs):  # S [B, H, Dk, Dv]
        q_i, k_i, u_i, w_i, qk_i, G_i = xs
        v_new = u_i - w_i @ S
        y = (q_i * jnp.exp(G_i)[..., None]) @ S + qk_i @ v_new
        tail = jnp.exp(G_i[..., -1:] - G_i)[..., None]
        S = S * jnp.exp(G_i[..., -1])[..., None, None] + jnp.swapaxes(k_i * tail, -1, -2) @ v_new
        return S, y

    S0 = jnp.swapaxes(initial_state.astype(jnp.float32), -1, -2)
    S, Y = jax.lax.scan(step, S0, (qc, kc, U, W, QK, G))
    y = jnp.moveaxis(jnp.moveaxis(Y, 3, 2), 0, 1).reshape(B, N * chunk, Hv, Dv)[:, :T]
    return y.astype(q.dtype), jnp.swapaxes(S, -1, -2)


def check_textbook(problem) -> float:
    """Worst relative error of `textbook_chunked` against the float64 reference (T = 150)."""
    import jax
    import jax.numpy as jnp

    from gdngen.algebra import reference
    from gdngen.tools.timing import make_inputs
    from gdngen.validate import relative_error

    x = make_inputs(problem, 1, 150, seed=1)
    scale = problem.Dk ** -0.5
    names = ("q", "k", "v", "g", "beta", "initial_state")
    args = [jnp.asarray(x[n]) for n in names]
    (y, s), vjp = jax.vjp(lambda *a: textbook_chunked(*a, scale=scale), *args)
    grads = vjp((jnp.asarray(x["dy"]), jnp.asarray(x["dfinal_state"])))
    ref = reference.vjp(*(x[n].astype(np.float64) for n in names), x["dy"], x["dfinal_state"],
                        scale=scale, gate="log")
    got = {"y": y, "final_state": s, **dict(zip(("dq", "dk", "dv", "dg", "dbeta",
                                                   "dinitial_state"), grads))}
    return max(relative_error(np.asarray(got[n]), ref[n]) for n in got)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq-lens", default="2048,4096")
    p.add_argument("--scan-max-t", type=int, default=2048,
                   help="time lax.scan only up to this T (it is slow)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", default="4,8", metavar="HK,HV")
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", action="store_true")
    p.add_argument("--out", help="also write the rows as JSON to this file")
    p.add_argument("--settle", action="store_true",
                   help="an untimed call of each callable before each of its timed runs "
                        "(`gdngen.tools.timing.time_fwd_bwd`)")
    args = p.parse_args(argv)

    import jax.numpy as jnp

    from gdngen.entry import TunedGatedDelta
    from gdngen.jax import gated_delta
    from gdngen.problem import Problem
    from gdngen.tools import timing

    hk, hv = (int(x) for x in args.heads.split(","))
    problem = Problem(hk, hv, args.dim, args.dim)
    worst = check_textbook(problem)
    print(f"[bench_default] textbook chunked vs float64 reference: worst {worst:.1e}",
          file=sys.stderr)
    if worst > 1e-3:
        print("textbook implementation is wrong; not timing it", file=sys.stderr)
        return 1
    rows = []
    for T in (int(t) for t in args.seq_lens.split(",")):
        x = {n: jnp.zeros((args.batch, T) + s, jnp.float32) for n, s in
             (("q", (hk, args.dim)), ("k", (hk, args.dim)), ("v", (hv, args.dim)),
              ("g", (hv,)), ("beta", (hv,)))}
        chosen = TunedGatedDelta("jax", timing_device(), "ieee").explain(
            x["q"], x["k"], x["v"], x["g"], x["beta"])
        fns = {"gdngen default": gated_delta, "textbook chunked": textbook_chunked}
        if T <= args.scan_max_t:
            fns["lax.scan"] = timing.sequential_fn("jax")
        res = timing.time_fwd_bwd("jax", fns, problem, batch=args.batch, seq_len=T,
                                  repeats=args.repeats, settle=args.settle)
        base = res["gdngen default"].median_s
        for name, t in res.items():
            rows.append({"T": T, "callable": name, "median_ms": t.median_s * 1e3,
                         "min_ms": min(t.times_s) * 1e3, "max_ms": max(t.times_s) * 1e3,
                         "ratio_to_default": t.median_s / base,
                         "variant": str(chosen.variant) if name == "gdngen default" else ""})
    if args.out:
        from gdngen.fileio import atomic_write_text

        atomic_write_text(args.out, json.dumps(rows, indent=2) + "\n")
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    from gdngen.tables import render_table

    print(render_table(
        f"fwd+bwd, B={args.batch} Hk={hk} Hv={hv} D={args.dim} float32 (median of "
        f"{args.repeats}, interleaved; ratio = time / gdngen default time)",
        ("T", "callable", "median ms", "min ms", "max ms", "x default", "variant"),
        [(str(r["T"]), r["callable"], f"{r['median_ms']:.1f}", f"{r['min_ms']:.1f}",
          f"{r['max_ms']:.1f}", f"{r['ratio_to_default']:.2f}", r["variant"]) for r in rows]))
    return 0


def timing_device() -> str:
    from gdngen import devices

    return devices.detect("jax")


if __name__ == "__main__":
    sys.exit(main())
