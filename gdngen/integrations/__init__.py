"""Integrations of gdngen with third-party model libraries.

Each submodule imports its library lazily (only when the submodule itself is imported), so
``import gdngen`` never needs them. `gdngen.integrations.mlx_lm` routes mlx-lm's GatedDeltaNet
training path to `gdngen.mlx.gated_delta`; `gdngen.integrations.maxtext` routes MaxText's Qwen3-Next
``jax_chunk_gated_delta_rule`` to ``gdngen.load_tuned("jax")``.
"""
