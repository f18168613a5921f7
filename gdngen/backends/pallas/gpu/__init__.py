"""Pallas GPU backend: generated Triton-lowered kernels for the chunkwise gated delta rule, for
NVIDIA GPUs (a100, h100, h200 in `gdngen.devices`).

`PallasGPU` (its instance `SPEC`) is `gdngen.backends.pallas.backend.PallasBackend` with
pallas_gpu's hooks, by role: `gdngen.backends.pallas.gpu.config` (constants, `Config`,
resolved parameters, the shared-memory estimate, the variant space),
`gdngen.backends.pallas.gpu.kernels` (render plan from ``templates/pallas_gpu/``, interpret
mode, lowering) and `gdngen.backends.pallas.gpu.vjp` (layouts, cotangents, the custom-VJP cores
and walks). The module-level names are those of before: constants, the `SPEC` methods and the
cached cores.

On a GPU the kernels lower through ``jax.experimental.pallas.triton``; elsewhere (or with
``GDNGEN_INTERPRET=1``) they run in Pallas interpret mode (outputs start NaN), with a warning
once per process. Only ``gdngen.variant`` / ``gdngen.render`` run at import; jax is imported
when kernels are rendered or run.
"""

from __future__ import annotations

from gdngen.backends.pallas.core import call_jitted
from gdngen.backends.pallas.gpu.config import (
    BACKEND,
    CHUNK_SIZES,
    ENV_INTERPRET,
    INPUT_DTYPES,
    LOG_GATE_FLOOR,
    NUM_STAGES,
    NUM_WARPS,
    POLICY_TOLERANCES,
    PRECISIONS,
    RECURRENT_BELOW,
    TILES,
    Config,
    padded_dim,
    tiles,
)
from gdngen.backends.pallas.gpu.kernels import (
    LOADED,
    PLAIN_INPUTS,
    GPUKernels,
    _default_interpret_mode,
)
from gdngen.backends.pallas.gpu.vjp import (
    channel_core,
    channel_grads,
    channel_intra,
    channel_walk_core,
    chunk_core,
    chunk_walks,
    entering_core,
    normed_chunk,
    packed_core,
    pad_last,
    states_to_kernel,
)

__all__ = [
    "BACKEND", "CHUNK_SIZES", "ENV_INTERPRET", "INPUT_DTYPES", "LOADED", "LOG_GATE_FLOOR",
    "NUM_STAGES", "NUM_WARPS", "PLAIN_INPUTS", "POLICY_TOLERANCES", "PRECISIONS",
    "RECURRENT_BELOW", "SPEC", "TILES", "Config", "PallasGPU", "_default_interpret_mode",
    "channel_core", "channel_grads", "channel_intra", "channel_walk_core", "chunk_core",
    "chunk_walks", "clear_cache", "compiling_for_gpu", "default_config", "entering_core",
    "gated_delta", "interpret_mode", "interpreting", "kernel_params", "load_fused_kernels",
    "load_kernels", "load_packed_kernels", "load_steps_kernels", "lower_check", "numerics_key",
    "packed_core", "packed_gated_delta", "padded_dim", "recurrent_forward",
    "recurrent_steps_forward", "render_fused", "render_packed", "render_plan", "render_steps",
    "shared_memory_bytes", "tiles", "variant_space",
]


class PallasGPU(GPUKernels):
    """The pallas_gpu backend: `gdngen.backends.pallas.gpu.kernels.GPUKernels` plus its cores
    (`gdngen.backends.pallas.gpu.vjp`) and recurrent kernel run."""

    name, config, tolerances, dtypes = BACKEND, Config, POLICY_TOLERANCES, INPUT_DTYPES
    device_kinds, device_limit, reference_device = ("gpu",), "shared_memory", "h100"
    #: the recurrent kernel and the chunk forward have an output norm build (variants whose bv
    #: is the padded Dv); the recurrent kernel a conv build (the conv in its loads)
    fused_inputs, recurrent_conv = ("qk_norm", "gate", "conv", "norm"), True
    #: the module's functions
    caches = (chunk_core, packed_core, chunk_walks, entering_core, channel_core,
              channel_intra, channel_grads, channel_walk_core, normed_chunk)
    #: the cores on a loaded build ``key`` (sha256, interpret), cached process-wide
    #: (`gdngen.backends.pallas.gpu.vjp`)
    chunk_core, packed_core = staticmethod(chunk_core), staticmethod(packed_core)
    chunk_walks, entering_core = staticmethod(chunk_walks), staticmethod(entering_core)
    channel_core, channel_intra = staticmethod(channel_core), staticmethod(channel_intra)
    channel_grads = staticmethod(channel_grads)
    channel_walk_core, normed_chunk = staticmethod(channel_walk_core), staticmethod(normed_chunk)

    def chunk_conv(self, variant, problem) -> bool:
        """Both gate kinds: the chunk forward's norm build convolves the raw q, k, v in its
        loads (scalar: both kernels; per-channel: the intra-chunk kernel, which then forms the
        q/k norm; `normed_chunk` with ``conv``)."""
        return True

    def chunk_norm(self, variant, problem) -> bool:
        """Both gate kinds: the walk normalises each chunk's y rows in its stores and writes
        them in the call's time-row layout (`normed_chunk`), any Dv."""
        return True

    def holds_whole_head(self, variant, problem) -> bool:
        """A program holds a head's whole (padded) Dv where the variant's ``bv`` is it."""
        params = self.kernel_params(variant, problem)
        return params["bv"] == params["dv"]

    def run_recurrent(self, kernels, q, k, v, decay, beta, S0, gate=(), *, scale, what,
                      conv=None, **norm):
        """``kernels.run_recurrent`` on float32 API-layout arrays (q, k ``[B, T, Hk, Dk]``, v
        ``[B, T, Hv, Dv]``, decay, beta, S0; ``gate`` a fused build's gate operands, then a
        norm build's z and norm_weight, whose ``norm_eps`` comes in ``norm``; a conv build's
        ``conv = (conv_weight [C, K], conv_state [B, C, K-1] or None)``, laid out per input by
        `conv_operands`), head dims zero-padded to the kernels' ``dk`` / ``dv`` (exact: the
        norm's mean is over the real Dv) and cut back: ``(y, final state or every step's)``."""
        import jax.numpy as jnp

        del what  # no race detector here
        p, f32 = kernels.params, jnp.float32
        Dk, Dv = q.shape[-1], v.shape[-1]
        gate, normed = (gate[:-2], gate[-2:]) if norm else (gate, ())
        if gate and decay.ndim == 4:  # padded key channels: their state columns stay zero
            gate = (*(pad_last(x, p["dk"]) for x in gate[:2]), *gate[2:])
        if conv is not None:  # the conv build's taps and states, then the norm's
            gate = (*gate, *conv_operands(*conv, q.shape, v.shape, p["dk"], p["dv"]))
            norm = dict(norm, conv_k=int(conv[0].shape[1]))
        # a norm build's z [B, T, Hv, Dv] and norm_weight [Dv]: zero rows past Dv
        gate = (*gate, *(pad_last(x.astype(f32), p["dv"]) for x in normed))
        q, k = (pad_last(x.astype(f32), p["dk"]) for x in (q, k))
        if decay.ndim == 4:
            decay = pad_last(decay.astype(f32), p["dk"])
        y, s_final = call_jitted(kernels.run_recurrent, q, k, pad_last(v.astype(f32), p["dv"]),
                                 decay.astype(f32), beta.astype(f32),
                                 states_to_kernel(S0.astype(f32)[:, :, None], p["dk"], p["dv"]),
                                 *gate, scale=scale, interpret=kernels.interpret, **norm)
        return y[..., :Dv], s_final[..., :Dv, :Dk]


def conv_operands(weight, state, q_shape, v_shape, dk: int, dv: int) -> tuple:
    """The conv build's operands from the mixer's ``conv_weight [C, K]`` and ``conv_state [B,
    C, K-1]`` (None: zeros; C = 2 Hk Dk + Hv Dv, q's channels, k's, then v's): the taps of q,
    k ``[Hk, KP, dk]`` and v ``[Hv, KP, dv]``, then the state rows of q, k ``[B, Hk, KS, dk]``
    and v ``[B, Hv, KS, dv]`` (oldest first), float32; KP >= K and KS >= K - 1 powers of two
    (Triton's block sizes), the padding zeros."""
    import jax.numpy as jnp

    B, _, Hk, Dk = q_shape
    Hv, Dv = v_shape[2], v_shape[3]
    K = weight.shape[1]
    KP, KS = (1 << max(n - 1, 0).bit_length() for n in (K, max(K - 1, 1)))
    kd = Hk * Dk
    parts = ((0, Hk, Dk, dk), (kd, Hk, Dk, dk), (2 * kd, Hv, Dv, dv))

    def taps(lo, H, D, width):  # [H D, K] -> [H, KP, width]
        x = weight[lo:lo + H * D].astype(jnp.float32).reshape(H, D, K).transpose(0, 2, 1)
        return jnp.pad(x, ((0, 0), (0, KP - K), (0, width - D)))

    def rows(lo, H, D, width):  # [B, H D, K-1] -> [B, H, KS, width]
        if state is None:
            return jnp.zeros((B, H, KS, width), jnp.float32)
        x = state[:, lo:lo + H * D].astype(jnp.float32).reshape(B, H, D, K - 1)
        return jnp.pad(x.transpose(0, 1, 3, 2), ((0, 0), (0, 0), (0, KS - (K - 1)),
                                                 (0, width - D)))

    return (*(taps(*part) for part in parts), *(rows(*part) for part in parts))


SPEC = PallasGPU()

kernel_params, shared_memory_bytes, variant_space, default_config, numerics_key = (
    SPEC.kernel_params, SPEC.footprint, SPEC.space, SPEC.default, SPEC.numerics_key)
render_plan, render_fused, render_packed, render_steps = (
    SPEC.render_plan, SPEC.render_fused, SPEC.render_packed, SPEC.render_steps)
interpret_mode, interpreting, compiling_for_gpu = (
    SPEC.interpret_mode, SPEC.interpreting, SPEC.compiling_for_gpu)
clear_cache, lower_check = SPEC.clear_cache, SPEC.lower_check
load_kernels, load_fused_kernels = SPEC.load_kernels, SPEC.load_fused_kernels
load_packed_kernels, load_steps_kernels = SPEC.load_packed_kernels, SPEC.load_steps_kernels
recurrent_forward, recurrent_steps_forward = SPEC.recurrent_forward, SPEC.recurrent_steps_forward


def gated_delta(q, k, v, g, beta, initial_state=None, *, mask=None, scale=1.0, gate="log",
                variant, templates_dir=None, qk_norm=False):
    """Gated delta rule on ``variant``'s kernels: ``(y, final_state)``; arguments as
    `gdngen.jax.gated_delta` (scalar or per-channel gates; q, k, v float32, bfloat16 or
    float16). Differentiable (custom VJP) and jit-able; the path taken:
    `gdngen.backends.pallas.backend.PallasBackend.forward`."""
    return SPEC.entry(q, k, v, g, beta, initial_state, mask=mask, scale=scale, gate=gate,
                      variant=variant, templates_dir=templates_dir, qk_norm=qk_norm)


def packed_gated_delta(q, k, v, g, beta, initial_state=None, *, mask=None, scale=1.0,
                       gate="log", variant, cu_seqlens, templates_dir=None):
    """A packed row (scalar gates, `gdngen.backends.pallas.backend.PallasBackend.packed`);
    arguments as `gated_delta` with ``cu_seqlens`` int32 ``[N+1]``."""
    return SPEC.packed_entry(q, k, v, g, beta, initial_state, mask=mask, scale=scale,
                             gate=gate, variant=variant, cu_seqlens=cu_seqlens,
                             templates_dir=templates_dir)
