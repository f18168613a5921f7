"""What the generated JAX backends (`ffi_cpu`, `pallas_tpu`, `pallas_gpu`) share: the custom-VJP
core of their chunk kernels (`custom_vjp_core`, with the q/k norm and a parameterised gate
computed in it), the result types of their kernel calls under ``jax.shard_map``, and the guard of
the per-channel walks (`refuse_injection`, Metal's too). The Pallas orchestration is
`gdngen.backends.pallas.core`."""

from __future__ import annotations

from gdngen.algebra import chunkwise

# ------------------------------------------------------------------------------ checks


def refuse_injection(backend: str, injected) -> None:
    """Guard of a generated backend's per-channel chunk walks: ValueError unless ``injected``
    (the walk's ``inject`` / ``dS_in``) is None; per-channel packed rows run on the portable
    path."""
    if injected is not None:
        raise ValueError(f"the {backend} per-channel chunk walks take no injected states "
                         "(per-channel packed rows run on the portable path)")


# ------------------------------------------------------------------------------ calling


def result_type(shape, dtype, like):
    """The ``jax.ShapeDtypeStruct`` of a kernel result (an ``ffi_call`` or ``pallas_call``
    output) that varies over the manual axes of an enclosing ``jax.shard_map`` as ``like``
    does, so that under ``check_vma=True`` the custom VJP's cotangents have its primals' type."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    aval = jax.typeof(like)
    if not aval.manual_axis_type.varying:
        return jax.ShapeDtypeStruct(shape, dtype)
    return jax.ShapeDtypeStruct(shape, dtype,
                                sharding=NamedSharding(aval.sharding.mesh, PartitionSpec()),
                                manual_axis_type=aval.manual_axis_type)


def l2_normalized(xp, x):
    """``x`` L2-normalised over its last axis in float32 and back in its own dtype: the fused
    ``qk_norm`` of a generated backend's chunk core (``xp`` the framework's namespace)."""
    return chunkwise.l2_normalize(xp, x.astype(xp.module.float32)).astype(x.dtype)


def l2_normalized_vjp(xp, x, dx):
    """Cotangent of the raw ``x`` of `l2_normalized` from ``dx``, in ``x``'s dtype."""
    f32 = xp.module.float32
    return chunkwise.l2_normalize_vjp(xp, x.astype(f32), dx.astype(f32)).astype(x.dtype)


def custom_vjp_core(forward, backward, qk_norm=False, gate=None, forward_fuses=False):
    """``core(q, k, v, gates, beta, S0)`` (chunk layout) as a ``jax.custom_vjp`` from
    ``forward(primals) -> (outputs, saved)`` and ``backward(primals, saved, cotangents) ->
    cotangents of the primals``.

    ``qk_norm``: the core takes the raw q, k and L2-normalises them (float32, back in their
    dtype) before ``forward``; it keeps the raw ones, and its backward recomputes the normalised
    ones behind an optimisation barrier (not merged with the forward's) and maps ``backward``'s
    dq, dk through the norm's VJP (`gdngen.algebra.chunkwise.l2_normalize_vjp`). For kernels whose
    ``saved`` holds no copy of q, k, so no normalised q, k outlive the forward. ``gate`` a
    `gdngen.algebra.chunkwise.ParameterGate`: ``gates`` is ``(a, A_log, dt_bias)``; the core
    computes the log gate for ``forward`` (built for log gates) the same way, keeps only ``a`` and
    maps the log gate's cotangent to the three (`gdngen.algebra.chunkwise.gates_vjp`).

    ``forward_fuses``: ``forward`` computes the norm and the log gate in its kernels' loads
    (`gdngen.backends.kernel_inputs`): it receives the raw primals (q, k raw, ``gates`` the
    ``(a, A_log, dt_bias)`` tuple); ``backward`` still receives the recomputed inputs.
    """
    import jax

    from gdngen.backends.portable.jax_chunkwise import XP

    recomputes = chunkwise.computes_layer_inputs(qk_norm, gate)

    def inputs(primals):
        q, k, v, gates, *rest = primals
        if qk_norm:
            q, k = l2_normalized(XP, q), l2_normalized(XP, k)
        return (q, k, v, chunkwise.log_gates(XP, gates, gate)[0], *rest)

    def forward_inputs(primals):
        return primals if forward_fuses else inputs(primals)

    @jax.custom_vjp
    def core(q, k, v, gates, beta, S0):
        return forward(forward_inputs((q, k, v, gates, beta, S0)))[0]

    def core_fwd(*primals):
        outputs, saved = forward(forward_inputs(primals))
        return outputs, (primals, saved)

    def core_bwd(residuals, cotangents):
        primals, saved = residuals
        if not recomputes:
            return backward(primals, saved, cotangents)
        primals = XP.barrier(primals)
        dq, dk, dv, dgates, *rest = backward(inputs(primals), saved, cotangents)
        q, k, _, gates, *_ = primals
        if qk_norm:
            dq, dk = l2_normalized_vjp(XP, q, dq), l2_normalized_vjp(XP, k, dk)
        return dq, dk, dv, chunkwise.gates_vjp(XP, gates, gate, dgates), *rest

    core.defvjp(core_fwd, core_bwd)
    return core