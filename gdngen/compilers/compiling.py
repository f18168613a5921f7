"""The programs of a variant (`programs`) and their real compile for a device
(`compile_variant`, reported as a `CompileReport` of `Program` s); the package docstring lists
the programs."""

from __future__ import annotations

import contextlib
import dataclasses
import time

from gdngen import devices, dispatch, jaxcompat
from gdngen.compilers.hlo import mosaic_kernels, triton_kernels
from gdngen.compilers.targets import (
    PLATFORMS,
    _check_device,
    compiler_of,
    compiling_backend,
    target_device,
    topology_devices,
)
from gdngen.devices import Device
from gdngen.problem import Problem
from gdngen.variant import Variant

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


# ------------------------------------------------------------------------------ programs


#: the verify window of the ``steps_forward`` program (speculative decoding's longest draft)
STEPS_T = 16
#: the causal conv's taps in the fused programs (the models' kernel size)
FUSED_CONV = 4


def recurrent_length(variant: Variant) -> int:
    """The longest call the recurrent kernel runs (0: none does)."""
    return max(0, int(variant.get("recurrent_below") or 0) - 1)


def programs(variant: Variant, problem: Problem, T: int = DEFAULT_T) -> list[tuple[str, int]]:
    """``[(program name, steps)]`` a user's calls of ``variant`` run (`gdngen.compilers`)."""
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
    if problem.gate in spec.packed_gates:  # the backend's packed kernels take these gates
        out.append(("packed_fwd_bwd", chunk_T))
    out.append(("fused_fwd_bwd", chunk_T))
    if short:
        out.append(("fused_recurrent_forward", short))
    if (hasattr(spec, "chunk_norm") and spec.chunk_norm(variant, problem)
            and spec.holds_whole_head(variant, problem)):  # the chunk forward's norm build
        out.append(("fused_chunk_forward", chunk_T))
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
    if fused:  # + the output's gated norm and the causal conv (a backend's builds of them)
        channels = 2 * Hk * Dk + Hv * Dv
        args += [spec((Hv, Dk) if vector else (Hv,)), spec((Hv, Dk) if vector else (Hv,)),
                 spec((Dv,)), spec((1, T, Hv, Dv), dtype), spec((channels, FUSED_CONV)),
                 spec((1, channels, FUSED_CONV - 1))]
    if packed:
        args.append(spec((3,), jnp.int32))
    kwargs = {"variant": variant, "scale": Dk ** -0.5}

    def call(q, k, v, g, beta, *rest):
        extra = dict(kwargs)
        if fused:
            extra.update(qk_norm=True, gate="softplus", A_log=rest[0], dt_bias=rest[1],
                         norm_weight=rest[2], output_gate=rest[3], conv_weight=rest[4],
                         conv_state=rest[5])
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



def _backend_module(backend: str):
    from gdngen.backends.pallas import gpu as pallas_gpu
    from gdngen.backends.pallas import tpu as pallas_tpu

    return {"pallas_tpu": pallas_tpu, "pallas_gpu": pallas_gpu}[backend]


@contextlib.contextmanager
def _lowering_for(backend: str, target):
    """``backend``'s kernels lower for the compile-only jax device ``target`` (no interpret
    mode; Triton's for ``target`` as jax's default device), ungated: the first-use check
    (`gdngen.firstuse`) is of the attached device (this host's CPU, where the kernels run only
    interpreted), not of the compile's target, and its failure there would trace the portable
    fallback, without a kernel to compile."""
    compiler, _ = compiler_of(backend)
    module = _backend_module(backend)
    with contextlib.ExitStack() as stack:
        stack.enter_context(module.interpreting(False) if compiler == "mosaic"
                            else module.compiling_for_gpu())
        if compiler != "mosaic":
            stack.enter_context(jaxcompat.gpu_target(target))
        stack.enter_context(dispatch.ungated())
        yield


@contextlib.contextmanager
def targeting(device: str | Device, backend: str | None = None):
    """Trace for ``device``'s compile-only topology from this host, ahead of time (as MaxText's
    ``train_compile``): within it, ``gdngen.load_tuned(framework, device)`` takes ``device``
    though it is not attached, the generated kernels of ``backend`` (None: the one compiling
    for the device's kind, e.g. pallas_tpu) lower for its compiler, not in interpret mode, and
    the first-use check is skipped, as in `compile_variant` (nothing runs; the verdicts are of
    a device a kernel runs on). Yields the topology's jax devices: build the mesh on them and
    lower with ``lowering_platforms`` of the device ("tpu", "cuda"). ValueError for a device
    without a topology, RuntimeError where its compiler or topology is missing here."""
    device = _check_device(backend, device)
    backend = compiling_backend(device) if backend is None else backend
    found = topology_devices(device, backend)
    with devices.targeted(device.name), _lowering_for(backend, found[0]):
        yield found


def _compile_program(name: str, variant: Variant, problem: Problem, T: int, target,
                     device: Device, dump_to=None) -> Program:
    import pathlib
    import tempfile

    import jax
    from jax.sharding import SingleDeviceSharding

    compiler, _ = compiler_of(variant.backend)
    program = Program(name, T)
    start = time.perf_counter()
    try:
        with contextlib.ExitStack() as stack:
            fn, args = _program_fn(name, variant, problem, T, SingleDeviceSharding(target))
            with _lowering_for(variant.backend, target):
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
