"""The Metal backend's variants and sources: its typed config, space, footprints (threadgroup
memory, accumulator registers) and the renders of its kernels (plain, packed, fused inputs)."""

from __future__ import annotations

import functools
import itertools
import math
from dataclasses import dataclass

from gdngen import settings
from gdngen.backend import Backend
from gdngen.backends.kernel_inputs import KernelInputs
from gdngen.config import VECTOR_CHUNK, VariantConfig, recurrent_switch
from gdngen.devices import KiB
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
        return dict.fromkeys(CHANNEL_KERNELS, 4 * C * dvt)
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


def kernels_used(save: bool) -> tuple[str, ...]:
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
            "steps": False, **KernelInputs().context()}


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
        kernels_used(variant["save_states"])
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


def render_steps(variant: Variant, problem: Problem, *, templates_dir=None):
    """The recurrent kernel of ``variant`` that writes the state after every step
    (``return_states="steps"``): ``recurrent.metal`` rendered with ``steps`` set, its output
    ``states [B, T, Hv, Dv, Dk]`` in place of ``final_state``. With ``steps`` unset the template
    renders the recurrent kernel byte for byte (the variant's sha256 does not depend on it)."""
    from gdngen.sources import Rendered, environment, sources_sha256

    variant = adapt(variant, problem)
    template, context = render_plan(variant, problem)["recurrent.metal"]
    texts = {"recurrent_steps.metal": environment(templates_dir).get_template(template).render(
        **dict(context, steps=True))}
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
    return render_fused_kernels(adapt(variant, problem), problem, fused_key(inputs), templates)


@functools.lru_cache(maxsize=64)
def render_fused_kernels(variant: Variant, problem: Problem, fused: tuple, templates_dir):
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


def fused_key(inputs: KernelInputs | None) -> tuple:
    """What of ``inputs`` reaches a rendering (`KernelInputs.context`), hashable; ``()`` when
    nothing is fused. ``lower_bound`` is a runtime scalar: one build serves every bound."""
    if inputs is None or not inputs.fused:
        return ()
    return tuple(sorted(inputs.context().items()))


class Metal(Backend):
    """The generated Metal kernels of this module (Apple GPUs; `gdngen.backends.metal.sim`
    off-device); its hooks are the module's functions (looked up when called)."""

    name, framework, config, tolerances = BACKEND, "mlx", Config, POLICY_TOLERANCES
    device_kinds, device_limit, reference_device = ("apple",), "threadgroup_memory", "apple-m1"
    gates = tuned_gates = ("scalar", "vector")
    fused_inputs, packed_gates = ("qk_norm", "gate"), ("scalar",)
    step_states = chunk_states = ("scalar", "vector")

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

    # the hooks below run code of the modules above this one (the plans, the cores): looked
    # up in the package when called
    def lower_check(self, variant, problem):
        return _package().lower_check(variant, problem)

    def forward(self, call, operands, variant, launcher=None):
        return _package().dense_call(call, operands, variant, launcher)

    def packed(self, call, operands, variant, launcher=None, templates_dir=None):
        return _package().packed_call(call, operands, variant, launcher, templates_dir)

    def steps(self, call, operands, variant, launcher=None):
        return _package().steps_call(call, operands, variant, launcher)

    def chunks(self, call, operands, variant, launcher=None):
        return _package().chunks_call(call, operands, variant, launcher)


def _package():
    """`gdngen.backends.metal` (imported: this module is imported through it)."""
    import sys

    return sys.modules["gdngen.backends.metal"]


SPEC = Metal()
