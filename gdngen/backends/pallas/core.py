"""Helpers of the two Pallas backends (`gdngen.backends.pallas.backend.PallasBackend`): exec of a
rendered source as a module, jitting its entry points for top-level and nested calls, the gate
cotangent and the fused builds' gate operands."""

from __future__ import annotations

import linecache
import types

from gdngen.algebra import chunkwise, layer_inputs

#: XLA options for the interpret-mode executables on the host (compile time dominates there).
INTERPRET_COMPILER_OPTIONS = {"xla_backend_optimization_level": 0}


def exec_module(backend: str, name: str, source: str, sha: str) -> types.ModuleType:
    """A fresh module object holding the rendered ``source`` of file ``name`` (registered in
    linecache, so tracebacks show the generated lines)."""
    filename = f"<gdngen {backend} {sha[:16]} {name}>"
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    module = types.ModuleType(f"gdngen_{backend}_{sha[:16]}_{name.removesuffix('.py')}")
    module.__file__ = filename
    exec(compile(source, filename, "exec"), module.__dict__)  # noqa: S102 - our own rendering
    return module


def jit_pair(fn, static, interpret):
    """``(top-level jit, nested jit)`` of ``fn``: the first with `INTERPRET_COMPILER_OPTIONS`
    in interpret mode (jax accepts compiler options on top-level jits only)."""
    import jax

    options = INTERPRET_COMPILER_OPTIONS if interpret else None
    return (jax.jit(fn, static_argnames=static, compiler_options=options),
            jax.jit(fn, static_argnames=static))


def call_sequential_under_vmap(fns, *args, **static):
    """`call_jitted`, with ``jax.vmap`` of the call run as a loop over the mapped axis
    (``jax.custom_batching.sequential_vmap``: Mosaic's grid carries its own dimension
    semantics, which batching a ``pallas_call`` does not extend)."""
    import jax

    @jax.custom_batching.sequential_vmap
    def run(*arrays):
        return call_jitted(fns, *arrays, **static)

    return run(*args)


def call_jitted(fns, *args, **kwargs):
    """Call the right one of a `jit_pair` for ``args`` (inside a trace: the nested one)."""
    import jax

    traced = any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(args))
    return fns[traced](*args, **kwargs)


def floored_log_gates(gates, gate, floor):
    """The finite log gates the kernels read: ``gates`` (convention ``gate``, "log" or
    "linear") as log gates clamped to ``floor`` (the backend's ``LOG_GATE_FLOOR``, -1e30: a
    zero gate's log, which the kernels' exp still turns into an exact 0)."""
    import jax.numpy as jnp

    return jnp.maximum(gates if gate == "log" else jnp.log(gates), floor)


def channel_layer_inputs(q, k, gates, *, gate, qk_norm: bool):
    """``(q, k, log g)``: the layer inputs of the per-channel kernels, which take them as
    arrays (their norm builds' forwards), formed here: q, k L2-normalised with ``qk_norm``
    (`gdngen.backends.generated.l2_normalized`), the log gates of ``gates`` in ``gate``'s
    convention or a `gdngen.algebra.layer_inputs.ParameterGate`'s from ``(a, A_log,
    dt_bias)``."""
    from gdngen.backends import generated
    from gdngen.backends.portable.jax_chunkwise import XP

    if qk_norm:
        q, k = generated.l2_normalized(XP, q), generated.l2_normalized(XP, k)
    return q, k, layer_inputs.log_gates(XP, gates, gate)[0]


def gate_cotangent(gates, gate, dD):
    """d(gates) ``[..., C]`` (convention ``gate``: "log" or "linear") from the decay-factor
    cotangent ``dD [..., C+1, C+1]`` by the straddle-sum rule of `gdngen.algebra.chunkwise`
    (exact at g = 0)."""
    import jax.numpy as jnp

    from gdngen.backends.portable.jax_chunkwise import FLOAT32_MATMULS, XP

    with FLOAT32_MATMULS:  # the straddle sums are einsums
        if gate == "log":
            return chunkwise.decay_factors_log_vjp(XP, gates,
                                                   chunkwise.decay_factors(XP, gates), dD)
        D = chunkwise.decay_factors(XP, jnp.log(gates))
        return chunkwise.decay_factors_linear_vjp(XP, gates, D, dD)


def fused_gate_operands(inputs, A_log, dt_bias, Hv: int, Dk: int, vector_gate: bool) -> tuple:
    """The operands a fused kernel takes after ``a`` (`gdngen.backends.kernel_inputs`):
    ``(A_log, dt_bias)`` float32 ``[Hv]`` (``[Hv, Dk]`` per channel), then for
    "sigmoid_bound" ``lower_bound`` as a float32 scalar array. Empty without a gate form."""
    import jax.numpy as jnp

    from gdngen.backends.kernel_inputs import kernel_parameters

    if inputs.gate_form is None:
        return ()
    parameters = kernel_parameters(jnp, A_log, dt_bias, Hv, Dk, vector_gate)
    if inputs.gate_form == "sigmoid_bound":
        return (*parameters, jnp.asarray(inputs.lower_bound, jnp.float32))
    return parameters


def fused_gate_specs(inputs, Hv: int, Dk: int, vector_gate: bool) -> tuple:
    """``jax.ShapeDtypeStruct`` s of `fused_gate_operands` (for lowering a fused build)."""
    import jax
    import jax.numpy as jnp

    if not inputs.gate_form:
        return ()
    parameter = jax.ShapeDtypeStruct((Hv, Dk) if vector_gate else (Hv,), jnp.float32)
    bound = (jax.ShapeDtypeStruct((), jnp.float32),) if inputs.gate_form == "sigmoid_bound" else ()
    return (parameter, parameter, *bound)


def channel_walk_backward(dS_final, Pm, q, k, gates, Wk, W, S_in, dY, dS_in=None, *, gate: str,
                          scale: float):
    """The reverse walk of the Pallas per-channel kernels (``walk_backward`` of a backend's
    ``chunk_walks``), here on jax.numpy as its reference: `gdngen.algebra.chunkwise_channel.
    walk_backward` with its inputs G = Pm^T dY, Kc = K * DC, Qd = (scale Q) * D0 and dCC formed
    from Pm, q, k (unscaled) and the gates (convention ``gate``), which the kernels form per
    chunk. Chunk layout: Pm [N, B, Hk, r, C, C], q, k [N, B, Hk, C, Dk], gates, Wk [N, B, Hk,
    r, C, Dk], W, dY [N, B, Hk, r, C, Dv], S_in [N, B, Hk, r, Dv, Dk], dS_final [B, Hk, r,
    Dv, Dk]. Returns ``(dS0, dW, dWk, dQd, dKc, ddCC, dinject)`` (``dinject`` None without
    ``dS_in``)."""
    from gdngen.algebra import chunkwise_channel as channel
    from gdngen.backends.portable.jax_chunkwise import FLOAT32_MATMULS, XP

    with FLOAT32_MATMULS:
        D0, DC, dCC = channel.chunk_segments(XP, channel._linear(XP, gates, gate),
                                             channel.PRODUCT)
        return channel.walk_backward(XP, dS_final, channel._T(Pm) @ dY, k[..., None, :, :] * DC,
                                     Wk, W, S_in, dY, (q * scale)[..., None, :, :] * D0, dCC,
                                     dS_in)


def _channel_stages(intra, grads, walks, gate: str, scale: float, interpret, save_states):
    """``(forward, backward)`` of the per-channel chunk cores below on the kernels ``intra``,
    ``grads`` and ``walks``: ``forward(q, k, v, gates, beta, S0, inject) -> ((Y, S_final,
    S_in), saved)`` and ``backward(primals, saved, dY, dS_final, dS_in) -> (dq, dk, dv,
    dgates, dbeta, dS0, dinject)`` (``inject`` / ``dS_in`` None on a dense walk; q unscaled,
    gates in the convention ``gate``)."""
    import jax.numpy as jnp

    from gdngen.backends.portable.jax_chunkwise import XP

    walk_forward, walk_backward = walks

    def forward(q, k, v, gates, beta, S0, inject):
        U, Wk, Kc, Qd, Pm, Mkk, Tinv, dCC = intra(q, k, v, gates, beta)
        Y, S_final, S_in, W = walk_forward(XP, S0, U, Wk, Kc, Qd, Pm, dCC, inject)
        return (Y, S_final, S_in), ((S_in, W, Tinv, Wk, Pm, Mkk) if save_states else None)

    def backward_walk(q, k, gates, residuals, dY, dS_final, dS_in):
        S_in, W, _, Wk, Pm, _ = residuals
        return walk_backward(dS_final, Pm, q, k, gates, Wk, W, S_in, dY, dS_in, gate=gate,
                             scale=scale)

    run_walk = jit_pair(backward_walk, (), interpret)

    def backward(primals, saved, dY, dS_final, dS_in):
        q, k, v, gates, beta = primals[:5]
        if saved is None:
            saved = forward(*primals)[1]
        if dS_final is None:
            dS_final = jnp.zeros(saved[0].shape[1:], jnp.float32)
        dS0, dW, dWk, dQd, dKc, ddCC, dinject = call_jitted(run_walk, q, k, gates, saved, dY,
                                                           dS_final, dS_in)
        _, W, Tinv, _, _, Mkk = saved
        return (*grads(q, k, v, gates, beta, W, Tinv, Mkk, dY, dW, dWk, dQd, dKc, ddCC), dS0,
                dinject)

    return forward, backward


def channel_core(intra, grads, walks, gate, scale: float, qk_norm: bool, interpret,
                 save_states: bool = True, conv_chunk: int | None = None):
    """The per-channel chunk core ``core(q, k, v, gates, beta, S0) -> (Y, S_final)`` of a Pallas
    backend, in the chunk layout of `gdngen.algebra.chunkwise_channel` (float32, q unscaled:
    the core applies ``scale``), a ``jax.custom_vjp`` (`gdngen.backends.generated.custom_vjp_core`,
    so ``qk_norm`` and a `gdngen.algebra.layer_inputs.ParameterGate` ``gate`` are computed in it).

    Forward: ``intra(q, k, v, gates, beta) -> (U, Wk, Kc, Qd, Pm, Mkk, Tinv, dCC)``, the
    backend's intra-chunk kernel (chunk layout; gates in the convention of ``gate``; q scaled
    by it), then the walk ``walks[0]`` (`gdngen.algebra.chunkwise_channel.walk_forward`'s
    contract): two kernels. Its residuals are `chunkwise_channel.forward`'s (``save_states``
    False: recomputed by the backward). Backward, as `chunkwise_channel.backward`: the reverse
    walk ``walks[1]`` (`channel_walk_backward`'s contract: G = Pm^T dY and the decayed Q, K
    formed in the kernel), then
    ``grads(q, k, v, gates, beta, W, Tinv, Mkk, dY, dW, dWk, dQd, dKc, ddCC) -> (dq, dk, dv,
    dgates, dbeta)``, the backend's kernel of `chunkwise_channel.backward_in_chunks` (dq of the
    unscaled q). ``conv_chunk``: a conv call's core, over the call's layout with chunks of
    ``conv_chunk``: q, k, v arrive as conv tuples, only they are kept for the backward
    (`gdngen.backends.generated.custom_vjp_core` with ``conv`` and ``chunk_size``)."""
    from gdngen.backends import generated

    parameter_gate, gate = gate, layer_inputs.convention(gate)
    stages = _channel_stages(intra, grads, walks, gate, scale, interpret, save_states)

    def forward(primals):
        (Y, S_final, _), saved = stages[0](*primals, None)
        return (Y, S_final), saved

    def backward(primals, saved, cotangents):
        return stages[1](primals + (None,), saved, *cotangents, None)[:6]

    return generated.custom_vjp_core(forward, backward, qk_norm, parameter_gate,
                                     conv=conv_chunk is not None, chunk_size=conv_chunk)


def channel_walk_core(intra, grads, walks, gate, interpret, save_states: bool = True):
    """``core(q, k, v, gates, beta, inject) -> (Y, S_in)``: the chunk walk of a packed row of
    per-channel gates (`gdngen.algebra.packed.chunk_walk`'s ``packed_core``; chunk layout, q
    already scaled) on a packed build: `channel_core`'s kernels from a zero state, with
    ``inject`` [N, B, Hk, r, Dv, Dk] added to the state leaving each chunk (the packed build's
    ``walks`` take it) and the entering states S_in an output; its VJP takes their cotangent
    (``dS_in`` of the reverse walk) and gives ``inject``'s."""
    import jax.numpy as jnp

    from gdngen.backends import generated

    stages = _channel_stages(intra, grads, walks, gate, 1.0, interpret, save_states)

    def zero_state(inject):
        return jnp.zeros(inject.shape[1:], jnp.float32)

    def forward(primals):
        *arrays, inject = primals
        (Y, _, S_in), saved = stages[0](*arrays, zero_state(inject), inject)
        return (Y, S_in), saved

    def backward(primals, saved, cotangents):
        *arrays, inject = primals
        dY, dS_in = cotangents
        *grads_, _, dinject = stages[1]((*arrays, zero_state(inject), inject), saved, dY, None,
                                        dS_in)
        return (*grads_, dinject)

    return generated.custom_vjp_core(forward, backward)


def channel_cores(loaded: dict, channel_intra, channel_grads):
    """A Pallas backend's ``(channel_core, channel_walk_core)``, each cached process-wide by
    its arguments: `channel_core` / `channel_walk_core` on the loaded per-channel build ``key``
    (sha256, interpret) of ``loaded``, with the backend's kernels ``channel_intra(key, gate,
    scale)`` and ``channel_grads(key, gate, scale)`` and ``walks``, the build's chunk walks
    (the packed build's for `channel_walk_core`, whose q arrives scaled)."""
    import functools

    @functools.cache
    def core(key: tuple, gate, scale: float, qk_norm: bool, walks: tuple,
             conv_chunk: int | None = None):
        kernels, convention = loaded[key], layer_inputs.convention(gate)
        return channel_core(channel_intra(key, convention, scale),
                            channel_grads(key, convention, scale), walks, gate, scale, qk_norm,
                            kernels.interpret, kernels.params["save_states"], conv_chunk)

    @functools.cache
    def walk_core(key: tuple, gate: str, walks: tuple):
        kernels = loaded[key]
        return channel_walk_core(channel_intra(key, gate, 1.0), channel_grads(key, gate, 1.0),
                                 walks, gate, kernels.interpret, kernels.params["save_states"])

    return core, walk_core
