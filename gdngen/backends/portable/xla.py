"""xla: the portable chunkwise gated delta rule in jax.numpy, on any JAX device.

The implementation is `gdngen.backends.portable.jax_chunkwise` (imported when a call runs), so this
declaration imports no framework. ``qk_norm`` is fused into its chunk core (raw q, k kept for
the backward, `gdngen.backends.portable.jax_chunkwise.chunk_core`).
"""

from __future__ import annotations

from gdngen.backends import portable

Config, gated_delta, SPEC = portable.declare("xla", "jax", "gdngen.backends.portable.jax_chunkwise",
                                             device_kinds=("cpu", "tpu", "gpu"),
                                             fused_inputs=("qk_norm", "gate"))
