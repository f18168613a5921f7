"""MLX backend: the portable chunkwise gated delta rule in mlx.core (any MLX device).

Scalar and per-channel gates (and masks) take `gdngen.algebra.chunkwise` /
`gdngen.algebra.chunkwise_channel` with their hand-derived backward wired in through
``mx.custom_function``.
"""

from __future__ import annotations

import contextlib
import functools

import mlx.core as mx
import numpy as np

from gdngen.algebra import (
    chunkwise,
    chunkwise_channel,
    kinds,
    layer_inputs,
    namespaces,
    packed,
    recurrent,
)

#: MLX's matmuls are float32 at every precision policy: nothing to set around them
FLOAT32_MATMULS = contextlib.nullcontext()

#: the float32 dtype and zeros of this framework (`gdngen.backends.portable.run_call`)
FLOAT32 = mx.float32
zeros = mx.zeros


class XP(namespaces.ArrayNamespace):
    """The array namespace `gdngen.algebra.chunkwise` expects, over mlx.core (float32)."""

    module = mx

    @staticmethod
    def cumsum(x, axis, reverse=False):
        return mx.cumsum(x, axis=axis, reverse=reverse)

    @staticmethod
    def cumprod(x, axis, reverse=False):
        return mx.cumprod(x, axis=axis, reverse=reverse)

    @staticmethod
    def scan(f, carry, xs, reverse):
        """lax.scan semantics over the leading axis of every array in the tuple ``xs``; ``f``
        returns ``(carry, out)`` with out an array or a tuple of arrays."""
        n = xs[0].shape[0]
        order = range(n - 1, -1, -1) if reverse else range(n)
        outs = [None] * n
        for i in order:
            carry, outs[i] = f(carry, tuple(x[i] for x in xs))
        if isinstance(outs[0], tuple):
            return carry, tuple(mx.stack(list(parts)) for parts in zip(*outs))
        return carry, mx.stack(outs)

    @staticmethod
    def tril_mask(n, k):
        return mx.array(np.tri(n, n, k, dtype=bool))

    @staticmethod
    def rsqrt(x):
        return mx.rsqrt(x)

    sigmoid = staticmethod(mx.sigmoid)

    @classmethod
    @functools.cache
    def compiled(cls, step):
        """``step`` bound to this namespace under ``mx.compile``: its elementwise ops fused into
        one kernel per call shape (compiled once per shape; where MLX finds no compiler it runs
        the ops unfused). Measured (MLX 0.32 CPU, Qwen3-Next heads, forward at T=1): 1.24 ms
        against 1.34 ms for the same ops eagerly."""
        return mx.compile(functools.partial(step, cls))

    @staticmethod
    def dot_last(a, b):
        """``(a * b).sum(-1)``, a last axis of n = 16 m > 16 summed as m sums of 16 then their
        sum: MLX CPU's reduction over one long contiguous axis is the slower. Measured (MLX
        0.32 CPU, recurrent forward at Qwen3-Next heads Hv=32, D=128, against mlx-lm's
        ``gated_delta_ops``): T=1 1.20-1.35x with it, 0.94-0.99x with one sum; T=16 1.28x
        against 1.07x."""
        p = a * b
        n = p.shape[-1]
        if n <= DOT_BLOCK or n % DOT_BLOCK:
            return p.sum(axis=-1)
        return p.reshape(*p.shape[:-1], n // DOT_BLOCK, DOT_BLOCK).sum(axis=-1).sum(axis=-1)


#: the inner block of `XP.dot_last`'s split sum (8 x 16 at D = 128 measured fastest of 2..64)
DOT_BLOCK = 16

#: chunks per group of the per-channel backward's chunk-local stages
#: (`gdngen.algebra.chunkwise_channel.by_chunk_groups`). Measured, MLX CPU, fwd+bwd with every
# gradient,
#: T=2048, Hk=4, Hv=8, D=128, chunk 32: peak 665 MiB at once, 298 MiB in groups of 8 (267 MiB
#: in groups of 4, ~20% slower), time unchanged within the machine's noise
CHUNK_GROUP = 8


def _grouped(stages):
    """The backward's grouping keyword for ``stages`` (per-channel only)."""
    return {"chunk_group": CHUNK_GROUP} if stages is chunkwise_channel else {}


@functools.cache
def chunk_core(gate, solve_block, save_states, walks=None, qk_scale=None):
    """`gdngen.algebra.chunkwise.forward` in chunk layout as an ``mx.custom_function`` with its VJP.

    The core returns ``(Y, S_final, *residuals)``. With ``save_states`` the backward reads the
    forward's residuals (per-chunk entering states, WY pseudo-values, triangular inverses) from
    its outputs; otherwise it recomputes them. ``walks``: None, or for per-channel gates a pair
    ``(walk_forward, walk_backward)`` with the contracts of `gdngen.algebra.chunkwise_channel`'s
    defaults (a generated backend's walk kernels, `gdngen.backends.metal.ChannelWalks`), passed
    as its ``walk`` to every forward and backward. ``qk_scale`` (a float): q, k are the raw
    ones and the core L2-normalises them (`gdngen.algebra.layer_inputs.normalized_qk`, q then times
    ``qk_scale``); its backward recomputes the normalised ones from the raw q, k (no
    normalised copy outlives the forward) and returns the raw ones' cotangents. ``gate`` a
    `gdngen.algebra.layer_inputs.ParameterGate`: ``gates`` is ``(a, A_log, dt_bias)``, the log gate
    is
    computed here and recomputed in the backward the same way.
    """
    fwd, bwd = ({}, {}) if walks is None else ({"walk": walks[0]}, {"walk": walks[1]})

    @mx.custom_function
    def core(*primals):
        arrays, algebra_gate = layer_inputs.core_inputs(XP, primals, qk_scale, gate)
        Y, S_final, residuals = kinds.stages(arrays[3]).forward(
            XP, *arrays, gate=algebra_gate, solve_block=solve_block, **fwd)
        return (Y, S_final, *residuals)

    @core.vjp
    def core_vjp(primals, cotangents, outputs):
        arrays, algebra_gate = layer_inputs.core_inputs(XP, primals, qk_scale, gate)
        stages = kinds.stages(arrays[3])
        if save_states:
            residuals = tuple(outputs[2:])
        else:
            residuals = stages.forward(XP, *arrays, gate=algebra_gate, solve_block=solve_block,
                                       **fwd)[2]
        q, k, v, gates, beta, _ = arrays
        dY, dS_final = cotangents[0], cotangents[1]
        grads = stages.backward(XP, q, k, v, gates, beta, residuals, dY, dS_final,
                                gate=algebra_gate, **bwd, **_grouped(stages))
        return layer_inputs.core_inputs_vjp(XP, primals, grads, qk_scale, gate)

    return core


@functools.cache
def packed_core(gate, solve_block, save_states):
    """The chunk walk of a packed row (`gdngen.algebra.packed`) as an ``mx.custom_function``:
    ``(q, k, v, gates, beta, inject) -> (Y, S_in, *other residuals)``, from a zero state,
    ``inject`` added to the state leaving each chunk, the entering states S_in an output with
    a cotangent of their own (`gdngen.algebra.chunkwise.backward`'s ``dS_in``)."""

    def run(q, k, v, gates, beta, inject):
        return kinds.stages(gates).forward(
            XP, q, k, v, gates, beta, mx.zeros(inject.shape[1:]), gate=gate,
            solve_block=solve_block, inject=inject)

    @mx.custom_function
    def core(q, k, v, gates, beta, inject):
        Y, _, residuals = run(q, k, v, gates, beta, inject)
        return (Y, *residuals)

    @core.vjp
    def core_vjp(primals, cotangents, outputs):
        q, k, v, gates, beta, inject = primals
        residuals = tuple(outputs[1:]) if save_states else run(*primals)[2]
        dq, dk, dv, dgates, dbeta, _, dinject = kinds.stages(gates).backward(
            XP, q, k, v, gates, beta, residuals, cotangents[0], mx.zeros(inject.shape[1:]),
            gate=gate, dS_in=cotangents[1], **_grouped(kinds.stages(gates)))
        return dq, dk, dv, dgates, dbeta, dinject

    return core


@functools.cache
def packed_scalar_core(gate, solve_block, save_states):
    """`packed_core` for scalar gates that also extracts each sequence's final state in the walk
    (`gdngen.algebra.chunkwise.extract_states`): ``(q, k, v, gates, beta, inject, chunk, row) -> (Y,
    S_end, *residuals)``; its VJP adds `gdngen.algebra.chunkwise.extract_states_vjp` to the
    walk's."""

    def run(q, k, v, gates, beta, inject):
        return chunkwise.forward(XP, q, k, v, gates, beta, mx.zeros(inject.shape[1:]),
                                 gate=gate, solve_block=solve_block, inject=inject)

    @mx.custom_function
    def core(q, k, v, gates, beta, inject, chunk, row):
        Y, _, residuals = run(q, k, v, gates, beta, inject)
        D = chunkwise._decay(XP, gates, gate)
        S_end = chunkwise.extract_states(XP, D, residuals[0], residuals[1], k, chunk, row)
        return (Y, S_end, *residuals)

    @core.vjp
    def core_vjp(primals, cotangents, outputs):
        q, k, v, gates, beta, inject, chunk, row = primals
        residuals = tuple(outputs[2:]) if save_states else run(*primals[:6])[2]
        D = chunkwise._decay(XP, gates, gate)
        dS_in, ends = chunkwise.extract_states_vjp(XP, D, residuals[0], residuals[1], k, chunk,
                                                   row, cotangents[1], q.shape[0])
        dq, dk, dv, dgates, dbeta, _, dinject = chunkwise.backward(
            XP, q, k, v, gates, beta, residuals, cotangents[0], mx.zeros(inject.shape[1:]),
            gate=gate, dS_in=dS_in, ends=ends)
        return dq, dk, dv, dgates, dbeta, dinject, mx.zeros_like(chunk), mx.zeros_like(row)

    return core


def packed_gated_delta(q, k, v, g, beta, initial_state, mask, cu_seqlens, *, scale, gate,
                       chunk_size, solve_block=8, save_states=True):
    """Packed row (`gdngen.algebra.packed`): float32 arrays, q ``[1,T,Hk,Dk]``, ``initial_state
    [N,Hv,Dv,Dk]`` or None, ``cu_seqlens`` int32 ``[N+1]``. Params as
    `chunkwise_gated_delta`'s."""
    core = chunk_core(gate, solve_block, save_states)
    extracts = g.ndim == 3
    walk_core = (packed_scalar_core if extracts else packed_core)(gate, solve_block, save_states)

    def dense(q, k, v, g, beta, S0, mask):
        return chunkwise.whole_sequence(XP, lambda *a: core(*a)[:2], q, k, v, g, beta, S0, mask,
                                     scale=scale, gate=gate, chunk_size=chunk_size)

    walk = packed.chunk_walk(XP, lambda *a: walk_core(*a)[:2], scale=scale, gate=gate,
                             chunk_size=chunk_size, extracts=extracts)
    return packed.packed_row(XP, dense, walk, q, k, v, g, beta, initial_state, mask,
                              cu_seqlens, gate=gate, chunk_size=chunk_size)


def chunkwise_gated_delta(q, k, v, g, beta, initial_state, mask, *, scale, gate, chunk_size,
                          solve_block=8, save_states=True, walks=None, qk_norm=False):
    """Chunkwise path, scalar or per-channel gates; float32 arrays, shapes as
    `gdngen.mlx.gated_delta`.

    ``chunk_size``, ``solve_block``, ``save_states``: the params of an ``mlx`` `Variant`;
    ``walks``: per-channel gates' chunk walks (`chunk_core`), None for the default scans.
    ``qk_norm``: q, k are raw and the chunk core normalises them (see `chunk_core`).
    """
    core = chunk_core(gate, solve_block, save_states, walks, float(scale) if qk_norm else None)

    def core_outputs(*arrays):
        Y, S_final, *_ = core(*arrays)
        return Y, S_final

    return chunkwise.whole_sequence(XP, core_outputs, q, k, v, g, beta, initial_state, mask,
                                 scale=1.0 if qk_norm else scale, gate=gate,
                                 chunk_size=chunk_size)


def recurrent_or_chunkwise(recurrent, chunkwise_call, single_step=False):
    """``f(q, k, v, g, beta, S0) -> (y, S_final)`` evaluated by ``recurrent`` (nothing kept for a
    backward) whose VJP is ``chunkwise_call``'s (an ``mx.custom_function``): under ``mx.vjp`` /
    ``mx.grad`` the backward re-runs ``chunkwise_call`` (same function, chunk kernels) and takes
    its VJP. Both take the same float32 arrays (masks already folded into g and beta).

    ``single_step``: for calls of T = 1 (decode), f under ``mx.compile`` (its custom VJP kept:
    the two compose), so a token's forward is one compiled call (compiled once per shape; not
    for longer calls, whose every new T would compile again). Measured (MLX 0.32 CPU,
    Qwen3-Next heads): the Python cost of a decode call 73 -> 50 us."""

    @mx.custom_function
    def switched(q, k, v, g, beta, S0):
        return recurrent(q, k, v, g, beta, S0)

    @switched.vjp
    def switched_vjp(primals, cotangents, outputs):
        # mx.vjp takes a flat list: a ParameterGate's gates tuple spread out and regrouped
        q, k, v, g, beta, S0 = primals
        n = len(g) if isinstance(g, tuple) else 1

        def flat_call(q, k, v, *rest):
            gates = tuple(rest[:n]) if isinstance(g, tuple) else rest[0]
            return chunkwise_call(q, k, v, gates, *rest[n:])

        flat = [q, k, v, *(g if isinstance(g, tuple) else (g,)), beta, S0]
        grads = mx.vjp(flat_call, flat, list(cotangents))[1]
        dg = tuple(grads[3:3 + n]) if isinstance(g, tuple) else grads[3]
        return (*grads[:3], dg, *grads[3 + n:])

    return mx.compile(switched) if single_step else switched


def recurrent_gated_delta(q, k, v, g, beta, initial_state, *, scale, gate, steps=False):
    """Forward of the recurrence one step at a time (`gdngen.algebra.recurrent.recurrent_step`):
    float32 arrays in the API layout, masks folded into g and beta; scalar or per-channel gates.
    Returns ``(y [B,T,Hv,Dv], S_T)``; with ``steps`` every step's state ``[B,T,Hv,Dv,Dk]`` in
    place of S_T."""
    return recurrent.recurrent_forward(XP, q, k, v, g, beta, initial_state, scale=scale,
                                       gate=gate, steps=steps)
