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

Query scaling convention: q is NOT pre-scaled; every case runs with ``scale = Dk ** -0.5``
(`Case.scale`), as models do, so rounding q to a low-precision dtype sees model-like values.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import numpy as np

__all__ = ["BATTERY", "GATE_KINDS", "Case", "get_case"]

# How each case draws its log gates (see `_draw_log_gates`).
GATE_KINDS = ("mild", "strong", "hard", "exact_one_and_zero", "constant_0.95", "per_channel")


@dataclass(frozen=True)
class Case:
    """One battery problem: shapes, the chunk size it targets, and how its inputs are drawn.

    ``gates`` is one of `GATE_KINDS`; ``beta_range`` None means beta = sigmoid(N(0,1)), else
    beta ~ U(beta_range); ``identical_keys`` makes all keys inside each ``chunk_size`` block
    equal; ``has_initial_state`` draws a non-zero initial state; ``padding`` draws the
    left/right/middle padding mask of `_padding_mask`.
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

    def __post_init__(self):
        if self.gates not in GATE_KINDS:
            raise ValueError(f"case {self.name}: gates must be one of {GATE_KINDS}")
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
        initial_state = rng.standard_normal((B, Hv, Dv, Dk)) if self.has_initial_state else None
        mask = None
        if self.padding:
            mask = _padding_mask(B, T)
            # Garbage at padded steps: a backend that lets them leak is off by a lot.
            v = np.where(mask[:, :, None, None], v, 100.0 * v)
        dy = rng.standard_normal((B, T, Hv, Dv))
        dfinal_state = rng.standard_normal((B, Hv, Dv, Dk))
        return {"q": q, "k": k, "v": v, "g_log": g_log, "beta": beta,
                "initial_state": initial_state, "mask": mask, "dy": dy,
                "dfinal_state": dfinal_state}


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
    # exact_one_and_zero: ordinary gates with ~15% exact 0 (g = 1) and ~10% -inf (g = 0),
    # plus a whole chunk of g = 1 and a reset at t = 0 (wiping the initial state).
    g = -rng.uniform(0.01, 0.5, size=shape)
    draw = rng.uniform(size=shape)
    g[draw < 0.15] = 0.0
    g[draw > 0.90] = -np.inf
    g[0, 0, 0] = -np.inf
    g[0, case.chunk_size:2 * case.chunk_size, 1] = 0.0
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
         B=2, T=128, Hk=2, Hv=4, Dk=64, Dv=64, gates="hard", beta_range=(0.85, 1.0)),
    Case("gates_exact_one_and_zero",
         "exact g = 1 (log 0, incl. a whole chunk) and g = 0 (log -inf, incl. t=0 reset of the "
         "initial state): inf/nan from log/exp/division on boundary gates",
         B=2, T=128, Hk=2, Hv=4, Dk=32, Dv=32, gates="exact_one_and_zero",
         has_initial_state=True),
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
         B=2, T=1, Hk=2, Hv=4, Dk=32, Dv=32, has_initial_state=True),
    Case("short", "T = 37 < chunk 64, B = 1: a single partial chunk",
         B=1, T=37, Hk=2, Hv=4, Dk=32, Dv=32),
    Case("ragged", "T = 150 with chunk 64: two full chunks then a partial one (tail handling, "
         "state carried across chunks)",
         B=2, T=150, Hk=2, Hv=4, Dk=32, Dv=32),
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
)

_BY_NAME = {case.name: case for case in BATTERY}
assert len(_BY_NAME) == len(BATTERY), "duplicate case names"


def get_case(name: str) -> Case:
    """Return the battery case called ``name``; ValueError listing the known cases otherwise."""
    try:
        return _BY_NAME[name]
    except KeyError:
        raise ValueError(f"unknown case {name!r}; known cases: {', '.join(_BY_NAME)}") from None
