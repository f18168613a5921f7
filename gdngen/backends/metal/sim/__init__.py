"""A CPU simulator for the Metal kernels MLX runs, so generated kernels can be proven on Linux.

`metal_kernel` has the interface of ``mx.fast.metal_kernel``: the same kernel body compiles, as
the full source MLX would build (`source.kernel_source`: generated signature + body), with g++
against ``metal_shim.h``, a header emulating the Metal Shading Language. The runtime
(``runtime.cpp``) runs every thread of a threadgroup as a fiber, truly interleaved at barriers
and SIMD-group functions, with `threadgroup` memory shared by exactly one threadgroup. It makes
visible what a GPU hides: out-of-bounds device accesses (named by kernel and buffer; caught up
to 4 MiB past either end), writes to inputs, threadgroup variables written past their end (red
zones) or read before they are written (poisoned with NaN), barriers or SIMD-group functions not
reached by every thread (an error, not a hang), outputs left unwritten (poisoned before launch),
more than 32 KiB of threadgroup memory, and, run under several ``schedule``s (round robin,
LIFO, random, one simdgroup ahead of the others), results that depend on thread order (missing
barriers).

The one change to the MLX source: threadgroup *variable declarations* become references into
the runtime's per-threadgroup arena (`source.rewrite_threadgroup_variables`); the MSL shim
covers what `metal_shim.h` lists (SIMD-group functions need every lane of the SIMD-group: a
divergent call is reported, where a GPU would use the active lanes).

`run` executes a gdngen Metal variant exactly as `gdngen.backends.metal.gated_delta` does on a
Mac, with the simulator in place of the GPU.
"""

from __future__ import annotations

import functools
import re

import numpy as np

from gdngen.backends.metal.sim import compiler, launch, source
from gdngen.backends.metal.sim.compiler import CompileError
from gdngen.backends.metal.sim.launch import SimulatorError
from gdngen.devices import DEVICES

__all__ = ["CompileError", "SimKernel", "SimulatorError", "available", "metal_kernel", "run"]

#: Threadgroup memory of Apple GPUs (the smallest in gdngen.devices); launches over it fail.
THREADGROUP_MEMORY_LIMIT = min(d.limits.get("threadgroup_memory", 1 << 62)
                               for d in DEVICES.values() if d.kind == "apple")


def available() -> bool:
    """True when a C++ compiler is present (all the simulator needs)."""
    try:
        compiler.compiler()
    except RuntimeError:
        return False
    return True


def _numpy_dtype(dtype) -> np.dtype:
    name = source.dtype_name(dtype)
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


@functools.lru_cache(maxsize=256)
def _library(text: str, what: str) -> launch.KernelLibrary:
    return launch.KernelLibrary(compiler.kernel_library(text, what))


class SimKernel:
    """A simulated ``mx.fast.metal_kernel``: call it like the MLX one, with NumPy arrays.

    Extra keyword arguments of a call: ``schedule`` ("forward", "reverse", "random" with
    ``seed``, "low_first", "high_first"; see `launch.SCHEDULES`) orders the threads of a
    threadgroup (a race shows as results that change with it); ``workers`` OS threads run
    threadgroups; ``check_unwritten`` (default True unless ``init_value``) fails on outputs
    left unwritten.
    After a call, ``last_threadgroup_bytes`` holds the threadgroup memory the kernel declared.
    """

    def __init__(self, name: str, input_names, output_names, source_text: str, header: str = "",
                 ensure_row_contiguous: bool = True, atomic_outputs: bool = False):
        if not output_names:
            raise ValueError("output_names must name at least one output")
        self.name = name
        self.input_names = tuple(input_names)
        self.output_names = tuple(output_names)
        self.source = source_text
        self.header = header
        self.ensure_row_contiguous = ensure_row_contiguous
        self.atomic_outputs = atomic_outputs
        self.last_threadgroup_bytes = 0

    def kernel_text(self, inputs, output_dtypes, template=(),
                    metas_given: bool = False) -> source.KernelText:
        """The full MLX kernel source for these inputs (arrays, or ``(dtype, ndim, size)`` with
        ``metas_given``), output dtypes and template args."""
        metas = list(inputs) if metas_given else [(_dtype_of(x), np.ndim(x), int(np.size(x)))
                                                  for x in inputs]
        return source.kernel_source(self.name, self.input_names, self.output_names, self.source,
                                    self.header, metas, output_dtypes, tuple(template or ()),
                                    self.atomic_outputs)

    def __call__(self, *, inputs, grid, threadgroup, output_shapes, output_dtypes, template=(),
                 init_value=None, verbose=False, schedule="forward", seed=0, workers=None,
                 check_unwritten=None):
        if len(inputs) != len(self.input_names):
            raise ValueError(f"inputs has {len(inputs)} arrays, expected {len(self.input_names)} "
                             f"({', '.join(self.input_names)})")
        if len(output_shapes) != len(self.output_names):
            raise ValueError(f"output_shapes has {len(output_shapes)} entries, expected "
                             f"{len(self.output_names)}")
        grid = _dims("grid", grid)
        threadgroup = _dims("threadgroup", threadgroup)
        arrays = [np.asarray(x) for x in inputs]
        if self.ensure_row_contiguous:
            arrays = [x if x.flags.c_contiguous else np.ascontiguousarray(x) for x in arrays]
        kt = self.kernel_text(arrays, output_dtypes, template)
        if verbose:
            print(f"Generated source code for `{self.name}`:\n```\n{kt.source}\n```")
        lib = _library(source.simulator_source(kt), f"kernel {kt.kernel_name}")
        buffers, outputs = [], []
        try:
            for name, x, info in zip(self.input_names, arrays, kt.inputs):
                buffers.append(_input_buffer(name, x))
                if x.ndim > 0:
                    if info.uses_shape:
                        buffers.append(_input_buffer(f"{name}_shape", np.array(x.shape, np.int32)))
                    if info.uses_strides:
                        strides = np.array([s // x.itemsize for s in x.strides], np.int64)
                        buffers.append(_input_buffer(f"{name}_strides", strides))
                    if info.uses_ndim:
                        buffers.append(_input_buffer(f"{name}_ndim", np.array(x.ndim, np.int32)))
            for name, shape, dt in zip(self.output_names, output_shapes, output_dtypes):
                npdt = _numpy_dtype(dt)
                shape = tuple(int(s) for s in shape)
                buf = launch.Buffer(int(np.prod(shape, dtype=np.int64)) * npdt.itemsize, name,
                                    readonly=False)
                buffers.append(buf)
                view = buf.view(npdt, shape)
                if init_value is not None:
                    view[...] = init_value
                outputs.append((name, buf, view))
            # Metal clips the threadgroup to the grid (MLX: min(threadgroup, grid) per axis).
            group = tuple(min(t, g) for t, g in zip(threadgroup, grid))
            try:
                result = launch.dispatch(lib, kt.kernel_name, buffers, grid, group,
                                         workers=workers, schedule=schedule, seed=seed,
                                         threadgroup_memory_limit=THREADGROUP_MEMORY_LIMIT)
            except SimulatorError as e:
                raise SimulatorError(_quote_lines(str(e), kt.source)) from None
            self.last_threadgroup_bytes = result.threadgroup_bytes
            for buf in buffers:
                damage = buf.slack_damage()
                if damage:
                    raise SimulatorError(f"kernel {kt.kernel_name} wrote {damage} byte(s) just "
                                         f"outside buffer '{buf.name}'")
            check = init_value is None if check_unwritten is None else check_unwritten
            results = []
            for name, _buf, view in outputs:
                if check:
                    _check_written(kt.kernel_name, name, view)
                results.append(np.array(view))
            return results
        finally:
            for buf in buffers:
                buf.free()


def metal_kernel(name: str, input_names, output_names, source: str, header: str = "",
                 ensure_row_contiguous: bool = True, atomic_outputs: bool = False) -> SimKernel:
    """``mx.fast.metal_kernel`` for the simulator (same arguments)."""
    return SimKernel(name, input_names, output_names, source, header, ensure_row_contiguous,
                     atomic_outputs)


def _dtype_of(x):
    dt = getattr(x, "dtype", None)
    if dt is None:
        return np.asarray(x).dtype
    return dt


def _dims(name, value) -> tuple[int, int, int]:
    dims = tuple(int(v) for v in value)
    if len(dims) != 3 or min(dims) < 1:
        raise ValueError(f"{name} must be three positive ints, got {value!r}")
    return dims


def _input_buffer(name: str, x: np.ndarray) -> launch.Buffer:
    buf = launch.Buffer(x.nbytes, name, readonly=True)
    if x.nbytes:
        buf.view(np.uint8, (x.nbytes,))[...] = np.frombuffer(
            np.ascontiguousarray(x).tobytes(), np.uint8)
    return buf


def _quote_lines(message: str, text: str) -> str:
    """Append the source text of every ``line N`` a runtime message mentions."""
    lines = text.splitlines()

    def quote(m):
        n = int(m.group(1))
        code = lines[n - 1].strip() if 0 < n <= len(lines) else "?"
        return f"line {n} `{code}`"

    return re.sub(r"line (\d+)", quote, message)


def _check_written(kernel_name: str, name: str, view: np.ndarray) -> None:
    """Fail when elements hold the all-ones poison pattern outputs and threadgroup memory are
    filled with (x86 keeps a NaN's payload, so poison read from memory propagates as is)."""
    if view.size == 0:
        return
    raw = view.reshape(-1).view(np.uint8).reshape(view.size, view.itemsize)
    poisoned = np.all(raw == 0xFF, axis=1)
    count = int(poisoned.sum())
    if count:
        first = np.unravel_index(int(np.argmax(poisoned)), view.shape)
        raise SimulatorError(
            f"kernel {kernel_name}: {count} of {view.size} elements of output '{name}' hold the "
            f"poison pattern (first at index {tuple(map(int, first))}): never written, or "
            f"computed from memory that was never written")
