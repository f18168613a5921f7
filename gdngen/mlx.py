"""MLX entry point: ``gdngen.mlx.gated_delta`` (differentiable, compilable). Never imports jax."""

from __future__ import annotations

import importlib

import mlx.core as mx

from gdngen.backends import mlx as mlx_backend
from gdngen.dispatch import resolve
from gdngen.problem import check_call, dtype_name

__all__ = ["gated_delta"]


def gated_delta(q, k, v, g, beta, initial_state=None, *, mask=None, scale=1.0, gate="log",
                chunk_size=None, variant=None):
    """Gated delta rule over a sequence; returns ``(y, final_state)``.

    Same contract as `gdngen.jax.gated_delta`: q, k ``[B,T,Hk,Dk]``; v ``[B,T,Hv,Dv]``; g
    ``[B,T,Hv]`` or ``[B,T,Hv,Dk]``; beta ``[B,T,Hv]``; initial_state ``[B,Hv,Dv,Dk]`` or None;
    mask ``[B,T]`` bool or None; ``gate`` "log" or "linear". y has q's dtype, final_state is
    float32, accumulation float32. Scalar gates run chunkwise, vector gates sequentially.

    ``variant`` (a `gdngen.Variant`) runs exactly that variant; without it the tuned variant for
    this device and shape class runs, else the default. ``chunk_size`` (default 64) overrides the
    chosen variant's chunk.
    """
    shape = check_call(q, k, v, g, beta, initial_state, mask, gate=gate,
                       chunk_size=64 if chunk_size is None else chunk_size, scale=scale)
    chosen = resolve("mlx", shape, dtype_name(q), variant, chunk_size)
    if chosen.backend != "mlx":  # a generated-kernel backend
        module = importlib.import_module(f"gdngen.backends.{chosen.backend}")
        return module.gated_delta(q, k, v, g, beta, initial_state, mask=mask, scale=float(scale),
                                  gate=gate, variant=chosen)
    f32 = mx.float32
    if initial_state is None:
        initial_state = mx.zeros((shape.B, shape.Hv, shape.Dv, shape.Dk), f32)
    args = (q.astype(f32), k.astype(f32), v.astype(f32), g.astype(f32), beta.astype(f32),
            initial_state.astype(f32), mask)
    if shape.vector_gate:
        y, state = mlx_backend.sequential_gated_delta(*args, scale=float(scale), gate=gate)
    else:
        y, state = mlx_backend.chunkwise_gated_delta(*args, scale=float(scale), gate=gate,
                                                     **chosen.as_dict())
    return y.astype(q.dtype), state
