"""Matmul precision policies, most accurate first, and how each framework applies them.

"ieee": full float32 matmuls; "tf32": TensorFloat-32 (10 mantissa bits, or three bfloat16
passes on TPUs); "bf16": one 16-bit operand pass. A policy is the least accuracy accepted: a
backend with its own ``precision`` parameter is run at that, the portable backends under
``jax.default_matmul_precision`` (MLX has no global switch: its portable path stays float32,
which satisfies every policy).
"""

from __future__ import annotations

import contextlib

from gdngen.shape import check_framework

PRECISIONS = ("ieee", "tf32", "bf16")
JAX_MATMUL_PRECISION = {"ieee": "float32", "tf32": "tensorfloat32", "bf16": "bfloat16"}


def rank(precision: str) -> int:
    """0 for the most accurate policy; ValueError for an unknown one."""
    check(precision)
    return PRECISIONS.index(precision)


def check(precision: str) -> None:
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")


def check_precision(framework: str, precision: str) -> None:
    """ValueError unless ``framework`` and ``precision`` are known."""
    check_framework(framework)
    check(precision)


def precision_context(framework: str, precision: str):
    """Context manager applying ``precision`` to the framework's matmuls while tracing/running."""
    check_precision(framework, precision)
    if framework == "jax":
        import jax

        return jax.default_matmul_precision(JAX_MATMUL_PRECISION[precision])
    return contextlib.nullcontext()
