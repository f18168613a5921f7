"""Fused layer inputs: forward+backward of a call whose backend computes a layer input inside its
chunk core (`BackendSpec.fused_inputs`) against the same call with that input computed before
it (autodiff through it), both at once on the same inputs: peak memory and time. ``--inputs``:

* ``qk_norm``: ``gated_delta(..., qk_norm=True)`` (raw q, k) against q, k normalised before
  the call (`gdngen.prepare.normalize_qk`);
* ``gate``: ``gated_delta(..., gate="softplus", A_log=, dt_bias=)`` (g the raw projection a)
  against the log gate computed before the call (`gdngen.algebra.layer_inputs.log_gate`);
  per-channel gates with Kimi Linear's parameter shapes (A_log ``[Hv, 1]``, dt_bias ``[Hv, Dk]``).

What is differentiated is ``sum(y * dy) + sum(final_state)`` with respect to every array (q,
k, v, g, beta and, for ``gate``, A_log and dt_bias), B=1, float32, ``scale = Dk ** -0.5``, the
plain ``gdngen.<framework>.gated_delta`` call (tuned entry, else the default variant). Memory:

* MLX: ``mx.get_peak_memory()`` of one fwd+bwd after ``mx.clear_cache()`` and a reset (inputs
  and gradients included), and that peak above what was resident before the call;
* JAX: what ``jax.vjp`` keeps between the forward and the backward (the residuals: in a
  model, what each layer holds until its backward runs), and the jitted gradient's
  ``compiled.memory_analysis()``: temporaries plus outputs (what XLA allocates for one
  fwd+bwd beyond its arguments).

Time: median of ``--repeats`` interleaved runs after a warm-up (`gdngen.tools.timing._interleaved`).
Ratios are ``outside / fused`` (>= 1: the fused call is smaller / faster). Run from the repo
root::

    python benchmarks/bench_layer_inputs.py [--frameworks jax,mlx] [--inputs qk_norm,gate]
        [--seq-len 2048] [--heads 4,8] [--dim 128] [--gates scalar,vector] [--repeats 5]
        [--json]
"""

from __future__ import annotations

import argparse
import json
import os

from gdngen import prepare

#: the differentiated arrays of each ``--inputs`` kind, in the order the losses take them
ARGUMENTS = {"qk_norm": ("q", "k", "v", "g", "beta"),
             "gate": ("q", "k", "v", "g", "beta", "A_log", "dt_bias")}


def make_inputs(B, T, Hk, Hv, D, vector, seed=0):
    """The arrays of both kinds: g a log gate, a the raw projection with A_log and dt_bias."""
    import numpy as np

    rng = np.random.default_rng(seed)
    gate_shape = (B, T, Hv, D) if vector else (B, T, Hv)
    return {"q": rng.standard_normal((B, T, Hk, D)), "k": rng.standard_normal((B, T, Hk, D)),
            "v": rng.standard_normal((B, T, Hv, D)),
            "g": -rng.uniform(0.0, 0.3, gate_shape), "beta": rng.uniform(0, 1, (B, T, Hv)),
            "a": rng.standard_normal(gate_shape),
            "A_log": rng.standard_normal((Hv, 1) if vector else (Hv,)) * 0.5,
            "dt_bias": rng.standard_normal((Hv, D) if vector else (Hv,)) * 0.5,
            "dy": rng.standard_normal((B, T, Hv, D))}


def arguments(arrays, kind):
    """The loss arguments of ``kind`` from ``arrays`` (g the raw projection for ``gate``)."""
    return [arrays["a" if kind == "gate" and n == "g" else n] for n in ARGUMENTS[kind]]


def losses(framework, dy, D, kind="qk_norm"):
    """``{"fused", "outside"}``: ``loss(*ARGUMENTS[kind]) = sum(y * dy) + sum(final_state)`` of
    the plain call with the layer input ``kind`` computed inside the op, and before it."""
    from gdngen.algebra import layer_inputs

    if framework == "jax":
        import jax.numpy as ops

        from gdngen.jax import gated_delta
    else:
        import mlx.core as ops

        from gdngen.mlx import gated_delta

    def loss(y, s):
        return ops.sum(y * dy) + ops.sum(s)

    if kind == "gate":
        def fused(q, k, v, a, beta, A_log, dt_bias):
            return loss(*gated_delta(q, k, v, a, beta, scale=D ** -0.5, gate="softplus",
                                     A_log=A_log, dt_bias=dt_bias))

        def outside(q, k, v, a, beta, A_log, dt_bias):
            log_g = layer_inputs.log_gate(prepare.namespace(framework), a, A_log, dt_bias)
            return loss(*gated_delta(q, k, v, log_g, beta, scale=D ** -0.5))

        return {"fused": fused, "outside": outside}

    def fused(q, k, v, g, beta):
        return loss(*gated_delta(q, k, v, g, beta, scale=D ** -0.5, qk_norm=True))

    def outside(q, k, v, g, beta):
        qn, kn = prepare.normalize_qk(framework, q, k)
        return loss(*gated_delta(qn, kn, v, g, beta, scale=D ** -0.5))

    return {"fused": fused, "outside": outside}


def mlx_calls(inputs, D, kind):
    """``({"fused", "outside"}: zero-argument fwd+bwd calls}, eval)``."""
    import mlx.core as mx

    a = {n: mx.array(x.astype("float32")) for n, x in inputs.items()}
    mx.eval(list(a.values()))
    args = arguments(a, kind)
    argnums = list(range(len(args)))
    calls = {name: (lambda fn=fn: mx.grad(fn, argnums=argnums)(*args))
             for name, fn in losses("mlx", a["dy"], D, kind).items()}
    return calls, mx.eval


def mlx_memory(calls):
    """`gdngen.tools.timing.mlx_peak_memory`, with the peak above what was resident."""
    from gdngen.tools import timing

    return {name: {"peak_bytes": m["peak_bytes"],
                   "above_resident_bytes": m["peak_bytes"] - m["resident_bytes"]}
            for name, m in timing.mlx_peak_memory(calls).items()}


def jax_calls(inputs, D, kind):
    """``(calls, block_until_ready, memory)``: the jitted gradients and their memory."""
    import jax
    import jax.numpy as jnp

    a = {n: jnp.asarray(x, jnp.float32) for n, x in inputs.items()}
    args = arguments(a, kind)
    memory, calls = {}, {}
    for name, loss in losses("jax", a["dy"], D, kind).items():
        grad = jax.jit(jax.grad(loss, argnums=tuple(range(len(args)))))
        stats = grad.lower(*args).compile().memory_analysis()
        _, pullback = jax.vjp(loss, *args)
        memory[name] = {"temp_bytes": int(stats.temp_size_in_bytes),
                        "temp_and_output_bytes": int(stats.temp_size_in_bytes
                                                     + stats.output_size_in_bytes),
                        "residual_bytes": sum(int(x.nbytes)
                                              for x in jax.tree.leaves(pullback))}
        calls[name] = lambda grad=grad: grad(*args)
    return calls, jax.block_until_ready, memory


def run(framework, args, vector, kind):
    from gdngen.tools import timing

    Hk, Hv = args.heads
    inputs = make_inputs(1, args.seq_len, Hk, Hv, args.dim, vector)
    if framework == "mlx":
        calls, sync = mlx_calls(inputs, args.dim, kind)
        memory = None
    else:
        calls, sync, memory = jax_calls(inputs, args.dim, kind)
    timings = timing._interleaved(calls, sync, args.repeats, 1, True)
    if framework == "mlx":
        memory = mlx_memory(calls)
    key = "peak_bytes" if framework == "mlx" else "residual_bytes"
    ms = {n: t.median_s * 1e3 for n, t in timings.items()}
    return {"framework": framework, "inputs": kind, "gate": "vector" if vector else "scalar",
            "T": args.seq_len, "Hk": Hk, "Hv": Hv, "D": args.dim, "ms": ms,
            "spread": {n: max(t.times_s) / min(t.times_s) for n, t in timings.items()},
            "memory": memory, "memory_key": key,
            "memory_ratio": memory["outside"][key] / memory["fused"][key],
            "time_ratio": ms["outside"] / ms["fused"]}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--frameworks", default="jax,mlx")
    p.add_argument("--inputs", default="qk_norm,gate")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--heads", default="4,8", help="Hk,Hv")
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--gates", default="scalar,vector")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    args.heads = tuple(int(h) for h in args.heads.split(","))
    rows = [run(fw, args, gate == "vector", kind) for kind in args.inputs.split(",")
            for fw in args.frameworks.split(",") for gate in args.gates.split(",")]
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    print(f"fwd+bwd, layer inputs computed in the op vs before it; B=1 T={args.seq_len} "
          f"Hk={args.heads[0]} Hv={args.heads[1]} D={args.dim} float32, median of "
          f"{args.repeats}; load average {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    print(f"{'inputs':8} {'fw':5} {'gate':7} {'memory':22} {'fused MiB':>10} {'outside MiB':>12} "
          f"{'ratio':>6} | {'fused ms':>9} {'outside ms':>11} {'ratio':>6}")
    for r in rows:
        mem = r["memory"]
        keys = [key for key in mem["fused"] if key != "temp_bytes"]
        for i, key in enumerate(keys):
            times = (f"{r['ms']['fused']:9.1f} {r['ms']['outside']:11.1f} "
                     f"{r['time_ratio']:5.2f}x") if not i else ""
            print(f"{r['inputs']:8} {r['framework']:5} {r['gate']:7} {key:22} "
                  f"{mem['fused'][key] / 2**20:10.1f} {mem['outside'][key] / 2**20:12.1f} "
                  f"{mem['outside'][key] / mem['fused'][key]:5.2f}x | {times}")
    print("memory: MLX peak_bytes, the peak of the call (inputs and gradients included); JAX "
          "residual_bytes, kept by jax.vjp for the backward, and temp_and_output_bytes, the "
          "compiled gradient's temporaries plus outputs")


if __name__ == "__main__":
    main()
