"""The one entry body of ``gated_delta``: `Options`, `bind`, `body`, and `load_tuned`.

``gdngen.jax.gated_delta``, ``gdngen.mlx.gated_delta``, ``load_tuned()``'s callable (and its
``explain``) and the mixer's recurrence all run `body` here:

1. `bind`: the arrays and every option checked once (`gdngen.call.check`, the pool and state
   storage, the variant), remembered per shapes, dtypes and `Options`;
2. JAX, called eagerly: the variant chosen in Python, then the rest as one cached ``jax.jit``
   (`gdngen.eager`);
3. `run`: the states' storage (a pool's rows gathered, the final states scattered to
   ``output_state_indices`` or the same rows, `gdngen.state_pool`;
   bfloat16 states widened and rounded), the layer inputs laid out
   (`gdngen.prepare.prepared`), the placement on chips (`gdngen.sharding`, JAX) and
   the chosen variant's backend (`gdngen.dispatch.run`).

`load_tuned` is that body with the device and the precision policy fixed.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from typing import NamedTuple

from gdngen import dispatch, prepare, registry, state_pool
from gdngen.call import Call, Operands, check
from gdngen.shape import check_framework, dtype_name

__all__ = ["ARRAYS", "Bound", "Options", "TunedGatedDelta", "bind", "body",
           "load_tuned", "run"]

#: the array arguments of ``gated_delta``, in its signature's order
ARRAYS = ("q", "k", "v", "g", "beta", "initial_state", "mask", "A_log", "dt_bias", "cu_seqlens",
          "state_indices", "output_state_indices", "conv_weight", "conv_state", "norm_weight",
          "output_gate")
_OPERANDS = Operands._fields  # the pool's indices are the entry's


@dataclass(frozen=True)
class Options:
    """Every keyword option of ``gated_delta`` (its arrays apart: `ARRAYS`) as the caller gave
    them (meanings: `gdngen.jax.gated_delta`); `bind` checks them. An option is a field here,
    its keyword in the entry points' signatures, and the stage that reads it."""

    scale: float = 1.0
    gate: str = "log"
    chunk_size: int | None = None
    variant: object = None
    context_axis: str | None = None
    qk_norm: bool = False
    lower_bound: float | None = None
    beta_activation: str | None = None
    state_dtype: str = "float32"
    return_states: str = "final"
    checkpoint_every: int | None = None
    norm_eps: float = 1e-6
    norm_gate: str = "silu"

    @classmethod
    def split(cls, arguments: dict) -> tuple[dict, Options]:
        """``(arrays, options)`` of a ``gated_delta``'s arguments by name (its ``locals()``): the
        `ARRAYS` (absent ones None) and the rest as `Options`; TypeError naming an unknown
        keyword."""
        rest = dict(arguments)
        arrays = {name: rest.pop(name, None) for name in ARRAYS}
        if not rest.keys() <= _OPTION_SET:
            unknown = sorted(rest.keys() - _OPTION_SET)
            raise TypeError(f"gated_delta got unexpected keyword argument(s) {unknown}")
        return arrays, cls(**rest)

    def replace(self, **changes) -> Options:
        return dataclasses.replace(self, **changes)

    def key(self) -> tuple:
        """Hashable key of these options: each field's value and type (1, 1.0 and True
        differ); TypeError when a value is unhashable."""
        values = tuple(self.__dict__.values())  # the fields, in order
        key = (values, tuple(map(type, values)))
        hash(key)
        return key


_OPTION_NAMES = tuple(f.name for f in dataclasses.fields(Options))
_OPTION_SET = frozenset(_OPTION_NAMES)
#: the options a `gdngen.call.Call` records (`gdngen.call.check`'s keywords)
_CALL_OPTIONS = ("scale", "gate", "chunk_size", "qk_norm", "lower_bound", "beta_activation",
                 "context_axis", "return_states", "checkpoint_every", "norm_eps", "norm_gate")


class Bound(NamedTuple):
    """A checked call: its `Call` (float32 states, no pool: what the backends compute), its
    `Operands`, its `Options`, and ``state_indices`` (int32 ``[rows]``; the operands'
    ``initial_state`` is then the pool ``[P,Hv,Dv,Dk]``) or None, ``output_state_indices``
    (int32 ``[rows]``, the rows written; None: ``state_indices``)."""

    call: Call
    operands: Operands
    options: Options
    state_indices: object = None
    output_state_indices: object = None


_BOUND: dict = {}  # bind's key -> the Call of a call that passed every check


def bind(framework: str, arrays: dict, options: Options) -> Bound:
    """Check one ``gated_delta`` call (``arrays`` by name, `ARRAYS`) and return it `Bound`; the
    only place a call's arguments are checked. ValueErrors name the argument and what was
    expected. Shapes and Python values are read, and the values of ``cu_seqlens`` and
    ``state_indices`` when concrete, so it runs under ``jax.jit`` and ``mx.compile``. Without
    ``cu_seqlens`` the `Call` is remembered per shapes, dtypes and `Options.key`."""
    operands = Operands._make(map(arrays.get, _OPERANDS))
    state_indices = arrays.get("state_indices")
    written = arrays.get("output_state_indices")
    call = key = None
    if operands.cu_seqlens is None:
        try:
            key = (framework, options.key(),
                   tuple([None if x is None else (tuple(x.shape), x.dtype)
                          for x in (*operands, state_indices, written)]))
            call = _BOUND.get(key)
        except TypeError:  # an unhashable option: the checks name it
            key = None
    if call is None:
        call = _checked(framework, operands, options, state_indices, written)
        if key is not None and len(_BOUND) < 4096:
            _BOUND[key] = call
    elif state_indices is not None:  # the values may differ from the remembered call's
        _check_pool(framework, call, operands.initial_state, state_indices, written)
    return Bound(call, operands, options, state_indices, written)


def _checked(framework: str, x: Operands, o: Options, state_indices, written) -> Call:
    """`bind`'s checks, in order (nothing remembered)."""
    pooled = state_indices is not None
    check_framework(framework)
    if written is not None and not pooled:
        raise ValueError("output_state_indices needs state_indices and a pool initial_state "
                         "[P, Hv, Dv, Dk]: it names the pool rows the final states are written "
                         "to")
    if o.state_dtype != "float32" or (x.initial_state is not None
                                      and dtype_name(x.initial_state) != "float32"):
        state_pool.check_state_dtype(o.state_dtype, x.initial_state)
    if pooled and o.return_states != "final":
        raise ValueError(f"return_states={o.return_states!r} returns a row's states, not a "
                         "pool: pass state_indices=None and write the state you keep into the "
                         "pool")
    if o.context_axis is not None:
        if framework != "jax" or not isinstance(o.context_axis, str):
            raise ValueError(f"context_axis must be None or the name of a mesh axis (JAX "
                             f"only), got {o.context_axis!r}")
        if x.cu_seqlens is not None:
            raise ValueError("context_axis splits one sequence over chips; with cu_seqlens "
                             "pass context_axis=None (each row of sequences runs whole)")
    call, _ = check(framework, *x._replace(initial_state=None if pooled else x.initial_state)
                    [:7], A_log=x.A_log, dt_bias=x.dt_bias, cu_seqlens=x.cu_seqlens,
                    conv_weight=x.conv_weight, conv_state=x.conv_state,
                    norm_weight=x.norm_weight, output_gate=x.output_gate,
                    **{name: getattr(o, name) for name in _CALL_OPTIONS})
    if pooled:
        _check_pool(framework, call, x.initial_state, state_indices, written)
    if o.variant is not None:
        dispatch.check_variant(framework, o.variant, o.chunk_size)
        why = registry.get(o.variant.backend).refusal(call)
        if why:
            raise ValueError(why)
    return call


def _check_pool(framework: str, call: Call, pool, state_indices, written=None) -> None:
    shape = call.shape
    rows = shape.B if shape.sequences is None else shape.sequences
    state_pool.check_pool(framework, pool, state_indices, rows, (shape.Hv, shape.Dv, shape.Dk),
                          written)


# ------------------------------------------------------------------------------ the body


def body(framework: str, arrays: dict, options: Options, *, device: str | None = None,
                precision: str | None = None):
    """``(y, final_state)`` of one ``gated_delta`` call (``arrays`` by name, `ARRAYS`).
    ``device`` / ``precision``: the tuned entries to look up (default: the attached device,
    "ieee"); a given ``precision`` is also applied to the framework's matmuls
    (`gdngen.precision.precision_context`)."""
    from gdngen import eager

    bound = bind(framework, arrays, options)
    with _precision(framework, precision):
        if framework == "jax" and options.context_axis is None \
                and eager.is_eager(arrays.values()):
            variant = options.variant or dispatch.resolve(
                framework, bound.call.shape, bound.call.dtype, None, options.chunk_size,
                device=device, precision=precision or "ieee")
            return eager.run(run, arrays, bound.call, options.replace(variant=variant), device,
                             precision)
        return run(arrays, bound.call, options, device, precision)


def _precision(framework: str, precision: str | None):
    if precision is None:
        return contextlib.nullcontext()
    from gdngen.precision import precision_context

    return precision_context(framework, precision)


def run(arrays: dict, call: Call, options: Options, device: str | None = None,
        precision: str | None = None):
    """The bound ``call`` (`bind`'s, nothing checked again) on ``arrays``: the states' storage
    around `placed`."""
    operands = Operands._make(map(arrays.get, _OPERANDS))
    fw, pool, stored = call.framework, arrays.get("state_indices"), options.state_dtype
    spare = None
    if pool is not None:
        states, spare = state_pool.gather(fw, operands.initial_state, pool)
        operands = operands._replace(initial_state=states)
    elif stored != "float32" and operands.initial_state is not None:
        operands = operands._replace(
            initial_state=state_pool.as_dtype(fw, operands.initial_state, "float32"))
    y, final = placed(call, operands, options.variant, device, precision)
    if pool is not None:
        written = arrays.get("output_state_indices")
        return y, state_pool.scatter(fw, arrays["initial_state"],
                                     pool if written is None else written, final, spare)
    if stored != "float32":
        final = state_pool.as_dtype(fw, final, stored)
    return y, final


def placed(call: Call, operands: Operands, variant=None, device: str | None = None,
           precision: str | None = None):
    """``(y, states)``: the layer inputs laid out (`gdngen.prepare.prepared`),
    then JAX's dense rows placed on the chips (`gdngen.sharding.run`, each shard's call its
    backend's), else the backend on the whole call (`gdngen.dispatch.run`)."""
    look = {"variant": variant, "device": device, "precision": precision or "ieee"}
    if call.framework != "jax" or call.return_states != "final" or call.packed:
        # packed rows run whole; returned states are plain array ops a sharded jit partitions
        return dispatch.run(*prepare.prepared(call, operands), **look)
    from gdngen import sharding

    call, operands = prepare.prepared(
        call, operands, compute_gate=not sharding.fuses_gate(call.context_axis))
    names = ("q", "k", "v", "g", "beta", "initial_state", "mask", *sharding.PARAMETERS)
    whole = sharding.whole({n: getattr(operands, n) for n in names})
    if call.conv_size is not None:
        if whole:
            names += ("conv_weight", "conv_state")  # the backend convolves
        else:  # the conv's channels are not laid out by heads: convolved before the shards
            call, operands = prepare.convolved(call, operands)
    normed = None
    if call.norm_gate is not None:
        if whole:
            names += ("norm_weight", "output_gate")  # the backend normalises
        else:  # the norm after the shards (row-wise: it partitions as y does)
            normed, call = call, prepare.without_norm(call, operands)[0]

    def one_call(q, k, v, g, beta, initial_state, mask, A_log=None, dt_bias=None,
                 conv_weight=None, conv_state=None, norm_weight=None, output_gate=None):
        shard = Operands(q, k, v, g, beta, initial_state, mask, A_log, dt_bias, None,
                         conv_weight, conv_state, norm_weight, output_gate)
        return dispatch.run(call.for_arrays(q, v), shard, **look)

    arrays = {name: getattr(operands, name) for name in names}
    y, states = sharding.run(one_call, arrays, call.shape, context_axis=call.context_axis)
    if normed is not None:
        y = prepare.normed(normed, operands, y)
    return y, states


# ------------------------------------------------------------------------------ load_tuned


class TunedGatedDelta:
    """``gated_delta`` for one framework, device and precision policy: per call, the tuned
    variant of the call's shape class and T bucket (else the default variant), through the
    one entry body (`body`: pools, sharding and every option as the plain call)."""

    def __init__(self, framework: str, device: str, precision: str):
        self.framework, self.device, self.precision = framework, device, precision

    def __repr__(self) -> str:
        return (f"TunedGatedDelta(framework={self.framework!r}, device={self.device!r}, "
                f"precision={self.precision!r})")

    def __call__(self, q, k, v, g, beta, initial_state=None, **options):
        """Same contract as `gdngen.jax.gated_delta` / `gdngen.mlx.gated_delta`."""
        arrays, options = _split_call(q, k, v, g, beta, initial_state, options)
        return body(self.framework, arrays, options, device=self.device,
                           precision=self.precision)

    def explain(self, q, k, v, g, beta, initial_state=None, **options) -> dispatch.Choice:
        """Which variant a call with these arguments (every option of `__call__`) runs, and
        why (`str()` it to read)."""
        arrays, options = _split_call(q, k, v, g, beta, initial_state, options)
        call = bind(self.framework, arrays, options).call
        shape = call.shape
        choice = dispatch.decide(self.framework, shape, call.dtype, options.variant,
                                 options.chunk_size, device=self.device,
                                 precision=self.precision)
        choice = choice.for_length(shape.T, shape.vector_gate, shape.sequences)
        backend = registry.get(choice.variant.backend)
        if call.conv_size is not None:
            choice = dataclasses.replace(choice, conv_path="the causal conv " + backend.conv_path(
                call, choice.variant))
        if call.norm_gate is None:
            return choice
        where = ("in the kernels' stores when not differentiated (their norm build), after them "
                 "when differentiated" if backend.norm_in_stores(call, choice.variant)
                 else "after the kernels")
        return dataclasses.replace(choice, norm_path=f"the output's gated norm {where}")


def _split_call(q, k, v, g, beta, initial_state, options: dict) -> tuple[dict, Options]:
    return Options.split(dict(options, q=q, k=k, v=v, g=g, beta=beta,
                              initial_state=initial_state))


def load_tuned(framework: str = "jax", device: str | None = None,
               precision: str = "ieee") -> TunedGatedDelta:
    """A callable with the ``gated_delta`` signature dispatching each call to its tuned variant.

    ``device`` defaults to the attached one; naming a device that is not attached is a
    ValueError (saying what was found). ``precision``: "ieee" | "tf32" | "bf16", the policy the
    entries were tuned under (JAX applies it with ``jax.default_matmul_precision``; MLX's
    portable backend stays float32 under every policy).
    """
    from gdngen import devices
    from gdngen.precision import check_precision

    check_precision(framework, precision)
    device = devices.detect(framework) if device is None \
        else devices.require_attached(device, framework).name
    return TunedGatedDelta(framework, device, precision)
