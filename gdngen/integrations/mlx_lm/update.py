"""gdngen's computation of mlx-lm's ``gated_delta_update`` (`gdngen_gated_delta_update`, the
gate in log space, `log_decay`) and which calls gdngen takes (`_takes_chunkwise_path`)."""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np

from gdngen import mlx as gdngen_mlx
from gdngen import prepare
from gdngen.algebra import layer_inputs
from gdngen.shape import MAX_HEAD_DIM, MIN_HEAD_DIM, CallShape, dtype_name


def log_decay(A_log, a, dt_bias, lower_bound=None):
    """mlx-lm's decay gate in log space, float32, shaped like ``a + dt_bias``.

    ``-exp(A_log) * softplus(a + dt_bias)`` (= log of mlx-lm's ``compute_g``), or with
    ``lower_bound``: ``lower_bound * sigmoid(exp(A_log) * (a + dt_bias))`` (= log of
    ``compute_lower_bound_g``): `gdngen.algebra.layer_inputs.log_gate`, the formula
    ``gdngen.mlx.gated_delta(..., gate="softplus" | "sigmoid_bound")`` applies. No exp/log round
    trip: it cannot underflow, and its gradients to A_log, a and dt_bias are exact.
    """
    return layer_inputs.log_gate(prepare.namespace("mlx"), a, A_log, dt_bias, lower_bound)


def gdngen_gated_delta_update(q, k, v, a, b, A_log, dt_bias, state=None, mask=None, *,
                              use_kernel=True, lower_bound=None, allow_neg_eigval=False,
                              chunk_size=None):
    """mlx-lm's ``gated_delta_update`` contract, always computed by `gdngen.mlx.gated_delta`.

    q, k ``[B,T,Hk,Dk]`` (already normalized and scaled by mlx-lm's ``normalize_qk``; no scale is
    applied here); v ``[B,T,Hv,Dv]``; a ``[B,T,Hv]`` (or ``[B,T,Hv,Dk]`` for per-channel gates);
    b ``[B,T,Hv]``; state ``[B,Hv,Dv,Dk]`` or None; mask ``[B,T]`` (False: the step leaves the
    state unchanged and its output is 0). beta = sigmoid(b), doubled with ``allow_neg_eigval``;
    ``A_log``, ``dt_bias`` broadcast against a's head (and channel) axes, as in mlx-lm. The gate
    ``log g = -exp(A_log) softplus(a + dt_bias)`` (or the ``lower_bound`` form) and, without
    ``allow_neg_eigval``, ``sigmoid(b)`` are computed by ``gdngen.mlx.gated_delta`` itself
    (``gate="softplus"`` / ``"sigmoid_bound"``, ``beta_activation="sigmoid"``). Returns
    ``(y [B,T,Hv,Dv] in q's dtype, state [B,Hv,Dv,Dk] float32)``. ``use_kernel=False`` (mlx-lm's
    training path) runs the chunk path at every T (`_training_variant`); ``use_kernel=True``
    (inference) lets the variant's recurrent switch pick the path by T.
    """
    if allow_neg_eigval:  # beta in [0, 2]: not one of gdngen's activations, so taken here
        beta, beta_activation = 2.0 * mx.sigmoid(b.astype(mx.float32)), None
    else:
        beta, beta_activation = b, "sigmoid"
    # mlx-lm broadcasts A_log and dt_bias against a; gdngen takes them per head ([Hv]) or per
    # head and channel ([Hv, Dk]), which is that broadcast onto a's trailing axes
    A_log, dt_bias = (_onto_gate_axes(p, a.shape[2:]) for p in (A_log, dt_bias))
    if mask is not None and mask.dtype != mx.bool_:
        mask = mask.astype(mx.bool_)
    variant = None
    if not use_kernel:
        B, T, Hk, Dk = q.shape
        shape = CallShape(B, T, Hk, v.shape[2], Dk, v.shape[3], a.ndim == 4)
        variant = _training_variant(shape, dtype_name(q), chunk_size)
    return gdngen_mlx.gated_delta(
        q, k, v, a, beta, state, mask=mask, scale=1.0,
        gate="softplus" if lower_bound is None else "sigmoid_bound", A_log=A_log,
        dt_bias=dt_bias, lower_bound=lower_bound, beta_activation=beta_activation,
        chunk_size=None if variant is not None else chunk_size, variant=variant)


def _training_variant(shape: CallShape, dtype: str, chunk_size):
    """The variant a plain call of ``shape`` would run, with its recurrent switch off:
    mlx-lm's training path (``use_kernel=False``) is differentiated, and a differentiated
    call's VJP runs the chunk path's forward anyway (`gdngen.config.recurrent_switch`), so a
    forward through the step loop below the crossover would be paid on top. None for a backend
    without a switch."""
    from gdngen import dispatch

    chosen = dispatch.resolve("mlx", shape, dtype, None, chunk_size)
    if chosen.get("recurrent_below") is None:
        return None
    return chosen.replace(recurrent_below=0)


def _onto_gate_axes(p, gate_axes):
    """A gate parameter broadcast onto a's head (and channel) axes ``gate_axes``: mlx-lm's
    broadcast of ``p`` against ``a``, less a's batch and time axes (leading size-1 axes of ``p``
    dropped; `_takes_chunkwise_path` checked that they are 1)."""
    extra = p.ndim - len(gate_axes)
    if extra > 0:
        p = p.reshape(p.shape[extra:])
    return p if tuple(p.shape) == tuple(gate_axes) else mx.broadcast_to(p, gate_axes)


def _takes_lower_bound(lower_bound) -> bool:
    """None, or what ``gate="sigmoid_bound"`` takes: a Python int / float, finite and < 0.

    mlx-lm applies any bound as ``g = exp(lower_bound * sigmoid(...))``, its sign unchanged
    (Bailing V3's ``kda_lower_bound`` defaults to -5; Kimi K3 passes its ``gate_lower_bound``
    as given), and so does gdngen; a bound >= 0 (a gate >= 1) or an infinite one stays on mlx-lm.
    """
    if lower_bound is None:
        return True
    return (isinstance(lower_bound, (int, float)) and not isinstance(lower_bound, bool)
            and -math.inf < lower_bound < 0)


def _takes_chunkwise_path(q, v, a, A_log, dt_bias, lower_bound=None) -> bool:
    """Whether gdngen takes this call: both head dims in 16..256, a ``lower_bound`` it takes
    (`_takes_lower_bound`) and a gate of either form:

    - per head, ``a [B,T,Hv]`` (Qwen3.5, Qwen3-Next, OLMo hybrid): gdngen's chunkwise kernels;
    - per channel, ``a [B,T,Hv,Dk]`` (Kimi Linear, Kimi K3, Bailing V3, which pass
      ``A_log [Hv,1]`` and ``dt_bias [Hv,Dk]``): routed too, and run by gdngen's own
      per-channel path (`gdngen.mlx.gated_delta` with a vector gate);

    with ``A_log`` and ``dt_bias`` broadcasting against ``a`` to a's own shape and adding no
    batch or time extent (their axes beyond a's head and channel axes are 1), as gdngen takes
    them per head and channel. Anything else keeps mlx-lm's function, which raises its own
    error where the call is invalid.
    """
    if q.ndim != 4 or v.ndim != 4:
        return False
    B, T, _, Dk = q.shape
    Hv, Dv = v.shape[2:]
    gate_shape = tuple(a.shape)
    if gate_shape not in ((B, T, Hv), (B, T, Hv, Dk)):
        return False
    if not (MIN_HEAD_DIM <= Dk <= MAX_HEAD_DIM and MIN_HEAD_DIM <= Dv <= MAX_HEAD_DIM
            and _takes_lower_bound(lower_bound)):
        return False
    try:
        broadcast = np.broadcast_shapes(gate_shape, tuple(A_log.shape), tuple(dt_bias.shape))
    except ValueError:
        return False
    gate_axes = len(gate_shape) - 2
    return broadcast == gate_shape and all(
        d == 1 for p in (A_log, dt_bias) for d in tuple(p.shape)[:max(p.ndim - gate_axes, 0)])
