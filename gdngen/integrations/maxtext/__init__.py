"""Run MaxText's Qwen3-Next gated-delta layers on gdngen.

MaxText's ``Qwen3NextGatedDeltaNet`` computes its recurrence with
``maxtext.models.qwen3.jax_chunk_gated_delta_rule`` (plain, or inside the layer's
``jax.shard_map`` with ``cp_axis`` for context parallelism): a chunked scan in plain JAX that
runs in ``compute_dtype`` (bfloat16 by default). `patch` replaces that function with
`gdngen_chunk_gated_delta_rule`, which calls ``gdngen.load_tuned("jax")``: the tuned variant for
the device (its generated kernels: Pallas on TPU and GPU), MaxText's ``cp_axis`` as gdngen's
``context_axis``, MaxText's ``use_qk_norm_in_gdn`` as the fused ``qk_norm``, float32
accumulation and float32 intermediates whatever ``compute_dtype`` (the inputs are still cast to
it first, as MaxText does, and the output returned in the query's dtype).

    from gdngen.integrations import maxtext as gdn_maxtext

    gdn_maxtext.patch()                # before tracing / jitting the train step
    ...                                # MaxText's train loop as usual
    gdn_maxtext.unpatch()              # or: with gdn_maxtext.patched(): ...

Importing this module does not import MaxText; `patch` does, and checks its version (Python >=
3.12, ``pip install 'gdngen[maxtext]'``).

Modules: `gdngen.integrations.maxtext.rule` (gdngen's ``jax_chunk_gated_delta_rule``, the
conventions it maps and which calls it takes), `gdngen.integrations.maxtext.patching` (`patch`,
`unpatch`, the version check); the public names are re-exported here.
"""

from __future__ import annotations

from gdngen.integrations.maxtext.patching import (
                                                  SUPPORTED_MAXTEXT,
                                                  check_maxtext_version,
                                                  is_patched,
                                                  patch,
                                                  patched,
                                                  patched_modules,
                                                  unpatch,
)
from gdngen.integrations.maxtext.rule import gdngen_chunk_gated_delta_rule

__all__ = [
    "SUPPORTED_MAXTEXT",
    "check_maxtext_version",
    "gdngen_chunk_gated_delta_rule",
    "is_patched",
    "patch",
    "patched",
    "patched_modules",
    "unpatch",
]
