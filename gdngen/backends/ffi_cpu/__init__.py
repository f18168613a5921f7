"""ffi_cpu backend: generated C++ kernels for the chunkwise gated delta rule on the host CPU,
called from JAX as XLA FFI custom calls, for scalar and per-channel (vector) gates.

The forward and backward are rendered from ``templates/ffi_cpu/gated_delta.cc.j2`` with the
chunk size, the padded head dims and the gate kind baked in (per-channel gates: the template
includes ``templates/ffi_cpu/channel.cc.j2``, the algebra of `gdngen.algebra.chunkwise_channel`, in
place of its scalar decay factors and chunk walks; the matmul kernel, triangular solve,
padding and FFI plumbing are shared), compiled with the host C++ compiler
(``$CXX``, else g++ / c++; ``-O3 -march=native``) into a shared library cached under
``<gdngen cache>/ffi_cpu/`` (key: source sha256, compiler version, flags, host CPU, jaxlib
version; written atomically) and registered as XLA FFI targets. Each (batch, value head) is one
task; tasks run on one thread per available core. The chunk's matmuls run in one register-
blocked kernel whose output rows are whole 16-float vectors (every width is padded with zeros).

Why it exists: XLA:CPU runs the chunk algorithm's small [C x 128] @ [128 x 128] dots at 20-90
GFLOP/s here against 230-270 for a square 2048^3 matmul (see docs/NUMERICS.md); the fused
kernel keeps a chunk's operands in cache and runs those products near the square rate.

Variant parameters (`variant_space`):

* ``chunk_size`` 32 | 64 | 128: steps per chunk (per-channel gates: sub-chunks of
  `gdngen.algebra.chunkwise_channel.SUB_CHUNK` steps inside; default 32, as the portable path's).
* ``row_block`` 4 | 6: output rows per register block of the matmul kernel (4 or 6 rows by
  up to 64 columns of float32 accumulators).

A short call (T < ``recurrent_below``; untuned `RECURRENT_BELOW`, per-channel gates
`VECTOR_RECURRENT_BELOW`) evaluates through the recurrent kernel rendered from
``templates/ffi_cpu/recurrent.cc.j2`` into the same library (`recurrent_forward`): one task per
(batch, value head, block of state rows), the rows held in a local buffer over the whole walk,
nothing saved; its VJP is the chunk kernels'.

The forward saves only the state entering each chunk; the backward walks the chunks in reverse,
recomputes each chunk's WY form (per-channel gates: also the decay factors and decayed products)
from it, and forms the gate cotangent in-kernel by the straddle-sum rule of
`gdngen.algebra.chunkwise` (per channel: `gdngen.algebra.chunkwise_channel`'s anchored and chunk
sums), exact at g = 0 for linear gates. Packed rows of per-channel gates run on the portable path
(``packed_gates``).

Layer inputs in the loads (``qk_norm``, a parameterised gate: `gdngen.backends.kernel_inputs`):
a call with either runs fused builds of the recurrent kernel and of the chunk forward
(`render_fused`: the same templates with ``qk_norm`` / ``gate_form`` set, plus
``templates/ffi_cpu/layer_inputs.cc.j2``; each its own library and FFI targets, compiled and
cached like the plain one). They take the raw q, k (each loaded row L2-normalised in float32,
q then scaled) and the raw gate projection ``a`` with ``A_log``, ``dt_bias`` (``[Hv]`` or
``[Hv, Dk]``) and the runtime ``lower_bound``, and form log g per step (the recurrent kernel:
the rows' norm factors and the decays exp(log g) once per call, in a parallel pass over the
steps that every row block of a head shares; the chunk forward: in its loads, before the
chunk's cumulative sums; per-channel gates a row at a time in vectors). The chunk
backward is the plain kernel's, fed the norm and log gate recomputed as array ops inside the
custom VJP (`gdngen.backends.generated.custom_vjp_core` with ``forward_fuses``), which maps
its dq, dk, dlog g through their VJPs. The plain renders do not change with these parts.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import itertools
import os
import platform
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from gdngen import jaxcompat, settings
from gdngen.algebra import chunkwise, chunkwise_channel
from gdngen.backend import Backend
from gdngen.backends import generated
from gdngen.backends.kernel_inputs import QK_NORM_EPS, KernelInputs, kernel_parameters
from gdngen.config import VECTOR_CHUNK, VariantConfig, recurrent_switch
from gdngen.variant import Problem, Variant

BACKEND = "ffi_cpu"
CHUNK_SIZES = (32, 64, 128)
ROW_BLOCKS = (4, 6)
#: columns per register panel of the matmul kernel (row_block x panel float32 accumulators):
#: 64 fills AVX-512's 32 vector registers, 16 AVX2's 16 (a wider panel spills there).
PANELS = (16, 32, 64)
#: floats per vector of the matmul and dot kernels: 16 for AVX-512 registers, 8 for AVX2 (a
#: 16-float vector on an AVX2 host is split in two by the compiler, and spills).
VECTOR_FLOATS = (8, 16)
INPUT_DTYPES = ("float32", "bfloat16", "float16")
TEMPLATE = "ffi_cpu/gated_delta.cc.j2"
SOURCE_NAME = "gated_delta.cc"
PACKED_SOURCE_NAME = "gated_delta_packed.cc"
#: the recurrent (short-call forward) kernel's template and rendered file
RECURRENT_TEMPLATE = "ffi_cpu/recurrent.cc.j2"
RECURRENT_SOURCE_NAME = "recurrent.cc"
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


# ----------------------------------------------------------------------------- variant space


def padded(dim: int) -> int:
    """``dim`` rounded up to whole 16-float vectors."""
    return -(-dim // 16) * 16

#: untuned crossover T (`gdngen.config.recurrent_switch`), measured on this 2-core AVX2 host
#: at B=1, Hk=16, Hv=32, Dk=Dv=128, the forward with a state, on a quiet machine: the recurrent
#: kernel's 0.73 / 1.7 / 4.7 / 9.4 / 20.1 ms at T = 1 / 16 / 64 / 128 / 256 against the chunk
#: kernels' 5.6 / 6.4 / 5.1 / 9.4 / 17.0 ms (equal at 128, slower from 256)
RECURRENT_BELOW = 128

#: default chunk of per-channel gates (the portable path's, `gdngen.config.VECTOR_CHUNK`):
#: measured fwd+bwd at B=1, Hk=4, Hv=8, Dk=Dv=128, T=2048 on the 2-core AVX-512 host (shared,
#: load ~5): chunk 32 / 64 / 128 in 344 / 401 / 627 ms (medians of 5)
VECTOR_CHUNK_SIZE = VECTOR_CHUNK

#: untuned crossover T of per-channel gates: measured forward with a state at B=1, Hk=16,
#: Hv=32, Dk=Dv=128 on the same host (shared, load ~4.5; medians of 11), the per-channel
#: recurrent kernel's 7.9 / 8.0 / 14.5 / 20.0 / 22.4 ms at T = 16 / 24 / 32 / 48 / 64 against
#: the chunk kernels' (chunk 32) 8.2 / 8.2 / 11.9 / 17.9 / 16.4 ms (equal near 24, slower from 32)
VECTOR_RECURRENT_BELOW = 32


def _recurrent_below(problem: Problem) -> int:
    """The untuned ``recurrent_below`` of ``problem``'s gate kind."""
    return VECTOR_RECURRENT_BELOW if problem.gate == "vector" else RECURRENT_BELOW


@dataclass(frozen=True)
class Config(VariantConfig):
    """``chunk_size``: steps per chunk; ``row_block`` / ``panel``: output rows / columns per
    register block of the matmul kernel; ``vector_floats``: floats per vector register."""

    backend = BACKEND
    chunk_size: int = 64
    panel: int = 64
    row_block: int = 6
    vector_floats: int = 16
    recurrent_below: int = recurrent_switch(RECURRENT_BELOW)

    def check(self) -> None:
        self.check_count("recurrent_below")
        self.check_choice("chunk_size", CHUNK_SIZES)
        self.check_choice("panel", PANELS)
        self.check_choice("row_block", ROW_BLOCKS)
        self.check_choice("vector_floats", VECTOR_FLOATS)  # every panel holds whole vectors


@functools.cache
def host_vector_bits() -> int:
    """Widest float vector registers of this host: 512 with AVX-512F, 256 with AVX/AVX2, else
    128 (read from /proc/cpuinfo; 128 where it cannot be read)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "").split()
    except OSError:
        return 128
    return 512 if "avx512f" in flags else 256 if "avx" in flags else 128


def kernel_params(variant: Variant, problem: Problem) -> dict:
    """``{"chunk_size", "row_block"}`` of ``variant`` for ``problem``; ValueError for a variant
    of another backend, unknown or missing parameters, bad values, or a problem the backend
    does not implement."""
    config = SPEC.parse(variant)
    SPEC.check(problem)
    return config.params()


def variant_space(problem: Problem, device=None) -> list[Config]:
    """Every chunk size, panel and row block at this host's vector width (`host_vector_floats`;
    no on-chip limit to prune with), at the gate kind's untuned ``recurrent_below``."""
    SPEC.check(problem)
    width = host_vector_floats()
    below = _recurrent_below(problem)
    return [Config(c, p, r, width, recurrent_below=below) for c, p, r in
            itertools.product(CHUNK_SIZES, PANELS, ROW_BLOCKS)]


def default_config(problem: Problem, device=None) -> Config:
    """Chunk 64 (per-channel gates: `VECTOR_CHUNK_SIZE`), row block 6, at this host's vector
    width, with the panel its registers hold: 64 columns of 16-float vectors with AVX-512 (24
    of 32 registers), else 16 columns (12 of AVX2's 16 registers); ``recurrent_below``
    `RECURRENT_BELOW` (per-channel gates: `VECTOR_RECURRENT_BELOW`)."""
    width = host_vector_floats()
    chunk = VECTOR_CHUNK_SIZE if problem.gate == "vector" else 64
    return Config(chunk, 64 if width == 16 else 16, 6, width,
                  recurrent_below=_recurrent_below(problem))


def host_vector_floats() -> int:
    """The `VECTOR_FLOATS` entry of this host: 16 with AVX-512, else 8."""
    return 16 if host_vector_bits() >= 512 else 8


def render_plan(variant: Variant, problem: Problem) -> dict:
    """``{"gated_delta.cc": (template, context), "recurrent.cc": (template, context)}`` for
    `gdngen.render`: the chunk kernels and the recurrent kernel (per-channel gates when
    ``problem.gate`` is "vector"; the scalar renders do not depend on the per-channel parts).
    ``recurrent_below`` renders into neither. Both compute no layer inputs in their loads
    (`KernelInputs` off: `render_fused` renders the fused builds)."""
    p = kernel_params(variant, problem)
    per_channel = problem.gate == "vector"
    dims = {"dk": problem.Dk, "dv": problem.Dv, "dk_pad": padded(problem.Dk),
            "dv_pad": padded(problem.Dv), "vector_floats": p["vector_floats"], "symbol": SYMBOL,
            "per_channel": per_channel, **KernelInputs().context()}
    context = {"chunk": p["chunk_size"], "row_block": p["row_block"], "panel": p["panel"],
               "packed": False,
               "sub_chunk": chunkwise_channel.sub_chunk_size(p["chunk_size"]), **dims}
    recurrent = {"row_tile": RECURRENT_ROW_TILE, "steps": False, **dims}
    return {SOURCE_NAME: (TEMPLATE, context),
            RECURRENT_SOURCE_NAME: (RECURRENT_TEMPLATE, recurrent)}


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
    rendered sources, ``params`` (`kernel_params`), ``library`` (its path)."""

    def __init__(self, variant: Variant, problem: Problem, sha256: str, library: Path,
                 kinds=("forward", "backward", "recurrent")):
        self.variant, self.problem, self.sha256, self.library = variant, problem, sha256, library
        self.params = kernel_params(variant, problem)
        self._handle = ctypes.CDLL(str(library))  # kept alive with the registered targets
        for kind in kinds:
            target = f"gdngen_ffi_cpu_{sha256[:16]}_{kind}"
            setattr(self, f"target_{kind}", target)
            jaxcompat.ffi().register_ffi_target(
                target, jaxcompat.ffi().pycapsule(getattr(self._handle, f"{SYMBOL}_{kind}")),
                platform="cpu")


_LOADED: dict[str, Kernels] = {}


def load_kernels(variant: Variant, problem: Problem, *, templates_dir=None) -> Kernels:
    """Render ``variant`` for ``problem``, compile it unless cached, load and register it."""
    return _load(SPEC.render(variant, problem, templates_dir=templates_dir))


def _load(rendered, kinds=("forward", "backward", "recurrent")) -> Kernels:
    if rendered.sha256 not in _LOADED:
        path = library_path(rendered.sha256)
        if not path.exists():
            compile_library(rendered.sources, path)
        _LOADED[rendered.sha256] = Kernels(rendered.variant, rendered.problem, rendered.sha256,
                                           path, kinds)
    return _LOADED[rendered.sha256]


def render_packed(variant: Variant, problem: Problem, *, templates_dir=None):
    """The packed-row chunk kernels of ``variant`` (`gdngen.algebra.packed`): the chunk template
    with
    ``packed`` set: the forward also takes the injected states ``[B, Hv, n_seq, Dv, Dk]`` (or
    empty), ``inject_at`` int32 ``[N]`` (the sequence whose state is added to the state leaving
    each chunk, -1 none) and each sequence's last step, and returns the state after it; the
    backward takes that state's cotangent and returns the injected states'. With ``packed``
    unset the template renders the dense kernels byte for byte,
    so the dense variant's sha256 (and tuned entries) do not depend on it."""
    from gdngen.sources import Rendered, environment, sources_sha256

    SPEC.parse(variant)
    if problem.gate == "vector":
        raise ValueError(f"{BACKEND}: packed rows of per-channel gates run on the portable path")
    template, context = render_plan(variant, problem)[SOURCE_NAME]
    texts = {PACKED_SOURCE_NAME: environment(templates_dir).get_template(template).render(
        **dict(context, packed=True))}
    return Rendered(variant, problem, texts, sources_sha256(texts))


#: the rendered file of the per-step-states build of the recurrent kernel (`render_steps`)
STEPS_SOURCE_NAME = "recurrent_steps.cc"


def render_steps(variant: Variant, problem: Problem, *, templates_dir=None):
    """The recurrent kernel of ``variant`` that returns the state after every step
    (``return_states="steps"``): the recurrent template with ``steps`` set, its second result
    ``[B, T, Hv, Dv, Dk]`` in place of the final state, each task writing its rows of step t's
    state as it walks. With ``steps`` unset the template renders the recurrent kernel byte for
    byte, so the variant's sha256 (and tuned entries) do not depend on it."""
    from gdngen.sources import Rendered, environment, sources_sha256

    SPEC.parse(variant)
    template, context = render_plan(variant, problem)[RECURRENT_SOURCE_NAME]
    texts = {STEPS_SOURCE_NAME: environment(templates_dir).get_template(template).render(
        **dict(context, steps=True))}
    return Rendered(variant, problem, texts, sources_sha256(texts))


def load_steps_kernels(variant: Variant, problem: Problem, *, templates_dir=None) -> Kernels:
    """`render_steps`, compiled unless cached, loaded and registered (``target_recurrent``)."""
    return _load(render_steps(variant, problem, templates_dir=templates_dir), ("recurrent",))


#: which kernels of a fused build (`render_fused`) each of its sources holds
FUSED_KINDS = {RECURRENT_SOURCE_NAME: ("recurrent",), SOURCE_NAME: ("forward",)}


def render_fused(variant: Variant, problem: Problem, inputs: KernelInputs,
                 source: str = RECURRENT_SOURCE_NAME, *, templates_dir=None):
    """The build of ``variant``'s ``source`` (`RECURRENT_SOURCE_NAME`: the recurrent kernel;
    `SOURCE_NAME`: the chunk forward alone, no backward) that computes ``inputs``
    (`gdngen.backends.kernel_inputs.KernelInputs`, ``inputs.fused``) in its loads: its
    template rendered with ``inputs.context()`` (and the norm's eps) into the file
    ``<stem><inputs.tag()>.cc`` (a `gdngen.sources.Rendered` of its own sha256, so of its own
    library and FFI targets; `load_fused_kernels`).

    Its kernel takes q, k raw when ``inputs.qk_norm`` (each loaded row L2-normalised in float32,
    q then scaled) and, with ``inputs.gate_form``, the raw gate projection ``a`` where the
    decay (recurrent) or log gate (chunk forward) was, plus ``A_log``, ``dt_bias`` float32
    ``[Hv]`` (``[Hv, Dk]`` per channel) after S0 and a ``lower_bound`` float attribute; it forms
    the log gate per step (`gdngen.backends.kernel_inputs`), then decay = exp(log g). The
    plain renders (`render_plan`) do not depend on these parts."""
    from gdngen.sources import Rendered, environment, sources_sha256

    SPEC.parse(variant)
    if not inputs.fused:
        raise ValueError(f"inputs must fuse a qk norm or a gate, got {inputs!r}")
    if source not in FUSED_KINDS:
        raise ValueError(f"source must be one of {tuple(FUSED_KINDS)}, got {source!r}")
    template, context = render_plan(variant, problem)[source]
    context = dict(context, **inputs.context(), qk_norm_eps=repr(QK_NORM_EPS))
    name = f"{source.removesuffix('.cc')}{inputs.tag()}.cc"
    texts = {name: environment(templates_dir).get_template(template).render(**context)}
    return Rendered(variant, problem, texts, sources_sha256(texts))


def load_fused_kernels(variant: Variant, problem: Problem, inputs: KernelInputs,
                       source: str = RECURRENT_SOURCE_NAME, *, templates_dir=None) -> Kernels:
    """`render_fused`, compiled unless cached, loaded and registered: ``target_recurrent``
    (`RECURRENT_SOURCE_NAME`) or ``target_forward`` (`SOURCE_NAME`)."""
    return _load(render_fused(variant, problem, inputs, source, templates_dir=templates_dir),
                 FUSED_KINDS[source])


def load_packed_kernels(variant: Variant, problem: Problem, *, templates_dir=None) -> Kernels:
    """`render_packed`, compiled unless cached, loaded and registered (forward, backward)."""
    return _load(render_packed(variant, problem, templates_dir=templates_dir),
                 ("forward", "backward"))


def lower_check(variant: Variant, problem: Problem) -> dict:
    """Render and compile ``variant`` for ``problem`` (raises on a compile error)."""
    kernels = load_kernels(variant, problem)
    return {"library": str(kernels.library)}


def threads() -> int:
    """Worker threads per call: the cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


# ----------------------------------------------------------------------------- calling


def head_splits(B: int, Hk: int, group: int, workers: int) -> int:
    """Into how many tasks the kernels split each key head's ``group`` value heads: the fewest
    (a divisor of ``group``) that still give every worker a task. A task shares its key head's
    per-chunk work (K K^T, Q K^T) among its heads and sums their dq / dk terms into its own
    partial slot, which the caller adds up."""
    return next(p for p in range(1, group + 1) if group % p == 0 and (B * Hk * p >= workers
                                                                        or p == group))


def _call_context(sha256: str, gate: str, scale: float, poison: bool):
    """What every FFI call of the loaded kernels ``sha256`` shares: ``(kernels, workers,
    attrs, f32(shape, like) -> result type, log_gates(g) -> log g)``."""
    import jax.numpy as jnp
    import numpy as np

    workers = threads()

    def f32(shape, like):
        return generated.result_type(shape, jnp.float32, like)

    def log_gates(g):
        return g if gate == "log" else jnp.log(g)

    return (_LOADED[sha256], workers,
            {"scale": np.float32(scale), "threads": np.int64(workers), "poison": poison},
            f32, log_gates)


@functools.cache
def _core(sha256: str, gate, scale: float, poison: bool, qk_norm: bool = False,
          forward_sha256: str | None = None):
    """``core(q, k, v, gates, beta, S0) -> (y, S_final)`` on float32 arrays in the API layout
    (gates ``[B,T,Hv]`` or, on per-channel kernels, ``[B,T,Hv,Dk]``, in their own convention,
    already masked; for a `gdngen.algebra.chunkwise.ParameterGate` ``(a, A_log, dt_bias)``), with
    the generated backward as its ``jax.custom_vjp`` (`gdngen.backends.generated.custom_vjp_core`).

    ``forward_sha256`` None: the core normalises q, k (``qk_norm``) and computes the log gate
    as array ops before the forward kernel. Otherwise the loaded fused chunk forward of that
    sha256 (`render_fused` with `SOURCE_NAME`, for ``KernelInputs.of(qk_norm, gate)``) takes
    the raw q, k and ``a`` with A_log, dt_bias (`kernel_parameters`) and computes both in its
    loads (``forward_fuses``); the backward kernel of ``sha256`` still gets them recomputed
    as arrays, and the core maps its dq, dk, dlog g through their VJPs."""
    import jax.numpy as jnp
    import numpy as np

    parameter_gate, gate = gate, chunkwise.convention(gate)
    kernels, workers, attrs, f32, log_gates = _call_context(sha256, gate, scale, poison)
    C = kernels.params["chunk_size"]
    inputs = KernelInputs.of(qk_norm, parameter_gate)
    fuses = forward_sha256 is not None
    if fuses and not inputs.fused:
        raise ValueError("forward_sha256 needs qk_norm or a ParameterGate to fuse")
    forward_kernels = _LOADED[forward_sha256] if fuses else kernels

    def forward(primals):
        q, k, v, g, beta, S0 = primals
        B, T, Hk, Dk = q.shape
        Hv, Dv = v.shape[2], v.shape[3]
        if fuses and inputs.gate_form:  # the kernel forms log g from a, A_log, dt_bias
            a, A_log, dt_bias = g
            gate_operands = (a, beta, S0, *kernel_parameters(
                jnp, A_log, dt_bias, Hv, Dk, kernels.problem.gate == "vector"))
            extra = {"lower_bound": np.float32(inputs.lower_bound)}
        else:
            gate_operands, extra = (log_gates(g), beta, S0), {}
        y, s_final, states = jaxcompat.ffi().ffi_call(forward_kernels.target_forward, (
            f32((B, T, Hv, Dv), q), f32((B, Hv, Dv, Dk), q),
            f32((B, Hv, -(-T // C), padded(Dk), padded(Dv)), q)),
            vmap_method="sequential")(q, k, v, *gate_operands, **attrs, **extra,
                                      splits=np.int64(head_splits(B, Hk, Hv // Hk, workers)))
        return (y, s_final), states

    def backward(primals, states, cotangents):
        q, k, v, g, beta, _ = primals
        dy, dS_final = cotangents
        B, T, Hk, Dk = q.shape
        Hv, Dv = v.shape[2], v.shape[3]
        P = head_splits(B, Hk, Hv // Hk, workers)
        dq, dk, dv, dbeta, dg, dS0 = jaxcompat.ffi().ffi_call(kernels.target_backward, (
            f32((B, T, Hk * P, Dk), q), f32((B, T, Hk * P, Dk), q), f32((B, T, Hv, Dv), q),
            f32((B, T, Hv), q), f32(g.shape, q), f32((B, Hv, Dv, Dk), q)),
            vmap_method="sequential")(q, k, v, log_gates(g), beta, states,
                                      dy.astype(jnp.float32), dS_final.astype(jnp.float32),
                                      linear=gate == "linear", splits=np.int64(P), **attrs)
        if P > 1:
            dq, dk = (x.reshape(B, T, Hk, P, Dk).sum(3) for x in (dq, dk))
        return dq, dk, dv, dg, dbeta, dS0

    return generated.custom_vjp_core(forward, backward, qk_norm, parameter_gate,
                                     forward_fuses=fuses)


@functools.cache
def _packed_walk(sha256: str, gate: str, scale: float, poison: bool):
    """``walk(q, k, v, g, beta, inject, last) -> (y, None, S_end)`` of
    `gdngen.algebra.packed.gated_delta` on the packed kernels ``sha256`` (B = 1, API layout,
    float32;
    ``inject`` None or ``(states [n_seq, Hv, Dv, Dk], at [N] int32)``, the state injected at
    each chunk's end (`gdngen.algebra.packed.gated_delta`); ``last`` int32 ``[n_seq]`` each
    sequence's last step, -1 for an empty one; ``S_end [n_seq, Hv, Dv, Dk]`` the state after it, not
    written for an empty one): a ``jax.custom_vjp`` per presence of ``inject`` whose backward is
    the packed backward kernel."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    kernels, workers, attrs, f32, log_gates = _call_context(sha256, gate, scale, poison)

    def per_head(x):  # [N, Hv, Dv, Dk] <-> the kernels' [1, Hv, N, Dv, Dk]
        return x.swapaxes(0, 1)[None]

    def forward(q, k, v, g, beta, inject, last):
        _, T, Hk, Dk = q.shape
        Hv, Dv = v.shape[2], v.shape[3]
        N, n_seq = -(-T // kernels.params["chunk_size"]), last.shape[0]
        y, _, states, ends = jaxcompat.ffi().ffi_call(kernels.target_forward, (
            f32((1, T, Hv, Dv), q), f32((1, Hv, Dv, Dk), q),
            f32((1, Hv, N, padded(Dk), padded(Dv)), q), f32((1, Hv, n_seq, Dv, Dk), q)),
            vmap_method="sequential")(
                q, k, v, log_gates(g), beta, jnp.zeros((1, Hv, Dv, Dk), jnp.float32),
                jnp.zeros((0,), jnp.float32) if inject is None else per_head(inject[0]),
                jnp.full((N,), -1, jnp.int32) if inject is None else inject[1], last,
                **attrs,
                splits=np.int64(head_splits(1, Hk, Hv // Hk, workers)))
        return (y, ends[0].swapaxes(0, 1)), states

    def backward(primals, states, cotangents, inject_at):
        q, k, v, g, beta, last = primals
        dy, dS_end = cotangents
        _, T, Hk, Dk = q.shape
        Hv, Dv = v.shape[2], v.shape[3]
        P = head_splits(1, Hk, Hv // Hk, workers)
        N, n_seq = states.shape[2], last.shape[0]
        injects = inject_at is not None
        inject_shape = (1, Hv, n_seq, Dv, Dk) if injects else (0,)
        dq, dk, dv, dbeta, dg, _, dinject = jaxcompat.ffi().ffi_call(kernels.target_backward, (
            f32((1, T, Hk * P, Dk), q), f32((1, T, Hk * P, Dk), q), f32((1, T, Hv, Dv), q),
            f32((1, T, Hv), q), f32((1, T, Hv), q), f32((1, Hv, Dv, Dk), q),
            f32(inject_shape, q)), vmap_method="sequential")(
                q, k, v, log_gates(g), beta, states, dy.astype(jnp.float32),
                jnp.zeros((1, Hv, Dv, Dk), jnp.float32),
                inject_at if injects else jnp.full((N,), -1, jnp.int32), last,
                per_head(dS_end.astype(jnp.float32)), linear=gate == "linear",
                splits=np.int64(P), **attrs)
        if P > 1:
            dq, dk = (x.reshape(1, T, Hk, P, Dk).sum(3) for x in (dq, dk))
        return (dq, dk, dv, dg, dbeta), dinject

    @jax.custom_vjp
    def injected(q, k, v, g, beta, states, at, last):
        return forward(q, k, v, g, beta, (states, at), last)[0]

    def injected_fwd(q, k, v, g, beta, states, at, last):
        outputs, chunk_states = forward(q, k, v, g, beta, (states, at), last)
        return outputs, ((q, k, v, g, beta, last), chunk_states, at)

    def injected_bwd(saved, cotangents):
        primals, chunk_states, at = saved
        grads, dinject = backward(primals, chunk_states, cotangents, at)
        return (*grads, dinject[0].swapaxes(0, 1), None, None)

    injected.defvjp(injected_fwd, injected_bwd)

    @jax.custom_vjp
    def plain(q, k, v, g, beta, last):
        return forward(q, k, v, g, beta, None, last)[0]

    def plain_fwd(q, k, v, g, beta, last):
        outputs, states = forward(q, k, v, g, beta, None, last)
        return outputs, ((q, k, v, g, beta, last), states)

    def plain_bwd(saved, cotangents):
        return (*backward(*saved, cotangents, None)[0], None)

    plain.defvjp(plain_fwd, plain_bwd)

    def walk(q, k, v, g, beta, inject, last):
        if inject is None:
            y, S_end = plain(q, k, v, g, beta, last)
        else:
            y, S_end = injected(q, k, v, g, beta, *inject, last)
        return y, None, S_end

    return walk


def packed_gated_delta(q, k, v, g, beta, initial_state=None, *, mask=None, scale=1.0,
                       gate="log", variant, cu_seqlens, templates_dir=None):
    """A packed row (`gdngen.algebra.packed`) on ``variant``'s kernels, scalar gates: the row's
    chunk walk on its packed kernels (`render_packed`), each sequence's one-chunk calls on its dense
    chunk kernels. Arguments as `gdngen.jax.gated_delta` with ``cu_seqlens``; float32
    throughout; returns ``(y in q's dtype, final_state [N, Hv, Dv, Dk])``."""
    from gdngen import call as calls

    checked, operands = calls.of_kernel_args("jax", q, k, v, g, beta, initial_state, mask,
                                             scale=scale, gate=gate, cu_seqlens=cu_seqlens)
    return SPEC.run_packed_kernels(checked, operands, variant, templates_dir=templates_dir)


def _packed(call, operands, variant, templates_dir=None):
    """`packed_gated_delta`'s body on a checked packed `gdngen.call.Call`."""
    import jax.numpy as jnp

    from gdngen.algebra import packed
    from gdngen.backends.portable import jax_chunkwise

    gate, scale = call.gate, call.scale
    problem = call.problem
    kernels = load_kernels(variant, problem, templates_dir=templates_dir)
    walk_kernels = load_packed_kernels(variant, problem, templates_dir=templates_dir)
    poison = settings.flag(ENV_POISON)
    core = _core(kernels.sha256, gate, scale, poison)
    XP = jax_chunkwise.XP

    def dense(q, k, v, g, beta, S0, mask):
        g, beta = chunkwise.fold_mask(XP, g, beta, mask, gate)
        y, S = core(q, k, v, g, beta, S0)
        return jnp.where(mask[..., None, None], y, 0.0), S

    f32 = jnp.float32
    q, k, v, g, beta, initial_state, mask, _, _, cu_seqlens = operands
    y, state = packed.gated_delta(
        XP, dense, _packed_walk(walk_kernels.sha256, gate, scale, poison),
        *(x.astype(f32) for x in (q, k, v, g, beta)),
        None if initial_state is None else initial_state.astype(f32), mask, cu_seqlens,
        gate=gate, chunk_size=kernels.params["chunk_size"])
    return y.astype(q.dtype), state


def recurrent_rows(B: int, Hv: int, Dv: int, workers: int) -> int:
    """State rows per task of the recurrent kernel: at most `RECURRENT_MAX_ROWS` (a block stays
    in L1 over the walk), a multiple of `RECURRENT_ROW_TILE`, halved while the ``B * Hv`` heads'
    blocks leave a worker without a task (down to one tile)."""
    tile = RECURRENT_ROW_TILE
    rows = min(-(-Dv // tile) * tile, RECURRENT_MAX_ROWS)
    while rows > tile and B * Hv * -(-Dv // rows) < workers:
        rows = max(tile, -(-(rows // 2) // tile) * tile)
    return rows


#: nothing computed in the loads (the plain kernels)
PLAIN_INPUTS = KernelInputs()


@functools.cache
def _recurrent(sha256: str, scale: float, poison: bool, inputs: KernelInputs = PLAIN_INPUTS,
               steps: bool = False):
    """``call(q, k, v, decay, beta, S0, *parameters) -> (y, S_T)`` running the loaded recurrent
    kernel of ``sha256`` (float32, API layout; ``steps``: a `render_steps` build, every step's
    state ``[B, T, Hv, Dv, Dk]`` in place of S_T): the plain one (``inputs`` off) takes the linear
    decay; a fused one (`render_fused` for ``inputs``) the raw q, k when ``inputs.qk_norm`` and,
    with ``inputs.gate_form``, the raw projection ``a`` as ``decay`` and ``parameters`` =
    ``(A_log, dt_bias)`` as `kernel_parameters` gives them (``lower_bound`` from ``inputs``)."""
    import jax.numpy as jnp
    import numpy as np

    kernels = _LOADED[sha256]
    workers = threads()
    extra = {"lower_bound": np.float32(inputs.lower_bound)} if inputs.gate_form else {}
    n_parameters = 2 if inputs.gate_form else 0

    def call(q, k, v, decay, beta, S0, *parameters):
        if len(parameters) != n_parameters:
            raise ValueError(f"the recurrent kernel of {inputs!r} takes {n_parameters} gate "
                             f"parameters (A_log, dt_bias), got {len(parameters)}")
        B, T, _, Dk = q.shape
        Hv, Dv = v.shape[2], v.shape[3]
        states = (B, T, Hv, Dv, Dk) if steps else (B, Hv, Dv, Dk)
        return jaxcompat.ffi().ffi_call(kernels.target_recurrent, (
            generated.result_type((B, T, Hv, Dv), jnp.float32, q),
            generated.result_type(states, jnp.float32, q)),
            vmap_method="sequential")(q, k, v, decay, beta, S0, *parameters,
                                      scale=np.float32(scale), threads=np.int64(workers),
                                      poison=poison, **extra,
                                      rows=np.int64(recurrent_rows(B, Hv, Dv, workers)))

    return call


def recurrent_forward(q, k, v, decay, beta, S0, *, scale, variant, problem=None,
                      templates_dir=None, inputs: KernelInputs | None = None, A_log=None,
                      dt_bias=None):
    """Forward of the gated delta rule one step at a time through the recurrent kernel of
    ``variant`` (rendered from ``templates/ffi_cpu/recurrent.cc.j2``; compiled, cached and
    loaded with the chunk kernels of the same rendering, see `load_kernels`).

    Contract: float32 arrays, q, k ``[B,T,Hk,Dk]``; v ``[B,T,Hv,Dv]``; ``decay`` the LINEAR
    decay in [0, 1], ``[B,T,Hv]`` (scalar gate) or ``[B,T,Hv,Dk]`` (per-channel gate; the
    problem's gate must then be "vector"); beta ``[B,T,Hv]``; S0 ``[B,Hv,Dv,Dk]``; any T >= 1,
    Hv a multiple of Hk (value head h reads key head h // (Hv / Hk)), any Dk, Dv (padded to
    whole 16-float vectors inside). Masked steps must already be folded (decay 1, beta 0).
    Returns ``(y [B,T,Hv,Dv], S_T [B,Hv,Dv,Dk])``, float32. Per step, with q scaled by
    ``scale``: ``u = beta (v - S (a k))``, ``S' = S diag(a) + u k^T``, ``y = S (a q) + u (k.q)``
    (`gdngen.algebra.chunkwise.recurrent_forward`). Each task is a block of state rows
    (`recurrent_rows`) of one (batch, value head), held in a local buffer for the whole walk;
    the tasks run on `threads` threads. Nothing is saved for a backward and it has no VJP of
    its own (`gated_delta` pairs it with the chunk path's). With ``GDNGEN_POISON_OUTPUTS=1``
    both outputs are NaN-filled before the kernel writes them. ``problem`` defaults to the one
    of the arrays' shapes (gate kind from ``decay``'s rank). jit-able; ``jax.vmap`` runs it
    once per mapped element.

    ``inputs`` (`gdngen.backends.kernel_inputs.KernelInputs`, fusing something): the kernel
    computes them in its loads (`render_fused`): with ``inputs.qk_norm`` q, k are raw (each row
    L2-normalised in float32, q then scaled); with ``inputs.gate_form`` ``decay`` is the raw
    gate projection ``a`` (same shape; a = -inf an identity step) and ``A_log``, ``dt_bias``
    (``[Hv]``; per-channel also ``[Hv, 1]`` / ``[Hv, Dk]``) are required: the step's decay is
    exp(log g) of that gate (``inputs.lower_bound`` for "sigmoid_bound")."""
    import jax.numpy as jnp

    if problem is None:
        problem = Problem(q.shape[2], v.shape[2], q.shape[3], v.shape[3], "float32",
                          "vector" if decay.ndim == 4 else "scalar")
    poison = settings.flag(ENV_POISON)
    gate_form = None if inputs is None else inputs.gate_form
    if gate_form is None and (A_log is not None or dt_bias is not None):
        raise ValueError("A_log and dt_bias are taken only with inputs fusing a gate")
    if inputs is None or not inputs.fused:
        kernels = load_kernels(variant, problem, templates_dir=templates_dir)
        return _recurrent(kernels.sha256, float(scale), poison)(q, k, v, decay, beta, S0)
    parameters = ()
    if gate_form:
        if A_log is None or dt_bias is None:
            raise ValueError(f"A_log and dt_bias are required with gate_form={gate_form!r}")
        parameters = kernel_parameters(jnp, jnp.asarray(A_log), jnp.asarray(dt_bias),
                                       problem.Hv, problem.Dk, problem.gate == "vector")
    kernels = load_fused_kernels(variant, problem, inputs, templates_dir=templates_dir)
    return _recurrent(kernels.sha256, float(scale), poison, inputs)(
        q, k, v, decay, beta, S0, *parameters)


def gated_delta(q, k, v, g, beta, initial_state=None, *, mask=None, scale=1.0, gate="log",
                variant, templates_dir=None, qk_norm=False):
    """Gated delta rule with the generated C++ kernels of ``variant``; returns ``(y,
    final_state)``. Arguments as `gdngen.jax.gated_delta`; computes in float32 whatever the
    input dtype. Differentiable (custom VJP) and jit-able.

    Scalar and per-channel (vector) gates alike: a call with T < the variant's
    ``recurrent_below`` evaluates through the recurrent kernel (`recurrent_forward`), and its
    VJP is the chunk kernels' (the forward then runs the chunk kernels:
    `gdngen.backends.portable.jax_chunkwise.recurrent_or_chunkwise`); longer calls run the chunk
    kernels (per-channel gates: the kernels rendered from ``templates/ffi_cpu/channel.cc.j2``).

    ``qk_norm`` and a `gdngen.algebra.chunkwise.ParameterGate` ``gate`` (``g`` then ``(a, A_log,
    dt_bias)``): the kernels compute them in their own loads (`render_fused` builds per
    `gdngen.backends.kernel_inputs.KernelInputs`). A short call's recurrent kernel takes the
    raw q, k and ``a`` with A_log, dt_bias (no normalised q, k, log gate or decay array); the
    chunk forward kernel likewise, forming the log gate before its in-chunk cumulative sums.
    The chunk backward kernel gets them recomputed as array ops inside the custom VJP, which
    keeps only the raw arrays (`gdngen.backends.generated.custom_vjp_core`, ``forward_fuses``:
    the kernels save only the chunk states) and maps dq, dk, dlog g through the norm's and the
    gate's VJPs."""
    from gdngen import call as calls

    checked, operands = calls.of_kernel_args("jax", q, k, v, g, beta, initial_state, mask,
                                             scale=scale, gate=gate, qk_norm=qk_norm)
    return SPEC.run(checked, operands, variant, templates_dir=templates_dir)


def _forward(call, operands, variant, templates_dir=None):
    """`gated_delta`'s body on a checked dense `gdngen.call.Call`."""
    import jax.numpy as jnp

    from gdngen.backends.portable import jax_chunkwise

    shape, problem, gate, scale = call.shape, call.problem, call.kernel_gate, call.scale
    q, k, v, g, beta, initial_state, mask = operands[:7]
    kernels = load_kernels(variant, problem, templates_dir=templates_dir)
    f32 = jnp.float32
    if initial_state is None:
        initial_state = jnp.zeros((shape.B, shape.Hv, shape.Dv, shape.Dk), f32)
    # a masked step is an identity step; its output is zeroed below
    g, beta = chunkwise.fold_mask(jax_chunkwise.XP,
                                  chunkwise.cast_gates(operands.kernel_gates(), f32),
                                  beta.astype(f32), mask, gate)
    poison = settings.flag(ENV_POISON)
    args = (q.astype(f32), k.astype(f32), v.astype(f32), g, beta, initial_state.astype(f32))

    inputs = KernelInputs.of(call.qk_norm, gate)
    forward_sha256 = (load_fused_kernels(variant, problem, inputs, SOURCE_NAME,
                                         templates_dir=templates_dir).sha256
                      if inputs.fused else None)
    chunkwise_call = _core(kernels.sha256, gate, scale, poison, call.qk_norm, forward_sha256)
    if not SPEC.chunked(call, variant):
        fused = (load_fused_kernels(variant, problem, inputs, templates_dir=templates_dir)
                 if inputs.fused else kernels)
        run = _recurrent(fused.sha256, scale, poison, inputs)

        def recurrent(q, k, v, g, beta, S0):
            if inputs.gate_form:  # the kernel forms the decay from a, A_log, dt_bias
                a, A_log, dt_bias = g
                return run(q, k, v, a, beta, S0, *kernel_parameters(
                    jnp, A_log, dt_bias, shape.Hv, shape.Dk, shape.vector_gate))
            # raw q, k when the kernel normalises them (inputs.qk_norm)
            return run(q, k, v, chunkwise.linear_decay(jax_chunkwise.XP, g, gate), beta, S0)

        y, state = jax_chunkwise.recurrent_or_chunkwise(recurrent, chunkwise_call)(*args)
    else:
        y, state = chunkwise_call(*args)
    if mask is not None:
        y = jnp.where(mask[..., None, None], y, 0.0)
    return y.astype(q.dtype), state


def _steps(call, operands, variant, templates_dir=None):
    """A ``return_states="steps"`` call (layer inputs computed) on the `render_steps`
    recurrent kernel (`gdngen.backends.generated.kernel_steps`)."""
    kernels = load_steps_kernels(variant, call.problem, templates_dir=templates_dir)
    run = _recurrent(kernels.sha256, call.scale, settings.flag(ENV_POISON), steps=True)
    return generated.kernel_steps(call, operands, run)


def _chunks(call, operands, variant, templates_dir=None):
    """A ``return_states="chunks"`` call (layer inputs computed; scalar or per-channel gates)
    on the chunk forward kernel of ``variant``: the checkpoints are the states its walk writes
    entering each chunk (its ``ST per chunk`` result, the backward's residual), read, not
    recomputed (`gdngen.backends.generated.kernel_chunks`)."""
    import jax.numpy as jnp
    import numpy as np

    kernels = load_kernels(variant, call.problem, templates_dir=templates_dir)
    _, workers, attrs, f32, _ = _call_context(kernels.sha256, "log", call.scale,
                                              settings.flag(ENV_POISON))
    C = kernels.params["chunk_size"]

    def chunk_forward(q, k, v, log_g, beta, S0):
        B, T, Hk, Dk = q.shape
        Hv, Dv = v.shape[2], v.shape[3]
        y, final, entering = jaxcompat.ffi().ffi_call(kernels.target_forward, (
            f32((B, T, Hv, Dv), q), f32((B, Hv, Dv, Dk), q),
            f32((B, Hv, -(-T // C), padded(Dk), padded(Dv)), q)),
            vmap_method="sequential")(q, k, v, log_g, beta, S0, **attrs,
                                      splits=np.int64(head_splits(B, Hk, Hv // Hk, workers)))
        # [B, Hv, N, DK, DV] transposed and padded -> [B, N, Hv, Dv, Dk]
        entering = jnp.swapaxes(entering[..., :Dk, :Dv], -1, -2)
        return y, final, jnp.swapaxes(entering, 1, 2)

    return generated.kernel_chunks(call, operands, C, chunk_forward)


#: relative L2 error per precision policy: the kernels compute in float32 under every policy
#: (worst measured 9.7e-7, dbeta / identical_keys; per-channel gates 1.4e-6, dbeta /
#: vector_identical_keys at chunk 128, tests/backends/ffi_cpu/test_ffi_cpu_channel.py).
TOLERANCES = {"ieee": 5e-5, "tf32": 5e-5, "bf16": 5e-5}

class FfiCpu(Backend):
    """The generated C++ kernels of `gdngen.backends.ffi_cpu` (JAX FFI, CPU hosts)."""

    name, framework, config = BACKEND, "jax", Config
    tolerances, device_kinds, dtypes = TOLERANCES, ("cpu",), INPUT_DTYPES
    gates = tuned_gates = ("scalar", "vector")
    fused_inputs, packed_gates = ("qk_norm", "gate"), ("scalar",)
    step_states = chunk_states = ("scalar", "vector")
    render_plan, lower_check = staticmethod(render_plan), staticmethod(lower_check)

    def space(self, problem, device=None):
        return variant_space(problem, device)

    def default(self, problem, device=None):
        return default_config(problem, device)

    def available(self) -> bool:
        return available()

    def forward(self, call, operands, variant, templates_dir=None):
        return _forward(call, operands, variant, templates_dir)

    def packed(self, call, operands, variant, templates_dir=None):
        return _packed(call, operands, variant, templates_dir)

    def steps(self, call, operands, variant, templates_dir=None):
        return _steps(call, operands, variant, templates_dir)

    def chunks(self, call, operands, variant, templates_dir=None):
        return _chunks(call, operands, variant, templates_dir)


SPEC = FfiCpu()
