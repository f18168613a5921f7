"""The gated-delta mixer's two array stages around the recurrence, on a framework's ``xp``
namespace (`gdngen.prepare.namespace`: its array module ``xp.module``, its stable
``xp.sigmoid`` and ``xp.rsqrt``), and their float64 NumPy reference with its hand-derived VJP.

Stage 1, the causal depthwise short convolution over ``x [B, T, C]`` (``C = 2 Hk Dk + Hv Dv``,
q, k, v concatenated in that order) with ``w [C, K]`` and the last K-1 inputs before the row,
``conv_state [B, C, K-1]`` (zeros when None)::

    window = [conv_state^T ; x]          # [B, K-1+T, C]
    pre[t, c] = sum_j w[c, j] window[t + j, c]      (mlx-lm's / HF's Conv1d, groups = C)
    h = silu(pre)

and the new conv state, the window's last K-1 rows. A packed row (``cu_seqlens``, B = 1)
runs one window per sequence: steps before a sequence's start read that sequence's own
``conv_state [N, C, K-1]``, never the previous sequence's inputs, and each sequence returns the
last K-1 rows of its own window (its state again if it is empty).

Stage 2, the gated RMSNorm per value head of ``y [B, T, Hv, Dv]`` with ``z`` of y's shape and
``weight [Dv]``: ``rmsnorm(y) * weight * act(z)``, ``rmsnorm(y) = y * rsqrt(mean_Dv(y^2) +
eps)``, ``act`` SiLU (Qwen3-Next / Qwen3.5) or sigmoid (Kimi Linear's ``o_norm(y) *
sigmoid(g)``). Both stages compute in float32 and return their input's dtype.
"""

from __future__ import annotations

import numpy as np

from gdngen.algebra import reference

#: the output gate's activation of the gated RMSNorm
NORM_GATES = ("silu", "sigmoid")


# ------------------------------------------------------------------------ framework arrays


def _silu_derivative(x, s):
    """d silu(x) / dx = s (1 + x (1 - s)), with ``s = sigmoid(x)``."""
    return s * (1.0 + x * (1.0 - s))


def conv_dense(xp, x, w, conv_state):
    """``(silu(pre) [B, T, C], new conv_state [B, C, K-1])``, both in x's dtype."""
    window, pre = _window_and_pre(xp, x, w, conv_state)
    T = x.shape[1]
    return (pre * xp.sigmoid(pre)).astype(x.dtype), \
        xp.module.swapaxes(window[:, T:], 1, 2).astype(x.dtype)


def _window_and_pre(xp, x, w, conv_state):
    """Float32 ``(window [B, K-1+T, C], pre [B, T, C])`` of `conv_dense`."""
    m = xp.module
    T = x.shape[1]
    K = w.shape[1]
    f32 = m.float32
    if conv_state is None:  # a pad, which the compilers fuse into its readers
        window = m.pad(x.astype(f32), [(0, 0), (K - 1, 0), (0, 0)])  # [B, K-1+T, C]
    else:
        window = m.concatenate([m.swapaxes(conv_state.astype(f32), 1, 2), x.astype(f32)],
                               axis=1)
    wf = w.astype(f32)
    pre = window[:, 0:T] * wf[:, 0]
    for j in range(1, K):
        pre = pre + window[:, j:j + T] * wf[:, j]
    return window, pre


def conv_dense_vjp(xp, x, w, conv_state, dh, dnew_state):
    """Cotangents ``(dx [B, T, C], dw [C, K], dconv_state [B, C, K-1] or None)`` of
    `conv_dense` at ``(x, w, conv_state)`` from ``dh [B, T, C]`` and ``dnew_state [B, C, K-1]``
    (None: zero), each in its primal's dtype. The pre-activation and SiLU's derivative are
    recomputed from the raw inputs (nothing of the forward is kept)::

        dpre = dh * sig * (1 + pre (1 - sig)),  sig = sigmoid(pre)
        dw[c, j] = sum_{b,t} dpre[b, t, c] window[b, t + j, c]
        dwindow[b, t + j, c] += dpre[b, t, c] w[c, j];  dwindow[:, T:] += dnew_state^T
        dx = dwindow[:, K-1:],  dconv_state = dwindow[:, :K-1]^T
    """
    return conv_dense_pullback(xp, x, w, conv_state)[1](dh, dnew_state)


def conv_dense_pullback(xp, x, w, conv_state):
    """``(h, pullback)`` of `conv_dense` with one recomputation of the window and the
    pre-activation: ``h [B, T, C]`` (x's dtype) and ``pullback(dh, dnew_state) -> (dx, dw,
    dconv_state or None)`` (`conv_dense_vjp`), for a backward that needs both (a chunk core
    recomputing its convolved inputs, `gdngen.backends.generated.conv_inputs`)."""
    window, pre = _window_and_pre(xp, x, w, conv_state)
    sig = xp.sigmoid(pre)

    def pullback(dh, dnew_state):
        return _conv_dense_cotangents(xp, x, w, conv_state, window, pre, sig, dh, dnew_state)

    return (pre * sig).astype(x.dtype), pullback


def _conv_dense_cotangents(xp, x, w, conv_state, window, pre, sig, dh, dnew_state):
    """`conv_dense_vjp` from the recomputed float32 window, pre-activation and its sigmoid."""
    m = xp.module
    T = x.shape[1]
    K = w.shape[1]
    f32 = m.float32
    wf = w.astype(f32)
    dpre = dh.astype(f32) * _silu_derivative(pre, sig)  # [B, T, C]
    dw = m.stack([(dpre * window[:, j:j + T]).sum(axis=(0, 1)) for j in range(K)], axis=1)

    # dwindow[i] = sum_j dpre[i - j] w[:, j] (0 <= i - j < T): K shifted slices of dpre
    # with K-1 zeros on each side, one fused multiply-add over the window's K-1+T rows
    n = K - 1 + T
    dpre = m.pad(dpre, [(0, 0), (K - 1, K - 1), (0, 0)])  # [B, T + 2(K-1), C]
    dwindow = dpre[:, K - 1:K - 1 + n] * wf[:, 0]
    for j in range(1, K):
        dwindow = dwindow + dpre[:, K - 1 - j:K - 1 - j + n] * wf[:, j]
    if dnew_state is not None and K > 1:  # the new state is the window's last K-1 rows
        dwindow = dwindow + m.pad(m.swapaxes(dnew_state.astype(f32), 1, 2),
                                  [(0, 0), (T, 0), (0, 0)])
    dstate = None if conv_state is None else \
        m.swapaxes(dwindow[:, :K - 1], 1, 2).astype(conv_state.dtype)
    return dwindow[:, K - 1:].astype(x.dtype), dw.astype(w.dtype), dstate


class _PackedWindows:
    """A packed row's conv windows (`conv_packed`): ``starts``, ``ends`` ``[N]``, each step's
    sequence ``seq [T]`` and its start ``start_of [T]``, x zero-padded in front ``xpad [K-1+T,
    C]`` and the conv states as rows ``states [N (K-1), C]`` (None without), float32. What tap
    j (lag l = K-1-j) reads at every step is `source` (x at t - l inside the sequence, else row
    K-1 - (start - (t - l)) of the sequence's conv state): static slices of xpad, a gather of
    the states only where conv states are given."""

    def __init__(self, xp, x, w, conv_state, cu_seqlens):
        m = self.m = xp.module
        _, T, C = x.shape
        K = w.shape[1]
        f32, i32 = m.float32, m.int32
        offsets = cu_seqlens.astype(i32)
        self.starts, self.ends = offsets[:-1], offsets[1:]
        N = self.N = int(self.starts.shape[0])
        self.T, self.C, self.K = T, C, K
        self.x = x[0].astype(f32)
        self.xpad = m.pad(self.x, [(K - 1, 0), (0, 0)])
        self.states = None if conv_state is None else \
            m.swapaxes(conv_state.astype(f32), 1, 2).reshape((N * (K - 1), C))
        self.t = m.arange(T).astype(i32)
        self.seq = (self.ends[None, :] <= self.t[:, None]).astype(i32).sum(axis=1)  # [T]
        self.start_of = m.take(self.starts, self.seq, axis=0)
        self.wT = m.swapaxes(w.astype(f32), 0, 1)  # [K, C]
        self.pre = self.source(0) * self.wT[0]  # [T, C]
        for j in range(1, K):
            self.pre = self.pre + self.source(j) * self.wT[j]

    def source(self, j):
        """``[T, C]``: what tap j reads at every step."""
        m, K, T = self.m, self.K, self.T
        if j == K - 1:  # lag 0: the step itself, always inside its sequence
            return self.x
        inside = (self.t - (K - 1 - j) >= self.start_of)[:, None]
        if self.states is None:
            return m.where(inside, self.xpad[j:j + T], m.zeros((), m.float32))
        row = self.seq * (K - 1) + m.clip(self.t - self.start_of + j, 0, K - 2)
        return m.where(inside, self.xpad[j:j + T], m.take(self.states, row, axis=0))


def conv_packed(xp, x, w, conv_state, cu_seqlens):
    """Packed row ``x [1, T, C]``, ``conv_state [N, C, K-1]`` or None, ``cu_seqlens [N+1]``:
    ``(silu(pre) [1, T, C], new conv_state [N, C, K-1])``, both in x's dtype (the new state:
    `_packed_new_state`)."""
    p = _PackedWindows(xp, x, w, conv_state, cu_seqlens)
    return (p.pre * xp.sigmoid(p.pre)).astype(x.dtype)[None], \
        _packed_new_state(p.m, p.x, p.states, p.starts, p.ends, p.K).astype(x.dtype)


def _packed_new_state(m, x, states, starts, ends, K):
    """Float32 ``[N, C, K-1]``: each sequence's window's last K-1 rows, x ``[T, C]`` at ``end -
    (K-1) + i`` inside the sequence, else row ``len + i`` of its conv state (``states [N (K-1),
    C]``; zeros when None)."""
    T, C = x.shape
    N = int(starts.shape[0])
    i32 = m.int32
    i = m.arange(K - 1).astype(i32)[None, :]
    pos = ends[:, None] - (K - 1) + i  # [N, K-1]
    kept = m.take(x, m.clip(pos, 0, T - 1).reshape(-1), axis=0).reshape((N, K - 1, C))
    if states is None:
        earlier = m.zeros((), m.float32)
    else:
        n = m.arange(N).astype(i32)[:, None]
        row = n * (K - 1) + m.clip((ends - starts)[:, None] + i, 0, K - 2)
        earlier = m.take(states, row.reshape(-1), axis=0).reshape((N, K - 1, C))
    kept = m.where((pos >= starts[:, None])[..., None], kept, earlier)
    return m.swapaxes(kept, 1, 2)


def conv(xp, x, w, conv_state, cu_seqlens=None):
    """`conv_dense` (``cu_seqlens`` None) or `conv_packed`: ``(h, new conv_state)``."""
    if cu_seqlens is None:
        return conv_dense(xp, x, w, conv_state)
    return conv_packed(xp, x, w, conv_state, cu_seqlens)


def conv_vjp(xp, x, w, conv_state, cu_seqlens, dh, dnew_state):
    """`conv_dense_vjp` or `conv_packed_vjp`: ``(dx, dw, dconv_state or None)``."""
    if cu_seqlens is None:
        return conv_dense_vjp(xp, x, w, conv_state, dh, dnew_state)
    return conv_packed_vjp(xp, x, w, conv_state, cu_seqlens, dh, dnew_state)


def conv_new_state(xp, x, conv_state, K, cu_seqlens=None, mask=None):
    """The new conv state alone, ``[B, C, K-1]`` (``[N, C, K-1]`` packed) in x's dtype: the
    last K-1 rows of each window, as `conv` returns it, a masked step's input (``mask [B, T]``
    False) a zero (plain array ops; their autodiff is the state's VJP)."""
    m = xp.module
    _, T, C = x.shape
    f32 = m.float32
    if cu_seqlens is None:
        tail = x[:, max(T - (K - 1), 0):]  # only these rows can reach the new state
        if mask is not None:
            tail = m.where(mask[:, max(T - (K - 1), 0):, None], tail, 0)
        if conv_state is None:
            window = m.pad(tail.astype(f32), [(0, 0), (max(K - 1 - T, 0), 0), (0, 0)])
        else:
            window = m.concatenate([m.swapaxes(conv_state.astype(f32), 1, 2),
                                    tail.astype(f32)], axis=1)
        return m.swapaxes(window[:, window.shape[1] - (K - 1):], 1, 2).astype(x.dtype)
    if mask is not None:
        x = m.where(mask[..., None], x, 0)
    offsets = cu_seqlens.astype(m.int32)
    N = int(offsets.shape[0]) - 1
    states = None if conv_state is None else \
        m.swapaxes(conv_state.astype(f32), 1, 2).reshape((N * (K - 1), C))
    return _packed_new_state(m, x[0].astype(f32), states, offsets[:-1], offsets[1:],
                             K).astype(x.dtype)


def conv_packed_vjp(xp, x, w, conv_state, cu_seqlens, dh, dnew_state):
    """Cotangents ``(dx [1, T, C], dw [C, K], dconv_state [N, C, K-1] or None)`` of
    `conv_packed` from ``dh [1, T, C]`` and ``dnew_state [N, C, K-1]`` (None: zero), each in
    its primal's dtype; the taps and the pre-activation recomputed from the raw inputs. No
    scatter: with lag l = K-1-j,

        dw[:, j] = sum_t dpre[t] source_j[t]
        dx[s] = sum_j [seq(s + l) = seq(s)] dpre[s + l] w_j (+ dnew_seq(s)[s - end + K-1])
        dstate_n[i] = sum_{j <= i} [start_n + i - j < end_n] dpre[start_n + i - j] w_j
                      (+ dnew_n[i - len_n] where i >= len_n: a sequence shorter than K-1)

    (static slices of the padded dpre for dx, small gathers for the states).
    """
    p = _PackedWindows(xp, x, w, conv_state, cu_seqlens)
    m, N, K, T, C = p.m, p.N, p.K, p.T, p.C
    f32, i32 = m.float32, m.int32
    dpre = dh[0].astype(f32) * _silu_derivative(p.pre, xp.sigmoid(p.pre))  # [T, C]
    dw = m.stack([(dpre * p.source(j)).sum(axis=0) for j in range(K)], axis=1)  # [C, K]
    zero = m.zeros((), f32)
    dpre_pad = m.pad(dpre, [(0, K - 1), (0, 0)])
    seq_pad = m.pad(p.seq, [(0, K - 1)], constant_values=-1)  # -1: no sequence
    dx = dpre * p.wT[K - 1]  # lag 0: always the step's own sequence
    for j in range(K - 1):
        lag = K - 1 - j
        same = (seq_pad[lag:lag + T] == p.seq)[:, None]
        dx = dx + m.where(same, dpre_pad[lag:lag + T] * p.wT[j], zero)
    dnew = None
    if dnew_state is not None and K > 1:
        dnew = m.swapaxes(dnew_state.astype(f32), 1, 2).reshape((N * (K - 1), C))
        at = p.t - m.take(p.ends, p.seq, axis=0) + (K - 1)  # the step's row of its new state
        dx = dx + m.where((at >= 0)[:, None],
                          m.take(dnew, p.seq * (K - 1) + m.maximum(at, 0), axis=0), zero)
    dstate = None
    if conv_state is not None:
        i = m.arange(K - 1).astype(i32)[None, :]  # [1, K-1]
        dstate = m.zeros((N, K - 1, C), f32)
        for j in range(K):
            pos = p.starts[:, None] + i - j  # [N, K-1]: the step reading row i through tap j
            ok = (i >= j) & (pos < p.ends[:, None])
            read = m.take(dpre, m.clip(pos, 0, T - 1).reshape(-1), axis=0)
            dstate = dstate + m.where(ok[..., None], read.reshape((N, K - 1, C)) * p.wT[j],
                                      zero)
        if dnew is not None:
            src = i - (p.ends - p.starts)[:, None]  # [N, K-1]: a short sequence keeps row i
            n = m.arange(N).astype(i32)[:, None]
            kept = m.take(dnew, (n * (K - 1) + m.maximum(src, 0)).reshape(-1), axis=0)
            dstate = dstate + m.where((src >= 0)[..., None], kept.reshape((N, K - 1, C)),
                                      zero)
        dstate = m.swapaxes(dstate, 1, 2).astype(conv_state.dtype)
    return dx.astype(x.dtype)[None], dw.astype(w.dtype), dstate


def gated_norm(xp, y, z, weight, eps, activation):
    """``rmsnorm(y) * weight * act(z)`` per value head, float32 inside, y's dtype out."""
    f32 = xp.module.float32
    yf, zf = y.astype(f32), z.astype(f32)
    r = xp.rsqrt((yf * yf).mean(axis=-1, keepdims=True) + eps)
    gate = xp.sigmoid(zf)
    if activation == "silu":
        gate = zf * gate
    return (yf * r * weight.astype(f32) * gate).astype(y.dtype)


def gated_norm_vjp(xp, y, z, weight, eps, activation, dout):
    """Cotangents ``(dy, dz, dweight)`` of `gated_norm` from ``dout`` (each in its primal's
    dtype), the norm factor and the gate recomputed from y and z in float32::

        r = rsqrt(mean(y^2) + eps),  u = dout * act(z) * weight
        dy = r u - y r^3 mean(u y),  dz = dout * weight * y r * act'(z)
        dweight = sum over every axis but the last of dout * act(z) * y r
    """
    m = xp.module
    f32 = m.float32
    yf, zf, wf, df = y.astype(f32), z.astype(f32), weight.astype(f32), dout.astype(f32)
    r = xp.rsqrt((yf * yf).mean(axis=-1, keepdims=True) + eps)
    s = xp.sigmoid(zf)
    if activation == "silu":
        act, dact = zf * s, _silu_derivative(zf, s)
    else:
        act, dact = s, s * (1.0 - s)
    yr = yf * r
    u = df * act * wf
    dy = r * u - yr * (r * r) * (u * yf).mean(axis=-1, keepdims=True)
    dz = df * wf * yr * dact
    dweight = (df * act * yr).reshape((-1, yf.shape[-1])).sum(axis=0)
    return dy.astype(y.dtype), dz.astype(z.dtype), dweight.astype(weight.dtype)


# ------------------------------------------------------------------------ float64 reference


def _windows(x, conv_state, K, cu_seqlens):
    """Per window of the reference: ``(row, state index, steps slice, window [K-1+len, C])``
    in float64 (a row each, or a sequence each of the packed row 0)."""
    B, T, C = x.shape
    if cu_seqlens is None:
        for b in range(B):
            prev = np.zeros((K - 1, C)) if conv_state is None else conv_state[b].T
            yield b, b, slice(0, T), np.concatenate([prev, x[b]])
        return
    for n in range(len(cu_seqlens) - 1):
        s, e = int(cu_seqlens[n]), int(cu_seqlens[n + 1])
        prev = np.zeros((K - 1, C)) if conv_state is None else conv_state[n].T
        yield 0, n, slice(s, e), np.concatenate([prev, x[0, s:e]])


def reference_vjp(mixed_qkv, conv_weight, a, b, z, *, Hk, Hv, Dk, Dv, A_log, dt_bias,
                  norm_weight, conv_state=None, initial_state=None, mask=None, cu_seqlens=None,
                  norm_eps=1e-6, scale=None, gate="softplus", lower_bound=None,
                  norm_gate="silu", dout=None, dfinal_state=None, dconv_state=None,
                  allow_neg_eigval=False):
    """The whole mixer in float64 with the gradients of ``<out, dout> + <final_state,
    dfinal_state> + <conv_state_out, dconv_state>`` (None cotangents are zeros) w.r.t. every
    array argument: a per-row loop for the convolution, `gdngen.algebra.reference`'s
    recurrence and its BPTT, and the chain rule of every elementwise stage. Returns a dict:
    "out", "final_state", "conv_state" and "d<argument>" for each array argument."""
    f = lambda x: None if x is None else np.asarray(x, np.float64)
    x, w, a, bl, z = f(mixed_qkv), f(conv_weight), f(a), f(b), f(z)
    A_log, dt_bias, nw = f(A_log), f(dt_bias), f(norm_weight)
    conv_state, initial_state = f(conv_state), f(initial_state)
    B, T, C = x.shape
    K = w.shape[1]
    scale = Dk ** -0.5 if scale is None else scale
    if mask is not None:
        x = np.where(np.asarray(mask)[..., None], x, 0.0)
    pre = np.zeros_like(x)
    rows = list(_windows(x, conv_state, K, cu_seqlens))
    new_state = []
    for r, _, steps, window in rows:
        n = steps.stop - steps.start
        for j in range(K):
            pre[r, steps] += w[:, j] * window[j:j + n]
        new_state.append(window[-(K - 1):].T if K > 1 else np.zeros((C, 0)))
    sig = reference.sigmoid(pre)
    h = pre * sig
    kd = Hk * Dk
    q = h[..., :kd].reshape(B, T, Hk, Dk)
    k = h[..., kd:2 * kd].reshape(B, T, Hk, Dk)
    v = h[..., 2 * kd:].reshape(B, T, Hv, Dv)
    inputs = reference.LayerInputsVJP(q, k, a, bl, A_log, dt_bias, gate, lower_bound,
                                      2.0 if allow_neg_eigval else 1.0)
    cot_y = None
    if dout is not None:  # the gated norm's backward needs y first: forward, then the VJP
        y0, _ = _recurrence(inputs, v, initial_state, mask, cu_seqlens, scale, None, None)
        cot_y, norm_grads = gated_norm_reference(y0, z, nw, norm_eps, norm_gate, f(dout))
    out = _recurrence(inputs, v, initial_state, mask, cu_seqlens, scale, cot_y,
                      f(dfinal_state), full=True)
    y = out["y"]
    result = {"out": gated_norm_reference(y, z, nw, norm_eps, norm_gate, None)[0],
              "final_state": out["final_state"], "conv_state": np.stack(new_state)}
    grads = inputs.grads(out)
    dh = np.concatenate([grads["dq"].reshape(B, T, kd), grads["dk"].reshape(B, T, kd),
                         out["dv"].reshape(B, T, Hv * Dv)], axis=-1)
    dpre = dh * (sig * (1.0 + pre * (1.0 - sig)))
    dw = np.zeros_like(w)
    dx = np.zeros_like(x)
    dstate = np.zeros((len(rows), C, K - 1))
    dcs = None if dconv_state is None else f(dconv_state)
    for r, i, steps, window in rows:
        n = steps.stop - steps.start
        dwindow = np.zeros_like(window)
        for j in range(K):
            dw[:, j] += (dpre[r, steps] * window[j:j + n]).sum(axis=0)
            dwindow[j:j + n] += dpre[r, steps] * w[:, j]
        if dcs is not None and K > 1:
            dwindow[-(K - 1):] += dcs[i].T
        dx[r, steps] = dwindow[K - 1:]
        dstate[i] = dwindow[:K - 1].T
    if mask is not None:
        dx = np.where(np.asarray(mask)[..., None], dx, 0.0)
    result.update({"dmixed_qkv": dx, "dconv_weight": dw, "da": grads["dg"],
                   "db": grads["dbeta"], "dA_log": grads["dA_log"],
                   "ddt_bias": grads["ddt_bias"], "dconv_state": dstate,
                   "dinitial_state": out["dinitial_state"]})
    if dout is not None:
        result.update(norm_grads)
    else:
        result.update({"dz": np.zeros_like(z), "dnorm_weight": np.zeros_like(nw)})
    return result


def _recurrence(inputs, v, initial_state, mask, cu_seqlens, scale, dy, dfinal, full=False):
    """`gdngen.algebra.reference` (packed or dense) on the layer inputs' q, k, log g, beta."""
    q, k, log_g, beta = inputs.values()
    if cu_seqlens is None:
        out = reference.vjp(q, k, v, log_g, beta, initial_state, dy, dfinal, mask=mask,
                            scale=scale, gate="log")
    else:
        out = reference.packed_vjp(q, k, v, log_g, beta, initial_state, dy, dfinal,
                                   np.asarray(cu_seqlens), mask=mask, scale=scale, gate="log")
    return out if full else (out["y"], out["final_state"])


def gated_norm_reference(y, z, weight, eps, activation, dout):
    """Float64 ``(out, grads)`` of `gated_norm`; with ``dout`` None, ``(out, None)``; else
    ``(dy, {"dz", "dnorm_weight"})``."""
    D = y.shape[-1]
    r = 1.0 / np.sqrt((y * y).mean(axis=-1, keepdims=True) + eps)
    s = reference.sigmoid(z)
    act, dact = (z * s, s * (1.0 + z * (1.0 - s))) if activation == "silu" else (s, s * (1 - s))
    if dout is None:
        return y * r * weight * act, None
    u = dout * act * weight
    dy = r * u - y * r ** 3 * (u * y).sum(axis=-1, keepdims=True) / D
    return dy, {"dz": dout * weight * y * r * dact,
                "dnorm_weight": (dout * act * y * r).reshape(-1, D).sum(axis=0)}
