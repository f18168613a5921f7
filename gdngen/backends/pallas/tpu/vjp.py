"""pallas_tpu's custom-VJP side: the chunk layout of `gdngen.algebra.chunkwise` to and from the
kernels' ``[B, Hv, N, C, ...]`` blocks, the kernels' gradients to cotangents, and the cores
built on a loaded build (keyed by ``(sha256, interpret)``, cached process-wide): `chunk_core`,
`entering_core`, `packed_core`, `chunk_walks`, `channel_intra`, `channel_grads`,
`channel_core`, `channel_walk_core`, and the norm build's forward `normed_chunk`. `run_kernel`
runs a kernel with the interpret mode's race check."""

from __future__ import annotations

import functools

from gdngen import jaxcompat
from gdngen.algebra import layer_inputs
from gdngen.backends import generated
from gdngen.backends.kernel_inputs import KernelInputs
from gdngen.backends.pallas import core as pallas_core
from gdngen.backends.pallas.core import (
    call_jitted,
    call_sequential_under_vmap,
    fused_gate_operands,
    gate_cotangent,
    jit_pair,
)
from gdngen.backends.pallas.tpu.config import BACKEND, LOG_GATE_FLOOR
from gdngen.backends.pallas.tpu.kernels import LOADED


def _check_races(outputs, what: str, interpret) -> None:
    """Raise if TPU interpret mode's race detector flagged the kernel that produced
    ``outputs`` (only when they are concrete: under an outer jit the check is skipped)."""
    import jax

    if not getattr(interpret, "detect_races", False):
        return
    leaves = jax.tree.leaves(outputs)
    if any(isinstance(x, jax.core.Tracer) for x in leaves):
        return
    jax.block_until_ready(leaves)
    races = getattr(jaxcompat.tpu_interpreter(), "races", None)
    if races is not None and races.races_found:
        raise RuntimeError(f"TPU interpret mode detected a data race in the {what} kernel")


def run_kernel(fns, *args, what: str, interpret, **kwargs):
    """Run a kernel (``fns`` a `gdngen.backends.pallas.core.jit_pair`); in interpret mode check
    it for races, and reset the interpreter's shared state if it raised (jax requires that
    before the next kernel)."""
    try:
        outputs = call_sequential_under_vmap(fns, *args, interpret=interpret, **kwargs)
        _check_races(outputs, what, interpret)
    except Exception:
        if interpret:
            jaxcompat.pallas_tpu().reset_tpu_interpret_mode_state()
        raise
    return outputs


def _to_kernel_layout(q, k, v, gates, beta, S0, gate):
    """Chunk layout of `gdngen.algebra.chunkwise` (q, k [N, B, Hk, C, Dk]; v [N, B, Hk, r, C, Dv];
    gates, beta [N, B, Hk, r, C]; S0 [B, Hk, r, Dv, Dk]) -> the kernels' layout (see the
    forward template), as a dict."""
    return _kernel_layout(q, k, v, pallas_core.floored_log_gates(gates, gate, LOG_GATE_FLOOR),
                          beta, S0)


def _kernel_layout(q, k, v, per_step, beta, S0):
    """`_to_kernel_layout` with ``per_step`` [N, B, Hk, r, C] (the finite log gates, or a fused
    build's raw projection ``a``) laid out as ``g_col`` / ``g_row`` unchanged."""
    import jax.numpy as jnp

    B, Hk, r = v.shape[1:4]

    def keys(x):  # [N, B, Hk, C, Dk] (or with a unit value-head axis) -> [B, Hk, N, C, Dk]
        return jnp.moveaxis(x.reshape(x.shape[:3] + x.shape[-2:]), 0, 2)

    b = _to_heads(per_step)
    return {"q": keys(q), "k": keys(k), "v": _to_heads(v), "g_col": b[..., None],
            "g_row": b[..., None, :], "beta": _to_heads(beta)[..., None],
            "s0": S0.reshape((B, Hk * r) + S0.shape[-2:])}


def _to_fused_layout(q, k, v, gates, beta, S0, gate, inputs):
    """`_to_kernel_layout` for the fused forward kernel of ``inputs`` (raw primals of
    `gdngen.backends.generated.custom_vjp_core` with ``forward_fuses``): q, k as given (raw
    with ``qk_norm``); with a gate form ``gates`` is ``(a, A_log, dt_bias)`` (A_log, dt_bias
    ``[Hk, r, 1]``), ``g_col`` / ``g_row`` hold ``a`` (-inf kept: an identity step) and
    ``"gate"`` the operands after it (`gdngen.backends.pallas.core.fused_gate_operands`);
    otherwise ``gates`` in ``gate``'s convention, laid out as `_to_kernel_layout` does."""
    if inputs.gate_form is None:
        return dict(_to_kernel_layout(q, k, v, gates, beta, S0, gate), gate=())
    a, A_log, dt_bias = gates
    Hv, Dk = v.shape[2] * v.shape[3], k.shape[-1]
    return dict(_kernel_layout(q, k, v, a, beta, S0),
                gate=fused_gate_operands(inputs, A_log, dt_bias, Hv, Dk, False))


def _to_heads(x):
    """Chunk layout [N, B, Hk, r, C, ...] -> [B, Hv, N, C, ...]."""
    import jax.numpy as jnp

    x = jnp.moveaxis(x, 0, 3)
    return x.reshape((x.shape[0], x.shape[1] * x.shape[2]) + x.shape[3:])


def _from_heads(x, Hk):
    """[B, Hv, N, C, ...] -> chunk layout [N, B, Hk, r, C, ...]."""
    import jax.numpy as jnp

    B, Hv = x.shape[:2]
    return jnp.moveaxis(x.reshape((B, Hk, Hv // Hk) + x.shape[2:]), 3, 0)


def _gate_cotangent(gates, gate, dd11, dd0, ddc, ddcc):
    """d(gates) from the kernels' decay-factor cotangents, by the straddle-sum rule of
    `gdngen.algebra.chunkwise` (``decay_factors_log_vjp`` / ``decay_factors_linear_vjp``: exact at
    g = 0). Inputs [B, Hv, N, ...]; gates in their own convention."""
    import jax.numpy as jnp

    rows = jnp.concatenate([dd0, dd11], axis=-1)  # positions 1..C of dD, columns 0..C
    last = rows[..., -1, :] + jnp.concatenate([ddcc[..., 0, :], ddc[..., 0]], axis=-1)
    dD = jnp.concatenate([jnp.zeros(rows.shape[:-2] + (1, rows.shape[-1]), rows.dtype),
                          rows[..., :-1, :], last[..., None, :]], axis=-2)
    return gate_cotangent(gates, gate, dD)


def _cotangents(primals, grads, gate):
    """The kernels' gradients -> cotangents of the core's primals (chunk layout, their dtypes)."""
    import jax.numpy as jnp

    q, k, v, gates, _, S0 = primals
    dq, dk, dv, dbeta, dd11, dd0, ddc, ddcc, ds0 = grads
    B, Hk = v.shape[1:3]

    def key_grad(x, like):  # [B, Hk * tiles, N, C, Dk] partials -> chunk layout
        x = x.reshape((B, Hk, -1) + x.shape[2:]).sum(axis=2)
        return jnp.moveaxis(x, 2, 0).reshape(like.shape).astype(like.dtype)

    dgates = _gate_cotangent(_to_heads(gates), gate, dd11, dd0, ddc, ddcc)
    return (key_grad(dq, q), key_grad(dk, k), _from_heads(dv, Hk).astype(v.dtype),
            _from_heads(dgates, Hk), _from_heads(dbeta[..., 0], Hk), ds0.reshape(S0.shape))


@functools.cache
def chunk_core(key: tuple, gate, scale: float, qk_norm: bool = False,
               fused_key: tuple | None = None, conv_chunk: int | None = None,
               forward_convolves: bool = False):
    """`gdngen.algebra.chunkwise` core (chunk layout in and out) on the loaded kernels ``key``
    (sha256, interpret parameters), the generated backward as its ``jax.custom_vjp``
    (`gdngen.backends.generated.custom_vjp_core`; the backward lays the primals out again).
    ``fused_key``: the loaded fused build of ``qk_norm`` and ``gate`` (a convention or a
    `gdngen.algebra.layer_inputs.ParameterGate`), whose forward takes the raw primals; the
    backward runs the plain kernels on the recomputed inputs.
    ``conv_chunk``: the core of a conv call (``gated_delta(..., conv_weight=)``), over the call's
    layout with chunks of ``conv_chunk`` (its kernels'): q, k, v arrive as conv tuples, are
    convolved in it and only the tuples are kept for the backward
    (`gdngen.backends.generated.custom_vjp_core` with ``conv`` and ``chunk_size``).
    ``forward_convolves``: ``fused_key`` is a conv build, whose forward kernel convolves the
    raw q, k, v of the tuples in its loads (`_conv_parts_halos`); the backward recomputes
    them."""
    import jax.numpy as jnp

    parameter_gate, gate = gate, layer_inputs.convention(gate)  # the kernels take log gates
    kernels = LOADED[key]
    interpret = kernels.interpret
    prepare = jit_pair(functools.partial(_to_kernel_layout, gate=gate), (), interpret)
    finish = jit_pair(functools.partial(_cotangents, gate=gate), (), interpret)

    def forward_outputs(y, s_final, v, S0):
        return _from_heads(y, v.shape[2]), s_final.reshape(S0.shape)

    def backward_inputs(dY, dS_final, v, s0):
        return _to_heads(dY).astype(v.dtype), dS_final.reshape(s0.shape).astype(jnp.float32)

    forward_outputs = jit_pair(forward_outputs, (), interpret)
    backward_inputs = jit_pair(backward_inputs, (), interpret)

    if fused_key is None:
        run_forward, what = kernels.run_forward, "forward"
    else:
        run_forward, what = LOADED[fused_key].run_forward, "fused forward"
        fused_layout = functools.partial(_to_fused_layout, gate=gate,
                                         inputs=KernelInputs.of(qk_norm, parameter_gate))
        if forward_convolves:  # the raw q, k, v of the conv tuples, their halos and taps
            def fused_layout(q, k, v, *rest, layout=fused_layout):
                lay = layout(q[0], k[0], v[0], *rest)
                halos = _conv_parts_halos((lay["q"], lay["k"], lay["v"]),
                                          [x[1:] for x in (q, k, v)])
                return dict(lay, gate=(*lay["gate"], *halos))

        prepare_forward = jit_pair(fused_layout, (), interpret)

    def forward(primals):
        lay = call_jitted(prepare if fused_key is None else prepare_forward, *primals)
        outs = run_kernel(run_forward, lay["q"], lay["k"], lay["v"], lay["g_col"],
                           lay["g_row"], lay["beta"], lay["s0"], *lay.get("gate", ()),
                           scale=scale, what=what, interpret=interpret)
        v = primals[2][0] if forward_convolves else primals[2]
        return (call_jitted(forward_outputs, outs[0], outs[1], v, primals[5]),
                tuple(outs[2:]))

    def backward(primals, saved, cotangents):
        lay = call_jitted(prepare, *primals)
        if kernels.params["save_states"]:
            s_in, tinv = saved
            extra = (tinv,)
        else:
            s_in = run_kernel(kernels.run_chunk_states, lay["k"], lay["v"], lay["g_col"],
                               lay["g_row"], lay["beta"], lay["s0"], what="chunk-state",
                               interpret=interpret)
            extra = ()
        dy, dsf = call_jitted(backward_inputs, *cotangents, lay["v"], lay["s0"])
        grads = run_kernel(kernels.run_backward, lay["q"], lay["k"], lay["v"], lay["g_col"],
                            lay["g_row"], lay["beta"], s_in, *extra, dy, dsf, scale=scale,
                            what="backward", interpret=interpret)
        return call_jitted(finish, primals, grads)

    return generated.custom_vjp_core(forward, backward, qk_norm, parameter_gate,
                                     forward_fuses=fused_key is not None,
                                     conv=conv_chunk is not None,
                                     forward_convolves=forward_convolves, chunk_size=conv_chunk)


@functools.cache
def entering_core(key: tuple, scale: float):
    """``core(q, k, v, log_gates, beta, S0) -> (Y, S_final, S_in)`` in the chunk layout of
    `gdngen.algebra.chunkwise.whole_sequence` (its ``entering`` core; S_in ``[N, B, Hk, r, Dv,
    Dk]``) on the loaded ``save_states`` kernels ``key`` (sha256, interpret): one forward kernel
    call, its saved entering states returned. Forward only (`PallasBackend.chunks` takes the
    portable VJP)."""
    kernels = LOADED[key]
    interpret = kernels.interpret
    if not kernels.params["save_states"]:
        raise ValueError("entering_core needs a save_states build (its forward keeps S_in)")
    prepare = jit_pair(functools.partial(_to_kernel_layout, gate="log"), (), interpret)

    def outputs(y, s_final, s_in, v, S0):
        return _from_heads(y, v.shape[2]), s_final.reshape(S0.shape), _from_heads(s_in,
                                                                                  v.shape[2])

    outputs = jit_pair(outputs, (), interpret)

    def core(*primals):
        lay = call_jitted(prepare, *primals)
        y, s_final, s_in = run_kernel(
            kernels.run_forward, lay["q"], lay["k"], lay["v"], lay["g_col"], lay["g_row"],
            lay["beta"], lay["s0"], scale=scale, what="forward", interpret=interpret)[:3]
        return call_jitted(outputs, y, s_final, s_in, primals[2], primals[5])

    return core


def _packed_layout(q, k, v, gates, beta, inject, gate):
    """`_to_kernel_layout` of a packed walk (zero s0) plus ``inject`` [N, B, Hk, r, Dv, Dk]
    -> [B, Hv, N, Dv, Dk]."""
    import jax.numpy as jnp

    lay = _to_kernel_layout(q, k, v, gates, beta, jnp.zeros(inject.shape[1:], jnp.float32),
                            gate)
    lay["inject"] = _to_heads(inject)
    return lay


def _packed_cotangents(primals, grads, gate):
    """The packed backward's gradients -> cotangents of ``(q, k, v, gates, beta, inject)``."""
    *front, inject = primals
    Hk = inject.shape[2]
    return (*_cotangents((*front, inject[0]), grads[:-1], gate)[:5],
            _from_heads(grads[-1], Hk))


@functools.cache
def packed_core(key: tuple, gate: str):
    """The ``packed_core(q, k, v, gates, beta, inject) -> (Y, S_in)`` of
    `gdngen.algebra.packed.chunk_walk` on the loaded packed kernels ``key`` (sha256, interpret
    parameters): chunk layout (q already scaled), from a zero state, ``inject`` and ``S_in``
    ``[N, B, Hk, r, Dv, Dk]`` float32; the packed backward kernel as its ``jax.custom_vjp``
    (cotangents of every input, ``inject``'s the state cotangent leaving each chunk)."""
    import jax.numpy as jnp

    kernels = LOADED[key]
    interpret = kernels.interpret
    prepare = jit_pair(functools.partial(_packed_layout, gate=gate), (), interpret)
    finish = jit_pair(functools.partial(_packed_cotangents, gate=gate), (), interpret)

    def forward_outputs(y, s_in, Hk):
        return _from_heads(y, Hk), _from_heads(s_in, Hk)

    def backward_inputs(dY, dS_in, v, s0):
        return (_to_heads(dY).astype(v.dtype), jnp.zeros(s0.shape, jnp.float32),
                _to_heads(dS_in).astype(jnp.float32))

    forward_outputs = jit_pair(forward_outputs, ("Hk",), interpret)
    backward_inputs = jit_pair(backward_inputs, (), interpret)

    def forward(primals):
        lay = call_jitted(prepare, *primals)
        y, _, s_in, *tinv = run_kernel(
            kernels.run_forward, lay["q"], lay["k"], lay["v"], lay["g_col"], lay["g_row"],
            lay["beta"], lay["s0"], lay["inject"], scale=1.0, what="packed forward",
            interpret=interpret)
        saved = (s_in, *tinv) if kernels.params["save_states"] else ()
        return call_jitted(forward_outputs, y, s_in, Hk=primals[0].shape[2]), (lay, saved)

    def backward(primals, saved_forward, cotangents):
        lay, saved = saved_forward
        if not saved:  # the variant recomputes the entering states (injection included)
            saved = (run_kernel(kernels.run_chunk_states, lay["k"], lay["v"], lay["g_col"],
                                 lay["g_row"], lay["beta"], lay["s0"], lay["inject"],
                                 what="packed chunk-state", interpret=interpret),)
        dy, dsf, dsin = call_jitted(backward_inputs, *cotangents, lay["v"], lay["s0"])
        grads = run_kernel(kernels.run_backward, lay["q"], lay["k"], lay["v"], lay["g_col"],
                            lay["g_row"], lay["beta"], *saved, dy, dsf, dsin, scale=1.0,
                            what="packed backward", interpret=interpret)
        return call_jitted(finish, primals, grads)

    return generated.custom_vjp_core(forward, backward)


def _heads_merged(x, axis):
    """``x`` with its key-head axis ``axis`` and the next (r) merged into one Hv axis."""
    return x.reshape(x.shape[:axis] + (x.shape[axis] * x.shape[axis + 1],) + x.shape[axis + 2:])


@functools.cache
def chunk_walks(key: tuple):
    """``(walk_forward, walk_backward)`` on the loaded per-channel kernels ``key`` (sha256,
    interpret parameters): ``walk_forward`` with the signature and contract of
    `gdngen.algebra.chunkwise_channel.walk_forward`, ``walk_backward`` with those of
    `gdngen.backends.pallas.core.channel_walk_backward` (chunk layout [N, B, Hk, r, ...],
    float32): the forward and backward templates rendered with ``per_channel``, each one
    ``pallas_call`` walking the chunks in order (in reverse) with the state (its cotangent) in
    VMEM. Only the value heads are merged (reshapes, no transposes). ``inject`` / ``dS_in``
    (packed rows) are taken by the packed build's walks (`render_packed`; zeros where None),
    refused by the dense build's."""
    import jax.numpy as jnp

    kernels = LOADED[key]
    interpret = kernels.interpret
    packed = getattr(kernels, "packed", False)

    def zeros(shape):
        return jnp.zeros(shape, jnp.float32)

    def walk_forward(xp, S0, U, Wk, Kc, Qd, Pm, dCC, inject=None):
        del xp  # the kernels' own arrays
        if not packed:
            generated.refuse_injection(BACKEND, inject)
        states_in = ((_heads_merged(generated.walk_states(inject, U, S0, zeros), 2),)
                     if packed else ())
        y, s_final, s_in, w = run_kernel(
            kernels.run_forward, *(_heads_merged(x, 2) for x in (U, Wk, Kc, Qd, Pm,
                                                                 dCC[..., None, :])),
            _heads_merged(S0, 1), *states_in, what="per-channel forward walk",
            interpret=interpret)
        return (y.reshape(U.shape), s_final.reshape(S0.shape),
                s_in.reshape(U.shape[:4] + S0.shape[-2:]), w.reshape(U.shape))

    def walk_backward(dS_final, Pm, q, k, gates, Wk, W, S_in, dY, dS_in=None, *, gate, scale):
        if not packed:
            generated.refuse_injection(BACKEND, dS_in)
        states_in = ((_heads_merged(generated.walk_states(dS_in, W, dS_final, zeros), 2),)
                     if packed else ())
        dw, dwk, dqd, dkc, ddcc, ds0, *dinject = run_kernel(
            kernels.run_backward, _heads_merged(Pm, 2), _key_heads(q), _key_heads(k),
            _log_gates(gates, gate),
            *(_heads_merged(x, 2) for x in (Wk, W, S_in, dY)), _heads_merged(dS_final, 1),
            *states_in, scale=scale, what="per-channel backward walk", interpret=interpret)
        dJ = dinject[0].reshape(S_in.shape) if dinject and dS_in is not None else None
        return (ds0.reshape(dS_final.shape), dw.reshape(W.shape), dwk.reshape(Wk.shape),
                dqd.reshape(Wk.shape), dkc.reshape(Wk.shape),
                ddcc.reshape(Wk.shape[:4] + Wk.shape[-1:]), dJ)

    return walk_forward, walk_backward


def _key_heads(x):
    """q or k of the chunk layout [N, B, Hk, (1,) C, Dk] -> the kernels' [N, B, Hk, C, Dk]."""
    return x.reshape(x.shape[:3] + x.shape[-2:])


def _log_gates(gates, gate):
    """The chunk layout's gates [N, B, Hk, r, C, Dk] (convention ``gate``) -> the kernels' finite
    log gates [N, B, Hv, C, Dk] (clamped to `LOG_GATE_FLOOR`: exp gives 0 either way)."""
    return _heads_merged(pallas_core.floored_log_gates(gates, gate, LOG_GATE_FLOOR), 2)


def _channel_intra_layout(q, k, v, gates, beta, *conv, gate):
    """The intra-chunk kernel's inputs from the chunk layout (q, k [N, B, Hk, (1,) C, Dk]; v,
    gates, beta [N, B, Hk, r, C, ...]): the value heads merged, the gates as finite log gates,
    beta a column; ``conv`` ``(conv_weight [C, K], conv_state [B, C, K-1] or None)`` (a conv
    build's, raw q, k, v): then their halos and taps (`_conv_halos`)."""
    q, k, v = _key_heads(q), _key_heads(k), _heads_merged(v, 2)
    halos = _conv_halos((q, k, v), *conv, chunk_axis=0) if conv else ()
    return (q, k, v, _log_gates(gates, gate), _heads_merged(beta, 2)[..., None], *halos)


def _channel_intra_outputs(outputs, Hk):
    """The intra-chunk kernel's outputs [N, B, Hv, ...] -> chunk layout [N, B, Hk, r, ...] (dCC
    [N, B, Hk, r, Dk])."""
    *square, dcc = outputs

    def split(x):
        return x.reshape(x.shape[:2] + (Hk, x.shape[2] // Hk) + x.shape[3:])

    return (*(split(x) for x in square), split(dcc)[..., 0, :])


@functools.cache
def channel_intra(key: tuple, gate: str, scale: float):
    """``intra(q, k, v, gates, beta) -> (U, Wk, Kc, Qd, Pm, M_kk, T, dCC)``: the intra-chunk
    kernel (``intra`` of the forward template) of the loaded per-channel kernels ``key``
    (sha256, interpret parameters) in the chunk layout of `gdngen.algebra.chunkwise_channel`
    (float32; q unscaled, ``scale`` applied in the kernel; gates in the convention ``gate``):
    the stages of its ``forward`` before the walk. A conv build's takes raw q, k, v and ``conv
    = (conv_weight, conv_state or None)`` (`_channel_intra_layout`)."""
    kernels = LOADED[key]
    interpret = kernels.interpret
    prepare = jit_pair(functools.partial(_channel_intra_layout, gate=gate), (), interpret)
    finish = jit_pair(_channel_intra_outputs, ("Hk",), interpret)

    def intra(q, k, v, gates, beta, conv=()):
        outputs = run_kernel(kernels.run_intra, *call_jitted(prepare, q, k, v, gates, beta,
                                                             *conv),
                             scale=scale, what="per-channel intra-chunk", interpret=interpret)
        return call_jitted(finish, tuple(outputs), Hk=q.shape[2])

    return intra


def _channel_grads_layout(q, k, v, gates, beta, W, Tinv, Mkk, dY, dW, dWk, dQd, dKc, ddCC, *,
                          gate):
    """The grads kernel's inputs from the chunk layout: `_channel_intra_layout`'s five, then
    the value-head arrays merged (ddCC [N, B, Hv, 1, Dk])."""
    merged = (_heads_merged(x, 2) for x in (W, Tinv, Mkk, dY, dW, dWk, dQd, dKc))
    return (*_channel_intra_layout(q, k, v, gates, beta, gate=gate), *merged,
            _heads_merged(ddCC, 2)[..., None, :])


def _channel_grads_outputs(outputs, q, gates, gate):
    """The grads kernel's outputs -> the cotangents of ``(q, k, v, gates, beta)`` in the chunk
    layout (dq, dk summed over each key head's value heads; linear gates: db / g, the
    exact-zero rule's dz where g == 0)."""
    import jax.numpy as jnp

    dq, dk, dv, db, dbeta, *dz = outputs
    Hk = q.shape[2]

    def split(x):
        return x.reshape(x.shape[:2] + (Hk, x.shape[2] // Hk) + x.shape[3:])

    def key_sum(x):
        return split(x).sum(axis=3).reshape(q.shape)

    if gate == "log":
        dgates = split(db)
    else:
        zero = gates == 0.0
        dgates = jnp.where(zero, split(dz[0]), split(db) / jnp.where(zero, 1.0, gates))
    return key_sum(dq), key_sum(dk), split(dv), dgates, split(dbeta)[..., 0]


@functools.cache
def channel_grads(key: tuple, gate: str, scale: float):
    """``grads(q, k, v, gates, beta, W, Tinv, Mkk, dY, dW, dWk, dQd, dKc, ddCC) -> (dq, dk, dv,
    dgates, dbeta)``: the grads kernel (``grads`` of the backward template) of the loaded
    per-channel kernels ``key`` in the chunk layout of `gdngen.algebra.chunkwise_channel`
    (its ``backward_in_chunks``; q unscaled and dq its cotangent, gates in the convention
    ``gate``)."""
    kernels = LOADED[key]
    interpret = kernels.interpret
    prepare = jit_pair(functools.partial(_channel_grads_layout, gate=gate), (), interpret)
    finish = jit_pair(functools.partial(_channel_grads_outputs, gate=gate), (), interpret)

    def grads(q, k, v, gates, beta, *rest):
        outputs = run_kernel(kernels.run_grads, *call_jitted(prepare, q, k, v, gates, beta,
                                                             *rest),
                             scale=scale, linear=gate == "linear",
                             what="per-channel intra-chunk backward", interpret=interpret)
        return call_jitted(finish, tuple(outputs), q, gates)

    return grads


#: the per-channel chunk cores on a loaded build (`gdngen.backends.pallas.core.channel_core`,
#: ``channel_core(key, gate, scale, qk_norm, walks)``, and the packed build's
#: `gdngen.backends.pallas.core.channel_walk_core`, ``channel_walk_core(key, gate, walks)``):
#: `channel_intra`, `channel_grads` and the build's `chunk_walks`
channel_core, channel_walk_core = pallas_core.channel_cores(LOADED, channel_intra, channel_grads)


# ----------------------------------------------------------------------------- entry point


def _normed_layout(q, k, v, gates, beta, S0, z, norm_weight, *conv, gate, inputs, chunk):
    """A dense call's arrays (the call's layout, masks folded; ``gates`` in ``gate``'s
    convention or, with a gate form, ``(a, A_log, dt_bias)``) -> the norm build's forward
    operands: q, k, v, the gates and beta in the kernels' chunk blocks (`_to_fused_layout` of
    `gdngen.algebra.chunkwise.whole_sequence`'s chunk layout, T padded with identity steps),
    and z in the call's own layout, T padded: ``[B, N, C, Hv * Dv]``, a free reshape where T is
    a multiple of the chunk. ``conv`` ``(conv_weight [C, K], conv_state [B, C, K-1] or None)``
    (a conv build's): q, k, v stay raw, and each one's halos and taps (`_conv_halos`) follow
    the gate's operands."""
    chunked = generated.chunk_layout(q, k, v, gates, beta, S0, gate=gate, chunk_size=chunk)
    if inputs is None:  # per-channel gates: the chunk layout itself (the intra-chunk kernel's)
        return (*chunked, _call_rows(z, chunk), norm_weight)
    lay = _to_fused_layout(*chunked, layer_inputs.convention(gate), inputs)
    halos = _conv_halos((lay["q"], lay["k"], lay["v"]), *conv) if conv else ()
    return (lay["q"], lay["k"], lay["v"], lay["g_col"], lay["g_row"], lay["beta"], lay["s0"],
            *lay["gate"], *halos, _call_rows(z, chunk), norm_weight)


#: raw rows before each chunk in a conv build's halo blocks (the template's HALO: a sublane tile)
CONV_HALO = 8


def _conv_halos(qkv, weight, state, *, chunk_axis=2):
    """`_conv_parts_halos` of the whole ``conv_weight [C, K]`` and ``conv_state [B, C, K-1]``
    (or None), q, k, v's channels in that order."""
    bounds, lo = [], 0
    for x in qkv:
        width = x.shape[1 if chunk_axis == 2 else 2] * x.shape[-1]  # H * D
        bounds.append((lo, lo + width))
        lo += width
    return _conv_parts_halos(qkv, [(weight[a:b], None if state is None else state[:, a:b])
                                   for a, b in bounds], chunk_axis=chunk_axis)


def _conv_parts_halos(qkv, parts, *, chunk_axis=2):
    """A conv build's operands after the gate's: ``halo_q, halo_k [B, Hk, N, HALO, Dk]``,
    ``halo_v [B, Hv, N, HALO, Dv]``, the `CONV_HALO` raw rows before each chunk (chunk 0's:
    zeros, then the conv state's K - 1 rows, oldest first; chunk n's: chunk n - 1's last rows),
    then the taps ``taps_q, taps_k [Hk, KP, Dk]``, ``taps_v [Hv, KP, Dv]``, all float32 (the
    conv state not rounded to the inputs' dtype, as the plain path's conv reads it), zero taps
    first (KP = `CHUNK_CONV_TAPS`). ``qkv``: the raw q, k, v in the kernels' chunk blocks
    ``[B, H, N, C, D]`` (T padded at the end: no halo reads the padding); with ``chunk_axis``
    0, ``[N, B, H, C, D]`` (the per-channel intra kernel's), and the halos likewise. ``parts``:
    each input's ``(w [H D, K], conv_state [B, H D, K-1] or None)`` (`gdngen.prepare.
    conv_parts`)."""
    import jax.numpy as jnp

    from gdngen.backends.pallas.backend import CHUNK_CONV_TAPS as KP

    f32 = jnp.float32
    halos, taps = [], []
    for x, (weight, state) in zip(qkv, parts):
        K = weight.shape[1]
        if K > KP or K - 1 > CONV_HALO:
            raise ValueError(f"conv_weight has {K} taps, expected at most {KP} for the chunk "
                             f"forward's conv build")
        x = jnp.moveaxis(x, chunk_axis, 2)
        B, H, _, C, D = x.shape
        w = weight.astype(f32).reshape(H, D, K).transpose(0, 2, 1)
        taps.append(jnp.pad(w, ((0, 0), (KP - K, 0), (0, 0))))
        before = (jnp.zeros((B, H, K - 1, D), f32) if state is None else
                  state.reshape(B, H, D, K - 1).swapaxes(2, 3).astype(f32))
        first = jnp.pad(before, ((0, 0), (0, 0), (CONV_HALO - (K - 1), 0), (0, 0)))
        halos.append(jnp.moveaxis(jnp.concatenate(
            [first[:, :, None], x[:, :, :-1, C - CONV_HALO:].astype(f32)], axis=2), 2,
            chunk_axis))
    return (*halos, *taps)


def _call_rows(z, chunk):
    """z ``[B, T, Hv, Dv]`` as the norm builds read it: ``[B, N, C, Hv * Dv]``, T padded to
    the chunk (a free reshape where T is a multiple of it)."""
    import jax.numpy as jnp

    B, T, Hv, Dv = z.shape
    pad = -T % chunk
    z = jnp.pad(z, ((0, 0), (0, pad), (0, 0), (0, 0))) if pad else z
    return z.reshape(B, (T + pad) // chunk, chunk, Hv * Dv)


@functools.cache
def normed_chunk(key: tuple, gate, scale: float, qk_norm: bool = False):
    """``call(q, k, v, gates, beta, S0, z, norm_weight, *, norm_eps) -> (out [B, T, Hv, Dv],
    S_final [B, Hv, Dv, Dk])``, forward only: the chunk forward of the loaded norm build
    ``key`` (sha256, interpret; `render_fused` with ``norm``), which normalises each head's
    chunk rows in its stores and writes them, like it reads z, in the call's layout
    (`_normed_layout`; per-channel gates: `_normed_channel`). ``gate`` a convention or a
    `gdngen.algebra.layer_inputs.ParameterGate`
    (``gates`` then ``(a, A_log, dt_bias)``); q, k raw with ``qk_norm``; q unscaled; q, k, v
    in the problem's dtype, the rest float32; masks folded. A conv build's call takes ``conv
    = (conv_weight [C, K], conv_state [B, C, K-1] or None)`` and raw q, k, v, which its kernel
    convolves in its loads (scalar gates)."""
    kernels = LOADED[key]
    interpret = kernels.interpret
    if kernels.problem.gate == "vector":
        return _normed_channel(key, gate, scale, qk_norm)
    prepare = jit_pair(functools.partial(
        _normed_layout, gate=gate, inputs=KernelInputs.of(qk_norm, gate),
        chunk=kernels.params["chunk_size"]), (), interpret)

    def call(q, k, v, gates, beta, S0, z, norm_weight, *, norm_eps, conv=()):
        B, T, Hv, Dv = v.shape
        out, s_final = run_kernel(
            kernels.run_forward, *call_jitted(prepare, q, k, v, gates, beta, S0, z, norm_weight,
                                              *conv),
            scale=scale, what="chunk forward (norm build)", interpret=interpret,
            norm_eps=norm_eps)
        return out.reshape(B, -1, Hv, Dv)[:, :T], s_final

    return call


def _normed_channel(key: tuple, gate, scale: float, qk_norm: bool):
    """`normed_chunk` of a per-channel norm build: the intra-chunk kernel (`channel_intra`, on
    the chunk layout; a conv build's convolves the raw q, k, v and forms the q/k norm in its
    loads), then the walk, which writes the gated norm of y, like it reads z, in the call's
    layout (no W, no entering states: forward only)."""
    kernels = LOADED[key]
    interpret, chunk, convention = (kernels.interpret, kernels.params["chunk_size"],
                                    layer_inputs.convention(gate))
    # a conv build's intra kernel convolves, then normalises q, k in its loads
    inputs = {raw: jit_pair(functools.partial(pallas_core.channel_layer_inputs, gate=gate,
                                              qk_norm=qk_norm and not raw), (), interpret)
              for raw in (False, True)}
    prepare = jit_pair(functools.partial(_normed_layout, gate=convention, inputs=None,
                                         chunk=chunk), (), interpret)
    intra = channel_intra(key, convention, scale)

    def call(q, k, v, gates, beta, S0, z, norm_weight, *, norm_eps, conv=()):
        B, T, Hv, Dv = v.shape
        q, k, log_g = call_jitted(inputs[bool(conv)], q, k, gates)
        q, k, v, log_g, beta, S0, z, norm_weight = call_jitted(
            prepare, q.astype("float32"), k.astype("float32"), v.astype("float32"), log_g, beta,
            S0, z, norm_weight)
        # no M_kk, T: forward only
        U, Wk, Kc, Qd, Pm, dCC = intra(q, k, v, log_g, beta, conv)
        out, s_final = run_kernel(
            kernels.run_forward, *(_heads_merged(x, 2) for x in (U, Wk, Kc, Qd, Pm,
                                                                 dCC[..., None, :])),
            _heads_merged(S0, 1), z, norm_weight, what="per-channel forward walk (norm build)",
            interpret=interpret, norm_eps=norm_eps)
        return out.reshape(B, -1, Hv, Dv)[:, :T], s_final.reshape(B, Hv, Dv, -1)

    return call
