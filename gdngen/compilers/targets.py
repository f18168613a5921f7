"""The real compilers and the compile-only devices they compile for: which compiler a backend
has (`COMPILERS`), whether it is installed here (`missing_reason`), the versions a verdict
depends on, and a chip's compile-only jax devices: a TPU topology from libtpu, an NVIDIA device
from its `gpu_target_config` text (`GPU_SPECS`). Importing it sets libtpu's shared-load and
single-host settings and the CUDA plugin's no-GPU setting (before jax loads either)."""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import os

from gdngen import jaxcompat
from gdngen.devices import Device, get_device

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


def topology_missing(device: str | Device) -> str | None:
    """Why no compile-only device of ``device`` can be made here (None when it can): its
    compiler's `missing_reason`, or, where only some libtpu releases know its topology
    (`Device.topology_checked`, TPU7x), the installed libtpu's refusal
    (`jaxcompat.tpu_topology_missing`: builds the topology once per process)."""
    device = get_device(device) if isinstance(device, str) else device
    compiler = next((c for c, kind in COMPILERS.values() if kind == device.kind), None)
    if compiler is None or not device.topology:
        return f"{device.name} has no compile-only topology"
    reason = missing_reason(compiler)
    if reason is None and device.topology_checked:
        reason = jaxcompat.tpu_topology_missing(device.topology)
    return reason


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


def compiling_backend(device: Device) -> str:
    """The backend whose generated kernels a real compiler builds for ``device``'s kind
    (pallas_tpu for TPUs, pallas_gpu for NVIDIA GPUs); ValueError for a kind none compiles
    for."""
    backend = next((b for b, (_, kind) in COMPILERS.items() if kind == device.kind), None)
    if backend is None:
        raise ValueError(f"no backend has a real compiler for {device.kind} devices, got "
                         f"{device.name!r}")
    return backend


def _check_device(backend: str | None, device: str | Device) -> Device:
    """``device`` checked for ``backend``'s compiler (None: `compiling_backend`)."""
    device = get_device(device) if isinstance(device, str) else device
    backend = compiling_backend(device) if backend is None else backend
    compiler, kind = compiler_of(backend)
    if device.kind != kind or not device.topology:
        raise ValueError(f"device must be a {kind} device with a topology for {backend}'s "
                         f"{compiler} compile, got {device.name!r}")
    reason = topology_missing(device)
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
