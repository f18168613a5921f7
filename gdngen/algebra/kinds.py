"""The chunk algebra of each gate kind (scalar, per-channel)."""

from __future__ import annotations

from gdngen.algebra import chunkwise, chunkwise_channel


def stages(gates):
    """The chunk algebra for ``gates`` in chunk layout: `gdngen.algebra.chunkwise` for scalar gates
    ``[N,B,H,r,C]``, `gdngen.algebra.chunkwise_channel` for per-channel ones
    ``[N,B,H,r,C,Dk]``; both have ``forward(xp, q, k, v, gates, beta, S0, *, gate,
    solve_block)`` and ``backward``."""
    return chunkwise if gates.ndim == 5 else chunkwise_channel
