"""gdngen: kernel generator and autotuner for the gated delta rule.

Framework entry points live in submodules so that importing one framework never imports the
other: ``gdngen.jax.gated_delta`` and ``gdngen.mlx.gated_delta``. The pipeline stages are
modules: problem -> variant -> render -> build -> validate -> time -> cache -> load; the
backends are declared in `gdngen.registry`.
"""

from gdngen import jaxcompat

# a CPU host with libtpu installed prints libtpu's start-up errors on jax's first platform
# start: every gdngen import keeps it quiet unless the user chose the platforms (`quiet_host`)
jaxcompat.quiet_host()

from gdngen._version import __version__
from gdngen.entry import load_tuned
from gdngen.firstuse import FirstUseWarning  # installs the first-use check
from gdngen.problem import Problem
from gdngen.registry import default_variant, variants
from gdngen.render import Rendered, render
from gdngen.variant import Variant

__all__ = ["FirstUseWarning", "Problem", "Rendered", "Variant", "__version__", "default_variant",
           "load_tuned", "render", "variants"]
