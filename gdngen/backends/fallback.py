"""The portable runs of the calls a backend has no kernels for: packed rows of a gate kind its
packed kernels do not take, ``return_states="steps"`` and ``"chunks"``
(`gdngen.backend.Backend.run` sends them here). Each runs its framework's portable module
(`PORTABLE_OPS`) in float32 on a checked `gdngen.call.Call` whose layer inputs are computed
(`gdngen.prepare.computed`), and is differentiable by the framework.
"""

from __future__ import annotations

import importlib

from gdngen.algebra import chunkwise, layer_inputs, states

#: the portable chunk module a fallback run (and a generated backend's VJP) uses, per framework
PORTABLE_OPS = {"jax": "gdngen.backends.portable.jax_chunkwise",
                "mlx": "gdngen.backends.portable.mlx_chunkwise"}


def ops(framework: str):
    """The portable module of ``framework`` (`PORTABLE_OPS`)."""
    return importlib.import_module(PORTABLE_OPS[framework])


def _float32(call, operands):
    """``(ops, q, k, v, g, beta, initial_state, mask)``: the call's portable framework module
    and its operands in float32 (a zero initial state when None)."""
    module = ops(call.framework)
    f32, shape = module.FLOAT32, call.shape
    q, k, v, g, beta, initial_state, mask = operands[:7]
    if initial_state is None:
        initial_state = module.zeros((shape.B, shape.Hv, shape.Dv, shape.Dk), f32)
    return (module, q.astype(f32), k.astype(f32), v.astype(f32),
            layer_inputs.cast_gates(g, f32), beta.astype(f32), initial_state.astype(f32), mask)


def packed(call, operands, params):
    """A packed call on the portable chunk path with chunk ``params`` (``chunk_size``,
    optionally ``solve_block``, ``save_states``; `gdngen.backend.Backend.packed_params`).
    Returns ``(y in q's dtype, final_state [N, Hv, Dv, Dk] float32)``."""
    module = ops(call.framework)
    f32 = module.FLOAT32
    q, k, v, g, beta, initial_state, mask, _, _, cu_seqlens = operands[:10]
    y, state = module.packed_gated_delta(
        *(x.astype(f32) for x in (q, k, v, g, beta)),
        None if initial_state is None else initial_state.astype(f32), mask, cu_seqlens,
        scale=call.scale, gate=call.decay, **params)
    return y.astype(q.dtype), state


def steps(call, operands):
    """A ``return_states="steps"`` call on the portable recurrent loop. Returns ``(y in q's
    dtype, states [B,T,Hv,Dv,Dk] float32)``."""
    module, q, k, v, g, beta, initial_state, mask = _float32(call, operands)
    g, beta = layer_inputs.fold_mask(module.XP, g, beta, mask, call.decay)
    y, all_states = module.recurrent_gated_delta(q, k, v, g, beta, initial_state,
                                                 scale=call.scale, gate=call.decay, steps=True)
    if mask is not None:
        y = module.XP.where(mask[..., None, None], y, 0.0)
    return y.astype(operands.q.dtype), all_states


def chunks(call, operands, params):
    """A ``return_states="chunks"`` call on the portable chunk path with chunk ``params``
    (``chunk_size``, optionally ``solve_block``); ValueError unless ``call.checkpoint_every``
    is a multiple of the chunk. Returns ``(y in q's dtype, states [B, ceil(T/N), Hv, Dv, Dk]
    float32)``."""
    C = int(params["chunk_size"])
    m = states.checkpoint_stride(call.checkpoint_every, C)
    module, q, k, v, g, beta, initial_state, mask = _float32(call, operands)
    core = states.entering_core(module.XP, call.decay,
                                solve_block=int(params.get("solve_block", 8)))
    with module.FLOAT32_MATMULS:
        y, final, entering = chunkwise.whole_sequence(
            module.XP, core, q, k, v, g, beta, initial_state, mask, scale=call.scale,
            gate=call.decay, chunk_size=C, entering=True)
    return y.astype(operands.q.dtype), states.boundary_states(module.XP, entering, final, m)
