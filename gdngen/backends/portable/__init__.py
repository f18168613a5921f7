"""What the portable backends (xla, mlx) share: their typed config, space and whole-call body.

Both run `gdngen.algebra.chunkwise` (scalar gates) and `gdngen.algebra.chunkwise_channel`
(per-channel gates) through framework ops, chunkwise with the hand-derived backward. Their
tolerance is the generic one per precision policy (`TOLERANCES`).
"""

from __future__ import annotations

import functools
import importlib
import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

from gdngen.algebra import layer_inputs
from gdngen.algebra.chunkwise_channel import SUB_CHUNK
from gdngen.backend import Backend
from gdngen.config import VECTOR_CHUNK, VariantConfig, recurrent_switch

#: the algebra modules a portable variant runs: with this module and the framework module,
#: the sources whose text is the variant's sha256 (a change retires its tuned entries)
ALGEBRA_MODULES = tuple(f"gdngen.algebra.{name}" for name in (
    "chunkwise", "chunkwise_channel", "kinds", "layer_inputs", "namespaces", "recurrent"))
CHUNK_SIZES = (16, 32, 64, 128)
SOLVE_BLOCKS = (4, 8, 16, 32)
#: relative L2 error per precision policy. ieee: float32 throughout (worst measured 8.9e-7,
#: dbeta / identical_keys); tf32 and bf16: what those operand roundings allow (TF32 keeps 10
#: mantissa bits, bfloat16 7); the chunk core itself always traces its matmuls at float32.
TOLERANCES = {"ieee": 5e-5, "tf32": 1e-2, "bf16": 2e-2}

#: untuned crossover T per portable backend and gate kind (`gdngen.config.recurrent_switch`);
#: how they were measured: docs/DECODE.md, "Untuned defaults"
RECURRENT_BELOW = {"xla": {"scalar": 4, "vector": 4}, "mlx": {"scalar": 256, "vector": 256}}

@dataclass(frozen=True)
class PortableConfig(VariantConfig):
    """``chunk_size``: steps per chunk; ``solve_block``: substitution block of the exact
    triangular inverse (<= chunk_size); ``save_states``: the forward keeps per-chunk states,
    WY pseudo-values and inverses for the backward, else the backward recomputes them."""

    chunk_size: int = 64
    solve_block: int = 8
    save_states: bool = True
    recurrent_below: int = recurrent_switch(0)

    def check(self) -> None:
        self.check_count("recurrent_below")
        self.check_positive_int("chunk_size")
        self.check_choice("solve_block", SOLVE_BLOCKS)
        self.check_flag("save_states")
        if self.solve_block > self.chunk_size:
            self._fail("solve_block", f"<= chunk_size={self.chunk_size}")


class PortableBackend(Backend):
    """A framework's portable backend: `gdngen.algebra.chunkwise` /
    `gdngen.algebra.chunkwise_channel` in the framework module ``ops`` (imported when a call runs,
    so the declaration imports no framework), every gate kind, packed rows on its own chunk path."""

    portable = True
    gates = tuned_gates = packed_gates = ("scalar", "vector")
    tolerances = TOLERANCES

    def __init__(self, name: str, framework: str, ops: str, config: type, device_kinds: tuple,
                 fused_inputs: tuple = ()):
        self.name, self.framework, self.ops, self.config = name, framework, ops, config
        self.device_kinds, self.fused_inputs = device_kinds, fused_inputs
        self.source_modules = (*ALGEBRA_MODULES, __name__, ops)
        super().__init__()

    def space(self, problem, device=None):
        crossover = RECURRENT_BELOW[self.name][problem.gate]  # the tuner measures its own
        return [self.config(c, b, s, recurrent_below=crossover) for c, b, s in
                itertools.product(CHUNK_SIZES, SOLVE_BLOCKS, (True, False)) if b <= c]

    def default(self, problem, device=None):
        crossover = RECURRENT_BELOW[self.name][problem.gate]
        if problem.gate == "vector":
            return self.config(VECTOR_CHUNK, recurrent_below=crossover)
        return self.config(recurrent_below=crossover)

    @functools.cached_property
    def module(self):
        """The framework module ``ops``, imported on first use (not at declaration)."""
        return importlib.import_module(self.ops)

    def forward(self, call, operands, variant, **options):
        return run_call(self.module, call, operands, self.parse(variant),
                           self.chunked(call, variant))

    def packed_params(self, variant, vector_gate: bool) -> dict:
        """A portable variant's own params, less ``recurrent_below`` (a packed row always walks
        chunks)."""
        return {n: x for n, x in self.parse(variant).params().items() if n != "recurrent_below"}

    def packed(self, call, operands, variant, **options):
        from gdngen.backends import fallback

        return fallback.packed(call, operands, self.packed_params(variant, call.vector_gate))

    def entry(self):
        """This backend's own entry point, ``gdngen.backends.<name>.gated_delta(q, k, v, g,
        beta, initial_state=None, *, mask=None, scale=1.0, gate="log", variant, qk_norm=False)``:
        shapes as `gdngen.jax.gated_delta`; a parameterised gate as
        `gdngen.call.of_kernel_args` takes it."""

        def gated_delta(q, k, v, g, beta, initial_state=None, *, mask=None, scale=1.0,
                        gate="log", variant, qk_norm=False):
            call, operands = self.checked_args(q, k, v, g, beta, initial_state, mask,
                                               scale=scale, gate=gate, qk_norm=qk_norm)
            return self.forward(call, operands, variant)

        gated_delta.__doc__ = self.entry.__doc__
        return gated_delta


def short_chunk(T: int, chunk_size: int) -> int:
    """The chunk a call of T steps runs: a call shorter than the variant's chunk is one chunk
    of its own length (rounded up to a multiple of `SUB_CHUNK` past it, so per-channel
    sub-chunks stay whole) instead of a chunk padded with identity steps; the algebra is the
    same at any C (docs/DECODE.md, "Untuned defaults")."""
    if T >= chunk_size:
        return chunk_size
    return T if T <= SUB_CHUNK else min(chunk_size, -(-T // SUB_CHUNK) * SUB_CHUNK)


def run_call(ops, call, operands, config, chunked: bool):
    """Whole-call body of a portable backend over its framework module ``ops`` (with
    ``FLOAT32``, ``XP``, ``zeros``, ``chunkwise_gated_delta``, ``recurrent_gated_delta`` and
    ``recurrent_or_chunkwise``) for a checked `gdngen.call.Call`: float32 inputs, zero initial
    state when None; scalar or per-channel gates (`gdngen.algebra.chunkwise_channel`). Unless
    ``chunked`` (the recurrent switch, `gdngen.backend.Backend.chunked`) the call evaluates
    through the recurrent step loop, differentiated through the chunkwise path.
    ``call.qk_norm`` / a parameterised gate (the backend's ``fused_inputs``): q, k and ``a`` are
    raw; the chunk core computes the norm and the log gate and keeps only the raw arrays
    (`gdngen.algebra.layer_inputs.normalized_qk`); the recurrent path computes them first.
    Returns ``(y in q's dtype, final_state)``."""
    f32 = ops.FLOAT32
    shape, gate = call.shape, call.core_gate
    q, k, v, g, beta, initial_state, mask = operands[:7]
    if initial_state is None:
        initial_state = ops.zeros((shape.B, shape.Hv, shape.Dv, shape.Dk), f32)
    args = (q.astype(f32), k.astype(f32), v.astype(f32),
            layer_inputs.cast_gates(operands.kernel_gates(), f32), beta.astype(f32),
            initial_state.astype(f32), mask)
    calls = _calls(ops, call.scale, gate, call.qk_norm, config,
                   short_chunk(shape.T, config.chunk_size))
    if chunked:
        y, state = calls.chunkwise(*args)
        return y.astype(q.dtype), state
    g, beta = layer_inputs.fold_mask(ops.XP, args[3], args[4], mask, gate)
    switched = calls.single_step if shape.T == 1 else calls.switched
    y, state = switched(*args[:3], g, beta, args[5])
    if mask is not None:
        y = ops.XP.where(mask[..., None, None], y, 0.0)
    return y.astype(q.dtype), state


class _Calls(NamedTuple):
    chunkwise: Callable  # (q, k, v, g, beta, S0, mask) -> (y, S_T), the chunk path
    switched: Callable  # (q, k, v, g, beta, S0), mask folded: the recurrent forward, chunk VJP
    single_step: Callable  # switched for a call of T = 1


@functools.lru_cache(maxsize=256)
def _calls(ops, scale: float, gate, qk_norm: bool, config, chunk_size: int) -> _Calls:
    """The paths of `gated_delta` for one framework module, scale, gate, q/k norm and config
    (``chunk_size`` the chunk the call runs, `short_chunk`), built once: a decode loop calls
    them per token, its ``mx.custom_function`` included."""
    fused = {"qk_norm": True} if qk_norm else {}  # only where the spec declares it fused
    params = {n: x for n, x in config.params().items() if n != "recurrent_below"}
    params["chunk_size"] = chunk_size

    def chunkwise_call(q, k, v, g, beta, S0, mask=None):
        return ops.chunkwise_gated_delta(q, k, v, g, beta, S0, mask, scale=scale, gate=gate,
                                         **fused, **params)

    def recurrent(q, k, *arrays):
        q, k = layer_inputs.normalized_qk(ops.XP, q, k, 1.0 if qk_norm else None)
        return ops.recurrent_gated_delta(q, k, *arrays, scale=scale, gate=gate)

    return _Calls(chunkwise_call, ops.recurrent_or_chunkwise(recurrent, chunkwise_call),
                  ops.recurrent_or_chunkwise(recurrent, chunkwise_call, single_step=True))
