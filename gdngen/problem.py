"""The shape class a kernel is specialised for (`Problem`: heads, head dims, input dtype,
gate kind), frozen, hashable and JSON round-tripping; `problem_of` maps a call's
`gdngen.shape.CallShape` to it."""

from __future__ import annotations

import functools
from dataclasses import asdict, dataclass

from gdngen.shape import FLOAT_DTYPES, MAX_HEAD_DIM, MIN_HEAD_DIM

GATE_KINDS = ("scalar", "vector")


@dataclass(frozen=True)
class Problem:
    """Shape class: key/value heads (Hv a multiple of Hk), head dims, input dtype, gate kind."""

    Hk: int
    Hv: int
    Dk: int
    Dv: int
    dtype: str = "float32"
    gate: str = "scalar"

    def __post_init__(self):
        for name in ("Hk", "Hv", "Dk", "Dv"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"Problem.{name} must be a positive int, got {value!r}")
        if self.Hv % self.Hk:
            raise ValueError(f"Problem.Hv={self.Hv} must be a multiple of Problem.Hk={self.Hk}")
        for name in ("Dk", "Dv"):
            if not MIN_HEAD_DIM <= getattr(self, name) <= MAX_HEAD_DIM:
                raise ValueError(f"Problem.{name}={getattr(self, name)} must be in "
                                 f"{MIN_HEAD_DIM}..{MAX_HEAD_DIM}")
        if self.dtype not in FLOAT_DTYPES:
            raise ValueError(f"Problem.dtype must be one of {FLOAT_DTYPES}, got {self.dtype!r}")
        if self.gate not in GATE_KINDS:
            raise ValueError(f"Problem.gate must be one of {GATE_KINDS}, got {self.gate!r}")

    @property
    def group(self) -> int:
        """Value heads per key head."""
        return self.Hv // self.Hk

    def key(self) -> str:
        """Stable string key, e.g. ``hk2-hv4-dk128-dv128-float32-scalar``."""
        return (f"hk{self.Hk}-hv{self.Hv}-dk{self.Dk}-dv{self.Dv}-{self.dtype}-{self.gate}")

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> Problem:
        return cls(**data)

    @classmethod
    def parse(cls, text: str) -> Problem:
        """Parse ``"Hk=2,Hv=4,Dk=128,Dv=128[,dtype=bfloat16][,gate=scalar]"``."""
        fields = {}
        for part in filter(None, (p.strip() for p in text.split(","))):
            name, sep, value = part.partition("=")
            if not sep:
                raise ValueError(f"problem spec part {part!r} is not NAME=VALUE")
            fields[name.strip()] = value.strip() if name.strip() in ("dtype", "gate") \
                else int(value)
        try:
            return cls(**fields)
        except TypeError as e:
            raise ValueError(f"bad problem spec {text!r}: {e}") from None


def problem_of(shape, dtype: str) -> Problem:
    """The `Problem` (shape class) of a checked call (`gdngen.shape.CallShape`) with input
    dtype ``dtype``."""
    return _problem_of(shape.Hk, shape.Hv, shape.Dk, shape.Dv, dtype, shape.vector_gate)


@functools.lru_cache(maxsize=256)
def _problem_of(Hk, Hv, Dk, Dv, dtype, vector_gate) -> Problem:
    """`problem_of` once per shape class (a decode loop asks per token)."""
    return Problem(Hk, Hv, Dk, Dv, dtype, "vector" if vector_gate else "scalar")
