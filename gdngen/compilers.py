"""Real compiles without the chip: every program a user's call runs, compiled for a device's own
compiler on this host (``gdngen build --compile``, ``gdngen tune --dry-run``'s space check).

TPU (``compiler="mosaic"``): with libtpu installed (``gdngen[tpu]``),
``jax.experimental.topologies.get_topology_desc`` gives compile-only devices of the chip
(`gdngen.devices.Device.topology`, e.g. ``v5e:2x2``). A program is ``jax.jit`` traced on
``ShapeDtypeStruct`` s placed on one of them, lowered for the TPU platform and compiled: Mosaic
compiles each Pallas kernel and XLA TPU the program around it. The kernels are built with
`gdngen.backends.pallas.tpu.interpreting` (False), as on a TPU.

The programs of a variant (`programs`; the problem's gate kind and dtype, batch 1):

* ``chunk_fwd_bwd``: `gdngen.jax.gated_delta` and its gradient at ``T`` steps (the chunk kernels);
* ``recurrent_forward``: the forward of the longest call the recurrent kernel runs
  (``recurrent_below - 1`` steps; absent when ``recurrent_below <= 1``);
* ``packed_fwd_bwd`` (scalar gates): a packed row of two sequences (``cu_seqlens``) and its
  gradient (the packed build);
* ``fused_fwd_bwd`` / ``fused_recurrent_forward``: ``qk_norm=True``, ``gate="softplus"`` with
  ``A_log``, ``dt_bias`` (the fused-input build) at ``T`` and at the recurrent length;
* ``steps_forward`` (backends whose recurrent kernels write the per-step states,
  `gdngen.backend.Backend.step_states`): a ``return_states="steps"`` verify window of
  `STEPS_T` steps (the per-step-states build).

NVIDIA (``compiler="xla-gpu"``): with jax's CUDA plugin and ptxas/libdevice installed
(``gdngen[cuda]``; no GPU or driver needed), ``get_topology_desc(platform="cuda",
target_config=...)`` gives a compile-only device of the chip from its ``GpuTargetConfigProto``
text (`gpu_target_config`, from `GPU_SPECS`): XLA GPU compiles the program deviceless, its
Triton for each Pallas kernel (`gdngen.backends.pallas.gpu.compiling_for_gpu`) down to PTX and
ptxas (no autotuning: nothing to time on). Shared memory beyond the chip's opt-in per block is
XLA's rejection ("Shared memory size limit exceeded").

Each compiled program reports XLA's memory analysis (``temp_bytes``, ``code_bytes``; 0 on
GPU) and, per kernel: for Mosaic the scoped VMEM the compiler used and the limit it was given
(read from the compiled HLO's ``tpu_custom_call`` backend configs; `CompileReport.vmem_used` is
the largest); for Triton the shared memory its launch takes, with grid and threads (the thunk
sequence XLA dumps; `CompileReport.shared_memory_used` is the largest).

`check_space` is the verdict per variant for a search space, remembered in
``<cache root>/compile.json`` per render sha256, variant, problem, target and compiler versions.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.metadata
import importlib.util
import json
import os
import re
import time

from gdngen import jaxcompat, settings
from gdngen.devices import Device, get_device
from gdngen.variant import Problem, Variant, dumps

__all__ = ["COLLECTIVES", "COMPILERS", "CompileReport", "Program", "check_space",
           "check_targets", "collective_bytes", "compile_variant", "compiler_available",
           "compiler_versions", "missing_reason", "programs", "target_device",
           "topology_devices"]

#: backend -> (compiler name, device kind it compiles for)
COMPILERS = {"pallas_tpu": ("mosaic", "tpu"), "pallas_gpu": ("xla-gpu", "gpu")}
#: packages whose versions make a compile verdict (with gdngen's own version)
COMPILER_PACKAGES = {"mosaic": ("jax", "jaxlib", "libtpu"),
                     "xla-gpu": ("jax", "jaxlib", "jax-cuda12-plugin", "jax-cuda12-pjrt",
                                 "nvidia-cuda-nvcc-cu12")}
#: the jax platform each compiler lowers for
PLATFORMS = {"mosaic": "tpu", "xla-gpu": "cuda"}

#: ``GpuTargetConfigProto.gpu_device_info`` of each NVIDIA device (SXM parts, as the CUDA
#: runtime reports them; ``shared_memory_per_block_optin`` is the device's ``shared_memory``
#: limit, `gpu_target_config`), its ``device_description_str`` and cuDNN version
GPU_SPECS = {
    "a100": {"description": "NVIDIA A100-SXM4-80GB", "compute_capability": (8, 0),
             "core_count": 108, "fpus_per_core": 64, "shared_memory_per_core": 167936,
             "memory_bandwidth": 2039000000000, "l2_cache_size": 41943040,
             "clock_rate_ghz": 1.41, "device_memory_size": 85097971712},
    "h100": {"description": "NVIDIA H100 80GB HBM3", "compute_capability": (9, 0),
             "core_count": 132, "fpus_per_core": 128, "shared_memory_per_core": 233472,
             "memory_bandwidth": 3352320000000, "l2_cache_size": 52428800,
             "clock_rate_ghz": 1.98, "device_memory_size": 84978434048},
    "h200": {"description": "NVIDIA H200", "compute_capability": (9, 0),
             "core_count": 132, "fpus_per_core": 128, "shared_memory_per_core": 233472,
             "memory_bandwidth": 4800000000000, "l2_cache_size": 52428800,
             "clock_rate_ghz": 1.98, "device_memory_size": 150754820096},
}
CUDNN_VERSION = (9, 8)

#: the default sequence length of the chunk programs (two chunks of the largest chunk size)
DEFAULT_T = 256


@dataclasses.dataclass
class Program:
    """One compiled program: ``kernels`` lists each Mosaic kernel as ``{"name", "vmem_used",
    "vmem_limit"}`` (bytes), each Triton kernel launch as ``{"name", "shared_memory",
    "shared_memory_limit", "grid", "threads"}`` (bytes; ``[x, y, z]``)."""

    name: str
    T: int
    ok: bool = False
    error: str | None = None
    seconds: float = 0.0
    temp_bytes: int = 0
    code_bytes: int = 0
    kernels: list = dataclasses.field(default_factory=list)

    def to_json(self) -> dict:
        return dict(dataclasses.asdict(self), seconds=round(self.seconds, 2))


@dataclasses.dataclass
class CompileReport:
    """The real compile of one variant's programs for one device (the manifest's ``compile``)."""

    compiler: str
    target: str  # the compile-only device's device_kind, e.g. "TPU v5 lite", "NVIDIA H100 ..."
    device: str  # the registry name, e.g. "tpu-v5e"
    programs: list = dataclasses.field(default_factory=list)
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and all(p.ok for p in self.programs)

    @property
    def temp_bytes(self) -> int:
        return max((p.temp_bytes for p in self.programs), default=0)

    @property
    def code_bytes(self) -> int:
        return max((p.code_bytes for p in self.programs), default=0)

    @property
    def vmem_used(self) -> int:
        """The largest scoped VMEM any kernel of any program used (bytes)."""
        return max((k.get("vmem_used", 0) for p in self.programs for k in p.kernels), default=0)

    @property
    def shared_memory_used(self) -> int:
        """The most shared memory any Triton kernel launch of any program takes (bytes)."""
        return max((k.get("shared_memory", 0) for p in self.programs for k in p.kernels),
                   default=0)

    @property
    def seconds(self) -> float:
        return sum(p.seconds for p in self.programs)

    def first_error(self) -> str | None:
        if self.error:
            return self.error
        return next((f"{p.name}: {p.error}" for p in self.programs if not p.ok), None)

    def to_json(self) -> dict:
        """The manifest's ``compile``: ``vmem_used`` (Mosaic) or ``shared_memory_used``
        (XLA GPU) beside the common fields."""
        onchip = ({"shared_memory_used": self.shared_memory_used} if self.compiler == "xla-gpu"
                  else {"vmem_used": self.vmem_used})
        return {"compiler": self.compiler, "target": self.target, "device": self.device,
                "ok": self.ok, "error": self.first_error(), "temp_bytes": self.temp_bytes,
                "code_bytes": self.code_bytes, **onchip, "seconds": round(self.seconds, 2),
                "programs": [p.to_json() for p in self.programs]}


# ------------------------------------------------------------------------------ availability


def compiler_of(backend: str) -> tuple[str, str]:
    """``(compiler, device kind)`` of ``backend``; ValueError for one without a real compile."""
    if backend not in COMPILERS:
        raise ValueError(f"backend must be one of {sorted(COMPILERS)} for a real compile, got "
                         f"{backend!r}")
    return COMPILERS[backend]


def missing_reason(compiler: str) -> str | None:
    """Why ``compiler`` cannot run on this host (None when it can)."""
    if compiler == "mosaic" and importlib.util.find_spec("libtpu") is None:
        return "libtpu is not installed (pip install 'gdngen[tpu]')"
    if compiler == "xla-gpu":
        if _find_spec("jax_plugins.xla_cuda12") is None:
            return "jax's CUDA plugin is not installed (pip install 'gdngen[cuda]')"
        if _libdevice() is None:
            return ("no libdevice / ptxas for XLA GPU (nvidia-cuda-nvcc-cu12; pip install "
                    "'gdngen[cuda]')")
    return None


def _find_spec(name: str):
    """``importlib.util.find_spec(name)``, None also when a parent package is missing."""
    try:
        return importlib.util.find_spec(name)
    except ModuleNotFoundError:
        return None


def _libdevice():
    """Where XLA GPU finds libdevice (the nvidia-cuda-nvcc-cu12 package, else a CUDA toolkit
    under /usr/local/cuda), or None."""
    from pathlib import Path

    spec = _find_spec("nvidia.cuda_nvcc")
    roots = [Path(p) for p in (spec.submodule_search_locations or [])] if spec else []
    for root in roots + [Path("/usr/local/cuda")]:
        found = sorted(root.glob("nvvm/libdevice/libdevice*.bc"))
        if found:
            return found[0]
    return None


def compiler_available(compiler: str) -> bool:
    return missing_reason(compiler) is None


def compiler_versions(compiler: str) -> dict:
    """``{"gdngen": ..., package: version}`` of what makes ``compiler``'s verdicts."""
    from gdngen._version import __version__

    versions = {"gdngen": __version__}
    for package in COMPILER_PACKAGES[compiler]:
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            versions[package] = None
    return versions


def _check_device(backend: str | None, device: str | Device) -> Device:
    """``device`` checked for ``backend``'s compiler (None: the backend compiling for its
    kind)."""
    device = get_device(device) if isinstance(device, str) else device
    if backend is None:
        backend = next((b for b, (_, kind) in COMPILERS.items() if kind == device.kind), None)
        if backend is None:
            raise ValueError(f"no backend has a real compiler for {device.kind} devices, got "
                             f"{device.name!r}")
    compiler, kind = compiler_of(backend)
    if device.kind != kind or not device.topology:
        raise ValueError(f"device must be a {kind} device with a topology for {backend}'s "
                         f"{compiler} compile, got {device.name!r}")
    reason = missing_reason(compiler)
    if reason:
        raise RuntimeError(f"cannot compile for {device.name} with {compiler}: {reason}")
    return device


#: libtpu takes /tmp/libtpu_lockfile for the process that loads it first (one process per TPU);
#: compile-only topologies need no chip, so any number of processes may compile at once
ENV_LIBTPU_SHARED = "ALLOW_MULTIPLE_LIBTPU_LOAD"
os.environ.setdefault(ENV_LIBTPU_SHARED, "1")  # before this process first loads libtpu
# on a host without a TPU, libtpu's single-host settings (its start-up errors otherwise); without
# an NVIDIA GPU, no CUDA runtime check (jax >= 0.12's plugin registers its topologies only then)
jaxcompat.libtpu_single_host()
jaxcompat.cuda_plugin_without_gpu()


def gpu_target_config(device: str | Device) -> str:
    """The ``GpuTargetConfigProto`` text of an NVIDIA device of `GPU_SPECS` (what XLA GPU
    compiles for without the chip); its opt-in shared memory per block is the device's
    ``shared_memory`` limit."""
    device = get_device(device) if isinstance(device, str) else device
    if device.name not in GPU_SPECS:
        raise ValueError(f"device must be one of {sorted(GPU_SPECS)} for a GPU target config, "
                         f"got {device.name!r}")
    spec = GPU_SPECS[device.name]
    major, minor = spec["compute_capability"]
    info = {"threads_per_block_limit": 1024, "threads_per_warp": 32,
            "shared_memory_per_block": 48 * 1024,
            "shared_memory_per_core": spec["shared_memory_per_core"],
            "threads_per_core_limit": 2048, "core_count": spec["core_count"],
            "fpus_per_core": spec["fpus_per_core"], "block_dim_limit_x": 2 ** 31 - 1,
            "block_dim_limit_y": 65535, "block_dim_limit_z": 65535,
            "memory_bandwidth": spec["memory_bandwidth"], "l2_cache_size": spec["l2_cache_size"],
            "clock_rate_ghz": spec["clock_rate_ghz"],
            "device_memory_size": spec["device_memory_size"],
            "shared_memory_per_block_optin": device.limits["shared_memory"]}
    lines = ["gpu_device_info {", *(f"  {k}: {v}" for k, v in info.items()),
             f"  cuda_compute_capability {{ major: {major} minor: {minor} }}",
             "  registers_per_core_limit: 65536", "  registers_per_block_limit: 65536", "}",
             'platform_name: "CUDA"',
             f"dnn_version_info {{ major: {CUDNN_VERSION[0]} minor: {CUDNN_VERSION[1]} }}",
             f'device_description_str: "{spec["description"]}"']
    return "\n".join(lines) + "\n"


@functools.cache
def _topology(platform: str, name: str, topology: str, target_config: str | None):
    if platform == "tpu":
        return jaxcompat.get_topology_desc(topology_name=topology, platform="tpu")
    return jaxcompat.get_topology_desc(topology_name=name, platform=platform,
                                       topology=topology, target_config=target_config)


def _device_topology(device: Device):
    compiler = next(c for c, kind in COMPILERS.values() if kind == device.kind)
    platform = PLATFORMS[compiler]
    config = gpu_target_config(device) if platform == "cuda" else None
    return _topology(platform, device.name, device.topology, config)


def target_device(device: str | Device, backend: str | None = None):
    """A compile-only jax device of ``device`` (the first of its topology; ``backend``: the
    one compiling for ``device``'s kind when None)."""
    return _device_topology(_check_device(backend, device)).devices[0]


def topology_devices(device: str | Device, backend: str | None = None) -> list:
    """Every compile-only jax device of ``device``'s topology (e.g. 4 for ``v5e:2x2``)."""
    return list(_device_topology(_check_device(backend, device)).devices)


# ------------------------------------------------------------------------------ programs


#: the verify window of the ``steps_forward`` program (speculative decoding's longest draft)
STEPS_T = 16


def recurrent_length(variant: Variant) -> int:
    """The longest call the recurrent kernel runs (0: none does)."""
    return max(0, int(variant.get("recurrent_below") or 0) - 1)


def programs(variant: Variant, problem: Problem, T: int = DEFAULT_T) -> list[tuple[str, int]]:
    """``[(program name, steps)]`` a user's calls of ``variant`` run (module docstring)."""
    from gdngen import registry

    if T < 1:
        raise ValueError(f"T must be a positive number of steps, got {T}")
    spec = registry.get(variant.backend)
    check = spec.parse(variant)
    chunk_T = max(T, int(getattr(check, "recurrent_below", 0) or 0))
    short = recurrent_length(variant)
    out = [("chunk_fwd_bwd", chunk_T)]
    if short:
        out.append(("recurrent_forward", short))
    if problem.gate == "scalar":
        out.append(("packed_fwd_bwd", chunk_T))
    out.append(("fused_fwd_bwd", chunk_T))
    if short:
        out.append(("fused_recurrent_forward", short))
    if problem.gate in spec.step_states:
        out.append(("steps_forward", STEPS_T))
    return out


def _program_fn(name: str, variant: Variant, problem: Problem, T: int, sharding):
    """``(fn, args)``: the program ``name`` and its abstract arguments on ``sharding``."""
    import jax
    import jax.numpy as jnp

    import gdngen.jax as gj

    Hk, Hv, Dk, Dv = problem.Hk, problem.Hv, problem.Dk, problem.Dv
    dtype, f32 = jnp.dtype(problem.dtype), jnp.float32
    vector = problem.gate == "vector"
    fused = name.startswith("fused")
    packed = name.startswith("packed")
    steps = name.startswith("steps")

    def spec(shape, dt=f32):
        return jax.ShapeDtypeStruct(shape, dt, sharding=sharding)

    gate_shape = (1, T, Hv) + ((Dk,) if vector else ())
    args = [spec((1, T, Hk, Dk), dtype), spec((1, T, Hk, Dk), dtype),
            spec((1, T, Hv, Dv), dtype), spec(gate_shape), spec((1, T, Hv))]
    if fused:
        args += [spec((Hv, Dk) if vector else (Hv,)), spec((Hv, Dk) if vector else (Hv,))]
    if packed:
        args.append(spec((3,), jnp.int32))
    kwargs = {"variant": variant, "scale": Dk ** -0.5}

    def call(q, k, v, g, beta, *rest):
        extra = dict(kwargs)
        if fused:
            extra.update(qk_norm=True, gate="softplus", A_log=rest[0], dt_bias=rest[1])
        if packed:
            extra["cu_seqlens"] = rest[-1]
        if steps:
            extra["return_states"] = "steps"
        y, state = gj.gated_delta(q, k, v, g, beta, **extra)
        return jnp.sum(y.astype(f32) ** 2) + jnp.sum(state ** 2)

    if name.endswith("forward"):
        return call, args
    n_float = len(args) - (1 if packed else 0)
    return jax.value_and_grad(call, argnums=tuple(range(n_float))), args


_CUSTOM_CALL = re.compile(r"%([\w.\-]+) = .*?custom_call_target=\"tpu_custom_call\"(.*)")


def mosaic_kernels(hlo_text: str) -> list[dict]:
    """Each Mosaic kernel of a compiled program's HLO: ``{"name", "vmem_used", "vmem_limit"}``
    from its backend config (``used_scoped_memory_configs`` / ``scoped_memory_configs``, VMEM
    is memory space 1)."""
    kernels = []
    for line in hlo_text.splitlines():
        match = _CUSTOM_CALL.search(line)
        if not match:
            continue
        rest = match.group(2)

        def size(field, rest=rest):
            found = re.search(r'"' + field + r'":\[(.*?)\]', rest)
            entries = re.findall(r'"memory_space":"1","offset":"\d+","size":"(\d+)"',
                                 found.group(1)) if found else []
            return sum(int(s) for s in entries)

        kernels.append({"name": match.group(1), "vmem_used": size("used_scoped_memory_configs"),
                        "vmem_limit": size("scoped_memory_configs")})
    return kernels


#: an HLO instruction that communicates between devices (its result types before the name)
COLLECTIVES = r"\b(all-gather|all-reduce|all-to-all|collective-permute|reduce-scatter)(-start)?\("


def collective_bytes(hlo_text: str, *, per_channel: bool = False) -> dict:
    """``{collective kind: bytes its results hold, per device}`` in compiled HLO ``hlo_text``
    (empty: the program communicates nothing). ``per_channel``: one collective counts once per
    ``(kind, channel_id)``, for XLA TPU, which repeats a collective in each fusion it puts it
    in (XLA CPU gives one channel to several collectives it schedules together)."""
    import numpy as np

    sizes = {"bf16": 2, "f16": 2, "f32": 4, "f64": 8, "s32": 4, "pred": 1}
    out, seen = {}, set()
    for i, line in enumerate(hlo_text.splitlines()):
        found = re.search(r"= (.*?) " + COLLECTIVES, line)
        channel = re.search(r"\bchannel_id=(\d+)", line)
        key = (found.group(2), channel.group(1)) if found and channel and per_channel else i
        if found and key not in seen:
            seen.add(key)
            total = sum(sizes[t] * int(np.prod([int(d) for d in dims.split(",") if d]))
                        for t, dims in re.findall(r"(\w+)\[([\d,]*)\]", found.group(1)))
            out[found.group(2)] = out.get(found.group(2), 0) + total
    return out


_TRITON_CALL = re.compile(r'custom_call_target="__gpu\$xla\.gpu\.triton".*?\bname = "([^"]+)"')
_THUNK = re.compile(r"\s(\S+) grid: \[([\d, ]+)\] threads: \[([\d, ]+)\]\s+"
                    r"shared_memory: (\d+) bytes")


def triton_kernels(hlo_text: str, thunks_text: str, limit: int) -> list[dict]:
    """Each launch of a Triton kernel (a Pallas ``pallas_call``) in a program XLA GPU compiled:
    ``{"name", "shared_memory", "shared_memory_limit", "grid", "threads"}``, the kernels named
    by the compiled HLO's ``__gpu$xla.gpu.triton`` custom calls, their launches read from the
    thunk sequence XLA dumps (``*thunk_sequence.txt``); ``limit``: the device's opt-in shared
    memory per block."""
    names = set(_TRITON_CALL.findall(hlo_text))
    return [{"name": m.group(1), "shared_memory": int(m.group(4)), "shared_memory_limit": limit,
             "grid": [int(x) for x in m.group(2).split(",")],
             "threads": [int(x) for x in m.group(3).split(",")]}
            for m in _THUNK.finditer(thunks_text) if m.group(1) in names]


def _backend_module(backend: str):
    from gdngen.backends.pallas import gpu as pallas_gpu
    from gdngen.backends.pallas import tpu as pallas_tpu

    return {"pallas_tpu": pallas_tpu, "pallas_gpu": pallas_gpu}[backend]


def _compile_program(name: str, variant: Variant, problem: Problem, T: int, target,
                     device: Device, dump_to=None) -> Program:
    import contextlib
    import pathlib
    import tempfile

    import jax
    from jax.sharding import SingleDeviceSharding

    compiler, _ = compiler_of(variant.backend)
    module = _backend_module(variant.backend)
    real = (module.interpreting(False) if compiler == "mosaic"
            else module.compiling_for_gpu())
    for_target = (contextlib.nullcontext() if compiler == "mosaic"
                  else jaxcompat.gpu_target(target))
    program = Program(name, T)
    start = time.perf_counter()
    try:
        with contextlib.ExitStack() as stack:
            fn, args = _program_fn(name, variant, problem, T, SingleDeviceSharding(target))
            with real, for_target:
                lowered = (jax.jit(fn).trace(*args)
                           .lower(lowering_platforms=(PLATFORMS[compiler],)))
            if compiler == "mosaic":
                compiled = lowered.compile()
                kernels = mosaic_kernels(compiled.as_text())
            else:  # the launches' shared memory is in the thunk sequence XLA GPU dumps
                dump = (pathlib.Path(dump_to) / name if dump_to is not None else
                        pathlib.Path(stack.enter_context(tempfile.TemporaryDirectory())))
                compiled = lowered.compile(compiler_options={"xla_dump_to": str(dump)})
                thunks = "\n".join(f.read_text() for f in sorted(dump.glob("*thunk_sequence.txt")))
                kernels = triton_kernels(compiled.as_text(), thunks,
                                         device.limits["shared_memory"])
        memory = compiled.memory_analysis()
        program.temp_bytes = int(memory.temp_size_in_bytes)
        program.code_bytes = int(memory.generated_code_size_in_bytes)
        program.kernels = kernels
        if not program.kernels:
            kind = "Mosaic" if compiler == "mosaic" else "Triton"
            raise RuntimeError(f"the {name} program compiled without a {kind} kernel")
        program.ok = True
    except Exception as e:  # noqa: BLE001 - the compiler's rejection is this program's result
        program.error = f"{type(e).__name__}: {_short(str(e))}"
    program.seconds = time.perf_counter() - start
    return program


def _short(message: str, limit: int = 2000) -> str:
    """The compiler's message without jax's traceback-filtering note, at most ``limit``
    characters (its head: where Mosaic says what it rejects)."""
    message = message.split("\n--------------------\nFor simplicity")[0].strip()
    return message if len(message) <= limit else message[:limit] + " ..."


def compile_variant(variant: Variant, problem: Problem, device: str | Device, *,
                    T: int = DEFAULT_T, only=None, dump_to=None) -> CompileReport:
    """Compile ``variant``'s `programs` for ``device`` with its real compiler (``only``: these
    program names; ``dump_to``: XLA GPU keeps its dump of each program, LLVM IR, PTX and thunk
    sequence, in ``dump_to/<program>``, else in a temporary directory). ValueError for a
    backend/device without one, RuntimeError when the compiler is not installed; a program the
    compiler rejects is a failed `Program`."""
    compiler, _ = compiler_of(variant.backend)
    device = _check_device(variant.backend, device)
    target = target_device(device, variant.backend)
    report = CompileReport(compiler, target.device_kind, device.name)
    wanted = programs(variant, problem, T)
    if only is not None:
        unknown = set(only) - {n for n, _ in wanted}
        if unknown:
            raise ValueError(f"only must name programs of {[n for n, _ in wanted]}, got "
                             f"{sorted(unknown)}")
        wanted = [(n, t) for n, t in wanted if n in only]
    try:
        for name, steps in wanted:
            report.programs.append(_compile_program(name, variant, problem, steps, target,
                                                    device, dump_to))
    finally:
        _backend_module(variant.backend).clear_cache()
    return report


# ------------------------------------------------------------------------------ verdict memo


def _memo_path():
    return settings.cache_root() / "compile.json"


def verdict_key(variant: Variant, problem: Problem, device: Device, T: int) -> str:
    """The memo key of a compile verdict: the variant's render sha256 (its templates), params,
    problem, target (for a GPU, its `gpu_target_config` text's sha256), T, the programs
    compiled (`programs`) and the compiler's versions."""
    import hashlib

    from gdngen import cache

    compiler, _ = compiler_of(variant.backend)
    target = device.topology
    if PLATFORMS[compiler] == "cuda":
        config = gpu_target_config(device).encode()
        target += ":" + hashlib.sha256(config).hexdigest()[:16]
    return "|".join([cache.variant_sha256(variant, problem), dumps(variant), dumps(problem),
                     device.name, target, f"T{T}",
                     ",".join(name for name, _ in programs(variant, problem, T)),
                     json.dumps(compiler_versions(compiler), sort_keys=True)])


def _memo_load() -> dict:
    try:
        data = json.loads(_memo_path().read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _memo_store(records: dict) -> None:
    from filelock import FileLock

    from gdngen.fileio import atomic_write_text

    path = _memo_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(path) + ".lock"):
        data = _memo_load()
        data.update(records)
        atomic_write_text(path, json.dumps(data, sort_keys=True) + "\n")


def check_space(variant_list, problem: Problem, device: str | Device, *, T: int = DEFAULT_T,
                on_variant=None) -> dict:
    """``{variant name: None | reason}``: the compile verdict of each variant (None: every
    program compiled), from the memo or compiled now (and remembered). ``on_variant(done,
    total, name)`` is called before each."""
    device = get_device(device) if isinstance(device, str) else device
    memo = _memo_load()
    verdicts, new = {}, {}
    for i, variant in enumerate(variant_list):
        if on_variant is not None:
            on_variant(i, len(variant_list), variant.name())
        key = verdict_key(variant, problem, device, T)
        if key in memo:
            verdicts[variant.name()] = memo[key]["error"]
            continue
        report = compile_variant(variant, problem, device, T=T)
        verdicts[variant.name()] = new.setdefault(key, {"error": report.first_error()})["error"]
    if new:
        _memo_store(new)
    return verdicts


def check_targets(targets, *, T: int = DEFAULT_T, on_variant=None) -> list[tuple]:
    """``[(target, {dropped variant name: reason})]``: each tuning target (`gdngen.tune.Target`)
    with the variants of its space that do not compile for its device `excluded`
    (`check_space`); targets whose backend has no real compiler for the device pass unchanged.
    RuntimeError when the compiler they need is not installed."""
    out = []
    for target in targets:
        device = get_device(target.device)
        if COMPILERS.get(target.backend, (None, None))[1] != device.kind or not device.topology:
            out.append((target, {}))
            continue
        space = target.space()
        verdicts = check_space(space, target.problem, device, T=T, on_variant=on_variant)
        dropped = {name: why for name, why in verdicts.items() if why is not None}
        out.append((dataclasses.replace(target, excluded=target.excluded + tuple(dropped)),
                    dropped))
    return out
