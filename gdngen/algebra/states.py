"""The states a call returns in place of the final one (``return_states``), float32:

* ``"steps"``: the state after every step of a short call, ``[B, T, Hv, Dv, Dk]``
  (speculative decoding verifies a window of T = 1..16 draft tokens and keeps the state of
  the last accepted one). A backend whose recurrent kernels write them lists the gate kinds in
  `gdngen.backend.Backend.step_states` (its ``steps`` hook); every other call runs
  `gdngen.backends.fallback.steps`: its framework's portable recurrent step loop
  (`gdngen.algebra.recurrent.recurrent_forward` with ``steps``).
* ``"chunks"`` with ``checkpoint_every=N`` (a multiple of the chunk size): the states at
  t = N, 2N, ... before T and the final one, ``[B, ceil(T/N), Hv, Dv, Dk]`` (prefix caching
  keeps a state per N tokens of a prompt). They are the chunk walk's own entering states
  (`gdngen.algebra.chunkwise.forward`'s first residual; per-channel gates likewise), read from
  the forward, not recomputed. A backend whose chunk kernels give them lists the gate kinds in
  `gdngen.backend.Backend.chunk_states` (its ``chunks`` hook,
  `gdngen.backends.generated.kernel_chunks`); every other call runs
  `gdngen.backends.fallback.chunks`, on the portable chunk path of the call's framework at
  the chunk the backend's variant runs (`gdngen.backend.Backend.packed_params`).

The portable ones are differentiable by the framework's autodiff (plain array ops, no custom
VJP); a kernel's take the portable path's VJP. A masked step leaves the state as it was and
gives y = 0.
"""

from __future__ import annotations

from gdngen.algebra import kinds

__all__ = ["RETURN_STATES", "boundary_states", "checkpoint_stride", "entering_core"]

#: the values of ``return_states``
RETURN_STATES = ("final", "steps", "chunks")


def entering_core(xp, gate: str, *, solve_block: int = 8, walk=None):
    """``core(q, k, v, gates, beta, S0) -> (Y, S_final, S_in)`` in chunk layout (the
    ``entering`` core of `gdngen.algebra.chunkwise.whole_sequence`): the chunk stages of the gates'
    kind (`gdngen.algebra.kinds.stages`), ``S_in`` their first residual. ``walk``
    (per-channel gates only): a backend's kernel in place of the sequential stage
    (`gdngen.algebra.chunkwise_channel.walk_forward`'s contract)."""

    def core(q, k, v, gates, beta, S0):
        extra = {} if walk is None else {"walk": walk}
        Y, S_final, residuals = kinds.stages(gates).forward(
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
