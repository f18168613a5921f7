"""MLX entry point: ``gdngen.mlx.gated_delta`` (differentiable, compilable). Never imports jax."""

from __future__ import annotations

from gdngen import entry, mixer
from gdngen.entry import Options

__all__ = ["gated_delta", "gated_delta_mixer"]


def gated_delta(q, k, v, g, beta, initial_state=None, *, mask=None, scale=1.0, gate="log",
                chunk_size=None, variant=None, qk_norm=False, A_log=None, dt_bias=None,
                lower_bound=None, beta_activation=None, cu_seqlens=None, state_indices=None,
                output_state_indices=None, state_dtype="float32", return_states="final",
                checkpoint_every=None, conv_weight=None, conv_state=None, norm_weight=None,
                output_gate=None, norm_eps=1e-6, norm_gate="silu"):
    """Gated delta rule over a sequence; returns ``(y, final_state)``.

    Same contract as `gdngen.jax.gated_delta`: q, k ``[B,T,Hk,Dk]``; v ``[B,T,Hv,Dv]``; g
    ``[B,T,Hv]`` or ``[B,T,Hv,Dk]``; beta ``[B,T,Hv]``; initial_state ``[B,Hv,Dv,Dk]`` or None;
    mask ``[B,T]`` bool or None; ``gate`` "log" or "linear". y has q's dtype, final_state is
    float32, accumulation float32. Scalar and vector gates run chunkwise.

    ``variant`` (a `gdngen.Variant`) runs exactly that variant; without it the tuned variant for
    this device and shape class runs, else the default variant of the device's generated
    backend (metal on an Apple GPU) when it implements the call, else the portable ``mlx``
    path. ``chunk_size`` overrides the default variant's chunk.

    Layer inputs, as in `gdngen.jax.gated_delta` (`gdngen.algebra.layer_inputs`; the q/k norm and
    the gate inside the chunk core and the recurrent path, metal's kernels in their loads; packed
    rows get them computed first;
    gradients reach the raw arrays): ``qk_norm``; ``gate="softplus"`` / ``"sigmoid_bound"``
    with ``A_log``, ``dt_bias`` (and ``lower_bound``), g then the raw gate projection;
    ``beta_activation="sigmoid"``; ``conv_weight`` / ``conv_state`` (q, k, v raw before the
    causal conv + SiLU, computed first on MLX); ``norm_weight`` / ``output_gate`` (the gated
    RMSNorm on the output, `gdngen.jax.gated_delta`).

    Packed sequences, as in `gdngen.jax.gated_delta`: ``cu_seqlens`` int32 ``[N+1]``, B = 1,
    ``initial_state`` and the final state ``[N,Hv,Dv,Dk]`` (`gdngen.algebra.packed`).

    Serving, as in `gdngen.jax.gated_delta` (`gdngen.state_pool`): ``state_indices`` with a
    pool ``initial_state`` ``[P,Hv,Dv,Dk]``, which is updated in place and returned
    (``output_state_indices``: the rows written, when not the rows read);
    ``state_dtype="bfloat16"``; ``return_states="steps"`` / ``"chunks"`` with
    ``checkpoint_every``.
    """
    arrays, options = Options.split(locals())
    return entry.body("mlx", arrays, options)


def gated_delta_mixer(mixed_qkv, conv_weight, a, b, z, *, Hk, Hv, Dk, Dv, A_log, dt_bias,
                      norm_weight, conv_state=None, initial_state=None, mask=None,
                      cu_seqlens=None, norm_eps=1e-6, scale=None, gate="softplus",
                      lower_bound=None, norm_gate="silu", chunk_size=None, variant=None,
                      return_states="final", allow_neg_eigval=False):
    """The whole gated-delta mixer (`gdngen.mixer`): causal short conv + SiLU, q/k L2 norm,
    gates, the recurrence, gated RMSNorm; returns ``(out [B,T,Hv,Dv], final_state,
    conv_state [B,C,K-1])`` (``return_states="steps"``: every step's state
    ``[B,T,Hv,Dv,Dk]`` in place of the final one). ``allow_neg_eigval``: beta = 2 sigmoid(b),
    in [0, 2] (OLMo hybrid). Differentiable in every array argument."""
    return mixer.gated_delta_mixer("mlx", gated_delta, **locals())
