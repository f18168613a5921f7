"""Compile the simulator runtime and kernels with g++ and cache the shared objects.

Objects are cached under ``<gdngen cache root>/metal_sim`` (`gdngen.settings`: the root is
``$GDNGEN_CACHE_DIR`` or the user cache dir; ``$GDNGEN_METAL_SIM_CACHE`` overrides the folder),
named by the sha256 of everything that determines them: the source text, the
shim, the runtime, the compiler and its flags. Writes are atomic (temporary file, then
``os.replace``), so concurrent builds of the same source are safe.
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import subprocess
import tempfile
from pathlib import Path

from gdngen import settings
from gdngen.fileio import atomic_write_text

PACKAGE_DIR = Path(__file__).resolve().parent
SHIM_HEADER = PACKAGE_DIR / "metal_shim.h"
RUNTIME_HEADER = PACKAGE_DIR / "runtime.h"
RUNTIME_SOURCE = PACKAGE_DIR / "runtime.cpp"

#: Headers MSL sources may include; the shim already provides their contents.
STUB_HEADERS = ("metal_stdlib", "metal_math", "metal_atomic", "metal_simdgroup",
                "metal_simdgroup_matrix", "metal_compute", "metal_common", "metal_integer",
                "metal_relational")

#: g++ optimisation level for kernels. Measured on a generated kernel: -O1 compiles in about
#: half the time of -O2 and simulates as fast (the time goes into fiber switches and SIMD-group
#: exchanges); -O0 compiles ~15% faster than -O1 but simulates ~1.7x slower.
KERNEL_OPT = "-O1"


class CompileError(RuntimeError):
    """g++ rejected a kernel (or the runtime); the message holds the compiler output."""


def cache_dir() -> Path:
    """Folder of the cached shared objects (created on first use)."""
    override = os.environ.get(settings.ENV_METAL_SIM_CACHE)
    path = Path(override) if override else settings.cache_root() / "metal_sim"
    path.mkdir(parents=True, exist_ok=True)
    return path


def compiler() -> tuple[str, ...]:
    """The C++ compiler command (`gdngen.settings.compiler`: ``$CXX``, else g++, else c++);
    RuntimeError when there is none."""
    return tuple(settings.compiler("the Metal simulator"))


@functools.cache
def _cpu_flags() -> tuple[str, ...]:
    """Machine flags: hardware FMA where the CPU has it (metal fma() is a fused op)."""
    flags = []
    if platform.machine() in ("x86_64", "AMD64"):
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            cpuinfo = ""
        have = set()
        for line in cpuinfo.splitlines():
            if line.startswith("flags"):
                have = set(line.split(":", 1)[1].split())
                break
        if {"fma", "avx2"} <= have:
            flags += ["-mavx2", "-mfma"]
    return tuple(flags)


def _common_flags() -> list[str]:
    return ["-std=gnu++20", "-fPIC", "-shared", "-fno-strict-aliasing", "-ffp-contract=off",
            "-fno-math-errno", *_cpu_flags()]


def kernel_flags() -> list[str]:
    """Flags for kernels: MSL float literals are single precision, attributes are ignored."""
    return [KERNEL_OPT, *_common_flags(), "-fsingle-precision-constant", "-w"]


@functools.cache
def _compiler_version(cxx: tuple[str, ...]) -> str:
    proc = subprocess.run([*cxx, "--version"], capture_output=True, text=True, check=False)
    return proc.stdout.splitlines()[0] if proc.stdout else " ".join(cxx)


def _digest(*parts: str | bytes) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(part if isinstance(part, bytes) else part.encode())
        h.update(b"\0")
    return h.hexdigest()


def _run_compiler(args: list[str], what: str) -> None:
    proc = subprocess.run(args, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise CompileError(f"g++ failed to compile {what}:\n{proc.stderr[-6000:]}")


def _build(out: Path, source_name: str, source: str, flags: list[str], what: str,
           extra: list[str] = ()) -> Path:
    """Compile ``source`` into ``out`` (atomically) unless it is cached already."""
    if out.exists():
        return out
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=".build-") as tmp:
        src = Path(tmp) / source_name
        src.write_text(source)
        obj = Path(tmp) / out.name
        _run_compiler([*compiler(), *flags, str(src), "-o", str(obj), *extra], what)
        os.replace(obj, out)
    return out


@functools.cache
def include_dir() -> Path:
    """Folder with the shim, its precompiled header (built with the kernel flags, saving ~1 s
    per kernel), the runtime header and empty stand-ins for <metal_stdlib> etc."""
    shim = SHIM_HEADER.read_text()
    header = RUNTIME_HEADER.read_text()
    cxx = compiler()
    key = _digest(shim, header, _compiler_version(cxx), *kernel_flags())
    folder = cache_dir() / f"include-{key[:16]}"
    if not (folder / "metal_shim.h").exists():
        folder.mkdir(parents=True, exist_ok=True)
        for name in STUB_HEADERS:
            atomic_write_text(folder / name, "// provided by metal_shim.h\n")
        atomic_write_text(folder / "runtime.h", header)
        with tempfile.TemporaryDirectory(dir=folder, prefix=".pch-") as tmp:
            (Path(tmp) / "runtime.h").write_text(header)
            (Path(tmp) / "metal_shim.h").write_text(shim)
            gch = Path(tmp) / "metal_shim.h.gch"
            proc = subprocess.run([*cxx, *kernel_flags(), "-I", tmp, "-x", "c++-header",
                                   str(Path(tmp) / "metal_shim.h"), "-o", str(gch)],
                                  capture_output=True, text=True, check=False)
            if proc.returncode == 0:  # without it g++ parses the header every time
                os.replace(gch, folder / "metal_shim.h.gch")
        atomic_write_text(folder / "metal_shim.h", shim)  # written last: marks the folder complete
    return folder


@functools.cache
def runtime_library() -> Path:
    """The compiled runtime (built once per runtime source, compiler and flags)."""
    cxx = compiler()
    source = RUNTIME_SOURCE.read_text()
    flags = ["-O2", *_common_flags(), "-I", str(include_dir())]
    key = _digest(source, RUNTIME_HEADER.read_text(), _compiler_version(cxx), *flags)
    out = cache_dir() / f"libmslrt-{key[:24]}.so"
    return _build(out, "runtime.cpp", source, flags, "the Metal simulator runtime",
                  ["-lpthread"])


def kernel_library(source: str, what: str) -> Path:
    """Compile one simulator kernel source (see `source.simulator_source`); cached by hash."""
    runtime = runtime_library()
    include = include_dir()  # its name hashes the shim, the runtime header, compiler and flags
    flags = [*kernel_flags(), "-I", str(include), "-include", "metal_shim.h"]
    key = _digest(source, runtime.name, *flags)
    out = cache_dir() / f"kernel-{key[:32]}.so"
    return _build(out, "kernel.cpp", source, flags, what,
                  [str(runtime), f"-Wl,-rpath,{runtime.parent}"])
