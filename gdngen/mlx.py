"""MLX entry point: ``gdngen.mlx.gated_delta`` (differentiable, compilable). Never imports jax."""

from __future__ import annotations

from gdngen.dispatch import call

__all__ = ["gated_delta"]


def gated_delta(q, k, v, g, beta, initial_state=None, *, mask=None, scale=1.0, gate="log",
                chunk_size=None, variant=None):
    """Gated delta rule over a sequence; returns ``(y, final_state)``.

    Same contract as `gdngen.jax.gated_delta`: q, k ``[B,T,Hk,Dk]``; v ``[B,T,Hv,Dv]``; g
    ``[B,T,Hv]`` or ``[B,T,Hv,Dk]``; beta ``[B,T,Hv]``; initial_state ``[B,Hv,Dv,Dk]`` or None;
    mask ``[B,T]`` bool or None; ``gate`` "log" or "linear". y has q's dtype, final_state is
    float32, accumulation float32. Scalar gates run chunkwise, vector gates sequentially.

    ``variant`` (a `gdngen.Variant`) runs exactly that variant; without it the tuned variant for
    this device and shape class runs, else the default variant of the device's generated
    backend (metal on an Apple GPU) when it implements the call, else the portable ``mlx``
    path. ``chunk_size`` overrides the default variant's chunk.
    """
    return call("mlx", q, k, v, g, beta, initial_state, mask=mask, scale=scale, gate=gate,
                chunk_size=chunk_size, variant=variant)
