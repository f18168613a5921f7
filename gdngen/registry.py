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
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from gdngen.devices import Device, get_device
from gdngen.problem import FLOAT_DTYPES
from gdngen.variant import Problem, Variant

#: backend name -> module declaring its ``SPEC``; generated backends before portable ones of the
#: same framework (a device's preference order, see `backends_for`).
BACKENDS: dict[str, str] = {
    "ffi_cpu": "gdngen.backends.ffi_cpu",
    "pallas_tpu": "gdngen.backends.pallas_tpu",
    "pallas_gpu": "gdngen.backends.pallas_gpu",
    "xla": "gdngen.backends.xla",
    "metal": "gdngen.backends.metal",
    "mlx": "gdngen.backends.mlx",
}


def _always() -> bool:
    return True


@dataclass(frozen=True)
class BackendSpec:
    """What a backend is and does, declared once in its module as ``SPEC``.

    * ``framework``: "jax" | "mlx", whose ``gated_delta`` runs it.
    * ``config``: its typed parameters (a `gdngen.config.VariantConfig` subclass).
    * ``space(problem, device) -> [config]`` and ``default(problem, device) -> config``: the
      variants that fit ``device`` (a `gdngen.devices.Device`, or None for a backend with no
      on-chip limits) and the heuristic choice.
    * ``entry``: ``gated_delta(q, k, v, g, beta, initial_state, *, mask, scale, gate, variant)``.
    * ``tolerances``: relative L2 error allowed per precision policy (`gdngen.tolerance`).
    * ``device_kinds``: the `Device.kind` values it targets.
    * ``portable``: the framework's fallback path (runs wherever the framework does).
    * ``gates`` / ``dtypes``: gate kinds and input dtypes it implements; ``tuned_gates`` the gate
      kinds whose execution depends on the variant (the others have nothing to tune).
    * ``render_plan(variant, problem)`` (templated) or ``source_modules`` (portable): sources.
    * ``available()``: whether this host can run it; ``supports(problem)``: None or why not
      (shape limits beyond gates and dtypes); ``lower_check(variant, problem)``: compile or
      lowering check without the target hardware; ``clear_cache()``: drop loaded kernels.
    * ``device_limit``: the `Device.limits` key its space is pruned with; ``reference_device``:
      the device planned for when none is named.
    """

    name: str
    framework: str
    config: type
    space: Callable
    default: Callable
    entry: Callable
    tolerances: Mapping
    device_kinds: tuple
    portable: bool = False
    gates: tuple = ("scalar",)
    dtypes: tuple = FLOAT_DTYPES
    tuned_gates: tuple = ("scalar",)
    render_plan: Callable | None = None
    source_modules: tuple = ()
    available: Callable = _always
    supports: Callable | None = None
    lower_check: Callable | None = None
    clear_cache: Callable | None = None
    device_limit: str | None = None
    reference_device: str | None = None
    extra: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.framework not in ("jax", "mlx"):
            raise ValueError(f"BackendSpec.framework must be 'jax' or 'mlx', got "
                             f"{self.framework!r}")
        if (self.render_plan is None) == (not self.source_modules):
            raise ValueError(f"backend {self.name!r} must declare exactly one of render_plan "
                             "and source_modules")

    # ------------------------------------------------------------------ capability

    def capability(self, problem: Problem) -> tuple[bool, str]:
        """``(ok, reason)``: whether this backend implements ``problem`` and runs here."""
        if problem.gate not in self.gates:
            return False, (f"{self.name} implements {'/'.join(self.gates)} gates, not "
                           f"{problem.gate}")
        if problem.dtype not in self.dtypes:
            return False, (f"{self.name} takes {'/'.join(self.dtypes)} inputs, not "
                           f"{problem.dtype}")
        if self.supports is not None:
            why = self.supports(problem)
            if why:
                return False, why
        if not self.available():
            return False, f"{self.name} cannot run on this host"
        return True, "ok"

    # ------------------------------------------------------------------ configs

    def parse(self, variant: Variant):
        """The typed config of ``variant``; ValueError for another backend or bad params."""
        if variant.backend != self.name:
            raise ValueError(f"variant backend must be {self.name!r}, got {variant.backend!r}")
        return self.config.from_params(variant.as_dict())

    def device(self, device: str | Device | None) -> Device | None:
        """The device a space is planned for: ``device``, else `reference_device`."""
        if device is None:
            device = self.reference_device
        if device is None:
            return None
        dev = device if isinstance(device, Device) else get_device(device)
        if self.device_limit is not None and self.device_limit not in dev.limits:
            raise ValueError(f"device {dev.name!r} has no {self.device_limit} limit: {self.name} "
                             f"targets {'/'.join(self.device_kinds)} devices")
        return dev

    def run(self, q, k, v, g, beta, initial_state=None, *, mask=None, scale=1.0, gate="log",
            variant):
        """Run ``variant`` of this backend on one call (shapes as `gdngen.jax.gated_delta`)."""
        return self.entry(q, k, v, g, beta, initial_state, mask=mask, scale=scale, gate=gate,
                          variant=variant)


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
