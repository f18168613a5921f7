"""pallas_gpu's custom-VJP side: the chunk layout of `gdngen.algebra.chunkwise` to and from the
kernels' time-row layout (``[B, T, H, D]`` / ``[B, Hv, T]``, head dims zero-padded to 16), the
kernels' gradients to cotangents, and the cores built on a loaded build (keyed by
``(sha256, interpret)``, cached process-wide): `chunk_core`, `entering_core`, `packed_core`,
`chunk_walks`, `channel_intra`, `channel_grads`, `channel_core`, `channel_walk_core`, and the
norm build's call-layout forward `normed_chunk`."""

from __future__ import annotations

import functools

from gdngen.algebra import layer_inputs
from gdngen.backends import generated
from gdngen.backends.kernel_inputs import KernelInputs
from gdngen.backends.pallas import core as pallas_core
from gdngen.backends.pallas.core import (
    call_jitted,
    fused_gate_operands,
    gate_cotangent,
    jit_pair,
)
from gdngen.backends.pallas.gpu.config import BACKEND, LOG_GATE_FLOOR
from gdngen.backends.pallas.gpu.kernels import LOADED


def pad_last(x, size: int, axis: int = -1):
    import jax.numpy as jnp

    extra = size - x.shape[axis]
    if not extra:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths)


def _keys_to_kernel(x, dk):
    """Chunk layout [N, B, Hk, C, Dk] -> [B, T, Hk, DK] (zero-padded head dim)."""
    N, B, Hk, C, Dk = x.shape
    return pad_last(x.transpose(1, 0, 3, 2, 4).reshape(B, N * C, Hk, Dk), dk)


def _values_to_kernel(x, dv):
    """Chunk layout [N, B, Hk, r, C, Dv] -> [B, T, Hv, DV]."""
    N, B, Hk, r, C, Dv = x.shape
    return pad_last(x.transpose(1, 0, 4, 2, 3, 5).reshape(B, N * C, Hk * r, Dv), dv)


def _values_from_kernel(x, like):
    """[B, T, Hv, DV] -> chunk layout [N, B, Hk, r, C, Dv] of ``like``."""
    N, B, Hk, r, C, Dv = like.shape
    return x[..., :Dv].reshape(B, N, C, Hk, r, Dv).transpose(1, 0, 3, 4, 2, 5)


def _per_step_to_kernel(x):
    """Chunk layout [N, B, Hk, r, C] -> [B, Hv, T]."""
    N, B, Hk, r, C = x.shape
    return x.transpose(1, 2, 3, 0, 4).reshape(B, Hk * r, N * C)


def _per_step_from_kernel(x, like):
    """[B, Hv, T] (or [B, Hv, N, C]) -> chunk layout [N, B, Hk, r, C] of ``like``."""
    N, B, Hk, r, C = like.shape
    return x.reshape(B, Hk, r, N, C).transpose(3, 0, 1, 2, 4)


def states_to_kernel(x, dk, dv):
    """[B, Hk, r, Dv, Dk] -> [B, Hv, DV, DK]."""
    B, Hk, r, Dv, Dk = x.shape
    return pad_last(pad_last(x.reshape(B, Hk * r, Dv, Dk), dk), dv, axis=-2)


def _chunk_states_to_kernel(x, dk, dv):
    """Per-chunk states in chunk layout [N, B, Hk, r, Dv, Dk] -> [B, Hv, N, DV, DK]."""
    N, B, Hk, r, Dv, Dk = x.shape
    x = x.transpose(1, 2, 3, 0, 4, 5).reshape(B, Hk * r, N, Dv, Dk)
    return pad_last(pad_last(x, dk), dv, axis=-2)


def _chunk_states_from_kernel(x, like):
    """[B, Hv, N, DV, DK] -> chunk layout [N, B, Hk, r, Dv, Dk] of ``like``."""
    N, B, Hk, r, Dv, Dk = like.shape
    return x[..., :Dv, :Dk].reshape(B, Hk, r, N, Dv, Dk).transpose(3, 0, 1, 2, 4, 5)


def _to_kernel_layout(q, k, v, gates, beta, S0, *, gate, dk, dv):
    """Chunk layout of `gdngen.algebra.chunkwise` -> the kernels' layout (see the forward template),
    as a dict; log gates clamped to `LOG_GATE_FLOOR`."""
    return {"q": _keys_to_kernel(q, dk), "k": _keys_to_kernel(k, dk),
            "v": _values_to_kernel(v, dv),
            "g": _per_step_to_kernel(pallas_core.floored_log_gates(gates, gate, LOG_GATE_FLOOR)),
            "beta": _per_step_to_kernel(beta), "s0": states_to_kernel(S0, dk, dv)}


def _to_fused_layout(q, k, v, gates, beta, S0, *, gate, dk, dv, inputs):
    """`_to_kernel_layout` for the fused forward kernels of ``inputs`` (raw primals of
    `gdngen.backends.generated.custom_vjp_core` with ``forward_fuses``): q, k as given (raw
    with ``qk_norm``); with a gate form ``gates`` is ``(a, A_log, dt_bias)`` (A_log, dt_bias
    ``[Hk, r, 1]``), ``"g"`` holds ``a`` (-inf kept: an identity step) and ``"gate"`` the
    operands after it (`gdngen.backends.pallas.core.fused_gate_operands`); otherwise ``gates``
    in ``gate``'s convention, laid out as `_to_kernel_layout` does."""
    if inputs.gate_form is None:
        return dict(_to_kernel_layout(q, k, v, gates, beta, S0, gate=gate, dk=dk, dv=dv),
                    gate=())
    a, A_log, dt_bias = gates
    lay = _to_kernel_layout(q, k, v, a, beta, S0, gate="log", dk=dk, dv=dv)
    lay["g"] = _per_step_to_kernel(a)  # unclamped: the kernels clamp the log gate they compute
    lay["gate"] = fused_gate_operands(inputs, A_log, dt_bias, v.shape[2] * v.shape[3],
                                                k.shape[-1], False)
    return lay


def _gate_cotangent(gates, gate, dd11, dd0):
    """d(gates) [B, Hv, N, C] from the kernels' decay-factor cotangents (dd11 [B, Hv, T, C],
    dd0 [B, Hv, T]; the chunk-end terms already folded into their last rows) by the
    straddle-sum rule of `gdngen.algebra.chunkwise` (exact at g = 0); gates [B, Hv, N, C] in their
    own convention."""
    import jax.numpy as jnp

    C = gates.shape[-1]
    dd11 = dd11.reshape(gates.shape + (C,))
    rows = jnp.concatenate([dd0.reshape(gates.shape)[..., None], dd11], axis=-1)  # positions 1..C
    dD = jnp.concatenate([jnp.zeros(rows.shape[:-2] + (1, C + 1), rows.dtype), rows], axis=-2)
    return gate_cotangent(gates, gate, dD)


def _cotangents(primals, grads, *, gate):
    """The kernels' gradients -> cotangents of the core's primals (chunk layout, their dtypes)."""
    q, k, v, gates, beta, S0 = primals
    dq, dk, dv, dbeta, dd11, dd0, ds0 = grads
    N, B, Hk, C, Dk = q.shape
    r = v.shape[3]

    def key_grad(x, like):  # [B, T, Hv, DK] per value head -> summed over the group
        x = x[..., :Dk].reshape(B, N, C, Hk, r, Dk).sum(axis=4)
        return x.transpose(1, 0, 3, 2, 4).astype(like.dtype)

    B_, Hv = gates.shape[1], Hk * r
    per_head = gates.transpose(1, 2, 3, 0, 4).reshape(B_, Hv, N, C)
    dgates = _gate_cotangent(per_head, gate, dd11, dd0)
    Dv = v.shape[-1]
    return (key_grad(dq, q), key_grad(dk, k), _values_from_kernel(dv, v).astype(v.dtype),
            _per_step_from_kernel(dgates, gates), _per_step_from_kernel(dbeta, beta),
            ds0[:, :, :Dv, :Dk].reshape(S0.shape))


@functools.cache
def chunk_core(key: tuple, gate, scale: float, qk_norm: bool = False,
               fused_key: tuple | None = None, conv_chunk: int | None = None):
    """`gdngen.algebra.chunkwise` core (chunk layout in and out) on the loaded kernels ``key``
    (sha256, interpret mode), the generated backward as its ``jax.custom_vjp``
    (`gdngen.backends.generated.custom_vjp_core`; the backward lays the primals out again).
    ``fused_key``: the loaded fused build of ``qk_norm`` and ``gate`` (a convention or a
    `gdngen.algebra.layer_inputs.ParameterGate`), whose forward takes the raw primals; the
    backward (and a recomputing variant's residuals) runs the plain kernels on the recomputed
    inputs.
    ``conv_chunk``: the core of a conv call (``gated_delta(..., conv_weight=)``), over the call's
    layout with chunks of ``conv_chunk`` (its kernels'): q, k, v arrive as conv tuples, are
    convolved in it and only the tuples are kept for the backward
    (`gdngen.backends.generated.custom_vjp_core` with ``conv`` and ``chunk_size``)."""
    import jax.numpy as jnp

    parameter_gate, gate = gate, layer_inputs.convention(gate)  # the kernels take log gates
    kernels = LOADED[key]
    interpret, p = kernels.interpret, kernels.params
    if fused_key is None:
        run_forward, prepare_forward = kernels.run_forward, None
    else:
        run_forward = LOADED[fused_key].run_forward
        prepare_forward = jit_pair(functools.partial(
            _to_fused_layout, gate=gate, dk=p["dk"], dv=p["dv"],
            inputs=KernelInputs.of(qk_norm, parameter_gate)), (), interpret)
    prepare = jit_pair(functools.partial(_to_kernel_layout, gate=gate, dk=p["dk"], dv=p["dv"]),
                        (), interpret)
    finish = jit_pair(functools.partial(_cotangents, gate=gate), (), interpret)

    def forward_outputs(y, s_final, v, S0):
        Dv, Dk = S0.shape[-2:]
        return _values_from_kernel(y, v), s_final[:, :, :Dv, :Dk].reshape(S0.shape)

    def backward_inputs(dY, dS_final, lay_v):
        return (_values_to_kernel(dY, p["dv"]).astype(lay_v.dtype),
                states_to_kernel(dS_final.astype(jnp.float32), p["dk"], p["dv"]))

    forward_outputs = jit_pair(forward_outputs, (), interpret)
    backward_inputs = jit_pair(backward_inputs, (), interpret)

    def forward(primals):
        lay = call_jitted(prepare if prepare_forward is None else prepare_forward, *primals)
        y, s_final, saved = call_jitted(run_forward, lay["q"], lay["k"], lay["v"], lay["g"],
                                        lay["beta"], lay["s0"], *lay.get("gate", ()),
                                        scale=scale, interpret=interpret)
        return call_jitted(forward_outputs, y, s_final, primals[2], primals[5]), saved

    def backward(primals, saved, cotangents):
        lay = call_jitted(prepare, *primals)
        args = (lay["q"], lay["k"], lay["v"], lay["g"], lay["beta"])
        if not p["save_states"]:
            saved = call_jitted(kernels.run_residuals, *args, lay["s0"], scale=scale,
                                interpret=interpret)
        dy, dsf = call_jitted(backward_inputs, *cotangents, lay["v"])
        grads = call_jitted(kernels.run_backward, *args, *saved, dy, dsf, scale=scale,
                            interpret=interpret)
        return call_jitted(finish, primals, grads)

    return generated.custom_vjp_core(forward, backward, qk_norm, parameter_gate,
                                     forward_fuses=fused_key is not None,
                                     conv=conv_chunk is not None, chunk_size=conv_chunk)


@functools.cache
def entering_core(key: tuple, scale: float):
    """``core(q, k, v, log_gates, beta, S0) -> (Y, S_final, S_in)`` in the chunk layout of
    `gdngen.algebra.chunkwise.whole_sequence` (its ``entering`` core; S_in ``[N, B, Hk, r, Dv,
    Dk]``) on the loaded ``save_states`` kernels ``key`` (sha256, interpret): one forward kernel
    call, its saved entering states returned. Forward only (`PallasBackend.chunks` takes the
    portable VJP)."""
    import jax

    kernels = LOADED[key]
    interpret, p = kernels.interpret, kernels.params
    if not p["save_states"]:
        raise ValueError("entering_core needs a save_states build (its forward keeps S_in)")
    prepare = jit_pair(functools.partial(_to_kernel_layout, gate="log", dk=p["dk"], dv=p["dv"]),
                       (), interpret)

    def outputs(y, s_final, s_in, v, S0):
        N, B, Hk, r = v.shape[:4]
        Dv, Dk = S0.shape[-2:]
        like = jax.ShapeDtypeStruct((N, B, Hk, r, Dv, Dk), s_in.dtype)
        return (_values_from_kernel(y, v), s_final[:, :, :Dv, :Dk].reshape(S0.shape),
                _chunk_states_from_kernel(s_in, like))

    outputs = jit_pair(outputs, (), interpret)

    def core(*primals):
        lay = call_jitted(prepare, *primals)
        y, s_final, saved = call_jitted(kernels.run_forward, lay["q"], lay["k"], lay["v"],
                                        lay["g"], lay["beta"], lay["s0"], scale=scale,
                                        interpret=interpret)
        return call_jitted(outputs, y, s_final, saved[-1], primals[2], primals[5])

    return core


def _packed_layout(q, k, v, gates, beta, inject, *, gate, dk, dv):
    """`_to_kernel_layout` of a packed walk (zero s0) plus ``inject`` [N, B, Hk, r, Dv, Dk]
    -> [B, Hv, N, DV, DK]."""
    import jax.numpy as jnp

    lay = _to_kernel_layout(q, k, v, gates, beta, jnp.zeros(inject.shape[1:], jnp.float32),
                            gate=gate, dk=dk, dv=dv)
    lay["inject"] = _chunk_states_to_kernel(inject, dk, dv)
    return lay


def _packed_cotangents(primals, grads, *, gate):
    """The packed backward's gradients -> cotangents of ``(q, k, v, gates, beta, inject)``."""
    *front, inject = primals
    return (*_cotangents((*front, inject[0]), grads[:-1], gate=gate)[:5],
            _chunk_states_from_kernel(grads[-1], inject))


@functools.cache
def packed_core(key: tuple, gate: str):
    """The ``packed_core(q, k, v, gates, beta, inject) -> (Y, S_in)`` of
    `gdngen.algebra.packed.chunk_walk` on the loaded packed kernels ``key`` (sha256, interpret
    mode): chunk layout (q already scaled), from a zero state, ``inject`` and ``S_in`` ``[N, B, Hk,
    r, Dv, Dk]`` float32; the packed backward kernels as its ``jax.custom_vjp`` (cotangents of
    every input, ``inject``'s the state cotangent leaving each chunk)."""
    import jax.numpy as jnp

    kernels = LOADED[key]
    interpret, p = kernels.interpret, kernels.params
    prepare = jit_pair(functools.partial(_packed_layout, gate=gate, dk=p["dk"], dv=p["dv"]),
                       (), interpret)
    finish = jit_pair(functools.partial(_packed_cotangents, gate=gate), (), interpret)

    def forward_outputs(y, s_in, v, inject):
        return _values_from_kernel(y, v), _chunk_states_from_kernel(s_in, inject)

    def backward_inputs(dY, dS_in, lay_v, lay_s0):
        return (_values_to_kernel(dY, p["dv"]).astype(lay_v.dtype),
                jnp.zeros(lay_s0.shape, jnp.float32),
                _chunk_states_to_kernel(dS_in.astype(jnp.float32), p["dk"], p["dv"]))

    forward_outputs = jit_pair(forward_outputs, (), interpret)
    backward_inputs = jit_pair(backward_inputs, (), interpret)

    def forward(primals):
        lay = call_jitted(prepare, *primals)
        y, _, s_in, saved = call_jitted(kernels.run_forward, lay["q"], lay["k"], lay["v"],
                                        lay["g"], lay["beta"], lay["s0"], lay["inject"],
                                        scale=1.0, interpret=interpret)
        return call_jitted(forward_outputs, y, s_in, primals[2], primals[5]), (lay, saved)

    def backward(primals, saved_forward, cotangents):
        lay, saved = saved_forward
        args = (lay["q"], lay["k"], lay["v"], lay["g"], lay["beta"])
        if not p["save_states"]:  # recomputed, the injection included
            saved = call_jitted(kernels.run_residuals, *args, lay["s0"], lay["inject"],
                                scale=1.0, interpret=interpret)
        dy, dsf, dsin = call_jitted(backward_inputs, *cotangents, lay["v"], lay["s0"])
        grads = call_jitted(kernels.run_backward, *args, *saved, dy, dsf, dsin, scale=1.0,
                            interpret=interpret)
        return call_jitted(finish, primals, grads)

    return generated.custom_vjp_core(forward, backward)


def _rows_to_kernel(x, width):
    """Chunk layout [N, B, Hk, r, C, X] -> [B, Hv, T, width] (zero-padded last dim)."""
    N, B, Hk, r, C, X = x.shape
    return pad_last(x.transpose(1, 2, 3, 0, 4, 5).reshape(B, Hk * r, N * C, X), width)


def _rows_from_kernel(x, like):
    """[B, Hv, T, X'] -> chunk layout [N, B, Hk, r, C, X] of ``like``."""
    N, B, Hk, r, C, X = like.shape
    return x[..., :X].reshape(B, Hk, r, N, C, X).transpose(3, 0, 1, 2, 4, 5)


def _chunk_vectors_to_kernel(x, dk):
    """Per-chunk vectors in chunk layout [N, B, Hk, r, Dk] -> [B, Hv, N, DK]."""
    N, B, Hk, r, Dk = x.shape
    return pad_last(x.transpose(1, 2, 3, 0, 4).reshape(B, Hk * r, N, Dk), dk)


@functools.cache
def chunk_walks(key: tuple):
    """``(walk_forward, walk_backward)`` on the loaded per-channel kernels ``key`` (sha256,
    interpret mode): ``walk_forward`` with the signature and contract of
    `gdngen.algebra.chunkwise_channel.walk_forward`, ``walk_backward`` with those of
    `gdngen.backends.pallas.core.channel_walk_backward` (chunk layout [N, B, Hk, r, ...],
    float32): the forward and backward templates rendered with ``per_channel``. The forward
    walk is one ``pallas_call`` (grid batch * value head x Dv tiles, the chunks in order in one
    program, the state in registers); the reverse walk three (the decayed keys
    chunk-parallel, the state-cotangent walk as the forward's, then the sums over Dv
    chunk-parallel). Inputs go to the kernels' layout (value heads merged, time rows, head dims
    zero-padded: one copy each) and back. ``inject`` / ``dS_in`` (packed rows) are taken by the
    packed build's walks (`render_packed`; zeros where None), refused by the dense build's."""
    kernels = LOADED[key]
    interpret, p = kernels.interpret, kernels.params
    dk, dv = p["dk"], p["dv"]
    packed = getattr(kernels, "packed", False)

    def chunk_states(states, like, state):  # inject / dS_in in the kernel layout
        import jax.numpy as jnp

        zeros = functools.partial(jnp.zeros, dtype=jnp.float32)
        return (_chunk_states_to_kernel(generated.walk_states(states, like, state, zeros), dk,
                                        dv),)

    def walk_forward(xp, S0, U, Wk, Kc, Qd, Pm, dCC, inject=None):
        del xp  # the kernels' own arrays
        if not packed:
            generated.refuse_injection(BACKEND, inject)
        y, s_final, s_in, w = call_jitted(
            kernels.run_forward, _rows_to_kernel(U, dv),
            *(_rows_to_kernel(x, dk) for x in (Wk, Kc, Qd)), _rows_to_kernel(Pm, Pm.shape[-1]),
            _chunk_vectors_to_kernel(dCC, dk), states_to_kernel(S0, dk, dv),
            *(chunk_states(inject, U, S0) if packed else ()), interpret=interpret)
        N, B, Hk, r = U.shape[:4]
        Dv, Dk = S0.shape[-2:]
        s_in = s_in[..., :Dv, :Dk].reshape(B, Hk, r, N, Dv, Dk).transpose(3, 0, 1, 2, 4, 5)
        return (_rows_from_kernel(y, U), s_final[:, :, :Dv, :Dk].reshape(S0.shape), s_in,
                _rows_from_kernel(w, U))

    def walk_backward(dS_final, Pm, q, k, gates, Wk, W, S_in, dY, dS_in=None, *, gate, scale):
        if not packed:
            generated.refuse_injection(BACKEND, dS_in)
        dw, dwk, dqd, dkc, ddcc, ds0, *dinject = call_jitted(
            kernels.run_backward, _rows_to_kernel(Pm, Pm.shape[-1]), _key_heads(q, dk),
            _key_heads(k, dk), _log_gates(gates, gate, dk), _rows_to_kernel(Wk, dk),
            _rows_to_kernel(W, dv), _chunk_states_to_kernel(S_in, dk, dv),
            _rows_to_kernel(dY, dv), states_to_kernel(dS_final, dk, dv),
            *(chunk_states(dS_in, W, dS_final) if packed else ()), scale=scale,
            interpret=interpret)
        Dv, Dk = dS_final.shape[-2:]
        N, B, Hk, r = Wk.shape[:4]
        dJ = (_chunk_states_from_kernel(dinject[0], S_in) if dinject and dS_in is not None
              else None)
        return (ds0[:, :, :Dv, :Dk].reshape(dS_final.shape), _rows_from_kernel(dw, W),
                *(_rows_from_kernel(x, Wk) for x in (dwk, dqd, dkc)),
                ddcc[..., :Dk].reshape(B, Hk, r, N, Dk).transpose(3, 0, 1, 2, 4), dJ)

    return walk_forward, walk_backward


def _key_heads(x, dk):
    """q or k of the chunk layout [N, B, Hk, (1,) C, Dk] -> the kernels' [B, T, Hk, DK]."""
    return _keys_to_kernel(x.reshape(x.shape[:3] + x.shape[-2:]), dk)


def _log_gates(gates, gate, dk):
    """The chunk layout's gates [N, B, Hk, r, C, Dk] (convention ``gate``) -> the kernels' finite
    log gates [B, Hv, T, DK] (clamped to `LOG_GATE_FLOOR`: exp gives 0 either way)."""
    return _rows_to_kernel(pallas_core.floored_log_gates(gates, gate, LOG_GATE_FLOOR), dk)


def _channel_intra_layout(q, k, v, gates, beta, *, gate, dk, dv):
    """The intra-chunk kernel's inputs from the chunk layout (q, k [N, B, Hk, (1,) C, Dk]; v,
    gates, beta [N, B, Hk, r, C, ...]): q, k [B, T, Hk, DK], v [B, T, Hv, DV], the finite log
    gates [B, Hv, T, DK], beta [B, Hv, T]; head dims zero-padded."""
    return (_key_heads(q, dk), _key_heads(k, dk), _values_to_kernel(v, dv),
            _log_gates(gates, gate, dk), _per_step_to_kernel(beta))


def _channel_intra_outputs(outputs, shape):
    """The intra-chunk kernel's outputs -> chunk layout (``shape`` = (N, B, Hk, r, C, Dk,
    Dv)): U [N, B, Hk, r, C, Dv], Wk, Kc, Qd [.., C, Dk], Pm, M_kk, T [.., C, C], dCC [N, B, Hk,
    r, Dk]."""
    N, B, Hk, r, C, Dk, Dv = shape
    *rows, dcc = outputs

    def rows_from(x, width):
        return x[..., :width].reshape(B, Hk, r, N, C, width).transpose(3, 0, 1, 2, 4, 5)

    widths = (Dv, Dk, Dk, Dk, C, C, C)
    return (*(rows_from(x, width) for x, width in zip(rows, widths)),
            dcc[..., :Dk].reshape(B, Hk, r, N, Dk).transpose(3, 0, 1, 2, 4))


@functools.cache
def channel_intra(key: tuple, gate: str, scale: float):
    """``intra(q, k, v, gates, beta) -> (U, Wk, Kc, Qd, Pm, M_kk, T, dCC)``: the intra-chunk
    kernel (``intra`` of the forward template) of the loaded per-channel kernels ``key``
    (sha256, interpret mode) in the chunk layout of `gdngen.algebra.chunkwise_channel` (float32;
    q unscaled, ``scale`` applied in the kernel; gates in the convention ``gate``): the stages
    of its ``forward`` before the walk."""
    kernels = LOADED[key]
    interpret, p = kernels.interpret, kernels.params
    prepare = jit_pair(functools.partial(_channel_intra_layout, gate=gate, dk=p["dk"],
                                         dv=p["dv"]), (), interpret)
    finish = jit_pair(_channel_intra_outputs, ("shape",), interpret)

    def intra(q, k, v, gates, beta):
        outputs = call_jitted(kernels.run_intra, *call_jitted(prepare, q, k, v, gates, beta),
                              scale=scale, interpret=interpret)
        return call_jitted(finish, tuple(outputs),
                           shape=tuple(v.shape[:5]) + (k.shape[-1], v.shape[-1]))

    return intra


def _channel_grads_layout(q, k, v, gates, beta, W, Tinv, Mkk, dY, dW, dWk, dQd, dKc, ddCC, *,
                          gate, dk, dv):
    """The grads kernel's inputs from the chunk layout: q, k [B, T, Hk, DK]; the value-head
    arrays as time rows [B, Hv, T, X] (head dims zero-padded), beta [B, Hv, T], ddCC [B, Hv, N,
    DK]; the gates as `_channel_intra_layout` lays them out."""
    q, k, _, b, beta = _channel_intra_layout(q, k, v, gates, beta, gate=gate, dk=dk, dv=dv)
    values = (_rows_to_kernel(x, dv) for x in (v, W))
    squares = (_rows_to_kernel(x, x.shape[-1]) for x in (Tinv, Mkk))
    cotangents = (_rows_to_kernel(x, dv) for x in (dY, dW))
    keys = (_rows_to_kernel(x, dk) for x in (dWk, dQd, dKc))
    value, w = values
    return (q, k, value, b, beta, w, *squares, *cotangents, *keys,
            _chunk_vectors_to_kernel(ddCC, dk))


def _channel_grads_outputs(outputs, q, v, gates, gate):
    """The grads kernel's outputs -> the cotangents of ``(q, k, v, gates, beta)`` in the chunk
    layout (dq, dk summed over each key head's value heads; linear gates: db / g, the
    exact-zero rule's dz where g == 0)."""
    import jax.numpy as jnp

    dq, dk, dv, db, dbeta, *dz = outputs

    def key_sum(x):  # [B, Hv, T, DK] -> [N, B, Hk, r, C, Dk] -> summed over r
        return _rows_from_kernel(x, gates).sum(axis=3).reshape(q.shape)

    if gate == "log":
        dgates = _rows_from_kernel(db, gates)
    else:
        zero = gates == 0.0
        dgates = jnp.where(zero, _rows_from_kernel(dz[0], gates),
                           _rows_from_kernel(db, gates) / jnp.where(zero, 1.0, gates))
    return (key_sum(dq), key_sum(dk), _rows_from_kernel(dv, v), dgates,
            _per_step_from_kernel(dbeta, gates[..., 0]))


@functools.cache
def channel_grads(key: tuple, gate: str, scale: float):
    """``grads(q, k, v, gates, beta, W, Tinv, Mkk, dY, dW, dWk, dQd, dKc, ddCC) -> (dq, dk, dv,
    dgates, dbeta)``: the grads kernel (``grads`` of the backward template) of the loaded
    per-channel kernels ``key`` in the chunk layout of `gdngen.algebra.chunkwise_channel`
    (its ``backward_in_chunks``; q unscaled and dq its cotangent, gates in the convention
    ``gate``)."""
    kernels = LOADED[key]
    interpret, p = kernels.interpret, kernels.params
    prepare = jit_pair(functools.partial(_channel_grads_layout, gate=gate, dk=p["dk"],
                                         dv=p["dv"]), (), interpret)
    finish = jit_pair(functools.partial(_channel_grads_outputs, gate=gate), (), interpret)

    def grads(q, k, v, gates, beta, *rest):
        outputs = call_jitted(kernels.run_grads, *call_jitted(prepare, q, k, v, gates, beta,
                                                              *rest),
                              scale=scale, linear=gate == "linear", interpret=interpret)
        return call_jitted(finish, tuple(outputs), q, v, gates)

    return grads


#: the per-channel chunk cores on a loaded build (`gdngen.backends.pallas.core.channel_core`,
#: ``channel_core(key, gate, scale, qk_norm, walks)``, and the packed build's
#: `gdngen.backends.pallas.core.channel_walk_core`, ``channel_walk_core(key, gate, walks)``):
#: `channel_intra`, `channel_grads` and the build's `chunk_walks`
channel_core, channel_walk_core = pallas_core.channel_cores(LOADED, channel_intra, channel_grads)


def _normed_layout(q, k, v, gates, beta, S0, z, norm_weight, *conv, gate, inputs, chunk, dk,
                   dv):
    """A dense call's arrays (the call's layout: q, k ``[B, T, Hk, Dk]``, v, z ``[B, T, Hv,
    Dv]``, gates ``[B, T, Hv]`` in the convention ``gate`` or, with a gate form, ``(a, A_log,
    dt_bias)``, beta ``[B, T, Hv]``, S0 ``[B, Hv, Dv, Dk]``, norm_weight ``[Dv]``; masks folded)
    -> the norm build's forward operands: T padded to a multiple of ``chunk`` with identity
    steps (zero rows, log g = 0 or a = -inf, beta = 0), head dims zero-padded, gates and beta
    ``[B, Hv, T]``. No chunk layout: the kernels read time rows. ``conv`` ``(conv_weight [C,
    K], conv_state [B, C, K-1] or None)`` (a conv build's): q, k, v stay raw, each with the
    conv's rows before step 0 in front (`_conv_rows`), and their taps follow the gate's
    operands."""
    import jax.numpy as jnp

    f32 = jnp.float32
    pad = -q.shape[1] % chunk

    def rows(x, value=0.0):  # T padded with ``value``
        return _time_padded(x, pad, value)

    def per_step(x, value=0.0):  # [B, T, Hv] -> [B, Hv, T]
        return rows(x.astype(f32), value).transpose(0, 2, 1)

    if inputs.gate_form is None:
        g, parameters = per_step(pallas_core.floored_log_gates(gates, gate, LOG_GATE_FLOOR)), ()
    else:
        a, A_log, dt_bias = gates
        g = per_step(a, -float("inf"))  # an identity step; the kernels clamp the gate they form
        parameters = fused_gate_operands(inputs, A_log, dt_bias, v.shape[2], q.shape[3], False)
    qkv = (pad_last(rows(q), dk), pad_last(rows(k), dk), pad_last(rows(v), dv))
    taps = ()
    if conv:
        qkv, taps = _conv_rows(qkv, *conv, q.shape, v.shape)
    return (*qkv, g, per_step(beta), states_to_kernel(S0.astype(f32)[:, :, None], dk, dv),
            *parameters, *taps, pad_last(rows(z.astype(f32)), dv),
            pad_last(norm_weight.astype(f32), dv))


def _time_padded(x, pad: int, value=0.0):
    """``x`` ``[B, T, ...]`` with ``pad`` steps of ``value`` after its last."""
    import jax.numpy as jnp

    widths = [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2)
    return jnp.pad(x, widths, constant_values=value) if pad else x


def _conv_rows(qkv, weight, state, q_shape, v_shape):
    """A conv build's chunk forward operands: q, k, v (T and head dims padded) each with the
    ``CHUNK_CONV_TAPS - 1`` rows before step 0 in front (zeros, then the conv state's K - 1
    rows, oldest first), and the taps of q, k ``[Hk, KP, DK]`` and v ``[Hv, KP, DV]``, zero taps
    first (KP = `CHUNK_CONV_TAPS`)."""
    import jax.numpy as jnp

    from gdngen.backends.pallas.backend import CHUNK_CONV_TAPS as KP

    B, _, Hk, Dk = q_shape
    Hv, Dv = v_shape[2], v_shape[3]
    K = weight.shape[1]
    kd = Hk * Dk
    parts = ((0, Hk, Dk), (kd, Hk, Dk), (2 * kd, Hv, Dv))
    rows, taps = [], []
    for x, (lo, H, D) in zip(qkv, parts):
        width = x.shape[-1]
        w = weight[lo:lo + H * D].astype(jnp.float32).reshape(H, D, K).transpose(0, 2, 1)
        taps.append(jnp.pad(w, ((0, 0), (KP - K, 0), (0, width - D))))
        before = (jnp.zeros((B, K - 1, H, D), x.dtype) if state is None else
                  state[:, lo:lo + H * D].reshape(B, H, D, K - 1).transpose(0, 3, 1, 2)
                  .astype(x.dtype))  # [B, K-1, H, D]: the rows before step 0
        before = jnp.pad(before, ((0, 0), (KP - K, 0), (0, 0), (0, width - D)))
        rows.append(jnp.concatenate([before, x], axis=1))
    return tuple(rows), tuple(taps)


def _normed_channel_layout(q, k, v, gates, beta, S0, z, norm_weight, *conv, gate, qk_norm,
                           chunk, dk, dv):
    """`_normed_layout` of a per-channel norm build, whose kernels take the layer inputs as
    arrays, formed here (`gdngen.backends.pallas.core.channel_layer_inputs`), the log gates
    floored, ``[B, Hv, T, DK]``; q, k, v float32 as the per-channel kernels read them. A conv
    build's ``conv = (conv_weight, conv_state or None)``: q, k, v raw, each with the conv's
    rows before step 0 in front (its intra kernel convolves, then normalises q, k in its
    loads), and their taps last (`_conv_rows`)."""
    import jax.numpy as jnp

    f32 = jnp.float32
    q, k, log_g = pallas_core.channel_layer_inputs(q, k, gates, gate=gate,
                                                   qk_norm=qk_norm and not conv)
    log_g = pallas_core.floored_log_gates(log_g.astype(f32), layer_inputs.convention(gate),
                                          LOG_GATE_FLOOR)
    pad = -q.shape[1] % chunk

    def rows(x):  # T padded with identity steps (zero rows, log g = 0, beta = 0)
        return _time_padded(x.astype(f32), pad)

    qkv, taps = (pad_last(rows(q), dk), pad_last(rows(k), dk), pad_last(rows(v), dv)), ()
    if conv:
        qkv, taps = _conv_rows(qkv, *conv, q.shape, v.shape)
    return (*qkv, pad_last(rows(log_g).transpose(0, 2, 1, 3), dk), rows(beta).transpose(0, 2, 1),
            states_to_kernel(S0.astype(f32)[:, :, None], dk, dv), pad_last(rows(z), dv),
            pad_last(norm_weight.astype(f32), dv), *taps)


@functools.cache
def normed_chunk(key: tuple, gate, scale: float, qk_norm: bool = False):
    """``call(q, k, v, gates, beta, S0, z, norm_weight, *, norm_eps) -> (out [B, T, Hv, Dv],
    S_final [B, Hv, Dv, Dk])``, forward only: the chunk forward of the loaded norm build
    ``key`` (sha256, interpret; `render_fused` with ``norm``, whose walk computes the
    output's gated norm in its stores), on the call's layout (`_normed_layout`: no chunk
    layout, no copy of y; per-channel gates: `_normed_channel_layout`, the intra-chunk kernel,
    then the walk). ``gate`` a convention or a
    `gdngen.algebra.layer_inputs.ParameterGate` (``gates`` then ``(a, A_log, dt_bias)``); q, k
    raw with ``qk_norm`` (the build normalises them in its loads); q unscaled, q, k, v in the
    problem's dtype, the rest float32; masks folded."""
    kernels = LOADED[key]
    interpret, p = kernels.interpret, kernels.params
    if kernels.problem.gate == "vector":
        return _normed_channel(kernels, gate, scale, qk_norm)
    prepare = jit_pair(functools.partial(
        _normed_layout, gate=layer_inputs.convention(gate), inputs=KernelInputs.of(qk_norm, gate),
        chunk=p["chunk_size"], dk=p["dk"], dv=p["dv"]), (), interpret)

    def call(q, k, v, gates, beta, S0, z, norm_weight, *, norm_eps, conv=()):
        T, Dk, Dv = q.shape[1], q.shape[3], v.shape[3]
        out, s_final, _ = call_jitted(
            kernels.run_forward, *call_jitted(prepare, q, k, v, gates, beta, S0, z, norm_weight,
                                              *conv),
            scale=scale, interpret=interpret, norm_eps=norm_eps)
        return out[:, :T, :, :Dv], s_final[:, :, :Dv, :Dk]

    return call


def _normed_channel(kernels, gate, scale: float, qk_norm: bool):
    """`normed_chunk` of a per-channel norm build: the intra-chunk kernel (a conv build's
    convolves the raw q, k, v, then forms the q/k norm, in its loads), then the walk, which
    writes the gated norm of y in the call's layout (no W, no entering states: forward
    only)."""
    interpret, p = kernels.interpret, kernels.params
    prepare = jit_pair(functools.partial(
        _normed_channel_layout, gate=gate, qk_norm=qk_norm, chunk=p["chunk_size"], dk=p["dk"],
        dv=p["dv"]), (), interpret)

    def call(q, k, v, gates, beta, S0, z, norm_weight, *, norm_eps, conv=()):
        T, Dk, Dv = q.shape[1], q.shape[3], v.shape[3]
        q, k, v, b, beta, s0, z, norm_weight, *taps = call_jitted(
            prepare, q, k, v, gates, beta, S0, z, norm_weight, *conv)
        u, wk, kc, qd, pm, dcc = call_jitted(kernels.run_intra, q, k, v, b, beta, *taps,
                                             scale=scale, interpret=interpret)  # no M_kk, T
        out, s_final = call_jitted(kernels.run_forward, u, wk, kc, qd, pm, dcc, s0, z,
                                   norm_weight, interpret=interpret, norm_eps=norm_eps)
        return out[:, :T, :, :Dv], s_final[:, :, :Dv, :Dk]

    return call
