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
    with
    ``compute_gate`` the log gate computed here instead (``call.gate_form`` then None). q, k
    stay raw with ``call.qk_norm`` (the backend normalises them, `Backend.run`)."""
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
    a parameterised gate made its log gate (`computed_gate`), q, k normalised
    (`normalize_qk`)."""
    if call.gate_form is not None and "gate" not in fused:
        g, gate = computed_gate(call.framework, operands.kernel_gates(), call.core_gate)
        call = call.replace(decay=gate, gate_form=None, lower_bound=None)
        operands = operands._replace(g=g, A_log=None, dt_bias=None)
    if call.qk_norm and "qk_norm" not in fused:
        q, k = normalize_qk(call.framework, operands.q, operands.k)
        call, operands = call.replace(qk_norm=False), operands._replace(q=q, k=k)
    return call, operands
