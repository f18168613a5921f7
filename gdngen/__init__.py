"""gdngen: kernel generator and autotuner for the gated delta rule.

Framework entry points live in submodules so that importing one framework never imports the
other: ``gdngen.jax.gated_delta`` and ``gdngen.mlx.gated_delta``.
"""

__version__ = "0.1.0"
