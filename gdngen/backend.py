"""The backend base class: what every backend declares and the orchestration written once.

A backend (one per execution target; `gdngen.registry.BACKENDS` lists them) is a subclass of
`Backend` whose instance its module exports as ``SPEC``. It declares:

* ``name``, ``framework`` ("jax" | "mlx", whose ``gated_delta`` runs it), ``config`` (its
  typed parameters, a `gdngen.config.VariantConfig` subclass), ``tolerances`` (relative L2
  error allowed per precision policy, `gdngen.tolerance`), ``device_kinds`` (the
  `gdngen.devices.Device.kind` values it targets), ``portable`` (the framework's fallback);
* ``gates`` / ``dtypes``: gate kinds and input dtypes it implements; ``tuned_gates`` the gate
  kinds whose execution depends on the variant; ``fused_inputs``: the layer inputs it takes
  raw (``"qk_norm"``, ``"gate"``, ``"conv"``; the others `run` computes before it) and
  ``"norm"``, the output's gated norm its `forward` applies itself (`normalises`; else `run`
  applies it after); ``packed_gates``: the
  gate kinds whose packed rows (`gdngen.algebra.packed`) run in its own kernels (`packed`);
* ``space(problem, device) -> [config]``, ``default(problem, device) -> config``;
  ``device_limit`` with ``footprint(variant, problem)`` (bytes of that `Device.limits`
  resource a variant uses; the space keeps what fits), ``reference_device``;
* ``supports(problem) -> reason | None`` (shape rules beyond gates and dtypes),
  ``available()``, ``render_plan(variant, problem)`` (templated) or ``source_modules``
  (portable), ``lower_check(variant, problem)``, ``clear_cache()``;
* the hooks a call runs through: ``forward(call, operands, variant)`` (a dense call; it reads
  the recurrent switch through `Backend.chunked`) and, for ``packed_gates``,
  ``packed(call, operands, variant)``.

`run` is the one path from a checked `gdngen.call.Call` to those hooks: the layer inputs the
backend does not fuse are computed first (`gdngen.prepare.computed`), a packed row goes
to `packed` or the framework's portable packed path. Nothing re-checks the call.
`BackendSpec` is the same declaration made from plain functions (plugins, tests).
"""

from __future__ import annotations

import functools

from gdngen import prepare
from gdngen.config import VECTOR_CHUNK
from gdngen.devices import Device, get_device
from gdngen.problem import Problem
from gdngen.shape import FLOAT_DTYPES
from gdngen.variant import Variant

__all__ = ["Backend", "parse_variant"]


class Backend:
    """Base of every backend (see the module docstring for what a subclass declares)."""

    name: str
    framework: str
    config: type
    tolerances: dict
    device_kinds: tuple
    portable: bool = False
    gates: tuple = ("scalar",)
    dtypes: tuple = FLOAT_DTYPES
    tuned_gates: tuple = ("scalar",)
    source_modules: tuple = ()
    device_limit: str | None = None
    reference_device: str | None = None
    fused_inputs: tuple = ()
    packed_gates: tuple = ()
    #: gate kinds whose per-step states (``return_states="steps"``) its recurrent kernels write
    #: (the ``steps`` hook); the others run `gdngen.backends.fallback.steps`
    step_states: tuple = ()
    #: gate kinds whose chunk forward kernel gives the chunk-boundary states
    #: (``return_states="chunks"``, the ``chunks`` hook); the others run
    #: `gdngen.backends.fallback.chunks`
    chunk_states: tuple = ()
    #: optional hooks (None: the backend has none): ``render_plan(variant, problem)``,
    #: ``lower_check(variant, problem)``, ``clear_cache()``, ``footprint(variant, problem)``
    render_plan = None
    lower_check = None
    clear_cache = None
    footprint = None

    def __init__(self):
        self.validate()

    def validate(self) -> None:
        """ValueError for a declaration that contradicts itself."""
        if self.framework not in ("jax", "mlx"):
            raise ValueError(f"BackendSpec.framework must be 'jax' or 'mlx', got "
                             f"{self.framework!r}")
        if (self.render_plan is None) == (not self.source_modules):
            raise ValueError(f"backend {self.name!r} must declare exactly one of render_plan "
                             "and source_modules")
        if (self.device_limit is None) != (self.footprint is None):
            raise ValueError(f"backend {self.name!r} must declare device_limit and footprint "
                             "together")

    def __repr__(self) -> str:
        return f"<{type(self).__name__} backend {self.name!r} ({self.framework})>"

    # ------------------------------------------------------------------ declaration

    def space(self, problem: Problem, device: Device | None = None) -> list:
        raise NotImplementedError

    def default(self, problem: Problem, device: Device | None = None):
        raise NotImplementedError

    def supports(self, problem: Problem) -> str | None:
        """Why this backend cannot run ``problem`` beyond its gates and dtypes, or None."""
        return None

    def available(self) -> bool:
        """Whether this host can run it."""
        return True

    def toolchain(self) -> str:
        """What besides the rendered source and the framework versions decides its binaries
        (a compiler's version, flags): part of a first-use verdict's key (`gdngen.firstuse`)."""
        return ""

    # ------------------------------------------------------------------ capability

    def unsupported(self, problem) -> str | None:
        """Why this backend does not implement ``problem`` (a `Problem` or a
        `gdngen.call.Call`: gate kind, dtype, its shape rules), or None."""
        problem = getattr(problem, "problem", problem)
        if problem.gate not in self.gates:
            return (f"Problem.gate must be one of {self.gates} for the {self.name} backend "
                    f"(vector gates run on the portable backend), got {problem.gate!r}")
        if problem.dtype not in self.dtypes:
            return (f"Problem.dtype must be one of {self.dtypes} for the {self.name} backend, "
                    f"got {problem.dtype!r}")
        why = self.supports(problem)
        return f"the {self.name} backend cannot run {problem.key()}: {why}" if why else None

    def check(self, problem) -> None:
        """ValueError saying why, unless this backend implements ``problem``."""
        why = self.unsupported(problem)
        if why:
            raise ValueError(why)

    def capability(self, problem) -> tuple[bool, str]:
        """``(ok, reason)``: whether this backend implements ``problem`` and runs here."""
        why = self.unsupported(problem)
        if why:
            return False, why
        if not self.available():
            return False, f"{self.name} cannot run on this host"
        return True, "ok"

    def refusal(self, call) -> str | None:
        """Why this backend cannot run the checked `gdngen.call.Call` (naming the argument:
        q's dtype, g's shape for a gate kind it lacks, its shape rules), or None."""
        if call.dtype not in self.dtypes:
            return (f"q has dtype {call.dtype}, expected one of {self.dtypes} for the "
                    f"{self.name} backend")
        shape = call.shape
        if shape.vector_gate and "vector" not in self.gates:
            return (f"g has shape {(shape.B, shape.T, shape.Hv, shape.Dk)}, expected "
                    f"({shape.B}, {shape.T}, {shape.Hv}): the {self.name} backend implements "
                    "scalar gates only")
        return self.unsupported(call.problem)

    def checked_args(self, q, k, v, g, beta, initial_state=None, mask=None, **options):
        """``(call, operands)`` of this backend's own entry point's arguments
        (`gdngen.call.of_kernel_args`, ``options`` its keywords), ValueError when the backend
        cannot run the call (`refusal`): the check of a call that does not come through
        `gdngen.entry.bind`."""
        from gdngen.call import of_kernel_args

        call, operands = of_kernel_args(self.framework, q, k, v, g, beta, initial_state, mask,
                                        **options)
        why = self.refusal(call)
        if why:
            raise ValueError(why)
        return call, operands

    def chunked(self, call, variant: Variant) -> bool:
        """The recurrent switch (`gdngen.config.recurrent_switch`), the one place it is read:
        whether ``call`` under ``variant`` evaluates through the chunk kernels (T >= the
        variant's ``recurrent_below``; a packed row always) rather than the recurrent kernel.
        Either way a differentiated call takes the chunk path's VJP."""
        return call.packed or call.shape.T >= self.parse(variant).recurrent_below

    def native_packed(self, vector_gate: bool) -> bool:
        """Whether packed rows of this gate kind run in this backend's own kernels."""
        return ("vector" if vector_gate else "scalar") in self.packed_gates

    def packed_params(self, variant: Variant, vector_gate: bool) -> dict:
        """Chunk params of the portable path (`gdngen.backends.fallback`) a call of ``variant``
        runs on when this backend has no kernels for it: its chunk size (scalar gates) or the
        chunk its per-channel gradients run (`gdngen.config.VECTOR_CHUNK`)."""
        if vector_gate:
            return {"chunk_size": VECTOR_CHUNK}
        return {"chunk_size": int(variant.get("chunk_size", 64))}

    def describe_packed(self, variant: Variant, vector_gate: bool, sequences: int) -> str:
        """What a packed call of ``variant`` runs (`gdngen.dispatch.Choice.for_length`)."""
        if self.native_packed(vector_gate):
            where = f"the {self.name} chunk kernels" + ("" if self.portable else
                                                        " (their packed build)")
            chunk = variant.get("chunk_size")
        else:
            from gdngen.backends.fallback import PORTABLE_OPS

            module = PORTABLE_OPS[self.framework].rsplit(".", 1)[1]
            where = (f"the portable {module} chunk path (no packed {self.name} kernels for "
                     "these gates yet)")
            chunk = self.packed_params(variant, vector_gate)["chunk_size"]
        return (f"packed row of {sequences} sequences: {where} at chunk_size={chunk}, resets at "
                "each start, initial states injected, final states from each sequence's last "
                "chunk (recurrent_below does not apply; the dense shape class's entry)")

    # ------------------------------------------------------------------ configs

    def parse(self, variant: Variant):
        """The typed config of ``variant``; ValueError for another backend or bad params."""
        return parse_variant(self.name, self.config, variant)

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

    def render(self, variant: Variant, problem: Problem, *, templates_dir=None):
        """This backend's sources for ``variant`` specialised to ``problem`` (`gdngen.sources`)."""
        from gdngen.sources import render_spec

        return render_spec(self, variant, problem, templates_dir=templates_dir)

    # ------------------------------------------------------------------ running a call

    def run(self, call, operands, variant: Variant, **options):
        """Run ``variant`` on a `gdngen.call.Call` checked for this backend (`gdngen.entry.bind`
        or `checked_args`) and its `gdngen.call.Operands`
        (beta activated, a parameterised gate's parameters laid out:
        `gdngen.prepare.prepared`); returns ``(y, final_state)``. The layer inputs this
        backend does not take raw (`fused_inputs`; a packed row: none) are computed first.
        ``options``: keywords of this backend's hooks (e.g. ``templates_dir``)."""
        from gdngen.backends import fallback

        if call.norm_gate is not None and not self.normalises(call):
            y, states = self.run(*prepare.without_norm(call, operands), variant, **options)
            return prepare.normed(call, operands, y), states
        if call.return_states != "final":
            call, operands = prepare.computed(call, operands)
            if call.return_states == "chunks":
                if call.problem.gate in self.chunk_states:
                    return self.chunks(call, operands, variant, **options)
                return fallback.chunks(call, operands,
                                       self.packed_params(variant, call.vector_gate))
            if call.problem.gate in self.step_states:
                return self.steps(call, operands, variant, **options)
            return fallback.steps(call, operands)
        if call.packed:
            call, operands = prepare.computed(call, operands)
            if self.native_packed(call.vector_gate):
                return self.packed(call, operands, variant, **options)
            return fallback.packed(call, operands, self.packed_params(variant, call.vector_gate))
        call, operands = prepare.computed(call, operands, self.fused_inputs)
        return self.forward(call, operands, variant, **options)

    def normalises(self, call) -> bool:
        """Whether `forward` takes ``call``'s gated norm (``call.norm_gate``) itself: a dense
        call returning the final state, on a backend listing "norm" in `fused_inputs`."""
        return ("norm" in self.fused_inputs and call.return_states == "final"
                and not call.packed)

    def norm_in_stores(self, call, variant: Variant) -> bool:
        """Whether ``call``'s output norm (``call.norm_gate``) is computed in its kernels'
        stores when not differentiated (a norm build); else it runs after them. What the
        forwards of ffi_cpu and Pallas read (metal's `dense_call` the same condition, a short
        call) and `gdngen.entry.TunedGatedDelta.explain` says."""
        return False

    def takes_raw_conv(self, call) -> bool:
        """Whether `forward` gets ``call``'s q, k, v raw with the conv (``call.conv_size``): a
        dense call returning the final state, on a backend listing "conv" in `fused_inputs`."""
        return ("conv" in self.fused_inputs and call.conv_size is not None
                and call.return_states == "final" and not call.packed)

    def conv_path(self, call, variant: Variant) -> str:
        """Where ``call``'s causal conv (``call.conv_size``) runs, in words
        (`gdngen.entry.TunedGatedDelta.explain`): here before the kernels, in the conv's own
        custom VJP; a backend whose kernels convolve in their loads (`takes_raw_conv`) says
        which."""
        return "before the kernels (the conv's custom VJP, keeping the raw inputs)"

    def run_packed_kernels(self, call, operands, variant: Variant, **options):
        """`run` for a backend's own packed entry point (``packed_gated_delta``): ValueError
        for gates its packed kernels do not take (`packed_gates`) instead of the portable
        path `run` would take."""
        if not self.native_packed(call.vector_gate):
            shape = call.shape
            raise ValueError(f"g has shape {(shape.B, shape.T, shape.Hv, shape.Dk)}: the "
                             f"{self.name} packed kernels take scalar gates only (per-channel "
                             "packed rows run on the portable path)")
        return self.run(call, operands, variant, **options)

    def forward(self, call, operands, variant: Variant, **options):
        """A dense call of ``variant``: ``(y in q's dtype, final_state float32)``. The
        layer inputs in ``call`` are the ones listed in `fused_inputs`."""
        raise NotImplementedError

    def steps(self, call, operands, variant: Variant, **options):
        """A ``return_states="steps"`` call (gate kinds of `step_states`): ``(y in q's dtype,
        states [B,T,Hv,Dv,Dk] float32)``."""
        raise NotImplementedError

    def chunks(self, call, operands, variant: Variant, **options):
        """A ``return_states="chunks"`` call (gate kinds of `chunk_states`): ``(y in q's dtype,
        states [B, ceil(T/N), Hv, Dv, Dk] float32)`` from the chunk walk of its kernels."""
        raise NotImplementedError

    def packed(self, call, operands, variant: Variant, **options):
        """A packed row (`gdngen.algebra.packed`, gate kinds of `packed_gates`) of ``variant``:
        ``(y [1,T,Hv,Dv] in q's dtype, final_state [N,Hv,Dv,Dk] float32)``."""
        raise NotImplementedError


def parse_variant(backend: str, config: type, variant: Variant):
    """The ``config`` instance of a ``backend`` ``variant`` (memoised per params); ValueError
    for another backend or bad params. `Backend.parse` without the instance."""
    if variant.backend != backend:
        raise ValueError(f"variant backend must be {backend!r}, got {variant.backend!r}")
    return _parsed(config, variant.params, tuple(type(v) for _, v in variant.params))


@functools.lru_cache(maxsize=256)
def _parsed(config, params: tuple, types: tuple):
    """``config.from_params`` memoised per (config class, variant params and their types: 1 and
    True are equal keys, not equal params): a decode-length call parses its variant once, not
    per token (a ValueError is raised again each time)."""
    return config.from_params(dict(params))
