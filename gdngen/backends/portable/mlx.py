"""mlx: the portable chunkwise gated delta rule in mlx.core, on any MLX device.

The implementation is `gdngen.backends.portable.mlx_chunkwise` (imported when a call runs), so this
declaration imports no framework.
"""

from __future__ import annotations

from gdngen.backends import portable

Config, gated_delta, SPEC = portable.declare("mlx", "mlx", "gdngen.backends.portable.mlx_chunkwise",
                                             device_kinds=("cpu", "apple"),
                                             fused_inputs=("qk_norm", "gate"))
