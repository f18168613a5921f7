"""mlx: the portable chunkwise gated delta rule in mlx.core, on any MLX device.

The implementation is `gdngen.backends.portable.mlx_chunkwise` (imported when a call runs), so this
declaration imports no framework.
"""

from __future__ import annotations

from dataclasses import dataclass

from gdngen.backends.portable import RECURRENT_BELOW, PortableBackend, PortableConfig
from gdngen.config import recurrent_switch


@dataclass(frozen=True)
class Config(PortableConfig):
    backend = "mlx"
    recurrent_below: int = recurrent_switch(RECURRENT_BELOW["mlx"]["scalar"])


SPEC = PortableBackend("mlx", "mlx", "gdngen.backends.portable.mlx_chunkwise", Config,
                       device_kinds=("cpu", "apple"), fused_inputs=("qk_norm", "gate"))
gated_delta = SPEC.entry()
