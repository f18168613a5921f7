"""XLA backend: the portable chunkwise gated delta rule in jax.numpy (any JAX device).

Scalar and per-channel gates (and masks) take the chunkwise path of `gdngen.algebra.chunkwise` /
`gdngen.algebra.chunkwise_channel`, whose hand-derived backward (recomputation, straddle-sum gate
rule) is wired in with ``jax.custom_vjp``. `sequential_gated_delta`, a float32 ``lax.scan``
recurrence, is the benchmark baseline.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from gdngen.algebra import (
    chunkwise,
    kinds,
    layer_inputs,
    namespaces,
    packed,
    recurrent,
)

#: the float32 dtype and zeros of this framework (`gdngen.backends.portable.run_call`)
FLOAT32 = jnp.float32
zeros = jnp.zeros


class XP(namespaces.ArrayNamespace):
    """The array namespace `gdngen.algebra.chunkwise` expects, over jax.numpy (float32)."""

    module = jnp

    @staticmethod
    def cumsum(x, axis, reverse=False):
        # a parallel prefix: XLA:CPU lowers lax.cumsum to a slow blocked reduce-window
        return jax.lax.associative_scan(jnp.add, x, reverse=reverse, axis=axis % x.ndim)

    @staticmethod
    def cumprod(x, axis, reverse=False):
        return jax.lax.associative_scan(jnp.multiply, x, reverse=reverse, axis=axis % x.ndim)

    @staticmethod
    def scan(f, carry, xs, reverse):
        return jax.lax.scan(f, carry, xs, reverse=reverse)

    @staticmethod
    def tril_mask(n, k):
        return np.tri(n, n, k, dtype=bool)

    @staticmethod
    def mul_sum(a, b, axis):
        # an einsum: XLA:CPU 0.10 crashes at run time on some multiply-then-reduce fusions
        # whose operand is a dot's output (a reduce over a non-minor axis)
        # (operands not broadcast: a size-1 axis facing a longer one is squeezed out)
        nd = max(a.ndim, b.ndim)
        a, b = (x.reshape((1,) * (nd - x.ndim) + x.shape) for x in (a, b))
        letters = "abcdefghijklmnopqrstuvwxyz"[:nd]

        def spec(x, other):
            drop = tuple(i for i in range(nd) if x.shape[i] == 1 < other.shape[i])
            return x.squeeze(drop), "".join(c for i, c in enumerate(letters) if i not in drop)

        (a, sa), (b, sb) = spec(a, b), spec(b, a)
        out = "".join(c for i, c in enumerate(letters) if i != axis % nd)
        return jnp.einsum(f"{sa},{sb}->{out}", a, b)

    @staticmethod
    def rsqrt(x):
        return jax.lax.rsqrt(x)

    sigmoid = staticmethod(jax.nn.sigmoid)

    @staticmethod
    def barrier(arrays):
        return jax.lax.optimization_barrier(arrays)


# ------------------------------------------------------------------ differentiable chunk core

#: traced under this, every matmul is a true float32 product (the precision is fixed in the
#: traced dots, their transposes included): the exact triangular inverse, the decay algebra and
#: the recurrence must not drop to the TF32 / bfloat16 passes GPUs and TPUs use by default.
FLOAT32_MATMULS = jax.default_matmul_precision("highest")


def _walk(walks, which):
    """The ``walk=`` keyword of `gdngen.algebra.chunkwise_channel`'s ``forward`` (``which`` 0) or
    ``backward`` (1) for the ``walks`` pair, none for the default walks."""
    return {} if walks is None else {"walk": walks[which]}


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8, 9, 10))
def chunk_core(q, k, v, gates, beta, S0, gate, solve_block, save_states, qk_scale=None,
               walks=None):
    """`gdngen.algebra.chunkwise.forward` in chunk layout -> (Y, S_final), with its hand-derived
    VJP.

    ``save_states``: keep the forward's residuals (per-chunk entering states, WY pseudo-values,
    triangular inverses) for the backward, or recompute them there (one more sequential pass,
    less memory). ``qk_scale`` (a float): q, k are the raw ones and the core L2-normalises
    them itself (`gdngen.algebra.layer_inputs.normalized_qk`, q then times ``qk_scale``), keeping
    the
    raw ones for its backward, which recomputes the normalised ones behind a barrier. ``gate`` a
    `gdngen.algebra.layer_inputs.ParameterGate`: ``gates`` is ``(a, A_log, dt_bias)`` and the log
    gate
    is computed here, likewise kept only as ``a``. ``walks``
    (per-channel gates only): ``(walk_forward, walk_backward)`` replacing
    `gdngen.algebra.chunkwise_channel`'s default chunk walks (a generated backend's kernels;
    hashable).
    """
    return _core_fwd(q, k, v, gates, beta, S0, gate, solve_block, False, qk_scale, walks)[0]


def _core_fwd(q, k, v, gates, beta, S0, gate, solve_block, save_states, qk_scale, walks):
    primals = (q, k, v, gates, beta, S0)
    with FLOAT32_MATMULS:
        arrays, algebra_gate = layer_inputs.core_inputs(XP, primals, qk_scale, gate)
        Y, S_final, residuals = kinds.stages(arrays[3]).forward(
            XP, *arrays, gate=algebra_gate, solve_block=solve_block, **_walk(walks, 0))
    return (Y, S_final), (primals, residuals if save_states else None)


def _core_bwd(gate, solve_block, save_states, qk_scale, walks, saved, cotangents):
    primals, residuals = saved
    dY, dS_final = cotangents
    with FLOAT32_MATMULS:
        if layer_inputs.computes_layer_inputs(qk_scale is not None, gate):
            primals = XP.barrier(primals)
        arrays, algebra_gate = layer_inputs.core_inputs(XP, primals, qk_scale, gate)
        stages = kinds.stages(arrays[3])
        if residuals is None:
            residuals = stages.forward(XP, *arrays, gate=algebra_gate, solve_block=solve_block,
                                       **_walk(walks, 0))[2]
        q, k, v, gates, beta, _ = arrays
        cotangents = stages.backward(XP, q, k, v, gates, beta, residuals, dY, dS_final,
                                     gate=algebra_gate, **_walk(walks, 1))
        return layer_inputs.core_inputs_vjp(XP, primals, cotangents, qk_scale, gate)


chunk_core.defvjp(_core_fwd, _core_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8))
def packed_core(q, k, v, gates, beta, inject, gate, solve_block, save_states):
    """The chunk walk of a packed row (`gdngen.algebra.packed`) -> ``(Y, S_in)``: from a zero state,
    ``inject`` added to the state leaving each chunk, the entering states an output; its VJP is
    `gdngen.algebra.chunkwise.backward` with those two extra terms."""
    return _packed_fwd(q, k, v, gates, beta, inject, gate, solve_block, save_states)[0]


def _packed_fwd(q, k, v, gates, beta, inject, gate, solve_block, save_states):
    with FLOAT32_MATMULS:
        Y, _, residuals = kinds.stages(gates).forward(
            XP, q, k, v, gates, beta, jnp.zeros(inject.shape[1:], jnp.float32), gate=gate,
            solve_block=solve_block, inject=inject)
    return (Y, residuals[0]), (q, k, v, gates, beta, inject, residuals if save_states else None)


def _packed_bwd(gate, solve_block, save_states, saved, cotangents):
    q, k, v, gates, beta, inject, residuals = saved
    dY, dS_in = cotangents
    S0 = jnp.zeros(inject.shape[1:], jnp.float32)
    with FLOAT32_MATMULS:
        stages = kinds.stages(gates)
        if residuals is None:
            residuals = stages.forward(XP, q, k, v, gates, beta, S0, gate=gate,
                                       solve_block=solve_block, inject=inject)[2]
        dq, dk, dv, dgates, dbeta, _, dinject = stages.backward(
            XP, q, k, v, gates, beta, residuals, dY, S0, gate=gate, dS_in=dS_in)
    return dq, dk, dv, dgates, dbeta, dinject


packed_core.defvjp(_packed_fwd, _packed_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(8, 9, 10))
def packed_scalar_core(q, k, v, gates, beta, inject, chunk, row, gate, solve_block,
                       save_states):
    """`packed_core` for scalar gates that also extracts each sequence's final state in the walk
    (`gdngen.algebra.chunkwise.extract_states` at ``chunk``, ``row``) -> ``(Y, S_end)``; its VJP
    adds `gdngen.algebra.chunkwise.extract_states_vjp` to the walk's."""
    return _packed_scalar_fwd(q, k, v, gates, beta, inject, chunk, row, gate, solve_block,
                              save_states)[0]


def _packed_scalar_fwd(q, k, v, gates, beta, inject, chunk, row, gate, solve_block,
                       save_states):
    (Y, S_in), (*saved, residuals) = _packed_fwd(q, k, v, gates, beta, inject, gate,
                                                 solve_block, True)
    with FLOAT32_MATMULS:
        D = chunkwise._decay(XP, gates, gate)
        S_end = chunkwise.extract_states(XP, D, S_in, residuals[1], k, chunk, row)
    return (Y, S_end), (*saved, chunk, row, residuals if save_states else None)


def _packed_scalar_bwd(gate, solve_block, save_states, saved, cotangents):
    q, k, v, gates, beta, inject, chunk, row, residuals = saved
    dY, dS_end = cotangents
    S0 = jnp.zeros(inject.shape[1:], jnp.float32)
    with FLOAT32_MATMULS:
        if residuals is None:
            residuals = chunkwise.forward(XP, q, k, v, gates, beta, S0, gate=gate,
                                          solve_block=solve_block, inject=inject)[2]
        D = chunkwise._decay(XP, gates, gate)
        dS_in, ends = chunkwise.extract_states_vjp(XP, D, residuals[0], residuals[1], k, chunk,
                                                   row, dS_end, q.shape[0])
        dq, dk, dv, dgates, dbeta, _, dinject = chunkwise.backward(
            XP, q, k, v, gates, beta, residuals, dY, S0, gate=gate, dS_in=dS_in, ends=ends)
    return dq, dk, dv, dgates, dbeta, dinject, None, None


packed_scalar_core.defvjp(_packed_scalar_fwd, _packed_scalar_bwd)


# ------------------------------------------------------------------------------ paths


@functools.partial(jax.jit, static_argnames=("scale", "gate", "chunk_size", "solve_block",
                                             "save_states", "qk_norm", "walks"))
def chunkwise_gated_delta(q, k, v, g, beta, initial_state, mask, *, scale, gate, chunk_size,
                          solve_block=8, save_states=True, qk_norm=False, walks=None):
    """Chunkwise path, scalar or per-channel gates; float32 arrays, shapes as
    `gdngen.jax.gated_delta`.

    ``chunk_size``, ``solve_block``, ``save_states``: the params of an ``xla`` `Variant`.
    ``qk_norm``: q, k are raw and the chunk core normalises them (see `chunk_core`).
    ``walks``: per-channel gates' chunk walks (see `chunk_core`).
    """
    qk_scale = float(scale) if qk_norm else None

    def core(*arrays):
        return chunk_core(*arrays, gate, solve_block, save_states, qk_scale, walks)

    return chunkwise.whole_sequence(XP, core, q, k, v, g, beta, initial_state, mask,
                                 scale=1.0 if qk_norm else scale, gate=gate,
                                 chunk_size=chunk_size)


@functools.partial(jax.jit, static_argnames=("scale", "gate", "chunk_size", "solve_block",
                                             "save_states"))
def packed_gated_delta(q, k, v, g, beta, initial_state, mask, cu_seqlens, *, scale, gate,
                       chunk_size, solve_block=8, save_states=True):
    """Packed row (`gdngen.algebra.packed`): float32 arrays, q ``[1,T,Hk,Dk]``, ``initial_state
    [N,Hv,Dv,Dk]`` or None, ``cu_seqlens`` int32 ``[N+1]`` (may be traced). Params as
    `chunkwise_gated_delta`'s."""

    def core(*arrays):
        return chunk_core(*arrays, gate, solve_block, save_states)

    def dense(q, k, v, g, beta, S0, mask):
        return chunkwise.whole_sequence(XP, core, q, k, v, g, beta, S0, mask, scale=scale,
                                     gate=gate, chunk_size=chunk_size)

    if g.ndim == 3:
        def walk_core(*arrays):
            return packed_scalar_core(*arrays, gate, solve_block, save_states)
    else:
        def walk_core(*arrays):
            return packed_core(*arrays, gate, solve_block, save_states)

    walk = packed.chunk_walk(XP, walk_core, scale=scale, gate=gate, chunk_size=chunk_size,
                             extracts=g.ndim == 3)
    return packed.packed_row(XP, dense, walk, q, k, v, g, beta, initial_state, mask,
                              cu_seqlens, gate=gate, chunk_size=chunk_size)


@functools.partial(jax.jit, static_argnames=("scale", "gate"))
def sequential_gated_delta(q, k, v, g, beta, initial_state, mask=None, *, scale=1.0, gate="log"):
    """Per-step float32 ``lax.scan`` recurrence differentiated by autodiff (benchmark
    baseline)."""
    with FLOAT32_MATMULS:
        return recurrent.sequential_gated_delta(XP, q, k, v, g, beta, initial_state, mask,
                                                scale=scale, gate=gate)


@functools.partial(jax.jit, static_argnames=("scale", "gate", "steps"))
def recurrent_gated_delta(q, k, v, g, beta, initial_state, *, scale, gate, steps=False):
    """Forward of the recurrence one step at a time in a ``lax.scan``
    (`gdngen.algebra.recurrent.recurrent_forward`): float32 arrays in the API layout, masks folded
    into g and beta; scalar or per-channel gates. Returns ``(y [B,T,Hv,Dv], S_T)``; with
    ``steps`` every step's state ``[B,T,Hv,Dv,Dk]`` in place of S_T."""
    with FLOAT32_MATMULS:
        return recurrent.recurrent_forward(XP, q, k, v, g, beta, initial_state, scale=scale,
                                           gate=gate, steps=steps)


def recurrent_or_chunkwise(recurrent, chunkwise_call, single_step=False):
    """``f(q, k, v, g, beta, S0) -> (y, S_final)`` whose value is ``recurrent``'s and whose VJP
    is ``chunkwise_call``'s (a ``jax.custom_vjp``): a call that is only evaluated runs the
    recurrent kernel and keeps nothing for a backward; under ``jax.vjp`` / ``jax.grad`` the
    forward runs ``chunkwise_call`` (same function, chunk kernels) and its residuals serve the
    backward. Both take the same float32 arrays (masks already folded into g and beta).
    ``single_step`` (a call of T = 1) changes nothing here: jit compiles every call anyway."""

    @jax.custom_vjp
    def switched(*primals):
        return recurrent(*primals)

    def switched_fwd(*primals):
        # jax.vjp's function is a pytree (jax.tree_util.Partial) holding chunkwise's residuals
        return jax.vjp(chunkwise_call, *primals)

    def switched_bwd(chunkwise_vjp, cotangents):
        return chunkwise_vjp(cotangents)

    switched.defvjp(switched_fwd, switched_bwd)
    return switched
