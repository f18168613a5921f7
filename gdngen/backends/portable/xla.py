"""xla: the portable chunkwise gated delta rule in jax.numpy, on any JAX device.

The implementation is `gdngen.backends.portable.jax_chunkwise` (imported when a call runs), so this
declaration imports no framework. ``qk_norm`` and a parameterised gate are fused into its chunk
core (raw q, k and ``a`` kept for the backward,
`gdngen.backends.portable.jax_chunkwise.chunk_core`).
"""

from __future__ import annotations

from dataclasses import dataclass

from gdngen.backends.portable import RECURRENT_BELOW, PortableBackend, PortableConfig
from gdngen.config import recurrent_switch


@dataclass(frozen=True)
class Config(PortableConfig):
    backend = "xla"
    recurrent_below: int = recurrent_switch(RECURRENT_BELOW["xla"]["scalar"])


SPEC = PortableBackend("xla", "jax", "gdngen.backends.portable.jax_chunkwise", Config,
                       device_kinds=("cpu", "tpu", "gpu"), fused_inputs=("qk_norm", "gate"))
gated_delta = SPEC.entry()
