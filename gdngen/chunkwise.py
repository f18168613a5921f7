"""Framework-neutral chunkwise gated delta rule (WY form), shared by the JAX and MLX backends.

Every function takes ``xp``, a small array namespace (`gdngen.backends.xla.XP`,
`gdngen.backends.mlx.XP`) exposing: ``exp log where cumsum(x, axis, reverse) sum(x, axis)
concatenate stack swapaxes zeros ones eye tril_mask(n, k) float32 isfinite``. Arrays are float32.

Chunk algebra, per value head, chunk of C steps entering with state S0 ``[Dv, Dk]``. Positions
are 0..C with 0 the chunk boundary; ``D[i, j] = prod_{j < m <= i} g_m`` (i >= j) are the decay
factors of the chunk. Writing ``S_t = D[t,0] S0 + sum_{j<=t} D[t,j] w_j k_j^T`` in the recurrence
gives the unit-lower-triangular system (I + A) W = diag(beta) V - diag(beta D[:,0]) K S0^T with
``A[t, j] = beta_t D[t,j] (k_t . k_j)`` for j < t. Hence, with T = (I + A)^{-1},
``U = T diag(beta) V``, ``Wk = T diag(beta D[:,0]) K``, ``W = U - Wk S0^T`` and

    Y   = scale * (diag(D[:,0]) Q S0^T + (tril(D) * Q K^T) W)
    S_C = D[C,0] S0 + W^T diag(D[C,1:]) K.

Only bounded ratios D[i, j] with i >= j are ever formed (entries above the diagonal are exact
zeros, never exp of a positive number), each as exp of a segment sum over (j, i] (Mamba-2's
stable ``segsum``), so no digits are lost to differences of long cumulative sums and log g = -inf
gives an exact 0.
"""

from __future__ import annotations

# --------------------------------------------------------------------------- decay factors


def segment_sums(xp, b):
    """``[..., C] -> [..., C+1, C+1]``: entry (i, j) = sum of b_m over j < m <= i (0 where i <= j).

    Each entry adds only its own terms (a masked cumulative sum down the rows), so it is exact to
    the rounding of that sum alone; -inf terms give -inf, never NaN.
    """
    C = b.shape[-1]
    bz = xp.concatenate([xp.zeros(b.shape[:-1] + (1,)), b], axis=-1)  # b_0 = 0 at the boundary
    below = xp.tril_mask(C + 1, -1)  # m > j
    terms = xp.where(below, bz[..., :, None], 0.0)  # terms[m, j] = b_m if m > j
    return xp.cumsum(terms, axis=-2)


def decay_factors(xp, b):
    """Log gates ``b [..., C]`` -> decay factors ``D [..., C+1, C+1]``, zero above the diagonal."""
    C = b.shape[-1]
    return xp.where(xp.tril_mask(C + 1, 0), xp.exp(segment_sums(xp, b)), 0.0)


def straddle_sum(xp, P):
    """``P [..., C+1, C+1] -> [..., C]``: out[m-1] = sum of P[i, j] over i >= m > j.

    Gate m enters exactly the factors D[i, j] with j < m <= i ("straddling" m), so
    d/dlog g_m of sum(dD * D) is this sum of P = dD * D: every term already carries g_m, and
    nothing cancels as in the textbook reverse cumsum of dL/dG (which loses all digits at
    strong decay). A suffix sum over i, then a masked prefix over j: O(C^2), exact.
    """
    C = P.shape[-1] - 1
    from_below = xp.cumsum(P, axis=-2, reverse=True)  # sum over i >= m
    per_gate = xp.sum(xp.where(xp.tril_mask(C + 1, -1), from_below, 0.0), axis=-1)
    return per_gate[..., 1:]


def decay_factors_log_vjp(xp, b, D, dD):
    """Cotangent of the log gates b given dD for ``D = decay_factors(b)``."""
    return straddle_sum(xp, dD * D)


def decay_factors_linear_vjp(xp, a, D, dD):
    """Cotangent of linear gates a (D built from log a) given dD; exact at a = 0.

    For a_m > 0: dL/da_m = (dL/dlog a_m) / a_m, accurate because every straddling term carries
    a_m. For a_m = 0 the factors containing it are 0 and the quotient is 0/0, so use
    dL/da_m = sum over straddling (i, j) of dD[i, j] * prod_{j < m' <= i, m' != m} a_m', nonzero
    only where m is the segment's single zero gate.
    """
    C = a.shape[-1]
    zero = a == 0
    finite_log = xp.log(xp.where(zero, 1.0, a))
    zero_count = segment_sums(xp, xp.where(zero, 1.0, 0.0))
    others = xp.where(xp.tril_mask(C + 1, 0) & (zero_count == 1),
                      xp.exp(segment_sums(xp, finite_log)), 0.0)
    d_at_zero = straddle_sum(xp, dD * others)
    d_log = straddle_sum(xp, dD * D)
    return xp.where(zero, d_at_zero, d_log / xp.where(zero, 1.0, a))


# --------------------------------------------------------------- unit lower triangular inverse

SUBSTITUTION_BLOCK = 16


def _forward_substitution(xp, L):
    """Inverse of unit-lower-triangular ``L [..., n, n]`` row by row: row_i = e_i - L[i, :i] X[:i]."""
    n = L.shape[-1]
    inv = xp.eye(n) + xp.zeros(L.shape)
    rows = [inv[..., i, :] for i in range(n)]
    for i in range(1, n):
        done = xp.stack(rows[:i], axis=-2)  # [..., i, n]
        rows[i] = rows[i] - (L[..., i, None, :i] @ done)[..., 0, :]
    return xp.stack(rows, axis=-2)


def solve_unit_lower(xp, L):
    """Exact inverse of a unit-lower-triangular ``L [..., n, n]`` in float32.

    Block recursion on halves, inv([[L11, 0], [L21, L22]]) = [[X11, 0], [-X22 L21 X11, X22]],
    down to forward substitution on blocks of `SUBSTITUTION_BLOCK`. No Newton-Schulz or Neumann
    series: those diverge on near-singular chunks (identical keys).
    """
    n = L.shape[-1]
    if n <= SUBSTITUTION_BLOCK:
        return _forward_substitution(xp, L)
    h = n // 2
    if n - h == h:  # both halves at once
        X = solve_unit_lower(xp, xp.stack([L[..., :h, :h], L[..., h:, h:]], axis=0))
        X11, X22 = X[0], X[1]
    else:
        X11, X22 = solve_unit_lower(xp, L[..., :h, :h]), solve_unit_lower(xp, L[..., h:, h:])
    X21 = -(X22 @ (L[..., h:, :h] @ X11))
    top = xp.concatenate([X11, xp.zeros(X11.shape[:-1] + (n - h,))], axis=-1)
    bottom = xp.concatenate([X21, X22], axis=-1)
    return xp.concatenate([top, bottom], axis=-2)


def solve_unit_lower_vjp(xp, Tinv, dTinv):
    """Cotangent of the strictly-lower part A of L = I + A given T = L^{-1}: -T^T dT T^T, masked.

    From d(L^{-1}) = -L^{-1} dL L^{-1}.
    """
    n = Tinv.shape[-1]
    full = -(xp.swapaxes(Tinv, -1, -2) @ dTinv @ xp.swapaxes(Tinv, -1, -2))
    return xp.where(xp.tril_mask(n, -1), full, 0.0)


# --------------------------------------------------------------------------- chunk stages
# Layout: chunk index N leading (the sequential axis), then batch and heads, then C, then D.
# q, k: [N, B, Hk, 1, C, Dk] (broadcast over the r value heads sharing a key head);
# v: [N, B, Hk, r, C, Dv]; b (log gates) or a (linear gates), beta: [N, B, Hk, r, C];
# states: [B, Hk, r, Dv, Dk].


def chunk_prepare(xp, k, v, beta, D, invert):
    """Intra-chunk WY factors: ``U = T diag(beta) V`` [.., C, Dv] and ``Wk = T diag(beta D[:,0]) K``.

    ``invert(A)`` returns (I + A)^{-1} for strictly lower A (a differentiable op).
    K K^T is formed once per key head and shared by its value heads.
    """
    C = k.shape[-2]
    KK = k @ xp.swapaxes(k, -1, -2)
    A = xp.where(xp.tril_mask(C, -1), beta[..., :, None] * D[..., 1:, 1:] * KK, 0.0)
    Tinv = invert(A)
    U = Tinv @ (beta[..., None] * v)
    Wk = Tinv @ ((beta * D[..., 1:, 0])[..., None] * k)
    return U, Wk


def chunk_state_step(xp, S, U, Wk, k, D):
    """One chunk of the recurrence: returns (W, S_next) for entering state S [.., Dv, Dk].

    ``W = U - Wk S^T`` [.., C, Dv]; ``S_next = D[C,0] S + W^T diag(D[C,1:]) K``.
    """
    W = U - Wk @ xp.swapaxes(S, -1, -2)
    S_next = D[..., -1, 0, None, None] * S + xp.swapaxes(W, -1, -2) @ (D[..., -1, 1:, None] * k)
    return W, S_next


def chunk_output(xp, q, k, D, S, W):
    """``Y = diag(D[:,0]) Q S^T + (tril(D) * Q K^T) W`` (unscaled) [.., C, Dv]."""
    QK = q @ xp.swapaxes(k, -1, -2)
    inter = D[..., 1:, 0, None] * (q @ xp.swapaxes(S, -1, -2))
    return inter + (D[..., 1:, 1:] * QK) @ W
