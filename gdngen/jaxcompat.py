"""The jax releases gdngen supports, and the APIs whose home or spelling differs between them.

gdngen is tested with jax (and jaxlib) 0.10 through 0.12 (docs/COMPILE.md, "Supported JAX").
`require` imports jax and refuses a release outside that range with one `UnsupportedJax` naming
the installed and the supported versions; `gdngen.sharding` calls it at its import, so ``import
gdngen.jax`` fails there rather than with an AttributeError deep in a trace.

Everything gdngen uses from jax that moved between releases, or that lives in a private module,
is reached through the functions below, so a new jax release changes this module only:

* `shard_map` (``jax.shard_map``; ``jax.experimental.shard_map`` before jax 0.6);
* `typeof`, `varying_axes`, `varying`, `result_struct`: an array's abstract value, the manual
  axes it varies over (``manual_axis_type.varying``; ``vma`` before), it made varying over
  more (``jax.lax.pcast``; ``pvary`` before), a kernel result typed like it;
* `custom_partitioning` (``jax.experimental.custom_partitioning``);
* `get_topology_desc`: libtpu's and the CUDA plugin's compile-only topologies
  (``jax.experimental.topologies``); `gpu_target`, `abstract_gpu`: Pallas Triton's lowering
  for one of the latter's devices, or for an abstract H100 (jax >= 0.12 needs a GPU to lower
  for);
* `ffi` (``jax.ffi``; ``jax.extend.ffi`` before jax 0.4.38): the FFI_cpu backend's registration
  and calls;
* `tpu_topology_missing`: whether the installed libtpu knows a compile-only topology (TPU7x's
  only in some releases); `tpu_hardware`: jax's (private) table of a TPU chip's VMEM and MXU;
* `pallas`, `pallas_tpu`: the Pallas modules gdngen's own code uses; `tpu_interpreter`: Pallas
  TPU interpret mode's module (private), whose race detector gdngen reads. The generated kernel
  sources import ``jax.experimental.pallas`` themselves (standalone modules; the same spelling
  in every supported release).

`gdngen.devices` maps the TPU device kinds jax reports to the registry, and
`gdngen.devices.Device.topology` names libtpu's compile-only topologies: v4 to v6e the same in
the libtpu of every supported jax; TPU7x's (``tpu7x:2x2x1``) only in some releases (libtpu
0.0.42.1 of jax 0.10.2 and 0.0.50.1 of jax 0.12.0.1 know it), so `tpu_topology_missing` asks
the installed libtpu (`gdngen.devices.Device.topology_checked`).

Without importing jax, the process settings gdngen's commands make first (`host_settings`):
`skip_absent_tpu` keeps jax from starting its TPU platform on a host without a TPU
(`tpu_attached`), where libtpu, installed by ``gdngen[tpu]`` for the compile-only topologies,
otherwise prints its start-up errors at every jax start, and gives libtpu its single-host
settings for those topologies (`libtpu_single_host`); `cuda_plugin_without_gpu` lets jax 0.12's
CUDA plugin register its compile-only topologies without the CUDA runtime libraries.
"""

from __future__ import annotations

import contextlib
import functools
import glob
import importlib.util
import os
import re

__all__ = ["SUPPORTED", "UnsupportedJax", "abstract_gpu", "check_versions",
           "cuda_plugin_without_gpu", "custom_partitioning", "ffi", "get_topology_desc",
           "gpu_target", "host_settings", "libtpu_single_host", "pallas", "pallas_tpu",
           "quiet_host", "release", "require", "result_struct", "shard_map", "skip_absent_tpu",
           "tpu_attached", "tpu_hardware", "tpu_interpreter", "tpu_topology_missing", "typeof",
           "varying", "varying_axes"]

#: the (major, minor) releases of jax and jaxlib gdngen is tested with, lowest and highest
SUPPORTED = ((0, 10), (0, 12))


def _supported_text() -> str:
    (lo_major, lo_minor), (hi_major, hi_minor) = SUPPORTED
    return f"{lo_major}.{lo_minor} through {hi_major}.{hi_minor}"


class UnsupportedJax(ImportError):
    """The installed jax or jaxlib is outside `SUPPORTED`."""


def release(version: str) -> tuple[int, int]:
    """``(major, minor)`` of a version string (``"0.12.0.1"`` -> ``(0, 12)``; ``"0.13.0.dev1"``
    -> ``(0, 13)``); ValueError for one that does not start with two numbers."""
    match = re.match(r"\s*(\d+)\.(\d+)", str(version))
    if match is None:
        raise ValueError(f"version must start with major.minor numbers, got {version!r}")
    return int(match.group(1)), int(match.group(2))


def check_versions(jax_version: str, jaxlib_version: str) -> None:
    """Raise `UnsupportedJax` unless both versions are releases in `SUPPORTED`."""
    lo, hi = SUPPORTED
    bad = [f"{name} {version}" for name, version in (("jax", jax_version),
                                                    ("jaxlib", jaxlib_version))
           if not lo <= release(version) <= hi]
    if bad:
        raise UnsupportedJax(
            f"gdngen supports jax and jaxlib {_supported_text()}, but {' and '.join(bad)} "
            f"is installed (jax {jax_version}, jaxlib {jaxlib_version}); install a supported "
            f"release, e.g. pip install 'gdngen[jax]' (jax 0.11 and later need Python >= 3.12)")


@functools.cache
def require():
    """``jax``, imported and checked to be a supported release (`UnsupportedJax` otherwise)."""
    import jax
    import jaxlib

    check_versions(jax.__version__, getattr(jaxlib, "__version__", None)
                   or _distribution_version("jaxlib"))
    return jax


def _distribution_version(name: str) -> str:
    import importlib.metadata

    return importlib.metadata.version(name)


# ------------------------------------------------------------------------------ moved APIs


def shard_map(f, **kwargs):
    """``jax.shard_map(f, **kwargs)`` (``mesh``, ``in_specs``, ``out_specs``, ...)."""
    return require().shard_map(f, **kwargs)


def typeof(x):
    """``jax.typeof(x)``: the abstract value of ``x`` with its sharding."""
    return require().typeof(x)


def varying_axes(x) -> frozenset:
    """The manual mesh axes ``x`` varies over inside ``jax.shard_map`` (empty outside one)."""
    return frozenset(typeof(x).manual_axis_type.varying)


def varying(x, axes):
    """``x`` made varying over the manual mesh ``axes`` it does not vary over yet (inside
    ``jax.shard_map``; ``jax.lax.pcast(..., to="varying")``, ``jax.lax.pvary`` before), so a
    custom VJP's cotangent of it may vary as its other inputs' do; the transpose sums it."""
    jax = require()
    axes = tuple(sorted(set(axes) - varying_axes(x)))
    if not axes:
        return x
    if hasattr(jax.lax, "pcast"):
        return jax.lax.pcast(x, axes, to="varying")
    return jax.lax.pvary(x, axes)


def result_struct(shape, dtype, like):
    """A ``jax.ShapeDtypeStruct`` that varies over the manual axes ``like`` varies over (a
    plain one where ``like`` varies over none)."""
    jax = require()
    from jax.sharding import NamedSharding, PartitionSpec

    aval = typeof(like)
    if not aval.manual_axis_type.varying:
        return jax.ShapeDtypeStruct(shape, dtype)
    return jax.ShapeDtypeStruct(shape, dtype,
                                sharding=NamedSharding(aval.sharding.mesh, PartitionSpec()),
                                manual_axis_type=aval.manual_axis_type)


def custom_partitioning(fun):
    """``jax.experimental.custom_partitioning.custom_partitioning(fun)``."""
    require()
    from jax.experimental.custom_partitioning import custom_partitioning as make

    return make(fun)


def get_topology_desc(**kwargs):
    """``jax.experimental.topologies.get_topology_desc(**kwargs)``: compile-only devices."""
    require()
    from jax.experimental import topologies

    return topologies.get_topology_desc(**kwargs)


def tpu_hardware(device_kind: str):
    """jax's table of a TPU TensorCore's hardware (a ``TpuInfo``: ``vmem_capacity_bytes``,
    ``mxu_column_size``, ``num_mxus``, ...) for the chip jax reports as ``device_kind`` ("TPU
    v5 lite", "TPU7x"), one TensorCore per device; None for a kind the table lacks. Private in
    every supported release (``jax._src.pallas.mosaic.tpu_info``; from jax 0.12 a forward to
    ``jax._src.tpu_info``)."""
    require()
    from jax._src.pallas.mosaic import tpu_info

    chip = tpu_info.chip_version_from_device_kind(device_kind)
    return None if chip is None else tpu_info.get_tpu_info_for_chip(chip, 1)


@functools.cache
def tpu_topology_missing(topology: str) -> str | None:
    """Why libtpu gives no compile-only ``topology`` here (None when it does): libtpu is not
    installed, the installed release does not know the name (its own words), or it is a release
    gdngen refuses for that topology (`TOPOLOGY_LIBTPU_REFUSED`, with why). Asked by
    building the topology, once per process and name (libtpu's start, 2-5 s on a busy 2-core
    host, the first time). libtpu's single-host settings (`libtpu_single_host`) keep its start
    quiet; `gdngen.compilers` sets them at import."""
    if importlib.util.find_spec("libtpu") is None:
        return "libtpu is not installed (pip install 'gdngen[tpu]')"
    try:
        version = _distribution_version("libtpu")
    except Exception:  # noqa: BLE001 - a libtpu without distribution metadata
        version = "(version unknown)"
    try:
        get_topology_desc(topology_name=topology, platform="tpu")
    except Exception as e:  # noqa: BLE001 - libtpu's refusal is the answer
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        return (f"the installed libtpu {version} does not know the topology {topology!r} "
                f"({first}); jax[tpu] 0.12.0.1's libtpu 0.0.50.1 does")
    for (first_bad, first_good), why in TOPOLOGY_LIBTPU_REFUSED.get(topology, ()):
        found = tuple(int(n) for n in re.findall(r"\d+", version)[:len(first_bad)])
        if first_bad <= found < first_good:
            return (f"the installed libtpu {version} knows the topology {topology!r}, but "
                    f"gdngen does not compile for it with libtpu {_dotted(first_bad)} up to (not "
                    f"including) {_dotted(first_good)}: {why}")
    return None


#: libtpu releases gdngen does not compile a topology with: ((first bad, first good), why)
TOPOLOGY_LIBTPU_REFUSED = {
    "tpu7x:2x2x1": [(((0, 0, 48), (0, 0, 50)),
                     ("its Mosaic uses 1.47x the VMEM the footprint model admits for the "
                     "backward, where libtpu 0.0.42 and 0.0.50 stay within the render's 1.25x "
                     "margin (docs/COMPILE.md, TPU7x)"))],
}


def _dotted(release: tuple) -> str:
    return ".".join(map(str, release))


def ffi():
    """``jax.ffi``: ``ffi_call``, ``register_ffi_target``, ``pycapsule``, ``include_dir``."""
    return require().ffi


def pallas():
    """``jax.experimental.pallas``."""
    require()
    from jax.experimental import pallas as pl

    return pl


def pallas_tpu():
    """``jax.experimental.pallas.tpu`` (``VMEM``, ``CompilerParams``, ``InterpretParams``,
    ``reset_tpu_interpret_mode_state``)."""
    require()
    from jax.experimental.pallas import tpu as pltpu

    return pltpu


def gpu_target(device):
    """A context in which Pallas Triton kernels lower for the compile-only NVIDIA ``device`` (a
    topology's, `gdngen.compilers.target_device`) where no GPU is attached: jax's default device.
    jax >= 0.12 reads the GPU and its compute capability from it and refuses without one ("No
    supported GPU devices found"); jax 0.10 took sm_90 for every target."""
    return require().default_device(device)


def abstract_gpu(device_kind: str = "NVIDIA H100 80GB HBM3", num_cores: int = 132):
    """A context in which Pallas Triton kernels lower for CUDA without a GPU and without a
    compile-only device (`gdngen.backends.pallas.gpu.lower_check`): an abstract mesh whose
    abstract device is ``device_kind`` (an H100, sm_90). jax >= 0.12 reads the GPU from it
    (``jax._src.pallas.triton.gpu_info``) and refuses without one; before, the lowering took
    sm_90 itself and refused a non-CPU abstract device, so this is no context there."""
    jax = require()
    if importlib.util.find_spec("jax._src.pallas.triton.gpu_info") is None:
        return contextlib.nullcontext()
    from jax.sharding import AbstractDevice, AbstractMesh

    device = AbstractDevice(device_kind=device_kind, num_cores=num_cores, platform="cuda")
    return jax.sharding.use_abstract_mesh(AbstractMesh((), (), abstract_device=device))


def tpu_interpreter():
    """Pallas TPU interpret mode's module (private in every supported release): its ``races``
    is the race detector's verdict on the kernels run with ``detect_races``."""
    require()
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call

    return interpret_pallas_call


# ------------------------------------------------------------------------------ TPU platform


#: a TPU chip on the PCI bus: Google's vendor id and the chips' device ids (jax's
#: ``hardware_utils``: v3, an unnamed one, v4, v5p, v5e, v6e, TPU7x); other Google devices
#: (gVNIC) are not TPUs
GOOGLE_PCI_VENDOR = "0x1ae0"
TPU_PCI_DEVICES = frozenset({"0x0027", "0x0056", "0x005e", "0x0062", "0x0063", "0x006f",
                             "0x0076"})


def tpu_attached(pci_root: str = "/sys/bus/pci/devices") -> bool:
    """Whether a TPU chip is on this host's PCI bus (what jax and libtpu look for)."""
    for vendor in glob.glob(os.path.join(pci_root, "*", "vendor")):
        try:
            with open(vendor) as f:
                if f.read().strip() != GOOGLE_PCI_VENDOR:
                    continue
            with open(os.path.join(os.path.dirname(vendor), "device")) as f:
                if f.read().strip() in TPU_PCI_DEVICES:
                    return True
        except OSError:
            continue
    return False


#: jax plugin modules (``jax_plugins.<name>``) -> the platform they register
_PLUGIN_PLATFORMS = (("xla_cuda", "cuda"), ("xla_rocm", "rocm"))
#: libtpu's single-host settings: without them its start on a host without a TPU (a compile-only
#: topology) prints "unexpected worker hostname ... TPU_WORKER_HOSTNAMES" and "Failed to find
#: host bounds for accelerator type"
LIBTPU_SINGLE_HOST = {"TPU_WORKER_HOSTNAMES": "localhost", "TPU_HOST_BOUNDS": "1,1,1"}


def _plugin_platforms() -> list[str] | None:
    """The platforms of the installed jax plugins (None: one gdngen does not know)."""
    import pkgutil

    spec = importlib.util.find_spec("jax_plugins")
    if spec is None or not spec.submodule_search_locations:
        return []
    platforms = []
    for module in pkgutil.iter_modules(list(spec.submodule_search_locations)):
        platform = next((p for prefix, p in _PLUGIN_PLATFORMS
                         if module.name.startswith(prefix)), None)
        if platform is None:
            return None
        if platform not in platforms:
            platforms.append(platform)
    return platforms


def libtpu_single_host(environ=None, *, pci_root: str = "/sys/bus/pci/devices") -> dict:
    """On a host without a TPU, libtpu's single-host settings (`LIBTPU_SINGLE_HOST`, each unless
    already set), read when libtpu starts for a compile-only topology. Returns what it set."""
    environ = os.environ if environ is None else environ
    if tpu_attached(pci_root):
        return {}
    added = {k: v for k, v in LIBTPU_SINGLE_HOST.items() if k not in environ}
    environ.update(added)
    return added


def skip_absent_tpu(environ=None, *, pci_root: str = "/sys/bus/pci/devices") -> dict:
    """On a host with libtpu installed but no TPU attached, keep jax from starting its TPU
    platform: ``JAX_PLATFORMS`` set to jax's other platforms (the installed plugins', then
    "cpu"; jax itself skips "cuda" where no NVIDIA GPU is visible), and `libtpu_single_host`
    for the compile-only topologies, which still start libtpu. gdngen's commands call it first
    (before jax is imported: jax reads ``JAX_PLATFORMS`` at import), and their subprocesses
    inherit it. What a user set (even an empty ``JAX_PLATFORMS``) is kept, and nothing is set
    where a TPU is attached or libtpu is not installed; ``JAX_PLATFORMS`` is left alone where a
    jax plugin gdngen does not know is installed. Returns what it set."""
    environ = os.environ if environ is None else environ
    if importlib.util.find_spec("libtpu") is None or tpu_attached(pci_root):
        return {}
    added = libtpu_single_host(environ, pci_root=pci_root)
    plugins = _plugin_platforms()
    if plugins is not None and "JAX_PLATFORMS" not in environ:
        added["JAX_PLATFORMS"] = environ["JAX_PLATFORMS"] = ",".join([*plugins, "cpu"])
    return added


# ------------------------------------------------------------------------------ CUDA plugin


#: device files of a visible NVIDIA GPU (jax's own check)
NVIDIA_DEVICE_FILES = ("/dev/nvidia0", "/dev/nvidiactl", "/dev/dxg")


def cuda_plugin_without_gpu(environ=None, *, device_files=NVIDIA_DEVICE_FILES) -> dict:
    """On a host without an NVIDIA GPU, ``JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1`` (unless set): the
    CUDA plugin of jax >= 0.12 checks the CUDA runtime libraries (cuDNN, ...) when it registers
    and, without them (``gdngen[cuda]`` brings only the compiler), leaves its compile-only
    topologies unregistered ("topology not implemented for cuda"); jax 0.10's did not. Read
    when jax first looks for its plugins. Returns what it set."""
    environ = os.environ if environ is None else environ
    if any(os.path.exists(f) for f in device_files) or \
            "JAX_SKIP_CUDA_CONSTRAINTS_CHECK" in environ:
        return {}
    environ["JAX_SKIP_CUDA_CONSTRAINTS_CHECK"] = "1"
    return {"JAX_SKIP_CUDA_CONSTRAINTS_CHECK": "1"}


def host_settings(environ=None) -> dict:
    """What gdngen's commands set first, before jax is imported: `skip_absent_tpu` and
    `cuda_plugin_without_gpu`. Returns what was set."""
    environ = os.environ if environ is None else environ
    return {**skip_absent_tpu(environ), **cuda_plugin_without_gpu(environ)}


def quiet_host(environ=None) -> dict:
    """`host_settings` for a library user: ``import gdngen`` calls it, so a script's first
    jit on a host with libtpu installed but no TPU prints no libtpu start-up errors. Before jax
    is imported it sets the environment (`host_settings`); after, where jax has started no
    platform yet and neither ``JAX_PLATFORMS`` nor ``jax_platforms`` was set, it sets jax's
    ``jax_platforms`` option to the same value. Returns what it set."""
    import sys

    environ = os.environ if environ is None else environ
    if "jax" not in sys.modules:
        return host_settings(environ)
    jax = sys.modules["jax"]
    from jax._src import xla_bridge

    user_set = "JAX_PLATFORMS" in environ or jax.config.jax_platforms is not None
    if user_set or xla_bridge.backends_are_initialized():
        return cuda_plugin_without_gpu(environ)
    added = host_settings(dict(environ))
    platforms = added.pop("JAX_PLATFORMS", None)
    environ.update(added)
    if platforms is not None:
        jax.config.update("jax_platforms", platforms)
        added["jax_platforms"] = platforms
    return added
