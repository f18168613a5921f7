"""JAX entry point: ``gdngen.jax.gated_delta`` (differentiable, jit-able). Never imports mlx."""

from __future__ import annotations

from gdngen.dispatch import call

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
    this device and shape class runs, else the default variant of the device's generated
    backend when it implements the call, else the portable ``xla`` path. ``chunk_size``
    overrides the default variant's chunk.
    """
    return call("jax", q, k, v, g, beta, initial_state, mask=mask, scale=scale, gate=gate,
                chunk_size=chunk_size, variant=variant)
