"""Pallas GPU backend: generated Triton-lowered kernels for the chunkwise gated delta rule
(scalar gates; for per-channel gates its chunk walks) and a recurrent forward kernel for short
calls (scalar and per-channel gates), for NVIDIA GPUs (a100, h100, h200 in `gdngen.devices`).

The kernels are rendered from ``templates/pallas_gpu/`` (forward and backward module, every
variant parameter baked in as a constant) and wired into ``jax.custom_vjp``. On a GPU they are
lowered through ``jax.experimental.pallas.triton``; elsewhere they run in Pallas interpret mode
(outputs start as NaN, so anything a kernel fails to write poisons the result), with a warning
once per process. ``GDNGEN_INTERPRET=1`` forces interpret mode (``gdngen tune --dry-run``).

Kernel plan (the template docstrings have the algebra): the O(C^2)/O(C^3) chunk work runs
chunk-parallel (grid batch * value head x chunk); only the state recurrence walks the chunks in
order, one program per (batch * value head, BV columns of the state), the state in registers.
Calls with T < ``recurrent_below`` evaluate through the recurrent kernel (``recurrent.py``: grid
batch x value head x BV rows of the state, every step in order, the state in registers, nothing
saved); their VJP is the chunk path's.

Per-channel (vector) gates: the same forward and backward templates rendered with
``per_channel`` set are the two chunk walks of `gdngen.algebra.chunkwise_channel` (`chunk_walks`:
the forward walk and the reverse state-cotangent walk carry the state, its cotangent, in registers
over the chunks; a chunk-parallel kernel forms the backward's sums over Dv); the intra-chunk
stages stay its shared jnp code (not fused into the kernels yet). Calls of T >=
``recurrent_below`` evaluate through `gdngen.algebra.chunkwise_channel.forward` with the kernel
walk, shorter ones through the recurrent kernel, and every differentiated call takes
`gdngen.algebra.chunkwise_channel.backward` with the kernel walks. Their variant space is the walks'
parameters (``chunk_size``, ``bk``, ``bv``, ``num_warps``, ``num_stages``; ieee, saving states),
and they are tuned. Validated as the scalar variants (`gdngen.validate.run_battery`, interpret
mode, poisoned outputs): worst relative L2 error over every per-channel battery case and
quantity (dg in both conventions), default variant, float32: 7.5e-7 (dbeta,
vector_identical_keys; the other cases <= 3.0e-7).

Variant parameters (`variant_space`):

* ``chunk_size`` 16 | 32 | 64: steps per chunk.
* ``bk`` / ``bv``: register tiles over Dk / Dv (powers of two >= 16 dividing the head dim
  rounded up to 16; a request that does not divide takes the largest power of two that does).
  Triton dots need power-of-two shapes >= 16, so head dims are zero-padded to a multiple of 16
  (exact: padded key columns and value rows stay zero through the recurrence).
* ``precision``: matmul policy, see `PRECISIONS` and `POLICY_TOLERANCES`. The decay segment sums
  and the exact unit-lower-triangular inverse always run at input precision "ieee".
* ``num_warps`` / ``num_stages``: Triton launch parameters (``plgpu.CompilerParams``).
* ``save_states``: the forward saves U, Wk, Pm, T and each chunk's entering state for the
  backward, or the backward recomputes them (the chunk-parallel kernel and one more state walk).
* ``recurrent_below``: calls with fewer steps run the recurrent kernel forward
  (`gdngen.config.recurrent_switch`); it reaches no rendered source.

Packed rows (``cu_seqlens``, `gdngen.algebra.packed`), scalar gates: `packed_gated_delta` runs the
row's chunk walk on the variant's packed build (`render_packed`: the same templates with ``packed``
set; the forward state walk, and the recomputing variants' ``residuals``, also takes a state per
chunk ``[B, Hv, N, DV, DK]`` added to the state leaving it, and the forward always returns the
entering states; the reverse walk also takes their cotangent, and its per-chunk dS_out is the
injection's) and each sequence's one-chunk calls (initial-state response, final state from its
last chunk's entering state) on the dense chunk kernels, float32. With ``packed`` unset the
templates render the dense kernels byte for byte (tuned entries keep their sha256). Per-channel
packed rows run on the portable chunk path.

Layer inputs (``qk_norm=True``, a parameterised gate ``gate="softplus"`` / ``"sigmoid_bound"``;
`gdngen.backends.kernel_inputs`): the kernels compute them in their own loads. `render_fused`
renders the recurrent kernel and (scalar gates) the chunk forward kernels (chunk-parallel and
state walk) once per `KernelInputs.context` (the runtime ``lower_bound`` is an operand: one
build serves every bound): they take the raw q, k and L2-normalise each loaded row in float32
over its DK tiles (q then scaled), and take the raw projection ``a`` where the decay / log gate
was, with ``a_log``, ``dt_bias`` (``[Hv]`` per head, ``[Hv, DK]`` per channel) as operands,
forming log g (a = -inf: exactly 0) and its exp or segment sums there. The chunk backward (and
a recomputing variant's residuals) runs the plain kernels on inputs the custom VJP recomputes
(`gdngen.backends.generated.custom_vjp_core` with ``forward_fuses``), so only the raw arrays
are kept. Per-channel chunk calls compute them in `gdngen.backends.portable.jax_chunkwise`'s custom
VJP (its intra-chunk stages are jnp). The plain renders are byte for byte those of before (tuned
entries keep their sha256).

Only ``gdngen.variant`` / ``gdngen.render`` run at import; jax is imported when kernels are
rendered or run.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import types
import warnings
from dataclasses import dataclass

from gdngen import jaxcompat, settings
from gdngen.algebra import chunkwise
from gdngen.backends import generated
from gdngen.backends.kernel_inputs import QK_NORM_EPS, KernelInputs
from gdngen.backends.pallas import core as pallas_core
from gdngen.backends.pallas.core import call_jitted, exec_module, jit_pair
from gdngen.config import VariantConfig, recurrent_switch
from gdngen.variant import Problem, Variant

BACKEND = "pallas_gpu"
CHUNK_SIZES = (16, 32, 64)
#: matmul precision policies: ieee = float32 operands at input precision "ieee"; tf32 = input
#: precision "tf32" (tensor cores; emulated in interpret mode by rounding the operands to TF32);
#: bf16 = bfloat16 operands. Accumulation is float32 in all three.
PRECISIONS = ("ieee", "tf32", "bf16")
#: Relative L2 error each policy is validated at (the battery's own tolerance for the input
#: dtype applies when it is larger). Worst error measured in interpret mode, float32 inputs,
#: default tiles (chunk 64, bk = bv = 64), every scalar-gate battery case and quantity:
#:
#:   policy  tolerance  measured worst   (quantity / case that reaches it)
#:   ieee    5e-5       8.4e-7           dbeta (identical_keys)
#:   tf32    5e-3       1.7e-3           dbeta (identical_keys; other cases <= 7.2e-4)
#:   bf16    2e-2       1.4e-2           dbeta (identical_keys; other cases <= 5.3e-3)
POLICY_TOLERANCES = {"ieee": 5e-5, "tf32": 5e-3, "bf16": 2e-2}
INPUT_DTYPES = ("float32", "bfloat16", "float16")
#: register tile sizes offered for bk / bv (Triton dots need powers of two >= 16).
TILES = (16, 32, 64, 128)
NUM_WARPS = (4, 8)
NUM_STAGES = (2, 3)
#: log gates are clamped to this finite floor inside the kernels (exp gives exactly 0 either
#: way, and a 0/1 matmul never meets 0 * -inf); the gate cotangent uses the true gates.
LOG_GATE_FLOOR = -1e30
#: environment variable forcing interpret mode (set by ``gdngen tune --dry-run`` workers).
ENV_INTERPRET = settings.ENV_INTERPRET


# ----------------------------------------------------------------------------- variant space


def padded_dim(d: int) -> int:
    """Head dim as the kernels see it: rounded up to a multiple of 16."""
    return -(-d // 16) * 16


def tiles(d: int) -> list[int]:
    """Tiles enumerated for head dim ``d``: the powers of two in `TILES` dividing its padded
    size, at least 32 when the padded size allows (16-wide tiles only for 16-wide heads)."""
    padded = padded_dim(d)
    return [t for t in TILES if padded % t == 0 and t >= min(32, padded)]


def _resolve_tile(requested: int, d: int) -> int:
    """The largest power of two >= 16, not above ``requested``, dividing ``padded_dim(d)``."""
    padded, tile = padded_dim(d), 16
    while tile * 2 <= min(requested, padded) and padded % (tile * 2) == 0:
        tile *= 2
    return tile

#: untuned crossover T (`gdngen.config.recurrent_switch`): one chunk (below it the chunk
#: kernels pad to a whole chunk); not measured on a GPU, the tuner measures it there
RECURRENT_BELOW = 64

@dataclass(frozen=True)
class Config(VariantConfig):
    """Typed pallas_gpu parameters (see the module docstring)."""

    backend = BACKEND
    bk: int = 64
    bv: int = 64
    chunk_size: int = 64
    num_stages: int = 2
    num_warps: int = 4
    precision: str = "ieee"
    save_states: bool = True
    recurrent_below: int = recurrent_switch(RECURRENT_BELOW)

    def check(self) -> None:
        self.check_count("recurrent_below")
        self.check_choice("chunk_size", CHUNK_SIZES)
        self.check_choice("bk", TILES)
        self.check_choice("bv", TILES)
        self.check_choice("num_warps", (1, 2, 4, 8, 16))
        self.check_choice("num_stages", (1, 2, 3, 4, 5))
        self.check_choice("precision", PRECISIONS)
        self.check_flag("save_states")


def kernel_params(variant: Variant, problem: Problem) -> dict:
    """The variant's parameters resolved for ``problem``: ``chunk_size``, ``bk``/``bv`` (tiles
    dividing the padded head dims), ``dk``/``dv`` (padded head dims), ``precision``,
    ``num_warps``, ``num_stages``, ``save_states``.

    ValueError for a variant of another backend, unknown or missing parameters, bad values, or
    a problem the backend does not implement.
    """
    config = SPEC.parse(variant)
    SPEC.check(problem)
    return {
        "chunk_size": config.chunk_size,
        "bk": _resolve_tile(config.bk, problem.Dk),
        "bv": _resolve_tile(config.bv, problem.Dv),
        "dk": padded_dim(problem.Dk),
        "dv": padded_dim(problem.Dv),
        "precision": config.precision,
        "num_warps": config.num_warps,
        "num_stages": config.num_stages,
        "save_states": config.save_states,
    }


def shared_memory_bytes(variant: Variant, problem: Problem) -> int:
    """Planning estimate of the variant's largest shared-memory use per program, in bytes.

    Triton stages dot operands through shared memory and software-pipelines the loads of a
    loop ``num_stages`` deep. The sequential walks (forward state walk, reverse state-cotangent
    walk) load per chunk the key and query tiles (input dtype), Wk (float32), Pm (float32) and
    a BV-column float32 tile; they hold ``num_stages`` of those, plus one staged dot (Pm times
    a BV tile). The chunk-parallel kernels stage their largest dot (T times a tile of Dk or
    Dv). Not the compiler's own figure (that needs the device): a bound to prune variants
    that cannot fit, not a promise that the rest do.
    """
    p = kernel_params(variant, problem)
    C, bk, bv, dk = p["chunk_size"], p["bk"], p["bv"], p["dk"]
    isz = 4 if problem.dtype == "float32" else 2
    # per-channel walks: Wk, Kc (forward) or Qd (reverse) and Pm, all float32
    keys = 3 * C * dk * 4 if problem.gate == "vector" else 2 * C * dk * isz + C * dk * 4
    per_chunk = keys + C * C * 4 + C * bv * 4
    walk = p["num_stages"] * per_chunk + (C * C + C * bv) * 4
    parallel = 2 * (C * C + C * max(bk, bv)) * 4
    return max(walk, parallel)


def variant_space(problem: Problem, device) -> list[Config]:
    """Every variant whose `shared_memory_bytes` fits ``device``'s ``shared_memory``
    (gdngen.devices). For per-channel gates only the walks' parameters vary (chunk, tiles,
    launch parameters), at ieee, saving states."""
    SPEC.check(problem)
    budget = device.limits["shared_memory"]
    vector = problem.gate == "vector"
    space = []
    for chunk, precision, bk, bv, warps, stages, save in itertools.product(
            CHUNK_SIZES, ("ieee",) if vector else PRECISIONS, tiles(problem.Dk),
            tiles(problem.Dv), NUM_WARPS, NUM_STAGES, (True,) if vector else (True, False)):
        config = Config(bk, bv, chunk, stages, warps, precision, save)
        if shared_memory_bytes(Variant(BACKEND, config.params()), problem) <= budget:
            space.append(config)
    return space


def default_config(problem: Problem, device) -> Config:
    """Chunk 64, ieee, 64-wide tiles, 4 warps, 2 stages, saving states; where that does not fit
    ``device``'s shared memory, the ieee variant that fits and is closest to it (saving states,
    chunk nearest 64, 4 warps and 2 stages, then the widest tiles)."""
    ideal = Config(min(64, tiles(problem.Dk)[-1]), min(64, tiles(problem.Dv)[-1]), 64, 2, 4,
                   "ieee", True)
    budget = device.limits["shared_memory"]
    if shared_memory_bytes(Variant(BACKEND, ideal.params()), problem) <= budget:
        return ideal
    fits = [c for c in variant_space(problem, device) if c.precision == "ieee"]
    if not fits:
        raise ValueError(f"no {BACKEND} variant of {problem.key()} fits the {budget // 1024} KiB "
                         f"of shared memory of {device.name}")
    return min(fits, key=lambda c: (not c.save_states, abs(c.chunk_size - 64),
                                    (c.num_warps, c.num_stages) != (4, 2), -min(c.bk, 64),
                                    -min(c.bv, 64)))


def numerics_key(variant: Variant, problem: Problem) -> tuple:
    """What decides the variant's arithmetic on ``problem``: its resolved parameters without
    the launch parameters (``num_warps``, ``num_stages`` only reach ``plgpu.CompilerParams``)."""
    p = kernel_params(variant, problem)
    return tuple(sorted((k, v) for k, v in p.items() if k not in ("num_warps", "num_stages")))


# ----------------------------------------------------------------------------- rendering


def render_plan(variant: Variant, problem: Problem) -> dict:
    """``{"forward.py": (template, context), "backward.py": (template, context), "recurrent.py":
    (template, context)}``; the contexts hold the parameters resolved for ``problem``
    (`kernel_params`). For a per-channel (vector) gate problem the forward and backward sources
    are the chunk walks (``per_channel`` set; ``save_states`` and the input dtype reach them
    not). The recurrent kernel's are the head dims and heads, the tiles ``bk`` /
    ``bv``, the launch parameters and the gate kind ``per_channel`` (``problem.gate ==
    "vector"``); ``recurrent_below`` reaches no source (the switch is taken in `gated_delta`)."""
    p = kernel_params(variant, problem)
    context = {
        "problem_key": problem.key(),
        "chunk": p["chunk_size"],
        "dk": p["dk"],
        "dv": p["dv"],
        "bk": p["bk"],
        "bv": p["bv"],
        "n_dk": p["dk"] // p["bk"],
        "n_dv": p["dv"] // p["bv"],
        "hk": problem.Hk,
        "hv": problem.Hv,
        "group": problem.group,
        "dtype": problem.dtype,
        "precision": p["precision"],
        "num_warps": p["num_warps"],
        "num_stages": p["num_stages"],
        "save_states": p["save_states"],
        "packed": False,  # `render_packed` sets it; off, the dense kernels render unchanged
        "per_channel": problem.gate == "vector",  # the chunk walks of chunkwise_channel
        **PLAIN_INPUTS,
    }
    recurrent = {key: context[key] for key in ("problem_key", "dk", "dv", "bk", "bv", "n_dk",
                                               "n_dv", "hk", "hv", "group", "num_warps",
                                               "num_stages", *PLAIN_INPUTS)}
    recurrent["per_channel"] = problem.gate == "vector"
    recurrent["steps"] = False  # `render_steps` sets it; off, the kernel renders unchanged
    return {"forward.py": ("pallas_gpu/forward.py.j2", context),
            "backward.py": ("pallas_gpu/backward.py.j2", context),
            "recurrent.py": ("pallas_gpu/recurrent.py.j2", recurrent)}


#: the template context of a plain build: nothing computed in the loads (`render_fused` sets
#: these, `gdngen.backends.kernel_inputs.KernelInputs.context`)
PLAIN_INPUTS = {"qk_norm": False, "gate_form": None}


def render_fused(variant: Variant, problem: Problem, inputs, *, templates_dir=None):
    """The fused build of ``variant`` for ``inputs`` (a `gdngen.backends.kernel_inputs.
    KernelInputs` that fuses something): the recurrent kernel and, for scalar gates, the chunk
    forward kernels (chunk-parallel and walk) rendered with ``inputs.context()``, so they take
    raw q, k (normalised per loaded row, float32, q then scaled) and, with a gate form, the raw
    projection ``a`` where the decay / log gate was plus ``a_log``, ``dt_bias`` (and the
    runtime ``lower_bound``) operands, computing the log gate in their loads. Named
    ``recurrent<tag>.py``, ``forward<tag>.py``. The backward kernels and the residual
    recomputation are not in it (they take the recomputed inputs: the plain build's);
    per-channel chunk walks are not either (their intra-chunk stages are jnp,
    `gdngen.backends.portable.jax_chunkwise`)."""
    names = ("recurrent.py",) if problem.gate == "vector" else ("recurrent.py", "forward.py")
    return pallas_core.render_fused(SPEC, variant, problem, names, inputs,
                                  templates_dir=templates_dir,
                                  context={"qk_norm_eps": repr(QK_NORM_EPS),
                                           "log_gate_floor": repr(LOG_GATE_FLOOR)})


# ----------------------------------------------------------------------------- loading

_LOADED: dict = {}


@functools.cache
def _default_interpret_mode() -> bool:
    import jax

    if settings.flag(ENV_INTERPRET):
        return True
    if jax.default_backend() == "gpu":
        return False
    warnings.warn(f"gdngen {BACKEND}: no GPU attached; the generated kernels run in Pallas "
                  "interpret mode (slow; for validation)", RuntimeWarning,
                  stacklevel=settings.caller_stacklevel())
    return True


_INTERPRET_OVERRIDE: list = []


def interpret_mode() -> bool:
    """False on a GPU (Triton lowering); True elsewhere or with ``GDNGEN_INTERPRET=1``, with a
    warning once per process when no GPU is attached; False inside `compiling_for_gpu`."""
    return _INTERPRET_OVERRIDE[-1] if _INTERPRET_OVERRIDE else _default_interpret_mode()


@contextlib.contextmanager
def compiling_for_gpu():
    """Inside the block the kernels take the Triton lowering whatever device is attached: for
    lowering a whole program for CUDA off-GPU (``.lower(lowering_platforms=("cuda",))``), not
    for running it."""
    _INTERPRET_OVERRIDE.append(False)
    try:
        yield
    finally:
        _INTERPRET_OVERRIDE.pop()


def clear_cache() -> None:
    """Drop every loaded variant and jax's compiled executables (a build calls this between
    variants)."""
    import jax

    _LOADED.clear()
    chunk_core.cache_clear()
    packed_core.cache_clear()
    chunk_walks.cache_clear()
    entering_core.cache_clear()
    jax.clear_caches()


def load_kernels(variant: Variant, problem: Problem, *, templates_dir=None):
    """Render ``variant`` for ``problem`` and load it (cached by the sources' sha256 and the
    interpret mode).

    Returns a namespace: ``forward``/``backward``/``recurrent`` (the generated modules),
    ``run_forward``, ``run_residuals``, ``run_backward``, ``run_recurrent`` (their functions
    jitted with ``scale``/``interpret`` static: a pair, top-level and nested), ``sha256``,
    ``variant``, ``problem``, ``params`` (`kernel_params`), ``interpret``. For a vector-gate
    problem ``forward``/``backward`` are the per-channel chunk walks (``run_forward``/
    ``run_backward`` with only ``interpret`` static, no ``run_residuals``; see `chunk_walks`).
    """
    rendered = SPEC.render(variant, problem, templates_dir=templates_dir)
    interpret = interpret_mode()
    key = (rendered.sha256, interpret)
    if key not in _LOADED:
        fwd, bwd, rec = (exec_module(BACKEND, name, rendered.sources[name], rendered.sha256)
                         for name in ("forward.py", "backward.py", "recurrent.py"))
        static = ("scale", "interpret")
        walk_static = ("interpret",) if problem.gate == "vector" else static
        kernels = types.SimpleNamespace(
            forward=fwd, backward=bwd, recurrent=rec, sha256=rendered.sha256, variant=variant,
            problem=problem, params=kernel_params(variant, problem), interpret=interpret,
            run_forward=jit_pair(fwd.forward, walk_static, interpret),
            run_backward=jit_pair(bwd.backward, walk_static, interpret),
            run_recurrent=jit_pair(rec.recurrent, static, interpret))
        if problem.gate != "vector":
            kernels.run_residuals = jit_pair(fwd.residuals, static, interpret)
        _LOADED[key] = kernels
    return _LOADED[key]


def load_fused_kernels(variant: Variant, problem: Problem, inputs, *, templates_dir=None):
    """`render_fused`, loaded (cached as `load_kernels`, by the fused sources' sha256: one
    entry per rendering context, whatever the runtime ``lower_bound``): a namespace with
    ``recurrent``, ``run_recurrent`` and, for scalar gates, ``forward``, ``run_forward``
    (jitted with ``scale``/``interpret`` static), ``sha256``, ``variant``, ``problem``,
    ``params``, ``interpret``, ``context`` (``inputs.context()``)."""
    return pallas_core.load_fused(
        BACKEND, render_fused(variant, problem, inputs, templates_dir=templates_dir), inputs,
        kernel_params(variant, problem), interpret_mode(), _LOADED)


def render_packed(variant: Variant, problem: Problem, *, templates_dir=None):
    """The packed-row chunk kernels of ``variant`` (`gdngen.algebra.packed`, scalar gates): the
    forward and backward templates with ``packed`` set. The forward state walk (also the recomputing
    variants' ``residuals``) takes an injected state per chunk ``[B, Hv, N, DV, DK]``, added to
    the state leaving the chunk, and the forward always returns the entering states; the
    backward also takes their cotangent and returns the injection's (the template headers).
    With ``packed`` unset the templates render the dense kernels byte for byte."""
    return pallas_core.render_packed(SPEC, variant, problem, ("forward.py", "backward.py"),
                                   templates_dir=templates_dir)


def load_packed_kernels(variant: Variant, problem: Problem, *, templates_dir=None):
    """`render_packed`, loaded (cached as `load_kernels`): a namespace with ``forward``,
    ``backward``, ``run_forward``, ``run_residuals``, ``run_backward``, ``sha256``,
    ``variant``, ``problem``, ``params``, ``interpret``."""
    rendered = render_packed(variant, problem, templates_dir=templates_dir)
    interpret = interpret_mode()
    key = (rendered.sha256, interpret)
    if key not in _LOADED:
        kernels = pallas_core.load_packed(BACKEND, rendered, kernel_params(variant, problem),
                                        interpret)
        kernels.run_residuals = jit_pair(kernels.forward.residuals, ("scale", "interpret"),
                                         interpret)
        _LOADED[key] = kernels
    return _LOADED[key]


def lower_check(variant: Variant, problem: Problem, *, batch: int = 1, chunks: int = 2,
                steps: int = 5, inputs=None) -> dict:
    """Lower the variant's kernels (forward, residual recomputation, backward, and the
    recurrent forward over ``steps`` steps) through the Pallas Triton lowering for the CUDA
    platform, which needs no GPU; returns ``{function name: StableHLO text}``. For a
    vector-gate problem: ``channel_walk`` and ``channel_walk_backward`` (the per-channel chunk
    walks) instead of forward, residuals and backward. ``inputs`` (a
    `gdngen.backends.kernel_inputs.KernelInputs` that fuses something): the kernels of its
    fused build instead (`render_fused`: ``recurrent`` and, for scalar gates, ``forward``).
    Raises what the lowering raises (non-power-of-two shapes, unsupported ops, scratch memory,
    ...). Triton's own compilation to PTX runs only on a GPU."""
    import jax
    import jax.numpy as jnp

    if inputs is not None:
        return _lower_fused(variant, problem, inputs, batch=batch, chunks=chunks, steps=steps)
    kernels = load_kernels(variant, problem)
    p = kernels.params
    C, Dk, Dv, Hk, Hv = p["chunk_size"], p["dk"], p["dv"], problem.Hk, problem.Hv
    B, T, N = batch, chunks * C, chunks
    spec, f32, dtype = jax.ShapeDtypeStruct, jnp.float32, jnp.dtype(problem.dtype)
    q = spec((B, T, Hk, Dk), dtype)
    v = spec((B, T, Hv, Dv), dtype)
    gates, state = spec((B, Hv, T), f32), spec((B, Hv, Dv, Dk), f32)
    residuals = (spec((B, Hv, T, Dv), f32), spec((B, Hv, T, Dk), f32), spec((B, Hv, T, C), f32),
                 spec((B, Hv, T, C), f32), spec((B, Hv, N, Dv, Dk), f32))

    def lower(fn, *args, scaled=True):  # the per-channel walks take no scale
        static = {"interpret": False} | ({"scale": Dk ** -0.5} if scaled else {})
        with jaxcompat.abstract_gpu():
            return (jax.jit(fn, static_argnames=tuple(static)).trace(*args, **static)
                    .lower(lowering_platforms=("cuda",)).as_text())

    vector = problem.gate == "vector"
    keys, values = spec((B, Hv, T, Dk), f32), spec((B, Hv, T, Dv), f32)
    dcc, pm = spec((B, Hv, N, Dk), f32), spec((B, Hv, T, C), f32)
    lowered = {
        "channel_walk": lower(kernels.forward.forward, values, keys, keys, keys, pm, dcc, state,
                              scaled=False),
        "channel_walk_backward": lower(kernels.backward.backward, values, keys, keys, values,
                                       residuals[-1], values, keys, dcc, state, scaled=False),
    } if vector else {
        "forward": lower(kernels.forward.forward, q, q, v, gates, gates, state),
        "residuals": lower(kernels.forward.residuals, q, q, v, gates, gates, state),
        "backward": lower(kernels.backward.backward, q, q, v, gates, gates, *residuals, v,
                          state),
    }
    per_step = spec((B, steps, Hv), f32)
    decay = spec((B, steps, Hv, Dk), f32) if vector else per_step
    q_rec = spec((B, steps, Hk, Dk), f32)
    lowered["recurrent"] = lower(kernels.recurrent.recurrent, q_rec, q_rec,
                                 spec((B, steps, Hv, Dv), f32), decay, per_step, state)
    for name, text in lowered.items():
        if "triton" not in text:
            raise RuntimeError(f"the {name} kernels did not lower to a Triton custom call")
    return lowered


def _lower_fused(variant: Variant, problem: Problem, inputs, *, batch: int, chunks: int,
                 steps: int) -> dict:
    """`lower_check` of the fused build of ``inputs``."""
    import jax
    import jax.numpy as jnp

    kernels = load_fused_kernels(variant, problem, inputs)
    p = kernels.params
    C, Dk, Dv, Hk, Hv = p["chunk_size"], p["dk"], p["dv"], problem.Hk, problem.Hv
    spec, f32, dtype = jax.ShapeDtypeStruct, jnp.float32, jnp.dtype(problem.dtype)
    vector = problem.gate == "vector"
    parameter = spec((Hv, Dk) if vector else (Hv,), f32)
    gate = ((parameter, parameter) + ((spec((), f32),) if inputs.gate_form == "sigmoid_bound"
                                      else ())) if inputs.gate_form else ()

    def lower(fn, *args):
        static = {"interpret": False, "scale": Dk ** -0.5}
        with jaxcompat.abstract_gpu():
            return (jax.jit(fn, static_argnames=tuple(static)).trace(*args, **static)
                    .lower(lowering_platforms=("cuda",)).as_text())

    B, state = batch, spec((batch, Hv, Dv, Dk), f32)
    per_step = spec((B, steps, Hv), f32)
    q_rec = spec((B, steps, Hk, Dk), f32)
    lowered = {"recurrent": lower(kernels.recurrent.recurrent, q_rec, q_rec,
                                  spec((B, steps, Hv, Dv), f32),
                                  spec((B, steps, Hv, Dk), f32) if vector else per_step,
                                  per_step, state, *gate)}
    if not vector:
        T = chunks * C
        q, gates = spec((B, T, Hk, Dk), dtype), spec((B, Hv, T), f32)
        lowered["forward"] = lower(kernels.forward.forward, q, q, spec((B, T, Hv, Dv), dtype),
                                   gates, gates, state, *gate)
    for name, text in lowered.items():
        if "triton" not in text:
            raise RuntimeError(f"the fused {name} kernels did not lower to a Triton custom call")
    return lowered


# ----------------------------------------------------------------------------- custom VJP core


def _pad_last(x, size: int, axis: int = -1):
    import jax.numpy as jnp

    extra = size - x.shape[axis]
    if not extra:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths)


def _keys_to_kernel(x, dk):
    """Chunk layout [N, B, Hk, C, Dk] -> [B, T, Hk, DK] (zero-padded head dim)."""
    N, B, Hk, C, Dk = x.shape
    return _pad_last(x.transpose(1, 0, 3, 2, 4).reshape(B, N * C, Hk, Dk), dk)


def _values_to_kernel(x, dv):
    """Chunk layout [N, B, Hk, r, C, Dv] -> [B, T, Hv, DV]."""
    N, B, Hk, r, C, Dv = x.shape
    return _pad_last(x.transpose(1, 0, 4, 2, 3, 5).reshape(B, N * C, Hk * r, Dv), dv)


def _values_from_kernel(x, like):
    """[B, T, Hv, DV] -> chunk layout [N, B, Hk, r, C, Dv] of ``like``."""
    N, B, Hk, r, C, Dv = like.shape
    return x[..., :Dv].reshape(B, N, C, Hk, r, Dv).transpose(1, 0, 3, 4, 2, 5)


def _per_step_to_kernel(x):
    """Chunk layout [N, B, Hk, r, C] -> [B, Hv, T]."""
    N, B, Hk, r, C = x.shape
    return x.transpose(1, 2, 3, 0, 4).reshape(B, Hk * r, N * C)


def _per_step_from_kernel(x, like):
    """[B, Hv, T] (or [B, Hv, N, C]) -> chunk layout [N, B, Hk, r, C] of ``like``."""
    N, B, Hk, r, C = like.shape
    return x.reshape(B, Hk, r, N, C).transpose(3, 0, 1, 2, 4)


def _states_to_kernel(x, dk, dv):
    """[B, Hk, r, Dv, Dk] -> [B, Hv, DV, DK]."""
    B, Hk, r, Dv, Dk = x.shape
    return _pad_last(_pad_last(x.reshape(B, Hk * r, Dv, Dk), dk), dv, axis=-2)


def _chunk_states_to_kernel(x, dk, dv):
    """Per-chunk states in chunk layout [N, B, Hk, r, Dv, Dk] -> [B, Hv, N, DV, DK]."""
    N, B, Hk, r, Dv, Dk = x.shape
    x = x.transpose(1, 2, 3, 0, 4, 5).reshape(B, Hk * r, N, Dv, Dk)
    return _pad_last(_pad_last(x, dk), dv, axis=-2)


def _chunk_states_from_kernel(x, like):
    """[B, Hv, N, DV, DK] -> chunk layout [N, B, Hk, r, Dv, Dk] of ``like``."""
    N, B, Hk, r, Dv, Dk = like.shape
    return x[..., :Dv, :Dk].reshape(B, Hk, r, N, Dv, Dk).transpose(3, 0, 1, 2, 4, 5)


def _to_kernel_layout(q, k, v, gates, beta, S0, *, gate, dk, dv):
    """Chunk layout of `gdngen.algebra.chunkwise` -> the kernels' layout (see the forward template),
    as a dict; log gates clamped to `LOG_GATE_FLOOR`."""
    import jax.numpy as jnp

    log_gates = gates if gate == "log" else jnp.log(gates)
    return {"q": _keys_to_kernel(q, dk), "k": _keys_to_kernel(k, dk),
            "v": _values_to_kernel(v, dv),
            "g": _per_step_to_kernel(jnp.maximum(log_gates, LOG_GATE_FLOOR)),
            "beta": _per_step_to_kernel(beta), "s0": _states_to_kernel(S0, dk, dv)}


def _to_fused_layout(q, k, v, gates, beta, S0, *, gate, dk, dv, inputs):
    """`_to_kernel_layout` for the fused forward kernels of ``inputs`` (raw primals of
    `gdngen.backends.generated.custom_vjp_core` with ``forward_fuses``): q, k as given (raw
    with ``qk_norm``); with a gate form ``gates`` is ``(a, A_log, dt_bias)`` (A_log, dt_bias
    ``[Hk, r, 1]``), ``"g"`` holds ``a`` (-inf kept: an identity step) and ``"gate"`` the
    operands after it (`gdngen.backends.pallas.core.fused_gate_operands`); otherwise ``gates``
    in ``gate``'s convention, laid out as `_to_kernel_layout` does."""
    if inputs.gate_form is None:
        return dict(_to_kernel_layout(q, k, v, gates, beta, S0, gate=gate, dk=dk, dv=dv),
                    gate=())
    a, A_log, dt_bias = gates
    lay = _to_kernel_layout(q, k, v, a, beta, S0, gate="log", dk=dk, dv=dv)
    lay["g"] = _per_step_to_kernel(a)  # unclamped: the kernels clamp the log gate they compute
    lay["gate"] = pallas_core.fused_gate_operands(inputs, A_log, dt_bias, v.shape[2] * v.shape[3],
                                                k.shape[-1], False)
    return lay


def _gate_cotangent(gates, gate, dd11, dd0):
    """d(gates) [B, Hv, N, C] from the kernels' decay-factor cotangents (dd11 [B, Hv, T, C],
    dd0 [B, Hv, T]; the chunk-end terms already folded into their last rows) by the
    straddle-sum rule of `gdngen.algebra.chunkwise` (exact at g = 0); gates [B, Hv, N, C] in their
    own convention."""
    import jax.numpy as jnp

    C = gates.shape[-1]
    dd11 = dd11.reshape(gates.shape + (C,))
    rows = jnp.concatenate([dd0.reshape(gates.shape)[..., None], dd11], axis=-1)  # positions 1..C
    dD = jnp.concatenate([jnp.zeros(rows.shape[:-2] + (1, C + 1), rows.dtype), rows], axis=-2)
    return pallas_core.gate_cotangent(gates, gate, dD)


def _cotangents(primals, grads, *, gate):
    """The kernels' gradients -> cotangents of the core's primals (chunk layout, their dtypes)."""
    q, k, v, gates, beta, S0 = primals
    dq, dk, dv, dbeta, dd11, dd0, ds0 = grads
    N, B, Hk, C, Dk = q.shape
    r = v.shape[3]

    def key_grad(x, like):  # [B, T, Hv, DK] per value head -> summed over the group
        x = x[..., :Dk].reshape(B, N, C, Hk, r, Dk).sum(axis=4)
        return x.transpose(1, 0, 3, 2, 4).astype(like.dtype)

    B_, Hv = gates.shape[1], Hk * r
    per_head = gates.transpose(1, 2, 3, 0, 4).reshape(B_, Hv, N, C)
    dgates = _gate_cotangent(per_head, gate, dd11, dd0)
    Dv = v.shape[-1]
    return (key_grad(dq, q), key_grad(dk, k), _values_from_kernel(dv, v).astype(v.dtype),
            _per_step_from_kernel(dgates, gates), _per_step_from_kernel(dbeta, beta),
            ds0[:, :, :Dv, :Dk].reshape(S0.shape))


@functools.cache
def chunk_core(key: tuple, gate, scale: float, qk_norm: bool = False,
               fused_key: tuple | None = None):
    """`gdngen.algebra.chunkwise` core (chunk layout in and out) for the loaded kernels ``key``
    (sha256, interpret mode), with the generated backward as its ``jax.custom_vjp``. Layout
    changes and the gate epilogue are jitted on their own; each kernel module function is its
    own executable (shared by both gate kinds).

    The backward lays the primals out again rather than keeping the forward's copies (the
    custom VJP keeps the primals), so nothing of q, k outlives the forward but the primals:
    with ``qk_norm`` (`gdngen.backends.generated.custom_vjp_core`) the raw ones only.

    ``fused_key``: the loaded fused build (`load_fused_kernels`) of ``qk_norm`` and ``gate``
    (a `gdngen.algebra.chunkwise.ParameterGate` or a convention): its forward kernels take the raw
    primals (``forward_fuses``), normalising q, k and computing the log gate in their loads;
    the backward (and a recomputing variant's residuals) runs the plain kernels ``key`` on the
    recomputed inputs. None: the core computes them with array ops before the forward."""
    import jax.numpy as jnp

    parameter_gate, gate = gate, chunkwise.convention(gate)  # the kernels take log gates
    kernels = _LOADED[key]
    interpret, p = kernels.interpret, kernels.params
    if fused_key is None:
        run_forward, prepare_forward = kernels.run_forward, None
    else:
        run_forward = _LOADED[fused_key].run_forward
        prepare_forward = jit_pair(functools.partial(
            _to_fused_layout, gate=gate, dk=p["dk"], dv=p["dv"],
            inputs=KernelInputs.of(qk_norm, parameter_gate)), (), interpret)
    prepare = jit_pair(functools.partial(_to_kernel_layout, gate=gate, dk=p["dk"], dv=p["dv"]),
                        (), interpret)
    finish = jit_pair(functools.partial(_cotangents, gate=gate), (), interpret)

    def forward_outputs(y, s_final, v, S0):
        Dv, Dk = S0.shape[-2:]
        return _values_from_kernel(y, v), s_final[:, :, :Dv, :Dk].reshape(S0.shape)

    def backward_inputs(dY, dS_final, lay_v):
        return (_values_to_kernel(dY, p["dv"]).astype(lay_v.dtype),
                _states_to_kernel(dS_final.astype(jnp.float32), p["dk"], p["dv"]))

    forward_outputs = jit_pair(forward_outputs, (), interpret)
    backward_inputs = jit_pair(backward_inputs, (), interpret)

    def forward(primals):
        lay = call_jitted(prepare if prepare_forward is None else prepare_forward, *primals)
        y, s_final, saved = call_jitted(run_forward, lay["q"], lay["k"], lay["v"], lay["g"],
                                        lay["beta"], lay["s0"], *lay.get("gate", ()),
                                        scale=scale, interpret=interpret)
        return call_jitted(forward_outputs, y, s_final, primals[2], primals[5]), saved

    def backward(primals, saved, cotangents):
        lay = call_jitted(prepare, *primals)
        args = (lay["q"], lay["k"], lay["v"], lay["g"], lay["beta"])
        if not p["save_states"]:
            saved = call_jitted(kernels.run_residuals, *args, lay["s0"], scale=scale,
                          interpret=interpret)
        dy, dsf = call_jitted(backward_inputs, *cotangents, lay["v"])
        grads = call_jitted(kernels.run_backward, *args, *saved, dy, dsf, scale=scale,
                      interpret=interpret)
        return call_jitted(finish, primals, grads)

    return generated.custom_vjp_core(forward, backward, qk_norm, parameter_gate,
                                     forward_fuses=fused_key is not None)


@functools.cache
def entering_core(key: tuple, scale: float):
    """``core(q, k, v, log_gates, beta, S0) -> (Y, S_final, S_in)`` in the chunk layout of
    `gdngen.algebra.chunkwise.gated_delta` (its ``entering`` core; S_in ``[N, B, Hk, r, Dv,
    Dk]``) on the loaded ``save_states`` kernels ``key`` (sha256, interpret): one forward kernel
    call, its saved entering states returned. Forward only (`PallasBackend.chunks` takes the
    portable VJP)."""
    import jax

    kernels = _LOADED[key]
    interpret, p = kernels.interpret, kernels.params
    if not p["save_states"]:
        raise ValueError("entering_core needs a save_states build (its forward keeps S_in)")
    prepare = jit_pair(functools.partial(_to_kernel_layout, gate="log", dk=p["dk"], dv=p["dv"]),
                       (), interpret)

    def outputs(y, s_final, s_in, v, S0):
        N, B, Hk, r = v.shape[:4]
        Dv, Dk = S0.shape[-2:]
        like = jax.ShapeDtypeStruct((N, B, Hk, r, Dv, Dk), s_in.dtype)
        return (_values_from_kernel(y, v), s_final[:, :, :Dv, :Dk].reshape(S0.shape),
                _chunk_states_from_kernel(s_in, like))

    outputs = jit_pair(outputs, (), interpret)

    def core(*primals):
        lay = call_jitted(prepare, *primals)
        y, s_final, saved = call_jitted(kernels.run_forward, lay["q"], lay["k"], lay["v"],
                                        lay["g"], lay["beta"], lay["s0"], scale=scale,
                                        interpret=interpret)
        return call_jitted(outputs, y, s_final, saved[-1], primals[2], primals[5])

    return core


def _packed_layout(q, k, v, gates, beta, inject, *, gate, dk, dv):
    """`_to_kernel_layout` of a packed walk (zero s0) plus ``inject`` [N, B, Hk, r, Dv, Dk]
    -> [B, Hv, N, DV, DK]."""
    import jax.numpy as jnp

    lay = _to_kernel_layout(q, k, v, gates, beta, jnp.zeros(inject.shape[1:], jnp.float32),
                            gate=gate, dk=dk, dv=dv)
    lay["inject"] = _chunk_states_to_kernel(inject, dk, dv)
    return lay


def _packed_cotangents(primals, grads, *, gate):
    """The packed backward's gradients -> cotangents of ``(q, k, v, gates, beta, inject)``."""
    *front, inject = primals
    return (*_cotangents((*front, inject[0]), grads[:-1], gate=gate)[:5],
            _chunk_states_from_kernel(grads[-1], inject))


@functools.cache
def packed_core(key: tuple, gate: str):
    """The ``packed_core(q, k, v, gates, beta, inject) -> (Y, S_in)`` of
    `gdngen.algebra.packed.chunk_walk` on the loaded packed kernels ``key`` (sha256, interpret
    mode): chunk layout (q already scaled), from a zero state, ``inject`` and ``S_in`` ``[N, B, Hk,
    r, Dv, Dk]`` float32; the packed backward kernels as its ``jax.custom_vjp`` (cotangents of
    every input, ``inject``'s the state cotangent leaving each chunk)."""
    import jax.numpy as jnp

    kernels = _LOADED[key]
    interpret, p = kernels.interpret, kernels.params
    prepare = jit_pair(functools.partial(_packed_layout, gate=gate, dk=p["dk"], dv=p["dv"]),
                       (), interpret)
    finish = jit_pair(functools.partial(_packed_cotangents, gate=gate), (), interpret)

    def forward_outputs(y, s_in, v, inject):
        return _values_from_kernel(y, v), _chunk_states_from_kernel(s_in, inject)

    def backward_inputs(dY, dS_in, lay_v, lay_s0):
        return (_values_to_kernel(dY, p["dv"]).astype(lay_v.dtype),
                jnp.zeros(lay_s0.shape, jnp.float32),
                _chunk_states_to_kernel(dS_in.astype(jnp.float32), p["dk"], p["dv"]))

    forward_outputs = jit_pair(forward_outputs, (), interpret)
    backward_inputs = jit_pair(backward_inputs, (), interpret)

    def forward(primals):
        lay = call_jitted(prepare, *primals)
        y, _, s_in, saved = call_jitted(kernels.run_forward, lay["q"], lay["k"], lay["v"],
                                        lay["g"], lay["beta"], lay["s0"], lay["inject"],
                                        scale=1.0, interpret=interpret)
        return call_jitted(forward_outputs, y, s_in, primals[2], primals[5]), (lay, saved)

    def backward(primals, saved_forward, cotangents):
        lay, saved = saved_forward
        args = (lay["q"], lay["k"], lay["v"], lay["g"], lay["beta"])
        if not p["save_states"]:  # recomputed, the injection included
            saved = call_jitted(kernels.run_residuals, *args, lay["s0"], lay["inject"],
                                scale=1.0, interpret=interpret)
        dy, dsf, dsin = call_jitted(backward_inputs, *cotangents, lay["v"], lay["s0"])
        grads = call_jitted(kernels.run_backward, *args, *saved, dy, dsf, dsin, scale=1.0,
                            interpret=interpret)
        return call_jitted(finish, primals, grads)

    return generated.custom_vjp_core(forward, backward)


def _rows_to_kernel(x, width):
    """Chunk layout [N, B, Hk, r, C, X] -> [B, Hv, T, width] (zero-padded last dim)."""
    N, B, Hk, r, C, X = x.shape
    return _pad_last(x.transpose(1, 2, 3, 0, 4, 5).reshape(B, Hk * r, N * C, X), width)


def _rows_from_kernel(x, like):
    """[B, Hv, T, X'] -> chunk layout [N, B, Hk, r, C, X] of ``like``."""
    N, B, Hk, r, C, X = like.shape
    return x[..., :X].reshape(B, Hk, r, N, C, X).transpose(3, 0, 1, 2, 4, 5)


def _chunk_vectors_to_kernel(x, dk):
    """Per-chunk vectors in chunk layout [N, B, Hk, r, Dk] -> [B, Hv, N, DK]."""
    N, B, Hk, r, Dk = x.shape
    return _pad_last(x.transpose(1, 2, 3, 0, 4).reshape(B, Hk * r, N, Dk), dk)


@functools.cache
def chunk_walks(key: tuple):
    """``(walk_forward, walk_backward)`` with the signatures and contracts of
    `gdngen.algebra.chunkwise_channel.walk_forward` / ``walk_backward`` (chunk layout [N, B, Hk, r,
    ...], float32) on the loaded per-channel kernels ``key`` (sha256, interpret mode): the forward
    and backward templates rendered with ``per_channel``. The forward walk is one ``pallas_call``
    (grid batch * value head x Dv tiles, the chunks in order in one program, the state in
    registers); the reverse walk two (the state-cotangent walk likewise, then the sums over Dv
    chunk-parallel). Inputs go to the kernels' layout (value heads merged, time rows, head dims
    zero-padded: one copy each) and back. Packed rows (``inject`` / ``dS_in``) are not taken:
    per-channel packed rows run on the portable path."""
    kernels = _LOADED[key]
    interpret, p = kernels.interpret, kernels.params
    dk, dv = p["dk"], p["dv"]

    def walk_forward(xp, S0, U, Wk, Kc, Qd, Pm, dCC, inject=None):
        del xp  # the kernels' own arrays
        generated.refuse_injection(BACKEND, inject)
        y, s_final, s_in, w = call_jitted(
            kernels.run_forward, _rows_to_kernel(U, dv),
            *(_rows_to_kernel(x, dk) for x in (Wk, Kc, Qd)), _rows_to_kernel(Pm, Pm.shape[-1]),
            _chunk_vectors_to_kernel(dCC, dk), _states_to_kernel(S0, dk, dv),
            interpret=interpret)
        N, B, Hk, r = U.shape[:4]
        Dv, Dk = S0.shape[-2:]
        s_in = s_in[..., :Dv, :Dk].reshape(B, Hk, r, N, Dv, Dk).transpose(3, 0, 1, 2, 4, 5)
        return (_rows_from_kernel(y, U), s_final[:, :, :Dv, :Dk].reshape(S0.shape), s_in,
                _rows_from_kernel(w, U))

    def walk_backward(xp, dS_final, G, Kc, Wk, W, S_in, dY, Qd, dCC, dS_in=None):
        del xp
        generated.refuse_injection(BACKEND, dS_in)
        dw, dwk, dqd, dkc, ddcc, ds0 = call_jitted(
            kernels.run_backward, _rows_to_kernel(G, dv),
            *(_rows_to_kernel(x, dk) for x in (Kc, Wk)), _rows_to_kernel(W, dv),
            _chunk_states_to_kernel(S_in, dk, dv), _rows_to_kernel(dY, dv),
            _rows_to_kernel(Qd, dk), _chunk_vectors_to_kernel(dCC, dk),
            _states_to_kernel(dS_final, dk, dv), interpret=interpret)
        Dv, Dk = dS_final.shape[-2:]
        N, B, Hk, r = dCC.shape[:4]
        return (ds0[:, :, :Dv, :Dk].reshape(dS_final.shape), _rows_from_kernel(dw, G),
                *(_rows_from_kernel(x, like) for x, like in ((dwk, Wk), (dqd, Qd), (dkc, Kc))),
                ddcc[..., :Dk].reshape(B, Hk, r, N, Dk).transpose(3, 0, 1, 2, 4), None)

    return walk_forward, walk_backward


# ----------------------------------------------------------------------------- entry point


def recurrent_forward(q, k, v, decay, beta, S0, *, scale, variant, problem, templates_dir=None,
                      inputs=None):
    """The recurrent forward kernel of ``variant`` for ``problem`` (templates/pallas_gpu/
    recurrent.py.j2): the gated delta rule walked one step at a time, each program holding its
    ``bv`` rows of the state on-chip (registers, as ``bk``-wide tiles over the padded Dk) from
    ``S0`` to the final state. Forward only: nothing is saved for a backward.

    Contract:

    * inputs float32 in the API layout: q, k ``[B,T,Hk,Dk]`` (q unscaled; the kernel applies
      ``scale``), v ``[B,T,Hv,Dv]``, ``decay`` the LINEAR decay in [0, 1], ``[B,T,Hv]``
      (scalar gate) or ``[B,T,Hv,Dk]`` (per-channel gate, ``problem.gate == "vector"``), beta
      ``[B,T,Hv]``, S0 ``[B,Hv,Dv,Dk]``. Masked steps are folded by the caller (decay 1,
      beta 0; `gdngen.algebra.chunkwise.fold_mask`), log gates converted with exp (exactly 0 at
      log g = -inf).
    * any T >= 1 (a trace-time size: each T traces its own call), GVA (value head h reads key
      head h // (Hv / Hk)), Dk != Dv, head dims that are not multiples of 16 (zero-padded to
      the kernels' ``dk`` / ``dv``, which is exact).
    * returns ``(y [B,T,Hv,Dv], S_T [B,Hv,Dv,Dk])``, float32; per step
      ``u = beta (v - S (a k))``, ``S <- S diag(a) + u k^T``, ``y = scale S q``
      (`gdngen.algebra.chunkwise.recurrent_forward`).
    * poisoned outputs as the chunk kernels: interpret mode (no GPU, or ``GDNGEN_INTERPRET=1``)
      starts every output as NaN, so anything the kernel leaves unwritten shows up (with
      ``GDNGEN_POISON_OUTPUTS=1`` or without); on a GPU outputs are as Triton leaves them.

    * ``inputs`` (a `gdngen.backends.kernel_inputs.KernelInputs`; None: nothing fused)
      selects the fused build (`render_fused`): with ``inputs.qk_norm`` q, k are raw and the
      kernel L2-normalises each loaded row (float32, eps `QK_NORM_EPS`) before scaling q; with
      ``inputs.gate_form`` ``decay`` is the tuple ``(a, A_log, dt_bias)``: ``a`` the raw gate
      projection shaped as the decay (a = -inf on masked steps: decay 1), ``A_log``,
      ``dt_bias`` any shape `gdngen.backends.kernel_inputs.kernel_parameters` takes, and the
      kernel computes the decay exp(log g) per step (``lower_bound`` a runtime operand: one
      build for every bound).

    Loaded and cached with the variant's other kernels (`load_kernels`); differentiable only
    through `gated_delta`'s switch, whose VJP is the chunk path's.
    """
    interpret_mode()
    inputs = KernelInputs() if inputs is None else inputs
    if inputs.fused:
        kernels = load_fused_kernels(variant, problem, inputs, templates_dir=templates_dir)
    else:
        kernels = load_kernels(variant, problem, templates_dir=templates_dir)
    return _run_recurrent(kernels, q, k, v, decay, beta, S0, scale=scale, inputs=inputs)


def render_steps(variant: Variant, problem: Problem, *, templates_dir=None):
    """The recurrent kernel returning the state after every step (`pallas_core.render_steps`):
    each program also writes its ``[bv, DK]`` rows of each step's state."""
    return pallas_core.render_steps(SPEC, variant, problem, templates_dir=templates_dir)


def load_steps_kernels(variant: Variant, problem: Problem, *, templates_dir=None):
    """`render_steps`, loaded (cached as `load_kernels`): ``recurrent``, ``run_recurrent``."""
    return pallas_core.load_steps(BACKEND, render_steps(variant, problem,
                                                        templates_dir=templates_dir),
                                  kernel_params(variant, problem), interpret_mode(), _LOADED)


def recurrent_steps_forward(q, k, v, decay, beta, S0, *, scale, variant, problem,
                            templates_dir=None):
    """`recurrent_forward` (plain inputs) on the `render_steps` build of ``variant`` for
    ``problem``: ``(y [B, T, Hv, Dv], states [B, T, Hv, Dv, Dk])``, float32, the state after
    every step."""
    interpret_mode()
    kernels = load_steps_kernels(variant, problem, templates_dir=templates_dir)
    return _run_recurrent(kernels, q, k, v, decay, beta, S0, scale=scale,
                          inputs=KernelInputs())


def _run_recurrent(kernels, q, k, v, decay, beta, S0, *, scale, inputs):
    import jax.numpy as jnp

    p, f32 = kernels.params, jnp.float32
    Dk, Dv = q.shape[-1], v.shape[-1]
    gate = ()
    if inputs.gate_form is not None:
        if not (isinstance(decay, tuple) and len(decay) == 3):
            raise ValueError(f"decay must be the tuple (a, A_log, dt_bias) for gate_form="
                             f"{inputs.gate_form!r}, got {type(decay).__name__}")
        decay, A_log, dt_bias = decay
        vector = decay.ndim == 4
        gate = pallas_core.fused_gate_operands(inputs, A_log, dt_bias, v.shape[2], Dk, vector)
        if vector:  # zero-padded key channels: their state columns stay zero whatever the gate
            gate = (*(_pad_last(x, p["dk"]) for x in gate[:2]), *gate[2:])
    q, k = (_pad_last(x.astype(f32), p["dk"]) for x in (q, k))
    if decay.ndim == 4:
        decay = _pad_last(decay.astype(f32), p["dk"])
    y, s_final = call_jitted(kernels.run_recurrent, q, k, _pad_last(v.astype(f32), p["dv"]),
                             decay.astype(f32), beta.astype(f32),
                             _states_to_kernel(S0.astype(f32)[:, :, None], p["dk"], p["dv"]),
                             *gate, scale=float(scale), interpret=kernels.interpret)
    return y[..., :Dv], s_final[..., :Dv, :Dk]  # the final state, or (steps) every step's


def gated_delta(q, k, v, g, beta, initial_state=None, *, mask=None, scale=1.0, gate="log",
                variant, templates_dir=None, qk_norm=False):
    """Gated delta rule with the generated Pallas GPU kernels of ``variant``; returns
    ``(y, final_state)``. Arguments as `gdngen.jax.gated_delta` (q, k, v float32, bfloat16 or
    float16). Differentiable (custom VJP) and jit-able.

    A call with T >= the variant's ``recurrent_below`` runs the chunk kernels (per-channel
    gates, g ``[B,T,Hv,Dk]``: `gdngen.algebra.chunkwise_channel` with the kernel walks,
    `chunk_walks`); a shorter one evaluates through the recurrent kernel (`recurrent_forward`, on
    the inputs upcast to float32, masks folded) and differentiates through the chunk path
    (`gdngen.backends.portable.jax_chunkwise.recurrent_or_chunkwise`).

    ``qk_norm`` (q, k raw) and a `gdngen.algebra.chunkwise.ParameterGate` ``gate`` (``g`` the tuple
    ``(a, A_log, dt_bias)``; `BackendSpec.fused_inputs`) are computed in the kernels' loads:
    the recurrent kernel's and the scalar chunk forward kernels' (`render_fused`); the chunk
    backward gets them recomputed and keeps only the raw arrays
    (`gdngen.backends.generated.custom_vjp_core`). Per-channel gates' chunk path computes them
    inside its custom VJP (`gdngen.backends.portable.jax_chunkwise.chunk_core`).
    """
    return SPEC.entry(q, k, v, g, beta, initial_state, mask=mask, scale=scale, gate=gate,
                      variant=variant, templates_dir=templates_dir, qk_norm=qk_norm)


def packed_gated_delta(q, k, v, g, beta, initial_state=None, *, mask=None, scale=1.0,
                       gate="log", variant, cu_seqlens, templates_dir=None):
    """A packed row (`gdngen.algebra.packed`, scalar gates) on a variant's kernels
    (`gdngen.backends.pallas.core.packed_gated_delta`); arguments as `gated_delta` with
    ``cu_seqlens`` int32 ``[N+1]``."""
    return SPEC.packed_entry(q, k, v, g, beta, initial_state, mask=mask, scale=scale,
                             gate=gate, variant=variant, cu_seqlens=cu_seqlens,
                             templates_dir=templates_dir)


class PallasGPU(pallas_core.PallasBackend):
    """The generated Pallas kernels of this module; its hooks are the module's functions
    (looked up when called,
    `gdngen.backends.pallas.core.PallasBackend`)."""

    name, config, tolerances, dtypes = BACKEND, Config, POLICY_TOLERANCES, INPUT_DTYPES
    device_kinds, device_limit, reference_device = ("gpu",), "shared_memory", "h100"

    footprint_function = "shared_memory_bytes"


SPEC = PallasGPU(__name__)
