"""The call stage: one gated-delta call as a `Call` (what it computes) and its `Operands` (the
arrays).

`check` holds the checks of the arrays and the layer-input options (`gdngen.problem` for the
arrays' shapes and dtypes, `gdngen.algebra.layer_inputs` for the options); `gdngen.entry.bind`,
the one validation point of a ``gated_delta`` call, runs it with the checks of the rest (pool,
state storage, variant) and remembers the result; a backend's own entry point runs it through
`of_kernel_args`. Every later stage (`gdngen.sharding`, `gdngen.dispatch`, a
`gdngen.backend.Backend`) takes the `Call` and re-checks nothing. A `Call` holds no arrays, so
it is hashable and a stage may key its caches on it.

Names: ``Call.shape.vector_gate`` / ``Problem.gate`` is the gate kind (scalar or per-channel),
``Call.decay`` the decay form ("log" / "linear"), ``Call.gate_form`` the gate's
parameterisation; the public ``gate=`` argument takes a decay form or a parameterisation.

The gate's parameterisation is a field (``gate_form`` "softplus" / "sigmoid_bound" with
``lower_bound``), and its parameters ``A_log`` and ``dt_bias`` are operands of their own. The
chunk cores of the backends take a parameterised gate as the tuple ``(a, A_log, dt_bias)``
with a `gdngen.algebra.layer_inputs.ParameterGate` as their ``gate`` (`Operands.kernel_gates`,
`Call.core_gate`): that is an operand layout of the cores, not of the call.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import NamedTuple

from gdngen.algebra import layer_inputs
from gdngen.shape import FLOAT_DTYPES, GATES, CallShape, check_call, check_framework, dtype_name

__all__ = ["BETA_ACTIVATIONS", "LAYER_GATES", "PARAMETER_GATES", "Call", "LayerInputs", "Operands",
           "check", "check_options", "check_parameters", "of_kernel_args"]


@dataclass(frozen=True)
class Call:
    """What one ``gated_delta`` call computes (shapes as `gdngen.jax.gated_delta`).

    * ``framework``: "jax" | "mlx"; ``shape``: the `gdngen.shape.CallShape` (B, T, heads,
      head dims, gate kind, packed sequences); ``dtype``: q's dtype name.
    * ``decay``: the decay form of ``g`` as the recurrence reads it, "log" or "linear" ("log"
      for a parameterised gate); ``gate_form``: None, or "softplus" / "sigmoid_bound" when
      ``g`` is the raw projection ``a`` and the operands carry ``A_log``, ``dt_bias``
      (``lower_bound`` for "sigmoid_bound").
    * ``qk_norm``: q, k are raw and L2-normalised per head; ``beta_activation``: None or
      "sigmoid" (beta given as logits).
    * ``scale``; ``chunk_size``: the caller's override of the default variant's chunk, or
      None; ``context_axis``: the mesh axis the time axis is split over, or None.
    * ``return_states``: "final" (the final state), "steps" (the state after every step) or
      "chunks" (every ``checkpoint_every`` steps and the final one), `gdngen.algebra.states`.
    * ``conv_size``: None, or the kernel size K of the causal depthwise conv + SiLU the raw
      q, k, v go through first (operands ``conv_weight``, ``conv_state``; `gdngen.prepare.
      conv_parts`).
    * ``norm_gate``: None, or the gated RMSNorm's gate activation ("silu" / "sigmoid") the
      output goes through last, ``rmsnorm(y) * norm_weight * act(output_gate)`` per value head
      with ``norm_eps`` (operands ``norm_weight``, ``output_gate``; `gdngen.prepare.normed`).
    """

    framework: str
    shape: CallShape
    dtype: str
    decay: str = "log"
    gate_form: str | None = None
    lower_bound: float | None = None
    qk_norm: bool = False
    beta_activation: str | None = None
    scale: float = 1.0
    chunk_size: int | None = None
    context_axis: str | None = None
    return_states: str = "final"
    checkpoint_every: int | None = None
    conv_size: int | None = None
    norm_gate: str | None = None
    norm_eps: float = 1e-6

    @property
    def problem(self):
        """The shape class (`gdngen.problem.Problem`) the kernels are specialised for."""
        from gdngen.problem import problem_of

        return problem_of(self.shape, self.dtype)

    @property
    def packed(self) -> bool:
        """Whether the single row holds packed sequences (``cu_seqlens``,
        `gdngen.algebra.packed`)."""
        return self.shape.sequences is not None

    @property
    def vector_gate(self) -> bool:
        return self.shape.vector_gate

    @property
    def core_gate(self):
        """The ``gate`` argument of the chunk cores: a `gdngen.algebra.layer_inputs.ParameterGate`
        for a parameterised gate (its gates then `Operands.kernel_gates`' tuple), else `decay`."""
        if self.gate_form is None:
            return self.decay
        return layer_inputs.ParameterGate(self.lower_bound)

    def replace(self, **changes) -> Call:
        return dataclasses.replace(self, **changes)

    def for_arrays(self, q, v, *, packed: bool | None = None) -> Call:
        """This call on other arrays of it: sizes and dtype read from ``q`` ``[B,T,Hk,Dk]`` and
        ``v`` ``[B,T,Hv,Dv]`` (one shard's, inside ``jax.shard_map`` or a partitioned op; the
        extended values of a context-parallel shard; the one-chunk rows or the float32 copies a
        stage makes), nothing checked again; ``packed=False`` drops the packed sequences (a
        dense call of them)."""
        from gdngen.shape import dtype_name

        B, T, Hk, Dk = (int(s) for s in q.shape)
        Hv, Dv, dtype = int(v.shape[2]), int(v.shape[3]), dtype_name(q)
        sequences = self.shape.sequences if packed is None or packed else None
        shape = dataclasses.replace(self.shape, B=B, T=T, Hk=Hk, Hv=Hv, Dk=Dk, Dv=Dv,
                                    sequences=sequences)
        if (shape, dtype) == (self.shape, self.dtype):
            return self
        return self.replace(shape=shape, dtype=dtype)


class Operands(NamedTuple):
    """The arrays of a `Call`: q, k ``[B,T,Hk,Dk]``; v ``[B,T,Hv,Dv]``; g ``[B,T,Hv(,Dk)]``
    (the raw projection ``a`` with a ``gate_form``); beta ``[B,T,Hv]``; initial_state
    ``[B|N,Hv,Dv,Dk]`` or None; mask ``[B,T]`` bool or None; A_log, dt_bias (a ``gate_form``'s
    parameters, else None); cu_seqlens int32 ``[N+1]`` or None; conv_weight ``[C, K]``,
    conv_state ``[B|N, C, K-1]`` or None (``C = 2 Hk Dk + Hv Dv``; a ``conv_size`` call's);
    norm_weight ``[Dv]``, output_gate ``[B,T,Hv,Dv]`` or None (a ``norm_gate`` call's)."""

    q: object
    k: object
    v: object
    g: object
    beta: object
    initial_state: object = None
    mask: object = None
    A_log: object = None
    dt_bias: object = None
    cu_seqlens: object = None
    conv_weight: object = None
    conv_state: object = None
    norm_weight: object = None
    output_gate: object = None

    def kernel_gates(self):
        """``g`` as the chunk cores take it: ``(a, A_log, dt_bias)`` when the gate has
        parameters (`Call.core_gate`), else ``g``."""
        if self.A_log is None:
            return self.g
        return (self.g, self.A_log, self.dt_bias)


def check(framework: str, q, k, v, g, beta, initial_state=None, mask=None, *, scale=1.0,
          gate="log", chunk_size=None, qk_norm=False, A_log=None, dt_bias=None,
          lower_bound=None, beta_activation=None, cu_seqlens=None, context_axis=None,
          return_states="final", checkpoint_every=None, conv_weight=None,
          conv_state=None, norm_weight=None, output_gate=None, norm_eps=1e-6,
          norm_gate="silu") -> tuple[Call, Operands]:
    """Check one call's arrays and options (as `gdngen.jax.gated_delta`; ``initial_state``
    float states ``[B|N,Hv,Dv,Dk]``, not a pool); return its `Call` and `Operands`. ValueErrors
    name the argument and what was expected (the checks of
    `check_options`, then `gdngen.shape.check_call`, then the
    gate's parameters). Only shapes and Python values are read (``cu_seqlens``' values when
    concrete), so it runs under ``jax.jit`` and ``mx.compile``. Nothing is remembered here
    (`gdngen.entry.bind` remembers)."""
    operands = Operands(q, k, v, g, beta, initial_state, mask, A_log, dt_bias, cu_seqlens,
                        conv_weight, conv_state, norm_weight, output_gate)
    check_framework(framework)
    _check_return_states(return_states, checkpoint_every, cu_seqlens, context_axis)
    options = check_options(gate=gate, qk_norm=qk_norm, A_log=A_log,
                                         dt_bias=dt_bias, lower_bound=lower_bound,
                                         beta_activation=beta_activation)
    shape = check_call(q, k, v, g, beta, initial_state, mask, gate=options.call_gate,
                       chunk_size=64 if chunk_size is None else chunk_size, scale=scale,
                       cu_seqlens=cu_seqlens)
    options = check_parameters(options, shape, g, A_log, dt_bias)
    norm = check_norm(shape, norm_weight, output_gate, norm_eps, norm_gate)
    found = Call(framework, shape, dtype_name(q), options.call_gate,
                 options.gate if options.gate in PARAMETER_GATES else None,
                 options.lower_bound, qk_norm, beta_activation, float(scale), chunk_size,
                 context_axis, return_states, checkpoint_every,
                 check_conv(shape, conv_weight, conv_state, context_axis),
                 norm, 1e-6 if norm is None else float(norm_eps))
    return found, operands


def check_norm(shape, norm_weight, output_gate, norm_eps, norm_gate) -> str | None:
    """The gated norm's activation (None without ``norm_weight``) after its checks:
    norm_weight ``[Dv]``, output_gate ``[B, T, Hv, Dv]`` (both or neither), float dtypes;
    ``norm_eps`` a positive float; ``norm_gate`` one of `gdngen.algebra.mixer.NORM_GATES`."""
    from gdngen.algebra.mixer import NORM_GATES

    if norm_gate not in NORM_GATES:
        raise ValueError(f"norm_gate must be one of {NORM_GATES}, got {norm_gate!r}")
    if isinstance(norm_eps, bool) or not isinstance(norm_eps, (int, float)) \
            or not norm_eps > 0:
        raise ValueError(f"norm_eps must be a positive float, got {norm_eps!r}")
    if norm_weight is None:
        if output_gate is not None:
            raise ValueError("output_gate needs norm_weight: the output is "
                             "rmsnorm(y) * norm_weight * act(output_gate)")
        return None
    if output_gate is None:
        raise ValueError("norm_weight needs output_gate [B, T, Hv, Dv]: the output is "
                         "rmsnorm(y) * norm_weight * act(output_gate)")
    expected = {"norm_weight": ((shape.Dv,), "[Dv]"),
                "output_gate": ((shape.B, shape.T, shape.Hv, shape.Dv), "[B, T, Hv, Dv]")}
    for name, x in (("norm_weight", norm_weight), ("output_gate", output_gate)):
        want, what = expected[name]
        got = tuple(int(n) for n in getattr(x, "shape", ()))
        if got != want:
            raise ValueError(f"{name} has shape {got}, expected {what} = {want}")
        if dtype_name(x) not in FLOAT_DTYPES:
            raise ValueError(f"{name} has dtype {dtype_name(x)}, expected one of {FLOAT_DTYPES}")
    return norm_gate


def check_conv(shape, conv_weight, conv_state, context_axis=None) -> int | None:
    """The conv's kernel size K (None without ``conv_weight``) after its checks: conv_weight
    ``[2 Hk Dk + Hv Dv, K]``, conv_state ``[B, C, K-1]`` (``[N, C, K-1]`` with cu_seqlens),
    float dtypes; one chip's whole time axis (no ``context_axis``)."""
    if conv_weight is None:
        if conv_state is not None:
            raise ValueError("conv_state needs conv_weight (it is the conv's last K-1 inputs)")
        return None
    C = 2 * shape.Hk * shape.Dk + shape.Hv * shape.Dv
    got = tuple(getattr(conv_weight, "shape", ()))
    if len(got) != 2 or got[0] != C or got[1] < 1:
        raise ValueError(f"conv_weight has shape {got}, expected [2*Hk*Dk + Hv*Dv, K] = "
                         f"[{C}, K] (one causal filter per channel of q, k, v in that order)")
    K = int(got[1])
    rows, what = (shape.B, "[B, C, K-1]") if shape.sequences is None else \
        (shape.sequences, "[N, C, K-1] (one per sequence)")
    for name, x in (("conv_weight", conv_weight), ("conv_state", conv_state)):
        if x is not None and dtype_name(x) not in FLOAT_DTYPES:
            raise ValueError(f"{name} has dtype {dtype_name(x)}, expected one of {FLOAT_DTYPES}")
    if conv_state is not None and tuple(conv_state.shape) != (rows, C, K - 1):
        raise ValueError(f"conv_state has shape {tuple(conv_state.shape)}, expected {what} = "
                         f"{(rows, C, K - 1)}")
    if context_axis is not None:
        raise ValueError("conv_weight convolves each row's whole time axis on one chip: with "
                         "context_axis, pass q, k, v convolved and conv_weight=None")
    return K


def _check_return_states(return_states, checkpoint_every, cu_seqlens, context_axis) -> None:
    from gdngen.algebra.states import RETURN_STATES

    if return_states not in RETURN_STATES:
        raise ValueError(f"return_states must be one of {RETURN_STATES}, got {return_states!r}")
    if return_states == "chunks":
        if isinstance(checkpoint_every, bool) or not isinstance(checkpoint_every, int) \
                or checkpoint_every < 1:
            raise ValueError(f"checkpoint_every must be a positive int (a multiple of the chunk "
                             f"size) with return_states='chunks', got {checkpoint_every!r}")
    elif checkpoint_every is not None:
        raise ValueError(f"checkpoint_every goes with return_states='chunks', got "
                         f"return_states={return_states!r}")
    if return_states != "final" and cu_seqlens is not None:
        raise ValueError(f"return_states={return_states!r} takes dense rows: pass "
                         "cu_seqlens=None")
    if return_states != "final" and context_axis is not None:
        raise ValueError(f"return_states={return_states!r} runs on one chip: pass "
                         "context_axis=None")


def of_kernel_args(framework: str, q, k, v, g, beta, initial_state=None, mask=None, *,
                   scale=1.0, gate="log", qk_norm=False, cu_seqlens=None
                   ) -> tuple[Call, Operands]:
    """`check` of a backend entry point's arguments (``gdngen.backends.<name>.gated_delta``),
    whose parameterised gate comes in the cores' layout: ``gate`` a
    `gdngen.algebra.layer_inputs.ParameterGate` with ``g = (a, A_log, dt_bias)``, the parameters
    already broadcast against ``a`` (`gdngen.algebra.layer_inputs.parameter_layout`); ``qk_norm``:
    q, k
    raw."""
    if not isinstance(gate, layer_inputs.ParameterGate):
        return check(framework, q, k, v, g, beta, initial_state, mask, scale=scale, gate=gate,
                     qk_norm=qk_norm, cu_seqlens=cu_seqlens)
    a, A_log, dt_bias = g
    shape = check_call(q, k, v, a, beta, initial_state, mask, scale=scale,
                       cu_seqlens=cu_seqlens)
    form = "softplus" if gate.lower_bound is None else "sigmoid_bound"
    call = Call(framework, shape, dtype_name(q), "log", form, gate.lower_bound, qk_norm, None,
                float(scale))
    return call, Operands(q, k, v, a, beta, initial_state, mask, A_log, dt_bias, cu_seqlens)


# --------------------------------------------------------------------------- layer-input options


#: gates given by their parameters (``g`` is the raw projection, plus A_log and dt_bias)
PARAMETER_GATES = ("softplus", "sigmoid_bound")
#: every value the ``gate`` argument of ``gated_delta`` takes
LAYER_GATES = GATES + PARAMETER_GATES
BETA_ACTIVATIONS = (None, "sigmoid")


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
    """``options`` of a call whose arrays passed `gdngen.shape.check_call` (its
    `gdngen.shape.CallShape` ``shape``), with the gate's parameters checked: A_log and
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
