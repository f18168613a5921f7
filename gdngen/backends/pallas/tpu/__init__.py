"""Pallas TPU backend: generated Mosaic kernels for the chunkwise gated delta rule.

The kernels are rendered from ``templates/pallas_tpu/`` (forward and backward module, every
variant parameter baked in as a constant) and wired into ``jax.custom_vjp``. A third module, the
recurrent kernel (``recurrent.py``: the state held in VMEM for the whole walk over T, one step at
a time, forward only), evaluates short calls (T < ``recurrent_below``, whose VJP is the chunk
path's). On a TPU they compile with Mosaic; elsewhere they run in TPU interpret mode
(``pltpu.InterpretParams``: simulated VMEM, uninitialised buffers filled with NaN, dynamic race
detection), with a warning once per process.

Per-channel (vector) gates: the same forward and backward templates rendered with
``per_channel`` set are the two chunk walks of `gdngen.algebra.chunkwise_channel` (`chunk_walks`:
the state, and in reverse its cotangent, carried in VMEM over the chunk axis); the intra-chunk
stages stay its shared jnp code (not fused into the kernels yet). Calls of T >=
``recurrent_below`` evaluate through `gdngen.algebra.chunkwise_channel.forward` with the kernel
walk, shorter ones through the recurrent kernel, and every differentiated call takes
`gdngen.algebra.chunkwise_channel.backward` with the kernel walks. Their variant space is the walk's
parameters (``chunk_size``, ``head_tile``, ``dv_tile``; ieee, saving states), and they are
tuned. Validated as the scalar variants (`gdngen.validate.run_battery`, interpret mode, poisoned
outputs): worst relative L2 error over every per-channel battery case and quantity (dg in both
conventions), default variant, float32: 6.7e-7 (dbeta, vector_identical_keys; the other cases <=
3.0e-7).

Variant parameters (`variant_space`):

* ``chunk_size`` 32 | 64 | 128: steps per chunk.
* ``head_tile``: value heads per program, sharing their key head's K K^T and Q K^T (a divisor of
  the group Hv/Hk; on a problem with another group the largest divisor not above it is used).
* ``dv_tile``: value columns per grid step (128-multiples dividing Dv; any other value, e.g. Dv
  itself, means the whole Dv).
* ``precision``: matmul policy, see `PRECISIONS` and `POLICY_TOLERANCES`. The decay segment sums
  and the exact unit-lower-triangular inverse always run at float32 (Precision.HIGHEST).
* ``save_states``: the forward saves each chunk's entering state and T = (I + A)^-1 for the
  backward, or the backward recomputes them (one more state walk and the inverse).
* ``recurrent_below``: calls with fewer steps run the recurrent kernel's forward (its Dv split is
  ``dv_tile``'s; it does not change any rendered source).

Packed rows (``cu_seqlens``, `gdngen.algebra.packed`), scalar gates: `packed_gated_delta` runs the
row's chunk walk on the variant's packed build (`render_packed`: the same templates with ``packed``
set; the forward also takes a state per chunk ``[B, Hv, N, Dv, Dk]`` added to the state leaving
it and always returns the entering states, the backward also takes their cotangent and returns
the injection's) and each sequence's one-chunk calls (initial-state response, final state from
its last chunk's entering state) on the dense chunk kernels, float32. With ``packed`` unset the
templates render the dense kernels byte for byte (tuned entries keep their sha256). Per-channel
packed rows run on the portable chunk path.

Layer inputs (``qk_norm=True``, a parameterised gate ``gate="softplus"`` / ``"sigmoid_bound"``;
`gdngen.backends.kernel_inputs`): the kernels compute them in their own loads. `render_fused`
renders the recurrent kernel and (scalar gates) the chunk forward kernel once per
`KernelInputs.context` (the runtime ``lower_bound`` is an operand: one build serves every
bound): they take the raw q, k and L2-normalise each loaded row in float32 (q then scaled), and
take the raw projection ``a`` where the decay / log gate was, with ``a_log``, ``dt_bias``
(``[Hv]`` per head, ``[Hv, Dk]`` per channel) as operands, forming log g (a = -inf: exactly 0)
and its exp or segment sums there. The chunk backward runs the plain kernels on inputs the
custom VJP recomputes (`gdngen.backends.generated.custom_vjp_core` with ``forward_fuses``), so
only the raw arrays are kept. Per-channel chunk calls compute them in
`gdngen.backends.portable.jax_chunkwise`'s custom VJP (its intra-chunk stages are jnp). The plain
renders are byte for byte those of before (tuned entries keep their sha256).

Only ``gdngen.variant`` / ``gdngen.render`` run at import; jax is imported when kernels are
rendered or run.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import math
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
from gdngen.devices import MiB
from gdngen.variant import Problem, Variant

BACKEND = "pallas_tpu"
CHUNK_SIZES = (32, 64, 128)
#: matmul precision policies: ieee = float32 operands at Precision.HIGHEST; tf32 = three bfloat16
#: passes (hi*hi + hi*lo + lo*hi; Precision.HIGH where the installed jax lowers it for Mosaic);
#: bf16 = one bfloat16 pass. Accumulation is float32 in all three.
PRECISIONS = ("ieee", "tf32", "bf16")
#: Relative L2 error each policy is validated at (`gdngen.tolerance`: the battery's own
#: tolerance for the input dtype applies when it is larger). Worst error measured by
#: ``gdngen build`` in TPU interpret
#: mode, float32 inputs, over every scalar-gate battery case, quantity and variant of
#: Problem(2, 4, 128, 128) and Problem(1, 3, 128, 128) (72 variants, all passing):
#:
#:   policy  tolerance  measured worst   (quantity / case that reaches it)
#:   ieee    5e-5       1.2e-6           dbeta, dg
#:   tf32    2e-4       2.7e-5           dbeta (identical_keys)
#:   bf16    2e-2       1.6e-2           dbeta (identical_keys; other cases <= 5e-3)
POLICY_TOLERANCES = {"ieee": 5e-5, "tf32": 2e-4, "bf16": 2e-2}
INPUT_DTYPES = ("float32", "bfloat16")
#: log gates are clamped to this finite floor inside the kernels (exp gives exactly 0 either
#: way, and a 0/1 matmul never meets 0 * -inf); the gate cotangent uses the true gates.
LOG_GATE_FLOOR = -1e30


# ----------------------------------------------------------------------------- variant space


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _dv_tiles(dv: int) -> list[int]:
    """Dv tiles legal for Mosaic blocks: the whole Dv, or a 128-multiple dividing it."""
    return [t for t in range(128, dv, 128) if dv % t == 0] + [dv]

#: untuned crossover T (`gdngen.config.recurrent_switch`): one chunk (below it the chunk
#: kernels pad to a whole chunk); not measured on a TPU, the tuner measures it there
RECURRENT_BELOW = 64
#: steps per grid block of the recurrent kernel when T exceeds it (a 128-multiple: the value-side
#: blocks carry one step per lane); shorter calls run as one block of T steps
RECURRENT_TIME_BLOCK = 128

@dataclass(frozen=True)
class Config(VariantConfig):
    """Typed pallas_tpu parameters (see the module docstring)."""

    backend = BACKEND
    chunk_size: int = 64
    dv_tile: int = 128
    head_tile: int = 1
    precision: str = "ieee"
    save_states: bool = True
    recurrent_below: int = recurrent_switch(RECURRENT_BELOW)

    def check(self) -> None:
        self.check_count("recurrent_below")
        self.check_choice("chunk_size", CHUNK_SIZES)
        self.check_positive_int("dv_tile")
        self.check_positive_int("head_tile")
        self.check_choice("precision", PRECISIONS)
        self.check_flag("save_states")


def kernel_params(variant: Variant, problem: Problem) -> dict:
    """The variant's parameters resolved for ``problem``: ``chunk_size``, ``head_tile`` (a
    divisor of the group), ``dv_tile`` (dividing Dv), ``precision``, ``save_states``.

    ValueError for a variant of another backend, unknown or missing parameters, bad values, or
    a problem the backend does not implement.
    """
    config = SPEC.parse(variant)
    SPEC.check(problem)
    return {
        "chunk_size": config.chunk_size,
        "head_tile": max(d for d in _divisors(problem.group) if d <= config.head_tile),
        "dv_tile": config.dv_tile if config.dv_tile in _dv_tiles(problem.Dv) else problem.Dv,
        "precision": config.precision,
        "save_states": config.save_states,
    }


def _padded_bytes(shape, itemsize: int = 4) -> int:
    """VMEM footprint of a block: the last two dims padded to the (8 or 16, 128) tile."""
    *lead, rows, cols = shape
    sublanes = 8 * (4 // itemsize)
    return (math.prod(lead) * (-(-rows // sublanes) * sublanes) * (-(-cols // 128) * 128)
            * itemsize)


def vmem_bytes(variant: Variant, problem: Problem) -> int:
    """Static VMEM estimate of the variant's largest kernel (forward or backward), in bytes:
    double-buffered blocks, scratch, and a working set of live chunk-sized temporaries."""
    p = kernel_params(variant, problem)
    C, ht, tv = p["chunk_size"], p["head_tile"], p["dv_tile"]
    Dk, Dv = problem.Dk, problem.Dv
    isz = 2 if problem.dtype == "bfloat16" else 4
    tiled = tv < Dv

    def b(shape, itemsize=4):
        return _padded_bytes(shape, itemsize)

    cc, ck, c1 = b((ht, C, C)), b((ht, C, Dk)), b((ht, C, 1))
    key, state, tile_state = b((C, Dk), isz), b((ht, Dv, Dk)), b((ht, tv, Dk))
    values = b((ht, C, tv), isz)
    gates = 2 * c1 + b((ht, 1, C))  # g_col, beta, g_row
    forward_blocks = 2 * key + values + gates + state + values + state
    if p["save_states"]:
        forward_blocks += tile_state + cc
    forward_scratch = state + (3 * cc + 2 * ck + c1 + b((ht, 1, 1)) if tiled else 0)
    # live per head of the tile at ieee (Mosaic's float32 matmuls keep their split operands;
    # measured against the compiler's scoped VMEM, docs/COMPILE.md), once at tf32 / bf16
    per_head = ht if p["precision"] == "ieee" else 1
    temps = per_head * (8 * b((C, C)) + 4 * b((C, Dk)) + 3 * b((C, tv)) + 2 * b((tv, Dk)))
    forward = 2 * forward_blocks + forward_scratch + temps
    backward_blocks = (2 * key + values + gates + tile_state + (cc if p["save_states"] else 0)
                       + values + state  # inputs: ..., s_in, [tinv], dy, dsf
                       + 2 * b((C, Dk)) + values + 4 * c1 + cc + b((ht, 1, 1)) + state)
    backward_scratch = state + ((5 * cc + 4 * ck + 4 * c1 + 2 * b((ht, 1, 1)) + 2 * b((C, C))
                                 + 2 * ck + c1) if tiled else 0)
    backward = (2 * backward_blocks + backward_scratch + temps
                + per_head * (4 * b((C, C)) + 2 * b((C, Dk))))
    if problem.gate == "vector":  # the chunk walks and the recurrent kernel
        return max(walk_vmem_bytes(variant, problem), recurrent_vmem_bytes(variant, problem))
    return max(forward, backward, recurrent_vmem_bytes(variant, problem))


def walk_vmem_bytes(variant: Variant, problem: Problem) -> int:
    """Static VMEM estimate of the per-channel chunk walks (forward or reverse, the larger), in
    bytes: double-buffered blocks (all float32), the carried state and the Dv-tile sums, and a
    working set of chunk-sized temporaries."""
    p = kernel_params(variant, problem)
    C, ht, tv = p["chunk_size"], p["head_tile"], p["dv_tile"]
    Dk, Dv = problem.Dk, problem.Dv
    b = _padded_bytes
    values, keys, column = b((ht, C, tv)), b((ht, C, Dk)), b((ht, 1, Dk))
    state, tile_state = b((ht, Dv, Dk)), b((ht, tv, Dk))
    temps = 3 * b((C, tv)) + 2 * b((tv, Dk)) + b((C, Dk))
    # in: u, wk, kc, qd, pm, dcc, s0; out: y, sf, s_in, w
    forward = 2 * (3 * values + 3 * keys + b((ht, C, C)) + column + 2 * state + tile_state)
    # in: g, kc, wk, w, s_in, dy, qd, dcc, dsf; out: dw, dwk, dqd, dkc, ddcc, ds0
    backward = (2 * (4 * values + 6 * keys + 2 * column + tile_state + 2 * state)
                + (3 * keys + column if tv < Dv else 0))
    return max(forward, backward) + state + temps


def recurrent_vmem_bytes(variant: Variant, problem: Problem) -> int:
    """Static VMEM estimate of the recurrent kernel at its largest time block, in bytes:
    double-buffered blocks, the state scratch, and the loop's carry and temporaries."""
    tv, Dk = kernel_params(variant, problem)["dv_tile"], problem.Dk
    tt = RECURRENT_TIME_BLOCK
    b = _padded_bytes
    gate = b((tt, Dk)) if problem.gate == "vector" else b((tt, 1))
    blocks = 2 * b((tt, Dk)) + 2 * b((tv, tt)) + gate + b((tt, 1)) + 2 * b((tv, Dk))
    return 2 * blocks + b((tv, Dk)) + 4 * b((tv, Dk)) + 3 * b((tv, tt))


def _vmem_limit(estimate: int) -> int:
    """Scoped-VMEM limit passed to Mosaic: the estimate plus 25%, at least 16 MiB."""
    return max(16 * MiB, -(-int(estimate * 1.25) // MiB) * MiB)


def variant_space(problem: Problem, device) -> list[Config]:
    """Every variant whose `vmem_bytes` fits ``device``'s ``vmem_budget`` (gdngen.devices). For
    per-channel gates only the walks' parameters vary (chunk, head tile, Dv tile), at ieee,
    saving states."""
    SPEC.check(problem)
    budget = device.limits["vmem_budget"]
    vector = problem.gate == "vector"
    space = []
    for chunk, precision, head_tile, dv_tile, save in itertools.product(
            CHUNK_SIZES, ("ieee",) if vector else PRECISIONS, _divisors(problem.group),
            _dv_tiles(problem.Dv), (True,) if vector else (True, False)):
        config = Config(chunk, dv_tile, head_tile, precision, save)
        if vmem_bytes(Variant(BACKEND, config.params()), problem) <= budget:
            space.append(config)
    return space


def default_config(problem: Problem, device) -> Config:
    """Chunk 64, ieee, the whole group per program and the whole Dv per step, saving states;
    where that does not fit ``device``'s VMEM budget, the ieee variant that fits and is closest
    to it (saving states, chunk nearest 64, then the widest head and Dv tiles)."""
    ideal = Config(64, problem.Dv, problem.group, "ieee", True)
    if vmem_bytes(Variant(BACKEND, ideal.params()), problem) <= device.limits["vmem_budget"]:
        return ideal
    fits = [c for c in variant_space(problem, device) if c.precision == "ieee"]
    if not fits:
        raise ValueError(f"no {BACKEND} variant of {problem.key()} fits the "
                         f"{device.limits['vmem_budget'] // MiB} MiB VMEM budget of "
                         f"{device.name}")
    return min(fits, key=lambda c: (not c.save_states, abs(c.chunk_size - 64), -c.head_tile,
                                    -c.dv_tile))


# ----------------------------------------------------------------------------- rendering


@functools.cache
def mosaic_lowers_precision_high() -> bool:
    """Whether the installed jax lowers ``Precision.HIGH`` matmuls for Mosaic (probed by
    lowering a tiny kernel for the TPU platform; no TPU needed)."""
    import jax
    import jax.numpy as jnp

    pl = jaxcompat.pallas()

    def kernel(x_ref, o_ref):
        o_ref[...] = jnp.dot(x_ref[...], x_ref[...], precision=jax.lax.Precision.HIGH,
                             preferred_element_type=jnp.float32)

    def f(x):
        return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape, jnp.float32))(x)

    try:
        jax.jit(f).trace(jnp.zeros((128, 128), jnp.float32)).lower(lowering_platforms=("tpu",))
    except Exception:  # noqa: BLE001 - NotImplementedError from the lowering rule, or no Mosaic
        return False
    return True


def render_plan(variant: Variant, problem: Problem) -> dict:
    """``{"forward.py": (template, context), "backward.py": (template, context), "recurrent.py":
    (template, context)}``; for a per-channel (vector) gate problem the forward and backward
    sources are the chunk walks (``per_channel`` set).

    The context holds the parameters resolved for ``problem`` (`kernel_params`), not the raw
    variant, so variants that resolve alike on a shape render the same sources (one compile;
    ``save_states`` and the input dtype reach no per-channel walk).
    The recurrent kernel's: the head dims, ``dv_tile`` (its Dv split), ``per_channel`` (the
    problem's gate kind) and ``time_block`` (`RECURRENT_TIME_BLOCK`); not the input dtype (it
    runs float32) nor ``recurrent_below``.
    """
    p = kernel_params(variant, problem)
    heads = {"dk": problem.Dk, "dv": problem.Dv, "dv_tile": p["dv_tile"],
             "n_dv": problem.Dv // p["dv_tile"], "hk": problem.Hk, "hv": problem.Hv,
             "group": problem.group}
    recurrent = ("pallas_tpu/recurrent.py.j2", {
        **heads,
        "per_channel": problem.gate == "vector",
        "time_block": RECURRENT_TIME_BLOCK,
        "vmem_limit_bytes": _vmem_limit(recurrent_vmem_bytes(variant, problem)),
        "steps": False,  # `render_steps` sets it; off, the recurrent kernel renders unchanged
        **PLAIN_INPUTS,
    })
    context = {
        "problem_key": problem.key(),
        "chunk": p["chunk_size"],
        **heads,
        "head_tile": p["head_tile"],
        "n_head_tiles": problem.group // p["head_tile"],
        "dtype": problem.dtype,
        "precision": p["precision"],
        "tf32_native": p["precision"] == "tf32" and mosaic_lowers_precision_high(),
        "save_states": p["save_states"],
        "vmem_limit_bytes": _vmem_limit(vmem_bytes(variant, problem)),
        "packed": False,  # `render_packed` sets it; off, the dense kernels render unchanged
        "per_channel": problem.gate == "vector",  # the chunk walks of chunkwise_channel
        **PLAIN_INPUTS,
    }
    return {"forward.py": ("pallas_tpu/forward.py.j2", context),
            "backward.py": ("pallas_tpu/backward.py.j2", context),
            "recurrent.py": recurrent}


#: the template context of a plain build: nothing computed in the loads (`render_fused` sets
#: these, `gdngen.backends.kernel_inputs.KernelInputs.context`)
PLAIN_INPUTS = {"qk_norm": False, "gate_form": None}


def render_fused(variant: Variant, problem: Problem, inputs, *, templates_dir=None):
    """The fused build of ``variant`` for ``inputs`` (a `gdngen.backends.kernel_inputs.
    KernelInputs` that fuses something): the recurrent kernel and, for scalar gates, the chunk
    forward kernel rendered with ``inputs.context()``, so they take raw q, k (normalised per
    loaded row, float32, q then scaled) and, with a gate form, the raw projection ``a`` where
    the decay / log gate was plus ``a_log``, ``dt_bias`` (and the runtime ``lower_bound``)
    operands, computing the log gate in their loads. Named ``recurrent<tag>.py``,
    ``forward<tag>.py``. The backward kernels are not in it (they take the recomputed inputs:
    the plain build's); per-channel chunk walks are not either (their intra-chunk stages are
    jnp, `gdngen.backends.portable.jax_chunkwise`)."""
    names = ("recurrent.py",) if problem.gate == "vector" else ("recurrent.py", "forward.py")
    return pallas_core.render_fused(SPEC, variant, problem, names, inputs,
                                  templates_dir=templates_dir,
                                  context={"qk_norm_eps": repr(QK_NORM_EPS),
                                           "log_gate_floor": repr(LOG_GATE_FLOOR)})


# ----------------------------------------------------------------------------- loading

_LOADED: dict = {}


_INTERPRET_OVERRIDE: list = []


@functools.cache
def _default_interpret_mode():
    import jax

    pltpu = jaxcompat.pallas_tpu()

    if jax.default_backend() == "tpu":
        return False
    warnings.warn(f"gdngen {BACKEND}: no TPU attached; the generated kernels run in TPU "
                  "interpret mode (slow; for validation)", RuntimeWarning,
                  stacklevel=settings.caller_stacklevel())
    return pltpu.InterpretParams(detect_races=True)


def interpret_mode():
    """False on a TPU (a real Mosaic compile); else the TPU interpret-mode parameters (race
    detection on, uninitialised memory NaN, one simulated core), with a warning once per
    process; inside `interpreting` the parameters given there."""
    return _INTERPRET_OVERRIDE[-1] if _INTERPRET_OVERRIDE else _default_interpret_mode()


@contextlib.contextmanager
def interpreting(params):
    """Run the kernels with these ``pltpu.InterpretParams`` inside the block (e.g.
    ``num_cores_or_threads=2``: the parallel grid axes split over two simulated TensorCores,
    as on megacore chips), whatever device is attached."""
    _INTERPRET_OVERRIDE.append(params)
    try:
        yield params
    finally:
        _INTERPRET_OVERRIDE.pop()


def clear_cache() -> None:
    """Drop every loaded variant and jax's compiled executables (a build calls this between
    variants; interpret-mode executables are large)."""
    import jax

    _LOADED.clear()
    chunk_core.cache_clear()
    packed_core.cache_clear()
    chunk_walks.cache_clear()
    entering_core.cache_clear()
    jax.clear_caches()


def load_kernels(variant: Variant, problem: Problem, *, templates_dir=None):
    """Render ``variant`` for ``problem`` and load it (cached by the sources' sha256 and the
    interpret-mode parameters).

    Returns a namespace: ``forward``/``backward``/``recurrent`` (the generated modules),
    ``run_forward``, ``run_backward``, ``run_recurrent`` and, for variants that recompute,
    ``run_chunk_states`` (their functions jitted with ``scale``/``interpret`` static: a pair,
    top-level and nested), ``sha256``, ``variant``, ``problem``, ``params`` (`kernel_params`),
    ``interpret`` (what they run with). For a vector-gate problem ``forward``/``backward``
    are the per-channel chunk walks (``run_forward``/``run_backward`` with only ``interpret``
    static; see `chunk_walks`).
    """
    rendered = SPEC.render(variant, problem, templates_dir=templates_dir)
    key = (rendered.sha256, interpret_mode())
    if key not in _LOADED:
        modules = {name: exec_module(BACKEND, name, source, rendered.sha256)
                   for name, source in rendered.sources.items()}
        interpret = interpret_mode()
        fwd, bwd, rec = (modules[name] for name in ("forward.py", "backward.py", "recurrent.py"))
        static = ("interpret",) if problem.gate == "vector" else ("scale", "interpret")

        kernels = types.SimpleNamespace(
            forward=fwd, backward=bwd, recurrent=rec, sha256=rendered.sha256, variant=variant,
            problem=problem, params=kernel_params(variant, problem), interpret=interpret,
            run_recurrent=jit_pair(rec.recurrent, ("scale", "interpret"), interpret),
            run_forward=jit_pair(fwd.forward, static, interpret),
            run_backward=jit_pair(bwd.backward, static, interpret))
        if hasattr(fwd, "chunk_states"):
            kernels.run_chunk_states = jit_pair(fwd.chunk_states, ("interpret",), interpret)
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
    forward and backward templates with ``packed`` set. The forward (and the recomputing variants'
    state walk) also takes an injected state per chunk ``[B, Hv, N, Dv, Dk]``, added to the
    state leaving the chunk, and always returns the entering states; the backward also takes
    their cotangent and returns the injection's (the template headers). With ``packed`` unset
    the templates render the dense kernels byte for byte."""
    p = kernel_params(variant, problem)
    extra = 4 * _padded_bytes((p["head_tile"], p["dv_tile"], problem.Dk))  # inject/S_in blocks
    return pallas_core.render_packed(
        SPEC, variant, problem, ("forward.py", "backward.py"), templates_dir=templates_dir,
        context={"vmem_limit_bytes": _vmem_limit(vmem_bytes(variant, problem) + extra)})


def load_packed_kernels(variant: Variant, problem: Problem, *, templates_dir=None):
    """`render_packed`, loaded (cached as `load_kernels`): a namespace with ``forward``,
    ``backward``, ``run_forward``, ``run_backward`` (and ``run_chunk_states`` for variants that
    recompute), ``sha256``, ``variant``, ``problem``, ``params``, ``interpret``."""
    rendered = render_packed(variant, problem, templates_dir=templates_dir)
    interpret = interpret_mode()
    key = (rendered.sha256, interpret)
    if key not in _LOADED:
        kernels = pallas_core.load_packed(BACKEND, rendered, kernel_params(variant, problem),
                                        interpret)
        if hasattr(kernels.forward, "chunk_states"):
            kernels.run_chunk_states = jit_pair(kernels.forward.chunk_states, ("interpret",),
                                                interpret)
        _LOADED[key] = kernels
    return _LOADED[key]


def render_steps(variant: Variant, problem: Problem, *, templates_dir=None):
    """The recurrent kernel returning the state after every step (`pallas_core.render_steps`):
    each program also writes its ``[dv_tile, Dk]`` rows of each step's state, a block of
    ``[time block, dv_tile, Dk]`` per grid step (its VMEM limit counts that block)."""
    tv = kernel_params(variant, problem)["dv_tile"]
    blocks = 2 * RECURRENT_TIME_BLOCK * _padded_bytes((tv, problem.Dk))
    return pallas_core.render_steps(
        SPEC, variant, problem, templates_dir=templates_dir,
        context={"vmem_limit_bytes": _vmem_limit(recurrent_vmem_bytes(variant, problem)
                                                 + blocks)})


def load_steps_kernels(variant: Variant, problem: Problem, *, templates_dir=None):
    """`render_steps`, loaded (cached as `load_kernels`): ``recurrent``, ``run_recurrent``."""
    return pallas_core.load_steps(BACKEND, render_steps(variant, problem,
                                                        templates_dir=templates_dir),
                                  kernel_params(variant, problem), interpret_mode(), _LOADED)


def _check_races(outputs, what: str, interpret) -> None:
    """Raise if TPU interpret mode's race detector flagged the kernel that produced
    ``outputs`` (only when they are concrete: under an outer jit the check is skipped)."""
    import jax

    if not getattr(interpret, "detect_races", False):
        return
    leaves = jax.tree.leaves(outputs)
    if any(isinstance(x, jax.core.Tracer) for x in leaves):
        return
    jax.block_until_ready(leaves)
    races = getattr(jaxcompat.tpu_interpreter(), "races", None)
    if races is not None and races.races_found:
        raise RuntimeError(f"TPU interpret mode detected a data race in the {what} kernel")


def _run_kernel(fns, *args, what: str, interpret, **kwargs):
    """Run a kernel function (``fns``: its top-level and nested jit, see `load_kernels`); in
    interpret mode, check it for races, and reset the interpreter's shared state if it raised
    (jax requires that before the next kernel)."""
    try:
        outputs = pallas_core.call_sequential_under_vmap(fns, *args, interpret=interpret,
                                                       **kwargs)
        _check_races(outputs, what, interpret)
    except Exception:
        if interpret:
            jaxcompat.pallas_tpu().reset_tpu_interpret_mode_state()
        raise
    return outputs


def lower_check(variant: Variant, problem: Problem, *, batch: int = 1, chunks: int = 2,
                inputs=None) -> dict:
    """Lower the variant's kernels (forward, backward and, if it recomputes, the chunk-state
    walk; the recurrent kernel, over one short block and over two whole time blocks and a tail)
    through Mosaic for the TPU platform, which needs no TPU; returns
    ``{kernel name: StableHLO text}`` (a vector-gate problem: ``channel_walk`` and
    ``channel_walk_backward``, the per-channel chunk walks, instead of forward and backward).
    ``inputs`` (a `gdngen.backends.kernel_inputs.KernelInputs` that fuses something): the
    kernels of its fused build instead (`render_fused`: ``recurrent``, ``recurrent_blocks``
    and, for scalar gates, ``forward``).
    Raises what the Mosaic lowering raises (unsupported ops, illegal block shapes, ...). The
    TPU compiler's own passes run only on a TPU."""
    import jax
    import jax.numpy as jnp

    if inputs is not None:
        return _lower_fused(variant, problem, inputs, batch=batch, chunks=chunks)
    kernels = load_kernels(variant, problem)
    C, Dk, Dv, Hk, Hv = kernels.params["chunk_size"], problem.Dk, problem.Dv, problem.Hk, problem.Hv
    spec = jax.ShapeDtypeStruct
    f32, dtype = jnp.float32, jnp.dtype(problem.dtype)
    B, N = batch, chunks
    key, values = spec((B, Hk, N, C, Dk), dtype), spec((B, Hv, N, C, Dv), dtype)
    g_col, g_row = spec((B, Hv, N, C, 1), f32), spec((B, Hv, N, 1, C), f32)
    state, states = spec((B, Hv, Dv, Dk), f32), spec((B, Hv, N, Dv, Dk), f32)
    tinv = (spec((B, Hv, N, C, C), f32),) if kernels.params["save_states"] else ()

    def lower(fn, *args, **static):
        return (jax.jit(fn, static_argnames=tuple(static)).trace(*args, **static)
                .lower(lowering_platforms=("tpu",)).as_text())

    static = {"scale": Dk ** -0.5, "interpret": False}
    lowered = {}
    decay_tail = (Dk,) if problem.gate == "vector" else ()
    for name, T in (("recurrent", 5), ("recurrent_blocks", 2 * RECURRENT_TIME_BLOCK + 3)):
        lowered[name] = lower(kernels.recurrent.recurrent, spec((B, T, Hk, Dk), f32),
                              spec((B, T, Hk, Dk), f32), spec((B, T, Hv, Dv), f32),
                              spec((B, T, Hv) + decay_tail, f32), spec((B, T, Hv), f32), state,
                              **static)
    if problem.gate == "vector":
        chunk_values, chunk_keys = spec((N, B, Hv, C, Dv), f32), spec((N, B, Hv, C, Dk), f32)
        dcc, chunk_states = spec((N, B, Hv, 1, Dk), f32), spec((N, B, Hv, Dv, Dk), f32)
        lowered["channel_walk"] = lower(kernels.forward.forward, chunk_values, chunk_keys,
                                        chunk_keys, chunk_keys, spec((N, B, Hv, C, C), f32), dcc,
                                        state, interpret=False)
        lowered["channel_walk_backward"] = lower(
            kernels.backward.backward, chunk_values, chunk_keys, chunk_keys, chunk_values,
            chunk_states, chunk_values, chunk_keys, dcc, state, interpret=False)
        return _check_lowered(lowered)
    lowered |= {
        "forward": lower(kernels.forward.forward, key, key, values, g_col, g_row, g_col, state,
                         **static),
        "backward": lower(kernels.backward.backward, key, key, values, g_col, g_row, g_col,
                          states, *tinv, values, state, **static),
    }
    if not kernels.params["save_states"]:
        lowered["chunk_states"] = lower(kernels.forward.chunk_states, key, values, g_col, g_row,
                                        g_col, state, interpret=False)
    return _check_lowered(lowered)


def _lower_fused(variant: Variant, problem: Problem, inputs, *, batch: int, chunks: int) -> dict:
    """`lower_check` of the fused build of ``inputs``."""
    import jax
    import jax.numpy as jnp

    kernels = load_fused_kernels(variant, problem, inputs)
    C, Dk, Dv, Hk, Hv = kernels.params["chunk_size"], problem.Dk, problem.Dv, problem.Hk, problem.Hv
    spec, f32, dtype = jax.ShapeDtypeStruct, jnp.float32, jnp.dtype(problem.dtype)
    B, N = batch, chunks
    vector = problem.gate == "vector"
    parameter = spec((Hv, Dk) if vector else (Hv,), f32)
    gate = ((parameter, parameter) + ((spec((), f32),) if inputs.gate_form == "sigmoid_bound"
                                      else ())) if inputs.gate_form else ()

    def lower(fn, *args):
        static = {"scale": Dk ** -0.5, "interpret": False}
        return (jax.jit(fn, static_argnames=tuple(static)).trace(*args, **static)
                .lower(lowering_platforms=("tpu",)).as_text())

    state = spec((B, Hv, Dv, Dk), f32)
    lowered = {}
    for name, T in (("recurrent", 5), ("recurrent_blocks", 2 * RECURRENT_TIME_BLOCK + 3)):
        keys = spec((B, T, Hk, Dk), f32)
        lowered[name] = lower(kernels.recurrent.recurrent, keys, keys, spec((B, T, Hv, Dv), f32),
                              spec((B, T, Hv) + ((Dk,) if vector else ()), f32),
                              spec((B, T, Hv), f32), state, *gate)
    if not vector:
        key, g_col = spec((B, Hk, N, C, Dk), dtype), spec((B, Hv, N, C, 1), f32)
        lowered["forward"] = lower(kernels.forward.forward, key, key,
                                   spec((B, Hv, N, C, Dv), dtype), g_col,
                                   spec((B, Hv, N, 1, C), f32), g_col, state, *gate)
    return _check_lowered(lowered)


def _check_lowered(lowered: dict) -> dict:
    for name, text in lowered.items():
        if "tpu_custom_call" not in text:
            raise RuntimeError(f"the {name} kernel did not lower to a Mosaic custom call")
    return lowered


# ----------------------------------------------------------------------------- custom VJP core


def _to_kernel_layout(q, k, v, gates, beta, S0, gate):
    """Chunk layout of `gdngen.algebra.chunkwise` (q, k [N, B, Hk, C, Dk]; v [N, B, Hk, r, C, Dv];
    gates, beta [N, B, Hk, r, C]; S0 [B, Hk, r, Dv, Dk]) -> the kernels' layout (see the
    forward template), as a dict."""
    import jax.numpy as jnp

    log_gates = gates if gate == "log" else jnp.log(gates)
    return _kernel_layout(q, k, v, jnp.maximum(log_gates, LOG_GATE_FLOOR), beta, S0)


def _kernel_layout(q, k, v, per_step, beta, S0):
    """`_to_kernel_layout` with ``per_step`` [N, B, Hk, r, C] (the finite log gates, or a fused
    build's raw projection ``a``) laid out as ``g_col`` / ``g_row`` unchanged."""
    import jax.numpy as jnp

    B, Hk, r = v.shape[1:4]

    def keys(x):  # [N, B, Hk, C, Dk] (or with a unit value-head axis) -> [B, Hk, N, C, Dk]
        return jnp.moveaxis(x.reshape(x.shape[:3] + x.shape[-2:]), 0, 2)

    b = _to_heads(per_step)
    return {"q": keys(q), "k": keys(k), "v": _to_heads(v), "g_col": b[..., None],
            "g_row": b[..., None, :], "beta": _to_heads(beta)[..., None],
            "s0": S0.reshape((B, Hk * r) + S0.shape[-2:])}


def _to_fused_layout(q, k, v, gates, beta, S0, gate, inputs):
    """`_to_kernel_layout` for the fused forward kernel of ``inputs`` (raw primals of
    `gdngen.backends.generated.custom_vjp_core` with ``forward_fuses``): q, k as given (raw
    with ``qk_norm``); with a gate form ``gates`` is ``(a, A_log, dt_bias)`` (A_log, dt_bias
    ``[Hk, r, 1]``), ``g_col`` / ``g_row`` hold ``a`` (-inf kept: an identity step) and
    ``"gate"`` the operands after it (`gdngen.backends.pallas.core.fused_gate_operands`);
    otherwise ``gates`` in ``gate``'s convention, laid out as `_to_kernel_layout` does."""
    if inputs.gate_form is None:
        return dict(_to_kernel_layout(q, k, v, gates, beta, S0, gate), gate=())
    a, A_log, dt_bias = gates
    Hv, Dk = v.shape[2] * v.shape[3], k.shape[-1]
    return dict(_kernel_layout(q, k, v, a, beta, S0),
                gate=pallas_core.fused_gate_operands(inputs, A_log, dt_bias, Hv, Dk, False))


def _to_heads(x):
    """Chunk layout [N, B, Hk, r, C, ...] -> [B, Hv, N, C, ...]."""
    import jax.numpy as jnp

    x = jnp.moveaxis(x, 0, 3)
    return x.reshape((x.shape[0], x.shape[1] * x.shape[2]) + x.shape[3:])


def _from_heads(x, Hk):
    """[B, Hv, N, C, ...] -> chunk layout [N, B, Hk, r, C, ...]."""
    import jax.numpy as jnp

    B, Hv = x.shape[:2]
    return jnp.moveaxis(x.reshape((B, Hk, Hv // Hk) + x.shape[2:]), 3, 0)


def _gate_cotangent(gates, gate, dd11, dd0, ddc, ddcc):
    """d(gates) from the kernels' decay-factor cotangents, by the straddle-sum rule of
    `gdngen.algebra.chunkwise` (``decay_factors_log_vjp`` / ``decay_factors_linear_vjp``: exact at
    g = 0). Inputs [B, Hv, N, ...]; gates in their own convention."""
    import jax.numpy as jnp

    rows = jnp.concatenate([dd0, dd11], axis=-1)  # positions 1..C of dD, columns 0..C
    last = rows[..., -1, :] + jnp.concatenate([ddcc[..., 0, :], ddc[..., 0]], axis=-1)
    dD = jnp.concatenate([jnp.zeros(rows.shape[:-2] + (1, rows.shape[-1]), rows.dtype),
                          rows[..., :-1, :], last[..., None, :]], axis=-2)
    return pallas_core.gate_cotangent(gates, gate, dD)


def _cotangents(primals, grads, gate):
    """The kernels' gradients -> cotangents of the core's primals (chunk layout, their dtypes)."""
    import jax.numpy as jnp

    q, k, v, gates, _, S0 = primals
    dq, dk, dv, dbeta, dd11, dd0, ddc, ddcc, ds0 = grads
    B, Hk = v.shape[1:3]

    def key_grad(x, like):  # [B, Hk * tiles, N, C, Dk] partials -> chunk layout
        x = x.reshape((B, Hk, -1) + x.shape[2:]).sum(axis=2)
        return jnp.moveaxis(x, 2, 0).reshape(like.shape).astype(like.dtype)

    dgates = _gate_cotangent(_to_heads(gates), gate, dd11, dd0, ddc, ddcc)
    return (key_grad(dq, q), key_grad(dk, k), _from_heads(dv, Hk).astype(v.dtype),
            _from_heads(dgates, Hk), _from_heads(dbeta[..., 0], Hk), ds0.reshape(S0.shape))


@functools.cache
def chunk_core(key: tuple, gate, scale: float, qk_norm: bool = False,
               fused_key: tuple | None = None):
    """`gdngen.algebra.chunkwise` core (chunk layout in and out) for the loaded kernels ``key``
    (sha256, interpret parameters), with the
    generated backward as its ``jax.custom_vjp``. Layout changes and the gate epilogue are
    jitted on their own; each kernel is its own executable (shared by both gate kinds).

    The backward lays the primals out again rather than keeping the forward's copies (the
    custom VJP keeps the primals), so nothing of q, k outlives the forward but the primals:
    with ``qk_norm`` (`gdngen.backends.generated.custom_vjp_core`) the raw ones only.

    ``fused_key``: the loaded fused build (`load_fused_kernels`) of ``qk_norm`` and ``gate``
    (a `gdngen.algebra.chunkwise.ParameterGate` or a convention): its forward kernel takes the raw
    primals (``forward_fuses``), normalising q, k and computing the log gate in its loads; the
    backward (and a recomputing variant's state walk) runs the plain kernels ``key`` on the
    recomputed inputs. None: the core computes them with array ops before the forward."""
    import jax.numpy as jnp

    parameter_gate, gate = gate, chunkwise.convention(gate)  # the kernels take log gates
    kernels = _LOADED[key]
    interpret = kernels.interpret
    prepare = jit_pair(functools.partial(_to_kernel_layout, gate=gate), (), interpret)
    finish = jit_pair(functools.partial(_cotangents, gate=gate), (), interpret)

    def forward_outputs(y, s_final, v, S0):
        return _from_heads(y, v.shape[2]), s_final.reshape(S0.shape)

    def backward_inputs(dY, dS_final, v, s0):
        return _to_heads(dY).astype(v.dtype), dS_final.reshape(s0.shape).astype(jnp.float32)

    forward_outputs = jit_pair(forward_outputs, (), interpret)
    backward_inputs = jit_pair(backward_inputs, (), interpret)

    if fused_key is None:
        run_forward, what = kernels.run_forward, "forward"
    else:
        run_forward, what = _LOADED[fused_key].run_forward, "fused forward"
        prepare_forward = jit_pair(functools.partial(
            _to_fused_layout, gate=gate, inputs=KernelInputs.of(qk_norm, parameter_gate)), (),
            interpret)

    def forward(primals):
        lay = call_jitted(prepare if fused_key is None else prepare_forward, *primals)
        outs = _run_kernel(run_forward, lay["q"], lay["k"], lay["v"], lay["g_col"],
                           lay["g_row"], lay["beta"], lay["s0"], *lay.get("gate", ()),
                           scale=scale, what=what, interpret=interpret)
        return (call_jitted(forward_outputs, outs[0], outs[1], primals[2], primals[5]),
                tuple(outs[2:]))

    def backward(primals, saved, cotangents):
        lay = call_jitted(prepare, *primals)
        if kernels.params["save_states"]:
            s_in, tinv = saved
            extra = (tinv,)
        else:
            s_in = _run_kernel(kernels.run_chunk_states, lay["k"], lay["v"], lay["g_col"],
                               lay["g_row"], lay["beta"], lay["s0"], what="chunk-state",
                               interpret=interpret)
            extra = ()
        dy, dsf = call_jitted(backward_inputs, *cotangents, lay["v"], lay["s0"])
        grads = _run_kernel(kernels.run_backward, lay["q"], lay["k"], lay["v"], lay["g_col"],
                            lay["g_row"], lay["beta"], s_in, *extra, dy, dsf, scale=scale,
                            what="backward", interpret=interpret)
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
    kernels = _LOADED[key]
    interpret = kernels.interpret
    if not kernels.params["save_states"]:
        raise ValueError("entering_core needs a save_states build (its forward keeps S_in)")
    prepare = jit_pair(functools.partial(_to_kernel_layout, gate="log"), (), interpret)

    def outputs(y, s_final, s_in, v, S0):
        return _from_heads(y, v.shape[2]), s_final.reshape(S0.shape), _from_heads(s_in,
                                                                                  v.shape[2])

    outputs = jit_pair(outputs, (), interpret)

    def core(*primals):
        lay = call_jitted(prepare, *primals)
        y, s_final, s_in = _run_kernel(
            kernels.run_forward, lay["q"], lay["k"], lay["v"], lay["g_col"], lay["g_row"],
            lay["beta"], lay["s0"], scale=scale, what="forward", interpret=interpret)[:3]
        return call_jitted(outputs, y, s_final, s_in, primals[2], primals[5])

    return core


def _packed_layout(q, k, v, gates, beta, inject, gate):
    """`_to_kernel_layout` of a packed walk (zero s0) plus ``inject`` [N, B, Hk, r, Dv, Dk]
    -> [B, Hv, N, Dv, Dk]."""
    import jax.numpy as jnp

    lay = _to_kernel_layout(q, k, v, gates, beta, jnp.zeros(inject.shape[1:], jnp.float32),
                            gate)
    lay["inject"] = _to_heads(inject)
    return lay


def _packed_cotangents(primals, grads, gate):
    """The packed backward's gradients -> cotangents of ``(q, k, v, gates, beta, inject)``."""
    *front, inject = primals
    Hk = inject.shape[2]
    return (*_cotangents((*front, inject[0]), grads[:-1], gate)[:5],
            _from_heads(grads[-1], Hk))


@functools.cache
def packed_core(key: tuple, gate: str):
    """The ``packed_core(q, k, v, gates, beta, inject) -> (Y, S_in)`` of
    `gdngen.algebra.packed.chunk_walk` on the loaded packed kernels ``key`` (sha256, interpret
    parameters): chunk layout (q already scaled), from a zero state, ``inject`` and ``S_in``
    ``[N, B, Hk, r, Dv, Dk]`` float32; the packed backward kernel as its ``jax.custom_vjp``
    (cotangents of every input, ``inject``'s the state cotangent leaving each chunk)."""
    import jax.numpy as jnp

    kernels = _LOADED[key]
    interpret = kernels.interpret
    prepare = jit_pair(functools.partial(_packed_layout, gate=gate), (), interpret)
    finish = jit_pair(functools.partial(_packed_cotangents, gate=gate), (), interpret)

    def forward_outputs(y, s_in, Hk):
        return _from_heads(y, Hk), _from_heads(s_in, Hk)

    def backward_inputs(dY, dS_in, v, s0):
        return (_to_heads(dY).astype(v.dtype), jnp.zeros(s0.shape, jnp.float32),
                _to_heads(dS_in).astype(jnp.float32))

    forward_outputs = jit_pair(forward_outputs, ("Hk",), interpret)
    backward_inputs = jit_pair(backward_inputs, (), interpret)

    def forward(primals):
        lay = call_jitted(prepare, *primals)
        y, _, s_in, *tinv = _run_kernel(
            kernels.run_forward, lay["q"], lay["k"], lay["v"], lay["g_col"], lay["g_row"],
            lay["beta"], lay["s0"], lay["inject"], scale=1.0, what="packed forward",
            interpret=interpret)
        saved = (s_in, *tinv) if kernels.params["save_states"] else ()
        return call_jitted(forward_outputs, y, s_in, Hk=primals[0].shape[2]), (lay, saved)

    def backward(primals, saved_forward, cotangents):
        lay, saved = saved_forward
        if not saved:  # the variant recomputes the entering states (injection included)
            saved = (_run_kernel(kernels.run_chunk_states, lay["k"], lay["v"], lay["g_col"],
                                 lay["g_row"], lay["beta"], lay["s0"], lay["inject"],
                                 what="packed chunk-state", interpret=interpret),)
        dy, dsf, dsin = call_jitted(backward_inputs, *cotangents, lay["v"], lay["s0"])
        grads = _run_kernel(kernels.run_backward, lay["q"], lay["k"], lay["v"], lay["g_col"],
                            lay["g_row"], lay["beta"], *saved, dy, dsf, dsin, scale=1.0,
                            what="packed backward", interpret=interpret)
        return call_jitted(finish, primals, grads)

    return generated.custom_vjp_core(forward, backward)


def _heads_merged(x, axis):
    """``x`` with its key-head axis ``axis`` and the next (r) merged into one Hv axis."""
    return x.reshape(x.shape[:axis] + (x.shape[axis] * x.shape[axis + 1],) + x.shape[axis + 2:])


@functools.cache
def chunk_walks(key: tuple):
    """``(walk_forward, walk_backward)`` with the signatures and contracts of
    `gdngen.algebra.chunkwise_channel.walk_forward` / ``walk_backward`` (chunk layout [N, B, Hk, r,
    ...], float32) on the loaded per-channel kernels ``key`` (sha256, interpret parameters): the
    forward and backward templates rendered with ``per_channel``, each one ``pallas_call``
    walking the chunks in order (in reverse) with the state (its cotangent) in VMEM. Only the
    value heads are merged (reshapes, no transposes). Packed rows (``inject`` / ``dS_in``) are
    not taken: per-channel packed rows run on the portable path."""
    kernels = _LOADED[key]
    interpret = kernels.interpret

    def walk_forward(xp, S0, U, Wk, Kc, Qd, Pm, dCC, inject=None):
        del xp  # the kernels' own arrays
        generated.refuse_injection(BACKEND, inject)
        y, s_final, s_in, w = _run_kernel(
            kernels.run_forward, *(_heads_merged(x, 2) for x in (U, Wk, Kc, Qd, Pm,
                                                                 dCC[..., None, :])),
            _heads_merged(S0, 1), what="per-channel forward walk", interpret=interpret)
        return (y.reshape(U.shape), s_final.reshape(S0.shape),
                s_in.reshape(U.shape[:4] + S0.shape[-2:]), w.reshape(U.shape))

    def walk_backward(xp, dS_final, G, Kc, Wk, W, S_in, dY, Qd, dCC, dS_in=None):
        del xp
        generated.refuse_injection(BACKEND, dS_in)
        dw, dwk, dqd, dkc, ddcc, ds0 = _run_kernel(
            kernels.run_backward, *(_heads_merged(x, 2) for x in (G, Kc, Wk, W, S_in, dY, Qd,
                                                                  dCC[..., None, :])),
            _heads_merged(dS_final, 1), what="per-channel backward walk", interpret=interpret)
        return (ds0.reshape(dS_final.shape), dw.reshape(G.shape), dwk.reshape(Wk.shape),
                dqd.reshape(Qd.shape), dkc.reshape(Kc.shape), ddcc.reshape(dCC.shape), None)

    return walk_forward, walk_backward


# ----------------------------------------------------------------------------- entry point


def recurrent_forward(q, k, v, decay, beta, S0, *, scale, variant, problem=None,
                      templates_dir=None, inputs=None):
    """Forward of the gated delta rule through ``variant``'s generated recurrent kernel
    (``recurrent.py``); no VJP of its own, nothing saved (see `gated_delta` for the switch).

    Contract (all arrays float32; masked steps already folded: decay 1, beta 0):

    * q, k ``[B, T, Hk, Dk]`` (q unscaled: the kernel applies ``scale``); v ``[B, T, Hv, Dv]``
      with Hv = r * Hk (value head h reads key head h // r); Dk != Dv allowed;
    * decay ``[B, T, Hv]`` (scalar gate) or ``[B, T, Hv, Dk]`` (per-channel gate): the LINEAR
      decay a_t in [0, 1] (a log gate's exp: exactly 0 at log g = -inf resets the state);
    * beta ``[B, T, Hv]``; S0 ``[B, Hv, Dv, Dk]``;
    * returns ``(y [B, T, Hv, Dv], S_T [B, Hv, Dv, Dk])``, float32, of the recurrence
      ``S_t = S_{t-1} diag(a_t) + beta_t (v_t - S_{t-1} diag(a_t) k_t) k_t^T``,
      ``y_t = scale * S_t q_t``, evaluated per step as `gdngen.algebra.chunkwise.recurrent_forward`:
      ``u = beta (v - S (a k)); S' = S diag(a) + u k^T; y = S (a q) + u (k . q)``.

    Any T >= 1 (a trace-time size; T > `RECURRENT_TIME_BLOCK` runs in blocks of that many
    steps, padded with identity steps). The kernel's grid is (B, Hv, Dv tiles of the variant's
    ``dv_tile``, time blocks); each program holds its [dv_tile, Dk] state in VMEM for the whole
    walk. ``problem`` (default: the float32 one of these shapes and gate kind) selects the
    rendered sources, so a call's kernels load once with its chunk kernels. Outputs are poisoned
    as the chunk kernels' are: off a TPU the kernel runs in TPU interpret mode, whose buffers
    (outputs included) start NaN-filled, so anything left unwritten shows up.

    ``inputs`` (a `gdngen.backends.kernel_inputs.KernelInputs`; None: nothing fused) selects
    the fused build (`render_fused`): with ``inputs.qk_norm`` q, k are raw and the kernel
    L2-normalises each loaded row (float32, eps `QK_NORM_EPS`) before scaling q; with
    ``inputs.gate_form`` ``decay`` is the tuple ``(a, A_log, dt_bias)``: ``a`` the raw gate
    projection shaped as the decay (a = -inf on masked steps: decay 1), ``A_log``, ``dt_bias``
    any shape `gdngen.backends.kernel_inputs.kernel_parameters` takes, and the kernel computes
    the decay exp(log g) per step (``lower_bound`` a runtime operand: one build for every
    bound).
    """
    inputs = KernelInputs() if inputs is None else inputs
    gate_parameters = ()
    if inputs.gate_form is not None:
        if not (isinstance(decay, tuple) and len(decay) == 3):
            raise ValueError(f"decay must be the tuple (a, A_log, dt_bias) for gate_form="
                             f"{inputs.gate_form!r}, got {type(decay).__name__}")
        decay, *gate_parameters = decay
    per_channel = decay.ndim == 4
    if problem is None:
        problem = Problem(q.shape[2], v.shape[2], q.shape[3], v.shape[3], "float32",
                          "vector" if per_channel else "scalar")
    if per_channel != (problem.gate == "vector"):
        raise ValueError(f"decay has shape {tuple(decay.shape)}, which does not match the "
                         f"{problem.gate} gates of {problem.key()}")
    interpret_mode()  # decided (and warned about) before the kernels load
    if inputs.fused:
        kernels = load_fused_kernels(variant, problem, inputs, templates_dir=templates_dir)
    else:
        kernels = load_kernels(variant, problem, templates_dir=templates_dir)
    if gate_parameters:
        gate_parameters = pallas_core.fused_gate_operands(inputs, *gate_parameters, problem.Hv,
                                                        problem.Dk, per_channel)
    y, state = _run_kernel(kernels.run_recurrent, q, k, v, decay, beta, S0, *gate_parameters,
                           scale=float(scale), what="recurrent", interpret=kernels.interpret)
    return y, state


def recurrent_steps_forward(q, k, v, decay, beta, S0, *, scale, variant, problem,
                            templates_dir=None):
    """`recurrent_forward` (plain inputs) on the `render_steps` build of ``variant`` for
    ``problem``: ``(y [B, T, Hv, Dv], states [B, T, Hv, Dv, Dk])``, float32, the state after
    every step."""
    interpret_mode()
    kernels = load_steps_kernels(variant, problem, templates_dir=templates_dir)
    return _run_kernel(kernels.run_recurrent, q, k, v, decay, beta, S0, scale=float(scale),
                       what="recurrent steps", interpret=kernels.interpret)


def gated_delta(q, k, v, g, beta, initial_state=None, *, mask=None, scale=1.0, gate="log",
                variant, templates_dir=None, qk_norm=False):
    """Gated delta rule with the generated Pallas TPU kernels of ``variant``; returns
    ``(y, final_state)``. Arguments as `gdngen.jax.gated_delta` (scalar or per-channel gates;
    q, k, v float32 or bfloat16). Differentiable (custom VJP) and jit-able.

    A call with T >= the variant's ``recurrent_below`` runs the chunk kernels (per-channel
    gates: `gdngen.algebra.chunkwise_channel` with the kernel walks, `chunk_walks`). A shorter one
    evaluates through the recurrent kernel (`recurrent_forward`, masks folded, the gate made a
    linear decay) inside `gdngen.backends.portable.jax_chunkwise.recurrent_or_chunkwise`: its VJP is
    that of the chunk path on the same call.

    ``qk_norm`` (q, k raw) and a `gdngen.algebra.chunkwise.ParameterGate` ``gate`` (``g`` the tuple
    ``(a, A_log, dt_bias)``; `BackendSpec.fused_inputs`) are computed in the kernels' loads:
    the recurrent kernel's and the scalar chunk forward kernel's (`render_fused`); the chunk
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


class PallasTPU(pallas_core.PallasBackend):
    """The generated Pallas kernels of this module; its hooks are the module's functions
    (looked up when called,
    `gdngen.backends.pallas.core.PallasBackend`)."""

    name, config, tolerances, dtypes = BACKEND, Config, POLICY_TOLERANCES, INPUT_DTYPES
    device_kinds, device_limit, reference_device = ("tpu",), "vmem_budget", "tpu-v5e"

    footprint_function = "vmem_bytes"


SPEC = PallasTPU(__name__)
