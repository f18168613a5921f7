"""Framework-neutral chunkwise gated delta rule (WY form), shared by the JAX and MLX backends.

Every function takes ``xp``, a small array namespace
(`gdngen.algebra.namespaces.ArrayNamespace`) exposing
``exp log where concatenate stack swapaxes einsum repeat zeros(shape) eye(n) pad_time(x, pad,
value)`` and the framework-specific ``cumsum(x, axis, reverse) cumprod(x, axis, reverse)
tril_mask(n, k) scan(f, carry, xs, reverse)`` (lax.scan semantics).
Arrays are float32. The gates' layouts and the layer inputs are `gdngen.algebra.layer_inputs`';
the step-at-a-time recurrence is `gdngen.algebra.recurrent`.

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

from gdngen.algebra.layer_inputs import fold_mask, identity_value, raw_gates

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
    below = xp.where(xp.tril_mask(C + 1, -1), 1.0, 0.0)  # j < m
    return xp.einsum("...mj,mj->...m", from_below, below)[..., 1:]


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

def _forward_substitution(xp, L):
    """Inverse of unit-lower-triangular ``L [..., n, n]``, row_i = e_i - L[i, :i] X[:i]."""
    n = L.shape[-1]
    inv = xp.eye(n) + xp.zeros(L.shape)
    rows = [inv[..., i, :] for i in range(n)]
    for i in range(1, n):
        done = xp.stack(rows[:i], axis=-2)  # [..., i, n]
        rows[i] = rows[i] - (L[..., i, None, :i] @ done)[..., 0, :]
    return xp.stack(rows, axis=-2)


def solve_unit_lower(xp, L, block=8):
    """Exact inverse of a unit-lower-triangular ``L [..., n, n]`` in float32.

    Block recursion on halves, inv([[L11, 0], [L21, L22]]) = [[X11, 0], [-X22 L21 X11, X22]],
    down to forward substitution on blocks of at most ``block`` rows. No Newton-Schulz or Neumann
    series: those diverge on near-singular chunks (identical keys).
    """
    n = L.shape[-1]
    if n <= block:
        return _forward_substitution(xp, L)
    h = n // 2
    if n - h == h:  # both halves at once
        X = solve_unit_lower(xp, xp.stack([L[..., :h, :h], L[..., h:, h:]], axis=0), block)
        X11, X22 = X[0], X[1]
    else:
        X11 = solve_unit_lower(xp, L[..., :h, :h], block)
        X22 = solve_unit_lower(xp, L[..., h:, h:], block)
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
# Layout: chunk index N leading (the sequential axis), then batch B and key heads H.
# Key-head arrays q, k: [N, B, H, C, Dk] (q already multiplied by `scale`); value-head arrays
# v: [N, B, H, r, C, Dv], gates (log or linear) and beta: [N, B, H, r, C]; states
# [B, H, r, Dv, Dk]. Products with a key-head operand are einsums over "...": the r value heads
# of a key head fold into one larger matmul (GVA sharing) instead of broadcasting.


def _T(x):
    return x.swapaxes(-1, -2)


def _sum_heads(x):
    """``[..., r, A, B] -> [..., A, B]``: sum over the value heads of a key head."""
    return sum(x[..., i, :, :] for i in range(1, x.shape[-3])) + x[..., 0, :, :]


def _row_dots(xp, x, y):
    """``x [..., r, C, K]``, key-head ``y [..., C, K]`` -> ``[..., r, C]``: x[r, c] . y[c].

    One einsum per value head: each is a contraction over the minor axis with every other axis
    a leading batch axis, which XLA:CPU runs far faster than a fused multiply-reduce.
    """
    return xp.stack([xp.einsum("...ck,...ck->...c", x[..., i, :, :], y)
                     for i in range(x.shape[-3])], axis=-2)


def _decay(xp, gates, gate):
    return decay_factors(xp, gates if gate == "log" else xp.log(gates))


def _wy(xp, k, v, beta, D, solve_block):
    """Parallel over chunks: T = (I + A)^{-1} [.., r, C, C] with A = strict(beta D K K^T),
    ``U = T diag(beta) V`` [.., r, C, Dv] and ``Wk = T diag(beta D0) K`` [.., r, C, Dk]."""
    C = k.shape[-2]
    KK = xp.einsum("...ck,...dk->...cd", k, k)[..., None, :, :]  # once per key head
    A = xp.where(xp.tril_mask(C, -1), beta[..., :, None] * D[..., 1:, 1:] * KK, 0.0)
    Tinv = solve_unit_lower(xp, xp.eye(C) + A, solve_block)
    U = Tinv @ (beta[..., None] * v)
    Wk = xp.einsum("...rcd,...dk->...rck", Tinv * (beta * D[..., 1:, 0])[..., None, :], k)
    return Tinv, U, Wk


def forward(xp, q, k, v, gates, beta, S0, *, gate, solve_block=8, inject=None):
    """Chunkwise forward. Returns ``(Y [N,B,H,r,C,Dv], S_final, residuals)``.

    The residuals for `backward` are ``(S_in, W, Tinv, Wk)``: the state entering each chunk
    [N,B,H,r,Dv,Dk], the WY pseudo-values W [N,B,H,r,C,Dv], the triangular inverse
    [N,B,H,r,C,C] and Wk = T diag(beta D0) K [N,B,H,r,C,Dk].

    ``inject`` [N,B,H,r,Dv,Dk] (or None): added to the state leaving each chunk,
    ``S_{n+1} = D[C,0] S_n + W^T Kc + inject[n]`` (packed sequences' initial states,
    `gdngen.algebra.packed`).

    Everything that reads a chunk's state happens inside the chunk walk, while that state is
    hot in cache; the intra-chunk products that do not need it run batched over all chunks.
    """
    ein = xp.einsum
    D = _decay(xp, gates, gate)
    Tinv, U, Wk = _wy(xp, k, v, beta, D, solve_block)
    Kc = D[..., -1, 1:, None] * k[..., None, :, :]  # keys decayed to the chunk end
    Pm = D[..., 1:, 1:] * ein("...ck,...dk->...cd", q, k)[..., None, :, :]

    def step(S, xs):
        U_n, Wk_n, Kc_n, q_n, Pm_n, D0_n, dCC, *J_n = xs
        W = U_n - ein("...ck,...vk->...cv", Wk_n, S)
        Y = D0_n[..., None] * ein("...ck,...rvk->...rcv", q_n, S) + Pm_n @ W
        S_out = dCC[..., None, None] * S + ein("...cv,...ck->...vk", W, Kc_n)
        return (S_out + J_n[0] if J_n else S_out), (Y, S, W)

    S_final, (Y, S_in, W) = xp.scan(
        step, S0, (U, Wk, Kc, q, Pm, D[..., 1:, 0], D[..., -1, 0]) + _optional(inject), False)
    return Y, S_final, (S_in, W, Tinv, Wk)


def _optional(x):
    """``(x,)``, or ``()`` for None: an optional per-chunk input of a chunk walk."""
    return () if x is None else (x,)


def backward(xp, q, k, v, gates, beta, residuals, dY, dS_final, *, gate, dS_in=None,
             ends=None):
    """Hand-derived VJP of `forward`: returns (dq, dk, dv, dgates, dbeta, dS0).

    ``dS_in`` [N,B,H,r,Dv,Dk] (or None): a cotangent of the residual S_in itself (the
    entering states as an output, `gdngen.algebra.packed`); it is added to the walk's state
    cotangent at each chunk start, and the cotangent of `forward`'s ``inject`` (the state cotangent
    leaving each chunk) is returned as a seventh value. ``ends``: the cotangent pieces of
    `extract_states` (`extract_states_vjp`), added where W, the keys and the decay factors
    enter.

    ``residuals``: what `forward` returned (saved, or recomputed by the caller).
    Recomputes the cheap decay factors and K K^T, walks the chunks in reverse for the state
    cotangent (dW = Pm^T dY + Kc dS_out^T, dS_in = D[C,0] dS_out + (D0 dY)^T Q - dW^T Wk) and,
    in the same walk, every product with a chunk's state or state cotangent; then forms the
    input cotangents in parallel. The gate cotangent goes through the straddle-sum rule.
    """
    C = k.shape[-2]
    ein = xp.einsum
    S_in, W, Tinv, Wk = residuals
    D = _decay(xp, gates, gate)
    D0, D11, D_last = D[..., 1:, 0], D[..., 1:, 1:], D[..., -1, 1:]
    KK = ein("...ck,...dk->...cd", k, k)[..., None, :, :]
    key_scale = beta * D0
    Kc = D_last[..., None] * k[..., None, :, :]
    QK = ein("...ck,...dk->...cd", q, k)[..., None, :, :]
    Pm = D11 * QK
    G = _T(Pm) @ dY
    if ends is not None:
        G = G + ends["W"]

    def step(dS_out, xs):
        G_n, Kc_n, Wk_n, W_n, S_n, dY_n, q_n, k_n, D0_n, D_last_n, dCC, *dS_n = xs
        dW = G_n + ein("...ck,...vk->...cv", Kc_n, dS_out)
        dY_S = dY_n @ S_n  # d(Q S^T) per value head
        dKc = W_n @ dS_out  # S_out = D[C,0] S_in + W^T Kc
        dS_prev = (dCC[..., None, None] * dS_out
                   + ein("...rcv,...ck->...rvk", D0_n[..., None] * dY_n, q_n)
                   - ein("...cv,...ck->...vk", dW, Wk_n))
        return (dS_prev + dS_n[0] if dS_n else dS_prev), (
            dW, -(dW @ S_n), _sum_heads(D0_n[..., None] * dY_S), _row_dots(xp, dY_S, q_n),
            _sum_heads(D_last_n[..., None] * dKc), _row_dots(xp, dKc, k_n),
            ein("...vk,...vk->...", dS_out, S_n)) + _optional(dS_out if dS_n else None)

    dS0, (dW, dWk, dq, dD0, dk, dDC, ddCC, *dJ) = xp.scan(
        step, dS_final, (G, Kc, Wk, W, S_in, dY, q, k, D0, D_last, D[..., -1, 0])
        + _optional(dS_in), True)

    # Y = D0 * (Q S^T) + Pm W
    dPm = dY @ _T(W)
    dPmD_heads = _sum_heads(dPm * D11)
    dq = dq + dPmD_heads @ k
    dk = dk + _T(dPmD_heads) @ q
    dD11 = dPm * QK
    # W = U - Wk S^T ;  U = T (beta V) ;  Wk = T (beta D0 K)
    dTinv = (dW @ _T(beta[..., None] * v)
             + ein("...rck,...dk->...rcd", dWk, k) * key_scale[..., None, :])
    dbv = _T(Tinv) @ dW
    dbk = _T(Tinv) @ dWk
    dv = beta[..., None] * dbv
    dbk_k = _row_dots(xp, dbk, k)
    dbeta = ein("...cv,...cv->...c", dbv, v) + D0 * dbk_k
    dD0 = dD0 + beta * dbk_k
    dk = dk + _sum_heads(key_scale[..., None] * dbk)
    # A = beta_i D_ij (k_i . k_j), strictly lower;  d(L^{-1}) = -L^{-1} dL L^{-1}
    dA = solve_unit_lower_vjp(xp, Tinv, dTinv)
    dA_D = dA * D11
    dbeta = dbeta + ein("...rcd,...cd->...rc", dA_D, KK[..., 0, :, :])
    dD11 = dD11 + dA * beta[..., :, None] * KK
    dKK = _sum_heads(beta[..., None] * dA_D)
    dk = dk + (dKK + _T(dKK)) @ k
    # assemble dD over positions 0..C (row 0 never carries a gate)
    rows = xp.concatenate([dD0[..., None], dD11], axis=-1)  # positions 1..C
    last = rows[..., -1, :] + xp.concatenate([ddCC[..., None], dDC], axis=-1)
    dD = xp.concatenate([xp.zeros(rows.shape[:-2] + (1, C + 1)), rows[..., :-1, :],
                         last[..., None, :]], axis=-2)
    if ends is not None:
        dD, dk = dD + ends["D"], dk + ends["k"]
    if gate == "log":
        dgates = decay_factors_log_vjp(xp, gates, D, dD)
    else:
        dgates = decay_factors_linear_vjp(xp, gates, D, dD)
    return (dq, dk, dv, dgates, dbeta, dS0) + tuple(dJ)


# ------------------------------------------------------------------ states inside chunks


def extract_states(xp, D, S_in, W, k, chunk, row):
    """The state after step ``row[i]`` of chunk ``chunk[i]`` for each i (a packed sequence's
    final state, `gdngen.algebra.packed`): ``S = D[p,0] S_in + sum_{u < p} D[p,u] w_u k_u^T`` at
    position ``p = row + 1`` (the chunk-end formula of `forward` cut at p), from the chunk
    layout's decay factors ``D``, entering states, WY pseudo-values and keys. ``chunk``, ``row``
    int32 ``[n]`` (a row of -1: that entry is all zeros). Returns ``[n, B, H, r, Dv, Dk]``."""
    take = xp.module.take
    C = k.shape[-2]
    at = _row_one_hot(xp, row, C)  # [n, C+1]
    Dp = (take(D, chunk, axis=0) * at[:, None, None, None, :, None]).sum(axis=-2)  # [n,..,C+1]
    return (Dp[..., 0, None, None] * take(S_in, chunk, axis=0)
            + xp.einsum("n...rcv,n...ck->n...rvk", Dp[..., 1:, None] * take(W, chunk, axis=0),
                        take(k, chunk, axis=0)))


def _row_one_hot(xp, row, C):
    """``[n, C+1]``: 1 at position ``row + 1`` (none for row -1)."""
    return xp.where(xp.module.arange(C + 1)[None, :] == (row + 1)[:, None], 1.0, 0.0) * \
        xp.where(row >= 0, 1.0, 0.0)[:, None]


def extract_states_vjp(xp, D, S_in, W, k, chunk, row, dS, chunks):
    """Cotangents of `extract_states` from ``dS [n, B, H, r, Dv, Dk]``, summed into chunk
    layout over the ``chunks`` chunks: ``S_in`` (-> `backward`'s ``dS_in``) and the ``ends``
    pieces of `backward`: ``W`` [chunks, .., r, C, Dv], ``k`` [chunks, .., C, Dk], ``D``
    [chunks, .., r, C+1, C+1]."""
    take = xp.module.take
    C = k.shape[-2]
    at = _row_one_hot(xp, row, C)
    Dc, Sc, Wc, kc = (take(x, chunk, axis=0) for x in (D, S_in, W, k))
    Dp = (Dc * at[:, None, None, None, :, None]).sum(axis=-2)
    dWk = xp.einsum("n...ck,n...rvk->n...rcv", kc, dS)  # k_u dS^T per value head
    WdS = xp.einsum("n...rcv,n...rvk->n...rck", Wc, dS)
    dDp = xp.concatenate([(Sc * dS).sum(axis=(-1, -2))[..., None],
                          (WdS * kc[..., None, :, :]).sum(axis=-1)], axis=-1)
    return (xp.scatter_add(chunks, chunk, Dp[..., 0, None, None] * dS),
            {"W": xp.scatter_add(chunks, chunk, Dp[..., 1:, None] * dWk),
             "k": xp.scatter_add(chunks, chunk, _sum_heads(Dp[..., 1:, None] * WdS)),
             "D": xp.scatter_add(chunks, chunk,
                                 at[:, None, None, None, :, None] * dDp[..., None, :])})


# --------------------------------------------------------------------------- whole sequences


def to_chunks(x, N, C, heads_shape):
    """``[B, T, H, ...]`` (T = N*C) -> ``[N, B, *heads_shape, C, ...]``."""
    B, _, _, *rest = x.shape
    x = x.reshape((B, N, C) + tuple(heads_shape) + tuple(rest))
    nh = len(heads_shape)
    return x.transpose((1, 0) + tuple(range(3, 3 + nh)) + (2,) + tuple(range(3 + nh, x.ndim)))


def from_chunks(y, T):
    """``[N, B, Hk, r, C, Dv]`` -> ``[B, T, Hk*r, Dv]`` (dropping the padded tail)."""
    N, B, Hk, r, C, Dv = y.shape
    return y.transpose((1, 0, 4, 2, 3, 5)).reshape(B, N * C, Hk * r, Dv)[:, :T]



def _chunk_parameters(x, Hk, r, vector_gate):
    """A parameter in the API broadcast form (`parameter_layout`) against ``a`` in chunk layout
    ``[N, B, Hk, r, C(, Dk)]``: ``[Hk, r, 1(, 1 or Dk)]``."""
    return x.reshape((Hk, r, 1) + tuple(x.shape[1:]) if vector_gate else (Hk, r, 1))


def whole_sequence(xp, core, q, k, v, g, beta, initial_state, mask, *, scale, gate, chunk_size,
                entering=False):
    """Whole-sequence chunkwise gated delta, scalar or per-channel gates
    (`gdngen.algebra.kinds.stages`); float32 arrays, shapes as the API.

    ``core(q, k, v, gates, beta, S0) -> (Y, S_final)`` is `forward` in chunk layout wrapped with
    `backward` as its VJP by the framework. A masked step folds into the gates (log g = 0 /
    g = 1, beta = 0) and its output is zeroed; T is padded to a multiple of the chunk with
    identity steps, which leave the state unchanged. With a `ParameterGate` ``g`` is the tuple
    ``(a, A_log, dt_bias)`` (parameters as `parameter_layout` gives them) and the core gets it
    in chunk layout. ``entering``: ``core`` returns ``(Y, S_final, S_in)`` (the states entering
    each chunk, `forward`'s first residual) and so does this, S_in ``[B, N, Hv, Dv, Dk]``.
    """
    B, T, Hk, Dk = q.shape
    Hv, Dv = v.shape[2], v.shape[3]
    r, C = Hv // Hk, chunk_size
    N = -(-T // C)
    g, beta = fold_mask(xp, g, beta, mask, gate)
    a = raw_gates(g)
    pad = N * C - T
    if pad:
        q, k, v, beta = (xp.pad_time(x, pad, 0.0) for x in (q, k, v, beta))
        a = xp.pad_time(a, pad, identity_value(gate))
    gates = to_chunks(a, N, C, (Hk, r)) if a.ndim == 4 else \
        to_chunks(a[..., None], N, C, (Hk, r))[..., 0]
    if isinstance(g, tuple):
        gates = (gates, *(_chunk_parameters(x, Hk, r, a.ndim == 4) for x in g[1:]))
    Y, S_final, *S_in = core(to_chunks(q * scale, N, C, (Hk,)), to_chunks(k, N, C, (Hk,)),
                             to_chunks(v, N, C, (Hk, r)), gates,
                             to_chunks(beta[..., None], N, C, (Hk, r))[..., 0],
                             initial_state.reshape(B, Hk, r, Dv, Dk))
    y = from_chunks(Y, T)
    if mask is not None:
        y = xp.where(mask[..., None, None], y, 0.0)
    if entering:  # [N, B, Hk, r, Dv, Dk] -> [B, N, Hv, Dv, Dk]
        S_in = S_in[0].transpose((1, 0, 2, 3, 4, 5)).reshape(B, N, Hv, Dv, Dk)
        return y, S_final.reshape(B, Hv, Dv, Dk), S_in
    return y, S_final.reshape(B, Hv, Dv, Dk)


