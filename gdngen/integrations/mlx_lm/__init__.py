"""Train mlx-lm's gated-delta models on gdngen: GatedDeltaNet (Qwen3.5, Qwen3-Next, OLMo
hybrid, ...) and Kimi Delta Attention (Kimi Linear, Kimi K3, Bailing V3).

mlx-lm's linear-attention layers call ``gated_delta_update(..., use_kernel=not self.training)``,
so every training step runs ``gated_delta_ops``, a per-token loop. `patch` replaces that function
in every mlx-lm module that imported it; calls made with ``use_kernel=False`` (the training path)
then run `gdngen.mlx.gated_delta` on the raw gate projection and beta logits with the layer's
parameters (``gate="softplus"`` or ``"sigmoid_bound"``, ``A_log``, ``dt_bias``,
``beta_activation="sigmoid"``: the gate is taken in log space, `gdngen.algebra.layer_inputs`, never
as
``log(exp(...))``). Both gate forms are routed:

- per head, ``a [B,T,Hv]`` with ``A_log``, ``dt_bias [Hv]`` (Qwen3.5, Qwen3-Next, OLMo hybrid):
  gdngen's chunkwise kernels;
- per channel, ``a [B,T,Hv,Dk]`` with ``A_log [Hv,1]`` and ``dt_bias [Hv,Dk]`` (Kimi Linear,
  Kimi K3, Bailing V3; Kimi K3 and Bailing V3 with the ``lower_bound`` gate, their
  ``gate_lower_bound`` / ``kda_lower_bound``, passed on exactly as mlx-lm applies it):
  gdngen's own per-channel path.

q and k arrive normalised (mlx-lm's models call ``normalize_qk`` before
``gated_delta_update``), so ``qk_norm`` stays off. Calls with ``use_kernel=True`` (inference;
mlx-lm's Metal kernel where it has one) keep mlx-lm's function unless ``patch(inference=True)``
(Kimi K3 ``mx.compile``s its T=1 decode step per layer on first use, on Metal: patch before the
first decode for that step to be routed). Training calls run gdngen's chunk path at every T
(they are differentiated, and the chunk path's VJP needs its forward); inference calls take the
variant's recurrent switch (decode and short prefill through the step loop below the tuned
crossover T).
Calls gdngen cannot take (a head dim outside 16..256, a ``lower_bound`` that is not a finite
negative number, a gate or parameter shape other than the above) keep mlx-lm's function.

    from gdngen.integrations import mlx_lm as gdn_mlx_lm

    gdn_mlx_lm.patch()                 # before building / compiling the train step
    ...                                # mlx_lm.tuner.trainer.train(...) as usual
    gdn_mlx_lm.unpatch()               # or: with gdn_mlx_lm.patched(): ...

Importing this module does not import mlx-lm; `patch` does, and checks its version.

Modules: `gdngen.integrations.mlx_lm.update` (gdngen's ``gated_delta_update`` and which calls it
takes), `gdngen.integrations.mlx_lm.route` (the active patch and the function it installs),
`gdngen.integrations.mlx_lm.mixers` (whole layers of the `MIXER_LAYERS` families),
`gdngen.integrations.mlx_lm.rewind` (``RewindableCache`` for speculative decoding),
`gdngen.integrations.mlx_lm.patching` (`patch`, `unpatch`, the version check and the module
scan); the public names are re-exported here.
"""

from __future__ import annotations

from gdngen.integrations.mlx_lm.mixers import MIXER_LAYERS
from gdngen.integrations.mlx_lm.patching import (
                                                 SUPPORTED_MLX_LM,
                                                 check_mlx_lm_version,
                                                 is_patched,
                                                 patch,
                                                 patched,
                                                 patched_modules,
                                                 unpatch,
)
from gdngen.integrations.mlx_lm.rewind import MAX_REWIND
from gdngen.integrations.mlx_lm.update import gdngen_gated_delta_update, log_decay

__all__ = [
    "MAX_REWIND",
    "MIXER_LAYERS",
    "SUPPORTED_MLX_LM",
    "check_mlx_lm_version",
    "gdngen_gated_delta_update",
    "is_patched",
    "log_decay",
    "patch",
    "patched",
    "patched_modules",
    "unpatch",
]
