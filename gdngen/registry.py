"""The backend registry: one line per backend, one `BackendSpec` declared in each backend module.

`BACKENDS` maps a backend name to the module that declares its ``SPEC``. Spec modules import no
framework at import time (each imports jax or mlx inside the functions that run kernels), so
listing, rendering, enumerating or checking any backend imports neither framework, and
importing `gdngen.jax` never imports mlx (nor `gdngen.mlx` jax). Modules are imported on first
use of their spec.

Everything else asks the registry: which backends a framework or a device runs
(`names`, `backends_for`), a backend's space and default on a device (`variants`,
`default_variant`), whether it implements a problem (`BackendSpec.capability`), its tolerance
rule (`gdngen.tolerance`), its sources (`gdngen.render`) and its entry point
(`BackendSpec.run`).

Adding a backend: its module under ``gdngen/backends/`` declaring ``SPEC``, its templates under
``templates/<name>/``, one line in `BACKENDS`, and its tests (the conformance suite picks it up
from the registry).
"""

from __future__ import annotations

import importlib

from gdngen.devices import Device, get_device
from gdngen.problem import Problem
from gdngen.spec import BackendSpec
from gdngen.variant import Variant

__all__ = ["BACKENDS", "BackendSpec", "backends_for", "check_variant", "default_variant",
           "framework_of", "get", "names", "portable", "register", "runnable", "unregister",
           "variants"]

#: backend name -> module declaring its ``SPEC``; generated backends before portable ones of the
#: same framework (a device's preference order, see `backends_for`).
BACKENDS: dict[str, str] = {
    "ffi_cpu": "gdngen.backends.ffi_cpu",
    "pallas_tpu": "gdngen.backends.pallas.tpu",
    "pallas_gpu": "gdngen.backends.pallas.gpu",
    "xla": "gdngen.backends.portable.xla",
    "metal": "gdngen.backends.metal",
    "mlx": "gdngen.backends.portable.mlx",
}


# ------------------------------------------------------------------------------ lookup

_SPECS: dict[str, BackendSpec] = {}


def names(framework: str | None = None) -> tuple[str, ...]:
    """Registered backend names, in registry order (only ``framework``'s, if given)."""
    if framework is None:
        return tuple(BACKENDS)
    return tuple(n for n in BACKENDS if get(n).framework == framework)


def get(name: str) -> BackendSpec:
    """The spec of backend ``name`` (importing its module on first use)."""
    if name not in BACKENDS:
        raise ValueError(f"backend must be one of {sorted(BACKENDS)}, got {name!r}")
    spec = _SPECS.get(name)
    if spec is None:
        spec = importlib.import_module(BACKENDS[name]).SPEC
        if spec.name != name:
            raise RuntimeError(f"{BACKENDS[name]}.SPEC declares {spec.name!r}, registered as "
                               f"{name!r}")
        _SPECS[name] = spec
    return spec


def register(name: str, module: str) -> None:
    """Add (or replace) a backend: ``module`` declares its ``SPEC`` (plugins, tests)."""
    BACKENDS[name] = module
    _SPECS.pop(name, None)


def unregister(name: str) -> None:
    BACKENDS.pop(name, None)
    _SPECS.pop(name, None)


def framework_of(name: str) -> str:
    """The framework whose entry point runs backend ``name``."""
    return get(name).framework


def portable(framework: str) -> str:
    """The framework's portable backend (its fallback)."""
    for name in names(framework):
        if get(name).portable:
            return name
    raise ValueError(f"no portable backend registered for framework {framework!r}")


def backends_for(device: str | Device, framework: str | None = None) -> tuple[str, ...]:
    """Backends targeting ``device``'s kind (of ``framework``, if given), preferred first:
    generated kernels before the portable path."""
    kind = (device if isinstance(device, Device) else get_device(device)).kind
    found = [n for n in names(framework) if kind in get(n).device_kinds]
    return tuple(sorted(found, key=lambda n: get(n).portable))


def runnable(framework: str, problem: Problem, device: str | Device | None = None
             ) -> tuple[str, ...]:
    """Backends of ``framework`` (targeting ``device``, if given) that implement ``problem``
    and that this host can run, preferred first."""
    pool = names(framework) if device is None else backends_for(device, framework)
    return tuple(n for n in pool if get(n).capability(problem)[0])


def variants(backend: str, problem: Problem, device: str | Device | None = None
             ) -> list[Variant]:
    """Every variant of ``backend`` for ``problem`` that fits ``device`` (default: the
    backend's reference device), in a stable order."""
    spec = get(backend)
    return [Variant(backend, c.params()) for c in spec.space(problem, spec.device(device))]


def default_variant(backend: str, problem: Problem, device: str | Device | None = None
                    ) -> Variant:
    """The heuristic choice of ``backend`` for ``problem`` on ``device`` (used untuned)."""
    spec = get(backend)
    return Variant(backend, spec.default(problem, spec.device(device)).params())


def check_variant(variant: Variant):
    """The typed config of ``variant`` (ValueError naming the bad field)."""
    return get(variant.backend).parse(variant)
