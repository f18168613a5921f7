"""Load stage: choose the variant that runs a call (explicit, else tuned, else default).

`resolve` is shared by ``gdngen.jax.gated_delta`` and ``gdngen.mlx.gated_delta``. Without an
explicit variant or chunk size it consults the tuned cache (`gdngen.cache`) for the attached
device, the call's shape class (`Problem`), precision "ieee" and the call's sequence-length
bucket; with nothing usable there it takes the backend's default variant. Setting
``GDNGEN_NO_TUNED=1`` skips the cache. `load_tuned` returns a callable doing the same per call
for a chosen device and precision policy, with `TunedGatedDelta.explain` saying what it picked
and why.
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass

from gdngen.problem import CallShape, check_call, dtype_name
from gdngen.variant import SPACES, Problem, Variant, default_variant

#: backends each framework can execute, the portable one first (the fallback).
FRAMEWORK_BACKENDS = {"jax": ("xla", "pallas_tpu", "pallas_gpu", "ffi_cpu"),
                      "mlx": ("mlx", "metal")}
ENV_NO_TUNED = "GDNGEN_NO_TUNED"


def problem_of(shape: CallShape, dtype: str) -> Problem:
    """The `Problem` (shape class) of a checked call with input dtype ``dtype``."""
    return Problem(shape.Hk, shape.Hv, shape.Dk, shape.Dv, dtype,
                   "vector" if shape.vector_gate else "scalar")


def framework_of(backend: str) -> str:
    """The framework whose entry point executes ``backend``."""
    for framework, backends in FRAMEWORK_BACKENDS.items():
        if backend in backends:
            return framework
    raise ValueError(f"backend {backend!r} belongs to no framework; known: {FRAMEWORK_BACKENDS}")


def runnable_backends(framework: str, problem: Problem) -> tuple[str, ...]:
    """Registered backends of ``framework`` that implement ``problem``'s gate kind and that this
    host can run (`backend_available`)."""
    from gdngen.backends import VECTOR_GATE_BACKENDS

    if framework not in FRAMEWORK_BACKENDS:
        raise ValueError(f"framework must be one of {sorted(FRAMEWORK_BACKENDS)}, "
                         f"got {framework!r}")
    return tuple(b for b in FRAMEWORK_BACKENDS[framework] if b in SPACES
                 and (problem.gate == "scalar" or b in VECTOR_GATE_BACKENDS)
                 and backend_available(b))


def backend_available(backend: str) -> bool:
    """False when ``backend``'s module has an ``available()`` hook saying this host cannot run
    it (e.g. ffi_cpu without a C++ compiler); True otherwise."""
    module = importlib.import_module(SPACES[backend].partition(":")[0])
    hook = getattr(module, "available", None)
    return hook is None or bool(hook())


@dataclass(frozen=True)
class Choice:
    """The variant chosen for a call: ``source`` is "explicit", "tuned" or "default";
    ``reason`` says why; ``entry`` / ``path`` name the tuned entry used, if any."""

    variant: Variant
    source: str
    reason: str
    device: str | None = None
    precision: str = "ieee"
    entry: dict | None = None
    path: str | None = None

    def __str__(self) -> str:
        where = f" on {self.device}" if self.device else ""
        return f"{self.variant} ({self.source}{where}, precision {self.precision}): {self.reason}"


def choose(framework: str, shape: CallShape, dtype: str, *, device: str | None = None,
           precision: str = "ieee") -> Choice:
    """Tuned variant for this call's shape class and T bucket on ``device`` (default: the
    attached one), else the default variant of the framework's portable backend."""
    from gdngen import cache, devices

    problem = problem_of(shape, dtype)
    fallback = default_variant(FRAMEWORK_BACKENDS[framework][0], problem)
    if os.environ.get(ENV_NO_TUNED, "") not in ("", "0"):
        return Choice(fallback, "default", f"tuned lookup disabled by {ENV_NO_TUNED}",
                      device, precision)
    if device is None:
        found = devices.detect_framework(framework)
        if found.name is None:
            return Choice(fallback, "default", f"attached device ({found.description}) is not "
                          "in the device registry", None, precision)
        device = found.name
    result = cache.lookup(device, runnable_backends(framework, problem), problem, precision,
                          shape.T)
    if result.entry is None:
        return Choice(fallback, "default", result.reason, device, precision)
    return Choice(Variant.from_json(result.entry["variant"]), "tuned", result.reason, device,
                  precision, result.entry, str(result.path))


def resolve(framework: str, shape: CallShape, dtype: str, variant: Variant | None = None,
            chunk_size: int | None = None) -> Variant:
    """The variant for one call. An explicit ``variant`` must belong to ``framework``; an explicit
    ``chunk_size`` overrides the default variant's chunk (and must agree with an explicit
    variant); with neither, the tuned variant for the attached device (precision "ieee") wins
    over the default (see `choose`)."""
    backends = FRAMEWORK_BACKENDS[framework]
    if variant is not None:
        if not isinstance(variant, Variant):
            raise ValueError(f"variant must be a gdngen.Variant, got {type(variant).__name__}")
        if variant.backend not in backends:
            raise ValueError(f"variant backend {variant.backend!r} does not run on {framework}; "
                             f"expected one of {backends}")
        if chunk_size is not None and chunk_size != variant.get("chunk_size", chunk_size):
            raise ValueError(f"chunk_size={chunk_size} conflicts with the variant's chunk_size="
                             f"{variant['chunk_size']}")
        return variant
    if chunk_size is None:
        return choose(framework, shape, dtype).variant
    chosen = default_variant(backends[0], problem_of(shape, dtype))
    return Variant(chosen.backend, dict(chosen.as_dict(), chunk_size=chunk_size))


# ------------------------------------------------------------------------------ load_tuned


class TunedGatedDelta:
    """``gated_delta`` for one framework, device and precision policy that runs, per call, the
    tuned variant of the call's shape class and T bucket (else the default variant)."""

    def __init__(self, framework: str, device: str, precision: str):
        self.framework, self.device, self.precision = framework, device, precision
        self._entry = importlib.import_module(f"gdngen.{framework}").gated_delta

    def __repr__(self) -> str:
        return (f"TunedGatedDelta(framework={self.framework!r}, device={self.device!r}, "
                f"precision={self.precision!r})")

    def explain(self, q, k, v, g, beta, initial_state=None, *, mask=None, scale=1.0,
                gate="log") -> Choice:
        """Which variant a call with these arguments runs, and why (`str()` it to read)."""
        shape = check_call(q, k, v, g, beta, initial_state, mask, gate=gate, scale=scale)
        return choose(self.framework, shape, dtype_name(q), device=self.device,
                      precision=self.precision)

    def __call__(self, q, k, v, g, beta, initial_state=None, *, mask=None, scale=1.0,
                 gate="log"):
        """Same contract as `gdngen.jax.gated_delta` / `gdngen.mlx.gated_delta`."""
        from gdngen.timing import precision_context

        chosen = self.explain(q, k, v, g, beta, initial_state, mask=mask, scale=scale,
                              gate=gate).variant
        with precision_context(self.framework, self.precision):
            return self._entry(q, k, v, g, beta, initial_state, mask=mask, scale=scale,
                               gate=gate, variant=chosen)


def call(framework: str, portable, f32, zeros, q, k, v, g, beta, initial_state, *, mask, scale,
         gate, chunk_size, variant):
    """The body of ``gdngen.<framework>.gated_delta``: check, choose the variant, run it.

    ``portable`` is the framework's portable backend module (its ``chunkwise_gated_delta`` and
    ``sequential_gated_delta``), ``f32`` its float32 dtype and ``zeros(shape, dtype)`` its zeros.
    A generated-kernel variant runs through ``gdngen.backends.<backend>.gated_delta``.
    """
    shape = check_call(q, k, v, g, beta, initial_state, mask, gate=gate,
                       chunk_size=64 if chunk_size is None else chunk_size, scale=scale)
    chosen = resolve(framework, shape, dtype_name(q), variant, chunk_size)
    if chosen.backend != FRAMEWORK_BACKENDS[framework][0]:  # a generated-kernel backend
        module = importlib.import_module(f"gdngen.backends.{chosen.backend}")
        return module.gated_delta(q, k, v, g, beta, initial_state, mask=mask, scale=float(scale),
                                  gate=gate, variant=chosen)
    if initial_state is None:
        initial_state = zeros((shape.B, shape.Hv, shape.Dv, shape.Dk), f32)
    args = (q.astype(f32), k.astype(f32), v.astype(f32), g.astype(f32), beta.astype(f32),
            initial_state.astype(f32), mask)
    if shape.vector_gate:
        y, state = portable.sequential_gated_delta(*args, scale=float(scale), gate=gate)
    else:
        y, state = portable.chunkwise_gated_delta(*args, scale=float(scale), gate=gate,
                                                  **chosen.as_dict())
    return y.astype(q.dtype), state


def load_tuned(framework: str = "jax", device: str | None = None,
               precision: str = "ieee") -> TunedGatedDelta:
    """A callable with the ``gated_delta`` signature dispatching each call to its tuned variant.

    ``device`` defaults to the attached one; naming a device that is not attached is a
    ValueError (saying what was found). ``precision``: "ieee" | "tf32" | "bf16", the policy the
    entries were tuned under (JAX applies it with ``jax.default_matmul_precision``; MLX's
    portable backend stays float32 under every policy).
    """
    from gdngen import devices
    from gdngen.timing import check_precision

    if framework not in FRAMEWORK_BACKENDS:
        raise ValueError(f"framework must be one of {sorted(FRAMEWORK_BACKENDS)}, "
                         f"got {framework!r}")
    check_precision(framework, precision)
    device = devices.detect(framework) if device is None \
        else devices.require_attached(device, framework).name
    return TunedGatedDelta(framework, device, precision)
