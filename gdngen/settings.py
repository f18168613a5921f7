"""Every setting gdngen reads from the environment, and the cache root they point into.

=========================  ==================================================================
variable                   meaning
=========================  ==================================================================
``GDNGEN_CACHE_DIR``       root of everything gdngen caches (tuned files, studies, validation
                           memo, compiled ffi_cpu libraries, Metal simulator objects); default
                           platformdirs' user cache dir for "gdngen"
``GDNGEN_METAL_SIM_CACHE`` the Metal simulator's objects (default ``<cache root>/metal_sim``)
``GDNGEN_METAL_SIM_WORKERS`` threads running simulated threadgroups (default: the usable cores)
``GDNGEN_TEMPLATES``       a template override folder (shadows shipped templates by path)
``GDNGEN_NO_TUNED``        1: skip the tuned cache (untuned defaults only)
``GDNGEN_PLUGINS``         modules imported by the tuner and its trial processes (out-of-tree
                           backends register themselves there)
``GDNGEN_INTERPRET``       1: generated GPU kernels run in interpret mode (``tune --dry-run``)
``GDNGEN_POISON_OUTPUTS``  1: NaN-fill ffi_cpu outputs before the kernels write them (tests)
``GDNGEN_NO_PARTITIONING`` 1: a JAX call outside ``jax.shard_map`` on a host with several
                           devices is the plain call, not custom_partitioning ops (whose
                           backward re-runs the forward); a sharded jit then gathers its inputs
``GDNGEN_VALIDATE``        generated kernels' check on first use (`gdngen.firstuse`): "first-use"
                           (default), "off" (trust them), "always" (again in each process)
``GDNGEN_TUNER_PID``       set by the tuner for its trial processes (internal)
``GDNGEN_HOST``            this tuner's host name in shared studies (default the hostname): set
                           it where hosts (containers) share a hostname but not their pids
``CXX``                    the C++ compiler command (split like shell words, e.g. "ccache g++");
                           default g++, else c++ (ffi_cpu and the Metal simulator alike)
=========================  ==================================================================
"""

from __future__ import annotations

import functools
import os
import shlex
import shutil
from pathlib import Path

ENV_CACHE_DIR = "GDNGEN_CACHE_DIR"
ENV_METAL_SIM_CACHE = "GDNGEN_METAL_SIM_CACHE"
ENV_METAL_SIM_WORKERS = "GDNGEN_METAL_SIM_WORKERS"
ENV_TEMPLATES = "GDNGEN_TEMPLATES"
ENV_NO_TUNED = "GDNGEN_NO_TUNED"
ENV_PLUGINS = "GDNGEN_PLUGINS"
ENV_INTERPRET = "GDNGEN_INTERPRET"
ENV_POISON_OUTPUTS = "GDNGEN_POISON_OUTPUTS"
ENV_NO_PARTITIONING = "GDNGEN_NO_PARTITIONING"
ENV_VALIDATE = "GDNGEN_VALIDATE"
ENV_TUNER_PID = "GDNGEN_TUNER_PID"
ENV_HOST = "GDNGEN_HOST"
ENV_COMPILER = "CXX"


def flag(name: str) -> bool:
    """Whether the environment variable ``name`` is set to something other than "" or "0"."""
    return os.environ.get(name, "") not in ("", "0")


def cache_root() -> Path:
    """gdngen's user cache folder: ``$GDNGEN_CACHE_DIR`` or platformdirs' user cache dir."""
    env = os.environ.get(ENV_CACHE_DIR)
    if env:
        return Path(env)
    return _platform_cache_root(os.environ.get("XDG_CACHE_HOME"), os.environ.get("HOME"))


@functools.lru_cache(maxsize=8)
def _platform_cache_root(xdg_cache_home, home) -> Path:
    """platformdirs' user cache dir, once per value of the variables it reads (a dispatch at
    decode length asks for it per call)."""
    import platformdirs

    return Path(platformdirs.user_cache_dir("gdngen", appauthor=False))


def host_id() -> str:
    """This host's name in shared studies: ``$GDNGEN_HOST`` or the hostname. Tuners with one
    name must see each other's pids (a dead pid of this name is recovered at once)."""
    import socket

    return os.environ.get(ENV_HOST) or socket.gethostname()


def validate_mode() -> str | None:
    """``$GDNGEN_VALIDATE`` as set (stripped, lower case), or None (`gdngen.firstuse.mode`)."""
    return os.environ.get(ENV_VALIDATE, "").strip().lower() or None


def templates_override() -> str | None:
    """The template override folder named by ``$GDNGEN_TEMPLATES``, if any."""
    return os.environ.get(ENV_TEMPLATES) or None


def plugins() -> list[str]:
    """Module names listed in ``$GDNGEN_PLUGINS`` (comma-separated)."""
    return [n.strip() for n in os.environ.get(ENV_PLUGINS, "").split(",") if n.strip()]


def compiler(purpose: str) -> list[str]:
    """The C++ compiler command: ``$CXX`` split like shell words (e.g. "ccache g++"), else g++,
    else c++; RuntimeError naming ``purpose`` when there is none."""
    command = shlex.split(os.environ.get(ENV_COMPILER, "")) or [
        shutil.which("g++") or shutil.which("c++") or ""]
    if not command[0] or not shutil.which(command[0]):
        raise RuntimeError(f"{purpose} needs a C++ compiler: set ${ENV_COMPILER} or install g++ "
                           f"(got {' '.join(command) or 'none'})")
    return command


def caller_stacklevel() -> int:
    """The ``stacklevel`` of a ``warnings.warn`` made here that points at the first frame
    outside gdngen and JAX (the user's call, however deep the stages between)."""
    import os
    import sys

    package = os.path.dirname(os.path.abspath(__file__)) + os.sep
    inside = (package, os.sep + "jax" + os.sep, os.sep + "jaxlib" + os.sep)
    frame, level = sys._getframe(1), 1
    while frame is not None and any(p in frame.f_code.co_filename for p in inside):
        frame, level = frame.f_back, level + 1
    return level
