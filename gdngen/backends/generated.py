"""What the generated backends share: for the JAX ones (`ffi_cpu`, `pallas_tpu`, `pallas_gpu`)
the custom-VJP core of their chunk kernels (`custom_vjp_core`, with the q/k norm and a
parameterised gate computed in it) and the result types of their kernel calls under
``jax.shard_map``; for all four (Metal too) the guard of the per-channel walks
(`refuse_injection`) and the returned-states calls on their kernels (`kernel_steps`,
`kernel_chunks`: the kernel's values, the portable path's VJP). The Pallas orchestration is
`gdngen.backends.pallas.backend`."""

from __future__ import annotations

from gdngen.algebra import chunkwise, layer_inputs, mixer
from gdngen.backends import fallback

# ------------------------------------------------------------------------------ checks


def refuse_injection(backend: str, injected) -> None:
    """Guard of a generated backend's dense per-channel chunk walks: ValueError unless
    ``injected`` (the walk's ``inject`` / ``dS_in``) is None (packed rows take the packed
    build's walks, which take them: `walk_states`)."""
    if injected is not None:
        raise ValueError(f"the {backend} dense per-channel chunk walks take no injected states "
                         "(packed rows run walks of their own)")


def walk_states(states, like, state, zeros):
    """A packed build's walk input ``inject`` / ``dS_in`` ``[N, B, Hk, r, Dv, Dk]`` (chunk
    layout): ``states`` itself, or where None (a sequence's one-chunk call, a walk without
    injections) ``zeros(shape)`` of that shape, N from ``like`` (a chunk-layout array), the
    rest from ``state`` (one state ``[B, Hk, r, Dv, Dk]``)."""
    if states is not None:
        return states
    return zeros(tuple(like.shape[:1]) + tuple(state.shape))


# ------------------------------------------------------------------------------ calling


def _kernel_valued(call, operands, kernel, portable):
    """``(y in q's dtype, states)`` of ``kernel(q, k, v, g, beta, S0)`` with the VJP of
    ``portable`` (same arguments: float32, masks folded into g and beta, a zero S0 when there is
    none; the ``recurrent_or_chunkwise`` of the call's framework,
    `gdngen.backends.portable.jax_chunkwise` or `gdngen.backends.portable.mlx_chunkwise`); masked
    steps give y = 0."""
    ops = fallback.ops(call.framework)
    shape, f32 = call.shape, ops.FLOAT32
    q, k, v, g, beta, initial_state, mask = operands[:7]
    if initial_state is None:
        initial_state = ops.zeros((shape.B, shape.Hv, shape.Dv, shape.Dk), f32)
    g, beta = layer_inputs.fold_mask(ops.XP, layer_inputs.cast_gates(g, f32), beta.astype(f32),
                                     mask, call.decay)
    y, states = ops.recurrent_or_chunkwise(kernel, portable)(
        q.astype(f32), k.astype(f32), v.astype(f32), g, beta, initial_state.astype(f32))
    if mask is not None:
        y = ops.XP.where(mask[..., None, None], y, 0.0)
    return y.astype(q.dtype), states


def kernel_chunks(call, operands, chunk_size: int, chunk_forward):
    """A ``return_states="chunks"`` `gdngen.call.Call` (layer inputs computed) through a
    backend's chunk forward kernel: ``chunk_forward(q, k, v, log_g, beta, S0) -> (y [B,T,Hv,Dv],
    final [B,Hv,Dv,Dk], entering [B, ceil(T/C), Hv, Dv, Dk])`` on float32 arrays of the call's
    framework, masks folded (log g 0, beta 0), q unscaled (``chunk_forward`` applies
    ``call.scale``), ``entering`` the states the walk enters each chunk of ``chunk_size`` with
    (`entering_forward` makes one from a chunk-layout core). The checkpoints are read from the
    walk (`gdngen.algebra.states.boundary_states`), nothing recomputed; the VJP is the portable
    chunk path's (`gdngen.backends.fallback.chunks`, run under the framework's vjp
    only). Returns ``(y in q's dtype, states [B, ceil(T/N), Hv, Dv, Dk] float32)``."""
    from gdngen.algebra import states

    xp = fallback.ops(call.framework).XP
    m = states.checkpoint_stride(call.checkpoint_every, chunk_size)

    def kernel(q, k, v, g, beta, S0):
        log_g = g if call.decay == "log" else xp.module.log(g)
        y, final, entering = chunk_forward(q, k, v, log_g, beta, S0)
        return y, states.boundary_states(xp, entering, final, m)

    def portable(q, k, v, g, beta, S0):  # the masks are folded into g and beta
        plain = operands._replace(q=q, k=k, v=v, g=g, beta=beta, initial_state=S0, mask=None)
        return fallback.chunks(call, plain, {"chunk_size": chunk_size})

    return _kernel_valued(call, operands, kernel, portable)


def entering_forward(call, chunk_size: int, core, *, core_scales: bool):
    """A `kernel_chunks` ``chunk_forward`` from ``core(q, k, v, log_gates, beta, S0) -> (Y,
    S_final, S_in)`` in the chunk layout of `gdngen.algebra.chunkwise.whole_sequence` (its
    ``entering`` core; S_in ``[N, B, Hk, r, Dv, Dk]``), which lays the call out in chunks
    around it. ``core_scales``: the core's kernels apply ``call.scale`` themselves."""
    ops = fallback.ops(call.framework)
    scale = 1.0 if core_scales else call.scale

    def chunk_forward(q, k, v, log_g, beta, S0):
        with ops.FLOAT32_MATMULS:
            return chunkwise.whole_sequence(ops.XP, core, q, k, v, log_g, beta, S0, None,
                                         scale=scale, gate="log", chunk_size=chunk_size,
                                         entering=True)

    return chunk_forward


def walk_chunk_forward(call, chunk_size: int, walk, intra=None):
    """`entering_forward` of per-channel gates whose sequential stage is a backend's walk
    kernel (``walk``: `gdngen.algebra.chunkwise_channel.walk_forward`'s contract): the entering
    states are the ones the kernel's walk writes. ``intra``: the backend's intra-chunk kernel
    (``intra(q, k, v, log_gates, beta) -> (U, Wk, Kc, Qd, Pm, Mkk, Tinv, dCC)``, q scaled
    before it: `gdngen.backends.pallas.core.channel_core`'s), the stages before the walk;
    None: `gdngen.algebra.chunkwise_channel`'s."""
    from gdngen.algebra import states

    xp = fallback.ops(call.framework).XP
    if intra is None:
        return entering_forward(call, chunk_size, states.entering_core(xp, "log", walk=walk),
                                core_scales=False)

    def core(q, k, v, log_g, beta, S0):
        U, Wk, Kc, Qd, Pm, _, _, dCC = intra(q, k, v, log_g, beta)
        Y, S_final, S_in, _ = walk(xp, S0, U, Wk, Kc, Qd, Pm, dCC)
        return Y, S_final, S_in

    return entering_forward(call, chunk_size, core, core_scales=False)


def kernel_steps(call, operands, recurrent):
    """A ``return_states="steps"`` `gdngen.call.Call` (layer inputs computed) through a
    backend's recurrent kernel that writes every step's state: ``recurrent(q, k, v, decay,
    beta, S0) -> (y [B,T,Hv,Dv], states [B,T,Hv,Dv,Dk])`` on float32 arrays of the call's
    framework, masks folded (decay 1, beta 0), ``decay`` linear. Its value is the kernel's; its
    VJP the portable step loop's (the framework's ``recurrent_gated_delta``, run under its vjp
    only). Returns ``(y in q's dtype, states float32)``; masked steps give y = 0."""
    ops = fallback.ops(call.framework)
    gate, scale = call.decay, call.scale

    def kernel(q, k, v, g, beta, S0):
        return recurrent(q, k, v, layer_inputs.linear_decay(ops.XP, g, gate), beta, S0)

    def portable(q, k, v, g, beta, S0):
        return ops.recurrent_gated_delta(q, k, v, g, beta, S0, scale=scale, gate=gate,
                                         steps=True)

    return _kernel_valued(call, operands, kernel, portable)


def result_type(shape, dtype, like):
    """The ``jax.ShapeDtypeStruct`` of a kernel result (an ``ffi_call`` or ``pallas_call``
    output) that varies over the manual axes of an enclosing ``jax.shard_map`` as ``like``
    does, so that under ``check_vma=True`` the custom VJP's cotangents have its primals' type."""
    from gdngen import jaxcompat

    return jaxcompat.result_struct(shape, dtype, like)


def l2_normalized(xp, x):
    """``x`` L2-normalised over its last axis in float32 and back in its own dtype: the fused
    ``qk_norm`` of a generated backend's chunk core (``xp`` the framework's namespace)."""
    return layer_inputs.l2_normalize(xp, x.astype(xp.module.float32)).astype(x.dtype)


def l2_normalized_vjp(xp, x, dx):
    """Cotangent of the raw ``x`` of `l2_normalized` from ``dx``, in ``x``'s dtype."""
    f32 = xp.module.float32
    return layer_inputs.l2_normalize_vjp(xp, x.astype(f32), dx.astype(f32)).astype(x.dtype)


def conv_inputs(xp, primals):
    """``primals`` with q, k, v convolved where they are conv tuples ``(x [B, T, H, D], w [H D,
    K], conv_state [B, H D, K-1] or None)`` (a ``conv`` core's; `gdngen.prepare.conv_parts`):
    ``silu(causal_conv(x))`` in x's dtype, x's shape (`conv_pullbacks` without the
    pullbacks)."""
    return conv_pullbacks(xp, primals)[0]


def conv_pullbacks(xp, primals):
    """``(primals convolved, pullbacks)``: the conv of each conv tuple computed once
    (`gdngen.algebra.mixer.conv_dense_pullback`), its pullback
    mapping the convolved input's cotangent to the tuple's ``(dx, dw, dconv_state or None)``
    (None for an input that is not a tuple)."""
    out, pullbacks = [], []
    for x in primals[:3]:
        if not isinstance(x, tuple):
            out.append(x)
            pullbacks.append(None)
            continue
        raw, w, state = x
        h, pullback = mixer.conv_dense_pullback(xp, raw.reshape((*raw.shape[:2], -1)), w, state)
        out.append(h.reshape(raw.shape))

        def tuple_pullback(d, raw=raw, pullback=pullback):
            draw, dw, dstate = pullback(d.reshape((*raw.shape[:2], -1)), None)
            return draw.reshape(raw.shape), dw, dstate

        pullbacks.append(tuple_pullback)
    return (*out, *primals[3:]), pullbacks


def norm_switch(plain, normed, eps: float, activation: str):
    """``call(args, z, w) -> (out, final_state)`` as a ``jax.custom_vjp``, ``out = rmsnorm(y) *
    w * act(z)`` (`gdngen.algebra.mixer.gated_norm`) of ``(y, final_state) = plain(*args)``.
    Not differentiated it runs ``normed(*args, z, w, norm_eps=eps)``, a kernel computing the
    norm in its stores (None: ``plain`` then the norm as array ops); differentiated, ``plain``
    and the norm, whose VJP keeps y, z and w and maps dy into ``plain``'s own VJP."""
    import jax

    from gdngen.algebra import mixer as stages
    from gdngen.backends.portable.jax_chunkwise import XP

    def unfused(args, z, w):
        y, state = plain(*args)
        return stages.gated_norm(XP, y, z, w, eps, activation), state

    @jax.custom_vjp
    def call(args, z, w):
        if normed is None:
            return unfused(args, z, w)
        return normed(*args, z, w, norm_eps=eps)

    def forward(args, z, w):
        (y, state), pull = jax.vjp(plain, *args)
        return (stages.gated_norm(XP, y, z, w, eps, activation), state), (pull, y, z, w)

    def backward(saved, cotangents):
        pull, y, z, w = saved
        dout, dstate = cotangents
        dy, dz, dw = stages.gated_norm_vjp(XP, y, z, w, eps, activation, dout)
        return pull((dy.astype(y.dtype), dstate)), dz, dw

    call.defvjp(forward, backward)
    return call


def undifferentiated(plain, fused):
    """``call(*args)`` as a ``jax.custom_vjp``: ``fused(*args)`` (a kernel computing more in
    its loads and stores) when not differentiated; differentiated, ``plain``, its value and its
    VJP (the backward runs what ``plain``'s does, nothing of ``fused``)."""
    import jax

    call = jax.custom_vjp(lambda *args: fused(*args))
    call.defvjp(lambda *args: jax.vjp(plain, *args), lambda pull, cotangents: pull(cotangents))
    return call


def chunk_layout(q, k, v, gates, beta, S0, *, gate, chunk_size: int) -> tuple:
    """The call's arrays (`whole_sequence_parts`' primals) in
    `gdngen.algebra.chunkwise.whole_sequence`'s own chunk layout (T padded to a multiple of
    ``chunk_size`` with identity steps; ``gate`` the gates' convention, or a ParameterGate
    for ``(a, A_log, dt_bias)``): the arrays it hands its chunk core."""
    import jax.numpy as jnp

    from gdngen.backends.portable.jax_chunkwise import XP

    taken = []

    def core(*chunked):
        taken.append(chunked)
        return jnp.zeros_like(chunked[2]), jnp.zeros_like(chunked[5])

    chunkwise.whole_sequence(XP, core, q, k, v, gates, beta, S0, None, scale=1.0, gate=gate,
                             chunk_size=chunk_size)
    return taken[-1]


def whole_sequence_parts(forward, backward, *, gate, forward_gate, chunk_size: int,
                         forward_convolves: bool = False):
    """``(forward, backward)`` over the call's layout (q, k, v ``[B, T, H, D]``, gates
    ``[B, T, Hv(, Dk)]`` or a ParameterGate's ``(a, A_log, dt_bias)``, beta ``[B, T, Hv]``, S0
    ``[B, Hv, Dv, Dk]``; masks folded, q unscaled) from a chunk-layout pair of
    `custom_vjp_core`'s contract: `gdngen.algebra.chunkwise.whole_sequence` lays the primals
    out (padding T to a multiple of ``chunk_size``) around ``forward``, and the backward maps
    the cotangents in and the chunk backward's gradients out through the same (linear) layout
    by its VJP, so the saved residuals are the chunk forward's own. ``forward_gate`` is the
    layout's gate convention of the forward's primals (a ParameterGate where its kernels take
    the raw projection), ``gate`` the backward's. ``forward_convolves``: q, k, v of the
    forward's primals are conv tuples ``(x, w, conv_state or None)``, whose raw x is laid out
    (zero rows padding T: identity steps, whatever their conv) and handed on in its tuple."""
    import jax
    import jax.numpy as jnp

    from gdngen.backends.portable.jax_chunkwise import XP

    def run(core, primals, convention):
        q, k, v, gates, beta, S0 = primals
        return chunkwise.whole_sequence(XP, core, q, k, v, gates, beta, S0, None, scale=1.0,
                                        gate=convention, chunk_size=chunk_size)

    def api_forward(primals):
        kept, parts = [], None
        if forward_convolves:  # lay out the raw x of each tuple, hand its conv operands on
            parts = [x[1:] for x in primals[:3]]
            primals = (*(x[0] for x in primals[:3]), *primals[3:])

        def core(*chunked):
            if parts is not None:
                chunked = (*((x, *p) for x, p in zip(chunked[:3], parts)), *chunked[3:])
            outputs, saved = forward(chunked)
            kept.append(saved)
            return outputs

        return run(core, primals, forward_gate), kept[0]

    def api_backward(primals, saved, cotangents):
        def lay(*arrays):  # the primals -> the chunk layout (whole_sequence's own)
            return chunk_layout(*arrays, gate=gate, chunk_size=chunk_size)

        chunked, pull = jax.vjp(lay, *primals)
        Y0, S0 = jnp.zeros_like(chunked[2]), jnp.zeros_like(chunked[5])
        _, unlay = jax.vjp(lambda Y, S: run(lambda *_: (Y, S), primals, gate), Y0, S0)
        dY, dS = unlay(tuple(c.astype(o.dtype) for c, o in zip(cotangents, (Y0, S0))))
        return pull(tuple(backward(chunked, saved, (dY, dS))))

    return api_forward, api_backward


def custom_vjp_core(forward, backward, qk_norm=False, gate=None, forward_fuses=False,
                    conv=False, forward_convolves=False, chunk_size=None):
    """``core(q, k, v, gates, beta, S0)`` (chunk layout) as a ``jax.custom_vjp`` from
    ``forward(primals) -> (outputs, saved)`` and ``backward(primals, saved, cotangents) ->
    cotangents of the primals``.

    ``conv``: q, k, v arrive as conv tuples ``(x, w, conv_state or None)`` (`conv_inputs`, a
    dense call's causal conv + SiLU); the core convolves them before anything else and keeps
    only the tuples (the raw inputs), its backward recomputes the conv behind the barrier below
    (once: `conv_pullbacks`) and maps ``backward``'s dq, dk, dv through its VJP, so no
    convolved q, k, v outlive the forward.

    ``qk_norm``: the core takes the raw q, k and L2-normalises them (float32, back in their
    dtype) before ``forward``; it keeps the raw ones, and its backward recomputes the normalised
    ones behind an optimisation barrier (not merged with the forward's) and maps ``backward``'s
    dq, dk through the norm's VJP (`gdngen.algebra.layer_inputs.l2_normalize_vjp`). For kernels
    whose
    ``saved`` holds no copy of q, k, so no normalised q, k outlive the forward. ``gate`` a
    `gdngen.algebra.layer_inputs.ParameterGate`: ``gates`` is ``(a, A_log, dt_bias)``; the core
    computes the log gate for ``forward`` (built for log gates) the same way, keeps only ``a`` and
    maps the log gate's cotangent to the three (`gdngen.algebra.layer_inputs.gates_vjp`).

    ``forward_fuses``: ``forward`` computes the norm and the log gate in its kernels' loads
    (`gdngen.backends.kernel_inputs`): it receives the raw primals (q, k raw, ``gates`` the
    ``(a, A_log, dt_bias)`` tuple); ``forward_convolves``: it also computes the conv in its
    loads (it receives the conv tuples). ``backward`` still receives the recomputed inputs.

    ``chunk_size``: ``forward`` and ``backward`` are over `gdngen.algebra.chunkwise`'s chunk
    layout, and the core over the call's (`whole_sequence_parts` lays the primals out inside
    it): a ``conv`` core of chunk kernels convolves in the call's layout, before the layout's
    padding, and keeps the conv tuples alone.
    """
    import jax

    from gdngen.backends.portable.jax_chunkwise import XP

    recomputes = conv or layer_inputs.computes_layer_inputs(qk_norm, gate)
    if chunk_size is not None:
        convention = layer_inputs.convention(gate) if gate is not None else "log"
        forward, backward = whole_sequence_parts(
            forward, backward, gate=convention, chunk_size=chunk_size,
            forward_gate=gate if forward_fuses and gate is not None else convention,
            forward_convolves=forward_convolves)

    def convolved(primals):
        return conv_inputs(XP, primals) if conv else primals

    def inputs(primals):
        q, k, v, gates, *rest = primals
        if qk_norm:
            q, k = l2_normalized(XP, q), l2_normalized(XP, k)
        return (q, k, v, layer_inputs.log_gates(XP, gates, gate)[0], *rest)

    def forward_inputs(primals):
        if not forward_convolves:
            primals = convolved(primals)
        return primals if forward_fuses else inputs(primals)

    @jax.custom_vjp
    def core(q, k, v, gates, beta, S0):
        return forward(forward_inputs((q, k, v, gates, beta, S0)))[0]

    def core_fwd(*primals):
        outputs, saved = forward(forward_inputs(primals))
        return outputs, (primals, saved)

    def core_bwd(residuals, cotangents):
        primals, saved = residuals
        if not recomputes:
            return backward(primals, saved, cotangents)
        primals = XP.barrier(primals)
        # q, k, v as the norm and the kernels' inputs take them (the conv recomputed once)
        raw, pullbacks = conv_pullbacks(XP, primals) if conv else (primals, None)
        dq, dk, dv, dgates, *rest = backward(inputs(raw), saved, cotangents)
        q, k, _, gates, *_ = raw
        if qk_norm:
            dq, dk = l2_normalized_vjp(XP, q, dq), l2_normalized_vjp(XP, k, dk)
        if conv:
            dq, dk, dv = (pullback(d) for pullback, d in zip(pullbacks, (dq, dk, dv)))
        return dq, dk, dv, layer_inputs.gates_vjp(XP, gates, gate, dgates), *rest

    core.defvjp(core_fwd, core_bwd)
    return core
