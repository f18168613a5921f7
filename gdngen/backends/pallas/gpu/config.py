"""pallas_gpu's variants: constants, the typed `Config`, the parameters resolved for a problem
(`GPUPlanning.kernel_params`), the shared-memory estimate (`GPUPlanning.footprint`), the variant
space and the default variant."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from gdngen import settings
from gdngen.backends.pallas.backend import PallasBackend
from gdngen.config import VariantConfig, recurrent_switch
from gdngen.problem import Problem
from gdngen.variant import Variant

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
#: per-channel gates: the widest bk offered. The intra-chunk kernels hold a dozen (C, BK) float32
#: tiles live through their sub-chunk loops; at chunk 64 for H100 (ieee, D = 128, measured with
#: ptxas off-GPU) the grads kernel compiles in 47 s at bk 32 / 8 warps, 131 s at bk 32 / 4 warps,
#: and had not finished after 7 minutes at bk 64 / 4 warps (register spills).
CHANNEL_MAX_TILE = 32
NUM_STAGES = (2, 3)
#: log gates are clamped to this finite floor inside the kernels (exp gives exactly 0 either
#: way, and a 0/1 matmul never meets 0 * -inf); the gate cotangent uses the true gates.
LOG_GATE_FLOOR = -1e30
#: environment variable forcing interpret mode (set by ``gdngen tune --dry-run`` workers).
ENV_INTERPRET = settings.ENV_INTERPRET


def padded_dim(d: int) -> int:
    """Head dim as the kernels see it: rounded up to a multiple of 16."""
    return -(-d // 16) * 16


def tiles(d: int) -> list[int]:
    """Tiles enumerated for head dim ``d``: the powers of two in `TILES` dividing its padded
    size, at least 32 where one of them is (16-wide tiles only where none is: 16, 48, 80, ...)."""
    padded = padded_dim(d)
    dividing = [t for t in TILES if padded % t == 0]
    return [t for t in dividing if t >= 32] or dividing[-1:]


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
    """Typed pallas_gpu parameters.

    * ``chunk_size`` 16 | 32 | 64: steps per chunk.
    * ``bk`` / ``bv``: register tiles over Dk / Dv (powers of two >= 16 dividing the head dim
      padded to 16; otherwise the largest that does). Head dims are zero-padded to 16s.
    * ``precision``: matmul policy (`PRECISIONS`, `POLICY_TOLERANCES`); the decay segment sums
      and the unit-lower-triangular inverse always run at "ieee".
    * ``num_warps`` / ``num_stages``: Triton launch parameters (``plgpu.CompilerParams``).
    * ``save_states``: the forward saves U, Wk, Pm, T and the entering states, or the backward
      recomputes them.
    * ``recurrent_below``: shorter calls run the recurrent kernel (reaches no source).
    """

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


class GPUPlanning(PallasBackend):
    """pallas_gpu's variants (the base of `gdngen.backends.pallas.gpu.PallasGPU`)."""

    log_gate_floor = LOG_GATE_FLOOR

    def kernel_params(self, variant: Variant, problem: Problem) -> dict:
        """The variant's parameters resolved for ``problem``: ``chunk_size``, ``bk``/``bv`` (tiles
        dividing the padded head dims), ``dk``/``dv`` (padded head dims), ``precision``,
        ``num_warps``, ``num_stages``, ``save_states``.

        ValueError for a variant of another backend, unknown or missing parameters, bad values, or
        a problem the backend does not implement.
        """
        config = self.parse(variant)
        self.check(problem)
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

    def footprint(self, variant: Variant, problem: Problem) -> int:
        """Planning estimate (the module's ``shared_memory_bytes``) of the variant's largest
        shared-memory use per program, in bytes: the walks' ``num_stages`` staged per-chunk
        loads (key and query tiles, Wk, Pm, a BV-column tile) plus one staged dot, or the
        chunk-parallel kernels' largest staged dot. A bound to prune variants that cannot fit,
        not the compiler's figure."""
        p = self.kernel_params(variant, problem)
        C, bk, bv, dk = p["chunk_size"], p["bk"], p["bv"], p["dk"]
        isz = 4 if problem.dtype == "float32" else 2
        # per-channel walks: Wk, Kc (forward) or Qd (reverse) and Pm, all float32
        keys = 3 * C * dk * 4 if problem.gate == "vector" else 2 * C * dk * isz + C * dk * 4
        per_chunk = keys + C * C * 4 + C * bv * 4
        walk = p["num_stages"] * per_chunk + (C * C + C * bv) * 4
        parallel = 2 * (C * C + C * max(bk, bv)) * 4
        return max(walk, parallel)

    def space(self, problem: Problem, device=None) -> list[Config]:
        """Every variant whose `footprint` fits ``device``'s ``shared_memory``
        (`gdngen.devices`); per-channel gates: the walks' parameters only, at ieee, saving
        states."""
        self.check(problem)
        budget = device.limits["shared_memory"]
        vector = problem.gate == "vector"
        space = []
        key_tiles = [t for t in tiles(problem.Dk) if not vector or t <= CHANNEL_MAX_TILE]
        for chunk, precision, bk, bv, warps, stages, save in itertools.product(
                CHUNK_SIZES, ("ieee",) if vector else PRECISIONS, key_tiles,
                tiles(problem.Dv), NUM_WARPS, NUM_STAGES, (True,) if vector else (True, False)):
            config = Config(bk, bv, chunk, stages, warps, precision, save)
            if self.footprint(Variant(BACKEND, config.params()), problem) <= budget:
                space.append(config)
        return space

    def default(self, problem: Problem, device=None) -> Config:
        """Chunk 64, ieee, 64-wide tiles, 4 warps, 2 stages, saving states (per-channel gates:
        32-wide tiles and 8 warps, `CHANNEL_MAX_TILE`); where that does not fit ``device``'s
        shared memory, the ieee variant that fits and is closest to it (saving states, chunk
        nearest 64, the ideal's warps and 2 stages, then the widest tiles up to its)."""
        wide, warps = (CHANNEL_MAX_TILE, 8) if problem.gate == "vector" else (64, 4)
        ideal = Config(min(wide, tiles(problem.Dk)[-1]), min(wide, tiles(problem.Dv)[-1]), 64, 2,
                       warps, "ieee", True)
        budget = device.limits["shared_memory"]
        if self.footprint(Variant(BACKEND, ideal.params()), problem) <= budget:
            return ideal
        fits = [c for c in self.space(problem, device) if c.precision == "ieee"]
        if not fits:
            raise ValueError(f"no {BACKEND} variant of {problem.key()} fits the "
                             f"{budget // 1024} KiB of shared memory of {device.name}")
        return min(fits, key=lambda c: (not c.save_states, abs(c.chunk_size - 64),
                                        (c.num_warps, c.num_stages) != (warps, 2),
                                        -min(c.bk, wide), -min(c.bv, wide)))

    def numerics_key(self, variant: Variant, problem: Problem) -> tuple:
        """What decides the variant's arithmetic on ``problem``: its resolved parameters
        without the launch parameters (``num_warps``, ``num_stages``)."""
        p = self.kernel_params(variant, problem)
        return tuple(sorted((k, v) for k, v in p.items() if k not in ("num_warps", "num_stages")))
