"""How a kernel is specialised: a `Variant` names a backend and its parameter values, frozen,
hashable and round-tripping through JSON (what is specialised: `gdngen.problem.Problem`). Each
backend's space, default and typed config are declared in its `gdngen.registry.BackendSpec`
(`gdngen.registry.variants`, `gdngen.registry.default_variant`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Variant:
    """One point of a backend's space: ``Variant("xla", {"chunk_size": 64, ...})``."""

    backend: str
    params: tuple = field(default=())

    def __init__(self, backend: str, params=()):
        items = params.items() if isinstance(params, dict) else params
        object.__setattr__(self, "backend", backend)
        object.__setattr__(self, "params", tuple(sorted((str(k), v) for k, v in items)))

    def __getitem__(self, name):
        return dict(self.params)[name]

    def get(self, name, default=None):
        return dict(self.params).get(name, default)

    def as_dict(self) -> dict:
        return dict(self.params)

    def replace(self, **changes) -> Variant:
        """This variant with the params in ``changes`` set (added or replaced)."""
        return Variant(self.backend, dict(self.params, **changes))

    def to_json(self) -> dict:
        return {"backend": self.backend, "params": self.as_dict()}

    @classmethod
    def from_json(cls, data: dict) -> Variant:
        return cls(data["backend"], data["params"])

    def name(self) -> str:
        """Short readable id, e.g. ``xla[chunk_size=64,save_states=True,solve_block=8]``."""
        inner = ",".join(f"{k}={v}" for k, v in self.params)
        return f"{self.backend}[{inner}]"

    def __str__(self) -> str:
        return self.name()


def dumps(obj) -> str:
    """Canonical JSON of a `gdngen.problem.Problem` / `Variant` (sorted keys), used for
    hashing and cache keys."""
    return json.dumps(obj.to_json(), sort_keys=True, separators=(",", ":"))
