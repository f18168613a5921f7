"""Device registry: target names, their kind and their on-chip memory limits.

Which backends a device runs is each backend's own declaration (`gdngen.registry.backends_for`:
the backends whose ``device_kinds`` hold the device's kind).

One table, `DEVICES`; each limit names its source. `detect(framework)` maps what JAX
(``jax.devices()[0].platform`` / ``device_kind``) or MLX (``mx.metal.is_available()``,
``mx.device_info()["device_name"]``) runs on to a registry name; it imports only the framework
asked about.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import importlib.util
import re
from dataclasses import dataclass, field

from gdngen.shape import FRAMEWORKS, check_framework

KiB, MiB = 1024, 1024 * 1024


@dataclass(frozen=True)
class Device:
    """A tuning target. ``limits`` holds on-chip memory budgets in bytes (``vmem`` for TPUs,
    ``threadgroup_memory`` for Apple GPUs, ``shared_memory`` per block for NVIDIA)."""

    name: str
    kind: str  # "cpu" | "tpu" | "gpu" | "apple"
    limits: dict = field(default_factory=dict)
    source: str = ""
    #: the compile-only topology of a TPU (``jax.experimental.topologies.get_topology_desc``
    #: with libtpu) or NVIDIA GPU (one chip, "1x1x1", with jax's CUDA plugin; `gdngen.compilers`),
    #: "" for devices without one
    topology: str = ""
    #: True where only some libtpu releases know ``topology``: asked of the installed one before
    #: use (`gdngen.compilers.topology_missing`, `gdngen.jaxcompat.tpu_topology_missing`)
    topology_checked: bool = False
    #: a TPU TensorCore's matrix unit (MXU): its systolic array, rows x columns
    mxu: tuple[int, int] | None = None


# VMEM per TensorCore: v4 16 MiB, v5e 128 MiB, v5p 95 MiB, v6e 128 MiB (Pallas TPU docs,
# "TPU memory spaces" / jax.experimental.pallas.tpu; Mosaic's default scoped-VMEM limit is
# lower, 16-32 MiB, so variants are planned against `vmem_budget`). TPU7x (Ironwood): two
# TensorCores per chip, each its own jax device (Cloud TPU docs, "TPU7x (Ironwood)"), 64 MiB of
# VMEM and two 256x256 MXUs per TensorCore (jax's TPU hardware table, TpuInfo for
# ChipVersion.TPU_7X in jax/_src/pallas/mosaic/tpu_info.py, jax 0.10-0.12); budget 32 MiB as
# v5e-v6e (docs/COMPILE.md, "TPU7x"). MXU: 128x128 before v6e, 256x256 from v6e (the same table).
# Apple GPUs: 32 KiB threadgroup memory per threadgroup (Metal feature set tables, all families).
# NVIDIA: 227 KiB shared memory per block on Hopper (H100/H200), 163 KiB on A100 (CUDA guide).
DEVICES: dict[str, Device] = {
    d.name: d for d in (
        Device("cpu", "cpu"),
        Device("tpu-v4", "tpu", {"vmem": 16 * MiB, "vmem_budget": 16 * MiB},
               "Pallas TPU docs", topology="v4:2x2x1", mxu=(128, 128)),
        Device("tpu-v5e", "tpu", {"vmem": 128 * MiB, "vmem_budget": 32 * MiB},
               "Pallas TPU docs", topology="v5e:2x2", mxu=(128, 128)),
        Device("tpu-v5p", "tpu", {"vmem": 95 * MiB, "vmem_budget": 32 * MiB},
               "Pallas TPU docs", topology="v5p:2x2x1", mxu=(128, 128)),
        Device("tpu-v6e", "tpu", {"vmem": 128 * MiB, "vmem_budget": 32 * MiB},
               "Pallas TPU docs", topology="v6e:2x2", mxu=(256, 256)),
        Device("tpu-v7x", "tpu", {"vmem": 64 * MiB, "vmem_budget": 32 * MiB},
               "Cloud TPU7x docs; jax TpuInfo", topology="tpu7x:2x2x1", topology_checked=True,
               mxu=(256, 256)),
        Device("a100", "gpu", {"shared_memory": 163 * KiB},
               "CUDA programming guide, compute capability 8.0", topology="1x1x1"),
        Device("h100", "gpu", {"shared_memory": 227 * KiB},
               "CUDA programming guide, compute capability 9.0", topology="1x1x1"),
        Device("h200", "gpu", {"shared_memory": 227 * KiB},
               "CUDA programming guide, compute capability 9.0", topology="1x1x1"),
        *(Device(f"apple-m{i}", "apple", {"threadgroup_memory": 32 * KiB},
                 "Metal feature set tables") for i in range(1, 6)),
    )
}


def get_device(name: str) -> Device:
    """The registered device ``name``; ValueError listing the known names otherwise."""
    if name not in DEVICES:
        raise ValueError(f"device must be one of {sorted(DEVICES)}, got {name!r}")
    return DEVICES[name]


# ------------------------------------------------------------------------------ detection


# device_kind substrings (lower case) -> registry name, first match wins. JAX reports TPUs as
# "TPU v4", "TPU v5 lite" (v5e), "TPU v5p" / "TPU v5" (v5p), "TPU v6 lite" / "TPU v6e" (v6e),
# "TPU7x" (Ironwood; not "TPU7", another chip); NVIDIA GPUs as the marketing name ("NVIDIA H100
# 80GB HBM3", "NVIDIA A100-SXM4-40GB").
_TPU_KINDS = (("v5 lite", "tpu-v5e"), ("v5e", "tpu-v5e"), ("v5p", "tpu-v5p"), ("v5", "tpu-v5p"),
              ("v6 lite", "tpu-v6e"), ("v6e", "tpu-v6e"), ("trillium", "tpu-v6e"),
              ("v4", "tpu-v4"), ("tpu7x", "tpu-v7x"), ("v7x", "tpu-v7x"))
_GPU_KINDS = (("h200", "h200"), ("h100", "h100"), ("a100", "a100"))


@dataclass(frozen=True)
class Detected:
    """What one framework sees: ``name`` is the registry name (None when the attached device is
    not in `DEVICES`), ``description`` the framework's own words for it."""

    framework: str
    name: str | None
    description: str


def device_from_jax(platform: str, device_kind: str) -> str | None:
    """Registry name for a JAX device (``jax.devices()[0].platform`` / ``.device_kind``)."""
    platform, kind = platform.lower(), device_kind.lower()
    if platform == "cpu":
        return "cpu"
    if platform == "tpu":
        return next((name for part, name in _TPU_KINDS if part in kind), None)
    if platform in ("gpu", "cuda"):
        return next((name for part, name in _GPU_KINDS if part in kind), None)
    return None


def device_from_mlx(gpu_default: bool, info: dict) -> str | None:
    """Registry name for MLX's default device: ``gpu_default`` is True when Metal is available
    and the default device is the GPU; ``info`` is ``mx.device_info()`` (``device_name`` such as
    "Apple M3 Max")."""
    if not gpu_default:
        return "cpu"
    match = re.search(r"\bM(\d+)\b", str(info.get("device_name", "")))
    name = f"apple-m{match.group(1)}" if match else None
    return name if name in DEVICES else None


def _detect_jax() -> Detected:
    import jax

    device = jax.devices()[0]
    kind = getattr(device, "device_kind", "") or device.platform
    return Detected("jax", device_from_jax(device.platform, kind), f"{device.platform}: {kind}")


def _detect_mlx() -> Detected:
    import mlx.core as mx

    gpu = bool(mx.metal.is_available()) and mx.default_device().type == mx.DeviceType.gpu
    info_fn = getattr(mx, "device_info", None)  # mlx 0.32; older releases: mx.metal only
    if info_fn is None and gpu:
        info_fn = mx.metal.device_info
    info = dict(info_fn()) if info_fn is not None else {}
    described = info.get("device_name") or info.get("architecture") or "cpu"
    return Detected("mlx", device_from_mlx(gpu, info),
                    f"{'gpu' if gpu else 'cpu'}: {described}")


@functools.cache
def detect_framework(framework: str) -> Detected:
    """What ``framework`` ("jax" | "mlx") runs on by default (imports that framework only;
    memoised per process)."""
    check_framework(framework)
    return _detect_jax() if framework == "jax" else _detect_mlx()


def installed_frameworks() -> tuple[str, ...]:
    """Frameworks importable here (checked without importing them)."""
    return tuple(fw for fw in FRAMEWORKS if importlib.util.find_spec(fw) is not None)


def detect_all() -> dict[str, Detected]:
    """`detect_framework` for every installed framework."""
    return {fw: detect_framework(fw) for fw in installed_frameworks()}


def detect(framework: str | None = None) -> str:
    """Registry name of the attached device as ``framework`` sees it; with None, an Apple GPU
    (MLX Metal) wins, then the JAX device, then "cpu". ValueError when the device is not in the
    registry (the message says what was found)."""
    if framework is not None:
        found = detect_framework(framework)
        if found.name is None:
            raise ValueError(f"the device {framework} runs on ({found.description}) is not in "
                             f"the gdngen device registry {sorted(DEVICES)}")
        return found.name
    found = detect_all()
    for fw in ("mlx", "jax"):
        if fw in found and found[fw].name not in (None, "cpu"):
            return found[fw].name
    return "cpu"


#: the devices traced for ahead of time here (`targeted`): taken as attached by `require_attached`
_TARGETED: contextvars.ContextVar = contextvars.ContextVar("gdngen_targeted", default=())


@contextlib.contextmanager
def targeted(name: str):
    """Within it, `require_attached` takes device ``name`` as attached: a trace for its
    compile-only topology (`gdngen.compilers.targeting`, which checks the topology)."""
    token = _TARGETED.set((*_TARGETED.get(), get_device(name).name))
    try:
        yield
    finally:
        _TARGETED.reset(token)


def require_attached(name: str, framework: str) -> Device:
    """The registered device ``name``, checked to be what ``framework`` runs on here (or the
    device of a `targeted` trace); a ValueError saying what was found instead otherwise (fail
    fast before tuning)."""
    device = get_device(name)
    if name in _TARGETED.get():
        return device
    found = detect_framework(framework)
    if found.name != name:
        raise ValueError(f"device {name!r} is not attached: {framework} runs on "
                         f"{found.name or 'an unregistered device'} ({found.description})")
    return device


def format_table(detected: dict, backends: dict, unavailable: dict | None = None) -> str:
    """``gdngen devices`` table: every registered device with its ``backends`` (device name ->
    backend names), its compile-only topology, marking the ones ``detected`` (framework ->
    `Detected`) found attached; ``unavailable`` (device name -> reason,
    `gdngen.compilers.topology_missing`): the topologies that cannot be compiled for here, with
    the reasons below the table."""
    from gdngen.tables import render_table

    unavailable = unavailable or {}
    rows = []
    for dev in DEVICES.values():
        seen = [f"{fw} ({d.description})" for fw, d in detected.items() if d.name == dev.name]
        limits = [f"{k}={v // MiB} MiB" if v >= MiB else f"{k}={v // KiB} KiB"
                  for k, v in dev.limits.items()]
        if dev.mxu:
            limits.append("mxu={}x{}".format(*dev.mxu))
        topology = dev.topology or "-"
        if dev.name in unavailable:
            topology += " (unavailable)"
        rows.append((dev.name, dev.kind, ", ".join(backends.get(dev.name, ())),
                     ", ".join(limits) or "-", topology,
                     "* " + "; ".join(seen) if seen else "", dev.source))
    unknown = [f"{fw}: {d.description}" for fw, d in detected.items() if d.name is None]
    footer = ["attached but not registered: " + "; ".join(unknown)] if unknown else []
    by_reason: dict[str, list[str]] = {}
    for name, reason in unavailable.items():
        by_reason.setdefault(reason, []).append(name)
    footer += [f"no compile-only topology here for {', '.join(names)}: {reason}"
               for reason, names in by_reason.items()]
    return render_table("gdngen devices", ("device", "kind", "backends", "limits", "topology",
                                           "attached", "source"), rows, footer=footer)
