"""Layer inputs: q/k L2 norm, gates given by their parameters, beta as logits (both frameworks).

``gated_delta(..., qk_norm=, gate=, A_log=, dt_bias=, lower_bound=, beta_activation=)`` turns a
GatedDeltaNet layer's raw projections into the ordinary call (normalised q, k; a log gate; beta
in [0, 1])::

    qk_norm=True             q <- q * rsqrt(sum_Dk(q^2) + 1e-6), k likewise (per head)
    gate="softplus"          log g = -exp(A_log) * softplus(g + dt_bias)
    gate="sigmoid_bound"     log g = lower_bound * sigmoid(exp(A_log) * (g + dt_bias))
    beta_activation="sigmoid"   beta <- sigmoid(beta)

With a parameterised gate, ``g`` is the raw projection (mlx-lm's ``a``) ``[B,T,Hv]`` or, for a
per-channel gate, ``[B,T,Hv,Dk]``. ``A_log`` and ``dt_bias`` are ``[Hv]`` for a per-head gate;
for a per-channel gate each is ``[Hv]``, ``[Hv,1]`` (mlx-lm's Kimi Linear / Bailing V3 pass
``A_log.reshape(Hv, 1)``) or ``[Hv,Dk]``, and ``[Hv]`` means one value per head (it broadcasts
over Dk, not over the heads).

`prepared` computes beta once, before the call, as ordinary differentiable array operations, so
the gradients reach the beta logits through the framework's autodiff. The q/k norm and the gate
are computed before the backend too (`computed`: the normalised q, k and the log gate then kept
as activations of that autodiff), except where the chunk core takes them raw (a backend listing
them in `gdngen.backend.Backend.fused_inputs`: every backend today): its custom VJP
takes the raw q, k and the raw projection ``a`` with A_log and dt_bias
(`gdngen.algebra.chunkwise.ParameterGate`), computes the norm and the log gate inside the core (for
the kernels' loads and in-chunk cumulative sums), keeps only the raw arrays, and recomputes
both in its backward, mapping their cotangents to the raw arrays. A packed row, a context-parallel
call and a backend that does not list them get them computed before the call. (The C++, Pallas
and Metal kernels compute them in their own loads: their recurrent kernels, for decode and
short prefill, and their scalar-gate chunk forward kernels, ffi_cpu's per-channel one too, are
rendered in fused builds (`gdngen.backends.kernel_inputs`) that take the raw q, k and ``(a,
A_log, dt_bias)``, so no normalised q, k and no log gate exist as arrays in a forward; the
backward kernels take the inputs the core recomputes as array ops.)

Numerics: everything is computed in float32. The gate is produced directly in log space (never
``log(exp(...))``), so strong decay (log g around -37 and below) neither underflows nor loses the
gradients to A_log and dt_bias; softplus is the framework's ``logaddexp(x, 0)`` (x for large x,
exp(x) for very negative x, derivative sigmoid(x) everywhere, 1/2 at 0). The L2 norm adds eps to
the sum of squares, ``x * rsqrt(sum(x^2) + eps)`` with eps = 1e-6: the formula of mlx-lm's
``normalize_qk`` (used by qwen3_next, qwen3_5, ...), which computes it as
``Dk**-0.5 * rms_norm(x, eps / Dk)``. Normalised q, k are cast back to q's dtype (so y keeps q's
dtype, as in mlx-lm, whose ``rms_norm`` returns its input's dtype); log g and activated beta
are float32.

This module imports no framework at import time; `namespace` imports the requested one.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from gdngen.algebra import chunkwise
from gdngen.problem import FLOAT_DTYPES, GATES, check_framework, dtype_name

#: gates given by their parameters (``g`` is the raw projection, plus A_log and dt_bias)
PARAMETER_GATES = ("softplus", "sigmoid_bound")
#: every value the ``gate`` argument of ``gated_delta`` takes
LAYER_GATES = GATES + PARAMETER_GATES
BETA_ACTIVATIONS = (None, "sigmoid")
#: added to sum(x^2) over Dk by ``qk_norm=True`` (mlx-lm's ``normalize_qk(..., eps=1e-6)``)
QK_NORM_EPS = chunkwise.QK_NORM_EPS


@dataclass(frozen=True)
class LayerInputs:
    """The checked layer-input options of one call (`check_options`, `check_parameters`).

    ``gate`` is the caller's gate; ``vector_gate`` whether ``g`` is ``[B,T,Hv,Dk]``.
    """

    qk_norm: bool
    gate: str
    lower_bound: float | None
    beta_activation: str | None
    vector_gate: bool

    @property
    def call_gate(self) -> str:
        """The gate the backends receive: "log" for a parameterised gate, else the caller's."""
        return "log" if self.gate in PARAMETER_GATES else self.gate

    @property
    def is_identity(self) -> bool:
        """Whether the inputs pass through unchanged (no norm, no parameters, no activation)."""
        return (not self.qk_norm and self.gate not in PARAMETER_GATES
                and self.beta_activation is None)


# --------------------------------------------------------------------------- argument checks


def _parameter_shapes(Hv: int, Dk: int, vector_gate: bool) -> tuple[tuple[int, ...], ...]:
    """Accepted shapes of A_log and dt_bias: ``(Hv,)`` per head; per channel also ``(Hv, 1)``
    and ``(Hv, Dk)``."""
    return ((Hv,), (Hv, 1), (Hv, Dk)) if vector_gate else ((Hv,),)


def _listed(shapes) -> str:
    names = [str(tuple(s)) for s in shapes]
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " or " + names[-1]


def check_options(*, gate="log", qk_norm=False, A_log=None, dt_bias=None, lower_bound=None,
                  beta_activation=None) -> LayerInputs:
    """The Python-value checks of the layer-input options (gate name, qk_norm, beta
    activation, which of A_log / dt_bias / lower_bound the gate takes, lower_bound's value);
    ``vector_gate`` is not known yet (`check_parameters` sets it)."""
    if gate not in LAYER_GATES:
        raise ValueError(f"gate must be one of {LAYER_GATES}, got {gate!r}")
    if not isinstance(qk_norm, bool):
        raise ValueError(f"qk_norm must be a bool, got {qk_norm!r}")  # noqa: TRY004 - options: ValueError
    if beta_activation not in BETA_ACTIVATIONS:
        raise ValueError(f"beta_activation must be None or 'sigmoid', got {beta_activation!r}")
    if gate not in PARAMETER_GATES:
        for name, value in (("A_log", A_log), ("dt_bias", dt_bias)):
            if value is not None:
                raise ValueError(f"{name} is only for gate='softplus' or gate='sigmoid_bound' "
                                 f"(g is then the raw gate projection); got gate={gate!r}")
    if gate != "sigmoid_bound" and lower_bound is not None:
        raise ValueError(f"lower_bound is only for gate='sigmoid_bound', got gate={gate!r}")
    if gate in PARAMETER_GATES and (A_log is None or dt_bias is None):
        missing = " and ".join(n for n, x in (("A_log", A_log), ("dt_bias", dt_bias)) if x is None)
        raise ValueError(f"gate={gate!r} needs A_log and dt_bias ({missing} not given)")
    if gate == "sigmoid_bound":
        if lower_bound is None:
            raise ValueError("gate='sigmoid_bound' needs lower_bound (a negative float)")
        if not isinstance(lower_bound, (int, float)) or isinstance(lower_bound, bool):
            raise ValueError(f"lower_bound must be a Python float, got "
                             f"{type(lower_bound).__name__}")
        if not -float("inf") < lower_bound < 0:
            raise ValueError(f"lower_bound must be < 0 (and finite), got {lower_bound!r}")
        lower_bound = float(lower_bound)
    return LayerInputs(qk_norm, gate, lower_bound, beta_activation, vector_gate=False)


def check_parameters(options: LayerInputs, shape, g, A_log, dt_bias) -> LayerInputs:
    """``options`` of a call whose arrays passed `gdngen.problem.check_call` (its
    `gdngen.problem.CallShape` ``shape``), with the gate's parameters checked: A_log and
    dt_bias ``[Hv]`` (per channel also ``[Hv, 1]``, ``[Hv, Dk]``), float dtypes."""
    if options.gate in PARAMETER_GATES:
        accepted = _parameter_shapes(shape.Hv, shape.Dk, shape.vector_gate)
        kind = "per-channel g" if shape.vector_gate else "per-head g"
        for name, x in (("A_log", A_log), ("dt_bias", dt_bias)):
            if tuple(x.shape) not in accepted:
                raise ValueError(f"{name} has shape {tuple(x.shape)}, expected {_listed(accepted)}"
                                 f" for Hv={shape.Hv}, Dk={shape.Dk} ({kind} {tuple(g.shape)})")
            if dtype_name(x) not in FLOAT_DTYPES:
                raise ValueError(f"{name} has dtype {dtype_name(x)}, expected one of "
                                 f"{FLOAT_DTYPES}")
    return LayerInputs(options.qk_norm, options.gate, options.lower_bound,
                       options.beta_activation, shape.vector_gate)


# --------------------------------------------------------------------------- the math, once


def l2_normalize(xp, x):
    """``x [..., D] -> x * rsqrt(sum_D(x^2) + QK_NORM_EPS)`` in float32."""
    return chunkwise.l2_normalize(xp, xp.float32(x))


def log_gate(xp, a, A_log, dt_bias, lower_bound=None):
    """Log decay from the gate's parameters, float32, shaped like ``a + dt_bias``
    (`gdngen.algebra.chunkwise.ParameterGate.log_gates`).

    ``-exp(A_log) * softplus(a + dt_bias)``, or with ``lower_bound``:
    ``lower_bound * sigmoid(exp(A_log) * (a + dt_bias))``. ``A_log`` and ``dt_bias`` must
    already broadcast against ``a``.
    """
    return chunkwise.ParameterGate(lower_bound).log_gates(
        xp, *(xp.float32(x) for x in (a, A_log, dt_bias)))


# --------------------------------------------------------------------------- per framework


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
    """``(g, gate)`` for a backend that does not compute a `gdngen.algebra.chunkwise.ParameterGate`
    itself: its tuple made the float32 log gate (differentiable by the framework, "log");
    other gates as given."""
    if not isinstance(gate, chunkwise.ParameterGate):
        return g, gate
    return gate.log_gates(namespace(framework), *g), "log"


def normalize_qk(framework: str, q, k):
    """``qk_norm`` computed before a backend that does not fuse it (`BackendSpec.fused_inputs`):
    L2-normalised q, k in q's dtype, differentiable by the framework."""
    xp = namespace(framework)
    return tuple(xp.astype(l2_normalize(xp, x), q.dtype) for x in (q, k))


def prepared(call, operands, *, compute_gate: bool = False):
    """``(call, operands)`` of a checked `gdngen.call.Call` for the stages after the entry
    point: beta activated (float32) where ``call.beta_activation`` says so (``call`` then
    without it); a parameterised gate's ``a``, A_log and dt_bias float32, the parameters laid
    out against ``a`` (`gdngen.algebra.chunkwise.parameter_layout`), for the backend to compute;
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
        A_log, dt_bias = chunkwise.parameter_layout(operands.A_log, operands.dt_bias,
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
        g, gate = computed_gate(call.framework, operands.kernel_gates(), call.kernel_gate)
        call = call.replace(gate=gate, gate_form=None, lower_bound=None)
        operands = operands._replace(g=g, A_log=None, dt_bias=None)
    if call.qk_norm and "qk_norm" not in fused:
        q, k = normalize_qk(call.framework, operands.q, operands.k)
        call, operands = call.replace(qk_norm=False), operands._replace(q=q, k=k)
    return call, operands
