"""Float64 NumPy reference for the gated delta rule: forward and hand-derived backward (BPTT).

No autodiff: the backward pass walks t = T-1..0 carrying dS. Per value head h (key head
h // r, r = Hv / Hk) and unmasked step t, with a_t the linear gate (``exp(g_t)`` for
gate="log", ``g_t`` for gate="linear")::

    S'_t = a_t S_{t-1}            (vector gate: S_{t-1} @ diag(a_t), column-wise over Dk)
    u_t = S'_t k_t,  delta_t = beta_t (v_t - u_t)
    S_t = S'_t + delta_t k_t^T,   y_t = scale * S_t q_t

A masked step (mask[b, t] False) keeps S_t = S_{t-1}, gives y_t = 0, and receives zero
gradients. Shapes: q, k ``[B,T,Hk,Dk]``; v ``[B,T,Hv,Dv]``; g ``[B,T,Hv]`` or ``[B,T,Hv,Dk]``;
beta ``[B,T,Hv]``; state ``[B,Hv,Dv,Dk]``; mask ``[B,T]`` bool. Everything is float64.
"""

from __future__ import annotations

import numpy as np

from gdngen.shape import check_call

__all__ = ["forward", "vjp"]


class _Spec:
    """Shape stand-in so `check_call` validates shapes while the reference accepts float64."""

    dtype = "float32"

    def __init__(self, shape):
        self.shape = tuple(shape)


def _prepare(q, k, v, g, beta, initial_state, mask, scale, gate):
    q, k, v, g, beta = (np.asarray(x, dtype=np.float64) for x in (q, k, v, g, beta))
    if mask is not None:
        mask = np.asarray(mask)
    s0 = None if initial_state is None else _Spec(np.shape(initial_state))
    shape = check_call(_Spec(q.shape), _Spec(k.shape), _Spec(v.shape), _Spec(g.shape),
                       _Spec(beta.shape), s0, mask, gate=gate, scale=scale)
    B, T, Hv, Dv, Dk = shape.B, shape.T, shape.Hv, shape.Dv, shape.Dk
    if initial_state is None:
        s0 = np.zeros((B, Hv, Dv, Dk))
    else:
        s0 = np.asarray(initial_state, dtype=np.float64)
    m = np.ones((B, T), dtype=bool) if mask is None else mask.astype(bool)
    # Expand key heads to value heads: value head h reads key head h // group.
    qh = np.repeat(q, shape.group, axis=2)
    kh = np.repeat(k, shape.group, axis=2)
    with np.errstate(over="ignore"):
        a = np.exp(g) if gate == "log" else g.copy()  # exp(-inf) == 0 exactly
    return shape, qh, kh, v, g, a, beta, s0, m


def _decay(S, a_t, vector_gate):
    """a_t * S with a_t [B,H] (scalar gate) or [B,H,Dk] (column-wise over Dk)."""
    return S * (a_t[:, :, None, :] if vector_gate else a_t[:, :, None, None])


def _run(shape, qh, kh, v, a, beta, s0, m, scale):
    """Forward pass; returns y [B,T,Hv,Dv] and states [T+1,B,Hv,Dv,Dk] (states[t] = S_{t-1})."""
    B, T, Hv, Dv, Dk = shape.B, shape.T, shape.Hv, shape.Dv, shape.Dk
    states = np.empty((T + 1, B, Hv, Dv, Dk))
    states[0] = s0
    y = np.zeros((B, T, Hv, Dv))
    S = s0
    for t in range(T):
        k_t, mt = kh[:, t], m[:, t, None, None, None]
        Sp = _decay(S, a[:, t], shape.vector_gate)
        u = np.einsum("bhij,bhj->bhi", Sp, k_t)
        delta = beta[:, t, :, None] * (v[:, t] - u)
        S = np.where(mt, Sp + delta[..., :, None] * k_t[..., None, :], S)
        y[:, t] = np.where(m[:, t, None, None],
                           scale * np.einsum("bhij,bhj->bhi", S, qh[:, t]), 0.0)
        states[t + 1] = S
    return y, states


def _fold_heads(x, shape):
    """Sum a value-head gradient [B,T,Hv,Dk] over each key head's group -> [B,T,Hk,Dk]."""
    return x.reshape(shape.B, shape.T, shape.Hk, shape.group, x.shape[-1]).sum(axis=3)


def forward(q, k, v, g, beta, initial_state=None, *, mask=None, scale=1.0, gate="log"):
    """Run the gated delta rule in float64; return (y [B,T,Hv,Dv], final_state [B,Hv,Dv,Dk])."""
    shape, qh, kh, v, _, a, beta, s0, m = _prepare(q, k, v, g, beta, initial_state, mask,
                                                   scale, gate)
    y, states = _run(shape, qh, kh, v, a, beta, s0, m, scale)
    return y, states[-1]


def vjp(q, k, v, g, beta, initial_state, dy, dfinal_state, *, mask=None, scale=1.0,
        gate="log", steps=False, dg_scale=False):
    """Forward plus vector-Jacobian product of the loss <y, dy> + <final_state, dfinal_state>.

    ``initial_state`` None means zeros (``dinitial_state`` is still returned); ``dy`` or
    ``dfinal_state`` None means zeros. Returns a dict with "y", "final_state" and the gradients
    "dq", "dk", "dv", "dg", "dbeta", "dinitial_state", each with its input's shape; "dg" is in
    the gate's own convention (gate="log": d/d g_log, exactly 0 where g = -inf). ``steps``:
    also "states", the state after every step [B,T,Hv,Dv,Dk]. ``dg_scale``: also "dg_scale",
    the root sum of squares of the terms each step's dg sums (the state's entries): the scale
    a float32 dg is accurate to where they cancel (identical keys, beta = 1, strong decay).
    """
    shape, qh, kh, v, _, a, beta, s0, m = _prepare(q, k, v, g, beta, initial_state, mask,
                                                   scale, gate)
    B, T, Hv, Dv, Dk = shape.B, shape.T, shape.Hv, shape.Dv, shape.Dk
    vg = shape.vector_gate
    dy = np.zeros((B, T, Hv, Dv)) if dy is None else np.asarray(dy, dtype=np.float64)
    if dy.shape != (B, T, Hv, Dv):
        raise ValueError(f"dy has shape {dy.shape}, expected {(B, T, Hv, Dv)}")
    if dfinal_state is None:
        dS = np.zeros((B, Hv, Dv, Dk))
    else:
        dS = np.array(dfinal_state, dtype=np.float64)
        if dS.shape != (B, Hv, Dv, Dk):
            raise ValueError(f"dfinal_state has shape {dS.shape}, expected {(B, Hv, Dv, Dk)}")

    y, states = _run(shape, qh, kh, v, a, beta, s0, m, scale)
    dqh, dkh = np.zeros_like(qh), np.zeros_like(kh)
    dv, dbeta, da = np.zeros_like(v), np.zeros_like(beta), np.zeros_like(a)
    da_rss = np.zeros_like(a)

    for t in range(T - 1, -1, -1):
        S_prev, S = states[t], states[t + 1]
        q_t, k_t, v_t, b_t = qh[:, t], kh[:, t], v[:, t], beta[:, t, :, None]
        mt = m[:, t, None, None, None]
        Sp = _decay(S_prev, a[:, t], vg)
        resid = v_t - np.einsum("bhij,bhj->bhi", Sp, k_t)  # v_t - u_t
        delta = b_t * resid

        # y_t = scale S_t q_t
        dS_t = dS + scale * dy[:, t, :, :, None] * q_t[:, :, None, :]
        dq_t = scale * np.einsum("bhij,bhi->bhj", S, dy[:, t])
        # S_t = S'_t + delta k^T
        ddelta = np.einsum("bhij,bhj->bhi", dS_t, k_t)
        # delta = beta (v - S' k): d resid = beta ddelta, and S' also enters through u = S' k
        dres = b_t * ddelta
        dk_t = (np.einsum("bhij,bhi->bhj", dS_t, delta)
                - np.einsum("bhij,bhi->bhj", Sp, dres))
        dSp = dS_t - dres[..., :, None] * k_t[..., None, :]
        # S' = a S_{t-1}: linear-gate gradient, summed over Dv rows per Dk column if vector
        prod = dSp * S_prev
        da_t = prod.sum(axis=2) if vg else prod.sum(axis=(2, 3))

        on = m[:, t]
        dqh[:, t] = np.where(on[:, None, None], dq_t, 0.0)
        dkh[:, t] = np.where(on[:, None, None], dk_t, 0.0)
        dv[:, t] = np.where(on[:, None, None], dres, 0.0)
        dbeta[:, t] = np.where(on[:, None], np.sum(ddelta * resid, axis=-1), 0.0)
        da[:, t] = np.where(on[:, None, None] if vg else on[:, None], da_t, 0.0)
        sq_t = (prod * prod).sum(axis=2) if vg else (prod * prod).sum(axis=(2, 3))
        da_rss[:, t] = np.where(on[:, None, None] if vg else on[:, None], np.sqrt(sq_t), 0.0)
        dS = np.where(mt, _decay(dSp, a[:, t], vg), dS)

    # d/d g_log = da * exp(g_log) = da * a: exactly 0 where a == 0, never a division.
    dg = da * a if gate == "log" else da
    extra = {"states": np.moveaxis(states[1:], 0, 1)} if steps else {}
    if dg_scale:
        extra["dg_scale"] = da_rss * np.abs(a) if gate == "log" else da_rss
    return {
        **extra,
        "y": y,
        "final_state": states[-1],
        "dq": _fold_heads(dqh, shape),
        "dk": _fold_heads(dkh, shape),
        "dv": dv,
        "dg": dg,
        "dbeta": dbeta,
        "dinitial_state": dS,
    }


def packed_vjp(q, k, v, g, beta, initial_state, dy, dfinal_state, cu_seqlens, *, mask=None,
               scale=1.0, gate="log"):
    """`vjp` of a packed row (`gdngen.algebra.packed`), a sequence at a time: q ``[1,T,Hk,Dk]``
    etc.,
    ``cu_seqlens`` ``[N+1]``, ``initial_state`` / ``dfinal_state`` ``[N,Hv,Dv,Dk]`` (None:
    zeros). Each sequence runs `vjp` on its own steps from its own initial state; an empty one
    returns its initial state (and passes its final-state cotangent straight back). Same keys
    as `vjp`, final_state and dinitial_state ``[N,Hv,Dv,Dk]``."""
    offsets = np.asarray(cu_seqlens)
    N = len(offsets) - 1
    q, k, v, g, beta = (np.asarray(x, dtype=np.float64) for x in (q, k, v, g, beta))
    Hv, Dv, Dk = v.shape[2], v.shape[3], q.shape[3]
    dy = np.zeros(v.shape) if dy is None else np.asarray(dy, dtype=np.float64)
    s0 = np.zeros((N, Hv, Dv, Dk)) if initial_state is None else \
        np.asarray(initial_state, dtype=np.float64)
    dS = np.zeros((N, Hv, Dv, Dk)) if dfinal_state is None else \
        np.asarray(dfinal_state, dtype=np.float64)
    out = {"y": np.zeros(v.shape), "final_state": s0.copy(), "dq": np.zeros(q.shape),
           "dk": np.zeros(k.shape), "dv": np.zeros(v.shape), "dg": np.zeros(g.shape),
           "dbeta": np.zeros(beta.shape), "dinitial_state": dS.copy()}
    for n in range(N):
        s, e = int(offsets[n]), int(offsets[n + 1])
        if e == s:
            continue
        part = vjp(q[:, s:e], k[:, s:e], v[:, s:e], g[:, s:e], beta[:, s:e], s0[n:n + 1],
                   dy[:, s:e], dS[n:n + 1], mask=None if mask is None else mask[:, s:e],
                   scale=scale, gate=gate)
        for name in ("y", "dq", "dk", "dv", "dg", "dbeta"):
            out[name][:, s:e] = part[name]
        out["final_state"][n] = part["final_state"][0]
        out["dinitial_state"][n] = part["dinitial_state"][0]
    return out


# ------------------------------------------------------------------------ layer inputs


def sigmoid(x):
    """1 / (1 + exp(-x)) in float64, written so that neither tail cancels or overflows."""
    e = np.exp(-np.abs(x))
    return np.where(x >= 0, 1.0 / (1.0 + e), e / (1.0 + e))


def l2_normalize(x, eps=1e-6):
    """``(x / r, r)`` with ``r = sqrt(sum_D x^2 + eps)`` (`gdngen.algebra.layer_inputs`)."""
    r = np.sqrt((x * x).sum(axis=-1, keepdims=True) + eps)
    return x / r, r


def l2_normalize_vjp(x_hat, r, d_hat):
    """d/dx of <x / r, d_hat>: ``(d_hat - x_hat (x_hat . d_hat)) / r``."""
    return (d_hat - x_hat * (x_hat * d_hat).sum(axis=-1, keepdims=True)) / r


def sum_to(x, shape):
    """A gate-shaped gradient ``[B,T,Hv(,Dk)]`` summed down to a parameter's ``shape``."""
    per_head = x.sum(axis=(0, 1))
    if per_head.shape == shape:
        return per_head
    return per_head.sum(axis=-1).reshape(shape)


class LayerInputsVJP:
    """Float64 layer inputs of a GatedDeltaNet / KDA layer (`gdngen.algebra.layer_inputs`):
    q, k L2-normalised, ``log g`` from the raw projection ``a`` (gate "softplus" or
    "sigmoid_bound" with ``A_log``, ``dt_bias``, ``lower_bound``), ``beta = beta_scale
    sigmoid(b)``; and
    the chain rule from the recurrence's gradients (`vjp`'s dict) back to the raw arrays."""

    def __init__(self, q, k, a, b, A_log, dt_bias, gate, lower_bound=None, beta_scale=1.0):
        vector = a.ndim == 4
        as_param = lambda p: p.reshape(-1, 1) if vector and p.ndim == 1 else p
        self.shapes = (A_log.shape, dt_bias.shape)
        (self.q, self.rq), (self.k, self.rk) = l2_normalize(q), l2_normalize(k)
        self.A, self.pre = as_param(A_log), a + as_param(dt_bias)
        self.gate, self.lower_bound = gate, lower_bound
        if gate == "softplus":
            self.log_g = -np.exp(self.A) * np.logaddexp(self.pre, 0.0)
        elif gate == "sigmoid_bound":
            self.zg = np.exp(self.A) * self.pre
            self.log_g = lower_bound * sigmoid(self.zg)
        else:
            raise ValueError(f"gate must be 'softplus' or 'sigmoid_bound', got {gate!r}")
        self.beta_scale = beta_scale  # beta = beta_scale * sigmoid(b) (2: allow_neg_eigval)
        self.beta = beta_scale * sigmoid(b)

    def values(self):
        """``(q, k, log_g, beta)`` the recurrence takes."""
        return self.q, self.k, self.log_g, self.beta

    def _gate_terms(self, dg):
        """``(d_pre, d_A)``: the gate's cotangent ``dg`` (d/d log g) per step, ``[B,T,Hv(,Dk)]``
        each, before ``dA_log`` / ``ddt_bias`` sum them over the batch and time."""
        if self.gate == "softplus":  # d log g/d pre = -exp(A) sigmoid(pre), d log g/dA = log g
            return dg * -np.exp(self.A) * sigmoid(self.pre), dg * self.log_g
        s = sigmoid(self.zg)  # d log g / dz = lb s (1 - s), dz / d pre = exp(A), dz / dA = z
        dz = dg * self.lower_bound * s * (1.0 - s)
        return dz * np.exp(self.A), dz * self.zg

    def reduction_scales(self, dg_scale):
        """``dg`` (d/da), ``dA_log``, ``ddt_bias``'s scales from the recurrence's ``dg_scale``
        (`vjp`'s): the chain rule's |factor| times it, then the parameters' root sums of
        squares over B, T (their sums can cancel far below their terms over long calls)."""
        d_pre, d_A = (np.abs(d) for d in self._gate_terms(dg_scale))
        return {"dg": d_pre, "dA_log": np.sqrt(sum_to(d_A * d_A, self.shapes[0])),
                "ddt_bias": np.sqrt(sum_to(d_pre * d_pre, self.shapes[1]))}

    def grads(self, out):
        """``dq, dk`` (raw), ``dg`` (d/da), ``dA_log``, ``ddt_bias``, ``dbeta`` (d/db)."""
        d_pre, d_A = self._gate_terms(out["dg"])
        return {"dq": l2_normalize_vjp(self.q, self.rq, out["dq"]),
                "dk": l2_normalize_vjp(self.k, self.rk, out["dk"]),
                "dg": d_pre, "dA_log": sum_to(d_A, self.shapes[0]),
                "ddt_bias": sum_to(d_pre, self.shapes[1]),
                "dbeta": out["dbeta"] * self.beta * (1.0 - self.beta / self.beta_scale)}
