"""The layer inputs a backend does not take raw, laid out and computed as framework array ops
before it runs (differentiable by the framework's autodiff): beta from logits, a parameterised
gate's parameters laid out or its log gate computed, q and k L2-normalised
(`gdngen.algebra.layer_inputs` holds the math). Imports no framework at import time; `namespace`
imports the requested one."""

from __future__ import annotations

import functools

from gdngen.algebra import layer_inputs
from gdngen.algebra.layer_inputs import l2_normalize, log_gate
from gdngen.shape import check_framework


@functools.cache
def namespace(framework: str):
    """The ``xp`` of this module's array ops for ``framework``: its chunkwise ``XP`` namespace
    (`gdngen.backends.portable.jax_chunkwise.XP`, `gdngen.backends.portable.mlx_chunkwise.XP`) plus
    ``float32 astype``."""
    check_framework(framework)
    if framework == "jax":
        from gdngen.backends.portable.jax_chunkwise import XP
    else:
        from gdngen.backends.portable.mlx_chunkwise import XP
    module = XP.module

    class LayerXP(XP):
        @staticmethod
        def float32(x):
            return x.astype(module.float32)

        @staticmethod
        def astype(x, dtype):
            return x.astype(dtype)

    LayerXP.__name__ = LayerXP.__qualname__ = f"LayerXP[{framework}]"
    return LayerXP


def computed_gate(framework: str, g, gate):
    """``(g, gate)`` for a backend that does not compute a
    `gdngen.algebra.layer_inputs.ParameterGate`
    itself: its tuple made the float32 log gate (differentiable by the framework, "log");
    other gates as given."""
    if not isinstance(gate, layer_inputs.ParameterGate):
        return g, gate
    return gate.log_gates(namespace(framework), *g), "log"


def normalize_qk(framework: str, q, k):
    """``qk_norm`` computed before a backend that does not fuse it (`BackendSpec.fused_inputs`):
    L2-normalised q, k in q's dtype, differentiable by the framework."""
    xp = namespace(framework)
    return tuple(xp.astype(l2_normalize(xp, xp.float32(x)), q.dtype) for x in (q, k))


def prepared(call, operands, *, compute_gate: bool = False):
    """``(call, operands)`` of a checked `gdngen.call.Call` for the stages after the entry
    point: beta activated (float32) where ``call.beta_activation`` says so (``call`` then
    without it); a parameterised gate's ``a``, A_log and dt_bias float32, the parameters laid
    out against ``a`` (`gdngen.algebra.layer_inputs.parameter_layout`), for the backend to compute;
    a convolving call's masked inputs zeroed (`masked_conv_inputs`); with
    ``compute_gate`` the log gate computed here instead (``call.gate_form`` then None). q, k
    stay raw with ``call.qk_norm`` (the backend normalises them, `Backend.run`)."""
    operands = masked_conv_inputs(call, operands)
    if call.beta_activation is None and call.gate_form is None:
        return call, operands
    xp = namespace(call.framework)
    changes, call_changes = {}, {}
    if call.beta_activation == "sigmoid":
        changes["beta"] = xp.sigmoid(xp.float32(operands.beta))
        call_changes["beta_activation"] = None
    if call.gate_form is not None:
        A_log, dt_bias = layer_inputs.parameter_layout(operands.A_log, operands.dt_bias,
                                                    call.vector_gate)
        a, A_log, dt_bias = (xp.float32(x) for x in (operands.g, A_log, dt_bias))
        if compute_gate:
            changes.update(g=log_gate(xp, a, A_log, dt_bias, call.lower_bound), A_log=None,
                           dt_bias=None)
            call_changes.update(gate_form=None, lower_bound=None)
        else:
            changes.update(g=a, A_log=A_log, dt_bias=dt_bias)
    return call.replace(**call_changes), operands._replace(**changes)


def computed(call, operands, fused=()):
    """``(call, operands)`` with the layer inputs a backend does not compute itself (``fused``:
    its `gdngen.backend.Backend.fused_inputs`) computed here as differentiable array ops:
    q, k, v convolved (`convolved`), a parameterised gate made its log gate (`computed_gate`),
    q, k normalised (`normalize_qk`)."""
    if call.gate_form is not None and "gate" not in fused:
        g, gate = computed_gate(call.framework, operands.kernel_gates(), call.core_gate)
        call = call.replace(decay=gate, gate_form=None, lower_bound=None)
        operands = operands._replace(g=g, A_log=None, dt_bias=None)
    if call.conv_size is not None and "conv" not in fused:
        call, operands = convolved(call, operands)
    if call.qk_norm and "qk_norm" not in fused:
        q, k = normalize_qk(call.framework, operands.q, operands.k)
        call, operands = call.replace(qk_norm=False), operands._replace(q=q, k=k)
    return call, operands


# ------------------------------------------------------------------------------ the conv


def conv_parts(call, operands):
    """The causal conv's operands per input (``call.conv_size`` set): three ``(x [B, T, H, D],
    w [H D, K], conv_state [B|N, H D, K-1] or None)`` for q, k, v, their channels' slices of
    ``conv_weight`` and ``conv_state`` (q, k, v concatenated in that order, the mixer's
    layout). The conv is depthwise, so each input's channels convolve alone."""
    shape = call.shape
    kd = shape.Hk * shape.Dk
    bounds = ((0, kd), (kd, 2 * kd), (2 * kd, 2 * kd + shape.Hv * shape.Dv))
    w, state = operands.conv_weight, operands.conv_state
    return tuple((x, w[lo:hi], None if state is None else state[:, lo:hi])
                 for x, (lo, hi) in zip((operands.q, operands.k, operands.v), bounds))


def convolved(call, operands):
    """``(call, operands)`` with q, k, v convolved here (`conv_stage`, its custom VJP keeping
    the raw inputs): ``call.conv_size`` None, no conv operands."""
    conv = conv_stage(call.framework)
    q, k, v = (conv(x.reshape((*x.shape[:2], -1)), w, state, operands.cu_seqlens)[0]
               .reshape(x.shape) for x, w, state in conv_parts(call, operands))
    return (call.replace(conv_size=None),
            operands._replace(q=q, k=k, v=v, conv_weight=None, conv_state=None))


def masked_conv_inputs(call, operands):
    """Operands whose masked steps' q, k, v are zeros when the call convolves them (a masked
    step's input is a zero in the windows of the steps after it, as in mlx-lm); else as
    given."""
    if call.conv_size is None or operands.mask is None:
        return operands
    m = namespace(call.framework).module
    keep = operands.mask[..., None, None]
    return operands._replace(**{n: m.where(keep, getattr(operands, n), 0)
                                for n in ("q", "k", "v")})


@functools.cache
def conv_stage(framework: str):
    """The causal conv + SiLU of ``framework`` with its hand-derived VJP as the framework's
    custom VJP: ``conv(x, w, conv_state or None, cu_seqlens or None) -> (h, new_conv_state)``
    (`gdngen.algebra.mixer.conv`, ``conv_vjp``): the backward keeps only the raw inputs and
    recomputes the pre-activation from them."""
    from gdngen.algebra import mixer as stages

    xp = namespace(framework)

    def values(x, w, state, cu_seqlens):
        return stages.conv(xp, x, w, state, cu_seqlens)

    if framework == "jax":
        import jax
        import numpy as np

        def bwd(saved, cts):
            cu_seqlens = saved[3]
            offsets = None if cu_seqlens is None else \
                np.zeros(cu_seqlens.shape, jax.dtypes.float0)  # an integer input's cotangent
            return (*stages.conv_vjp(xp, *saved, *cts), offsets)

        conv = jax.custom_vjp(values)
        conv.defvjp(lambda *primals: (values(*primals), primals), bwd)
        return conv
    import mlx.core as mx

    def function(with_state, packed):
        def full(primals):  # (x, w, state or None, cu_seqlens or None)
            it = iter(primals[2:])
            return (*primals[:2], next(it) if with_state else None, next(it) if packed else None)

        @mx.custom_function
        def f(*primals):
            return values(*full(primals))

        @f.vjp
        def f_vjp(primals, cotangents, outputs):
            dx, dw, dstate = stages.conv_vjp(xp, *full(primals), *cotangents)
            return ((dx, dw) + ((dstate,) if with_state else ())
                    + ((mx.zeros_like(primals[-1]),) if packed else ()))

        return f

    convs = {(s, p): function(s, p) for s in (False, True) for p in (False, True)}

    def conv(x, w, state, cu_seqlens):
        present = tuple(a for a in (state, cu_seqlens) if a is not None)
        return convs[state is not None, cu_seqlens is not None](x, w, *present)

    return conv


def normed(call, operands, y):
    """``y`` through the gated RMSNorm of a ``norm_gate`` call (`norm_stage`: its custom VJP
    keeps y, ``output_gate`` and ``norm_weight``): ``rmsnorm(y) * norm_weight *
    act(output_gate)`` in y's dtype."""
    norm = norm_stage(call.framework, float(call.norm_eps), call.norm_gate)
    return norm(y, operands.output_gate, operands.norm_weight)


def without_norm(call, operands):
    """``(call, operands)`` of the recurrence alone: no ``norm_gate``, no norm operands (the
    caller applies `normed` to its y)."""
    return (call.replace(norm_gate=None, norm_eps=1e-6),
            operands._replace(norm_weight=None, output_gate=None))


@functools.cache
def norm_stage(framework: str, eps: float, activation: str):
    """The gated RMSNorm ``norm(y, z, weight) -> out`` of ``framework`` with its hand-derived
    VJP (`gdngen.algebra.mixer.gated_norm`, ``gated_norm_vjp``) as the framework's custom VJP:
    the backward keeps y, z and the weight and recomputes the norm factor and the gate."""
    from gdngen.algebra import mixer as stages

    xp = namespace(framework)

    def values(y, z, weight):
        return stages.gated_norm(xp, y, z, weight, eps, activation)

    def cotangents(y, z, weight, dout):
        return stages.gated_norm_vjp(xp, y, z, weight, eps, activation, dout)

    if framework == "jax":
        import jax

        from gdngen import jaxcompat

        custom = jax.custom_vjp(values)
        custom.defvjp(lambda y, z, weight: (values(y, z, weight), (y, z, weight)),
                      lambda saved, dout: cotangents(*saved, dout))

        def norm(y, z, weight):  # inside shard_map: a replicated weight's cotangent varies
            axes = jaxcompat.varying_axes(y) | jaxcompat.varying_axes(z)
            return custom(y, z, jaxcompat.varying(weight, axes))

        return norm
    import mlx.core as mx

    @mx.custom_function
    def norm(y, z, weight):
        return values(y, z, weight)

    @norm.vjp
    def norm_vjp(primals, cotangent, output):
        return cotangents(*primals, cotangent)

    return norm
