"""JAX entry point: ``gdngen.jax.gated_delta`` (differentiable, jit-able). Never imports mlx."""

from __future__ import annotations

import importlib

import jax.numpy as jnp

from gdngen.backends import xla
from gdngen.dispatch import resolve
from gdngen.problem import check_call, dtype_name

__all__ = ["gated_delta"]


def gated_delta(q, k, v, g, beta, initial_state=None, *, mask=None, scale=1.0, gate="log",
                chunk_size=None, variant=None):
    """Gated delta rule over a sequence; returns ``(y, final_state)``.

    q, k ``[B,T,Hk,Dk]``; v ``[B,T,Hv,Dv]`` (Hv a multiple of Hk; value head h reads key head
    h // (Hv/Hk)); g ``[B,T,Hv]`` (scalar gate) or ``[B,T,Hv,Dk]`` (vector gate); beta
    ``[B,T,Hv]``; initial_state ``[B,Hv,Dv,Dk]`` or None (zeros); mask ``[B,T]`` bool or None.
    ``gate="log"``: g is log-decay (<= 0, -inf = full reset); ``"linear"``: g in [0, 1].
    Recurrence ``S_t = g_t S_{t-1} + beta_t (v_t - g_t S_{t-1} k_t) k_t^T``,
    ``y_t = scale * S_t q_t``. y has q's dtype; final_state is float32; accumulation is float32.
    Scalar gates run chunkwise (`chunk_size` steps per chunk); vector gates run sequentially.

    ``variant`` (a `gdngen.Variant`) runs exactly that variant; without it the tuned variant for
    this device and shape class runs, else the default. ``chunk_size`` (default 64) overrides the
    chosen variant's chunk.
    """
    shape = check_call(q, k, v, g, beta, initial_state, mask, gate=gate,
                       chunk_size=64 if chunk_size is None else chunk_size, scale=scale)
    chosen = resolve("jax", shape, dtype_name(q), variant, chunk_size)
    if chosen.backend != "xla":  # a generated-kernel backend
        module = importlib.import_module(f"gdngen.backends.{chosen.backend}")
        return module.gated_delta(q, k, v, g, beta, initial_state, mask=mask, scale=float(scale),
                                  gate=gate, variant=chosen)
    f32 = jnp.float32
    if initial_state is None:
        initial_state = jnp.zeros((shape.B, shape.Hv, shape.Dv, shape.Dk), f32)
    args = (q.astype(f32), k.astype(f32), v.astype(f32), g.astype(f32), beta.astype(f32),
            initial_state.astype(f32), mask)
    if shape.vector_gate:
        y, state = xla.sequential_gated_delta(*args, scale=float(scale), gate=gate)
    else:
        y, state = xla.chunkwise_gated_delta(*args, scale=float(scale), gate=gate,
                                             **chosen.as_dict())
    return y.astype(q.dtype), state
