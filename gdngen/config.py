"""Typed variant parameters: each backend's `Config` is a frozen dataclass of this base.

A `gdngen.Variant` names a backend and its parameters as plain JSON values; the backend's
`Config` is the same point with each field typed and validated. The same meaning has the same
name in every backend: ``chunk_size`` (steps per chunk), ``precision`` (matmul operand policy,
one of `gdngen.precision.PRECISIONS`), ``save_states`` (the forward keeps per-chunk states for
the backward, else the backward recomputes them), ``recurrent_below`` (calls with fewer steps
than this run the backend's recurrent kernel forward, see `recurrent_switch`).

Validation errors are ``ValueError``s naming the backend, the field and the allowed values.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

#: default chunk of per-channel-gate problems on the portable chunk path (the portable backends'
#: default variant, the generated backends' per-channel gradients, packed per-channel rows):
#: measured fwd+bwd at B=1, Hk=4, Hv=8, D=128, T=2048 on the 2-core host, chunk 32 against 64
#: (sub-chunks of 8): xla 0.90 vs 1.15 s, mlx 3.9 vs 5.0 s (the decayed products' pairwise
#: work grows with the chunk)
VECTOR_CHUNK = 32

#: a ``recurrent_below`` that takes the recurrent kernel at every T (the battery's forward-only
#: check in `gdngen.validate`, the crossover timing in `gdngen.tune.crossover`)
RECURRENT_ALWAYS = 1 << 30


def recurrent_switch(default: int):
    """The ``recurrent_below`` field of a backend's `VariantConfig`: a call of T steps with
    T < recurrent_below runs its forward through the backend's recurrent kernel (the state held
    on-chip, walked one step at a time, nothing saved); longer calls, and every forward whose
    gradient is taken, run the chunk kernels. 0 never takes the recurrent kernel. Keyword-only,
    so positional construction of a config keeps its other fields' order; its value is the
    crossover T the tuner measures (`gdngen.tune.crossover`), else ``default``."""
    return dataclasses.field(default=default, kw_only=True)


@dataclasses.dataclass(frozen=True)
class VariantConfig:
    """Base of the backends' typed parameters; subclasses declare fields and `check` them."""

    backend: ClassVar[str] = ""

    def __post_init__(self):
        self.check()

    def check(self) -> None:
        """Raise ValueError for a bad field value (overridden per backend)."""

    # --------------------------------------------------------------------- conversion

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def from_params(cls, params: dict) -> VariantConfig:
        """The config of a params dict; ValueError naming unknown or missing fields. A
        keyword-only field (``recurrent_below``) may be left out: it takes its default."""
        names = cls.field_names()
        optional = {f.name for f in dataclasses.fields(cls) if f.kw_only}
        unknown = sorted(set(params) - set(names))
        missing = [n for n in names if n not in params and n not in optional]
        if unknown or missing:
            parts = ([f"unknown {unknown}"] if unknown else []) + \
                    ([f"missing {missing}"] if missing else [])
            raise ValueError(f"{cls.backend} variant params must be {list(names)}: "
                             f"{', '.join(parts)}")
        return cls(**{n: params[n] for n in names if n in params})

    def params(self) -> dict:
        """The fields as a plain dict (a `Variant`'s params)."""
        return {n: getattr(self, n) for n in self.field_names()}

    # --------------------------------------------------------------------- field checks

    def _fail(self, name: str, expected: str) -> None:
        raise ValueError(f"{self.backend} variant param {name} must be {expected}, got "
                         f"{getattr(self, name)!r}")

    def check_choice(self, name: str, allowed) -> None:
        """The field is one of ``allowed`` (ints must be ints, not bools)."""
        value = getattr(self, name)
        if isinstance(value, bool) and not all(isinstance(a, bool) for a in allowed):
            self._fail(name, f"one of {tuple(allowed)}")
        if value not in tuple(allowed):
            self._fail(name, f"one of {tuple(allowed)}")

    def check_flag(self, name: str) -> None:
        """The field is a bool."""
        if type(getattr(self, name)) is not bool:
            self._fail(name, "a bool")

    def check_count(self, name: str) -> None:
        """The field is an int >= 0 (not a bool)."""
        value = getattr(self, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            self._fail(name, "an int >= 0")

    def check_positive_int(self, name: str) -> None:
        value = getattr(self, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            self._fail(name, "a positive int")
