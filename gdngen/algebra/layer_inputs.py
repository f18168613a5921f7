"""The layer inputs as the chunk cores take them (framework-neutral ``xp`` math, float32).

``gated_delta(..., qk_norm=, gate=, A_log=, dt_bias=, lower_bound=, beta_activation=)`` turns a
GatedDeltaNet layer's raw projections into the ordinary call::

    qk_norm=True             q <- q * rsqrt(sum_Dk(q^2) + 1e-6), k likewise (per head)
    gate="softplus"          log g = -exp(A_log) * softplus(a + dt_bias)
    gate="sigmoid_bound"     log g = lower_bound * sigmoid(exp(A_log) * (a + dt_bias))
    beta_activation="sigmoid"   beta <- sigmoid(beta)

``a`` is ``[B,T,Hv]`` (per-channel ``[B,T,Hv,Dk]``); ``A_log``, ``dt_bias`` ``[Hv]`` (per
channel also ``[Hv,1]``, ``[Hv,Dk]``), laid out against ``a`` by `parameter_layout`. A chunk
core given a `ParameterGate` takes ``(a, A_log, dt_bias)`` raw, computes the log gate itself
and recomputes it in its backward (`core_inputs`, `core_inputs_vjp`); the log gate is formed in
log space, so strong decay keeps its digits. `fold_mask` makes masked steps identity steps.
Where these are computed before a backend instead: `gdngen.prepare`. Narrative and
measurements: docs/LAYER_INPUTS.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# --------------------------------------------------------------------------- q/k L2 norm

#: added to sum(x^2) over Dk by ``qk_norm=True`` (mlx-lm's ``normalize_qk(..., eps=1e-6)``)
QK_NORM_EPS = 1e-6


def l2_normalize(xp, x):
    """``x [..., D] -> x * rsqrt(sum_D(x^2) + QK_NORM_EPS)`` (float32 ``x``)."""
    return x * xp.rsqrt((x * x).sum(axis=-1, keepdims=True) + QK_NORM_EPS)


def l2_normalize_vjp(xp, x, dn):
    """Cotangent of ``x`` from that of ``n = l2_normalize(x)``: with ``r = rsqrt(sum x^2 +
    eps)``, ``dn/dx = r I - r^3 x x^T``, so ``dx = r (dn - n (n . dn))``."""
    r = xp.rsqrt((x * x).sum(axis=-1, keepdims=True) + QK_NORM_EPS)
    n = x * r
    return r * (dn - n * (n * dn).sum(axis=-1, keepdims=True))


def normalized_qk(xp, q, k, qk_scale):
    """``(q, k)`` as the chunk core uses them: as given when ``qk_scale`` is None, else
    ``(l2_normalize(q) * qk_scale, l2_normalize(k))`` (the fused ``qk_norm``: the core takes the
    raw q, k, keeps them, not the normalised ones, for its backward and recomputes these)."""
    if qk_scale is None:
        return q, k
    return l2_normalize(xp, q) * qk_scale, l2_normalize(xp, k)


def normalized_qk_vjp(xp, q, k, dq, dk, qk_scale):
    """Cotangents of the raw q, k of `normalized_qk` from those of its outputs."""
    if qk_scale is None:
        return dq, dk
    return l2_normalize_vjp(xp, q, dq * qk_scale), l2_normalize_vjp(xp, k, dk)


# --------------------------------------------------------------------------- gates from parameters


@dataclass(frozen=True)
class ParameterGate:
    """The ``gate`` of a chunk core (and of the layout functions here) whose gates are the tuple
    ``(a, A_log, dt_bias)``: the raw gate projection ``a`` and the gate's parameters, broadcast
    against ``a`` (`parameter_layout`). The core computes the log gate itself (`log_gates`) and
    keeps only ``a`` for its backward, which recomputes the log gate and maps its cotangent to
    the three arrays (`gates_vjp`)::

        lower_bound None:   log g = -exp(A_log) * softplus(a + dt_bias)         ("softplus")
        lower_bound < 0:    log g = lower_bound * sigmoid(exp(A_log) * (a + dt_bias))

    ``a = -inf`` is an identity step for both (log g = 0 exactly, zero cotangents): masked and
    padded steps (`identity_value`). The log gate is produced in log space (never
    ``log(exp(..))``), so strong decay keeps its digits and its gradients.
    """

    lower_bound: float | None = None

    def _terms(self, xp, a, A_log, dt_bias):
        """``(live, x, rate)``: the steps that are not identity steps, ``a + dt_bias`` there
        (0 elsewhere, so no inf reaches the arithmetic) and ``exp(A_log)``."""
        live = a > -math.inf
        return live, xp.where(live, a + dt_bias, 0.0), xp.exp(A_log)

    def log_gates(self, xp, a, A_log, dt_bias):
        """The log gate, shaped like ``a`` (float32 arrays)."""
        live, x, rate = self._terms(xp, a, A_log, dt_bias)
        if self.lower_bound is None:
            return xp.where(live, -rate * xp.softplus(x), 0.0)
        return xp.where(live, self.lower_bound * xp.sigmoid(rate * x), 0.0)

    def vjp(self, xp, a, A_log, dt_bias, dlog_g):
        """``(da, dA_log, ddt_bias)`` from the log gate's cotangent ``dlog_g`` (like ``a``);
        the parameters' summed over the axes they broadcast along (`sum_to`).

        softplus: d/dx = -rate sigmoid(x), d/dA_log = log g. sigmoid_bound, z = rate x:
        d/dx = lower_bound sigmoid'(z) rate, d/dA_log = that times x, with sigmoid'(z) =
        sigmoid(z) sigmoid(-z) (no 1 - sigmoid(z) to cancel in the saturated tail). d/ddt_bias
        = d/da.
        """
        live, x, rate = self._terms(xp, a, A_log, dt_bias)
        if self.lower_bound is None:
            da = -rate * xp.sigmoid(x) * dlog_g
            dlog_rate = -rate * xp.softplus(x) * dlog_g
        else:
            z = rate * x
            da = self.lower_bound * xp.sigmoid(z) * xp.sigmoid(-z) * rate * dlog_g
            dlog_rate = da * x
        da, dlog_rate = (xp.where(live, d, 0.0) for d in (da, dlog_rate))
        return da, sum_to(dlog_rate, A_log.shape), sum_to(da, dt_bias.shape)


def sum_to(x, shape):
    """``x`` summed down to ``shape``, the shape of an array that broadcast to ``x``'s (the
    cotangent of a broadcast)."""
    lead = x.ndim - len(shape)
    axes = tuple(range(lead)) + tuple(lead + i for i, n in enumerate(shape)
                                      if n == 1 and x.shape[lead + i] != 1)
    return (x.sum(axis=axes, keepdims=True) if axes else x).reshape(tuple(shape))


def log_gates(xp, gates, gate):
    """``(gates, gate)`` for the chunk algebra: a `ParameterGate`'s ``(a, A_log, dt_bias)`` made
    its log gate (``gate`` then "log"); other gates as given."""
    if isinstance(gate, ParameterGate):
        return gate.log_gates(xp, *gates), "log"
    return gates, gate


def computes_layer_inputs(qk_norm: bool, gate) -> bool:
    """Whether a chunk core computes layer inputs from its primals (the q/k norm, a
    `ParameterGate`'s log gate): its backward then recomputes them behind ``xp.barrier`` (not
    merged with the forward's), and nothing is kept for them."""
    return qk_norm or isinstance(gate, ParameterGate)


def gates_vjp(xp, gates, gate, dgates):
    """The cotangent of ``gates`` from that of `log_gates`'s output: for a `ParameterGate` the
    tuple ``(da, dA_log, ddt_bias)``, otherwise ``dgates`` itself."""
    if isinstance(gate, ParameterGate):
        return gate.vjp(xp, *gates, dgates)
    return dgates


def identity_value(gate):
    """The gate value of an identity step (state kept): log g = 0, g = 1, or a raw projection
    of -inf for a `ParameterGate`."""
    if isinstance(gate, ParameterGate):
        return -math.inf
    return 0.0 if gate == "log" else 1.0


def convention(gate):
    """The convention of the gates the chunk algebra sees: "log" for a `ParameterGate` (its
    log gate), else ``gate`` ("log" or "linear")."""
    return "log" if isinstance(gate, ParameterGate) else gate


def cast_gates(g, dtype):
    """Gates ``g`` (an array or a `ParameterGate`'s tuple) cast to ``dtype``."""
    return tuple(x.astype(dtype) for x in g) if isinstance(g, tuple) else g.astype(dtype)


def raw_gates(g):
    """The array that carries the time axis of gates ``g``: ``a`` of a `ParameterGate`'s tuple,
    else ``g`` itself."""
    return g[0] if isinstance(g, tuple) else g


def with_raw_gates(g, raw):
    """``g`` with its time-carrying array (`raw_gates`) replaced by ``raw``."""
    return (raw, *g[1:]) if isinstance(g, tuple) else raw


def linear_decay(xp, g, gate):
    """The gates as the decay factor itself: exp of a log gate (exactly 0 at -inf; a
    `ParameterGate`'s computed first), a linear gate as given."""
    g, gate = log_gates(xp, g, gate)
    return xp.exp(g) if gate == "log" else g


def core_inputs(xp, primals, qk_scale, gate):
    """``(q, k, v, gates, beta, S0), gate`` as the chunk algebra takes them from a chunk core's
    primals: q, k normalised (`normalized_qk`), a `ParameterGate`'s gates made log gates
    (`log_gates`)."""
    q, k, v, gates, beta, S0 = primals
    q, k = normalized_qk(xp, q, k, qk_scale)
    gates, gate = log_gates(xp, gates, gate)
    return (q, k, v, gates, beta, S0), gate


def core_inputs_vjp(xp, primals, cotangents, qk_scale, gate):
    """The cotangents of a chunk core's primals from those of `core_inputs`'s arrays."""
    q, k, _, gates, _, _ = primals
    dq, dk, dv, dgates, dbeta, dS0 = cotangents
    dq, dk = normalized_qk_vjp(xp, q, k, dq, dk, qk_scale)
    return dq, dk, dv, gates_vjp(xp, gates, gate, dgates), dbeta, dS0



def fold_mask(xp, g, beta, mask, gate):
    """Gates ``g`` [B, T, H] (or per-channel [B, T, H, Dk]; a `ParameterGate`'s tuple) and
    ``beta`` [B, T, H] with masked steps (``mask`` [B, T] False) made identity steps
    (`identity_value`: log g = 0, g = 1 for ``gate="linear"``, a = -inf) and beta = 0.
    ``mask`` None: as is."""
    if mask is None:
        return g, beta
    a = raw_gates(g)
    return (with_raw_gates(g, xp.where(mask.reshape(mask.shape + (1,) * (a.ndim - 2)), a,
                                       identity_value(gate))),
            xp.where(mask[..., None], beta, 0.0))


def parameter_layout(A_log, dt_bias, vector_gate):
    """A `ParameterGate`'s ``A_log``, ``dt_bias`` (``[Hv]``; per-channel also ``[Hv, 1]``,
    ``[Hv, Dk]``) shaped to broadcast against ``a`` in the API layout: ``[Hv]`` against a
    per-head ``a [B,T,Hv]``, ``[Hv, 1 or Dk]`` against a per-channel ``a [B,T,Hv,Dk]``."""
    if vector_gate:
        return tuple(x.reshape(x.shape[0], 1) if x.ndim == 1 else x for x in (A_log, dt_bias))
    return A_log, dt_bias


def log_gate(xp, a, A_log, dt_bias, lower_bound=None):
    """Log decay from the gate's parameters, float32, shaped like ``a + dt_bias``
    (`ParameterGate.log_gates`).

    ``-exp(A_log) * softplus(a + dt_bias)``, or with ``lower_bound``:
    ``lower_bound * sigmoid(exp(A_log) * (a + dt_bias))``. ``A_log`` and ``dt_bias`` must
    already broadcast against ``a``.
    """
    return ParameterGate(lower_bound).log_gates(
        xp, *(xp.float32(x) for x in (a, A_log, dt_bias)))
