"""Framework-neutral chunkwise gated delta rule for per-channel gates (Kimi Delta Attention).

The gate ``a_t = exp(b_t)`` is a vector over Dk and decays the state column-wise,
``S_t = S_{t-1} diag(a_t) + beta_t (v_t - S_{t-1} diag(a_t) k_t) k_t^T``. The chunk algebra is
`gdngen.algebra.chunkwise`'s (same layout, same ``xp`` namespace, same exact triangular inverse)
with every decay factor a vector: tokens 0..C-1 of a chunk entering with S0, ``d(t, j)`` the decay
over (j, t] (``exp(sum_{j<m<=t} b_m)``, per channel), ``D0[t] = d(t, start)`` (tokens 0..t),
``DC[j]`` the decay over (j, C-1] and ``dCC`` over the whole chunk. Then

    M_xy[t, j] = sum_d x_t[d] y_j[d] d(t, j)[d]     (j <= t; "decayed products")
    A = strict(diag(beta) M_kk),   T = (I + A)^{-1},
    U = T diag(beta) V,            Wk = T diag(beta) (K * D0),   W = U - Wk S0^T,
    Y = (Q * D0) S0^T + M_qk W,    S_C = S0 diag(dCC) + W^T (K * DC).

A decayed product is no longer one matmul of bounded factors: ``(X e^G)(Y e^-G)^T`` needs exp
of a positive number. It is built on sub-chunks of `SUB_CHUNK` tokens (`anchored_segments`):

* for t in sub-chunk I and j in an earlier sub-chunk J, ``d(t, j) = F_I[t] H_IJ L_J[j]``: the
  products of the gates over (start of I, t], over the sub-chunks strictly between (their
  totals) and over (j, end of J]. All three are products of gates in [0, 1], so bounded by 1,
  and the block is one matmul ``(X_I F_I) (Y_J L_J H_IJ)^T``;
* pairs inside one sub-chunk are formed one offset at a time (`pair_bands`): for
  ``delta = t - j`` the products over (t - delta, t] per channel, ``E_delta[t] = a_t
  E_{delta-1}[t-1]`` (the multiplicative form of Mamba-2's ``segsum``, a band of the [c, c]
  segment matrix at a time), so no [c, c, Dk] tensor is ever formed: every intermediate of
  the products is the size of the gates (peak memory, measured in MLX: see
  `decayed_products`).

Every factor is a product of its own gates (one exp per log gate, never one per factor), never
a ratio or a difference of cumulative sums, so no digits are lost (``ulp(170) = 1.5e-5``) and
log g = -inf gives an exact 0.

The backward (`backward`) is hand-derived like the scalar one. The gate cotangent keeps the
straddle-sum rule per channel: each product's cotangent is turned into the terms
``P = (cotangent of a decay factor) * (that factor)``, each already carrying the gates it spans,
and d/db_m is a sum of the P that straddle m (`anchored_sums_adjoint`: the transpose of the
linear map b -> (F, H, L, pairwise sums)). Linear gates (``gate="linear"``) get
``(d/db) / a`` where a > 0 and, where a channel's gate is exactly 0, the sum of the P of the
segments in which it is the only zero, evaluated with that zero taken as 1 (the loss is affine
in each gate), via `zero_gate_factors`.
"""

from __future__ import annotations

from gdngen.algebra.chunkwise import (
    _T,
    _optional,
    _sum_heads,
    solve_unit_lower,
    solve_unit_lower_vjp,
)

#: tokens per sub-chunk of the decayed products (a divisor of the chunk; smaller chunks use
#: themselves): pairwise work and memory grow with it, the anchored matmuls shrink
SUB_CHUNK = 8


def sub_chunk_size(C: int) -> int:
    c = min(SUB_CHUNK, C)
    while C % c:
        c //= 2
    return c


# --------------------------------------------------------------------------- anchored sums

def _split(x, c):
    """``[..., C, Dk] -> [..., n, c, Dk]``."""
    return x.reshape(x.shape[:-2] + (x.shape[-2] // c, c, x.shape[-1]))


def _merge(x):
    """``[..., n, c, Dk] -> [..., C, Dk]``."""
    return x.reshape(x.shape[:-3] + (x.shape[-3] * x.shape[-2], x.shape[-1]))


def _shift_down(xp, x, axis, fill=0.0):
    """x shifted one step along ``axis`` (a negative axis): out[i] = x[i-1], out[0] = fill."""
    n = x.shape[axis]
    head = [slice(None)] * x.ndim
    head[axis] = slice(0, n - 1)
    edge = list(x.shape)
    edge[axis] = 1
    return xp.concatenate([xp.zeros(tuple(edge)) + fill, x[tuple(head)]], axis=axis)


def _shift_up(xp, x, axis, fill=0.0):
    """out[i] = x[i+1], out[n-1] = fill."""
    n = x.shape[axis]
    tail = [slice(None)] * x.ndim
    tail[axis] = slice(1, n)
    edge = list(x.shape)
    edge[axis] = 1
    return xp.concatenate([x[tuple(tail)], xp.zeros(tuple(edge)) + fill], axis=axis)


#: the two ways the segments are accumulated: log gates / zero counts add, linear gates multiply
SUM, PRODUCT = "sum", "product"


def _scan(xp, x, axis, op, reverse=False):
    return (xp.cumsum if op == SUM else xp.cumprod)(x, axis=axis, reverse=reverse)


def anchored_segments(xp, x, c, op=SUM):
    """Per-token values ``x [..., C, Dk]`` accumulated (``op``: added, or multiplied) over the
    segments the decayed products use, on sub-chunks of c tokens.

    The segment (j, t] for t in sub-chunk I and j in an earlier J splits into ``F[I, t]`` over
    (start of I, t] (t included; ``[..., n, c, Dk]``), ``H[I, J]`` the whole sub-chunks strictly
    between J and I (``[..., nI, nJ, Dk]``, the identity unless I > J) and ``L[J, j]`` over
    (j, end of J] (``[..., n, c, Dk]``); the pairs inside one sub-chunk are `pair_bands`'.
    Each accumulates its own terms only (sub-chunk totals taken whole), never a difference or
    a ratio: sums of log gates are exact to their own rounding, products of gates in [0, 1]
    stay bounded, and a zero gate (-inf log gate) gives an exact zero factor.
    """
    one = 0.0 if op == SUM else 1.0
    xs = _split(x, c)
    F = _scan(xp, xs, -2, op)
    L = _scan(xp, _shift_up(xp, xs, -2, one), -2, op, reverse=True)
    n = xs.shape[-3]
    later = xp.tril_mask(n, -1)[:, :, None]  # I' > J
    H = _shift_down(xp, _scan(xp, xp.where(later, F[..., :, None, -1, :], one), -3, op), -3,
                    one)
    return F, H, L


def pair_bands(xp, x, op=PRODUCT):
    """The in-sub-chunk segments by offset: for delta = 0, 1, ..., c-1 (a generator), ``x``
    (per token, ``[..., n, c, Dk]``, split in sub-chunks) accumulated over (t - delta, t] for
    every t of each sub-chunk, ``[..., n, c, Dk]``: the delta-th subdiagonal of the pairwise
    segment matrix S[t, j] over (j, t]. Entries with t < delta (a pair reaching into the
    previous sub-chunk) are 0. Built by recursion on delta, ``E_delta[t] = x_t op
    E_{delta-1}[t-1]`` (``E_0`` the identity of ``op``): each band accumulates its own terms."""
    c = x.shape[-2]
    band = xp.zeros(tuple(x.shape)) + (0.0 if op == SUM else 1.0)
    for delta in range(c):
        if delta and op == SUM:
            band = xp.where(xp.tril_mask(c, -delta)[:, :1], x + _shift_rows(xp, band, 1), 0.0)
        elif delta:  # a zero shifted in at t = delta - 1 leaves t < delta at 0
            band = x * _shift_rows(xp, band, 1)
        yield band


def _pair_factors(xp, diag):
    """The bands of `pair_bands` of the pairwise factors ``diag = (a, zeros)``: products of
    the gates ``a [..., n, c, Dk]``, and where ``zeros`` (the zero indicator, or None) is
    given, only on the segments holding exactly one zero (`zero_gate_factors`)."""
    a, zeros = diag
    if zeros is None:
        yield from pair_bands(xp, a)
        return
    for E, count in zip(pair_bands(xp, a), pair_bands(xp, zeros, SUM)):
        yield xp.where(count == 1, E, 0.0)


def pair_sums_adjoint(xp, P):
    """Transpose of b -> (bands 1..c-1 of ``pair_bands(b, SUM)``): ``db [..., n, c, Dk]``
    from ``P`` (the list of the bands' cotangents, delta = 1..c-1, each ``[..., n, c, Dk]``
    and 0 at t < delta, where the band holds no pair).

    ``db_m = sum_{s>=0} Ptail_{s+1}[m+s]`` with ``Ptail_e = sum_{delta>=e} P_delta`` (the
    segment (t - delta, t] holds m iff t - delta < m <= t): suffix sums over delta, then a
    Horner sum of one-step shifts; no differences."""
    tail = acc = None
    for P_delta in reversed(P):
        tail = P_delta if tail is None else tail + P_delta
        acc = tail if acc is None else tail + _shift_up(xp, acc, -2)
    return 0.0 if acc is None else _merge(acc)


def anchored_sums_adjoint(xp, dF, dH, dL):
    """Transpose of the linear map b -> (F, H, L) of `anchored_segments` (sums of log
    gates): ``db [..., C, Dk]``.

    Fed the P terms (cotangent of a factor times the factor), every output is a sum of P
    terms straddling its position: suffix / prefix sums and whole-block sums, no differences.
    """
    n, c = dL.shape[-3], dL.shape[-2]
    d_terms = xp.cumsum(_shift_up(xp, dH, -3), axis=-3, reverse=True)
    d_totals = xp.where(xp.tril_mask(n, -1)[:, :, None], d_terms, 0.0).sum(axis=-2)
    dF = dF + xp.concatenate([xp.zeros(d_totals.shape[:-1] + (c - 1, d_totals.shape[-1])),
                              d_totals[..., None, :]], axis=-2)
    dbs = xp.cumsum(dF, axis=-2, reverse=True)
    return _merge(dbs + _shift_down(xp, xp.cumsum(dL, axis=-2), -2))


def chunk_segments(xp, x, op=SUM):
    """``x [..., C, Dk]`` accumulated over the segments of D0 (tokens 0..t), DC ((j, C-1]) and
    dCC (the whole chunk)."""
    one = 0.0 if op == SUM else 1.0
    first = _scan(xp, x, -2, op)
    return first, _scan(xp, _shift_up(xp, x, -2, one), -2, op, reverse=True), first[..., -1, :]


def chunk_sums_adjoint(xp, d0, dc, dcc):
    """Transpose of `chunk_segments` for sums (fed P terms, like `anchored_sums_adjoint`)."""
    return (xp.cumsum(d0, axis=-2, reverse=True) + _shift_down(xp, xp.cumsum(dc, axis=-2), -2)
            + dcc[..., None, :])


# --------------------------------------------------------------------------- factors

def gate_factors(xp, a, c):
    """Decay factors of the linear gates a ``[..., C, Dk]`` (each in [0, 1]): ``(blocks, (D0,
    DC, dCC))``, products of the gates over each segment (one exp per gate for log gates,
    never one per factor).

    ``blocks = (terms, diag)``: ``terms`` a list of separable factor triples ``(EF, EH, EL)``
    (the products F, H, L of `anchored_segments`; EH zero unless I > J), here one; ``diag =
    (gates [..., n, c, Dk], None)`` what the in-sub-chunk factors are built from, a band at a
    time, where they are used (`_pair_factors`)."""
    F, H, L = anchored_segments(xp, a, c, PRODUCT)
    n = L.shape[-3]
    EH = xp.where(xp.tril_mask(n, -1)[:, :, None], H, 0.0)
    return ([(F, EH, L)], (_split(a, c), None)), chunk_segments(xp, a, PRODUCT)


def zero_gate_factors(xp, a, c):
    """The factors of `gate_factors` for linear gates ``a`` with every exact zero taken as 1,
    restricted to the segments holding exactly one zero (d/da at a zero gate: the loss is
    affine in each gate). An anchored segment F + H + L holds its one zero in one of the three
    parts, so the blocks become three separable terms."""
    zero = a == 0
    ones = xp.where(zero, 1.0, a)
    count = xp.where(zero, 1.0, 0.0)
    F, H, L = anchored_segments(xp, ones, c, PRODUCT)
    cF, cH, cL = anchored_segments(xp, count, c)
    n = L.shape[-3]
    H = xp.where(xp.tril_mask(n, -1)[:, :, None], H, 0.0)

    def only(e, c_, k):
        return xp.where(c_ == k, e, 0.0)

    terms = [(only(F, cF, 0), only(H, cH, 0), only(L, cL, 1)),
             (only(F, cF, 0), only(H, cH, 1), only(L, cL, 0)),
             (only(F, cF, 1), only(H, cH, 0), only(L, cL, 0))]
    vectors = tuple(only(e, n_, 1) for e, n_ in
                    zip(chunk_segments(xp, ones, PRODUCT), chunk_segments(xp, count)))
    return (terms, (_split(ones, c), _split(count, c))), vectors


# --------------------------------------------------------------------------- decayed products

def _blocks_to_matrix(x):
    """``[..., nI, nJ, c, c] -> [..., C, C]``."""
    n, c = x.shape[-3], x.shape[-1]
    x = x.swapaxes(-3, -2)  # [.., nI, c(t), nJ, c(j)]
    return x.reshape(x.shape[:-4] + (n * c, n * c))


def _matrix_to_blocks(x, c):
    n = x.shape[-1] // c
    x = x.reshape(x.shape[:-2] + (n, c, n, c))
    return x.swapaxes(-3, -2)


def _shift_rows(xp, x, steps):
    """``x [..., c, Dk]`` moved ``steps`` rows down (up if negative) inside each sub-chunk,
    zeros coming in: out[t] = x[t - steps]."""
    if steps == 0:
        return x
    c = x.shape[-2]
    edge = xp.zeros(tuple(x.shape[:-2]) + (abs(steps), x.shape[-1]))
    if steps > 0:
        return xp.concatenate([edge, x[..., :c - steps, :]], axis=-2)
    return xp.concatenate([x[..., -steps:, :], edge], axis=-2)


def _subdiagonal(xp, c, delta):
    """``[c, c]`` float: 1 where t - j == delta, else 0."""
    return (xp.where(xp.tril_mask(c, -delta), 1.0, 0.0)
            * xp.where(xp.tril_mask(c, -delta - 1), 0.0, 1.0))


def decayed_products(xp, x, y, blocks):
    """``M [..., r, C, C]``, M[t, j] = sum_d x_t[d] y_j[d] d(t, j)[d] for j <= t (0 above).

    ``x``, ``y``: key-head ``[..., C, Dk]`` (shared by the r value heads); ``blocks``: the
    ``(terms, diag)`` of `gate_factors` (per value head, ``[..., r, ...]``). Block (I, J < I)
    is ``(X_I EF_I) ((Y_J EL_J) EH_IJ)^T``, one matmul; the blocks I = J are built one offset
    delta = t - j at a time, ``M[t, t - delta] = sum_d x_t y_{t-delta} E_delta[t]``
    (`pair_bands`), and the blocks I > J one J at a time: each intermediate has the size of
    the gates (MLX, T = 2048, Hv = 8, D = 128, chunk 32, fwd+bwd with every gradient: peak
    665 MiB, 888 MiB with [c, c, Dk] pairwise factors and all (I, J) blocks at once; 298 MiB
    with the backward `by_chunk_groups`)."""
    terms, diag = blocks
    c, n = diag[0].shape[-2], diag[0].shape[-3]
    xs, ys = _split(x, c)[..., None, :, :, :], _split(y, c)[..., None, :, :, :]
    M = 0.0
    for EF, EH, EL in terms:
        XF, YL = xs * EF, ys * EL
        M = M + xp.stack([XF @ _T(YL[..., J, None, :, :] * EH[..., :, J, None, :])
                          for J in range(n)], axis=-3)  # one J at a time: [.., r, nI, c, c]
    Md = 0.0  # [.., r, n, c, c]
    for delta, E in enumerate(_pair_factors(xp, diag)):
        m = xp.mul_sum(xs * _shift_rows(xp, ys, delta), E, -1)  # [.., r, n, c]
        Md = Md + m[..., None] * _subdiagonal(xp, c, delta)
    M = M + xp.where(xp.eye(n)[:, :, None, None] > 0, Md[..., :, None, :, :], 0.0)
    return _blocks_to_matrix(M)


def decayed_products_vjp(xp, x, y, blocks, dM, *, inputs=True):
    """Cotangents of `decayed_products` from ``dM [..., r, C, C]`` (read on and below the
    diagonal): ``(dx, dy, db)`` with dx, dy per value head ``[..., r, C, Dk]`` (the caller sums
    over r) and db ``[..., r, C, Dk]`` the log-gate cotangent (straddle sums of the P terms).
    ``inputs=False``: only db (dx, dy None)."""
    terms, diag = blocks
    c, n = diag[0].shape[-2], diag[0].shape[-3]
    xs, ys = _split(x, c)[..., None, :, :, :], _split(y, c)[..., None, :, :, :]
    dMb = _matrix_to_blocks(dM, c)  # [.., r, nI, nJ, c, c]
    dx = dy = P_F = P_H = P_L = 0.0
    for EF, EH, EL in terms:
        XF, YL = xs * EF, ys * EL
        dXF, dYL, dH = 0.0, [], []
        for J in range(n):  # one sub-chunk J at a time: intermediates [.., r, nI, c, Dk]
            dM_J, EH_J = dMb[..., :, J, :, :], EH[..., :, J, None, :]  # [.., r, nI, c, c]
            dXF = dXF + (dM_J @ YL[..., J, None, :, :]) * EH_J
            dYLH_J = _T(dM_J) @ XF  # cotangent of (Y_J L_J H_IJ) for every I
            dYL.append(xp.mul_sum(dYLH_J, EH_J, -3))  # [.., r, c, Dk]
            dH.append(xp.mul_sum(dYLH_J, YL[..., J, None, :, :], -2) * EH_J[..., 0, :])
        dYL = xp.stack(dYL, axis=-3)  # [.., r, nJ, c, Dk]
        P_F = P_F + dXF * XF
        P_H = P_H + xp.stack(dH, axis=-2)  # [.., r, nI, nJ, Dk]
        P_L = P_L + dYL * YL
        if inputs:
            dx = dx + dXF * EF
            dy = dy + dYL * EL
    dMd = xp.where(xp.eye(n)[:, :, None, None] > 0, dMb, 0.0).sum(axis=-3)  # [.., r, n, c, c]
    # the cotangents of the bands' factors first (each band then dies with the next), the
    # rest from them with the bands' P terms in reverse for `pair_sums_adjoint`'s Horner sum
    dE = [(dMd * _subdiagonal(xp, c, delta)).sum(axis=-1)[..., None] * E  # [.., r, n, c, Dk]
          for delta, E in enumerate(_pair_factors(xp, diag))]
    tail = pairs = None
    for delta in range(c - 1, -1, -1):
        x_pair = dE[delta] * _shift_rows(xp, ys, delta)  # times y_{t-delta}
        if inputs:
            dx = dx + x_pair
            dy = dy + _shift_rows(xp, dE[delta] * xs, -delta)
        if delta:  # band 0 holds no gate
            tail = x_pair * xs if tail is None else tail + x_pair * xs
            pairs = tail if pairs is None else tail + _shift_rows(xp, pairs, -1)
    db = anchored_sums_adjoint(xp, P_F, P_H, P_L) + (0.0 if pairs is None else _merge(pairs))
    if not inputs:
        return None, None, db
    return _merge(dx), _merge(dy), db


# --------------------------------------------------------------------------- chunk stages
# Layout as `gdngen.algebra.chunkwise`: q, k [N, B, H, C, Dk] (q times scale); v [N, B, H, r, C,
# Dv]; gates [N, B, H, r, C, Dk]; beta [N, B, H, r, C]; states [B, H, r, Dv, Dk].


def _linear(xp, gates, gate):
    """Linear gates of log or linear ``gates`` (exp of a log gate <= 0: exact 0 at -inf)."""
    return xp.exp(gates) if gate == "log" else gates


def _factors(xp, gates, gate, C):
    """`gate_factors` of log or linear gates."""
    return gate_factors(xp, _linear(xp, gates, gate), sub_chunk_size(C))


def _wy(xp, k, v, beta, blocks, D0, solve_block):
    """T = (I + strict(beta M_kk))^{-1}, U = T diag(beta) V, Wk = T diag(beta) (K * D0), and
    the decayed key products M_kk [.., r, C, C]."""
    C = k.shape[-2]
    Mkk = decayed_products(xp, k, k, blocks)
    A = xp.where(xp.tril_mask(C, -1), beta[..., :, None] * Mkk, 0.0)
    Tinv = solve_unit_lower(xp, xp.eye(C) + A, solve_block)
    U = Tinv @ (beta[..., None] * v)
    Wk = Tinv @ (beta[..., None] * (k[..., None, :, :] * D0))
    return Tinv, U, Wk, Mkk


def forward(xp, q, k, v, gates, beta, S0, *, gate, solve_block=8, inject=None, walk=None):
    """Chunkwise forward for per-channel gates; returns ``(Y, S_final, residuals)`` as
    `gdngen.algebra.chunkwise.forward` does (``inject`` as there), the residuals ``(S_in, W, Tinv,
    Wk, Pm, Mkk)`` adding the decayed products ``M_qk``, ``M_kk`` [N,B,H,r,C,C] (C/Dk of the
    keys' size; the backward would otherwise rebuild them from the factors).

    ``walk``: the sequential stage (default `walk_forward`, an ``xp.scan``); a generated
    backend passes its kernel with the same contract, the intra-chunk stages staying here."""
    C = k.shape[-2]
    blocks, (D0, DC, dCC) = _factors(xp, gates, gate, C)
    Tinv, U, Wk, Mkk = _wy(xp, k, v, beta, blocks, D0, solve_block)
    Qd = q[..., None, :, :] * D0  # [.., r, C, Dk]
    Kc = k[..., None, :, :] * DC
    Pm = decayed_products(xp, q, k, blocks)
    Y, S_final, S_in, W = (walk or walk_forward)(xp, S0, U, Wk, Kc, Qd, Pm, dCC, inject)
    return Y, S_final, (S_in, W, Tinv, Wk, Pm, Mkk)


def walk_forward(xp, S0, U, Wk, Kc, Qd, Pm, dCC, inject=None):
    """The chunk walk of `forward`: ``(Y, S_final, S_in, W)``.

    Per chunk n (chunk layout: U [N,B,H,r,C,Dv]; Wk, Kc, Qd [N,B,H,r,C,Dk]; Pm [N,B,H,r,C,C];
    dCC [N,B,H,r,Dk]; S [B,H,r,Dv,Dk]; ``inject`` None or [N,B,H,r,Dv,Dk])::

        W = U - Wk S^T,   Y = Qd S^T + Pm W,   S' = S diag(dCC) + W^T Kc (+ inject[n]).

    Returns Y, W [N,B,H,r,C,Dv], the state after the last chunk and the states entering each
    chunk S_in [N,B,H,r,Dv,Dk]."""
    ein = xp.einsum

    def step(S, xs):
        U_n, Wk_n, Kc_n, Qd_n, Pm_n, dCC_n, *J_n = xs
        W = U_n - ein("...rck,...rvk->...rcv", Wk_n, S)
        Y = ein("...rck,...rvk->...rcv", Qd_n, S) + Pm_n @ W
        S_out = S * dCC_n[..., None, :] + ein("...rcv,...rck->...rvk", W, Kc_n)
        return (S_out + J_n[0] if J_n else S_out), (Y, S, W)

    S_final, (Y, S_in, W) = xp.scan(step, S0, (U, Wk, Kc, Qd, Pm, dCC) + _optional(inject),
                                    False)
    return Y, S_final, S_in, W


def backward(xp, q, k, v, gates, beta, residuals, dY, dS_final, *, gate, dS_in=None,
             walk=None, chunk_group=None):
    """Hand-derived VJP of `forward`: ``(dq, dk, dv, dgates, dbeta, dS0)``, plus the
    cotangent of ``inject`` when ``dS_in`` is given (both as in
    `gdngen.algebra.chunkwise.backward`).

    The chunk walk in reverse is the scalar one's with per-channel decays (dW = Pm^T dY +
    Kc dS_out^T, dS_in = dS_out diag(dCC) + dY^T (Q*D0) - dW^T Wk); the cotangents of the decay
    factors then go through the straddle-sum adjoints, and for linear gates through the
    exact-zero rule (module docstring). ``walk``: the reverse walk (default `walk_backward`).
    ``chunk_group``: the chunk-local stages after the walk (`backward_in_chunks`) run
    `by_chunk_groups` of that many chunks (None: all chunks at once).
    """
    S_in, W, Tinv, Wk, Pm, Mkk = residuals
    D0, DC, dCC = chunk_segments(xp, _linear(xp, gates, gate), PRODUCT)  # what the walk needs
    G = _T(Pm) @ dY
    dS0, dW, dWk, dQd, dKc, ddCC, dJ = (walk or walk_backward)(
        xp, dS_final, G, k[..., None, :, :] * DC, Wk, W, S_in, dY, q[..., None, :, :] * D0,
        dCC, dS_in)
    grads = by_chunk_groups(
        xp, lambda *arrays: backward_in_chunks(xp, *arrays, gate=gate), chunk_group,
        q, k, v, gates, beta, W, Tinv, Mkk, dY, dW, dWk, dQd, dKc, ddCC)
    return grads[:5] + (dS0,) + (() if dJ is None else (dJ,))


def backward_in_chunks(xp, q, k, v, gates, beta, W, Tinv, Mkk, dY, dW, dWk, dQd, dKc, ddCC, *,
                       gate):
    """The chunk-local part of `backward`, from the reverse walk's cotangents of W, Wk,
    Q * D0, K * DC and dCC (and the forward's W, T, M_kk): ``(dq, dk, dv, dgates, dbeta)``.
    Every array holds whole chunks along its leading axis, and so do the results."""
    ein = xp.einsum
    C = k.shape[-2]
    blocks, (D0, DC, dCC) = _factors(xp, gates, gate, C)
    qr, kr = q[..., None, :, :], k[..., None, :, :]
    # Y = Qd S^T + Pm W ;  S_out = S_in diag(dCC) + W^T Kc
    dq = _sum_heads(dQd * D0)
    dD0 = dQd * qr
    dk = _sum_heads(dKc * DC)
    dDC = dKc * kr
    dPm = dY @ _T(W)
    # W = U - Wk S^T ;  U = T (beta V) ;  Wk = T (beta K D0)
    KD0 = kr * D0
    dTinv = dW @ _T(beta[..., None] * v) + dWk @ _T(beta[..., None] * KD0)
    dbv = _T(Tinv) @ dW
    dbk = _T(Tinv) @ dWk  # cotangent of beta * (K * D0)
    dv = beta[..., None] * dbv
    dbeta = ein("...cv,...cv->...c", dbv, v) + ein("...ck,...ck->...c", dbk, KD0)
    dk = dk + _sum_heads(beta[..., None] * dbk * D0)
    dD0 = dD0 + beta[..., None] * dbk * kr
    # A = strict(beta M_kk) ;  d(L^{-1}) = -L^{-1} dL L^{-1}
    dA = solve_unit_lower_vjp(xp, Tinv, dTinv)
    dbeta = dbeta + ein("...cd,...cd->...c", dA, Mkk)
    dMkk = beta[..., :, None] * dA
    dq_p, dk_p, db = decayed_products_vjp(xp, q, k, blocks, dPm)
    dk_a, dk_b, db_a = decayed_products_vjp(xp, k, k, blocks, dMkk)
    dq = dq + _sum_heads(dq_p)
    dk = dk + _sum_heads(dk_p + dk_a + dk_b)
    vector_terms = (dD0, dDC, ddCC)
    db = db + db_a + chunk_sums_adjoint(
        xp, *(dX * X for dX, X in zip(vector_terms, (D0, DC, dCC))))
    if gate == "log":
        return dq, dk, dv, db, dbeta
    # linear gates: d/da = (d/db) / a, and the exact-zero rule where a == 0
    zero_blocks, zero_vectors = zero_gate_factors(xp, gates, sub_chunk_size(C))
    d_zero = (decayed_products_vjp(xp, q, k, zero_blocks, dPm, inputs=False)[2]
              + decayed_products_vjp(xp, k, k, zero_blocks, dMkk, inputs=False)[2]
              + chunk_sums_adjoint(xp, *(dX * X for dX, X in zip(vector_terms, zero_vectors))))
    zero = gates == 0
    dgates = xp.where(zero, d_zero, db / xp.where(zero, 1.0, gates))
    return dq, dk, dv, dgates, dbeta


def by_chunk_groups(xp, fn, group, *arrays):
    """``fn(*arrays)`` for a chunk-local ``fn`` (every argument and result ``[N, ...]``, chunk
    n of a result depending on chunk n of the arguments only), evaluated ``group`` chunks at a
    time (``group`` None: once, on all N).

    The groups' results are packed into one array per group ``[group, -1]`` and those joined
    along the chunks: a lazy framework (MLX evaluates a graph depth-first, inputs in order)
    then finishes one group before it starts the next, so the intermediates of ``fn`` live for
    one group only. Measured (MLX CPU, T=2048, Hv=8, D=128, chunk 32): ``decayed_products_vjp``
    alone 310 MiB above what was resident at once, 187 MiB in groups of 8 chunks."""
    N = arrays[0].shape[0]
    if group is None or group >= N:
        return fn(*arrays)
    parts = []
    for start in range(0, N, group):
        outs = fn(*(x[start:start + group] for x in arrays))
        parts.append(xp.concatenate([o.reshape(o.shape[0], -1) for o in outs], axis=1))
    packed, results, column = xp.concatenate(parts, axis=0), [], 0
    for o in outs:
        size = o[0].size
        results.append(packed[:, column:column + size].reshape((N,) + tuple(o.shape[1:])))
        column += size
    return tuple(results)


def walk_backward(xp, dS_final, G, Kc, Wk, W, S_in, dY, Qd, dCC, dS_in=None):
    """The reverse chunk walk of `backward`: ``(dS0, dW, dWk, dQd, dKc, ddCC, dinject)``.

    Shapes as `walk_forward` (G = Pm^T dY and dY [N,B,H,r,C,Dv]; ``dS_in`` None or the
    cotangent of the entering states [N,B,H,r,Dv,Dk]). Per chunk n in reverse, from the
    cotangent dS' of the state leaving it::

        dW = G + Kc dS'^T,            dWk = -dW S,   dQd = dY S,   dKc = W dS',
        ddCC = sum_v dS' * S,         dS = dS' diag(dCC) + dY^T Qd - dW^T Wk (+ dS_in[n]).

    dinject [N,B,H,r,Dv,Dk] (the cotangent of the state leaving each chunk) when ``dS_in`` is
    given, else None."""
    ein = xp.einsum

    def step(dS_out, xs):
        G_n, Kc_n, Wk_n, W_n, S_n, dY_n, Qd_n, dCC_n, *dS_n = xs
        dW = G_n + ein("...rck,...rvk->...rcv", Kc_n, dS_out)
        dS_prev = (dS_out * dCC_n[..., None, :] + ein("...rcv,...rck->...rvk", dY_n, Qd_n)
                   - ein("...rcv,...rck->...rvk", dW, Wk_n))
        return (dS_prev + dS_n[0] if dS_n else dS_prev), (
            dW, -ein("...rcv,...rvk->...rck", dW, S_n), ein("...rcv,...rvk->...rck", dY_n, S_n),
            ein("...rcv,...rvk->...rck", W_n, dS_out), (dS_out * S_n).sum(axis=-2)
        ) + _optional(dS_out if dS_n else None)

    dS0, (dW, dWk, dQd, dKc, ddCC, *dJ) = xp.scan(
        step, dS_final, (G, Kc, Wk, W, S_in, dY, Qd, dCC) + _optional(dS_in), True)
    return dS0, dW, dWk, dQd, dKc, ddCC, (dJ[0] if dJ else None)
