"""xla: the portable chunkwise gated delta rule in jax.numpy, on any JAX device.

The implementation is `gdngen.backends.jax_chunkwise` (imported when a call runs), so this
declaration imports no framework.
"""

from __future__ import annotations

from dataclasses import dataclass

from gdngen.backends import portable
from gdngen.spec import BackendSpec


@dataclass(frozen=True)
class Config(portable.PortableConfig):
    backend = "xla"


def gated_delta(q, k, v, g, beta, initial_state=None, *, mask=None, scale=1.0, gate="log",
                variant):
    """Run an xla ``variant`` (shapes as `gdngen.jax.gated_delta`)."""
    import jax.numpy as jnp

    from gdngen.backends import jax_chunkwise

    return portable.gated_delta(jax_chunkwise, jnp.float32, jnp.zeros, q, k, v, g, beta,
                                initial_state, mask=mask, scale=scale, gate=gate,
                                config=SPEC.parse(variant))


SPEC = BackendSpec(
    name="xla", framework="jax", config=Config, space=portable.space(Config),
    default=portable.default(Config), entry=gated_delta, tolerances=portable.TOLERANCES,
    device_kinds=("cpu", "tpu", "gpu"), portable=True, gates=("scalar", "vector"),
    source_modules=("gdngen.chunkwise", "gdngen.backends.portable",
                    "gdngen.backends.jax_chunkwise"))
