"""Command line: the ``gdngen`` click group (``gdngen validate``, ``bench``, ``build``,
``tune``, ``devices``, ``show``, ``merge``, ``report``, ``doctor``); the commands' bodies are in
`gdngen.tools.commands`.

Framework packages (jax, mlx) are imported lazily inside the commands, so importing this module
or running ``gdngen --help`` never imports them.
"""

from __future__ import annotations

import click

from gdngen._version import __version__
from gdngen.tools.commands.builds import build
from gdngen.tools.commands.caches import devices, merge, report, show
from gdngen.tools.commands.checks import bench, validate
from gdngen.tools.commands.doctor import doctor
from gdngen.tools.commands.tuning import tune


@click.group()
@click.version_option(version=__version__, prog_name="gdngen")
def main():
    """gdngen: kernel generator and autotuner for the gated delta rule."""
    from gdngen import jaxcompat

    # on a host without a TPU, jax's TPU platform stays off (libtpu's start-up errors otherwise);
    # without a GPU, the CUDA plugin registers its compile-only topologies
    jaxcompat.host_settings()


for _command in (validate, bench, build, tune, devices, show, merge, report, doctor):
    main.add_command(_command)

if __name__ == "__main__":
    main()
