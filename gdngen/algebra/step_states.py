"""Per-step states (``return_states="steps"``): the state after every step of a short call,
``[B, T, Hv, Dv, Dk]`` float32, in place of the final state (speculative decoding verifies a
window of T = 1..16 draft tokens and keeps the state of the last accepted one).

A backend whose recurrent kernels write them lists the gate kinds in
`gdngen.backend.Backend.step_states` (its ``steps`` hook); every other call runs `run_portable`:
its framework's portable recurrent step loop (`gdngen.algebra.chunkwise.recurrent_forward` with
``steps``), differentiable by the framework's autodiff (the loop is plain array ops). A masked
step leaves the state as it was (its entry repeats the one before) and gives y = 0.
"""

from __future__ import annotations

import importlib

from gdngen.algebra import chunkwise
from gdngen.algebra.packed import PORTABLE_OPS

__all__ = ["RETURN_STATES", "run_portable"]

#: the values of ``return_states``
RETURN_STATES = ("final", "steps")


def run_portable(call, operands):
    """A ``return_states="steps"`` `gdngen.call.Call` (layer inputs computed) on the portable
    recurrent loop of its framework, float32 inside. Returns ``(y in q's dtype, states
    [B,T,Hv,Dv,Dk] float32)``."""
    ops = importlib.import_module(PORTABLE_OPS[call.framework])
    f32 = ops.FLOAT32
    shape = call.shape
    q, k, v, g, beta, initial_state, mask = operands[:7]
    if initial_state is None:
        initial_state = ops.zeros((shape.B, shape.Hv, shape.Dv, shape.Dk), f32)
    g, beta = chunkwise.fold_mask(ops.XP, chunkwise.cast_gates(g, f32), beta.astype(f32), mask,
                                  call.gate)
    y, states = ops.recurrent_gated_delta(q.astype(f32), k.astype(f32), v.astype(f32), g, beta,
                                          initial_state.astype(f32), scale=call.scale,
                                          gate=call.gate, steps=True)
    if mask is not None:
        y = ops.XP.where(mask[..., None, None], y, 0.0)
    return y.astype(q.dtype), states
