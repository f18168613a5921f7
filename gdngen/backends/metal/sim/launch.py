"""ctypes binding of the simulator runtime: guarded device buffers and kernel dispatch."""

from __future__ import annotations

import ctypes
import functools
import os
from dataclasses import dataclass

import numpy as np

from gdngen import settings
from gdngen.backends.metal.sim import compiler

#: Thread orders within a threadgroup: round robin, LIFO, random, and the lowest / highest
#: runnable thread first (one simdgroup runs ahead of the others up to the next barrier).
SCHEDULES = {"forward": 0, "reverse": 1, "random": 2, "low_first": 3, "high_first": 4}


class SimulatorError(RuntimeError):
    """A simulated kernel did something a GPU would hide or hang on: an out-of-bounds access,
    a write to an input, a barrier not reached by every thread, divergent SIMD-group functions,
    outputs left unwritten, too much threadgroup memory."""


class _LaunchDesc(ctypes.Structure):
    _fields_ = [
        ("thread_fn", ctypes.c_void_p),
        ("args", ctypes.POINTER(ctypes.c_void_p)),
        ("grid", ctypes.c_uint32 * 3),
        ("threadgroup", ctypes.c_uint32 * 3),
        ("workers", ctypes.c_int32),
        ("schedule", ctypes.c_int32),
        ("seed", ctypes.c_uint64),
        ("stack_bytes", ctypes.c_uint64),
        ("threadgroup_memory_limit", ctypes.c_uint64),
        ("kernel_name", ctypes.c_char_p),
    ]


@functools.cache
def runtime() -> ctypes.CDLL:
    """The loaded runtime library (global symbols, so kernels bind to this instance)."""
    lib = ctypes.CDLL(str(compiler.runtime_library()), mode=ctypes.RTLD_GLOBAL)
    lib.msl_rt_buffer_alloc.argtypes = [ctypes.c_size_t, ctypes.c_char_p, ctypes.c_int,
                                        ctypes.POINTER(ctypes.c_void_p)]
    lib.msl_rt_buffer_alloc.restype = ctypes.c_int
    lib.msl_rt_buffer_free.argtypes = [ctypes.c_int]
    lib.msl_rt_buffer_free.restype = None
    lib.msl_rt_buffer_slack_damage.argtypes = [ctypes.c_int]
    lib.msl_rt_buffer_slack_damage.restype = ctypes.c_longlong
    lib.msl_rt_launch.argtypes = [ctypes.POINTER(_LaunchDesc), ctypes.c_char_p, ctypes.c_size_t,
                                  ctypes.POINTER(ctypes.c_size_t)]
    lib.msl_rt_launch.restype = ctypes.c_int
    return lib


class Buffer:
    """A device buffer with guard pages around it; ``array`` views its bytes as ``dtype``."""

    def __init__(self, nbytes: int, name: str, readonly: bool):
        ptr = ctypes.c_void_p()
        handle = runtime().msl_rt_buffer_alloc(nbytes, name.encode(), int(readonly),
                                               ctypes.byref(ptr))
        if handle < 0:
            raise MemoryError(f"cannot map a {nbytes}-byte simulator buffer for {name!r}")
        self.handle, self.ptr, self.nbytes, self.name = handle, ptr.value, nbytes, name

    def view(self, dtype, shape) -> np.ndarray:
        raw = (ctypes.c_ubyte * max(self.nbytes, 1)).from_address(self.ptr)
        flat = np.frombuffer(raw, dtype=np.uint8, count=self.nbytes)
        return flat.view(dtype).reshape(shape)

    def slack_damage(self) -> int:
        return int(runtime().msl_rt_buffer_slack_damage(self.handle))

    def free(self) -> None:
        if self.handle is not None:
            runtime().msl_rt_buffer_free(self.handle)
            self.handle = None


@dataclass(frozen=True)
class LaunchResult:
    """Statistics of one dispatch."""

    threadgroup_bytes: int  # threadgroup memory the kernel declared (sum of its variables)


class KernelLibrary:
    """A compiled kernel shared object and its entry point."""

    def __init__(self, path):
        runtime()
        self.lib = ctypes.CDLL(str(path))
        self.thread_fn = ctypes.cast(self.lib.msl_sim_thread, ctypes.c_void_p).value


def default_workers() -> int:
    """OS threads running threadgroups in parallel (``GDNGEN_METAL_SIM_WORKERS`` overrides)."""
    env = os.environ.get(settings.ENV_METAL_SIM_WORKERS)
    if env:
        return max(1, int(env))
    return max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
               else (os.cpu_count() or 1))


def dispatch(library: KernelLibrary, kernel_name: str, buffers: list[Buffer], grid, threadgroup,
             *, workers: int | None = None, schedule: str = "forward", seed: int = 0,
             stack_bytes: int = 1 << 17, threadgroup_memory_limit: int = 0) -> LaunchResult:
    """Run ``grid`` threads in threadgroups of ``threadgroup`` over the parameter ``buffers``."""
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {sorted(SCHEDULES)}, got {schedule!r}")
    args = (ctypes.c_void_p * max(len(buffers), 1))(*[b.ptr for b in buffers])
    name = kernel_name.encode()
    desc = _LaunchDesc(
        thread_fn=library.thread_fn, args=args,
        grid=(ctypes.c_uint32 * 3)(*grid), threadgroup=(ctypes.c_uint32 * 3)(*threadgroup),
        workers=workers or default_workers(), schedule=SCHEDULES[schedule], seed=seed,
        stack_bytes=stack_bytes, threadgroup_memory_limit=threadgroup_memory_limit,
        kernel_name=name)
    error = ctypes.create_string_buffer(4096)
    tg_bytes = ctypes.c_size_t(0)
    rc = runtime().msl_rt_launch(ctypes.byref(desc), error, len(error), ctypes.byref(tg_bytes))
    if rc != 0:
        raise SimulatorError(error.value.decode(errors="replace"))
    return LaunchResult(int(tg_bytes.value))
