"""ffi_cpu's kernel builds: the render plan of parsed kernel parameters, one source rendered,
the C++ compile into a cached shared library, its loading and registration as XLA FFI targets,
and the launch shape of a call (worker threads, head splits, recurrent row blocks)."""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import subprocess
import tempfile
from pathlib import Path

from gdngen import jaxcompat, settings
from gdngen.algebra import chunkwise_channel
from gdngen.backends.ffi_cpu.config import BACKEND, padded
from gdngen.backends.kernel_inputs import KernelInputs
from gdngen.problem import Problem
from gdngen.variant import Variant

TEMPLATE = "ffi_cpu/gated_delta.cc.j2"
SOURCE_NAME = "gated_delta.cc"
PACKED_SOURCE_NAME = "gated_delta_packed.cc"
#: the recurrent (short-call forward) kernel's template and rendered file
RECURRENT_TEMPLATE = "ffi_cpu/recurrent.cc.j2"
RECURRENT_SOURCE_NAME = "recurrent.cc"
#: the rendered file of the per-step-states build of the recurrent kernel (``render_steps``)
STEPS_SOURCE_NAME = "recurrent_steps.cc"
#: which kernels of a fused build (``render_fused``) each of its sources holds
FUSED_KINDS = {RECURRENT_SOURCE_NAME: ("recurrent",), SOURCE_NAME: ("forward",)}
#: state rows whose dot products the recurrent kernel runs together (2 accumulators each):
#: 4 rows keep 8 accumulators plus the k / q vectors within AVX2's 16 registers.
RECURRENT_ROW_TILE = 4
#: most state rows per recurrent task: 32 rows of 128 floats (16 KiB) stay in L1 over the walk.
RECURRENT_MAX_ROWS = 32
#: prefix of the C++ symbols of the handlers (``_forward`` / ``_backward`` in the chunk source,
#: ``_recurrent`` in the recurrent one; each library is loaded on its own).
SYMBOL = "gdngen_gated_delta"
#: flags of every build; on x86-64 GCC also gets -mprefer-vector-width=512, so its own
#: vectorised loops use AVX-512 registers where the host has them (the matmul kernel's vector
#: types are 16 floats wide regardless).
COMPILE_FLAGS = ("-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-pthread") + (
    ("-mprefer-vector-width=512",) if platform.machine().lower() in ("x86_64", "amd64") else ())
#: set to 1 to NaN-fill every kernel output before the kernel writes it (tests: an element a
#: kernel leaves unwritten then shows as NaN).
ENV_POISON = settings.ENV_POISON_OUTPUTS


# ----------------------------------------------------------------------------- render


def plan(params: dict, problem: Problem) -> dict:
    """``{SOURCE_NAME: (TEMPLATE, context), RECURRENT_SOURCE_NAME: (RECURRENT_TEMPLATE,
    context)}`` of checked kernel ``params`` (a `Config`'s) for ``problem``: the plain chunk
    and recurrent kernels (per-channel when ``problem.gate`` is "vector"; no layer inputs in
    their loads). ``recurrent_below`` renders into neither."""
    per_channel = problem.gate == "vector"
    dims = {"dk": problem.Dk, "dv": problem.Dv, "dk_pad": padded(problem.Dk),
            "dv_pad": padded(problem.Dv), "vector_floats": params["vector_floats"],
            "symbol": SYMBOL, "per_channel": per_channel, **KernelInputs().context()}
    context = {"chunk": params["chunk_size"], "row_block": params["row_block"],
               "panel": params["panel"], "packed": False,
               "sub_chunk": chunkwise_channel.sub_chunk_size(params["chunk_size"]), **dims}
    recurrent = {"row_tile": RECURRENT_ROW_TILE, "steps": False, **dims}
    return {SOURCE_NAME: (TEMPLATE, context),
            RECURRENT_SOURCE_NAME: (RECURRENT_TEMPLATE, recurrent)}


def render_source(variant: Variant, problem: Problem, name: str, template: str, context: dict,
                  templates_dir=None):
    """A `gdngen.sources.Rendered` of one file ``name``: ``template`` rendered with
    ``context`` (a plan entry with changes), of its own sha256."""
    from gdngen.sources import render_planned

    return render_planned(variant, problem, {name: (template, context)},
                          templates_dir=templates_dir)


# ----------------------------------------------------------------------------- compile + load


def compiler() -> list[str]:
    """The C++ compiler command (`gdngen.settings.compiler`: ``$CXX`` split like shell words,
    e.g. "ccache g++", else g++, else c++); RuntimeError when there is none."""
    return settings.compiler(f"the {BACKEND} backend")


@functools.cache
def available() -> bool:
    """Whether this host can build and run the kernels: a C++ compiler and jax's CPU backend."""
    try:
        compiler()
        import jax

        jax.devices("cpu")
    except (RuntimeError, ImportError):
        return False
    return True


@functools.cache
def _toolchain_id() -> str:
    """What besides the source decides the binary: compiler version, flags, host CPU, jaxlib."""
    import jaxlib

    version = subprocess.run([*compiler(), "--version"], capture_output=True, text=True,
                             check=True).stdout.splitlines()[0]
    cpu = ""
    try:
        info = Path("/proc/cpuinfo").read_text()
        cpu = next((line for line in info.splitlines() if line.startswith(("flags", "Features"))),
                   "")
        cpu += next((line for line in info.splitlines() if line.startswith("model name")), "")
    except OSError:
        pass
    return "\n".join([version, " ".join(COMPILE_FLAGS), platform.machine(), cpu,
                      jaxlib.__version__])


def library_path(sha256: str) -> Path:
    """Where the compiled library of rendered sources ``sha256`` is cached on this host."""
    key = hashlib.sha256((sha256 + "\n" + _toolchain_id()).encode()).hexdigest()
    return settings.cache_root() / BACKEND / f"{key[:32]}.so"


def compile_library(source, path: Path) -> Path:
    """Compile ``source`` (one C++ source, or ``{file name: source}`` of several, each compiled
    in its own compiler process, all at once, then linked together) into the shared library
    ``path`` (atomically: built in a temporary folder, then moved into place). RuntimeError with
    the compiler's output on failure."""
    from gdngen.fileio import atomic_write_bytes

    sources = {SOURCE_NAME: source} if isinstance(source, str) else dict(source)
    flags = [*compiler(), *COMPILE_FLAGS]
    with tempfile.TemporaryDirectory(prefix="gdngen-ffi-cpu-") as tmp:
        out = Path(tmp) / "kernel.so"
        objects, jobs = [], []
        for name, text in sources.items():
            src, obj = Path(tmp) / name, Path(tmp) / f"{name}.o"
            src.write_text(text)
            objects.append(str(obj))
            cmd = [*flags, f"-I{jaxcompat.ffi().include_dir()}", "-c", str(src), "-o", str(obj)]
            jobs.append((cmd, subprocess.Popen(cmd, stdout=subprocess.PIPE,
                                               stderr=subprocess.PIPE, text=True)))
        for cmd, stderr, returncode in [(cmd, job.communicate()[1], job.returncode)
                                        for cmd, job in jobs]:
            _check_compiled(cmd, stderr, returncode)
        link = [*flags, *objects, "-o", str(out)]
        linked = subprocess.run(link, check=False, capture_output=True, text=True)
        _check_compiled(link, linked.stderr, linked.returncode)
        return atomic_write_bytes(path, out.read_bytes())


def _check_compiled(cmd: list[str], stderr: str, returncode: int) -> None:
    if returncode:
        raise RuntimeError(f"{BACKEND}: compiling the rendered kernel failed "
                           f"({' '.join(cmd)}):\n{stderr[-4000:]}")


class Kernels:
    """A loaded variant: ``target_forward`` / ``target_backward`` / ``target_recurrent``
    (registered FFI target names; a packed library has no recurrent one), ``sha256`` of the
    rendered sources, ``params`` (the variant's kernel parameters), ``library`` (its path)."""

    def __init__(self, variant: Variant, problem: Problem, sha256: str, library: Path,
                 params: dict, kinds=("forward", "backward", "recurrent")):
        self.variant, self.problem, self.sha256, self.library = variant, problem, sha256, library
        self.params = params
        self._handle = ctypes.CDLL(str(library))  # kept alive with the registered targets
        for kind in kinds:
            target = f"gdngen_ffi_cpu_{sha256[:16]}_{kind}"
            setattr(self, f"target_{kind}", target)
            jaxcompat.ffi().register_ffi_target(
                target, jaxcompat.ffi().pycapsule(getattr(self._handle, f"{SYMBOL}_{kind}")),
                platform="cpu")


#: the loaded kernels of this process by sha256 of their rendered sources
LOADED: dict[str, Kernels] = {}


def load(rendered, params: dict, kinds=("forward", "backward", "recurrent")) -> Kernels:
    """The `Kernels` of ``rendered`` (a `gdngen.sources.Rendered`; ``params`` its variant's
    kernel parameters), compiled unless cached on disk, loaded and registered once per
    process (``kinds``: the handlers its library holds)."""
    if rendered.sha256 not in LOADED:
        path = library_path(rendered.sha256)
        if not path.exists():
            compile_library(rendered.sources, path)
        LOADED[rendered.sha256] = Kernels(rendered.variant, rendered.problem, rendered.sha256,
                                          path, params, kinds)
    return LOADED[rendered.sha256]


# ----------------------------------------------------------------------------- launch shape


def threads() -> int:
    """Worker threads per call: the cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def head_splits(B: int, Hk: int, group: int, workers: int) -> int:
    """Into how many tasks the kernels split each key head's ``group`` value heads: the fewest
    (a divisor of ``group``) that still give every worker a task. A task shares its key head's
    per-chunk work (K K^T, Q K^T) among its heads and sums their dq / dk terms into its own
    partial slot, which the caller adds up."""
    return next(p for p in range(1, group + 1) if group % p == 0 and (B * Hk * p >= workers
                                                                        or p == group))


def recurrent_rows(B: int, Hv: int, Dv: int, workers: int) -> int:
    """State rows per task of the recurrent kernel: at most `RECURRENT_MAX_ROWS` (a block stays
    in L1 over the walk), a multiple of `RECURRENT_ROW_TILE`, halved while the ``B * Hv`` heads'
    blocks leave a worker without a task (down to one tile)."""
    tile = RECURRENT_ROW_TILE
    rows = min(-(-Dv // tile) * tile, RECURRENT_MAX_ROWS)
    while rows > tile and B * Hv * -(-Dv // rows) < workers:
        rows = max(tile, -(-(rows // 2) // tile) * tile)
    return rows

