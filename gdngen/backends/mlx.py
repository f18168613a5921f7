"""mlx: the portable chunkwise gated delta rule in mlx.core, on any MLX device.

The implementation is `gdngen.backends.mlx_chunkwise` (imported when a call runs), so this
declaration imports no framework.
"""

from __future__ import annotations

from dataclasses import dataclass

from gdngen.backends import portable
from gdngen.spec import BackendSpec


@dataclass(frozen=True)
class Config(portable.PortableConfig):
    backend = "mlx"


def gated_delta(q, k, v, g, beta, initial_state=None, *, mask=None, scale=1.0, gate="log",
                variant):
    """Run an mlx ``variant`` (shapes as `gdngen.mlx.gated_delta`)."""
    import mlx.core as mx

    from gdngen.backends import mlx_chunkwise

    return portable.gated_delta(mlx_chunkwise, mx.float32, mx.zeros, q, k, v, g, beta,
                                initial_state, mask=mask, scale=scale, gate=gate,
                                config=SPEC.parse(variant))


SPEC = BackendSpec(
    name="mlx", framework="mlx", config=Config, space=portable.space(Config),
    default=portable.default(Config), entry=gated_delta, tolerances=portable.TOLERANCES,
    device_kinds=("cpu", "apple"), portable=True, gates=("scalar", "vector"),
    source_modules=("gdngen.chunkwise", "gdngen.backends.portable",
                    "gdngen.backends.mlx_chunkwise"))
