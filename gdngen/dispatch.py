"""Load stage: choose the variant that runs a call (explicit, else tuned, else default).

`resolve` is shared by ``gdngen.jax.gated_delta`` and ``gdngen.mlx.gated_delta``.
"""

from __future__ import annotations

from gdngen.problem import CallShape
from gdngen.variant import Problem, Variant, default_variant

#: backends each framework can execute, the portable one first (the fallback).
FRAMEWORK_BACKENDS = {"jax": ("xla", "pallas_tpu", "pallas_gpu"), "mlx": ("mlx", "metal")}


def problem_of(shape: CallShape, dtype: str) -> Problem:
    """The `Problem` (shape class) of a checked call with input dtype ``dtype``."""
    return Problem(shape.Hk, shape.Hv, shape.Dk, shape.Dv, dtype,
                   "vector" if shape.vector_gate else "scalar")


def resolve(framework: str, shape: CallShape, dtype: str, variant: Variant | None = None,
            chunk_size: int | None = None) -> Variant:
    """The variant for one call. An explicit ``variant`` must belong to ``framework``; an explicit
    ``chunk_size`` overrides the chosen variant's chunk (and must agree with an explicit one)."""
    backends = FRAMEWORK_BACKENDS[framework]
    if variant is not None:
        if not isinstance(variant, Variant):
            raise ValueError(f"variant must be a gdngen.Variant, got {type(variant).__name__}")
        if variant.backend not in backends:
            raise ValueError(f"variant backend {variant.backend!r} does not run on {framework}; "
                             f"expected one of {backends}")
        if chunk_size is not None and chunk_size != variant.get("chunk_size", chunk_size):
            raise ValueError(f"chunk_size={chunk_size} conflicts with the variant's chunk_size="
                             f"{variant['chunk_size']}")
        return variant
    chosen = default_variant(backends[0], problem_of(shape, dtype))
    if chunk_size is not None:
        chosen = Variant(chosen.backend, dict(chosen.as_dict(), chunk_size=chunk_size))
    return chosen
