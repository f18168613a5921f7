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
  the forward, not recomputed. A backend whose chunk kernels give them lists the gate kinds in
  `gdngen.backend.Backend.chunk_states` (its ``chunks`` hook,
  `gdngen.backends.generated.kernel_chunks`); every other call runs `run_chunks_portable`, on
  the portable chunk path of the call's framework at the chunk the backend's variant runs
  (`gdngen.algebra.packed.chunk_params`).

The portable ones are differentiable by the framework's autodiff (plain array ops, no custom
VJP); a kernel's take the portable path's VJP. A masked step leaves the state as it was and
gives y = 0.
"""

from __future__ import annotations

import importlib

from gdngen.algebra import chunkwise
from gdngen.algebra.packed import PORTABLE_OPS

__all__ = ["RETURN_STATES", "boundary_states", "checkpoint_stride", "entering_core",
           "run_chunks_portable", "run_steps_portable"]

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
    C = int(params["chunk_size"])
    m = checkpoint_stride(call.checkpoint_every, C)
    ops, q, k, v, g, beta, initial_state, mask = _float32(call, operands)
    core = entering_core(ops.XP, call.gate, solve_block=int(params.get("solve_block", 8)))
    with ops.FLOAT32_MATMULS:
        y, final, entering = chunkwise.gated_delta(
            ops.XP, core, q, k, v, g, beta, initial_state, mask, scale=call.scale,
            gate=call.gate, chunk_size=C, entering=True)
    return y.astype(operands.q.dtype), boundary_states(ops.XP, entering, final, m)


def entering_core(xp, gate: str, *, solve_block: int = 8, walk=None):
    """``core(q, k, v, gates, beta, S0) -> (Y, S_final, S_in)`` in chunk layout (the
    ``entering`` core of `gdngen.algebra.chunkwise.gated_delta`): the chunk stages of the gates'
    kind (`gdngen.algebra.chunkwise_channel.stages`), ``S_in`` their first residual. ``walk``
    (per-channel gates only): a backend's kernel in place of the sequential stage
    (`gdngen.algebra.chunkwise_channel.walk_forward`'s contract)."""
    from gdngen.algebra import chunkwise_channel

    def core(q, k, v, gates, beta, S0):
        extra = {} if walk is None else {"walk": walk}
        Y, S_final, residuals = chunkwise_channel.stages(gates).forward(
            xp, q, k, v, gates, beta, S0, gate=gate, solve_block=solve_block, **extra)
        return Y, S_final, residuals[0]

    return core


def checkpoint_stride(every: int, C: int) -> int:
    """Chunks per checkpoint: ``every // C``; ValueError unless ``checkpoint_every`` is a
    multiple of the chunk size ``C`` the call runs at."""
    if every % C:
        raise ValueError(f"checkpoint_every={every} must be a multiple of the chunk size {C} "
                         "the call runs at (the states are the chunk walk's)")
    return every // C


def boundary_states(xp, entering, final, m: int):
    """``[B, ceil(T/N), Hv, Dv, Dk]``: the states entering chunks m, 2m, ... (``entering``
    ``[B, n_chunks, Hv, Dv, Dk]``, the chunk walk's) and the ``final`` one."""
    if entering.shape[1] <= m:
        return final[:, None]
    return xp.module.concatenate([entering[:, m::m], final[:, None]], axis=1)
