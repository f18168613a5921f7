"""pallas_tpu's variants: constants, the typed `Config`, the parameters resolved for a problem
(`TPUPlanning.kernel_params`), the static VMEM estimates (`TPUPlanning.footprint`), the variant
space and the default variant."""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

from gdngen.backends.pallas.backend import PallasBackend
from gdngen.config import VariantConfig, recurrent_switch
from gdngen.devices import MiB
from gdngen.problem import Problem
from gdngen.variant import Variant

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
    """Typed pallas_tpu parameters.

    * ``chunk_size`` 32 | 64 | 128: steps per chunk.
    * ``dv_tile``: value columns per grid step (a 128-multiple dividing Dv; otherwise all Dv).
    * ``head_tile``: value heads per program sharing their key head (the largest divisor of the
      group not above it is used).
    * ``precision``: matmul policy (`PRECISIONS`, `POLICY_TOLERANCES`); the decay segment sums
      and the unit-lower-triangular inverse always run at float32.
    * ``save_states``: the forward saves the entering states and (I + A)^-1, or the backward
      recomputes them.
    * ``recurrent_below``: shorter calls run the recurrent kernel (reaches no source).
    """

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


def _padded_bytes(shape, itemsize: int = 4) -> int:
    """VMEM footprint of a block: the last two dims padded to the (8 or 16, 128) tile."""
    *lead, rows, cols = shape
    sublanes = 8 * (4 // itemsize)
    return (math.prod(lead) * (-(-rows // sublanes) * sublanes) * (-(-cols // 128) * 128)
            * itemsize)


def _vmem_limit(estimate: int) -> int:
    """Scoped-VMEM limit passed to Mosaic: the estimate plus 25%, at least 16 MiB."""
    return max(16 * MiB, -(-int(estimate * 1.25) // MiB) * MiB)


class TPUPlanning(PallasBackend):
    """pallas_tpu's variants (the base of `gdngen.backends.pallas.tpu.PallasTPU`)."""

    log_gate_floor = LOG_GATE_FLOOR

    def kernel_params(self, variant: Variant, problem: Problem) -> dict:
        """The variant's parameters resolved for ``problem``: ``chunk_size``, ``head_tile`` (a
        divisor of the group), ``dv_tile`` (dividing Dv), ``precision``, ``save_states``.

        ValueError for a variant of another backend, unknown or missing parameters, bad
        values, or a problem the backend does not implement.
        """
        config = self.parse(variant)
        self.check(problem)
        return {
            "chunk_size": config.chunk_size,
            "head_tile": max(d for d in _divisors(problem.group) if d <= config.head_tile),
            "dv_tile": config.dv_tile if config.dv_tile in _dv_tiles(problem.Dv) else problem.Dv,
            "precision": config.precision,
            "save_states": config.save_states,
        }

    def footprint(self, variant: Variant, problem: Problem) -> int:
        """Static VMEM estimate (the module's ``vmem_bytes``) of the variant's largest kernel, in
        bytes: double-buffered blocks, scratch, and live chunk-sized temporaries."""
        p = self.kernel_params(variant, problem)
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
        if problem.gate == "vector":  # the chunk walks, intra-chunk stages, recurrent kernel
            return max(self.walk_vmem_bytes(variant, problem),
                       self.channel_stage_vmem_bytes(variant, problem),
                       self.recurrent_vmem_bytes(variant, problem))
        return max(forward, backward, self.recurrent_vmem_bytes(variant, problem))

    def walk_vmem_bytes(self, variant: Variant, problem: Problem) -> int:
        """Static VMEM estimate of the per-channel chunk walks (the larger of forward and
        reverse), in bytes: double-buffered float32 blocks, the carried state and the Dv-tile
        sums, and chunk-sized temporaries."""
        p = self.kernel_params(variant, problem)
        C, ht, tv = p["chunk_size"], p["head_tile"], p["dv_tile"]
        Dk, Dv = problem.Dk, problem.Dv
        b = _padded_bytes
        values, keys, column = b((ht, C, tv)), b((ht, C, Dk)), b((ht, 1, Dk))
        state, tile_state = b((ht, Dv, Dk)), b((ht, tv, Dk))
        temps = 3 * b((C, tv)) + 2 * b((tv, Dk)) + b((C, Dk))
        # in: u, wk, kc, qd, pm, dcc, s0; out: y, sf, s_in, w
        forward = 2 * (3 * values + 3 * keys + b((ht, C, C)) + column + 2 * state + tile_state)
        # in: pm, q, k, b, wk, w, s_in, dy, dsf; out: dw, dwk, dqd, dkc, ddcc, ds0; the
        # decayed keys' temporaries (a (C, C) mask and its segment sums); tiled Dv: the
        # decayed keys kept and the sums over the tiles
        backward = (2 * (3 * values + 5 * keys + 2 * b((C, Dk)) + b((ht, C, C)) + column
                         + tile_state + 2 * state)
                    + 2 * b((C, C)) + 3 * b((C, Dk))
                    + (5 * keys + 2 * column if tv < Dv else 0))
        return max(forward, backward) + state + temps

    def channel_stage_vmem_bytes(self, variant: Variant, problem: Problem) -> int:
        """Static VMEM estimate of the per-channel intra-chunk kernel and its VJP's (the larger,
        ``grads``), in bytes: 44 float32 tiles of (C, max(C, Dk, Dv)), their double-buffered
        blocks and loop temporaries. Measured (Mosaic for v5e, ``compile_variant``'s
        chunk_fwd_bwd, Dk = Dv = 64 and 128 alike): grads 0.58, 1.30, 2.76 MB at C = 32, 64,
        128 (35-42 such tiles); intra 0.20, 0.53, 1.59 MB."""
        C = self.kernel_params(variant, problem)["chunk_size"]
        return 44 * _padded_bytes((C, max(C, problem.Dk, problem.Dv)))

    def recurrent_vmem_bytes(self, variant: Variant, problem: Problem) -> int:
        """Static VMEM estimate of the recurrent kernel at its largest time block, in bytes:
        double-buffered blocks, the state scratch, and the loop's carry and temporaries."""
        tv, Dk = self.kernel_params(variant, problem)["dv_tile"], problem.Dk
        tt = RECURRENT_TIME_BLOCK
        b = _padded_bytes
        gate = b((tt, Dk)) if problem.gate == "vector" else b((tt, 1))
        blocks = 2 * b((tt, Dk)) + 2 * b((tv, tt)) + gate + b((tt, 1)) + 2 * b((tv, Dk))
        return 2 * blocks + b((tv, Dk)) + 4 * b((tv, Dk)) + 3 * b((tv, tt))

    def space(self, problem: Problem, device=None) -> list[Config]:
        """Every variant whose `footprint` fits ``device``'s ``vmem_budget``
        (`gdngen.devices`); per-channel gates: the walks' parameters only, at ieee, saving
        states."""
        self.check(problem)
        budget = device.limits["vmem_budget"]
        vector = problem.gate == "vector"
        space = []
        for chunk, precision, head_tile, dv_tile, save in itertools.product(
                CHUNK_SIZES, ("ieee",) if vector else PRECISIONS, _divisors(problem.group),
                _dv_tiles(problem.Dv), (True,) if vector else (True, False)):
            config = Config(chunk, dv_tile, head_tile, precision, save)
            if self.footprint(Variant(BACKEND, config.params()), problem) <= budget:
                space.append(config)
        return space

    def default(self, problem: Problem, device=None) -> Config:
        """Chunk 64, ieee, the whole group per program and the whole Dv per step, saving
        states; where that does not fit ``device``'s VMEM budget, the ieee variant that fits
        and is closest (saving states, chunk nearest 64, then the widest head and Dv tiles)."""
        ideal = Config(64, problem.Dv, problem.group, "ieee", True)
        budget = device.limits["vmem_budget"]
        if self.footprint(Variant(BACKEND, ideal.params()), problem) <= budget:
            return ideal
        fits = [c for c in self.space(problem, device) if c.precision == "ieee"]
        if not fits:
            raise ValueError(f"no {BACKEND} variant of {problem.key()} fits the "
                             f"{budget // MiB} MiB VMEM budget of "
                             f"{device.name}")
        return min(fits, key=lambda c: (not c.save_states, abs(c.chunk_size - 64), -c.head_tile,
                                        -c.dv_tile))
