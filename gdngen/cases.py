"""The adversarial battery: small gated-delta problems every backend must match the reference on.

Each `Case` fixes shapes, the chunk size it is designed around, and how its inputs are drawn;
``Case.inputs(seed)`` returns float64 NumPy arrays (keys of docs/CONTRACT.md)::

    q, k          [B,T,Hk,Dk]   q ~ N(0,1) (unscaled); k ~ N(0,1) then L2-normalised per head
    v             [B,T,Hv,Dv]   ~ N(0,1)
    g_log         [B,T,Hv] or [B,T,Hv,Dk]   log gates (<= 0; -inf only where a case says so)
    beta          [B,T,Hv]      sigmoid(N(0,1)) unless the case says otherwise
    initial_state [B,Hv,Dv,Dk] or None
    mask          [B,T] bool or None
    dy            [B,T,Hv,Dv]   ~ N(0,1) cotangent of y (never zero)
    dfinal_state  [B,Hv,Dv,Dk]  ~ N(0,1) cotangent of the final state (never zero)
    cu_seqlens    [N+1] int32 or None: a packed case (B = 1, `gdngen.algebra.packed`); initial_state
                  and dfinal_state are then [N,Hv,Dv,Dk], one per sequence

Query scaling convention: q is NOT pre-scaled; every case runs with ``scale = Dk ** -0.5``
(`Case.scale`), as models do, so rounding q to a low-precision dtype sees model-like values.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import numpy as np

__all__ = ["BATTERY", "GATE_KINDS", "INF_GATE_KINDS", "VECTOR_GATE_KINDS", "Case",
           "get_case"]

# How each case draws its log gates (see `_draw_log_gates`).
GATE_KINDS = ("mild", "strong", "hard", "exact_one_and_zero", "constant_0.95", "per_channel",
              "half_strong", "channel_zero_and_one", "channel_mix")
#: gate kinds defined per channel only (a case drawing them must have ``vector_gate=True``)
VECTOR_GATE_KINDS = ("half_strong", "channel_zero_and_one", "channel_mix")
#: gate kinds that draw log g = -inf (exact zero gates) somewhere
INF_GATE_KINDS = ("exact_one_and_zero", "channel_zero_and_one", "channel_mix")


@dataclass(frozen=True)
class Case:
    """One battery problem: shapes, the chunk size it targets, and how its inputs are drawn.

    ``gates`` is one of `GATE_KINDS`; ``beta_range`` None means beta = sigmoid(N(0,1)), else
    beta ~ U(beta_range); ``identical_keys`` makes all keys inside each ``chunk_size`` block
    equal; ``has_initial_state`` draws a non-zero initial state; ``padding`` draws the
    left/right/middle padding mask of `_padding_mask`; ``cu_seqlens`` makes it a packed row of
    ``len(cu_seqlens) - 1`` sequences (B must be 1); ``states`` (dense cases) also checks the
    per-step and chunk-boundary states the call returns.
    """

    name: str
    description: str
    B: int
    T: int
    Hk: int
    Hv: int
    Dk: int
    Dv: int
    chunk_size: int = 64
    vector_gate: bool = False
    gates: str = "mild"
    beta_range: tuple[float, float] | None = None
    identical_keys: bool = False
    has_initial_state: bool = False
    padding: bool = False
    cu_seqlens: tuple[int, ...] | None = None
    #: the battery also checks the states this case's call returns (`gdngen.validate`)
    states: bool = False

    def __post_init__(self):
        if self.cu_seqlens is not None and (
                self.B != 1 or self.cu_seqlens[0] != 0 or self.cu_seqlens[-1] != self.T
                or any(b < a for a, b in zip(self.cu_seqlens, self.cu_seqlens[1:]))):
            raise ValueError(f"case {self.name}: a packed case needs B = 1 and offsets from 0 "
                             f"to T={self.T}, non-decreasing")
        if self.gates not in GATE_KINDS:
            raise ValueError(f"case {self.name}: gates must be one of {GATE_KINDS}")
        if self.gates in VECTOR_GATE_KINDS and not self.vector_gate:
            raise ValueError(f"case {self.name}: gates={self.gates!r} needs vector_gate=True")
        if self.Hv % self.Hk:
            raise ValueError(f"case {self.name}: Hv={self.Hv} is not a multiple of Hk={self.Hk}")

    @property
    def scale(self) -> float:
        """Query scale the case runs with: ``Dk ** -0.5`` (q itself is left unscaled)."""
        return float(self.Dk) ** -0.5

    @property
    def gate_shape(self) -> tuple[int, ...]:
        """Shape of ``g_log``: [B,T,Hv] or, for a vector gate, [B,T,Hv,Dk]."""
        base = (self.B, self.T, self.Hv)
        return base + (self.Dk,) if self.vector_gate else base

    def inputs(self, seed: int | None = None) -> dict:
        """Draw the case's inputs (float64 arrays, see module doc); fresh randomness if seed is
        None, reproducible otherwise (the case name is mixed in, so cases differ per seed)."""
        entropy = None if seed is None else [int(seed), zlib.crc32(self.name.encode())]
        rng = np.random.default_rng(entropy)
        B, T, Hk, Hv, Dk, Dv = self.B, self.T, self.Hk, self.Hv, self.Dk, self.Dv

        q = rng.standard_normal((B, T, Hk, Dk))
        if self.identical_keys:
            n_chunks = -(-T // self.chunk_size)
            per_chunk = rng.standard_normal((B, n_chunks, Hk, Dk))
            k = np.repeat(per_chunk, self.chunk_size, axis=1)[:, :T]
        else:
            k = rng.standard_normal((B, T, Hk, Dk))
        k = k / np.linalg.norm(k, axis=-1, keepdims=True)
        v = rng.standard_normal((B, T, Hv, Dv))
        g_log = _draw_log_gates(self, rng)
        if self.beta_range is None:
            beta = 1.0 / (1.0 + np.exp(-rng.standard_normal((B, T, Hv))))
        else:
            beta = rng.uniform(*self.beta_range, size=(B, T, Hv))
        states = B if self.cu_seqlens is None else len(self.cu_seqlens) - 1
        initial_state = rng.standard_normal((states, Hv, Dv, Dk)) if self.has_initial_state \
            else None
        mask = None
        if self.padding:
            mask = _padding_mask(B, T)
            # Garbage at padded steps: a backend that lets them leak is off by a lot.
            v = np.where(mask[:, :, None, None], v, 100.0 * v)
        dy = rng.standard_normal((B, T, Hv, Dv))
        dfinal_state = rng.standard_normal((states, Hv, Dv, Dk))
        cu_seqlens = None if self.cu_seqlens is None else np.array(self.cu_seqlens, np.int32)
        return {"q": q, "k": k, "v": v, "g_log": g_log, "beta": beta,
                "initial_state": initial_state, "mask": mask, "dy": dy,
                "dfinal_state": dfinal_state, "cu_seqlens": cu_seqlens}


def _draw_log_gates(case: Case, rng: np.random.Generator) -> np.ndarray:
    """Log gates of ``case.gate_shape`` drawn according to ``case.gates``."""
    shape = case.gate_shape
    if case.gates == "mild":
        return -rng.uniform(0.01, 0.1, size=shape)
    if case.gates == "strong":
        return -rng.uniform(7.0, 10.0, size=shape)  # mean -8.5: g ~ 2e-4
    if case.gates == "hard":
        return rng.uniform(-5.4, 0.0, size=shape)  # sum over 64 steps ~ -173
    if case.gates == "constant_0.95":
        return np.full(shape, np.log(0.95))
    if case.gates == "per_channel":
        # Decay rates spanning three decades per channel: -log g in [1e-3, 1).
        return -np.exp(rng.uniform(np.log(1e-3), 0.0, size=shape))
    if case.gates == "half_strong":
        # A fixed random half of each head's channels (the same at every batch and step) decays
        # strongly, log g ~ -U(30, 40) (real Kimi gates reach log g ~ -37; a 64-chunk sums to
        # ~ -2240 there, so exp(+-cumsum) within a chunk over/underflows even in float64), while
        # the other half barely decays, log g ~ -U(0, 0.02) (a 64-chunk sums to ~ -0.64).
        Hv, Dk = shape[2], shape[3]
        strong = np.zeros((Hv, Dk), dtype=bool)
        for h in range(Hv):
            strong[h, rng.permutation(Dk)[:Dk // 2]] = True
        return np.where(strong, -rng.uniform(30.0, 40.0, size=shape),
                        -rng.uniform(0.0, 0.02, size=shape))
    if case.gates == "channel_zero_and_one":
        # Ordinary gates -U(0.01, 0.5) with exact boundary values per channel: ~10% single
        # channels at 0 (g = 1) and ~5% at -inf (g = 0); whole steps of -inf (every channel of
        # one (batch, step, head)): ~3% at random outside batch 0, batch 0 head 0 at t = 0
        # (resets that head's initial state), and every head of the last batch at both sides
        # of the first chunk boundary (t = 63, 64); and g = 1 stretches: in batch 0, a random
        # quarter of each head's channels has log g = 0 over steps 40..99 (across t = 64).
        B, T, Hv, Dk = shape
        c = case.chunk_size
        g = -rng.uniform(0.01, 0.5, size=shape)
        draw = rng.uniform(size=shape)
        g[draw < 0.10] = 0.0
        g[draw > 0.95] = -np.inf
        whole = rng.uniform(size=(B, T, Hv)) < 0.03
        whole[0] = False
        g[whole] = -np.inf
        g[0, 0, 0] = -np.inf
        g[B - 1, c - 1:c + 1] = -np.inf
        for h in range(Hv):
            g[0, c - 24:c + 36, h, rng.permutation(Dk)[:Dk // 4]] = 0.0
        return g
    if case.gates == "channel_mix":
        # Every entry drawn on its own: -inf (10%, g = 0), exactly 0 (15%, g = 1), strong
        # -U(30, 40) (25%) or nearly 1, -U(0, 0.02) (50%); plus a whole step of -inf (batch 0,
        # t = 0, head 0) and one of exact 0 (last batch, t = 0, last head). With an initial
        # state at T = 1, each column of it is wiped, kept exactly, crushed or barely decayed.
        B, Hv = shape[0], shape[2]
        draw = rng.uniform(size=shape)
        g = np.where(draw < 0.5, -rng.uniform(30.0, 40.0, size=shape),
                     -rng.uniform(0.0, 0.02, size=shape))
        g[draw < 0.25] = 0.0
        g[draw < 0.10] = -np.inf
        g[0, 0, 0] = -np.inf
        g[B - 1, 0, Hv - 1] = 0.0
        return g
    # exact_one_and_zero: ordinary gates with ~15% exact 0 (g = 1) and ~10% -inf (g = 0),
    # plus a whole chunk of g = 1 and a reset at t = 0 (wiping the initial state).
    g = -rng.uniform(0.01, 0.5, size=shape)
    draw = rng.uniform(size=shape)
    g[draw < 0.15] = 0.0
    g[draw > 0.90] = -np.inf
    g[0, 0, 0] = -np.inf
    g[0, case.chunk_size:2 * case.chunk_size, min(1, shape[2] - 1)] = 0.0  # head 1, or 0 of one
    return g


def _padding_mask(B: int, T: int) -> np.ndarray:
    """[B,T] bool: batch 0 is left-padded (first 17 steps) with a hole at 70..74; batch 1 is
    right-padded (last 23 steps) with a hole 60..67 straddling the 64 boundary; further
    batches have a single hole at 5..8."""
    mask = np.ones((B, T), dtype=bool)
    mask[0, :17] = False
    mask[0, 70:75] = False
    if B > 1:
        mask[1, T - 23:] = False
        mask[1, 60:68] = False
    mask[2:, 5:9] = False
    return mask


BATTERY: tuple[Case, ...] = (
    Case("mild_decay", "baseline: mild gates (log g ~ -U(0.01, 0.1)), Dk != Dv, two full chunks",
         B=2, T=128, Hk=2, Hv=4, Dk=64, Dv=32),
    Case("strong_decay",
         "strong decay (mean log g = -8.5, g ~ 2e-4): underflow of cumulative gates in a chunk",
         B=2, T=128, Hk=2, Hv=4, Dk=32, Dv=32, gates="strong"),
    Case("hard_decay",
         "g = exp(U(-5.4, 0)): sum of log g over a 64-chunk ~ -170, overflows exp(-cumsum) "
         "tricks in fp32; beta in [0.85, 1]",
         B=2, T=128, Hk=2, Hv=4, Dk=64, Dv=64, gates="hard", beta_range=(0.85, 1.0), states=True),
    Case("gates_exact_one_and_zero",
         "exact g = 1 (log 0, incl. a whole chunk) and g = 0 (log -inf, incl. t=0 reset of the "
         "initial state): inf/nan from log/exp/division on boundary gates",
         B=2, T=128, Hk=2, Hv=4, Dk=32, Dv=32, gates="exact_one_and_zero",
         has_initial_state=True, states=True),
    Case("identical_keys",
         "all keys equal within each 64-chunk, g = 0.95, beta = 1, initial state: near-singular "
         "triangular solve (I + strictly-lower KK^T) in the chunked form",
         B=2, T=128, Hk=2, Hv=4, Dk=64, Dv=64, gates="constant_0.95", beta_range=(1.0, 1.0),
         identical_keys=True, has_initial_state=True),
    Case("negative_eigenvalues",
         "beta in [0, 2]: transition I - beta kk^T has negative eigenvalues (sign flips, "
         "non-contractive steps)",
         B=2, T=128, Hk=2, Hv=4, Dk=32, Dv=32, beta_range=(0.0, 2.0)),
    Case("gva3", "grouped values Hk=2, Hv=6 (3 value heads per key head) and Dk != Dv: head "
         "mapping h // 3 and the dq/dk sum over the group",
         B=2, T=96, Hk=2, Hv=6, Dk=32, Dv=64),
    Case("equal_heads", "Hk = Hv (group of 1): head mapping without grouping",
         B=2, T=96, Hk=2, Hv=2, Dk=32, Dv=32),
    Case("t1", "T = 1 with an initial state: a single partial chunk, decode-like step",
         B=2, T=1, Hk=2, Hv=4, Dk=32, Dv=32, has_initial_state=True, states=True),
    Case("short", "T = 37 < chunk 64, B = 1: a single partial chunk",
         B=1, T=37, Hk=2, Hv=4, Dk=32, Dv=32),
    Case("short_masked",
         "T = 37 at chunk 32 with a padding mask, exact gates (g = 0 resets, g = 1 runs), an "
         "initial state, GVA 3x, Dk != Dv: a decode-length call, run on both sides of the "
         "recurrent switch (tests/calls/test_recurrent.py)",
         B=2, T=37, Hk=2, Hv=6, Dk=32, Dv=64, chunk_size=32, gates="exact_one_and_zero",
         has_initial_state=True, padding=True, states=True),
    Case("ragged", "T = 150 with chunk 64: two full chunks then a partial one (tail handling, "
         "state carried across chunks)",
         B=2, T=150, Hk=2, Hv=4, Dk=32, Dv=32, states=True),
    Case("padding_mask",
         "mask: left padding (batch 0), right padding (batch 1), holes mid-sequence and across a "
         "chunk boundary, initial state; padded v is x100 garbage that must not leak",
         B=2, T=128, Hk=2, Hv=4, Dk=32, Dv=32, has_initial_state=True, padding=True),
    Case("initial_state", "non-zero initial state: its decay, its use in y, and dinitial_state",
         B=2, T=128, Hk=2, Hv=4, Dk=32, Dv=32, has_initial_state=True),
    Case("vector_gate",
         "per-channel gate g [B,T,Hv,Dk], -log g spanning 1e-3..1 per step: column-wise decay "
         "and the per-channel dg reduction",
         B=2, T=128, Hk=2, Hv=4, Dk=32, Dv=32, vector_gate=True, gates="per_channel"),
    # The vector cases below share shapes on purpose: backends compile once per shape (the
    # vector-gate path's autodiff costs seconds per shape), so vector_exact_zero and
    # vector_identical_keys take vector_gate's shape and vector_masked_gva3 takes
    # vector_strong_half's (a mask or not does not recompile); vector_t1 is the only other.
    Case("vector_strong_half",
         "per-channel gate, half of each head's channels log g ~ -U(30, 40) (a chunk sums to "
         "~ -2240: exp(+-cumsum) over/underflows) next to channels ~ -U(0, 0.02); T = 150 "
         "ragged tail, Hv = 3 Hk, Dk != Dv, initial state kept on the slow columns only",
         B=2, T=150, Hk=2, Hv=6, Dk=64, Dv=32, vector_gate=True, gates="half_strong",
         has_initial_state=True, states=True),
    Case("vector_exact_zero",
         "per-channel exact gates: -inf on single channels and on whole steps (t = 0 reset of "
         "the initial state, both sides of the 64 boundary), log g = 0 on single channels and "
         "on stretches across t = 64: inf/nan from log/exp/division per channel",
         B=2, T=128, Hk=2, Hv=4, Dk=32, Dv=32, vector_gate=True, gates="channel_zero_and_one",
         has_initial_state=True),
    Case("vector_masked_gva3",
         "per-channel exact gates with a padding mask (left pad, right pad covering the whole "
         "partial chunk 128..149, holes; masked -inf steps must not wipe the state, x100 "
         "padded v must not leak), grouped values Hv = 3 Hk, Dk != Dv, T = 150, initial state",
         B=2, T=150, Hk=2, Hv=6, Dk=64, Dv=32, vector_gate=True, gates="channel_zero_and_one",
         has_initial_state=True, padding=True, states=True),
    Case("vector_t1",
         "T = 1 per-channel step on an initial state whose columns are wiped (-inf), kept "
         "exactly (0), crushed (~ -35) or barely decayed: decode-like step, Dk < Dv",
         B=2, T=1, Hk=2, Hv=4, Dk=32, Dv=64, vector_gate=True, gates="channel_mix",
         has_initial_state=True, states=True),
    Case("vector_short_masked",
         "short_masked with per-channel exact gates (single channels and whole steps at -inf, "
         "g = 1 stretches): the per-channel recurrent kernel and its chunk VJP",
         B=2, T=37, Hk=2, Hv=6, Dk=32, Dv=64, chunk_size=32, vector_gate=True,
         gates="channel_zero_and_one", has_initial_state=True, padding=True),
    Case("vector_identical_keys",
         "per-channel mild gates (log g ~ -U(0.01, 0.1)) with all keys equal within each "
         "64-chunk, beta = 1, initial state: near-singular triangular solve with per-channel "
         "decayed keys",
         B=2, T=128, Hk=2, Hv=4, Dk=32, Dv=32, vector_gate=True, gates="mild",
         beta_range=(1.0, 1.0), identical_keys=True, has_initial_state=True),
    # Packed rows (cu_seqlens, B = 1): the float64 reference runs them a sequence at a time.
    Case("packed_boundaries",
         "packed row of 9 sequences with initial states: length 1 at t = 0, empty, a boundary "
         "inside chunk 0, one ending at the 64 edge, one exactly chunk 1, length 1 at the 128 "
         "edge, empty, one inside chunk 2, one starting 2 steps before the 192 edge and running "
         "into the ragged tail (its initial state injected at a chunk end: too few steps for "
         "the ~10% exact zeros to wipe it in every head); exact g = 0 / g = 1 inside sequences, "
         "GVA 3x, Dk != Dv",
         B=1, T=200, Hk=2, Hv=6, Dk=32, Dv=64, gates="exact_one_and_zero",
         has_initial_state=True, cu_seqlens=(0, 1, 1, 40, 64, 128, 129, 129, 190, 200)),
    Case("packed_long_masked",
         "packed row whose sequences span chunks (100..230 starts inside chunk 1 and ends inside "
         "chunk 3: its initial state is carried through two chunk ends), with the padding mask: "
         "steps 0..16 (sequence 0's first steps) and a hole 70..74 inside it; x100 padded v "
         "must not leak",
         B=1, T=256, Hk=1, Hv=2, Dk=32, Dv=32, has_initial_state=True, padding=True,
         cu_seqlens=(0, 100, 230, 256)),
    Case("packed_vector",
         "packed row with per-channel exact gates (-inf / 0 on channels and whole steps, both "
         "sides of the 64 edge), boundaries inside chunks and at t = 64, an empty sequence, "
         "GVA 3x, Dk != Dv, initial states",
         B=1, T=150, Hk=2, Hv=6, Dk=64, Dv=32, vector_gate=True, gates="channel_zero_and_one",
         has_initial_state=True, cu_seqlens=(0, 30, 30, 64, 65, 150)),
    Case("packed_vector_long_masked",
         "packed row with per-channel gates whose sequences span chunks (100..230 starts and "
         "ends inside chunks: its initial state is carried through several chunk ends), with "
         "the padding mask: steps 0..16 (sequence 0's first steps) and a hole 70..74 inside "
         "it; x100 padded v must not leak",
         B=1, T=256, Hk=1, Hv=2, Dk=32, Dv=32, vector_gate=True, has_initial_state=True,
         padding=True, cu_seqlens=(0, 100, 230, 256)),
)

_BY_NAME = {case.name: case for case in BATTERY}
assert len(_BY_NAME) == len(BATTERY), "duplicate case names"


def get_case(name: str) -> Case:
    """Return the battery case called ``name``; ValueError listing the known cases otherwise."""
    try:
        return _BY_NAME[name]
    except KeyError:
        raise ValueError(f"unknown case {name!r}; known cases: {', '.join(_BY_NAME)}") from None
