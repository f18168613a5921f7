"""Many chips: `gdngen.jax.gated_delta` under ``jax.shard_map``, under a sharded ``jax.jit``, and
context-parallel over a sequence axis. JAX only (imported by `gdngen.jax`).

How a call runs (`run`):

- **Inside** ``jax.shard_map`` (every mesh axis manual): each shard runs its own call on its own
  batch rows and GVA groups. The arrays are first made varying over the same manual axes
  (`match_manual_axes`, ``jax.lax.pcast``), so the backends' custom VJPs and their kernels'
  output types agree under ``check_vma=True``, and a ``None`` initial state is a zero state of
  that type.
- ``context_axis=name`` inside shard_map: `context_parallel` (time split in order over ``name``).
- **Outside** shard_map on a host with several devices: `partitioned`. The forward and the
  backward are each a ``jax.experimental.custom_partitioning`` op with a Shardy sharding rule
  (batch ``b``, key heads ``k``, GVA group ``r``: value heads are the compound ``(k r)``), so
  under a ``jax.jit`` whose inputs are sharded over batch and/or heads each device runs the
  kernels on its own shard and nothing is gathered. The backward op re-runs the shard's forward
  (its residuals stay inside the op), so a sharded-jit step costs one more forward per shard than
  the same step inside ``jax.shard_map``.
- One device (or ``GDNGEN_NO_PARTITIONING=1``): the plain call.
"""

from __future__ import annotations

import math
import types

from gdngen import jaxcompat, settings

# `import gdngen.jax` (which imports this module) fails here on an unsupported jax
jaxcompat.require()

#: the roles of each argument's dims: b batch, t time, h heads (key heads for q/k, value heads
#: for the rest), d a head dim
ROLES = {"q": "bthd", "k": "bthd", "v": "bthd", "g": "bth", "g_vector": "bthd", "beta": "bth",
         "initial_state": "bhdd", "mask": "bt", "y": "bthd", "final_state": "bhdd",
         "A_log": "h", "dt_bias": "h", "A_log_vector": "hd", "dt_bias_vector": "hd"}
#: Shardy factors of each argument (k key heads, r the GVA group, d = Dk, e = Dv)
FACTORS = {"q": "b t k d", "k": "b t k d", "v": "b t (k r) e", "g": "b t (k r)",
           "g_vector": "b t (k r) d", "beta": "b t (k r)", "initial_state": "b (k r) e d",
           "mask": "b t", "y": "b t (k r) e", "final_state": "b (k r) e d",
           "A_log": "(k r)", "dt_bias": "(k r)", "A_log_vector": "(k r) d",
           "dt_bias_vector": "(k r) d"}
DIFFERENTIABLE = ("q", "k", "v", "g", "beta", "initial_state", "A_log", "dt_bias")
#: a parameterised gate's parameters (`gdngen.algebra.layer_inputs.ParameterGate`): operands of
#: their
# own
#: (the value heads' entries, no batch axis), so the chunk core computes the log gate per shard
PARAMETERS = ("A_log", "dt_bias")


# ------------------------------------------------------------------------------ manual axes


def manual_axes() -> frozenset:
    """The mesh axes of an enclosing ``jax.shard_map`` (empty outside one)."""
    import jax

    return frozenset(jax.sharding.get_abstract_mesh().manual_axes)


def varying(x) -> frozenset:
    """The manual mesh axes ``x`` varies over (empty outside shard_map)."""
    return jaxcompat.varying_axes(x)


def vary(x, axes):
    """``x`` made varying over ``axes`` too (``jax.lax.pcast``; a no-op when it already is)."""
    import jax

    missing = tuple(sorted(frozenset(axes) - varying(x)))
    return jax.lax.pcast(x, missing, to="varying") if missing else x


def match_manual_axes(*arrays):
    """``arrays`` (None kept) all varying over the union of the axes any of them varies over: a
    custom VJP's cotangents and a kernel's outputs then have the primals' type."""
    axes = frozenset().union(*(varying(x) for x in arrays if x is not None))
    return tuple(None if x is None else vary(x, axes) for x in arrays)


# ------------------------------------------------------------------------------ dispatch


def run(call, arrays: dict, shape, *, context_axis):
    """``(y, final_state)`` of ``call(**arrays)`` (one shard's backend call,
    `gdngen.entry.placed`),
    placed as the module docstring says. ``arrays``: q, k, v, g, beta, initial_state (None:
    zeros), mask (None: none), and A_log, dt_bias (None unless g is a parameterised gate's raw
    projection, `fuses_gate`; per-channel ``[Hv, 1 or Dk]``); ``shape`` the checked
    `CallShape`."""
    axes = manual_axes()
    if context_axis is not None:
        if context_axis not in axes:
            raise ValueError(f"context_axis={context_axis!r} is not a manual axis here: call "
                             "gated_delta inside jax.shard_map over a mesh with that axis "
                             f"(manual axes here: {sorted(axes) or 'none'})")
        return context_parallel(call, arrays, shape, axis=context_axis)
    if axes:
        return per_shard(call, arrays)
    if not whole(arrays):
        arrays = _whole_parameters(arrays, shape)
        known = known_shardings(arrays, shape)
        if known:
            mesh = next(iter(known.values())).sharding.mesh
            batch, heads = _layout(known, mesh, shape)  # a ValueError here, before compiling
            if _explicit(mesh, batch + heads):
                return explicit_shard_map(call, arrays, shape, mesh, batch, heads)
        return partitioned(call, arrays, shape)
    return call(**arrays)


def whole(arrays: dict) -> bool:
    """Whether `run` (no ``context_axis``) calls ``call(**arrays)`` as it is: outside
    ``jax.shard_map``, on one device or with partitioning off."""
    return not manual_axes() and (settings.flag(settings.ENV_NO_PARTITIONING)
                                  or _on_one_device(arrays))


def fuses_gate(context_axis) -> bool:
    """Whether a parameterised gate travels to the backend as its raw projection and
    parameters (`gdngen.prepare.prepared`), its log gate computed in
    the chunk core: on every path of `run` but `context_parallel` (which gets the log gate, split
    over time like g)."""
    return context_axis is None


def _whole_parameters(arrays: dict, shape) -> dict:
    """``arrays`` with per-channel gate parameters ``[Hv, 1]`` broadcast to ``[Hv, Dk]`` (one
    Shardy factor per dim: `FACTORS`); their gradient sums back over the broadcast."""
    import jax.numpy as jnp

    if not shape.vector_gate or arrays.get("A_log") is None:
        return arrays
    return dict(arrays, **{n: jnp.broadcast_to(arrays[n], (shape.Hv, shape.Dk))
                           for n in PARAMETERS})


def _on_one_device(arrays: dict) -> bool:
    """Whether the call runs on a single device, so no partitioner will see it: every concrete
    array lives on one device, and every traced one carries a one-device mesh in its type
    (under a ``jax.jit`` whose inputs have a sharding: the mesh of those inputs, which may be
    a compile-only topology's, not this host's devices). A traced array without a mesh in its
    type falls back to this host's device count."""
    import jax

    present = [x for x in arrays.values() if x is not None]
    for x in present:
        if isinstance(x, jax.core.Tracer):
            mesh = getattr(jaxcompat.typeof(x).sharding, "mesh", None)
            if mesh is None or mesh.empty:
                if jax.device_count() > 1:
                    return False
            elif mesh.size > 1:
                return False
        elif hasattr(x, "sharding") and len(x.sharding.device_set) > 1:
            return False
    return True


def per_shard(call, arrays: dict):
    """``call(**arrays)`` inside shard_map: the arrays made varying over the same manual axes
    and a None initial state a zero state of that type."""
    import jax.numpy as jnp

    arrays = dict(zip(arrays, match_manual_axes(*arrays.values())))
    if arrays["initial_state"] is None:
        q, v = arrays["q"], arrays["v"]
        zeros = jnp.zeros((q.shape[0], v.shape[2], v.shape[3], q.shape[3]), jnp.float32)
        arrays["initial_state"] = vary(zeros, varying(q))
    return call(**arrays)


# ------------------------------------------------------------------------------ sharded jit


def _dim_axes(entry) -> tuple:
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, tuple) else (entry,)


def _spec_of(sharding, ndim: int) -> tuple:
    spec = tuple(getattr(sharding, "spec", ()))
    return tuple(_dim_axes(e) for e in spec + (None,) * (ndim - len(spec)))


def _layout(shapes: dict, mesh, shape) -> tuple[tuple, tuple]:
    """``(batch axes, head axes)`` the shards run with, from the operands' shardings; ValueError
    naming the argument for a sharded time or head dim, or head sharding that splits a GVA
    group."""
    from jax.sharding import PartitionSpec

    specs = {name: _spec_of(s.sharding, len(s.shape)) for name, s in shapes.items()}
    for name, spec in specs.items():
        for role, axes in zip(ROLES[name], spec):
            if axes and role in "td":
                what = "time" if role == "t" else "head-dim"
                hint = ("split time with context_axis inside jax.shard_map" if role == "t" else
                        "only batch and head axes can be sharded")
                raise ValueError(f"{_public(name)} is sharded as {PartitionSpec(*spec)}: its "
                                 f"{what} axis is sharded ({hint})")

    def chosen(role, order):
        for name in order:
            if name in specs and role in ROLES[name]:
                axes = specs[name][ROLES[name].index(role)]
                if axes:
                    return name, axes
        return None, ()

    _, batch = chosen("b", specs)
    heads_from, heads = chosen("h", ("v", "g", "g_vector", "beta", "initial_state", "y",
                                     "final_state", "q", "k"))
    if heads:
        sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
        n = math.prod(sizes[a] for a in heads)
        if shape.Hk % n:
            spec = PartitionSpec(*specs[heads_from])
            raise ValueError(
                f"{_public(heads_from)} is sharded as {spec}: its head axis is split into {n} "
                f"shards, but each shard must hold whole GVA groups (Hk={shape.Hk} key heads, "
                f"{shape.group} value heads each); shard heads over mesh axes whose sizes "
                f"multiply to a divisor of {shape.Hk}")
    return batch, heads


def known_shardings(arrays: dict, shape) -> dict:
    """The shardings known before compilation, per operand name: those of concrete arrays and
    the explicit mesh axes of traced ones (under a jit over auto axes the partitioner sees them
    first, and `_layout`'s error reaches the caller through the compiler)."""
    import jax
    from jax.sharding import NamedSharding

    known = {}
    for name, x in zip(_operand_names(arrays, shape), (x for x in arrays.values()
                                                       if x is not None)):
        sharding = jaxcompat.typeof(x).sharding if isinstance(x, jax.core.Tracer) else \
            getattr(x, "sharding", None)
        if isinstance(sharding, NamedSharding) and not sharding.mesh.empty:
            known[name] = types.SimpleNamespace(shape=x.shape, sharding=sharding)
    return known


def _explicit(mesh, axes) -> bool:
    from jax.sharding import AxisType

    kinds = dict(zip(mesh.axis_names, mesh.axis_types))
    return any(kinds[a] == AxisType.Explicit for a in axes)


def explicit_shard_map(call, arrays: dict, shape, mesh, batch: tuple, heads: tuple):
    """The call over a mesh with explicit axes (shardings in the types): a ``jax.shard_map`` of
    `per_shard` over batch and heads, each operand resharded (``jax.sharding.reshard``, a no-op
    when it already is) to the layout `_layout` chose."""
    import jax

    present = {n: x for n, x in arrays.items() if x is not None}
    names = _operand_names(arrays, shape)
    specs = tuple(_sharding(mesh, n, batch, heads).spec for n in names)
    operands = tuple(jax.sharding.reshard(x, spec) for x, spec in zip(present.values(), specs))

    def local(*operands):
        return per_shard(call, dict(arrays, **dict(zip(present, operands))))

    out_specs = tuple(_sharding(mesh, n, batch, heads).spec for n in ("y", "final_state"))
    return jaxcompat.shard_map(local, mesh=mesh, in_specs=specs, out_specs=out_specs)(*operands)


def _public(name: str) -> str:
    return {"g_vector": "g", "y": "y (cotangent)", "final_state": "final_state (cotangent)"}.get(
        name, name)


def _sharding(mesh, name: str, batch: tuple, heads: tuple):
    from jax.sharding import NamedSharding, PartitionSpec

    def entry(role):
        axes = {"b": batch, "h": heads}.get(role, ())
        return None if not axes else axes[0] if len(axes) == 1 else axes

    return NamedSharding(mesh, PartitionSpec(*(entry(r) for r in ROLES[name])))


def _op(fun, operand_names: tuple, result_names: tuple, shape):
    """``fun`` as a custom_partitioning op over named operands/results (`FACTORS`)."""
    import jax

    op = jaxcompat.custom_partitioning(fun)
    # a result without a batch axis (a gate parameter's gradient) is a sum over the batch rows
    over_rows = tuple("b" not in ROLES[n] for n in result_names)

    def partition(mesh, arg_shapes, result_shape):
        batch, heads = _layout(dict(zip(operand_names, arg_shapes)), mesh, shape)
        args = tuple(_sharding(mesh, n, batch, heads) for n in operand_names)
        results = tuple(_sharding(mesh, n, batch, heads) for n in result_names)
        if not (batch and any(over_rows)):
            return mesh, fun, results, args

        def summed_over_batch_shards(*operands):
            return tuple(jax.lax.psum(x, batch) if rows else x
                         for x, rows in zip(fun(*operands), over_rows))

        return mesh, summed_over_batch_shards, results, args

    rule = ", ".join(FACTORS[n] for n in operand_names) + " -> " + \
        ", ".join(FACTORS[n] for n in result_names)
    # Shardy takes no compound factor with a factor of size 1: Hk = Hv, or one key head (every
    # value head reads it; its head axis stays whole)
    if shape.group == 1:
        op.def_partition(partition, sharding_rule=rule.replace("(k r)", "k"))
    elif shape.Hk == 1:
        op.def_partition(partition, sharding_rule=rule.replace("(k r)", "r"))
    else:
        op.def_partition(partition, sharding_rule=rule, r=shape.group)
    return op


def _vmap_into_batch(op, operand_names: tuple, result_names: tuple):
    """``op`` (every operand and result but a gate's parameters and their gradients with the
    batch axis first) under ``jax.vmap``: the mapped axis is folded into the batch axis, whose
    rows are independent (custom_partitioning has no batching rule of its own). What cannot
    fold, parameters mapped too (a gate per mapped row) or their gradients (one per mapped row,
    not their sum), runs the rows one after another (``jax.lax.map``)."""
    import jax
    import jax.numpy as jnp
    from jax.custom_batching import custom_vmap

    has_batch = tuple("b" in ROLES[n] for n in operand_names)
    results_fold = all("b" in ROLES[n] for n in result_names)
    batched_op = custom_vmap(lambda *operands: op(*operands))

    @batched_op.def_vmap
    def rule(axis_size, in_batched, *operands):
        def mapped(x, is_mapped):
            return x if is_mapped else jnp.broadcast_to(x, (axis_size,) + x.shape)

        mapped_parameter = any(m and not b for m, b in zip(in_batched, has_batch))
        if mapped_parameter or not results_fold:
            results = jax.lax.map(lambda xs: op(*xs), tuple(map(mapped, operands, in_batched)))
        else:  # the mapped axis folded into each batched operand's batch axis
            results = op(*(mapped(x, m).reshape((-1,) + x.shape[1 + m:]) if b else x
                           for x, m, b in zip(operands, in_batched, has_batch)))
            results = tuple(x.reshape((axis_size, -1) + x.shape[1:]) for x in results)
        return tuple(results), tuple(True for _ in results)

    return batched_op


def _operand_names(arrays: dict, shape) -> tuple:
    names = []
    for name, x in arrays.items():
        if x is not None:
            per_channel = shape.vector_gate and name in ("g",) + PARAMETERS
            names.append(f"{name}_vector" if per_channel else name)
    return tuple(names)


def partitioned(call, arrays: dict, shape):
    """``call(**arrays)`` with its forward and backward each a custom_partitioning op, so a
    sharded jit runs them per shard (see the module docstring); ``jax.custom_vjp`` joins them."""
    import jax

    present = {n: x for n, x in arrays.items() if x is not None}
    names = _operand_names(arrays, shape)
    keys = tuple(present)
    float_keys = tuple(n for n in keys if n in DIFFERENTIABLE)
    grad_names = tuple(n for n, key in zip(names, keys) if key in DIFFERENTIABLE)

    def local(*operands):
        return tuple(call(**dict(arrays, **dict(zip(keys, operands)))))

    def local_backward(*operands):
        primals, (dy, dS) = operands[:-2], operands[-2:]
        bound = dict(zip(keys, primals))

        def of_floats(*floats):
            return local(*(dict(bound, **dict(zip(float_keys, floats)))[n] for n in keys))

        _, vjp = jax.vjp(of_floats, *(bound[n] for n in float_keys))
        return vjp((dy, dS))

    forward = _vmap_into_batch(_op(local, names, ("y", "final_state"), shape), names,
                               ("y", "final_state"))
    backward = _vmap_into_batch(_op(local_backward, names + ("y", "final_state"), grad_names,
                                    shape), names + ("y", "final_state"), grad_names)

    @jax.custom_vjp
    def op(*operands):
        return forward(*operands)

    def op_fwd(*operands):
        return forward(*operands), operands

    def op_bwd(operands, cotangents):
        grads = iter(backward(*operands, *cotangents))
        return tuple(next(grads) if key in DIFFERENTIABLE else None for key in keys)

    op.defvjp(op_fwd, op_bwd)
    return op(*present.values())


# ------------------------------------------------------------------------------ context parallel


def context_parallel(call, arrays: dict, shape, *, axis: str):
    """``(y, final_state)`` with time split in order over the manual mesh axis ``axis``.

    Over a segment the recurrence is affine in its entering state, ``S_out = S_in M + N`` (rows
    of S evolve independently), so one local call on value rows extended by Dk rows of zeros,
    entering ``[0; I]``, gives ``N`` and ``M`` as its final state and, as its outputs, ``y0``
    (the outputs from a zero state) and ``yI = scale M_{<=t} q_t``; then
    ``y_t = y0_t + S_in yI_t``. The shards' ``(M, N)`` are all-gathered (invariant over
    ``axis``: O(P Hv Dk (Dk+Dv)) words, independent of T) and folded locally in order from the
    initial state, which gives every shard its entering state and the final state. The
    backward is JAX's transpose of the same steps (the gather transposes to a slice, the fold
    runs in reverse). Transitions stay float32; the local call keeps every decay rule.
    """
    import jax
    import jax.numpy as jnp

    q, k, v, g, beta, S0, mask = (arrays[n] for n in ("q", "k", "v", "g", "beta",
                                                      "initial_state", "mask"))
    B, Hv, Dv, Dk = shape.B, shape.Hv, shape.Dv, shape.Dk
    f32 = jnp.float32
    (q, k, v, g, beta, mask) = match_manual_axes(q, k, v, g, beta, mask)
    local_axes = varying(q)
    v_ext = jnp.concatenate([v, jnp.zeros(v.shape[:-1] + (Dk,), v.dtype)], axis=-1)
    S_ext = jnp.concatenate([jnp.zeros((B, Hv, Dv, Dk), f32),
                             jnp.broadcast_to(jnp.eye(Dk, dtype=f32), (B, Hv, Dk, Dk))], axis=-2)
    y_ext, final_ext = call(q=q, k=k, v=v_ext, g=g, beta=beta,
                            initial_state=vary(S_ext, local_axes), mask=mask)
    y0, yI = y_ext[..., :Dv].astype(f32), y_ext[..., Dv:].astype(f32)
    N, M = final_ext[:, :, :Dv], final_ext[:, :, Dv:]          # [B,Hv,Dv,Dk], [B,Hv,Dk,Dk]
    # With check_vma the gathered transitions are invariant over the axis (their transpose is
    # a slice after JAX's psum of the varying uses); without it JAX tracks no such types, and
    # the varying gather's transpose (a reduce-scatter) does the summing.
    to = "invarying" if axis in local_axes else "varying"
    Ms = jax.lax.all_gather(M, axis, to=to)                     # [P,B,Hv,Dk,Dk]
    Ns = jax.lax.all_gather(N, axis, to=to)                     # [P,B,Hv,Dv,Dk]
    S = jnp.zeros((B, Hv, Dv, Dk), f32) if S0 is None else S0.astype(f32)
    entering = []
    with jax.default_matmul_precision("highest"):
        for i in range(Ms.shape[0]):
            entering.append(S)
            S = jnp.einsum("bhvj,bhjk->bhvk", S, Ms[i]) + Ns[i]
        S_in = jnp.stack(entering)[jax.lax.axis_index(axis)]     # [B,Hv,Dv,Dk]
        y = y0 + jnp.einsum("bhvk,bthk->bthv", S_in, yI)
    return y.astype(q.dtype), S
