"""Per-channel ("vector") gates: forward+backward of gdngen against what a user writes without
it, and, for MLX, the peak memory of each.

The recurrence (mlx-lm convention), per value head h reading key head h // (Hv/Hk), with the
gate g = log a_t of shape ``[B,T,Hv,Dk]``::

    S_t = S_{t-1} diag(a_t) + beta_t (v_t - S_{t-1} diag(a_t) k_t) k_t^T,   y_t = scale S_t q_t

What is timed is the gradient of ``sum(y * dy) + sum(final_state * dfinal_state)`` with respect
to q, k, v, g, beta and initial_state (``scale = Dk ** -0.5``, B=1, float32). Per framework and
T, every callable runs on the same inputs in one process: each is warmed up (compiled), then
the timed runs are interleaved round-robin (`gdngen.tools.timing._interleaved`, the grad callables
of `gdngen.tools.timing.time_fwd_bwd`), by default each right after an untimed "settle" run of the
same callable (``--no-settle`` drops it), median of ``--repeats``:

* ``gdngen``: the plain ``gdngen.<framework>.gated_delta`` call (tuned entry, else default);
  each row prints the kernel path ``load_tuned().explain``'s dispatch names for it;
* JAX ``scan``: a jitted ``lax.scan`` of the textbook per-channel step (`textbook_scan`),
  autodiff backward; only at T <= ``--baseline-max-T``;
* JAX ``chunked``: the textbook chunked (WY / UT-transform) form in plain jnp, as a user writes
  it after fla's ``naive_chunk_kda`` (`textbook_chunked`): chunk 64, per-chunk cumulative log
  gate per channel, the intra-chunk decays ``exp(Gamma_i - Gamma_j)`` as a masked
  ``[C, C, Dk]`` tensor, the triangular solve by ``jax.scipy.linalg.solve_triangular``, the
  inter-chunk state carried by ``lax.scan``, jax autodiff for the backward, jitted. Both JAX
  baselines are checked against the float64 `gdngen.algebra.reference` (`check_baseline`, also a
  test in tests/test_bench.py) before anything is timed;
* MLX ``mlx-lm``: mlx-lm's own ``gated_delta_ops`` (its per-step ops loop; given ``exp(g)``
  ``[B,T,Hv,Dk]`` and ``q * scale``; it repeats q, k to the value heads itself), ``mx.grad``
  backward; only at T <= ``--baseline-max-T``.

MLX peak memory is measured in a separate phase after the timing: per callable, caches
cleared, ``mx.reset_peak_memory()``, one fwd+bwd, ``mx.get_peak_memory()``. It is reported as
the peak (inputs, cotangents and gradients included) and as the peak above what was resident
before the call.

Ratios are ``baseline / gdngen`` (>= 1: gdngen is faster / smaller); the targets of issue 14
are printed with whether each was met. Run from the repo root::

    python benchmarks/bench_vector_gate.py [--frameworks jax,mlx] [--seq-lens 2048,4096]
        [--heads 4,8] [--dim 128] [--repeats 5] [--baseline-max-T 2048] [--no-settle]
        [--skip-check] [--json]

Without ``--seq-lens`` JAX runs T=2048,4096 and MLX T=2048.
"""

from __future__ import annotations

import argparse
import json
import sys

DEFAULT_SEQ_LENS = {"jax": (2048, 4096), "mlx": (2048,)}
CHUNK = 64
# (framework, baseline, T, minimum ratio, "time" | "memory"): what issue 14 must show
TARGETS = (("jax", "scan", 2048, 10.0, "time"), ("jax", "chunked", 4096, 2.0, "time"),
           ("mlx", "mlx-lm", 2048, 5.0, "time"), ("mlx", "mlx-lm", 2048, 8.0, "memory"))


def _expand_heads(q, k, v):
    """q, k ``[B,T,Hk,Dk]`` repeated to the value heads (value head h reads key head h // r)."""
    import jax.numpy as jnp

    r = v.shape[2] // q.shape[2]
    return (jnp.repeat(x.astype(jnp.float32), r, axis=2) for x in (q, k))


def textbook_scan(q, k, v, g, beta, initial_state, *, scale, gate="log"):
    """The per-channel recurrence as a user writes it: a ``lax.scan`` over T of the step."""
    import jax
    import jax.numpy as jnp

    assert gate == "log"
    q, k = _expand_heads(q, k, v)

    def step(S, xs):
        q_t, k_t, v_t, g_t, b_t = xs
        S = S * jnp.exp(g_t)[..., None, :]  # S diag(a_t): column d of S scaled by a_t[d]
        kv = jnp.sum(S * k_t[..., None, :], axis=-1)
        S = S + ((v_t - kv) * b_t[..., None])[..., None] * k_t[..., None, :]
        return S, jnp.sum(S * q_t[..., None, :], axis=-1) * scale

    xs = tuple(jnp.swapaxes(x, 0, 1) for x in (q, k, v, g, beta))
    S, y = jax.lax.scan(step, initial_state, xs)
    return jnp.swapaxes(y, 0, 1), S


def textbook_chunked(q, k, v, g, beta, initial_state, *, scale, gate="log", chunk_size=CHUNK):
    """The chunked WY form of the per-channel recurrence in plain jnp (autodiff backward).

    Per chunk of C steps with ``Gamma_i = sum_{s <= i} g_s`` (per channel, from the chunk's
    start) and S0 the state entering it, the deltas ``delta_i = beta_i (v_i - S_{i-1} diag(a_i)
    k_i)`` solve ``(I + diag(beta) A) Delta = diag(beta) (V - (exp(Gamma) * K) S0^T)`` with
    ``A_ij = sum_d k_i[d] k_j[d] exp(Gamma_i[d] - Gamma_j[d])`` for j < i (unit lower triangular:
    inverted by fla's naive row recursion), i.e. ``Delta = U - W S0^T`` (the WY/UT form); then::

        Y   = scale ((exp(Gamma) * Q) S0^T + A_qk Delta),  A_qk_ij = sum_d q_i k_j exp(G_i - G_j)
        S_C = S0 diag(exp(Gamma_C)) + Delta^T (exp(Gamma_C - Gamma) * K)

    The decays ``exp(Gamma_i - Gamma_j)`` are one masked ``[C, C, Dk]`` tensor per chunk and
    head (exponent -inf above the diagonal, so no overflow). T is zero-padded to a multiple of C
    (g = 0, beta = 0: padded steps leave the state unchanged)."""
    import jax
    import jax.numpy as jnp

    assert gate == "log"
    f32 = jnp.float32
    q, k = _expand_heads(q, k, v)
    v, g, beta = (x.astype(f32) for x in (v, g, beta))
    B, T, H = k.shape[:3]
    Dv, C = v.shape[-1], chunk_size
    N = -(-T // C)

    def chunks(x):  # [B,T,H,...] -> [B,H,N,C,...], zero-padded along T
        x = jnp.pad(x, [(0, 0), (0, N * C - T)] + [(0, 0)] * (x.ndim - 2))
        x = x.reshape(B, N, C, *x.shape[2:])
        return jnp.moveaxis(x, 3, 1)

    q, k, v, g, beta = (chunks(x) for x in (q, k, v, g, beta))
    Gamma = jnp.cumsum(g, axis=3)  # [B,H,N,C,Dk]
    causal = jnp.tril(jnp.ones((C, C), bool))
    diff = Gamma[..., :, None, :] - Gamma[..., None, :, :]  # [B,H,N,C,C,Dk]: Gamma_i - Gamma_j
    decay = jnp.exp(jnp.where(causal[:, :, None], diff, -jnp.inf))
    A_kk = jnp.einsum("bhnid,bhnjd,bhnijd->bhnij", k, k, decay)
    A_qk = jnp.einsum("bhnid,bhnjd,bhnijd->bhnij", q, k, decay)
    # (I + L)^{-1} by fla's naive row recursion (rows of -L, each finished from the ones above;
    # jax.scipy's batched LAPACK solve hangs XLA:CPU's thread pool at these sizes)
    A = -beta[..., None] * jnp.tril(A_kk, -1)
    for i in range(1, C):
        A = A.at[..., i, :i].add((A[..., i, :, None] * A[..., :, :i]).sum(-2))
    Tinv = A + jnp.eye(C, dtype=f32)
    W = Tinv @ (beta[..., None] * jnp.exp(Gamma) * k)  # [B,H,N,C,Dk]
    U = Tinv @ (beta[..., None] * v)  # [..,C,Dv]
    Qg = jnp.exp(Gamma) * q
    last = Gamma[..., -1:, :]  # [B,H,N,1,Dk]
    Kd = jnp.exp(last - Gamma) * k

    def step(S, xs):  # S [B,H,Dv,Dk]
        W_n, U_n, Qg_n, A_n, Kd_n, last_n = xs
        delta = U_n - jnp.einsum("bhck,bhvk->bhcv", W_n, S)
        y_n = scale * (jnp.einsum("bhck,bhvk->bhcv", Qg_n, S)
                       + jnp.einsum("bhij,bhjv->bhiv", A_n, delta))
        S = S * jnp.exp(last_n) + jnp.einsum("bhcv,bhck->bhvk", delta, Kd_n)
        return S, y_n

    xs = tuple(jnp.moveaxis(x, 2, 0) for x in (W, U, Qg, A_qk, Kd, last))
    S, y = jax.lax.scan(step, initial_state.astype(f32), xs)  # y [N,B,H,C,Dv]
    y = jnp.moveaxis(y, 0, 2).reshape(B, H, N * C, Dv)[:, :, :T]
    return jnp.swapaxes(y, 1, 2), S


def check_baseline(baseline=textbook_chunked, B=1, T=100, Hk=2, Hv=4, D=32,
                   seed=0) -> dict[str, float]:
    """``{name: relative error}`` of a JAX baseline's (default `textbook_chunked`) y, final
    state and six gradients against the float64 `gdngen.algebra.reference` on a small per-channel
    problem (mild gates: a in [0.9, 0.999]); relative error = max |ours - ref| / max |ref|."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from gdngen.algebra import reference
    from gdngen.precision import precision_context
    from gdngen.problem import Problem
    from gdngen.tools.timing import make_inputs

    x = make_inputs(Problem(Hk, Hv, D, D, gate="vector"), B, T, seed)
    names = ("q", "k", "v", "g", "beta", "initial_state")
    scale = D ** -0.5
    ref = reference.vjp(*(x[n] for n in names), x["dy"], x["dfinal_state"], scale=scale)
    args = tuple(jnp.asarray(x[n]) for n in names)
    dy, ds = jnp.asarray(x["dy"]), jnp.asarray(x["dfinal_state"])

    def loss(*a):
        y, s = baseline(*a, scale=scale)
        return jnp.sum(y * dy) + jnp.sum(s * ds)

    with precision_context("jax", "ieee"):
        y, s = jax.jit(lambda *a: baseline(*a, scale=scale))(*args)
        grads = jax.jit(jax.grad(loss, argnums=tuple(range(6))))(*args)
    ours = {"y": y, "final_state": s, **{"d" + n: gr for n, gr in zip(names, grads)}}
    return {n: float(np.max(np.abs(np.asarray(a, np.float64) - ref[n]))
                     / np.max(np.abs(ref[n]))) for n, a in ours.items()}


def mlx_lm_ops(q, k, v, g, beta, initial_state, *, scale, gate="log"):
    """mlx-lm's ``gated_delta_ops``: linear gate ``exp(g)`` (per channel) and ``q * scale``."""
    import mlx.core as mx
    from mlx_lm.models.gated_delta import gated_delta_ops

    assert gate == "log"
    return gated_delta_ops(q * scale, k, v, mx.exp(g), beta, initial_state)


def run(framework: str, problem, seq_lens, repeats: int, baseline_max_T: int,
        settle: bool) -> list[dict]:
    import gdngen
    from gdngen import dispatch
    from gdngen.precision import precision_context
    from gdngen.shape import CallShape
    from gdngen.tools import timing

    tuned = gdngen.load_tuned(framework)
    if framework == "jax":
        from gdngen.jax import gated_delta as plain

        baselines = {"scan": textbook_scan, "chunked": textbook_chunked}
        per_step = {"scan"}
    else:
        from gdngen.mlx import gated_delta as plain

        baselines = {"mlx-lm": mlx_lm_ops}
        per_step = {"mlx-lm"}
    rows = []
    for T in seq_lens:
        shape = CallShape(1, T, problem.Hk, problem.Hv, problem.Dk, problem.Dv, True)
        choice = dispatch.choose(framework, shape, problem.dtype, device=tuned.device)
        choice = choice.for_length(T, True)
        fns = {"gdngen": plain, **{n: f for n, f in baselines.items()
                                   if n not in per_step or T <= baseline_max_T}}
        print(f"[bench_vector_gate] {framework} T={T}: {', '.join(fns)}", file=sys.stderr,
              flush=True)
        inputs = timing.make_inputs(problem, 1, T, seed=T)
        with precision_context(framework, "ieee"):
            if framework == "jax":
                calls, sync = timing._jax_grad_fns(fns, problem, inputs)
            else:
                calls, sync = timing._mlx_grad_fns(fns, problem, inputs)
            timings = timing._interleaved(calls, sync, repeats, 1, settle)
            memory = timing.mlx_peak_memory(calls) if framework == "mlx" else None
        del calls
        ms = {n: t.median_s * 1e3 for n, t in timings.items()}
        row = {"framework": framework, "T": T, "B": 1, "Hk": problem.Hk, "Hv": problem.Hv,
               "Dk": problem.Dk, "Dv": problem.Dv, "gate": "vector", "dtype": problem.dtype,
               "repeats": repeats, "settle": settle, "variant": str(choice.variant),
               "source": choice.source, "path": choice.kernel_path, "ms": ms,
               "spread": {n: max(t.times_s) / min(t.times_s) for n, t in timings.items()},
               "first_s": {n: t.first_s for n, t in timings.items()},
               "over_gdngen": {n: ms[n] / ms["gdngen"] for n in ms if n != "gdngen"}}
        if memory is not None:
            ours = memory["gdngen"]
            row["memory"] = memory
            row["memory_over_gdngen"] = {
                n: m["peak_bytes"] / ours["peak_bytes"] for n, m in memory.items()
                if n != "gdngen"}
            row["net_memory_over_gdngen"] = {
                n: (m["peak_bytes"] - m["resident_bytes"])
                / max(1, ours["peak_bytes"] - ours["resident_bytes"])
                for n, m in memory.items() if n != "gdngen"}
        rows.append(row)
    return rows


def targets(rows: list[dict]) -> list[dict]:
    """Issue 14's targets with the measured ratio (None where that T/baseline was not run)."""
    out = []
    for framework, base, T, minimum, kind in TARGETS:
        key = "over_gdngen" if kind == "time" else "memory_over_gdngen"
        found = [r[key][base] for r in rows
                 if r["framework"] == framework and r["T"] == T and base in r.get(key, {})]
        ratio = found[0] if found else None
        out.append({"framework": framework, "baseline": base, "T": T, "kind": kind,
                    "minimum": minimum, "ratio": ratio,
                    "met": None if ratio is None else ratio >= minimum})
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--frameworks", default="jax,mlx")
    parser.add_argument("--seq-lens", default=None,
                        help="comma-separated T for every framework (default: JAX 2048,4096, "
                             "MLX 2048)")
    parser.add_argument("--heads", default="4,8", help="Hk,Hv")
    parser.add_argument("--dim", type=int, default=128, help="Dk = Dv")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--baseline-max-T", dest="baseline_max_T", type=int, default=2048,
                        help="skip the per-step baselines (scan, mlx-lm) above this T")
    parser.add_argument("--no-settle", dest="settle", action="store_false",
                        help="no untimed run of a callable right before each of its timed runs")
    parser.add_argument("--skip-check", action="store_true",
                        help="do not check the JAX baselines against gdngen.algebra.reference")
    parser.add_argument("--json", action="store_true")
    ns = parser.parse_args(argv)
    from gdngen.problem import Problem

    hk, hv = (int(x) for x in ns.heads.split(","))
    problem = Problem(hk, hv, ns.dim, ns.dim, gate="vector")
    frameworks = ns.frameworks.split(",")
    check = None
    if "jax" in frameworks and not ns.skip_check:
        check = {"chunked": check_baseline(textbook_chunked), "scan": check_baseline(textbook_scan)}
        for name, errors in check.items():
            if max(errors.values()) > 1e-4:
                print(f"{name} baseline disagrees with gdngen.algebra.reference: {errors}",
                      file=sys.stderr)
                return 1
    rows = []
    for framework in frameworks:
        lens = (DEFAULT_SEQ_LENS[framework] if ns.seq_lens is None else
                [int(t) for t in ns.seq_lens.split(",")])
        rows += run(framework, problem, lens, ns.repeats, ns.baseline_max_T, ns.settle)
    met = targets(rows)
    if ns.json:
        json.dump({"rows": rows, "targets": met, "reference_check": check}, sys.stdout,
                  indent=2)
        return 0
    for name, errors in (check or {}).items():
        worst = max(errors, key=errors.get)
        print(f"{name} baseline vs float64 gdngen.algebra.reference (B=1 T=100 Hk=2 Hv=4 "
              f"D=32): worst relative error {errors[worst]:.1e} ({worst}) over y, final state, "
              "6 gradients")
    print(f"fwd+bwd, per-channel gate, B=1 Hk={hk} Hv={hv} D={ns.dim} float32, median of "
          f"{ns.repeats}{' (settled)' if ns.settle else ''}; [max/min spread]; "
          "ratio = baseline / gdngen")
    for r in rows:
        ms, sp = r["ms"], r["spread"]
        cells = "  ".join(f"{n} {ms[n]:.1f} ms [{sp[n]:.2f}]" for n in ms)
        ratios = "  ".join(f"{n}/gdngen {x:.2f}x" for n, x in r["over_gdngen"].items())
        print(f"{r['framework']:4} T={r['T']:<5} {cells}  |  {ratios}")
        print(f"     gdngen: {r['path']} ({r['variant']}, {r['source']})")
        for n, m in r.get("memory", {}).items():
            print(f"     peak memory {n}: {m['peak_bytes'] / 2**20:.1f} MiB "
                  f"({(m['peak_bytes'] - m['resident_bytes']) / 2**20:.1f} MiB above the "
                  f"{m['resident_bytes'] / 2**20:.1f} MiB resident)")
        for n, x in r.get("memory_over_gdngen", {}).items():
            print(f"     memory {n}/gdngen {x:.2f}x (above resident: "
                  f"{r['net_memory_over_gdngen'][n]:.2f}x)")
    print("issue 14 targets:")
    for t in met:
        what = "time" if t["kind"] == "time" else "peak memory"
        got = ("not measured" if t["ratio"] is None else
               f"{t['ratio']:.2f}x: {'met' if t['met'] else 'NOT met'}")
        print(f"  {t['framework']} T={t['T']} {what} {t['baseline']}/gdngen >= "
              f"{t['minimum']:g}x: {got}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
