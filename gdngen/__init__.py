"""gdngen: kernel generator and autotuner for the gated delta rule.

Framework entry points live in submodules so that importing one framework never imports the
other: ``gdngen.jax.gated_delta`` and ``gdngen.mlx.gated_delta``. The pipeline stages are
modules: problem -> variant -> render -> build -> validate -> time -> cache -> load.
"""

__version__ = "0.1.0"

from gdngen.dispatch import load_tuned
from gdngen.render import Rendered, render
from gdngen.variant import Problem, Variant, default_variant, variants

__all__ = ["Problem", "Rendered", "Variant", "default_variant", "load_tuned", "render",
           "variants"]
