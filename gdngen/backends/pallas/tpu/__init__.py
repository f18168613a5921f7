"""Pallas TPU backend: generated Mosaic kernels for the chunkwise gated delta rule.

`PallasTPU` (its instance `SPEC`) is `gdngen.backends.pallas.backend.PallasBackend` with
pallas_tpu's hooks, by role: `gdngen.backends.pallas.tpu.config` (constants, `Config`,
resolved parameters, VMEM estimates, the variant space), `gdngen.backends.pallas.tpu.kernels`
(render plan from ``templates/pallas_tpu/``, interpret mode, lowering) and
`gdngen.backends.pallas.tpu.vjp` (layouts, cotangents, the custom-VJP cores and walks). The
module-level names are those of before: constants, the `SPEC` methods and the cached cores.

On a TPU the kernels compile with Mosaic; elsewhere they run in TPU interpret mode
(``pltpu.InterpretParams``: NaN-filled buffers, race detection), with a warning once per
process. Only ``gdngen.variant`` / ``gdngen.render`` run at import; jax is imported when
kernels are rendered or run.
"""

from __future__ import annotations

from gdngen.backends.pallas.tpu.config import (
    BACKEND,
    CHUNK_SIZES,
    INPUT_DTYPES,
    LOG_GATE_FLOOR,
    POLICY_TOLERANCES,
    PRECISIONS,
    RECURRENT_BELOW,
    RECURRENT_TIME_BLOCK,
    Config,
)
from gdngen.backends.pallas.tpu.kernels import (
    LOADED,
    PLAIN_INPUTS,
    TPUKernels,
    _default_interpret_mode,
    mosaic_lowers_precision_high,
)
from gdngen.backends.pallas.tpu.vjp import (
    channel_core,
    channel_grads,
    channel_intra,
    channel_walk_core,
    chunk_core,
    chunk_walks,
    entering_core,
    normed_chunk,
    packed_core,
    run_kernel,
)

__all__ = [
    "BACKEND", "CHUNK_SIZES", "INPUT_DTYPES", "LOADED", "LOG_GATE_FLOOR", "PLAIN_INPUTS",
    "POLICY_TOLERANCES", "PRECISIONS", "RECURRENT_BELOW", "RECURRENT_TIME_BLOCK", "SPEC",
    "Config", "PallasTPU", "_default_interpret_mode", "channel_core", "channel_grads",
    "channel_intra", "channel_walk_core", "chunk_core", "chunk_walks", "clear_cache",
    "default_config", "entering_core", "gated_delta", "interpret_mode", "interpreting",
    "kernel_params", "load_fused_kernels", "load_kernels", "load_packed_kernels",
    "load_steps_kernels", "lower_check", "mosaic_lowers_precision_high", "packed_core",
    "packed_gated_delta", "recurrent_forward", "recurrent_steps_forward",
    "recurrent_vmem_bytes", "render_fused", "render_packed", "render_plan", "render_steps",
    "run_kernel", "variant_space", "vmem_bytes", "walk_vmem_bytes",
]


class PallasTPU(TPUKernels):
    """The pallas_tpu backend: `gdngen.backends.pallas.tpu.kernels.TPUKernels` plus its cores
    (`gdngen.backends.pallas.tpu.vjp`) and recurrent kernel run."""

    name, config, tolerances, dtypes = BACKEND, Config, POLICY_TOLERANCES, INPUT_DTYPES
    device_kinds, device_limit, reference_device = ("tpu",), "vmem_budget", "tpu-v5e"
    #: the recurrent kernel and the chunk forward have an output norm build (variants whose
    #: dv_tile is Dv); the recurrent kernel a conv build (the conv in its loads), and so has
    #: the chunk forward's norm build (`chunk_conv`)
    fused_inputs, recurrent_conv = ("qk_norm", "gate", "conv", "norm"), True
    #: the module's functions
    caches = (chunk_core, packed_core, chunk_walks, entering_core, channel_core,
              channel_intra, channel_grads, channel_walk_core, normed_chunk)
    #: the cores on a loaded build ``key`` (sha256, interpret), cached process-wide
    #: (`gdngen.backends.pallas.tpu.vjp`)
    chunk_core, packed_core = staticmethod(chunk_core), staticmethod(packed_core)
    chunk_walks, entering_core = staticmethod(chunk_walks), staticmethod(entering_core)
    channel_core, channel_intra = staticmethod(channel_core), staticmethod(channel_intra)
    channel_grads = staticmethod(channel_grads)
    channel_walk_core, normed_chunk = staticmethod(channel_walk_core), staticmethod(normed_chunk)

    def chunk_conv(self, variant, problem) -> bool:
        """Both gate kinds: the chunk forward's norm build convolves the raw q, k, v in its
        loads (scalar: the forward kernel; per-channel: the intra-chunk kernel), each chunk
        block staged behind the raw rows before it (`normed_chunk` with ``conv``)."""
        return True

    def differentiated_conv(self, variant, problem) -> bool:
        """Scalar gates: the chunk core's forward kernel convolves the raw q, k, v in its loads
        (the conv build of the fused forward, with the chunk states it saves); the backward
        recomputes the conv."""
        return problem.gate == "scalar"

    def chunk_norm(self, variant, problem) -> bool:
        """Both gate kinds, where a program's heads' output lanes are a whole number of vregs
        (Dv a multiple of 128) or the whole row (one tile of all Hv heads): the norm build
        writes each head's (C, Dv) rows at a static lane offset of the call's layout."""
        return (problem.Dv % 128 == 0
                or self.kernel_params(variant, problem)["head_tile"] == problem.Hv)

    def holds_whole_head(self, variant, problem) -> bool:
        """A program holds a head's whole Dv where the variant's ``dv_tile`` is Dv."""
        return self.kernel_params(variant, problem)["dv_tile"] == problem.Dv

    def run_recurrent(self, kernels, q, k, v, decay, beta, S0, gate=(), *, scale, what,
                      conv=None, **norm):
        """``kernels.run_recurrent`` on float32 API-layout arrays (q, k ``[B, T, Hk, Dk]``, v
        ``[B, T, Hv, Dv]``, decay, beta, S0; ``gate`` a fused build's gate operands, then a
        norm build's z and norm_weight, whose ``norm_eps`` comes in ``norm``; a conv build's
        ``conv = (conv_weight [C, K], conv_state [B, C, K-1] or None: zeros)``, which the
        kernel's wrapper lays out per input) with the race check: ``(y, final state or every
        step's)``."""
        if conv is not None:  # between the gate's operands and the norm's
            import jax.numpy as jnp

            weight, state = conv
            if state is None:
                state = jnp.zeros((q.shape[0], weight.shape[0], weight.shape[1] - 1), jnp.float32)
            split = len(gate) - 2 if norm else len(gate)
            gate = (*gate[:split], weight, state, *gate[split:])
        return run_kernel(kernels.run_recurrent, q, k, v, decay, beta, S0, *gate, scale=scale,
                          what=what, interpret=kernels.interpret, **norm)


SPEC = PallasTPU()

kernel_params, vmem_bytes, variant_space, default_config = (
    SPEC.kernel_params, SPEC.footprint, SPEC.space, SPEC.default)
walk_vmem_bytes, recurrent_vmem_bytes = SPEC.walk_vmem_bytes, SPEC.recurrent_vmem_bytes
render_plan, render_fused, render_packed, render_steps = (
    SPEC.render_plan, SPEC.render_fused, SPEC.render_packed, SPEC.render_steps)
interpret_mode, interpreting, clear_cache, lower_check = (
    SPEC.interpret_mode, SPEC.interpreting, SPEC.clear_cache, SPEC.lower_check)
load_kernels, load_fused_kernels = SPEC.load_kernels, SPEC.load_fused_kernels
load_packed_kernels, load_steps_kernels = SPEC.load_packed_kernels, SPEC.load_steps_kernels
recurrent_forward, recurrent_steps_forward = SPEC.recurrent_forward, SPEC.recurrent_steps_forward


def gated_delta(q, k, v, g, beta, initial_state=None, *, mask=None, scale=1.0, gate="log",
                variant, templates_dir=None, qk_norm=False):
    """Gated delta rule on ``variant``'s kernels: ``(y, final_state)``; arguments as
    `gdngen.jax.gated_delta` (scalar or per-channel gates; q, k, v float32 or bfloat16).
    Differentiable (custom VJP) and jit-able; the path taken:
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
