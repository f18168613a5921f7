"""What a backend declares about itself: `BackendSpec` (one per backend module, as ``SPEC``).

This module sits below the backends (they import it) and below `gdngen.registry` (which imports
the backends by name), so the declaration and the lookup never import each other.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from gdngen.devices import Device, get_device
from gdngen.problem import FLOAT_DTYPES
from gdngen.variant import Problem, Variant


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
    * ``device_limit``: the `Device.limits` key its space is pruned with, ``footprint(variant,
      problem)`` the bytes of that resource a variant uses (its space keeps the variants whose
      footprint fits the device); ``reference_device``: the device planned for when none is
      named.
    * ``packed_entry``: ``gated_delta(..., variant, cu_seqlens)`` running a packed row in its
      own kernels for the gate kinds in ``packed_gates`` (`gdngen.packed`); without one, packed
      rows of its variants run on the framework's portable chunk path.
    * ``fused_inputs``: the layer inputs its entry takes raw and computes inside its chunk core
      (``"qk_norm"``: the entry takes ``qk_norm=True`` and raw q, k, and keeps no normalised
      q, k for its backward; ``"gate"``: the entry takes a `gdngen.chunkwise.ParameterGate`
      as ``gate`` with ``g = (a, A_log, dt_bias)`` and keeps no log gate); the others are
      computed before the call (`run`).
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
    footprint: Callable | None = None
    reference_device: str | None = None
    fused_inputs: tuple = ()
    packed_entry: Callable | None = None
    packed_gates: tuple = ()

    def __post_init__(self):
        if self.framework not in ("jax", "mlx"):
            raise ValueError(f"BackendSpec.framework must be 'jax' or 'mlx', got "
                             f"{self.framework!r}")
        if (self.render_plan is None) == (not self.source_modules):
            raise ValueError(f"backend {self.name!r} must declare exactly one of render_plan "
                             "and source_modules")
        if (self.device_limit is None) != (self.footprint is None):
            raise ValueError(f"backend {self.name!r} must declare device_limit and footprint "
                             "together")

    # ------------------------------------------------------------------ capability

    def unsupported(self, problem: Problem) -> str | None:
        """Why this backend does not implement ``problem`` (gate kind, dtype, its shape rules),
        or None."""
        if problem.gate not in self.gates:
            return (f"Problem.gate must be one of {self.gates} for the {self.name} backend "
                    f"(vector gates run on the portable backend), got {problem.gate!r}")
        if problem.dtype not in self.dtypes:
            return (f"Problem.dtype must be one of {self.dtypes} for the {self.name} backend, "
                    f"got {problem.dtype!r}")
        why = self.supports(problem) if self.supports is not None else None
        return f"the {self.name} backend cannot run {problem.key()}: {why}" if why else None

    def check(self, problem: Problem) -> None:
        """ValueError saying why, unless this backend implements ``problem``."""
        why = self.unsupported(problem)
        if why:
            raise ValueError(why)

    def capability(self, problem: Problem) -> tuple[bool, str]:
        """``(ok, reason)``: whether this backend implements ``problem`` and runs here."""
        why = self.unsupported(problem)
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
        return _parsed(self.config, variant.params, tuple(type(v) for _, v in variant.params))

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
            variant, qk_norm=False):
        """Run ``variant`` of this backend on one call (shapes as `gdngen.jax.gated_delta`);
        ``qk_norm``: q, k are raw, normalised inside the chunk core when this backend fuses the
        norm (`fused_inputs`), else just before the call; ``gate`` a
        `gdngen.chunkwise.ParameterGate` (``g`` then ``(a, A_log, dt_bias)``): likewise the log
        gate. (A packed row: `gdngen.packed.run`.)"""
        from gdngen import layer_inputs

        if "gate" not in self.fused_inputs:
            g, gate = layer_inputs.computed_gate(self.framework, g, gate)
        if qk_norm and "qk_norm" in self.fused_inputs:
            return self.entry(q, k, v, g, beta, initial_state, mask=mask, scale=scale,
                              gate=gate, variant=variant, qk_norm=True)
        if qk_norm:
            q, k = layer_inputs.normalize_qk(self.framework, q, k)
        return self.entry(q, k, v, g, beta, initial_state, mask=mask, scale=scale, gate=gate,
                          variant=variant)

    def render(self, variant: Variant, problem: Problem, *, templates_dir=None):
        """This backend's sources for ``variant`` specialised to ``problem`` (`gdngen.sources`)."""
        from gdngen.sources import render_spec

        return render_spec(self, variant, problem, templates_dir=templates_dir)


@functools.lru_cache(maxsize=256)
def _parsed(config, params: tuple, types: tuple):
    """``config.from_params`` memoised per (config class, variant params and their types: 1 and
    True are equal keys, not equal params): a decode-length call parses its variant once, not
    per token (a ValueError is raised again each time)."""
    return config.from_params(dict(params))
