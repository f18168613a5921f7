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
  ``A_log``, ``dt_bias`` (the fused-input build) at ``T`` and at the recurrent length.

Each compiled program reports XLA's memory analysis (``temp_bytes``, ``code_bytes``) and, per
Mosaic kernel, the scoped VMEM the compiler used and the limit it was given (read from the
compiled HLO's ``tpu_custom_call`` backend configs): `CompileReport.vmem_used` is the largest.

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

from gdngen import settings
from gdngen.devices import Device, get_device
from gdngen.variant import Problem, Variant, dumps

__all__ = ["COLLECTIVES", "COMPILERS", "CompileReport", "Program", "check_space",
           "check_targets", "collective_bytes", "compile_variant", "compiler_available",
           "compiler_versions", "missing_reason", "programs", "target_device",
           "topology_devices"]

#: backend -> (compiler name, device kind it compiles for)
COMPILERS = {"pallas_tpu": ("mosaic", "tpu")}
#: packages whose versions make a compile verdict (with gdngen's own version)
COMPILER_PACKAGES = {"mosaic": ("jax", "jaxlib", "libtpu")}

#: the default sequence length of the chunk programs (two chunks of the largest chunk size)
DEFAULT_T = 256


@dataclasses.dataclass
class Program:
    """One compiled program: ``kernels`` lists each Mosaic kernel as ``{"name", "vmem_used",
    "vmem_limit"}`` (bytes)."""

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
    target: str  # the compile-only device's device_kind, e.g. "TPU v5 lite"
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
        return max((k["vmem_used"] for p in self.programs for k in p.kernels), default=0)

    @property
    def seconds(self) -> float:
        return sum(p.seconds for p in self.programs)

    def first_error(self) -> str | None:
        if self.error:
            return self.error
        return next((f"{p.name}: {p.error}" for p in self.programs if not p.ok), None)

    def to_json(self) -> dict:
        return {"compiler": self.compiler, "target": self.target, "device": self.device,
                "ok": self.ok, "error": self.first_error(), "temp_bytes": self.temp_bytes,
                "code_bytes": self.code_bytes, "vmem_used": self.vmem_used,
                "seconds": round(self.seconds, 2),
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


def _check_device(backend: str, device: str | Device) -> Device:
    compiler, kind = compiler_of(backend)
    device = get_device(device) if isinstance(device, str) else device
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


@functools.cache
def _topology(name: str):
    from jax.experimental import topologies

    return topologies.get_topology_desc(topology_name=name, platform="tpu")


def target_device(device: str | Device, backend: str = "pallas_tpu"):
    """A compile-only jax device of ``device`` (the first of its topology)."""
    device = _check_device(backend, device)
    return _topology(device.topology).devices[0]


def topology_devices(device: str | Device, backend: str = "pallas_tpu") -> list:
    """Every compile-only jax device of ``device``'s topology (e.g. 4 for ``v5e:2x2``)."""
    device = _check_device(backend, device)
    return list(_topology(device.topology).devices)


# ------------------------------------------------------------------------------ programs


def recurrent_length(variant: Variant) -> int:
    """The longest call the recurrent kernel runs (0: none does)."""
    return max(0, int(variant.get("recurrent_below") or 0) - 1)


def programs(variant: Variant, problem: Problem, T: int = DEFAULT_T) -> list[tuple[str, int]]:
    """``[(program name, steps)]`` a user's calls of ``variant`` run (module docstring)."""
    from gdngen import registry

    if T < 1:
        raise ValueError(f"T must be a positive number of steps, got {T}")
    check = registry.get(variant.backend).parse(variant)
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


def _compile_program(name: str, variant: Variant, problem: Problem, T: int, target) -> Program:
    import jax
    from jax.sharding import SingleDeviceSharding

    from gdngen.backends.pallas import tpu as pallas_tpu

    program = Program(name, T)
    start = time.perf_counter()
    try:
        fn, args = _program_fn(name, variant, problem, T, SingleDeviceSharding(target))
        with pallas_tpu.interpreting(False):
            lowered = jax.jit(fn).trace(*args).lower(lowering_platforms=("tpu",))
        compiled = lowered.compile()
        memory = compiled.memory_analysis()
        program.temp_bytes = int(memory.temp_size_in_bytes)
        program.code_bytes = int(memory.generated_code_size_in_bytes)
        program.kernels = mosaic_kernels(compiled.as_text())
        if not program.kernels:
            raise RuntimeError(f"the {name} program compiled without a Mosaic kernel")
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
                    T: int = DEFAULT_T, only=None) -> CompileReport:
    """Compile ``variant``'s `programs` for ``device`` with its real compiler (``only``: these
    program names). ValueError for a backend/device without one, RuntimeError when the
    compiler is not installed; a program the compiler rejects is a failed `Program`."""
    from gdngen.backends.pallas import tpu as pallas_tpu

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
            report.programs.append(_compile_program(name, variant, problem, steps, target))
    finally:
        pallas_tpu.clear_cache()
    return report


# ------------------------------------------------------------------------------ verdict memo


def _memo_path():
    return settings.cache_root() / "compile.json"


def verdict_key(variant: Variant, problem: Problem, device: Device, T: int) -> str:
    """The memo key of a compile verdict: the variant's render sha256 (its templates), params,
    problem, target, T and the compiler's versions."""
    from gdngen import cache

    compiler, _ = compiler_of(variant.backend)
    return "|".join([cache.variant_sha256(variant, problem), dumps(variant), dumps(problem),
                     device.name, device.topology, f"T{T}",
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
