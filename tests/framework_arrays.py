"""Test helper: a framework's ``gated_delta`` with its array constructor and NumPy reader."""

from __future__ import annotations

import importlib.util

import pytest


def entry(framework: str):
    """``(gated_delta, array, numpy)`` of ``framework`` ("jax" | "mlx"); skips when it is not
    installed."""
    if importlib.util.find_spec(framework) is None:
        pytest.skip(f"{framework} is not installed")
    import numpy as np

    if framework == "jax":
        import jax.numpy as jnp

        from gdngen.jax import gated_delta
        return gated_delta, jnp.asarray, np.asarray
    import mlx.core as mx

    from gdngen.mlx import gated_delta
    return gated_delta, mx.array, np.array


def dtype(framework: str, name: str):
    """The framework's dtype object named ``name``."""
    if framework == "jax":
        import jax.numpy as jnp
        return jnp.dtype(name)
    import mlx.core as mx
    return getattr(mx, name)
