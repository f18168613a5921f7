"""The recurrence one step at a time (the portable backends' recurrent path and the benchmark
baseline): float32 arrays in the API layout, state ``[B, Hv, Dv, Dk]``."""

from __future__ import annotations

from gdngen.algebra.layer_inputs import linear_decay


def recurrent_step(xp, S, q_t, k_t, v_t, a_t, beta_t):
    """One step of the recurrence on the state grouped by key head, every operand shaped to
    broadcast against it (`recurrent_forward`): ``S [B,Hk,r,Dv,Dk]``; q_t, k_t ``[B,Hk,1,1,Dk]``
    (q scaled); v_t ``[B,Hk,r,Dv]``; a_t the step's decay of the state's columns, ``[B,Hk,r,1,1]``
    (scalar gate) or ``[B,Hk,r,1,Dk]``; beta_t ``[B,Hk,r,1]``. Returns ``(S', y_t [B,Hk,r,Dv])``.
    It reads the state twice and writes it once: ``u = beta (v - S (a k))``, ``S' = S diag(a) +
    u k^T`` and ``y = S' q = S (a q) + u (k.q)`` (expanded, so S' is not read again)."""
    if a_t.shape[-1] == 1:  # a scalar decay scales the products, not the state's operand
        Sk = a_t[..., 0] * xp.dot_last(S, k_t)  # [B, Hk, r, Dv]
        Sq = a_t[..., 0] * xp.dot_last(S, q_t)
    else:
        Sk = xp.dot_last(S, a_t * k_t)
        Sq = xp.dot_last(S, a_t * q_t)
    u = beta_t * (v_t - Sk)
    y_t = Sq + u * (k_t * q_t).sum(axis=-1)
    return S * a_t + u[..., None] * k_t, y_t


def recurrent_forward(xp, q, k, v, g, beta, initial_state, *, scale, gate, steps=False):
    """The recurrence's forward one step at a time, the state carried whole (the portable
    backends' recurrent path; no VJP of its own, see `gdngen.config.recurrent_switch`).

    float32 arrays in the API layout, masked steps already folded into g and beta
    (`fold_mask`); g scalar ``[B,T,Hv]`` or per-channel ``[B,T,Hv,Dk]``. Returns ``(y [B,T,Hv,Dv],
    S_T)``. Each step is `recurrent_step` on the value heads grouped by key head (reshapes
    only: q and k broadcast, never repeated), made one fused kernel where the framework
    compiles eagerly called functions (``xp.compiled``); a single step (decode) is one such
    call, its reshapes included (`single_step`). ``steps``: the state after every step,
    ``[B,T,Hv,Dv,Dk]``, in place of S_T (the scan's output; differentiable by the framework).
    """
    a = linear_decay(xp, g, gate)  # exp of log g <= 0 only; -inf gives exactly 0
    if q.shape[1] == 1:
        y, S = xp.compiled(single_step)(q, k, v, a, beta, initial_state, scale)
        return (y, S[:, None]) if steps else (y, S)
    B, T, Hv, Dv = v.shape
    S0, xs = _grouped_by_key_head(q, k, v, a, beta, initial_state, scale)
    step = xp.compiled(recurrent_step)
    xs = tuple(x.swapaxes(0, 1) for x in xs)
    if steps:
        def step_and_state(S, x):
            S, y = step(S, *x)
            return S, (y, S)

        _, (y, Ss) = xp.scan(step_and_state, S0, xs, False)
        states = Ss.swapaxes(0, 1).reshape((B, T) + tuple(initial_state.shape[1:]))
        return y.swapaxes(0, 1).reshape(B, T, Hv, Dv), states
    S, y = xp.scan(lambda S, x: step(S, *x), S0, xs, False)
    return y.swapaxes(0, 1).reshape(B, T, Hv, Dv), S.reshape(initial_state.shape)


def single_step(xp, q, k, v, a, beta, initial_state, scale):
    """`recurrent_forward` of a one-step call (``a`` the decay), in the API layout."""
    S0, xs = _grouped_by_key_head(q, k, v, a, beta, initial_state, scale)
    S, y = recurrent_step(xp, S0, *(x.reshape(x.shape[:1] + x.shape[2:]) for x in xs))
    return y.reshape(v.shape), S.reshape(initial_state.shape)


def _grouped_by_key_head(q, k, v, a, beta, initial_state, scale):
    """``(S0, (q, k, v, a, beta))`` from the API layout, shaped as `recurrent_step` takes them
    with the time axis after B: value head h = j r + i is (j, i)."""
    B, T, Hk, Dk = q.shape
    Hv, Dv = v.shape[2], v.shape[3]
    r = Hv // Hk
    return initial_state.reshape(B, Hk, r, Dv, Dk), (
        (q * scale).reshape(B, T, Hk, 1, 1, Dk), k.reshape(B, T, Hk, 1, 1, Dk),
        v.reshape(B, T, Hk, r, Dv), a.reshape(B, T, Hk, r, 1, a.shape[3] if a.ndim == 4 else 1),
        beta.reshape(B, T, Hk, r, 1))


def sequential_gated_delta(xp, q, k, v, g, beta, initial_state, mask, *, scale, gate):
    """The recurrence one step at a time in float32 (the benchmark baseline).

    Shapes as the API; differentiated by the framework's autodiff through ``xp.scan``, so the
    backward keeps one state per step.
    """
    r = v.shape[2] // q.shape[2]
    a = xp.exp(g) if gate == "log" else g
    if mask is not None:
        a = xp.where(mask.reshape(mask.shape + (1,) * (a.ndim - 2)), a, 1.0)
        beta = xp.where(mask[..., None], beta, 0.0)
    q, k = (xp.repeat(x, r, axis=2) for x in (q * scale, k))
    a = a[..., None, :] if a.ndim == 4 else a[..., None, None]  # broadcast over [Dv, Dk]

    def step(S, xs):
        q_t, k_t, v_t, a_t, beta_t = xs  # [B, Hv, ...]
        S = a_t * S
        delta = beta_t[..., None] * (v_t - (S @ k_t[..., None])[..., 0])
        S = S + delta[..., None] * k_t[..., None, :]
        return S, (S @ q_t[..., None])[..., 0]

    S, y = xp.scan(step, initial_state, tuple(x.swapaxes(0, 1) for x in (q, k, v, a, beta)), False)
    y = y.swapaxes(0, 1)
    if mask is not None:
        y = xp.where(mask[..., None, None], y, 0.0)
    return y, S
