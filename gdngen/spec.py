"""`BackendSpec`: a `gdngen.backend.Backend` declared from plain functions (plugins, tests).

This module sits below the backends and below `gdngen.registry` (which imports the backends by
name), so the declaration and the lookup never import each other.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from gdngen.backend import Backend
from gdngen.shape import FLOAT_DTYPES


def _always() -> bool:
    return True


def _no_reason(problem) -> None:
    return None


@dataclass(frozen=True, repr=False)
class BackendSpec(Backend):
    """A `gdngen.backend.Backend` declared from functions: the fields are the base class's
    declaration (its docstring says what each is), plus

    * ``entry``: ``gated_delta(q, k, v, g, beta, initial_state, *, mask, scale, gate, variant)``
      (and ``qk_norm=True`` when ``fused_inputs`` has "qk_norm"; a fused "gate" arrives as a
      `gdngen.algebra.layer_inputs.ParameterGate` with ``g = (a, A_log, dt_bias)``): its `forward`;
    * ``packed_entry``: ``gated_delta(..., variant, cu_seqlens)`` running a packed row in its
      own kernels for the gate kinds in ``packed_gates``: its `packed` (without one, packed
      rows run on the framework's portable chunk path).
    """

    name: str
    framework: str
    config: type
    space: Callable = field()  # no default (the base class's method is not one)
    default: Callable = field()
    entry: Callable
    tolerances: Mapping
    device_kinds: tuple
    portable: bool = False
    gates: tuple = ("scalar",)
    dtypes: tuple = FLOAT_DTYPES
    tuned_gates: tuple = ("scalar",)
    render_plan: Callable | None = None
    source_modules: tuple = ()
    available: Callable = _always
    supports: Callable | None = None
    lower_check: Callable | None = None
    clear_cache: Callable | None = None
    device_limit: str | None = None
    footprint: Callable | None = None
    reference_device: str | None = None
    fused_inputs: tuple = ()
    packed_entry: Callable | None = None
    packed_gates: tuple = ()

    def __post_init__(self):
        if self.supports is None:
            object.__setattr__(self, "supports", _no_reason)
        self.validate()

    def native_packed(self, vector_gate: bool) -> bool:
        return self.packed_entry is not None and super().native_packed(vector_gate)

    def forward(self, call, operands, variant, **options):
        """``entry`` on the call's arrays (a parameterised gate as ``(a, A_log, dt_bias)`` with
        a `gdngen.algebra.layer_inputs.ParameterGate`; ``qk_norm=True`` only when it is fused)."""
        extra = {"qk_norm": True} if call.qk_norm else {}
        return self.entry(operands.q, operands.k, operands.v, operands.kernel_gates(),
                          operands.beta, operands.initial_state, mask=operands.mask,
                          scale=call.scale, gate=call.core_gate, variant=variant, **extra)

    def packed(self, call, operands, variant, **options):
        return self.packed_entry(operands.q, operands.k, operands.v, operands.g, operands.beta,
                                 operands.initial_state, mask=operands.mask, scale=call.scale,
                                 gate=call.decay, variant=variant, cu_seqlens=operands.cu_seqlens)
