"""A generating layer's call with its raw inputs: the forward alone, with an incoming state, at
decode and short-prefill lengths, taking the q/k norm and the gate inside the op against
computing them before it.

Both callables get the same raw arrays: q, k un-normalised, ``a`` the gate projection with
``A_log`` and ``dt_bias`` (per channel: Kimi Linear's ``[Hv, 1]`` / ``[Hv, Dk]``), beta in
[0, 1], an incoming state:

* ``fused``: ``gated_delta(q, k, v, a, beta, S, qk_norm=True, gate="softplus", A_log=,
  dt_bias=)``: where the chosen backend's kernels compute the norm and the gate in their loads
  (`gdngen.backends.kernel_inputs`), no normalised q, k and no log gate exist as arrays;
* ``outside``: q, k normalised and the log gate computed by the caller
  (`gdngen.prepare.normalize_qk`, `gdngen.algebra.layer_inputs.log_gate`), then the
  plain call.

``--compare norm``: the output's gated RMSNorm (the mixer's, z ``[B, T, Hv, Dv]``, a weight
``[Dv]``) instead: ``fused`` passes ``norm_weight`` / ``output_gate`` to ``gated_delta`` (a
backend listing "norm" computes it in its kernel's stores), ``outside`` applies
`gdngen.algebra.mixer.gated_norm` to its y; both take the q/k norm and the gate inside.

JAX: each jitted whole; MLX: eager, as a model calls it. The plain ``gdngen.<framework>.
gated_delta`` dispatch runs (tuned entry, else the default variant; ``--backend`` forces that
backend's default variant). Interleaved (`gdngen.tools.timing._interleaved`), median of
``--repeats``; the ratio is ``outside / fused`` (>= 1: fused is faster). Run from the repo
root::

    python benchmarks/bench_decode_inputs.py [--frameworks jax,mlx] [--seq-lens 1,16]
        [--heads 16,32] [--dim 128] [--gates scalar,vector] [--backend NAME]
        [--repeats 51] [--compare inputs|norm] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from gdngen import prepare


def make_inputs(B, T, Hk, Hv, D, vector, seed=0):
    """Raw layer inputs (float32 NumPy): q, k, v, a, beta, A_log, dt_bias, state."""
    import numpy as np

    rng = np.random.default_rng(seed)
    gate_shape = (B, T, Hv, D) if vector else (B, T, Hv)
    f = np.float32
    return {"q": rng.standard_normal((B, T, Hk, D)).astype(f),
            "k": rng.standard_normal((B, T, Hk, D)).astype(f),
            "v": rng.standard_normal((B, T, Hv, D)).astype(f),
            "a": rng.standard_normal(gate_shape).astype(f),
            "beta": rng.uniform(0, 1, (B, T, Hv)).astype(f),
            "A_log": (rng.standard_normal((Hv, 1) if vector else (Hv,)) * 0.5).astype(f),
            "dt_bias": (rng.standard_normal((Hv, D) if vector else (Hv,)) * 0.5).astype(f),
            "state": (rng.standard_normal((B, Hv, D, D)) * 0.1).astype(f),
            "z": rng.standard_normal((B, T, Hv, D)).astype(f),
            "norm_weight": (1.0 + 0.1 * rng.standard_normal(D)).astype(f)}


def callables(framework, D, variant):
    """``{"fused", "outside"}``: ``(q, k, v, a, beta, A_log, dt_bias, state) -> (y, state)``."""
    from gdngen.algebra import layer_inputs

    if framework == "jax":
        from gdngen.jax import gated_delta
    else:
        from gdngen.mlx import gated_delta
    xp = prepare.namespace(framework)

    def fused(q, k, v, a, beta, A_log, dt_bias, state):
        return gated_delta(q, k, v, a, beta, state, scale=D ** -0.5, qk_norm=True,
                           gate="softplus", A_log=A_log, dt_bias=dt_bias, variant=variant)

    def outside(q, k, v, a, beta, A_log, dt_bias, state):
        qn, kn = prepare.normalize_qk(framework, q, k)
        if a.ndim == 4:  # per channel: the parameters broadcast over [Hv, Dk]
            A_log, dt_bias = (x.reshape(x.shape[0], -1) for x in (A_log, dt_bias))
        log_g = layer_inputs.log_gate(xp, a, A_log, dt_bias)
        return gated_delta(qn, kn, v, log_g, beta, state, scale=D ** -0.5, variant=variant)

    return {"fused": fused, "outside": outside}


def norm_callables(framework, D, variant):
    """``{"fused", "outside"}`` of ``--compare norm``: ``(q, k, v, a, beta, A_log, dt_bias,
    state, z, norm_weight) -> (out, state)``."""
    from gdngen.algebra import mixer as stages

    if framework == "jax":
        from gdngen.jax import gated_delta
    else:
        from gdngen.mlx import gated_delta
    xp = prepare.namespace(framework)
    options = {"scale": D ** -0.5, "qk_norm": True, "gate": "softplus", "variant": variant}

    def fused(q, k, v, a, beta, A_log, dt_bias, state, z, w):
        return gated_delta(q, k, v, a, beta, state, A_log=A_log, dt_bias=dt_bias,
                           norm_weight=w, output_gate=z, **options)

    def outside(q, k, v, a, beta, A_log, dt_bias, state, z, w):
        y, s = gated_delta(q, k, v, a, beta, state, A_log=A_log, dt_bias=dt_bias, **options)
        return stages.gated_norm(xp, y, z, w, 1e-6, "silu"), s

    return {"fused": fused, "outside": outside}


def run(framework, T, Hk, Hv, D, vector, backend, repeats, compare="inputs"):
    from gdngen import registry
    from gdngen.problem import Problem
    from gdngen.tools import timing

    raw = make_inputs(1, T, Hk, Hv, D, vector)
    order = ("q", "k", "v", "a", "beta", "A_log", "dt_bias", "state")
    if compare == "norm":
        order += ("z", "norm_weight")
    variant = None
    if backend:
        problem = Problem(Hk, Hv, D, D, gate="vector" if vector else "scalar")
        variant = registry.default_variant(backend, problem)
    fns = (norm_callables if compare == "norm" else callables)(framework, D, variant)
    if framework == "jax":
        import jax
        import jax.numpy as jnp

        args = [jnp.asarray(raw[n]) for n in order]
        jitted = {n: jax.jit(f) for n, f in fns.items()}
        calls = {n: (lambda f=f: f(*args)) for n, f in jitted.items()}
        sync = jax.block_until_ready
    else:
        import mlx.core as mx

        args = [mx.array(raw[n]) for n in order]
        mx.eval(args)
        calls = {n: (lambda f=f: f(*args)) for n, f in fns.items()}
        sync = mx.eval
    timings = timing._interleaved(calls, sync, repeats, 3, False)
    ms = {n: t.median_s * 1e3 for n, t in timings.items()}
    return {"framework": framework, "T": T, "gate": "vector" if vector else "scalar",
            "compare": compare,
            "backend": backend or "dispatch", "ms": ms,
            "spread": {n: max(t.times_s) / min(t.times_s) for n, t in timings.items()},
            "outside_over_fused": ms["outside"] / ms["fused"]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--frameworks", default="jax,mlx")
    p.add_argument("--seq-lens", default="1,16")
    p.add_argument("--heads", default="16,32", help="Hk,Hv")
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--gates", default="scalar,vector")
    p.add_argument("--backend", default=None)
    p.add_argument("--repeats", type=int, default=51)
    p.add_argument("--compare", default="inputs", choices=("inputs", "norm"),
                   help="inputs: q/k norm + gate inside vs before; norm: the output's gated "
                        "norm inside vs after")
    p.add_argument("--json", action="store_true")
    ns = p.parse_args(argv)
    Hk, Hv = (int(h) for h in ns.heads.split(","))
    rows = [run(fw, int(T), Hk, Hv, ns.dim, gate == "vector", ns.backend, ns.repeats,
                ns.compare)
            for fw in ns.frameworks.split(",") for gate in ns.gates.split(",")
            for T in ns.seq_lens.split(",")]
    if ns.json:
        json.dump(rows, sys.stdout, indent=2)
        return 0
    what = "the output's gated norm" if ns.compare == "norm" else \
        "raw layer inputs (qk_norm + softplus gate)"
    print(f"forward with a state, {what}, B=1 Hk={Hk} "
          f"Hv={Hv} D={ns.dim} float32, median of {ns.repeats} (max/min spread in brackets); "
          f"load average {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    print(f"{'fw':4} {'backend':9} {'gate':7} {'T':>4} {'fused ms':>15} {'outside ms':>15} "
          f"{'outside/fused':>13}")
    for r in rows:
        ms, sp = r["ms"], r["spread"]
        print(f"{r['framework']:4} {r['backend']:9} {r['gate']:7} {r['T']:>4} "
              f"{ms['fused']:>8.3f} [{sp['fused']:.2f}] {ms['outside']:>8.3f} "
              f"[{sp['outside']:.2f}] {r['outside_over_fused']:>12.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
