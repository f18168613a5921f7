"""FLOP model of the chunkwise gated-delta algorithm, for achieved-GFLOP/s figures."""

from __future__ import annotations

from fractions import Fraction


def chunkwise_flops(B: int, T: int, Hk: int, Hv: int, Dk: int, Dv: int, chunk_size: int) -> int:
    """Matmul FLOPs (2mnk each) of one forward+backward chunkwise call; elementwise ops ignored.

    With C = chunk_size and N = ceil(T / C) chunks, per chunk:
      per key head:   Q K^T and K K^T                                2 * 2*C*C*Dk
      per value head: triangular inverse (2/3)*C^3; U = T(beta V) 2*C*C*Dv;
                      Wk = T(beta K) 2*C*C*Dk; W = U - Wk S^T 2*C*Dk*Dv;
                      state update W^T K 2*C*Dv*Dk; Y = Q S^T 2*C*Dk*Dv;
                      intra-chunk (QK o D) W 2*C*C*Dv.
    The forward count is multiplied by 3 for forward + backward.
    """
    for name, x in (("B", B), ("T", T), ("Hk", Hk), ("Hv", Hv), ("Dk", Dk), ("Dv", Dv),
                    ("chunk_size", chunk_size)):
        if x < 1:
            raise ValueError(f"{name} must be >= 1, got {x}")
    C = chunk_size
    n_chunks = -(-T // C)
    key_head = 2 * (2 * C * C * Dk)
    value_head = (
        Fraction(2, 3) * C**3
        + 2 * C * C * Dv
        + 2 * C * C * Dk
        + 2 * C * Dk * Dv
        + 2 * C * Dv * Dk
        + 2 * C * Dk * Dv
        + 2 * C * C * Dv
    )
    return int(3 * B * n_chunks * (Hk * key_head + Hv * value_head))
