"""Metal backend: generated chunkwise kernels for ``mx.fast.metal_kernel``, forward and backward.

The kernels port `gdngen.algebra.chunkwise` (exact unit-lower-triangular inverse by forward
substitution, decay factors only as exp of segment sums, the straddle-sum gate gradient) to Metal,
as Jinja bodies under ``templates/metal/`` rendered per `Problem` and `Variant`. A `Plan` lists the
launches (kernel, grid, threadgroup, template args, buffers, output shapes) of the forward and of
the backward; the same plan runs on an Apple GPU through MLX (`MLXLauncher`) or, anywhere, in
`gdngen.backends.metal.sim` (`SimLauncher`), so the simulated path is the shipped path.

Around the kernels everything is `gdngen.algebra.chunkwise`: ``chunkwise.gated_delta`` folds the
mask, pads T and lays the sequence out in chunks, and the O(C^2) gate epilogue is
``chunkwise.decay_factors_{log,linear}_vjp`` in mx ops on the dD the kernels produce.

Kernels, per chunk n, batch b, value head h (C = chunk, r = Hv / Hk):

================  ====================  ==========================================================
kernel            threadgroups          computes
================  ====================  ==========================================================
fwd_intra[_tinv]  N*B*Hv                T = (I+A)^-1, U = T diag(beta) V, Wk = T diag(beta D0) K
fwd_scan[_save]   (Dv/dv_tile) x B*Hv   W, y and the state over the chunks (saving S_in, W)
fwd_scan_states   (Dv/dv_tile) x B*Hv   S_in and W only (the backward's recomputation)
bwd_scan          (Dv/dv_tile) x B*Hv   dW, dS_out per chunk, dS0 (chunks in reverse)
bwd_tri           N*B*Hv                dv, dA = -T^T dT T^T and the T-dependent dk, dbeta
bwd_qk            N*B*Hv                dq, dk, dbeta and the decay cotangent dD
recurrent         (Dv/dv_tile) x B*Hv   forward only, step by step: y and S_T, the state's rows
                                        in registers (calls with T < recurrent_below)
fwd_scan_channel  (Dv/dv_tile) x B*Hv   per-channel gates: `chunkwise_channel.walk_forward`, W, y,
                                        S_in and the state over the chunks
bwd_scan_channel  (Dv/dv_tile) x B*Hv   per-channel gates: `chunkwise_channel.walk_backward`, dW,
                                        dS_out per chunk, dS0, and per Dv tile its part of dWk,
                                        dQd, dKc, ddCC (summed in mx)
================  ====================  ==========================================================

Per-channel (vector) gates run `gdngen.algebra.chunkwise_channel` (the mlx backend's
``mx.custom_function``, `gdngen.backends.portable.mlx_chunkwise.chunk_core`) with its two chunk
walks on the ``*_channel`` kernels (`ChannelWalks`, `channel_plan`): the scan templates' per-channel
build (``per_channel`` set), whose decays d0 / dc / dcc come in as per-channel inputs (Qd = scale Q
* D0, Kc = K * DC, dCC) instead of being formed from scalar per-token gates. The intra-chunk stages
(factors, decayed products, WY, the backward's adjoints and straddle sums) stay
`gdngen.algebra.chunkwise_channel`'s shared code in mx ops; fusing them into kernels is a later
step. Validated as the scalar kernels: the battery's vector cases in the simulator with poisoned
outputs, worst relative error 1.1e-6 (vector_identical_keys, dbeta;
tests/backends/metal/test_metal_kernels.py).

Packed rows (`gdngen.algebra.packed`, ``cu_seqlens``), scalar gates: `packed_gated_delta` runs the
row's chunk walk on the templates' ``packed`` build (`render_packed`, `packed_launch_plan`):
the forward scans add ``inject[n]`` to the state leaving chunk n and always write the entering
states S_in (an output); ``bwd_scan`` adds their cotangent ``dsin[n]`` at chunk n's entry, so
its ``dsout`` is the injection's cotangent. Each sequence's initial-state response and its
final state (from its last chunk's S_in) are one-chunk calls of the dense chunk kernels. The
dense render does not change with the flag (tuned entries are keyed on its sha256).
Per-channel packed rows run the portable path (``packed_gates`` is scalar only).

Fused layer inputs (`gdngen.backends.kernel_inputs`; ``qk_norm``, ``gate="softplus"`` /
``"sigmoid_bound"``): the fused build (`render_fused`, the templates' ``qk_norm`` /
``gate_form`` blocks, helpers in ``layer_inputs.metal``) of the recurrent kernel and of the
scalar-gate chunk forward (`fused_kernels`) takes raw q, k and the raw gate projection ``a`` with
``A_log``, ``dt_bias``: the recurrent kernel normalises each loaded row in registers (its sum of
squares a ``simd_sum``), the chunk kernels apply each row's norm factor ``rsqrt(|x|^2 + 1e-6)``
to the products the row enters; both form log g from ``a`` in float32 (softplus as ``max(x, 0)
+ log1p(exp(-|x|))``, a = -inf an identity step) before their cumulative sums, the decay as
exp(log g). The chunk backward stays the plain build's, its inputs recomputed as mx ops in
`_core`; per-channel chunk calls compute them in `gdngen.algebra.chunkwise_channel`'s core. The
plain build renders byte for byte as before (its sha256 and tuned entries unchanged). Measured in
the simulator against float64, values and gradients: worst relative error 1.8e-6
(tests/backends/metal/test_metal_fused_inputs.py).

This module imports without mlx: the space, the renderer and the plan need no framework.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import math
from dataclasses import dataclass

from gdngen import settings
from gdngen.backend import Backend
from gdngen.backends.generated import l2_normalized, l2_normalized_vjp, refuse_injection
from gdngen.backends.kernel_inputs import KernelInputs, context_tag, kernel_parameters
from gdngen.config import VECTOR_CHUNK, VariantConfig, recurrent_switch
from gdngen.devices import KiB
from gdngen.problem import dtype_name
from gdngen.variant import Problem, Variant

BACKEND = "metal"
CHUNK_SIZES = (16, 32, 64)
PRECISIONS = ("ieee", "tf32", "bf16")
SIMDGROUPS = (1, 2, 4)
DV_TILES = (16, 32, 64)
#: Threadgroup memory of every Apple GPU in gdngen.devices (a variant is adapted to a shape
#: within it; spaces are pruned with the device's own limit).
THREADGROUP_MEMORY = 32 * KiB
#: Accumulator floats a thread may hold (beyond this the GPU spills registers).
MAX_ACC_FLOATS = 128
#: The per-channel gates' walk kernels (`channel_plan`): the scan templates' per-channel build.
CHANNEL_KERNELS = ("fwd_scan_channel", "bwd_scan_channel")
#: Dk columns per block of the backward walk's chunk products (``KB`` in bwd_scan.metal.j2).
CHANNEL_BLOCK = 32

#: Relative L2 error the battery allows per precision (`gdngen.tolerance`: the input dtype's
#: own tolerance applies when it is looser). ieee: float32 arithmetic throughout (worst
#: measured 1.2e-6). tf32: matmul operands rounded to 10 mantissa bits (unit roundoff 4.9e-4;
#: worst measured 3.6e-3, identical_keys). bf16: operands rounded to bfloat (unit roundoff
#: 3.9e-3; worst measured 2.1e-2, identical_keys, whose near-singular solve amplifies operand
#: rounding).
POLICY_TOLERANCES = {"ieee": 5e-5, "tf32": 1e-2, "bf16": 5e-2}


def supports(problem: Problem) -> str | None:
    """None when the kernels' shape rules allow ``problem``, else why not."""
    for name in ("Dk", "Dv"):
        if getattr(problem, name) % 32:
            return f"Problem.{name} must be a multiple of 32, got {getattr(problem, name)}"
    return None

#: untuned crossover T (`gdngen.config.recurrent_switch`): one chunk (below it the chunk
#: kernels pad to a whole chunk); not measured on an Apple GPU, the tuner measures it there
RECURRENT_BELOW = 64

@dataclass(frozen=True)
class Config(VariantConfig):
    """Typed metal parameters (see `variant_space`)."""

    backend = BACKEND
    chunk_size: int = 64
    dv_tile: int = 32
    mma: str = "simdgroup"
    precision: str = "ieee"
    save_states: bool = True
    simdgroups: int = 4
    recurrent_below: int = recurrent_switch(RECURRENT_BELOW)

    def check(self) -> None:
        self.check_count("recurrent_below")
        self.check_choice("chunk_size", CHUNK_SIZES)
        self.check_choice("dv_tile", DV_TILES)
        self.check_choice("mma", ("simdgroup", "fma"))
        self.check_choice("precision", PRECISIONS)
        self.check_flag("save_states")
        self.check_choice("simdgroups", SIMDGROUPS)
        if self.mma == "fma" and self.precision != "ieee":
            self._fail("mma", "'simdgroup' unless precision is 'ieee'")


def intra_tile(chunk_size: int) -> int:
    """Columns of Dk / Dv per intra-chunk tile (DW): 32, or 16 for chunk 64 (memory)."""
    return 32 if chunk_size <= 32 else 16


def threadgroup_bytes(params: dict, problem: Problem, qk_norm: bool = False) -> dict:
    """Threadgroup memory each kernel of ``problem``'s gate kind declares, in bytes (float32
    arrays, see the templates); per-channel gates: the two walk kernels, W / -dW of the tile.
    ``qk_norm``: the fused build's (`render_fused`) forward kernels, which also hold the rows'
    norm factors (rk in fwd_intra, rq and rk in fwd_scan: C floats each; at most 26 KiB in all
    of the space, within every Apple GPU's 32 KiB)."""
    C, dvt, sg, dw = params["chunk_size"], params["dv_tile"], params["simdgroups"], \
        intra_tile(params["chunk_size"])
    if problem.gate == "vector":
        return {name: 4 * C * dvt for name in CHANNEL_KERNELS}
    floats = {
        "fwd_intra": C * C + 3 * C,
        "fwd_intra_tinv": C * C + 3 * C,
        "fwd_scan": C * C + C * dvt + 4 * C,
        "fwd_scan_save": C * C + C * dvt + 4 * C,
        "fwd_scan_states": C * dvt + 4 * C,
        "bwd_scan": C * max(C, dvt) + C * dvt + 4 * C,
        "bwd_tri": C * C + 2 * C * dw + 5 * C,
        "bwd_qk": C * C + C * dw + 7 * C + sg,
    }
    if qk_norm:
        for name in ("fwd_intra", "fwd_intra_tinv"):
            floats[name] += C
        for name in ("fwd_scan", "fwd_scan_save"):
            floats[name] += 2 * C
    return {name: 4 * n for name, n in floats.items()}


def max_threadgroup_bytes(variant: Variant, problem: Problem) -> int:
    """The threadgroup memory of the variant's largest kernel, in bytes."""
    return max(threadgroup_bytes(variant.as_dict(), problem).values())


def _acc_floats(params: dict, M: int, N: int) -> int:
    """Floats one thread holds for an M x N accumulator tile."""
    sg = params["simdgroups"]
    if params["mma"] == "simdgroup":
        return 2 * math.ceil((M // 8) * (N // 8) / sg)
    return math.ceil(M * N / (32 * sg))


def accumulator_floats(params: dict, problem: Problem) -> int:
    """Most accumulator floats a thread keeps live in any kernel (a register-pressure bound)."""
    C, dvt, dw = params["chunk_size"], params["dv_tile"], intra_tile(params["chunk_size"])
    acc = functools.partial(_acc_floats, params)
    if problem.gate == "vector":  # the walks: W / dW tiles, the state tile, KB-column products
        return max(acc(C, dvt), acc(dvt, problem.Dk), acc(C, CHANNEL_BLOCK))
    return max(
        acc(C, C), acc(C, dw),                                     # fwd_intra
        acc(C, dvt), acc(dvt, problem.Dk),                         # fwd_scan
        2 * acc(C, dvt),                                           # bwd_scan
        acc(C, C) + acc(C, dw),                                    # bwd_tri
        2 * acc(C, C) + 2 * acc(C, dw),                            # bwd_qk
    )


def params_valid(params: dict, problem: Problem, limit: int = THREADGROUP_MEMORY) -> str | None:
    """None when ``params`` can run ``problem`` within ``limit`` bytes of threadgroup memory,
    else why not."""
    SPEC.check(problem)
    if params["dv_tile"] > problem.Dv or problem.Dv % params["dv_tile"]:
        return f"dv_tile={params['dv_tile']} does not divide Dv={problem.Dv}"
    if params["mma"] == "fma" and params["precision"] != "ieee":
        return "mma='fma' is only offered with precision='ieee'"
    worst = max(threadgroup_bytes(params, problem).values())
    if worst > limit:
        return f"{worst} bytes of threadgroup memory (limit {limit})"
    acc = accumulator_floats(params, problem)
    if acc > MAX_ACC_FLOATS:
        return f"{acc} accumulator floats per thread (limit {MAX_ACC_FLOATS})"
    return None


def variant_space(problem: Problem, device) -> list[Config]:
    """All Metal variants of ``problem`` that fit ``device`` (see the module doc for the kernels).

    Params: ``chunk_size`` 16/32/64; ``precision`` ieee (float32) / tf32 / bf16 (matmul operand
    precision); ``mma`` simdgroup (8x8 simdgroup matrices) or fma (scalar FMA, ieee only);
    ``simdgroups`` per threadgroup; ``dv_tile`` Dv columns per state-scan threadgroup;
    ``save_states`` (the forward keeps per-chunk states, W and T for the backward, else the
    backward recomputes them). Variants over the device's threadgroup memory or
    `MAX_ACC_FLOATS` are left out.

    Per-channel gates: ``chunk_size`` x ``simdgroups`` x ``dv_tile``, the params their path
    depends on (the chunk of `gdngen.algebra.chunkwise_channel`'s stages, the walk kernels' tiling,
    which the recurrent kernel shares); precision ieee, simdgroup matrices, saved states (the
    intra-chunk stages run in float32 mx ops whatever the walks' operand precision).
    """
    SPEC.check(problem)
    limit = device.limits["threadgroup_memory"]
    space = []
    if problem.gate == "vector":
        for C, sg, dvt in itertools.product(CHUNK_SIZES, SIMDGROUPS, DV_TILES):
            config = Config(C, dvt, simdgroups=sg)
            if params_valid(config.params(), problem, limit) is None:
                space.append(config)
        return space
    for C, precision, mma, sg, dvt, save in itertools.product(
            CHUNK_SIZES, PRECISIONS, ("simdgroup", "fma"), SIMDGROUPS, DV_TILES, (True, False)):
        if mma == "fma" and precision != "ieee":
            continue
        config = Config(C, dvt, mma, precision, save, sg)
        if params_valid(config.params(), problem, limit) is None:
            space.append(config)
    return space


def default_config(problem: Problem, device) -> Config:
    """Chunk 64, ieee, simdgroup matrices, 4 simdgroups, 32-column Dv tiles, saving states (the
    first variant of the space if that does not fit ``device``). Per-channel gates: chunk
    `gdngen.config.VECTOR_CHUNK` (the portable path's per-channel chunk; not measured on an
    Apple GPU, the tuner chooses there)."""
    config = Config(VECTOR_CHUNK) if problem.gate == "vector" else Config()
    if params_valid(config.params(), problem, device.limits["threadgroup_memory"]) is not None:
        config = variant_space(problem, device)[0]
    return config


def adapt(variant: Variant, problem: Problem) -> Variant:
    """``variant``'s params for ``problem``'s shape: dv_tile shrinks to the largest valid tile
    when it does not divide Dv; anything else invalid is a ValueError."""
    params = SPEC.parse(variant).params()
    if params["dv_tile"] > problem.Dv or problem.Dv % params["dv_tile"]:
        params["dv_tile"] = max(t for t in DV_TILES
                                if t <= min(params["dv_tile"], problem.Dv) and problem.Dv % t == 0)
    why = params_valid(params, problem)
    if why:
        raise ValueError(f"variant {variant} cannot run {problem.key()}: {why}")
    return Variant(BACKEND, params)


# ---------------------------------------------------------------------------- rendering

def _context(variant: Variant, problem: Problem) -> dict:
    p = variant.as_dict()
    return {
        "C": p["chunk_size"], "DK": problem.Dk, "DV": problem.Dv, "HK": problem.Hk,
        "HV": problem.Hv, "SG": p["simdgroups"], "DVT": p["dv_tile"],
        "DW": intra_tile(p["chunk_size"]), "policy": p["precision"], "mma": p["mma"],
        "per_channel": False, "packed": False,  # the packed build (`render_packed`) sets it
        **KernelInputs().context(),  # nothing fused: the fused build (`render_fused`) sets it
        # 16-bit operands: bfloat under precision bf16, else (tf32 rounding) half for float16
        "op_type": "bfloat" if p["precision"] == "bf16" or problem.dtype == "bfloat16"
        else "half",
    }


# kernel -> (template, extra context)
_KERNEL_TEMPLATES = {
    "fwd_intra": ("metal/fwd_intra.metal.j2", {"save_inverse": False}),
    "fwd_intra_tinv": ("metal/fwd_intra.metal.j2", {"save_inverse": True}),
    "fwd_scan": ("metal/fwd_scan.metal.j2", {"save": False, "write_y": True}),
    "fwd_scan_save": ("metal/fwd_scan.metal.j2", {"save": True, "write_y": True}),
    "fwd_scan_states": ("metal/fwd_scan.metal.j2", {"save": True, "write_y": False}),
    "bwd_scan": ("metal/bwd_scan.metal.j2", {}),
    "bwd_tri": ("metal/bwd_tri.metal.j2", {}),
    "bwd_qk": ("metal/bwd_qk.metal.j2", {}),
    # per-channel gates: the scan templates' per-channel build (the chunkwise_channel walks)
    "fwd_scan_channel": ("metal/fwd_scan.metal.j2",
                         {"save": True, "write_y": True, "per_channel": True}),
    "bwd_scan_channel": ("metal/bwd_scan.metal.j2", {"per_channel": True, "KB": CHANNEL_BLOCK}),
}


def _kernels_used(save: bool) -> tuple[str, ...]:
    if save:
        return ("fwd_intra_tinv", "fwd_scan_save", "bwd_scan", "bwd_tri", "bwd_qk")
    return ("fwd_intra", "fwd_scan", "fwd_intra_tinv", "fwd_scan_states", "bwd_scan", "bwd_tri",
            "bwd_qk")


def _recurrent_context(variant: Variant, problem: Problem) -> dict:
    """Context of ``recurrent.metal.j2``: head dims and heads, ``ROWS`` state rows per
    threadgroup (the variant's ``dv_tile``) over ``SG`` simdgroups (its ``simdgroups``), and the
    gate kind (``per_channel`` for a vector-gate problem). Nothing else of the variant (chunk,
    precision, ``recurrent_below``) reaches the recurrent source."""
    p = variant.as_dict()
    return {"DK": problem.Dk, "DV": problem.Dv, "HK": problem.Hk, "HV": problem.Hv,
            "ROWS": p["dv_tile"], "SG": p["simdgroups"], "per_channel": problem.gate == "vector",
            **KernelInputs().context()}


def render_plan(variant: Variant, problem: Problem) -> dict:
    """`gdngen.render` hook: ``{"common.metal": ..., "<kernel>.metal": ...}`` for the kernels
    this variant launches; each value is ``(template path, context)``. A scalar-gate problem
    runs the chunk kernels and the recurrent kernel (short calls); a vector-gate problem the
    per-channel build of the scan templates (`CHANNEL_KERNELS`, the walks of
    `gdngen.algebra.chunkwise_channel`) and the recurrent kernel."""
    variant = adapt(variant, problem)
    plan = {}
    ctx = _context(variant, problem)
    names = CHANNEL_KERNELS if problem.gate == "vector" else \
        _kernels_used(variant["save_states"])
    plan["common.metal"] = ("metal/common.metal.j2", ctx)
    for name in names:
        template, extra = _KERNEL_TEMPLATES[name]
        plan[f"{name}.metal"] = (template, dict(ctx, **extra))
    plan["recurrent.metal"] = ("metal/recurrent.metal.j2", _recurrent_context(variant, problem))
    return plan


def render_packed(variant: Variant, problem: Problem, *, templates_dir=None):
    """The packed-row build of ``variant``'s chunk kernels (`gdngen.algebra.packed`), a
    `gdngen.sources.Rendered` with `render_plan`'s chunk-kernel names (no recurrent kernel):
    the same templates with ``packed`` set. Its forward scans take ``inject [N, B, Hv, Dv,
    Dk]`` (added to the state leaving each chunk) and always write the entering states
    ``states`` (S_in); its ``bwd_scan`` takes their cotangent ``dsin`` (same layout), so its
    ``dsout`` is the injection's cotangent. With ``packed`` unset the templates render the dense
    kernels byte for byte: the dense sha256 (and tuned entries) do not depend on this build."""
    from gdngen.sources import Rendered, environment, sources_sha256

    if problem.gate != "scalar":
        raise ValueError(f"the metal packed kernels take scalar gates only, got {problem.key()}")
    variant = adapt(variant, problem)
    env = environment(templates_dir)
    texts = {name: env.get_template(template).render(**dict(context, packed=True))
             for name, (template, context) in render_plan(variant, problem).items()
             if name != "recurrent.metal"}
    return Rendered(variant, problem, texts, sources_sha256(texts))


def render_fused(variant: Variant, problem: Problem, inputs: KernelInputs, *,
                 templates_dir=None):
    """The fused build of ``variant``'s forward kernels (`gdngen.backends.kernel_inputs`): a
    `gdngen.sources.Rendered` of the kernels that compute the layer inputs in their loads, each
    template rendered with ``inputs.context()`` (``qk_norm``, ``gate_form``): the recurrent
    kernel; for a scalar-gate problem also the chunk forward's two kernels (`fused_kernels`)
    and their header ``common.metal``; and ``"layer_inputs.metal"``, the helpers they call (the
    fused recurrent kernel's header; ``common.metal`` includes it). These take raw q, k (each
    row normalised at load) and, with a gate form, the raw projection ``a`` with ``A_log`` and
    ``dt_bias`` ``[Hv]`` (per channel ``[Hv, Dk]``) in place of the gate. A backward is the plain
    build's (`render_plan`), on recomputed inputs; per-channel gates' chunk path is
    `gdngen.algebra.chunkwise_channel`'s (its layer inputs computed in its core). ``inputs`` must
    fuse something: the plain build is `render_plan`'s, whose sha256, and tuned entries, do not
    depend on this one. ``templates_dir``: a template override folder (default
    ``GDNGEN_TEMPLATES``)."""
    if not inputs.fused:
        raise ValueError(f"inputs must fuse a qk norm or a gate (the plain build is "
                         f"render_plan's), got {inputs!r}")
    templates = settings.templates_override() if templates_dir is None else templates_dir
    return _render_fused(adapt(variant, problem), problem, _fused_key(inputs), templates)


@functools.lru_cache(maxsize=64)
def _render_fused(variant: Variant, problem: Problem, fused: tuple, templates_dir):
    from gdngen.sources import Rendered, environment, sources_sha256

    env = environment(templates_dir)
    plan = render_plan(variant, problem)
    plan["layer_inputs.metal"] = ("metal/layer_inputs.metal.j2",
                                  _recurrent_context(variant, problem))
    names = {"recurrent.metal", "layer_inputs.metal"}
    if problem.gate == "scalar":
        names |= {"common.metal", *(f"{n}.metal" for n in fused_kernels(variant))}
    texts = {name: env.get_template(template).render(**dict(context, **dict(fused)))
             for name, (template, context) in plan.items() if name in names}
    return Rendered(variant, problem, texts, sources_sha256(texts))


def fused_kernels(variant: Variant) -> tuple[str, ...]:
    """The chunk kernels of a scalar-gate forward that have a fused build (`render_fused`): the
    forward's two launches (fwd_intra_tinv and fwd_scan_save when the variant saves states,
    fwd_intra and fwd_scan otherwise)."""
    if variant["save_states"]:
        return ("fwd_intra_tinv", "fwd_scan_save")
    return ("fwd_intra", "fwd_scan")


def _fused_key(inputs: KernelInputs | None) -> tuple:
    """What of ``inputs`` reaches a rendering (`KernelInputs.context`), hashable; ``()`` when
    nothing is fused. ``lower_bound`` is a runtime scalar: one build serves every bound."""
    if inputs is None or not inputs.fused:
        return ()
    return tuple(sorted(inputs.context().items()))


# ---------------------------------------------------------------------------- launch plan

@dataclass(frozen=True)
class KernelSpec:
    """One ``mx.fast.metal_kernel``: its unique name, parameter names, body and header."""

    name: str
    input_names: tuple
    output_names: tuple
    source: str
    header: str


@dataclass(frozen=True)
class Launch:
    """One kernel call. ``inputs`` / ``outputs`` name arrays of the plan's environment, in the
    kernel's parameter order; ``template`` values are ints, bools or dtype names."""

    kernel: str
    inputs: tuple
    outputs: tuple
    output_shapes: tuple
    output_dtypes: tuple
    grid: tuple
    threadgroup: tuple
    template: tuple


@dataclass(frozen=True)
class Plan:
    """Everything a forward + backward of one variant runs, for N chunks of batch B.

    Environment names: inputs q, k, v, g, beta, s0, prm (and dy, dsf in the backward); the
    forward returns ``y`` / ``final_state`` and hands ``saved`` to the backward.

    ``packed`` (`packed_launch_plan`): the packed build; the forward also takes ``inject`` and
    returns ``states`` (S_in, never in ``saved``: it is an output), the backward also takes
    ``dsin`` and its ``dsout`` is the injection's cotangent.

    A walk plan (`channel_plan`, per-channel gates) has one launch in each: the forward walk's
    and the backward walk's, each run on its own inputs by `ChannelWalks` (nothing ``saved``).

    ``fused`` (`_fused_key`: ``(("gate_form", ...), ("qk_norm", ...))``, empty for the plain
    build): the forward's kernels are `render_fused`'s, taking raw q, k and, with a gate form,
    ``a``, ``A_log``, ``dt_bias`` in place of ``g`` (``prm`` then also holds the lower bound);
    a backward is the plain build's, on the recomputed inputs.
    """

    variant: Variant
    problem: Problem
    N: int
    B: int
    kernels: dict
    forward: tuple
    backward: tuple
    saved: tuple
    threadgroup_bytes: dict
    packed: bool = False
    fused: tuple = ()


_KERNEL_IO = {
    "fwd_intra": (("k", "v", "g", "beta", "prm"), ("u", "wk")),
    "fwd_intra_tinv": (("k", "v", "g", "beta", "prm"), ("u", "wk", "tinv")),
    "fwd_scan": (("q", "k", "g", "s0", "u", "wk", "prm"), ("y_out", "final_state")),
    "fwd_scan_save": (("q", "k", "g", "s0", "u", "wk", "prm"),
                      ("y_out", "final_state", "states", "w_out")),
    "fwd_scan_states": (("k", "g", "s0", "u", "wk", "prm"), ("final_state", "states", "w_out")),
    "bwd_scan": (("q", "k", "g", "dy", "dsf", "wk", "prm"), ("dw", "dsout", "ds0")),
    "bwd_tri": (("k", "v", "g", "beta", "dw", "states", "tinv", "prm"),
                ("da", "dv", "dkt", "vec_out")),
    "bwd_qk": (("q", "k", "g", "beta", "dy", "w", "states", "dsout", "da", "dkt", "vec_in",
                "prm"), ("dq", "dk", "dbeta", "dd")),
    "recurrent": (("q", "k", "v", "a", "beta", "s0", "prm"), ("y_out", "final_state")),
    "fwd_scan_channel": (("s0", "u", "wk", "kc", "qd", "pm", "dccv"),
                         ("y_out", "final_state", "states", "w_out")),
    "bwd_scan_channel": (("dsf", "ptdy", "kc", "wk", "w", "states", "dy", "qd", "dccv"),
                         ("dw", "dsout", "ds0", "dwk", "dqd", "dkc", "ddcc")),
}
# Kernel parameter -> environment name, where they differ.
_ENV_NAME = {"w": "w_out", "vec_in": "vec_out"}


def _kernel_io(name: str, packed: bool, fused: tuple = ()) -> tuple:
    """``(inputs, outputs)`` of kernel ``name``; the packed build's scans take ``inject`` /
    ``dsin`` (before ``prm``) and every packed forward scan writes ``states``; a fused build
    (`_fused_key`) with a gate form takes ``a`` in place of ``g`` and ``A_log``, ``dt_bias``
    before ``prm``."""
    ins, outs = _KERNEL_IO[name]
    if dict(fused).get("gate_form"):
        ins = tuple("a" if n == "g" else n for n in ins[:-1]) + ("A_log", "dt_bias", "prm")
    if packed and name.startswith("fwd_scan"):
        ins = ins[:-1] + ("inject", "prm")
        outs = outs if "states" in outs else outs + ("states",)
    elif packed and name == "bwd_scan":
        ins = ins[:-1] + ("dsin", "prm")
    return ins, outs


def launch_plan(variant: Variant, problem: Problem, N: int, B: int,
                inputs: KernelInputs | None = None) -> Plan:
    """The launches of ``variant`` (adapted to ``problem``) for N chunks and batch B, rendered
    from the shipped templates or the ``GDNGEN_TEMPLATES`` override folder. ``inputs``
    (`KernelInputs`, default none): the forward's kernels are the fused build's
    (`render_fused`, `fused_kernels`): raw q, k and, with a gate form, ``a``, ``A_log``,
    ``dt_bias`` (``prm = (scale, 0, lower_bound)``); the backward's stay the plain build's, on
    the recomputed inputs (environment names ``q``, ``k``, ``g`` as before)."""
    if problem.gate != "scalar":
        raise ValueError(f"the metal chunk kernels take scalar gates only, got {problem.key()} "
                         f"(vector gates run the walk kernels, `channel_plan`)")
    return _launch_plan(adapt(variant, problem), problem, N, B,
                        settings.templates_override(), False, _fused_key(inputs))


def packed_launch_plan(variant: Variant, problem: Problem, N: int, B: int,
                       templates_dir=None) -> Plan:
    """`launch_plan` of the packed build (`render_packed`): the same launches, grids and
    threadgroup memory; ``templates_dir`` default the ``GDNGEN_TEMPLATES`` override."""
    if problem.gate != "scalar":
        raise ValueError(f"the metal packed kernels take scalar gates only, got {problem.key()}")
    templates = settings.templates_override() if templates_dir is None else templates_dir
    return _launch_plan(adapt(variant, problem), problem, N, B, templates, True)


def _recurrent_io(fused: tuple) -> tuple:
    """``(inputs, outputs)`` of the recurrent kernel; a fused gate adds ``A_log``, ``dt_bias``."""
    ins, outs = _KERNEL_IO["recurrent"]
    return (ins + ("A_log", "dt_bias") if dict(fused).get("gate_form") else ins), outs


@functools.lru_cache(maxsize=64)
def _recurrent_kernel(variant: Variant, problem: Problem, templates, fused: tuple = ()
                      ) -> KernelSpec:
    if not fused:
        rendered = SPEC.render(variant, problem, templates_dir=templates)
        body = rendered.sources["recurrent.metal"]
        tag = hashlib.sha256(body.encode()).hexdigest()[:12]  # self-contained: no header
        return KernelSpec(f"gdngen_recurrent_{tag}", *_KERNEL_IO["recurrent"], body, "")
    rendered = _render_fused(variant, problem, fused, templates)
    body, header = rendered.sources["recurrent.metal"], rendered.sources["layer_inputs.metal"]
    tag = hashlib.sha256((header + "\0" + body).encode()).hexdigest()[:12]
    return KernelSpec(f"gdngen_recurrent{context_tag(dict(fused))}_{tag}",
                      *_recurrent_io(fused), body, header)


def recurrent_plan(variant: Variant, problem: Problem, T: int, B: int,
                   templates_dir=None, inputs: KernelInputs | None = None) -> Plan:
    """The one launch of the recurrent kernel of ``variant`` (adapted to ``problem``) for T steps
    and batch B: grid (32 * simdgroups, Dv / dv_tile, B * Hv). In this `Plan`, ``N`` is T (the
    kernel reads T from q's shape at run time; the source does not depend on it) and there is no
    backward. ``templates_dir``: default the ``GDNGEN_TEMPLATES`` override, else the shipped
    templates. ``inputs`` (`KernelInputs`, default none): the fused build (`render_fused`),
    which takes raw q, k and, with a gate form, ``a``, ``A_log``, ``dt_bias`` (inputs in that
    order after the plain ones; ``prm = (scale, lower_bound)``); the kernel is keyed on what
    reaches its source (`_fused_key`), not on the lower bound."""
    variant = adapt(variant, problem)
    templates = settings.templates_override() if templates_dir is None else templates_dir
    fused = _fused_key(inputs)
    spec = _recurrent_kernel(variant, problem, templates, fused)
    p = variant.as_dict()
    nt = 32 * p["simdgroups"]
    Hv, Dk, Dv = problem.Hv, problem.Dk, problem.Dv
    f32 = "float32"
    ins, outs = _recurrent_io(fused)
    launch = Launch(kernel="recurrent", inputs=ins, outputs=outs,
                    output_shapes=((B, T, Hv, Dv), (B, Hv, Dv, Dk)), output_dtypes=(f32, f32),
                    grid=(nt, Dv // p["dv_tile"], B * Hv), threadgroup=(nt, 1, 1), template=())
    return Plan(variant, problem, T, B, {"recurrent": spec}, (launch,), (), (),
                {"recurrent": 0}, fused=fused)


def recurrent_input_metas(plan: Plan) -> dict:
    """``(dtype, ndim, size)`` of the recurrent kernel's inputs for ``plan`` (`recurrent_plan`)."""
    pb, T, B = plan.problem, plan.N, plan.B
    f32 = "float32"
    gate = T * B * pb.Hv * (pb.Dk if pb.gate == "vector" else 1)
    metas = {"q": (f32, 4, B * T * pb.Hk * pb.Dk), "k": (f32, 4, B * T * pb.Hk * pb.Dk),
             "v": (f32, 4, B * T * pb.Hv * pb.Dv),
             "a": (f32, 4 if pb.gate == "vector" else 3, gate), "beta": (f32, 3, B * T * pb.Hv),
             "s0": (f32, 4, B * pb.Hv * pb.Dv * pb.Dk), "prm": (f32, 1, 2 if plan.fused else 1)}
    if dict(plan.fused).get("gate_form"):
        vector = pb.gate == "vector"
        metas["A_log"] = metas["dt_bias"] = (f32, 2 if vector else 1,
                                             pb.Hv * (pb.Dk if vector else 1))
    return metas


@functools.lru_cache(maxsize=64)
def channel_plan(variant: Variant, problem: Problem, N: int, B: int, templates=None) -> Plan:
    """The walk kernels of per-channel gates (`CHANNEL_KERNELS`) for N chunks and batch B:
    ``forward`` is the one launch of `ChannelWalks.forward` (fwd_scan_channel), ``backward``
    the one of `ChannelWalks.backward` (bwd_scan_channel); both on grid (32 * simdgroups,
    Dv / dv_tile, B * Hv), every buffer float32 (names and shapes in the templates' headers).
    ``variant`` must be adapted to ``problem`` (a vector-gate `Problem`); ``templates``: a
    template override folder (None: the shipped templates)."""
    if problem.gate != "vector":
        raise ValueError(f"the metal walk kernels take vector gates, got {problem.key()}")
    rendered = SPEC.render(variant, problem, templates_dir=templates)
    p = variant.as_dict()
    C, nt, dvt = p["chunk_size"], 32 * p["simdgroups"], p["dv_tile"]
    Hv, Dk, Dv = problem.Hv, problem.Dk, problem.Dv
    header = rendered.sources["common.metal"]
    chunks, tiles = (N, B, Hv), (Dv // dvt, N, B, Hv)
    shapes = {"y_out": chunks + (C, Dv), "final_state": (B, Hv, Dv, Dk),
              "states": chunks + (Dv, Dk), "w_out": chunks + (C, Dv), "dw": chunks + (C, Dv),
              "dsout": chunks + (Dv, Dk), "ds0": (B, Hv, Dv, Dk), "dwk": tiles + (C, Dk),
              "dqd": tiles + (C, Dk), "dkc": tiles + (C, Dk), "ddcc": tiles + (Dk,)}
    kernels, launches = {}, []
    for name in CHANNEL_KERNELS:
        body = rendered.sources[f"{name}.metal"]
        tag = hashlib.sha256((header + "\0" + body).encode()).hexdigest()[:12]
        ins, outs = _KERNEL_IO[name]
        kernels[name] = KernelSpec(f"gdngen_{name}_{tag}", ins, outs, body, header)
        launches.append(Launch(kernel=name, inputs=ins, outputs=outs,
                               output_shapes=tuple(shapes[o] for o in outs),
                               output_dtypes=("float32",) * len(outs),
                               grid=(nt, Dv // dvt, B * Hv), threadgroup=(nt, 1, 1),
                               template=(("InT", "float32"),)))
    tg = threadgroup_bytes(p, problem)
    return Plan(variant, problem, N, B, kernels, (launches[0],), (launches[1],), (),
                {name: tg[name] for name in kernels})


def channel_input_metas(plan: Plan) -> dict:
    """``(dtype, ndim, size)`` of the walk kernels' inputs for ``plan`` (`channel_plan`), in
    the chunk layout `gdngen.algebra.chunkwise_channel` passes ([N, B, Hk, r, ...], states [B, Hk,
    r, Dv, Dk])."""
    pb, N, B, C = plan.problem, plan.N, plan.B, plan.variant["chunk_size"]
    f32, heads = "float32", N * B * pb.Hv
    state, rows_v, rows_k = (f32, 5, B * pb.Hv * pb.Dv * pb.Dk), (f32, 6, heads * C * pb.Dv), \
        (f32, 6, heads * C * pb.Dk)
    return {"s0": state, "dsf": state, "u": rows_v, "ptdy": rows_v, "w": rows_v, "dy": rows_v,
            "wk": rows_k, "kc": rows_k, "qd": rows_k, "pm": (f32, 6, heads * C * C),
            "dccv": (f32, 5, heads * pb.Dk), "states": (f32, 6, heads * pb.Dv * pb.Dk)}


@dataclass(frozen=True)
class ChannelWalks:
    """The chunk walks of `gdngen.algebra.chunkwise_channel` on the Metal walk kernels of
    ``variant`` (`channel_plan`), run by ``launcher``: ``forward`` has
    `chunkwise_channel.walk_forward`'s contract, ``backward`` `walk_backward`'s (mx arrays in chunk
    layout; float32 inside). The intra-chunk stages (factors, decayed products, WY, the backward's
    adjoints and straddle sums) stay `gdngen.algebra.chunkwise_channel`'s shared mx code; fusing
    them into kernels is a later step. Injected states (packed rows) are not taken: per-channel
    packed rows run the portable walk. Hashable, so
    `gdngen.backends.portable.mlx_chunkwise.chunk_core` caches one core per walks."""

    variant: Variant
    problem: Problem
    launcher: object
    templates: object = None

    def _plan(self, N: int, B: int) -> Plan:
        return channel_plan(self.variant, self.problem, N, B, self.templates)

    def _launch(self, plan: Plan, launches, env: dict) -> dict:
        import mlx.core as mx

        env = {n: x.astype(mx.float32) for n, x in env.items()}
        if hasattr(self.launcher, "prepare"):
            self.launcher.prepare(plan, env)
        return _run(plan, launches, env, self.launcher)

    def forward(self, xp, S0, U, Wk, Kc, Qd, Pm, dCC, inject=None):
        """``(Y, S_final, S_in, W)``: one launch of fwd_scan_channel (shapes as
        `gdngen.algebra.chunkwise_channel.walk_forward`)."""
        refuse_injection(BACKEND, inject)
        N, B = int(U.shape[0]), int(U.shape[1])
        plan = self._plan(N, B)
        env = self._launch(plan, plan.forward, {"s0": S0, "u": U, "wk": Wk, "kc": Kc, "qd": Qd,
                                                "pm": Pm, "dccv": dCC})
        return (env["y_out"].reshape(U.shape), env["final_state"].reshape(S0.shape),
                env["states"].reshape((N,) + tuple(S0.shape)), env["w_out"].reshape(U.shape))

    def backward(self, xp, dS_final, G, Kc, Wk, W, S_in, dY, Qd, dCC, dS_in=None):
        """``(dS0, dW, dWk, dQd, dKc, ddCC, None)``: one launch of bwd_scan_channel (shapes as
        `gdngen.algebra.chunkwise_channel.walk_backward`); the Dk-wide products come back one part
        per Dv tile and are summed here."""
        refuse_injection(BACKEND, dS_in)
        N, B = int(W.shape[0]), int(W.shape[1])
        plan = self._plan(N, B)
        env = self._launch(plan, plan.backward, {
            "dsf": dS_final, "ptdy": G, "kc": Kc, "wk": Wk, "w": W, "states": S_in, "dy": dY,
            "qd": Qd, "dccv": dCC})

        def summed(name, like):
            return env[name].sum(axis=0).reshape(like.shape)

        return (env["ds0"].reshape(dS_final.shape), env["dw"].reshape(W.shape),
                summed("dwk", Wk), summed("dqd", Qd), summed("dkc", Kc), summed("ddcc", dCC),
                None)


@functools.lru_cache(maxsize=64)
def _launch_plan(variant: Variant, problem: Problem, N: int, B: int, templates,
                 packed: bool = False, fused: tuple = ()) -> Plan:
    if packed and fused:
        raise ValueError("a packed row takes its layer inputs computed (no fused build)")
    rendered = render_packed(variant, problem, templates_dir=templates) if packed else \
        SPEC.render(variant, problem, templates_dir=templates)
    forward_fused = fused_kernels(variant) if fused else ()
    fused_sources = _render_fused(variant, problem, fused, templates).sources if fused else {}
    p = variant.as_dict()
    C, sg, dvt = p["chunk_size"], p["simdgroups"], p["dv_tile"]
    Hv, Dk, Dv = problem.Hv, problem.Dk, problem.Dv
    nt = 32 * sg
    in_t = problem.dtype
    header = rendered.sources["common.metal"]
    kernels = {}
    for name in _kernels_used(p["save_states"]):
        if name in forward_fused:  # the fused build: its own header (the helpers) and body
            head, body, suffix = fused_sources["common.metal"], \
                fused_sources[f"{name}.metal"], context_tag(dict(fused))
            io = _kernel_io(name, packed, fused)
        else:
            head, body, suffix = header, rendered.sources[f"{name}.metal"], ""
            io = _kernel_io(name, packed)
        # Named by its own text: variants that share a kernel share its compiled pipeline.
        tag = hashlib.sha256((head + "\0" + body).encode()).hexdigest()[:12]
        kernels[name] = KernelSpec(f"gdngen_{name}{suffix}_{tag}", *io, body, head)
    per_chunk = (N, B, Hv)
    f32 = "float32"
    shapes = {
        "u": per_chunk + (C, Dv), "wk": per_chunk + (C, Dk), "tinv": per_chunk + (C, C),
        "y_out": per_chunk + (C, Dv), "final_state": (B, Hv, Dv, Dk),
        "states": per_chunk + (Dv, Dk), "w_out": per_chunk + (C, Dv),
        "dw": per_chunk + (C, Dv), "dsout": per_chunk + (Dv, Dk), "ds0": (B, Hv, Dv, Dk),
        "da": per_chunk + (C, C), "dv": per_chunk + (C, Dv), "dkt": per_chunk + (C, Dk),
        "vec_out": per_chunk + (2, C), "dq": per_chunk + (C, Dk), "dk": per_chunk + (C, Dk),
        "dbeta": per_chunk + (C,), "dd": per_chunk + (C + 1, C + 1),
    }
    chunk_grid = (nt, 1, N * B * Hv)
    scan_grid = (nt, Dv // dvt, B * Hv)
    grids = {"fwd_intra": chunk_grid, "fwd_intra_tinv": chunk_grid, "fwd_scan": scan_grid,
             "fwd_scan_save": scan_grid, "fwd_scan_states": scan_grid, "bwd_scan": scan_grid,
             "bwd_tri": chunk_grid, "bwd_qk": chunk_grid}

    def launch(name):
        ins, outs = _kernel_io(name, packed, fused if name in forward_fused else ())
        return Launch(
            kernel=name, inputs=tuple(_ENV_NAME.get(n, n) for n in ins), outputs=outs,
            output_shapes=tuple(shapes[o] for o in outs),
            output_dtypes=tuple(in_t if o == "y_out" else f32 for o in outs),
            grid=grids[name], threadgroup=(nt, 1, 1), template=(("InT", in_t),))

    bwd = ("bwd_scan", "bwd_tri", "bwd_qk")
    if p["save_states"]:
        forward = (launch("fwd_intra_tinv"), launch("fwd_scan_save"))
        backward = tuple(launch(n) for n in bwd)
        saved = ("w_out", "tinv", "wk") if packed else ("states", "w_out", "tinv", "wk")
    else:
        forward = (launch("fwd_intra"), launch("fwd_scan"))
        backward = tuple(launch(n) for n in ("fwd_intra_tinv", "fwd_scan_states") + bwd)
        saved = ()
    tg, tg_fused = threadgroup_bytes(p, problem), \
        threadgroup_bytes(p, problem, dict(fused).get("qk_norm", False))
    return Plan(variant, problem, N, B, kernels, forward, backward, saved,
                {name: (tg_fused if name in forward_fused else tg)[name] for name in kernels},
                packed, fused)


# ---------------------------------------------------------------------------- execution

class MLXLauncher:
    """Runs launches with ``mx.fast.metal_kernel`` on the Metal GPU."""

    name = "metal"

    @staticmethod
    @functools.cache
    def _kernel(spec: KernelSpec):
        import mlx.core as mx

        return mx.fast.metal_kernel(name=spec.name, input_names=list(spec.input_names),
                                    output_names=list(spec.output_names), source=spec.source,
                                    header=spec.header)

    def __call__(self, plan: Plan, launch: Launch, arrays):
        import mlx.core as mx

        kernel = self._kernel(plan.kernels[launch.kernel])
        template = [(n, getattr(mx, v) if isinstance(v, str) else v) for n, v in launch.template]
        # GDNGEN_POISON_OUTPUTS=1: every output starts as NaN, so anything a kernel leaves
        # unwritten shows (the simulator always poisons outputs and fails on what is left).
        poison = float("nan") if settings.flag(settings.ENV_POISON_OUTPUTS) else None
        return kernel(inputs=list(arrays), template=template or None, grid=launch.grid,
                      threadgroup=launch.threadgroup, output_shapes=list(launch.output_shapes),
                      output_dtypes=[getattr(mx, d) for d in launch.output_dtypes],
                      init_value=poison)


class SimLauncher:
    """Runs launches in `gdngen.backends.metal.sim` (NumPy in and out of the simulated GPU)."""

    name = "simulator"

    def __init__(self, schedule: str = "forward", seed: int = 0):
        self.schedule, self.seed = schedule, seed
        self.threadgroup_bytes = {}  # kernel -> bytes the simulator measured

    @staticmethod
    @functools.cache
    def _kernel(spec: KernelSpec):
        from gdngen.backends.metal import sim as metal_sim

        return metal_sim.metal_kernel(spec.name, spec.input_names, spec.output_names,
                                      spec.source, spec.header)

    def prepare(self, plan: Plan, env: dict) -> None:
        """Compile every kernel of ``plan`` before the first launch (see `compile_plan`);
        ``env`` holds the forward's input arrays."""
        compile_plan(plan, {n: (dtype_name(a), a.ndim, int(a.size)) for n, a in env.items()})

    def __call__(self, plan: Plan, launch: Launch, arrays):
        kernel = self._kernel(plan.kernels[launch.kernel])
        outs = kernel(inputs=[to_numpy(a) for a in arrays], template=list(launch.template),
                      grid=launch.grid, threadgroup=launch.threadgroup,
                      output_shapes=list(launch.output_shapes),
                      output_dtypes=list(launch.output_dtypes), schedule=self.schedule,
                      seed=self.seed)
        self.threadgroup_bytes[launch.kernel] = kernel.last_threadgroup_bytes
        return [from_numpy(o) for o in outs]


def plan_input_metas(plan: Plan) -> dict:
    """``(dtype, ndim, size)`` of the forward's inputs in chunk layout, as MLX passes them."""
    pb, C = plan.problem, plan.variant["chunk_size"]
    steps = plan.N * plan.B * C  # time steps of all chunks and batch rows
    f32 = "float32"
    metas = {"q": (pb.dtype, 5, steps * pb.Hk * pb.Dk), "k": (pb.dtype, 5, steps * pb.Hk * pb.Dk),
             "v": (pb.dtype, 6, steps * pb.Hv * pb.Dv), "g": (f32, 5, steps * pb.Hv),
             "beta": (f32, 5, steps * pb.Hv), "s0": (f32, 5, plan.B * pb.Hv * pb.Dv * pb.Dk),
             "prm": (f32, 1, 2)}
    if plan.packed:  # [N, B, Hk, r, Dv, Dk], as `packed_gated_delta`'s walk passes it
        metas["inject"] = (f32, 6, plan.N * plan.B * pb.Hv * pb.Dv * pb.Dk)
    if plan.fused:  # the fused forward's: raw q, k (as above), prm with the lower bound
        metas["prm"] = (f32, 1, 3)
        if dict(plan.fused).get("gate_form"):
            metas["a"] = metas["g"]
            metas["A_log"] = metas["dt_bias"] = (f32, 1, pb.Hv)
    return metas


def compile_plan(plan: Plan, metas: dict | None = None) -> list:
    """Compile, in parallel, the simulator build of every kernel ``plan`` launches (the full
    source MLX would compile, g++ against the MSL shim); returns the shared-object paths.

    ``metas`` gives ``(dtype, ndim, size)`` of the forward's inputs (default: as MLX passes
    them, `plan_input_metas`; for a walk plan, `channel_input_metas`, which also completes the
    given ones: the backward walk's inputs are not the forward's outputs); every other buffer
    is declared by the plan.
    """
    from concurrent.futures import ThreadPoolExecutor

    from gdngen.backends.metal import sim as metal_sim
    from gdngen.backends.metal.sim import compiler, source
    from gdngen.backends.metal.sim.launch import default_workers

    if set(plan.kernels) == set(CHANNEL_KERNELS):
        metas = {**channel_input_metas(plan), **(metas or {})}
    metas = dict(plan_input_metas(plan) if metas is None else metas)
    if plan.fused and "a" in metas and "g" not in metas:  # its backward: the recomputed log g
        metas["g"] = metas["a"]
    texts = {}
    for launch in plan.forward + plan.backward:
        spec = plan.kernels[launch.kernel]
        kernel = metal_sim.metal_kernel(spec.name, spec.input_names, spec.output_names,
                                        spec.source, spec.header)
        text = kernel.kernel_text([metas[n] for n in launch.inputs], launch.output_dtypes,
                                  launch.template, metas_given=True)
        texts[source.simulator_source(text)] = f"kernel {text.kernel_name}"
        for name, shape, dt in zip(launch.outputs, launch.output_shapes, launch.output_dtypes):
            metas[name] = (dt, len(shape), math.prod(shape))
        if "y_out" in metas:  # the backward's cotangents are shaped like the outputs
            metas.setdefault("dy", metas["y_out"])
            metas.setdefault("dsf", metas["final_state"])
        if plan.packed and "states" in metas:
            metas.setdefault("dsin", metas["states"])
    with ThreadPoolExecutor(max_workers=default_workers()) as pool:
        return list(pool.map(lambda item: compiler.kernel_library(*item), texts.items()))


def lower_check(variant: Variant, problem: Problem) -> None:
    """`gdngen.build` hook: every kernel of ``variant`` compiles as MLX would build it (with
    g++ against the simulator's MSL shim; no Metal device needed), the fused builds of both
    gate forms with the qk norm (`render_fused`) included. Raises on failure."""
    fused = (KernelInputs(True, "softplus"), KernelInputs(True, "sigmoid_bound", -1.0))
    if problem.gate == "scalar":
        for inputs in (None, *fused):
            compile_plan(launch_plan(variant, problem, 2, 1, inputs))
    else:
        compile_plan(channel_plan(adapt(variant, problem), problem, 2, 1,
                                  settings.templates_override()))
    for inputs in (None, *fused):
        plan = recurrent_plan(variant, problem, 2, 1, inputs=inputs)
        compile_plan(plan, recurrent_input_metas(plan))


def to_numpy(x):
    """mx array -> NumPy (bfloat16 through ml_dtypes, bit for bit)."""
    import mlx.core as mx
    import numpy as np

    if x.dtype == mx.bfloat16:
        import ml_dtypes

        return np.array(x.view(mx.uint16)).view(ml_dtypes.bfloat16)
    return np.array(x)


def from_numpy(x):
    """NumPy -> mx array (bfloat16 bit for bit)."""
    import mlx.core as mx

    if x.dtype.name == "bfloat16":
        return mx.array(x.view("uint16")).view(mx.bfloat16)
    return mx.array(x)


@functools.cache
def default_launcher():
    """MLX on a Metal GPU, the simulator otherwise (one shared instance)."""
    import mlx.core as mx

    return MLXLauncher() if mx.metal.is_available() else SimLauncher()


def _run(plan: Plan, launches, env: dict, launcher) -> dict:
    for launch in launches:
        outs = launcher(plan, launch, [env[n] for n in launch.inputs])
        env.update(zip(launch.outputs, outs))
    return env


def _input_grads(env: dict, primals, gate: str) -> tuple:
    """``(dq, dk, dv, dgates, dbeta)`` in the primals' chunk layout from a backward's
    environment: dq / dk summed over the r value heads of each key head, the gate cotangent
    the O(C^2) epilogue (`gdngen.algebra.chunkwise.decay_factors_{log,linear}_vjp`) on ``dd``."""
    from gdngen.algebra import chunkwise
    from gdngen.backends.portable.mlx_chunkwise import XP

    q, k, v, gates, beta = primals[:5]
    N, B, Hk, r, C = v.shape[:5]
    Dk = q.shape[-1]
    dq = env["dq"].reshape(N, B, Hk, r, C, Dk).sum(axis=3).reshape(q.shape)
    dk = env["dk"].reshape(N, B, Hk, r, C, Dk).sum(axis=3).reshape(k.shape)
    dv = env["dv"].reshape(v.shape)
    dbeta = env["dbeta"].reshape(beta.shape)
    dD = env["dd"].reshape(gates.shape[:-1] + (C + 1, C + 1))
    if gate == "log":
        D = chunkwise.decay_factors(XP, gates)
        dgates = chunkwise.decay_factors_log_vjp(XP, gates, D, dD)
    else:
        D = chunkwise.decay_factors(XP, XP.log(gates))
        dgates = chunkwise.decay_factors_linear_vjp(XP, gates, D, dD)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), dgates, dbeta


@functools.lru_cache(maxsize=128)
def _core(variant: Variant, problem: Problem, gate, scale: float, launcher,
          templates=None, qk_norm=False):
    """``mx.custom_function`` over chunk-layout arrays (as `gdngen.algebra.chunkwise.gated_delta`
    passes them) -> (Y, S_final, *saved), with the Metal backward as its VJP. ``templates``:
    a template override folder (default: ``GDNGEN_TEMPLATES`` when the plan is made).

    Fused layer inputs (`gdngen.backends.kernel_inputs`): ``qk_norm``: q, k are raw;
    ``gate`` a `gdngen.algebra.chunkwise.ParameterGate`: ``gates`` is ``(a, A_log, dt_bias)`` (the
    parameters ``[Hk, r, 1]``). The forward hands them to the fused build of its two kernels
    (`launch_plan` with ``inputs``, `render_fused`), which normalise each loaded q, k row in
    float32 and form the log gate from ``a`` before the in-chunk cumulative sums: no normalised
    q, k and no log gate exist as arrays. The VJP recomputes them as mx ops (the normalised
    q, k in float32, back in their dtype: `gdngen.backends.generated.l2_normalized`; the log
    gate: `gdngen.algebra.chunkwise.log_gates`) for the plain backward kernels, and maps the
    kernels' dq, dk through the norm's VJP and the log gate's cotangent to the three arrays
    (`gdngen.algebra.chunkwise.gates_vjp`)."""
    import mlx.core as mx

    from gdngen.algebra import chunkwise
    from gdngen.backends.portable.mlx_chunkwise import XP

    parameter_gate, gate = gate, chunkwise.convention(gate)  # the kernels' gate convention

    def normalized(x):
        return l2_normalized(XP, x) if qk_norm else x

    def raw_cotangent(x, dx):
        return l2_normalized_vjp(XP, x, dx) if qk_norm else dx

    prm = mx.array([scale, 1.0 if gate == "linear" else 0.0], mx.float32)
    inputs = KernelInputs.of(qk_norm, parameter_gate)
    # the fused forward's: prm[2] the lower bound (sigmoid_bound; 0 otherwise)
    prm_fused = mx.array([scale, 1.0 if gate == "linear" else 0.0, inputs.lower_bound],
                         mx.float32)

    def plan_for(v):
        N, B = int(v.shape[0]), int(v.shape[1])
        if templates is None:
            return launch_plan(variant, problem, N, B, inputs)
        return _launch_plan(adapt(variant, problem), problem, N, B, templates, False,
                            _fused_key(inputs))

    def forward_inputs(q, k, gates):
        """The fused forward's q, k and gate operands: raw (the kernels compute the rest)."""
        if not inputs.fused:
            return {"q": q, "k": k, "g": gates}
        env = {"q": q, "k": k, "prm": prm_fused}
        if inputs.gate_form is None:
            env["g"] = gates
        else:
            a, A_log, dt_bias = gates
            env["a"] = a
            env["A_log"], env["dt_bias"] = kernel_parameters(mx, A_log, dt_bias, problem.Hv,
                                                             problem.Dk, False)
        return env

    # Chunk layout (gdngen.algebra.chunkwise.to_chunks): v [N, B, Hk, r, C, Dv], gates / beta
    # [N, B, Hk, r, C]; q and k hold N, B, Hk, C, Dk in that order (with or without a unit r
    # axis): the kernels only need their memory order.
    @mx.custom_function
    def core(q, k, v, gates, beta, s0):
        plan = plan_for(v)
        env = {"v": v, "beta": beta, "s0": s0, "prm": prm, **forward_inputs(q, k, gates)}
        if hasattr(launcher, "prepare"):
            launcher.prepare(plan, env)
        env = _run(plan, plan.forward, env, launcher)
        Y = env["y_out"].reshape(v.shape)
        S = env["final_state"].reshape(s0.shape)
        return (Y, S) + tuple(env[n] for n in plan.saved)

    @core.vjp
    def core_vjp(primals, cotangents, outputs):
        q, k, v, parameters, beta, s0 = primals
        gates = chunkwise.log_gates(XP, parameters, parameter_gate)[0]
        plan = plan_for(v)
        N, B, Hk, r, C, Dv = v.shape
        Dk = q.shape[-1]
        Hv = Hk * r
        dY = cotangents[0]
        dY = mx.zeros(outputs[0].shape, q.dtype) if dY is None else dY.astype(q.dtype)
        dS = cotangents[1]
        dS = mx.zeros(s0.shape, mx.float32) if dS is None else dS.astype(mx.float32)
        env = {"q": normalized(q), "k": normalized(k), "v": v, "g": gates, "beta": beta,
               "s0": s0, "prm": prm, "dy": dY.reshape(N, B, Hv, C, Dv),
               "dsf": dS.reshape(B, Hv, Dv, Dk)}
        env.update(zip(plan.saved, outputs[2:]))
        env = _run(plan, plan.backward, env, launcher)
        dq, dk, dv, dgates, dbeta = _input_grads(env, (q, k, v, gates, beta), gate)
        return (raw_cotangent(q, dq), raw_cotangent(k, dk), dv,
                chunkwise.gates_vjp(XP, parameters, parameter_gate, dgates), dbeta,
                env["ds0"].reshape(s0.shape))

    return core


@functools.lru_cache(maxsize=128)
def _packed_core(variant: Variant, problem: Problem, gate: str, launcher, templates):
    """The packed kernels' chunk walk (`packed_launch_plan`) as an ``mx.custom_function``
    ``(q, k, v, gates, beta, inject) -> (Y, S_in, *saved)``: the `gdngen.algebra.packed.chunk_walk`
    contract (`gdngen.algebra.chunkwise.forward` with ``inject``, from a zero state).

    Chunk layout (`gdngen.algebra.chunkwise.to_chunks`): q, k ``[N, 1, Hk, C, Dk]`` with q already
    scaled (the kernels run with scale 1), v ``[N, 1, Hk, r, C, Dv]``, gates / beta ``[N, 1,
    Hk, r, C]``, ``inject [N, 1, Hk, r, Dv, Dk]`` float32 added to the state leaving chunk n;
    Y like v, ``S_in`` like inject, the states entering the chunks. The VJP (the packed
    backward: ``dS_in`` enters at each chunk's entry) returns ``dinject`` = the cotangent of
    the state leaving each chunk, zero for the last (the walk's final state is not an
    output)."""
    import mlx.core as mx

    f32 = mx.float32
    prm = mx.array([1.0, 1.0 if gate == "linear" else 0.0], f32)

    def plan_for(v):
        return packed_launch_plan(variant, problem, int(v.shape[0]), int(v.shape[1]),
                                  templates)

    def state_shape(v, q):
        return (int(v.shape[1]), problem.Hv, int(v.shape[-1]), int(q.shape[-1]))

    @mx.custom_function
    def core(q, k, v, gates, beta, inject):
        plan = plan_for(v)
        env = {"q": q, "k": k, "v": v, "g": gates, "beta": beta,
               "s0": mx.zeros(state_shape(v, q), f32), "inject": inject.astype(f32), "prm": prm}
        if hasattr(launcher, "prepare"):
            launcher.prepare(plan, env)
        env = _run(plan, plan.forward, env, launcher)
        return (env["y_out"].reshape(v.shape), env["states"].reshape(inject.shape)) + \
            tuple(env[n] for n in plan.saved)

    @core.vjp
    def core_vjp(primals, cotangents, outputs):
        q, k, v, gates, beta, inject = primals
        plan = plan_for(v)
        N, B, Hk, r, C, Dv = v.shape
        dY, dS_in = cotangents[0], cotangents[1]
        dY = mx.zeros(v.shape, q.dtype) if dY is None else dY.astype(q.dtype)
        dS_in = mx.zeros(inject.shape, f32) if dS_in is None else dS_in.astype(f32)
        states = (N, B, Hk * r) + tuple(inject.shape[-2:])
        env = {"q": q, "k": k, "v": v, "g": gates, "beta": beta,
               "s0": mx.zeros(state_shape(v, q), f32), "inject": inject.astype(f32),
               "prm": prm, "dy": dY.reshape(N, B, Hk * r, C, Dv),
               "dsf": mx.zeros(state_shape(v, q), f32), "dsin": dS_in.reshape(states)}
        if plan.saved:
            env["states"] = outputs[1].reshape(states)
            env.update(zip(plan.saved, outputs[2:]))
        env = _run(plan, plan.backward, env, launcher)
        return _input_grads(env, primals, gate) + (env["dsout"].reshape(inject.shape),)

    return core


def recurrent_forward(q, k, v, decay, beta, S0, *, scale, variant, problem=None, launcher=None,
                      templates_dir=None, qk_norm=False, gate=None):
    """The recurrent kernel (``templates/metal/recurrent.metal.j2``): the forward of the gated
    delta rule one step at a time, for short calls (decode / short prefill).

    Contract: float32 mx arrays q, k ``[B,T,Hk,Dk]``; v ``[B,T,Hv,Dv]``; ``decay`` the LINEAR
    decay in [0, 1], ``[B,T,Hv]`` (scalar gate) or ``[B,T,Hv,Dk]`` (per-channel gate; the caller
    takes exp of log gates, exact 0 at log g = -inf); beta ``[B,T,Hv]``; S0 ``[B,Hv,Dv,Dk]``.
    Masked steps must already be folded in (decay 1, beta 0: `gdngen.algebra.chunkwise.fold_mask`).
    Returns ``(y [B,T,Hv,Dv], S_T [B,Hv,Dv,Dk])``, float32; value head h reads key head
    h // (Hv / Hk); y = scale * S_t q_t. Per step (`gdngen.algebra.chunkwise.recurrent_forward`):
    ``u = beta (v - S (a k))``, ``y = S (a q) + u (k.q)``, ``S <- S diag(a) + u k^T``.

    One launch (`recurrent_plan`): a threadgroup per (batch, value head, block of ``dv_tile``
    state rows), ``simdgroups`` simdgroups of 32 lanes, each lane holding Dk / 32 columns of
    its simdgroup's ``dv_tile / simdgroups`` rows in registers for the whole walk over T (a
    runtime size); the dot products are ``simd_sum``s. Nothing is saved for a backward (no
    VJP here: `gated_delta` differentiates the chunk path instead). Rendered, compiled and
    cached like the chunk kernels (kernel named by its source hash); ``problem`` (default: from
    the shapes, the gate kind from decay's rank) specialises the source, ``variant`` gives
    ``dv_tile`` / ``simdgroups``. Outputs are poisoned as the chunk kernels': always in the
    simulator (unwritten elements fail the launch), NaN-initialised on a GPU under
    ``GDNGEN_POISON_OUTPUTS=1``. ``launcher``: `MLXLauncher` / `SimLauncher` (default
    `default_launcher`); ``templates_dir``: a template override folder.

    Fused layer inputs (`render_fused`, `gdngen.backends.kernel_inputs`), computed by the kernel
    in its loads: ``qk_norm`` True: q, k are raw; each loaded row is L2-normalised in float32
    (``x rsqrt(sum x^2 + 1e-6)``, the sum a ``simd_sum``), q then scaled. ``gate`` a
    `gdngen.algebra.chunkwise.ParameterGate`: ``decay`` is the tuple ``(a, A_log, dt_bias)``, ``a``
    the raw projection ``[B,T,Hv]`` / ``[B,T,Hv,Dk]`` (masked steps a = -inf), the parameters in any
    form `kernel_parameters` takes (``[Hv]``; per channel also ``[Hv,1]``, ``[Hv,Dk]``); the
    kernel forms log g per step (and channel) and the decay exp(log g), the lower bound a
    runtime scalar (one build serves every bound).
    """
    import mlx.core as mx

    from gdngen.algebra import chunkwise

    B, T, Hk, Dk = (int(n) for n in q.shape)
    Hv, Dv = int(v.shape[2]), int(v.shape[3])
    parameter_gate = isinstance(gate, chunkwise.ParameterGate)
    if gate is not None and not parameter_gate:
        raise ValueError(f"gate must be None or a chunkwise.ParameterGate, got {gate!r}")
    if parameter_gate != isinstance(decay, tuple) or (parameter_gate and len(decay) != 3):
        raise ValueError("decay must be the tuple (a, A_log, dt_bias) exactly when gate is a "
                         f"ParameterGate, got {type(decay).__name__} with gate={gate!r}")
    inputs = KernelInputs.of(qk_norm, gate)
    gate_kind = "vector" if chunkwise.raw_gates(decay).ndim == 4 else "scalar"
    if problem is None:
        problem = Problem(Hk, Hv, Dk, Dv, "float32", gate_kind)
    got = (problem.Hk, problem.Hv, problem.Dk, problem.Dv, problem.gate)
    if got != (Hk, Hv, Dk, Dv, gate_kind):
        raise ValueError(f"arrays have shape class Hk={Hk}, Hv={Hv}, Dk={Dk}, Dv={Dv}, gate "
                         f"{gate_kind}, expected {problem.key()}")
    launcher = default_launcher() if launcher is None else launcher
    plan = recurrent_plan(variant, problem, T, B, templates_dir, inputs)
    f32 = mx.float32
    env = {"q": q.astype(f32), "k": k.astype(f32), "v": v.astype(f32),
           "a": chunkwise.raw_gates(decay).astype(f32), "beta": beta.astype(f32),
           "s0": S0.astype(f32), "prm": mx.array([float(scale)], f32)}
    if inputs.fused:
        env["prm"] = mx.array([float(scale), inputs.lower_bound], f32)
    if parameter_gate:
        env["A_log"], env["dt_bias"] = kernel_parameters(mx, *decay[1:], Hv, Dk,
                                                         gate_kind == "vector")
    if hasattr(launcher, "prepare"):
        launcher.prepare(plan, env)
    env = _run(plan, plan.forward, env, launcher)
    return env["y_out"], env["final_state"]


def _chunk_call(variant: Variant, problem: Problem, gate, scale: float, launcher,
                templates=None, qk_norm=False):
    """``f(q, k, v, g, beta, s0, mask=None) -> (y, S_final)`` on the chunk kernels at any T
    (API layout, inputs cast as `gated_delta` casts them; y in q's dtype); ``qk_norm``: q, k
    raw, ``gate`` a `gdngen.algebra.chunkwise.ParameterGate` (``g`` then ``(a, A_log, dt_bias)``):
    both computed by the fused forward kernels and recomputed for the backward (`_core`)."""
    from gdngen.algebra import chunkwise
    from gdngen.backends.portable.mlx_chunkwise import XP

    core = _core(variant, problem, gate, scale, launcher, templates, qk_norm)

    def core_outputs(*arrays):
        outs = core(*arrays)
        return outs[0], outs[1]

    def chunkwise_call(q, k, v, g, beta, s0, mask=None):
        # The scale is applied inside the kernels (in float32), so the layout glue runs with 1.
        y, state = chunkwise.gated_delta(XP, core_outputs, q, k, v, g, beta, s0, mask,
                                         scale=1.0, gate=gate, chunk_size=variant["chunk_size"])
        return y.astype(q.dtype), state

    return chunkwise_call


def gated_delta(q, k, v, g, beta, initial_state=None, *, mask=None, scale=1.0, gate="log",
                variant=None, launcher=None, qk_norm=False):
    """Run a Metal ``variant`` (differentiable, through ``mx.custom_function``).

    Shapes and semantics as `gdngen.mlx.gated_delta`; y has q's dtype, the final state is
    float32. k and v are cast to q's dtype, gates / beta / state to float32.
    ``launcher``: `MLXLauncher` (default on a Metal GPU) or `SimLauncher` (default elsewhere).

    Scalar gates with T >= the variant's ``recurrent_below``: the chunk kernels, forward and
    backward. T < recurrent_below: the forward is the recurrent kernel (`recurrent_forward`)
    and the VJP the chunk path's (`gdngen.backends.portable.mlx_chunkwise.recurrent_or_chunkwise`).
    Per-channel (vector) gates ``[B,T,Hv,Dk]``, likewise switched at recurrent_below: the chunk
    path is `gdngen.algebra.chunkwise_channel` at the variant's chunk (the mlx backend's
    ``mx.custom_function``, `gdngen.backends.portable.mlx_chunkwise.chunkwise_gated_delta`) with its
    two chunk walks on the walk kernels (`ChannelWalks`), forward and backward; its intra-chunk
    stages run in mx ops (float32).

    ``qk_norm``: q, k are raw (`BackendSpec.fused_inputs`); ``gate`` a
    `gdngen.algebra.chunkwise.ParameterGate`: ``g`` is ``(a, A_log, dt_bias)``
    (`gdngen.algebra.layer_inputs`). The kernels compute both in their loads (`render_fused`): the
    recurrent kernel (`recurrent_forward`'s fused build) and, scalar gates, the chunk forward's two
    kernels (`_core`), so no normalised q, k and no log gate are formed as arrays in a forward; the
    chunk VJP recomputes them as mx ops for the plain backward kernels (per-channel gates:
    `gdngen.backends.portable.mlx_chunkwise.chunk_core` computes them in its core, forward and VJP).
    """
    from gdngen import call as calls

    if variant is None or variant.backend != BACKEND:
        raise ValueError(f"variant must be a metal Variant, got {variant!r}")
    checked, operands = calls.of_kernel_args("mlx", q, k, v, g, beta, initial_state, mask,
                                             scale=scale, gate=gate, qk_norm=qk_norm)
    return SPEC.run(checked, operands, variant, launcher=launcher)


def _forward(call, operands, variant, launcher=None):
    """`gated_delta`'s body on a checked dense `gdngen.call.Call`."""
    import mlx.core as mx

    from gdngen.algebra import chunkwise
    from gdngen.backends.portable import mlx_chunkwise
    from gdngen.backends.portable.mlx_chunkwise import XP

    shape, problem, gate, scale, qk_norm = (call.shape, call.problem, call.kernel_gate,
                                            call.scale, call.qk_norm)
    q, k, v, _, beta, initial_state, mask = operands[:7]
    g = operands.kernel_gates()
    variant = adapt(variant, problem)
    launcher = default_launcher() if launcher is None else launcher
    f32 = mx.float32
    if initial_state is None:
        initial_state = mx.zeros((shape.B, shape.Hv, shape.Dv, shape.Dk), f32)
    args = (q, k.astype(q.dtype), v.astype(q.dtype), chunkwise.cast_gates(g, f32),
            beta.astype(f32), initial_state.astype(f32))

    if shape.vector_gate:
        walks = ChannelWalks(variant, problem, launcher, settings.templates_override())

        def chunkwise_call(q, k, v, g, beta, s0, mask=None):
            y, state = mlx_chunkwise.chunkwise_gated_delta(
                q.astype(f32), k.astype(f32), v.astype(f32), g, beta, s0, mask, scale=scale,
                gate=gate, chunk_size=variant["chunk_size"], save_states=variant["save_states"],
                walks=(walks.forward, walks.backward), qk_norm=qk_norm)
            return y.astype(q.dtype), state
    else:
        chunkwise_call = _chunk_call(variant, problem, gate, scale, launcher, qk_norm=qk_norm)
    if shape.T >= SPEC.parse(variant).recurrent_below:
        return chunkwise_call(*args, mask)

    parameter_gate = gate if isinstance(gate, chunkwise.ParameterGate) else None

    def recurrent(q, k, v, g, beta, s0):
        # the kernel normalises q, k and forms a ParameterGate's decay in its loads
        decay = g if parameter_gate else chunkwise.linear_decay(XP, g, gate)  # exp(-inf) = 0
        y, state = recurrent_forward(q, k, v, decay, beta, s0, scale=scale, variant=variant,
                                     problem=problem, launcher=launcher, qk_norm=qk_norm,
                                     gate=parameter_gate)
        return y.astype(q.dtype), state

    g, beta = chunkwise.fold_mask(XP, args[3], args[4], mask, gate)
    y, state = mlx_chunkwise.recurrent_or_chunkwise(recurrent, chunkwise_call)(
        *args[:3], g, beta, args[5])
    if mask is not None:
        y = mx.where(mask[..., None, None], y, mx.zeros((), y.dtype))
    return y.astype(q.dtype), state


def packed_gated_delta(q, k, v, g, beta, initial_state=None, *, mask=None, scale=1.0,
                       gate="log", variant, cu_seqlens, launcher=None, templates_dir=None):
    """A packed row (`gdngen.algebra.packed`, fla's ``cu_seqlens``) on ``variant``'s kernels, scalar
    gates: the row's chunk walk on the packed build (`render_packed`, `_packed_core`: resets,
    injected initial states, entering states S_in out), each sequence's one-chunk calls (the
    initial states' free response, the final state from its last chunk's S_in) on the dense
    chunk kernels (B = N rows of one chunk, masked y zeroed). Differentiable in every input.

    Arguments as `gated_delta` with ``cu_seqlens`` int32 ``[N+1]`` (checked here): q, k
    ``[1,T,Hk,Dk]``, v ``[1,T,Hv,Dv]``, g / beta ``[1,T,Hv]``, ``initial_state [N,Hv,Dv,Dk]``
    or None, mask ``[1,T]``. Float32 inside (the variant's ``precision`` still applies to the
    matmul operands); returns ``(y [1,T,Hv,Dv] in q's dtype, final_state [N,Hv,Dv,Dk]
    float32)``. ``recurrent_below`` does not apply (a packed row always walks chunks).
    ``templates_dir``: a template override folder for both builds (default
    ``GDNGEN_TEMPLATES``)."""
    from gdngen import call as calls

    if variant is None or variant.backend != BACKEND:
        raise ValueError(f"variant must be a metal Variant, got {variant!r}")
    checked, operands = calls.of_kernel_args("mlx", q, k, v, g, beta, initial_state, mask,
                                             scale=scale, gate=gate, cu_seqlens=cu_seqlens)
    return SPEC.run_packed_kernels(checked, operands, variant, launcher=launcher,
                                   templates_dir=templates_dir)


def _packed(call, operands, variant, launcher=None, templates_dir=None):
    """`packed_gated_delta`'s body on a checked packed `gdngen.call.Call`."""
    import mlx.core as mx

    from gdngen.algebra import packed
    from gdngen.backends.portable.mlx_chunkwise import XP

    gate, scale = call.gate, call.scale
    q, k, v, g, beta, initial_state, mask, _, _, cu_seqlens = operands
    problem = call.replace(dtype="float32").problem
    variant = adapt(variant, problem)
    launcher = default_launcher() if launcher is None else launcher
    templates = settings.templates_override() if templates_dir is None else templates_dir
    chunk_call = _chunk_call(variant, problem, gate, scale, launcher, templates)
    walk_core = _packed_core(variant, problem, gate, launcher, templates)

    def dense(q, k, v, g, beta, S0, mask):
        y, S = chunk_call(q, k, v, g, beta, S0, mask)
        return mx.where(mask[..., None, None], y, mx.zeros((), y.dtype)), S

    walk = packed.chunk_walk(XP, lambda *a: walk_core(*a)[:2], scale=scale, gate=gate,
                             chunk_size=variant["chunk_size"])
    f32 = mx.float32
    y, state = packed.gated_delta(
        XP, dense, walk, *(x.astype(f32) for x in (q, k, v, g, beta)),
        None if initial_state is None else initial_state.astype(f32), mask, cu_seqlens,
        gate=gate, chunk_size=variant["chunk_size"])
    return y.astype(q.dtype), state


# ---------------------------------------------------------------------------- validation


def problem_of_inputs(inputs: dict, dtype: str) -> Problem:
    """The `Problem` of battery-style inputs (q [B,T,Hk,Dk], v [B,T,Hv,Dv])."""
    _, _, Hk, Dk = inputs["q"].shape
    Hv, Dv = inputs["v"].shape[2], inputs["v"].shape[3]
    return Problem(int(Hk), int(Hv), int(Dk), int(Dv), dtype, "scalar")


def simulate(variant, problem, inputs, cotangents, *, gate="log", scale=None, schedule="forward",
             seed=0):
    """Forward + VJP of ``variant`` in `gdngen.backends.metal.sim`, through the shipped MLX path.

    ``inputs``: NumPy q, k, v, g, beta and optionally initial_state, mask (shapes as the API);
    ``cotangents``: ``{"y": dy, "final_state": dS}``. ``scale`` defaults to Dk ** -0.5.
    Returns ``(outputs, grads)``: ``{"y", "final_state"}`` and ``{"q", "k", "v", "g", "beta",
    "initial_state"}``, float32 NumPy arrays.
    """
    import mlx.core as mx
    import numpy as np

    got = problem_of_inputs(inputs, problem.dtype)
    if (got.Hk, got.Hv, got.Dk, got.Dv) != (problem.Hk, problem.Hv, problem.Dk, problem.Dv):
        raise ValueError(f"inputs have shape class {got.key()}, expected {problem.key()}")
    mdt = getattr(mx, problem.dtype)
    scale = float(problem.Dk) ** -0.5 if scale is None else float(scale)
    names = ("q", "k", "v", "g", "beta")
    args = [mx.array(np.asarray(inputs[n], np.float32)).astype(mdt if n in names[:3] else
                                                               mx.float32) for n in names]
    B = args[0].shape[0]
    s0 = inputs.get("initial_state")
    s0 = (mx.zeros((B, problem.Hv, problem.Dv, problem.Dk)) if s0 is None
          else mx.array(np.asarray(s0, np.float32)))
    mask = inputs.get("mask")
    mask = None if mask is None else mx.array(np.asarray(mask, bool))
    launcher = SimLauncher(schedule=schedule, seed=seed)

    def f(q, k, v, g, beta, s0):
        return gated_delta(q, k, v, g, beta, s0, mask=mask, scale=scale, gate=gate,
                           variant=variant, launcher=launcher)

    cot = [mx.array(np.asarray(cotangents["y"], np.float32)).astype(mdt),
           mx.array(np.asarray(cotangents["final_state"], np.float32))]
    (y, S), grads = mx.vjp(f, args + [s0], cot)
    out = {"y": y, "final_state": S}
    named = dict(zip(names + ("initial_state",), grads))
    as_np = {n: np.array(x.astype(mx.float32)) for n, x in {**out, **named}.items()}
    return ({n: as_np[n] for n in out}, {n: as_np[n] for n in named})


class Metal(Backend):
    """The generated Metal kernels of this module (Apple GPUs; `gdngen.backends.metal.sim`
    off-device); its hooks are the module's functions (looked up when called)."""

    name, framework, config, tolerances = BACKEND, "mlx", Config, POLICY_TOLERANCES
    device_kinds, device_limit, reference_device = ("apple",), "threadgroup_memory", "apple-m1"
    gates = tuned_gates = ("scalar", "vector")
    fused_inputs, packed_gates = ("qk_norm", "gate"), ("scalar",)

    def space(self, problem, device=None):
        return variant_space(problem, device)

    def default(self, problem, device=None):
        return default_config(problem, device)

    def supports(self, problem):
        return supports(problem)

    def footprint(self, variant, problem):
        return max_threadgroup_bytes(variant, problem)

    def render_plan(self, variant, problem):
        return render_plan(variant, problem)

    def lower_check(self, variant, problem):
        return lower_check(variant, problem)

    def forward(self, call, operands, variant, launcher=None):
        return _forward(call, operands, variant, launcher)

    def packed(self, call, operands, variant, launcher=None, templates_dir=None):
        return _packed(call, operands, variant, launcher, templates_dir)


SPEC = Metal()
