"""Layer inputs a generated kernel computes in its own loads (C++, Pallas, Metal).

A call with ``qk_norm=True`` or a parameterised gate (`gdngen.algebra.layer_inputs.ParameterGate`)
hands a generated backend the raw q, k and the raw gate projection ``a`` with ``A_log`` and
``dt_bias``. A kernel rendered with `KernelInputs.context` computes them where it loads its
operands, so no normalised q, k and no log gate exist as arrays between kernels. A call with
``conv_weight`` also hands ffi_cpu's forwards and the recurrent kernels of metal, pallas_tpu
and pallas_gpu (pallas_gpu's scalar chunk forward too) the raw q, k, v (``conv``); a call
with ``norm_weight`` hands the recurrent kernels of ffi_cpu, pallas_tpu and pallas_gpu the
gated norm of their output (``norm``, in their stores, not in their loads)::

    conv         x <- silu(sum_j w[c, j] x[t - (K-1) + j, c])  (the conv state before the row;
                 before the norm)
    qk_norm      x <- x * rsqrt(sum_Dk(x^2) + QK_NORM_EPS)      (float32; q scaled after it)
    "softplus"   log g = -exp(A_log) * softplus(a + dt_bias)
    "sigmoid_bound"  log g = lower_bound * sigmoid(exp(A_log) * (a + dt_bias))
    a = -inf     log g = 0 exactly (an identity step: masked or padded), whatever the form
    norm         out <- y * rsqrt(mean_Dv(y^2) + norm_eps) * w * act(z)  (per value head and
                 step; act silu or sigmoid; w [Dv], z [B, T, Hv, Dv], norm_eps a runtime scalar)

softplus(x) = max(x, 0) + log1p(exp(-|x|)) and sigmoid(z) = 1 / (1 + exp(-z)) for z >= 0,
exp(z) / (1 + exp(z)) below, so no exp of a large positive number is formed; the log gate is
produced in log space, then ``exp`` (exactly 0 at log g = -inf) where a kernel needs the decay.

Kernel operands of a parameterised gate (`kernel_parameters`): ``a`` where the log gate was
(``[..., Hv]`` per head, ``[..., Hv, Dk]`` per channel), and ``A_log``, ``dt_bias`` float32
``[Hv]`` per head or ``[Hv, Dk]`` per channel (every accepted shape broadcast there).
``lower_bound`` is a runtime scalar of the call, not part of the rendering, so one build serves
every bound. With nothing fused the context renders each template byte for byte as before, so
a plain variant's sha256, and its tuned entries, do not change.
"""

from __future__ import annotations

from dataclasses import dataclass

from gdngen.algebra import layer_inputs
from gdngen.algebra.mixer import NORM_GATES

#: the parameterised gate forms a kernel computes (`gdngen.call.PARAMETER_GATES`)
GATE_FORMS = ("softplus", "sigmoid_bound")
#: added to sum(x^2) over Dk by a kernel's qk norm (`gdngen.algebra.layer_inputs.QK_NORM_EPS`)
QK_NORM_EPS = layer_inputs.QK_NORM_EPS


@dataclass(frozen=True)
class KernelInputs:
    """What a kernel computes in its loads: ``qk_norm`` (q, k arrive raw) and ``gate_form``
    (None: the kernel takes the decay as before; "softplus" / "sigmoid_bound": it takes ``a``,
    ``A_log``, ``dt_bias``). ``lower_bound`` (< 0) is the runtime bound of "sigmoid_bound"
    (0.0 otherwise)."""

    qk_norm: bool = False
    gate_form: str | None = None
    lower_bound: float = 0.0
    conv: bool = False
    norm: str | None = None

    def __post_init__(self):
        if not isinstance(self.qk_norm, bool):
            raise ValueError(f"qk_norm must be a bool, got {self.qk_norm!r}")  # noqa: TRY004
        if not isinstance(self.conv, bool):
            raise ValueError(f"conv must be a bool, got {self.conv!r}")  # noqa: TRY004
        if self.norm not in (None, *NORM_GATES):
            raise ValueError(f"norm must be None or one of {NORM_GATES}, got {self.norm!r}")
        if self.gate_form not in (None, *GATE_FORMS):
            raise ValueError(f"gate_form must be None or one of {GATE_FORMS}, "
                             f"got {self.gate_form!r}")
        if (self.gate_form == "sigmoid_bound") != (self.lower_bound < 0):
            raise ValueError(f"lower_bound must be < 0 exactly for gate_form='sigmoid_bound', "
                             f"got {self.lower_bound!r} with gate_form={self.gate_form!r}")

    @classmethod
    def of(cls, qk_norm: bool, gate, conv: bool = False, norm: str | None = None
           ) -> KernelInputs:
        """The inputs of a call with ``qk_norm`` and ``gate`` (a `gdngen.algebra.chunkwise.
        ParameterGate` or a plain convention, "log" / "linear", which fuses no gate);
        ``conv``: q, k, v arrive before the causal conv + SiLU (a chunk forward's build);
        ``norm``: the output's gated norm activation (a recurrent kernel's stores)."""
        if isinstance(gate, layer_inputs.ParameterGate):
            if gate.lower_bound is None:
                return cls(bool(qk_norm), "softplus", conv=conv, norm=norm)
            return cls(bool(qk_norm), "sigmoid_bound", float(gate.lower_bound), conv=conv,
                       norm=norm)
        return cls(bool(qk_norm), conv=conv, norm=norm)

    @property
    def fused(self) -> bool:
        """Whether the kernel computes anything (a conv, a norm or a gate) in its loads, or
        the gated norm in its stores."""
        return self.qk_norm or self.gate_form is not None or self.conv or self.norm is not None

    def context(self) -> dict:
        """The template context: ``qk_norm`` (bool) and ``gate_form`` (None or a form), and
        ``conv: True`` only when it is on (the templates read ``conv | default(false)``). All
        off render the plain kernel byte for byte; ``norm`` (the activation) likewise only when
        on."""
        return {"qk_norm": self.qk_norm, "gate_form": self.gate_form,
                **({"conv": True} if self.conv else {}),
                **({"norm": self.norm} if self.norm else {})}

    def tag(self) -> str:
        """A short name of the fused build ("" when nothing is fused): for file and target
        names, e.g. ``"_qknorm_softplus"`` (`context_tag` of `context`)."""
        return context_tag(self.context())


def context_tag(context: dict) -> str:
    """`KernelInputs.tag` of a rendering context (`KernelInputs.context`, or the mapping of a
    backend's hashable key of it): ``"_conv"`` with ``conv``, ``"_qknorm"`` with ``qk_norm``,
    then ``"_<gate_form>"``, then ``"_norm<activation>"`` with ``norm``."""
    return "".join(f"_{part}" for part in (("conv",) if context.get("conv") else ())
                   + (("qknorm",) if context.get("qk_norm") else ())
                   + ((context["gate_form"],) if context.get("gate_form") else ())
                   + ((f"norm{context['norm']}",) if context.get("norm") else ()))


def kernel_parameters(module, A_log, dt_bias, Hv: int, Dk: int, vector_gate: bool):
    """``(A_log, dt_bias)`` as a kernel takes them: float32, ``[Hv]`` per head or ``[Hv, Dk]``
    per channel, from any accepted form (``[Hv]``, ``[Hv, 1]``, ``[Hv, Dk]``, or a chunk
    layout's ``[Hk, r, 1(, 1 or Dk)]``: `gdngen.algebra.chunkwise` keeps the heads first).
    ``module`` is the framework's array module (``jax.numpy``, ``mlx.core``)."""
    shape = (Hv, Dk) if vector_gate else (Hv,)
    out = []
    for x in (A_log, dt_bias):
        x = x.astype(module.float32)
        x = x.reshape(Hv, -1) if vector_gate else x.reshape(Hv)  # per channel: [Hv, 1 or Dk]
        out.append(module.broadcast_to(x, shape))
    return tuple(out)
