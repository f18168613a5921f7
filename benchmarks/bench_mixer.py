"""The mixer call (`gdngen.mixer`) against the unfused composition a user writes today: the
framework's own depthwise conv (``jax.lax.conv_general_dilated`` / ``mx.conv1d`` with one group
per channel) + SiLU, ``gated_delta(..., qk_norm=True, gate="softplus",
beta_activation="sigmoid")``, then the gated RMSNorm as plain array ops (MLX:
``mx.fast.rms_norm``). Both at once on the same inputs.

* ``train``: forward+backward of ``sum(out * dout) + sum(final_state)`` w.r.t. every array
  (mixed_qkv, conv_weight, a, b, z, A_log, dt_bias, norm_weight). Memory: MLX
  ``mx.get_peak_memory()`` of one fwd+bwd (after ``mx.clear_cache()``, inputs and gradients
  included); JAX the residuals ``jax.vjp`` keeps for the backward, and the jitted gradient's
  temporaries plus outputs (``compiled.memory_analysis()``). Time: median of ``--repeats``
  interleaved runs after a warm-up.
* ``prefill`` (JAX): the forward alone (the same loss, no gradient), jitted: time and the
  compiled step's temporaries plus outputs (``compiled.memory_analysis()``): what the forward
  materialises (a convolved copy of mixed_qkv, the un-normalised y).
* ``decode`` (MLX): per-token time of mlx-lm's ``Qwen3NextGatedDeltaNet`` layer with its
  cache, against the same layer's projections around ``gdngen.mlx.gated_delta_mixer``
  carrying (final_state, conv_state); median of ``--repeats`` runs of ``--tokens`` tokens.
  (JAX): per-token time of the jitted mixer step (T = 1, carrying final_state and conv_state)
  against the unfused step (the framework's conv over the conv state's window, then
  ``gated_delta``, then the norm as array ops) and ``conv_first`` (the mixer's own conv code
  before ``gated_delta(..., norm_weight=)``: the conv out of the kernel's loads, the norm in
  its stores), on the attached device's dispatch (ffi_cpu on a CPU).

``--target DEVICE`` (JAX ``train`` / ``prefill``, e.g. ``tpu-v5e``): no run; each composition
is compiled for the device's compile-only topology with its real compiler (`gdngen.compilers.
targeting`: the device's generated kernels, Mosaic for TPU) and the memory is the compiled
step's (``memory_analysis()``: temporaries plus outputs).

``unfused_shift`` is the same composition with the mixer's own convolution (shifted
multiply-adds) and norm code, not rematerialised: it separates what the framework's grouped conv
costs from what the rematerialisation saves. Ratios are ``unfused / mixer`` (>= 1: the mixer is
smaller / faster). ``--sequences N`` (N > 1) trains on one packed row of N sequences
(`bench_packed`'s row, ``cu_seqlens``): the mixer against ``unfused_shift`` with the mixer's
own packed conv code (the framework's grouped conv has no per-sequence windows). Run from the
repo root::

    python benchmarks/bench_mixer.py [--modes train,prefill,decode] [--frameworks jax,mlx]
        [--seq-lens jax=4096,mlx=2048] [--heads 16,32] [--dim 128] [--repeats 3]
        [--sequences 1] [--target DEVICE] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench_packed's row

from gdngen import prepare

ARGS = ("mixed_qkv", "conv_weight", "a", "b", "z", "A_log", "dt_bias", "norm_weight")


def make_inputs(T, Hk, Hv, D, K=4, seed=0):
    rng = np.random.default_rng(seed)
    C = 2 * Hk * D + Hv * D
    return {"mixed_qkv": rng.standard_normal((1, T, C)), "conv_weight": rng.standard_normal(
        (C, K)) * 0.5, "a": rng.standard_normal((1, T, Hv)), "b": rng.standard_normal(
        (1, T, Hv)), "z": rng.standard_normal((1, T, Hv, D)),
        "A_log": rng.standard_normal(Hv) * 0.5, "dt_bias": rng.standard_normal(Hv) * 0.5,
        "norm_weight": 1.0 + 0.1 * rng.standard_normal(D),
        "dout": rng.standard_normal((1, T, Hv, D))}


def losses(framework, dout, Hk, Hv, D, cu_seqlens=None, variant=None):
    """``{"mixer", "unfused", "unfused_shift"}``: the loss of each over ``ARGS``. With
    ``cu_seqlens`` (a packed row) ``{"mixer", "unfused_shift"}``: the framework's grouped
    conv has no per-sequence windows. ``variant``: the recurrence's (default: dispatch's)."""
    ops = prepare.namespace(framework).module

    def loss_of(layer):
        def loss(*args):
            out, s = layer(*args)
            return ops.sum(out * dout) + ops.sum(s)
        return loss

    return {name: loss_of(layer)
            for name, layer in layers(framework, Hk, Hv, D, cu_seqlens, variant).items()}


def layers(framework, Hk, Hv, D, cu_seqlens=None, variant=None):
    """``{"mixer", "unfused", "unfused_shift"}`` (packed: no ``unfused``, `losses`): each
    composition as ``layer(*ARGS) -> (out [B, T, Hv, D], final_state)``."""
    from gdngen.algebra import mixer as stages

    dims = {"Hk": Hk, "Hv": Hv, "Dk": D, "Dv": D}
    pick = {} if variant is None else {"variant": variant}
    kd = Hk * D
    if framework == "jax":
        import jax
        import jax.numpy as ops

        from gdngen.jax import gated_delta, gated_delta_mixer

        def conv(x, w):
            C, K = w.shape
            out = jax.lax.conv_general_dilated(
                ops.pad(x, ((0, 0), (K - 1, 0), (0, 0))), w.T[:, None, :], (1,), "VALID",
                dimension_numbers=("NWC", "WIO", "NWC"), feature_group_count=C)
            return jax.nn.silu(out)

        def norm(y, z, w):
            r = jax.lax.rsqrt((y * y).mean(-1, keepdims=True) + 1e-6)
            return y * r * w * jax.nn.silu(z)
    else:
        import mlx.core as ops
        from mlx import nn

        from gdngen.mlx import gated_delta, gated_delta_mixer

        def conv(x, w):
            C, K = w.shape
            out = ops.conv1d(ops.pad(x, [(0, 0), (K - 1, 0), (0, 0)]), w[..., None], groups=C)
            return nn.silu(out)

        def norm(y, z, w):
            return ops.fast.rms_norm(y, w, 1e-6) * nn.silu(z)

    def mixer(x, w, a, b, z, A_log, dt_bias, nw):
        out, s, _ = gated_delta_mixer(x, w, a, b, z, **dims, A_log=A_log, dt_bias=dt_bias,
                                      norm_weight=nw, cu_seqlens=cu_seqlens, **pick)
        return out, s

    def unfused(x, w, a, b, z, A_log, dt_bias, nw, conv=conv, norm=norm):
        h = conv(x, w)
        B, T, _ = x.shape
        q = h[..., :kd].reshape(B, T, Hk, D)
        k = h[..., kd:2 * kd].reshape(B, T, Hk, D)
        v = h[..., 2 * kd:].reshape(B, T, Hv, D)
        y, s = gated_delta(q, k, v, a, b, scale=D ** -0.5, qk_norm=True, gate="softplus",
                           A_log=A_log, dt_bias=dt_bias, beta_activation="sigmoid",
                           cu_seqlens=cu_seqlens, **pick)
        return norm(y, z, nw), s

    xp = prepare.namespace(framework)

    def shift_conv(x, w):  # the mixer's own conv code, differentiated by the framework
        if cu_seqlens is not None:
            return stages.conv_packed(xp, x, w, None, cu_seqlens)[0]
        return stages.conv_dense(xp, x, w, None)[0]

    def plain_norm(y, z, w):
        return stages.gated_norm(xp, y, z, w, 1e-6, "silu")

    def unfused_shift(*args):
        return unfused(*args, conv=shift_conv, norm=plain_norm)

    if cu_seqlens is not None:
        return {"mixer": mixer, "unfused_shift": unfused_shift}
    return {"mixer": mixer, "unfused": unfused, "unfused_shift": unfused_shift}


def stack_loss(layer, depth, dout, seed=1):
    """A ``depth``-layer stack of ``layer`` (JAX): layer l's output, projected back to
    mixed_qkv's width by a fixed ``[Hv D, C]`` matrix, is added to layer l+1's input (a
    residual stream); the loss is ``sum(out * dout) + sum(final_state)`` of every layer. Its
    gradient keeps every layer's residuals at once, as a model's does."""
    import jax.numpy as jnp

    def loss(x, *rest):
        B, T, C = x.shape
        rng = np.random.default_rng(seed)
        total = 0.0
        for level in range(depth):
            out, s = layer(x, *rest)
            total = total + jnp.sum(out * dout) + jnp.sum(s)
            if level + 1 < depth:
                proj = jnp.asarray(rng.standard_normal((out.shape[2] * out.shape[3], C))
                                   * 0.02, x.dtype)
                x = x + out.reshape(B, T, -1) @ proj
        return total

    return loss


def compiled_memory(fn, args, target):
    """``fn``'s compiled temporaries plus outputs in bytes on the compile-only ``target`` (a
    device name, `gdngen.compilers.targeting`), traced on abstract copies of ``args``."""
    import jax
    from jax.sharding import SingleDeviceSharding

    from gdngen.compilers import PLATFORMS, compiler_of, targeting
    from gdngen.compilers.targets import compiling_backend
    from gdngen.devices import get_device

    backend = compiling_backend(get_device(target))
    with targeting(target) as found:
        spec = [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=SingleDeviceSharding(found[0]))
                for x in args]
        lowered = jax.jit(fn).trace(*spec).lower(
            lowering_platforms=(PLATFORMS[compiler_of(backend)[0]],))
        stats = lowered.compile().memory_analysis()
    return int(stats.temp_size_in_bytes + stats.output_size_in_bytes)


def compiled_only(mode, T, Hk, Hv, D, target, sequences=1, depth=1):
    """``train`` / ``prefill`` (JAX) compiled for ``target``, not run: the memory of each
    composition's compiled step (`compiled_memory`); ``depth`` > 1: of a stack of that many
    layers (`stack_loss`), where the residuals of every layer are live at once."""
    import jax
    import jax.numpy as jnp

    inputs = make_inputs(T, Hk, Hv, D)
    offsets = None
    if sequences > 1:
        from bench_packed import packed_offsets

        offsets = jnp.asarray(packed_offsets(T, sequences, 0))
    from gdngen import registry
    from gdngen.compilers.targets import compiling_backend
    from gdngen.devices import get_device
    from gdngen.problem import Problem

    problem = Problem(Hk, Hv, D, D)
    variant = registry.default_variant(compiling_backend(get_device(target)), problem)
    a = {n: jnp.asarray(x, jnp.float32) for n, x in inputs.items()}
    args = [a[n] for n in ARGS]
    memory = {}
    for name, layer in layers("jax", Hk, Hv, D, offsets, variant).items():
        loss = stack_loss(layer, depth, a["dout"])
        fn = jax.grad(loss, argnums=tuple(range(len(args)))) if mode == "train" else loss
        memory[name] = {"temp_and_output_bytes": compiled_memory(fn, args, target)}
    return {"mode": mode, "framework": "jax", "target": target, "variant": variant.as_dict(),
            "T": T, "Hk": Hk, "Hv": Hv,
            "D": D, "sequences": sequences, "depth": depth, "memory": memory,
            "memory_ratios": {n: {k: memory[n][k] / memory["mixer"][k] for k in memory["mixer"]}
                              for n in memory if n != "mixer"}}


def train(framework, T, Hk, Hv, D, repeats, sequences=1):
    from gdngen.tools import timing

    inputs = make_inputs(T, Hk, Hv, D)
    offsets = None
    if sequences > 1:  # bench_packed's row: mixed lengths, boundaries anywhere
        from bench_packed import packed_offsets

        offsets = packed_offsets(T, sequences, 0)
    if framework == "jax":
        import jax
        import jax.numpy as jnp

        a = {n: jnp.asarray(x, jnp.float32) for n, x in inputs.items()}
        args = [a[n] for n in ARGS]
        cu = None if offsets is None else jnp.asarray(offsets)
        calls, memory = {}, {}
        for name, loss in losses("jax", a["dout"], Hk, Hv, D, cu).items():
            grad = jax.jit(jax.grad(loss, argnums=tuple(range(len(args)))))
            stats = grad.lower(*args).compile().memory_analysis()
            _, pullback = jax.vjp(loss, *args)
            memory[name] = {"residual_bytes": sum(int(x.nbytes)
                                                  for x in jax.tree.leaves(pullback)),
                            "temp_and_output_bytes": int(stats.temp_size_in_bytes
                                                         + stats.output_size_in_bytes)}
            del pullback
            calls[name] = lambda grad=grad: grad(*args)
        timings = timing._interleaved(calls, jax.block_until_ready, repeats, 1, True)
    else:
        import mlx.core as mx

        a = {n: mx.array(x.astype("float32")) for n, x in inputs.items()}
        mx.eval(list(a.values()))
        args = [a[n] for n in ARGS]
        argnums = list(range(len(args)))
        cu = None if offsets is None else mx.array(offsets)
        calls = {name: (lambda fn=fn: mx.grad(fn, argnums=argnums)(*args))
                 for name, fn in losses("mlx", a["dout"], Hk, Hv, D, cu).items()}
        timings = timing._interleaved(calls, mx.eval, repeats, 1, True)
        memory = {n: {"peak_bytes": m["peak_bytes"]}
                  for n, m in timing.mlx_peak_memory(calls).items()}
    ms = {n: t.median_s * 1e3 for n, t in timings.items()}
    return {"mode": "train", "framework": framework, "T": T, "Hk": Hk, "Hv": Hv, "D": D,
            "sequences": sequences,
            "ms": ms, "spread": {n: max(t.times_s) / min(t.times_s) for n, t in timings.items()},
            "memory": memory,
            "time_ratio": {n: ms[n] / ms["mixer"] for n in ms if n != "mixer"},
            "memory_ratios": {n: {k: memory[n][k] / memory["mixer"][k] for k in memory["mixer"]}
                              for n in memory if n != "mixer"}}


def prefill(T, Hk, Hv, D, repeats):
    """JAX forward-only time and compiled temporaries + outputs of each composition."""
    import jax
    import jax.numpy as jnp

    from gdngen.tools import timing

    inputs = make_inputs(T, Hk, Hv, D)
    a = {n: jnp.asarray(x, jnp.float32) for n, x in inputs.items()}
    args = [a[n] for n in ARGS]
    calls, memory = {}, {}
    for name, loss in losses("jax", a["dout"], Hk, Hv, D).items():
        fwd = jax.jit(loss)
        stats = fwd.lower(*args).compile().memory_analysis()
        memory[name] = {"temp_and_output_bytes": int(stats.temp_size_in_bytes
                                                     + stats.output_size_in_bytes)}
        calls[name] = lambda fwd=fwd: fwd(*args)
    timings = timing._interleaved(calls, jax.block_until_ready, repeats, 1, True)
    ms = {n: t.median_s * 1e3 for n, t in timings.items()}
    return {"mode": "prefill", "framework": "jax", "T": T, "Hk": Hk, "Hv": Hv, "D": D,
            "sequences": 1, "ms": ms,
            "spread": {n: max(t.times_s) / min(t.times_s) for n, t in timings.items()},
            "memory": memory, "time_ratio": {n: ms[n] / ms["mixer"] for n in ms if n != "mixer"},
            "memory_ratios": {n: {k: memory[n][k] / memory["mixer"][k] for k in memory["mixer"]}
                              for n in memory if n != "mixer"}}


def decode(Hk, Hv, D, tokens, repeats):
    """Per-token ms of mlx-lm's layer and of the layer's projections around the mixer."""
    import time

    import mlx.core as mx
    from mlx_lm.models import qwen3_next
    from mlx_lm.models.cache import ArraysCache

    from gdngen.mlx import gated_delta_mixer

    args = qwen3_next.ModelArgs(
        model_type="qwen3_next", hidden_size=2048, num_hidden_layers=1, intermediate_size=64,
        num_attention_heads=2, num_key_value_heads=1, head_dim=64, rms_norm_eps=1e-6,
        vocab_size=32, rope_theta=1e4, partial_rotary_factor=0.25, max_position_embeddings=64,
        linear_num_value_heads=Hv, linear_num_key_heads=Hk, linear_key_head_dim=D,
        linear_value_head_dim=D, linear_conv_kernel_dim=4, num_experts=1,
        num_experts_per_tok=1, decoder_sparse_step=1, shared_expert_intermediate_size=64,
        moe_intermediate_size=64, norm_topk_prob=True, mlp_only_layers=[])
    layer = qwen3_next.Qwen3NextGatedDeltaNet(args)
    layer.eval()
    mx.eval(layer.parameters())
    dims = {"Hk": Hk, "Hv": Hv, "Dk": D, "Dv": D}
    xs = [mx.random.normal((1, 1, args.hidden_size)) for _ in range(tokens)]
    mx.eval(xs)
    weight = layer.conv1d.weight[..., 0]

    def mlx_lm_run():
        cache = ArraysCache(size=2)
        for x in xs:
            mx.eval(layer(x, cache=cache))

    def mixer_run():
        state = conv = None
        for x in xs:
            q, k, v, z, b, a = layer.fix_query_key_value_ordering(layer.in_proj_qkvz(x),
                                                                 layer.in_proj_ba(x))
            mixed = mx.concatenate([t.reshape(1, 1, -1) for t in (q, k, v)], axis=-1)
            out, state, conv = gated_delta_mixer(
                mixed, weight, a, b, z, **dims, A_log=layer.A_log, dt_bias=layer.dt_bias,
                norm_weight=layer.norm.weight, conv_state=conv, initial_state=state)
            mx.eval(layer.out_proj(out.reshape(1, 1, -1)), state, conv)

    runs = {"mlx_lm": mlx_lm_run, "mixer": mixer_run}
    times = {n: [] for n in runs}
    for fn in runs.values():
        fn()
    for r in range(repeats):
        for name in (list(runs) if r % 2 == 0 else list(runs)[::-1]):
            t0 = time.perf_counter()
            runs[name]()
            times[name].append((time.perf_counter() - t0) / tokens * 1e3)
    ms = {n: float(np.median(t)) for n, t in times.items()}
    return {"mode": "decode", "framework": "mlx", "Hk": Hk, "Hv": Hv, "D": D,
            "tokens": tokens, "ms_per_token": ms, "time_ratio": ms["mlx_lm"] / ms["mixer"],
            "spread": {n: max(t) / min(t) for n, t in times.items()}}


def decode_jax(Hk, Hv, D, tokens, repeats, K=4):
    """Per-token ms of the jitted JAX decode steps (`decode`'s docstring): ``mixer``,
    ``unfused`` and ``conv_first``, each carrying its (final_state, conv_state)."""
    import time

    import jax
    import jax.numpy as jnp

    from gdngen.algebra import mixer as stages
    from gdngen.jax import gated_delta, gated_delta_mixer

    x = make_inputs(tokens, Hk, Hv, D, K)
    dims = {"Hk": Hk, "Hv": Hv, "Dk": D, "Dv": D}
    kd, C = Hk * D, 2 * Hk * D + Hv * D
    f32 = {n: jnp.asarray(v, jnp.float32) for n, v in x.items()}
    params = (f32["conv_weight"], f32["A_log"], f32["dt_bias"], f32["norm_weight"])
    xp = prepare.namespace("jax")

    def split(h):
        return (h[..., :kd].reshape(1, 1, Hk, D), h[..., kd:2 * kd].reshape(1, 1, Hk, D),
                h[..., 2 * kd:].reshape(1, 1, Hv, D))

    def rest(q, k, v, a, b, z, S, A_log, dt_bias, nw, norm_in_call):
        opts = {"scale": D ** -0.5, "qk_norm": True, "gate": "softplus", "A_log": A_log,
                "dt_bias": dt_bias, "beta_activation": "sigmoid", "initial_state": S}
        if norm_in_call:
            return gated_delta(q, k, v, a, b, norm_weight=nw, output_gate=z, **opts)
        y, S = gated_delta(q, k, v, a, b, **opts)
        r = jax.lax.rsqrt((y * y).mean(-1, keepdims=True) + 1e-6)
        return y * r * nw * jax.nn.silu(z), S

    @jax.jit
    def mixer(xt, a, b, z, S, cs, w, A_log, dt_bias, nw):
        return gated_delta_mixer(xt, w, a, b, z, **dims, A_log=A_log, dt_bias=dt_bias,
                                 norm_weight=nw, conv_state=cs, initial_state=S)

    @jax.jit
    def unfused(xt, a, b, z, S, cs, w, A_log, dt_bias, nw):
        window = jnp.concatenate([cs.transpose(0, 2, 1), xt], axis=1)  # [1, K, C]
        h = jax.nn.silu(jax.lax.conv_general_dilated(
            window, w.T[:, None, :], (1,), "VALID", dimension_numbers=("NWC", "WIO", "NWC"),
            feature_group_count=C))
        out, S = rest(*split(h), a, b, z, S, A_log, dt_bias, nw, False)
        return out, S, window[:, 1:].transpose(0, 2, 1)

    @jax.jit
    def conv_first(xt, a, b, z, S, cs, w, A_log, dt_bias, nw):
        h = stages.conv_dense(xp, xt, w, cs)[0]
        out, S = rest(*split(h), a, b, z, S, A_log, dt_bias, nw, True)
        return out, S, stages.conv_new_state(xp, xt, cs, K, None, None)

    steps = [tuple(f32[n][:, t:t + 1] for n in ("mixed_qkv", "a", "b", "z"))
             for t in range(tokens)]
    S0 = jnp.zeros((1, Hv, D, D), jnp.float32)
    cs0 = jnp.zeros((1, C, K - 1), jnp.float32)
    runs = {"mixer": mixer, "unfused": unfused, "conv_first": conv_first}

    def run(step):
        S, cs = S0, cs0
        for xt, a, b, z in steps:
            out, S, cs = step(xt, a, b, z, S, cs, *params)
        return jax.block_until_ready((out, S, cs))

    finals = {n: run(fn) for n, fn in runs.items()}  # compiles; the three agree
    for n in ("unfused", "conv_first"):
        for got, want in zip(finals[n], finals["mixer"]):
            np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4,
                                       atol=1e-5, err_msg=n)
    times = {n: [] for n in runs}
    for r in range(repeats):
        for name in (list(runs) if r % 2 == 0 else list(runs)[::-1]):
            t0 = time.perf_counter()
            run(runs[name])
            times[name].append((time.perf_counter() - t0) / tokens * 1e3)
    ms = {n: float(np.median(t)) for n, t in times.items()}
    return {"mode": "decode", "framework": "jax", "backend": jax.default_backend(),
            "Hk": Hk, "Hv": Hv, "D": D, "tokens": tokens, "ms_per_token": ms,
            "time_ratio": {n: ms[n] / ms["mixer"] for n in ms if n != "mixer"},
            "spread": {n: max(t) / min(t) for n, t in times.items()}}


def _memory_text(row, name):
    """The mixer's memory against composition ``name``'s, each measure of ``row``."""
    mem, ratios = row["memory"], row["memory_ratios"][name]
    return ", ".join(f"{k} {mem['mixer'][k] / 2**20:.0f} vs {mem[name][k] / 2**20:.0f} MiB "
                     f"({ratios[k]:.2f}x)" for k in mem["mixer"])


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--modes", default="train,decode")
    p.add_argument("--frameworks", default="jax,mlx")
    p.add_argument("--seq-lens", default="jax=4096,mlx=2048")
    p.add_argument("--heads", default="16,32", help="Hk,Hv")
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--sequences", type=int, default=1,
                   help="train on one packed row of this many sequences (cu_seqlens)")
    p.add_argument("--target", default=None,
                   help="JAX train / prefill: compile for this device's topology, no run")
    p.add_argument("--depth", type=int, default=1,
                   help="with --target: compile a stack of this many layers")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    Hk, Hv = (int(h) for h in args.heads.split(","))
    seq = dict(item.split("=") for item in args.seq_lens.split(","))
    rows = []
    modes = args.modes.split(",")
    if args.target is not None:
        rows += [compiled_only(mode, int(seq["jax"]), Hk, Hv, args.dim, args.target,
                               args.sequences, args.depth)
                 for mode in modes if mode in ("train", "prefill")]
        modes = []
    if "train" in modes:
        rows += [train(fw, int(seq[fw]), Hk, Hv, args.dim, args.repeats, args.sequences)
                 for fw in args.frameworks.split(",")]
    if "prefill" in modes:
        rows.append(prefill(int(seq["jax"]), Hk, Hv, args.dim, args.repeats))
    if "decode" in modes:
        for fw in args.frameworks.split(","):
            run = decode_jax if fw == "jax" else decode
            rows.append(run(Hk, Hv, args.dim, args.tokens, args.repeats))
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    print(f"mixer vs unfused composition; Hk={Hk} Hv={Hv} D={args.dim} float32; load average "
          f"{' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    for r in rows:
        if "target" in r:
            for n in r["memory_ratios"]:
                mem = _memory_text(r, n)
                depth = f" x{r['depth']} layers" if r["depth"] > 1 else ""
                print(f"{r['mode']} jax T={r['T']}{depth} compiled for {r['target']}: mixer "
                      f"vs {n}: {mem}")
        elif r["mode"] in ("train", "prefill"):
            for n in r["time_ratio"]:
                mem = _memory_text(r, n)
                packed = f" packed {r['sequences']}" if r["sequences"] > 1 else ""
                print(f"{r['mode']} {r['framework']} T={r['T']}{packed}: mixer "
                      f"{r['ms']['mixer']:.0f} ms, {n} {r['ms'][n]:.0f} ms "
                      f"({r['time_ratio'][n]:.2f}x); {mem}; "
                      f"spread {max(r['spread'].values()):.2f}")
        elif r["framework"] == "jax":
            ms = r["ms_per_token"]
            print(f"decode jax ({r['backend']}), {r['tokens']} tokens: mixer "
                  f"{ms['mixer']:.3f} ms/token, " + ", ".join(
                      f"{n} {ms[n]:.3f} ms/token ({r['time_ratio'][n]:.2f}x)"
                      for n in r["time_ratio"]) + f"; spread {max(r['spread'].values()):.2f}")
        else:
            ms = r["ms_per_token"]
            print(f"decode mlx, {r['tokens']} tokens: mixer {ms['mixer']:.2f} ms/token, "
                  f"mlx-lm layer {ms['mlx_lm']:.2f} ms/token ({r['time_ratio']:.2f}x); "
                  f"spread {max(r['spread'].values()):.2f}")


if __name__ == "__main__":
    main()
