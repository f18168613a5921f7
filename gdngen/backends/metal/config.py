"""The Metal backend's variants: constants, the typed `Config`, its space and default on a
device, its footprints (threadgroup memory, accumulator registers), and `adapt` (a variant's
params for a shape). Needs no framework and no other module of the backend."""

from __future__ import annotations

import functools
import itertools
import math
from dataclasses import dataclass

from gdngen.backend import parse_variant
from gdngen.config import VECTOR_CHUNK, VariantConfig, recurrent_switch
from gdngen.devices import KiB
from gdngen.problem import Problem
from gdngen.variant import Variant

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
#: The per-channel gates' kernels (`channel_plan`): the walks (the scan templates' per-channel
#: build), the intra-chunk stages (`STAGE_KERNELS`) and the reverse walk's decayed keys
#: (`KEYS_KERNEL`, chunk-parallel as the stages).
WALK_KERNELS = ("fwd_scan_channel", "bwd_scan_channel")
STAGE_KERNELS = ("channel_intra", "channel_grads")
KEYS_KERNEL = "channel_keys"
CHANNEL_KERNELS = WALK_KERNELS + STAGE_KERNELS + (KEYS_KERNEL,)
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
    arrays, see the templates); per-channel gates: the two walk kernels, W / -dW of the tile,
    the intra-chunk kernels, a (C, C) matrix and beta, and channel_keys none.
    ``qk_norm``: the fused build's (`render_fused`) forward kernels, which also hold the rows'
    norm factors (rk in fwd_intra, rq and rk in fwd_scan: C floats each; at most 26 KiB in all
    of the space, within every Apple GPU's 32 KiB)."""
    C, dvt, sg, dw = params["chunk_size"], params["dv_tile"], params["simdgroups"], \
        intra_tile(params["chunk_size"])
    if problem.gate == "vector":
        return {**dict.fromkeys(WALK_KERNELS, 4 * C * dvt),
                **dict.fromkeys(STAGE_KERNELS, 4 * (C * C + C)), KEYS_KERNEL: 0}
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
        return max(acc(C, dvt), acc(dvt, problem.Dk), acc(C, CHANNEL_BLOCK),
                   acc(C, dw))  # channel_intra's U tiles
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
    check(problem)
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
    """All Metal variants of ``problem`` that fit ``device`` (the kernels: the package docstring).

    Params: ``chunk_size`` 16/32/64; ``precision`` ieee (float32) / tf32 / bf16 (matmul operand
    precision); ``mma`` simdgroup (8x8 simdgroup matrices) or fma (scalar FMA, ieee only);
    ``simdgroups`` per threadgroup; ``dv_tile`` Dv columns per state-scan threadgroup;
    ``save_states`` (the forward keeps per-chunk states, W and T for the backward, else the
    backward recomputes them). Variants over the device's threadgroup memory or
    `MAX_ACC_FLOATS` are left out.

    Per-channel gates: ``chunk_size`` x ``simdgroups`` x ``dv_tile``, the params their path
    depends on (the chunk of `gdngen.algebra.chunkwise_channel`'s stages, the walk kernels' tiling,
    which the recurrent kernel shares); precision ieee, simdgroup matrices, saved states (the
    intra-chunk kernels compute in float32 whatever the walks' operand precision).
    """
    check(problem)
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
    params = parse(variant).params()
    if params["dv_tile"] > problem.Dv or problem.Dv % params["dv_tile"]:
        params["dv_tile"] = max(t for t in DV_TILES
                                if t <= min(params["dv_tile"], problem.Dv) and problem.Dv % t == 0)
    why = params_valid(params, problem)
    if why:
        raise ValueError(f"variant {variant} cannot run {problem.key()}: {why}")
    return Variant(BACKEND, params)


def check(problem: Problem) -> None:
    """ValueError unless the kernels take ``problem`` (`Metal.check`'s rule: every gate kind and
    dtype of a `Problem` is the backend's, so `supports` decides; same message)."""
    why = supports(problem)
    if why:
        raise ValueError(f"the {BACKEND} backend cannot run {problem.key()}: {why}")


def parse(variant: Variant) -> Config:
    """The `Config` of a metal ``variant`` (`gdngen.backend.parse_variant`); ValueError for
    another backend or bad params."""
    return parse_variant(BACKEND, Config, variant)
