"""The states a call returns in place of the final one (``return_states``), float32:

* ``"steps"``: the state after every step of a short call, ``[B, T, Hv, Dv, Dk]``
  (speculative decoding verifies a window of T = 1..16 draft tokens and keeps the state of
  the last accepted one). A backend whose recurrent kernels write them lists the gate kinds in
  `gdngen.backend.Backend.step_states` (its ``steps`` hook); every other call runs
  `run_steps_portable`: its framework's portable recurrent step loop
  (`gdngen.algebra.chunkwise.recurrent_forward` with ``steps``).
* ``"chunks"`` with ``checkpoint_every=N`` (a multiple of the chunk size): the states at
  t = N, 2N, ... before T and the final one, ``[B, ceil(T/N), Hv, Dv, Dk]`` (prefix caching
  keeps a state per N tokens of a prompt). They are the chunk walk's own entering states
  (`gdngen.algebra.chunkwise.forward`'s first residual; per-channel gates likewise), read from
  the forward, not recomputed: `run_chunks_portable`, on the portable chunk path of the
  call's framework at the chunk the backend's variant runs (`gdngen.algebra.packed.chunk_params`).

Both are differentiable by the framework's autodiff (plain array ops, no custom VJP). A
masked step leaves the state as it was and gives y = 0.
"""

from __future__ import annotations

import importlib

from gdngen.algebra import chunkwise
from gdngen.algebra.packed import PORTABLE_OPS

__all__ = ["RETURN_STATES", "run_chunks_portable", "run_steps_portable"]

#: the values of ``return_states``
RETURN_STATES = ("final", "steps", "chunks")


def _float32(call, operands):
    """``(ops, q, k, v, g, beta, initial_state, mask)``: the call's portable framework module
    and its operands in float32 (a zero initial state when None)."""
    ops = importlib.import_module(PORTABLE_OPS[call.framework])
    f32, shape = ops.FLOAT32, call.shape
    q, k, v, g, beta, initial_state, mask = operands[:7]
    if initial_state is None:
        initial_state = ops.zeros((shape.B, shape.Hv, shape.Dv, shape.Dk), f32)
    return (ops, q.astype(f32), k.astype(f32), v.astype(f32), chunkwise.cast_gates(g, f32),
            beta.astype(f32), initial_state.astype(f32), mask)


def run_steps_portable(call, operands):
    """A ``return_states="steps"`` `gdngen.call.Call` (layer inputs computed) on the portable
    recurrent loop of its framework, float32 inside. Returns ``(y in q's dtype, states
    [B,T,Hv,Dv,Dk] float32)``."""
    ops, q, k, v, g, beta, initial_state, mask = _float32(call, operands)
    g, beta = chunkwise.fold_mask(ops.XP, g, beta, mask, call.gate)
    y, states = ops.recurrent_gated_delta(q, k, v, g, beta, initial_state, scale=call.scale,
                                          gate=call.gate, steps=True)
    if mask is not None:
        y = ops.XP.where(mask[..., None, None], y, 0.0)
    return y.astype(operands.q.dtype), states


def run_chunks_portable(call, operands, params):
    """A ``return_states="chunks"`` `gdngen.call.Call` (layer inputs computed) on the portable
    chunk path of its framework with chunk ``params`` (``chunk_size``, optionally
    ``solve_block``); ValueError unless ``call.checkpoint_every`` is a multiple of the chunk.
    Returns ``(y in q's dtype, states [B, ceil(T/N), Hv, Dv, Dk] float32)``."""
    from gdngen.algebra import chunkwise_channel

    C, every = int(params["chunk_size"]), call.checkpoint_every
    if every % C:
        raise ValueError(f"checkpoint_every={every} must be a multiple of the chunk size {C} "
                         "the call runs at (the states are the chunk walk's)")
    ops, q, k, v, g, beta, initial_state, mask = _float32(call, operands)
    solve_block = int(params.get("solve_block", 8))

    def core(q, k, v, gates, beta, S0):
        Y, S_final, residuals = chunkwise_channel.stages(gates).forward(
            ops.XP, q, k, v, gates, beta, S0, gate=call.gate, solve_block=solve_block)
        return Y, S_final, residuals[0]

    with ops.FLOAT32_MATMULS:
        y, final, entering = chunkwise.gated_delta(
            ops.XP, core, q, k, v, g, beta, initial_state, mask, scale=call.scale,
            gate=call.gate, chunk_size=C, entering=True)
    m = every // C
    states = ops.XP.module.concatenate([entering[:, m::m], final[:, None]], axis=1) if \
        entering.shape[1] > m else final[:, None]
    return y.astype(operands.q.dtype), states
