"""Train mlx-lm's gated-delta models on gdngen: GatedDeltaNet (Qwen3.5, Qwen3-Next, OLMo
hybrid, ...) and Kimi Delta Attention (Kimi Linear, Kimi K3, Bailing V3).

mlx-lm's linear-attention layers call ``gated_delta_update(..., use_kernel=not self.training)``,
so every training step runs ``gated_delta_ops``, a per-token loop. `patch` replaces that function
in every mlx-lm module that imported it; calls made with ``use_kernel=False`` (the training path)
then run `gdngen.mlx.gated_delta` on the raw gate projection and beta logits with the layer's
parameters (``gate="softplus"`` or ``"sigmoid_bound"``, ``A_log``, ``dt_bias``,
``beta_activation="sigmoid"``: the gate is taken in log space, `gdngen.algebra.layer_inputs`, never
as
``log(exp(...))``). Both gate forms are routed:

- per head, ``a [B,T,Hv]`` with ``A_log``, ``dt_bias [Hv]`` (Qwen3.5, Qwen3-Next, OLMo hybrid):
  gdngen's chunkwise kernels;
- per channel, ``a [B,T,Hv,Dk]`` with ``A_log [Hv,1]`` and ``dt_bias [Hv,Dk]`` (Kimi Linear,
  Kimi K3, Bailing V3; Kimi K3 and Bailing V3 with the ``lower_bound`` gate, their
  ``gate_lower_bound`` / ``kda_lower_bound``, passed on exactly as mlx-lm applies it):
  gdngen's own per-channel path.

q and k arrive normalised (mlx-lm's models call ``normalize_qk`` before
``gated_delta_update``), so ``qk_norm`` stays off. Calls with ``use_kernel=True`` (inference;
mlx-lm's Metal kernel where it has one) keep mlx-lm's function unless ``patch(inference=True)``
(Kimi K3 ``mx.compile``s its T=1 decode step per layer on first use, on Metal: patch before the
first decode for that step to be routed). Training calls run gdngen's chunk path at every T
(they are differentiated, and the chunk path's VJP needs its forward); inference calls take the
variant's recurrent switch (decode and short prefill through the step loop below the tuned
crossover T).
Calls gdngen cannot take (a head dim outside 16..256, a ``lower_bound`` that is not a finite
negative number, a gate or parameter shape other than the above) keep mlx-lm's function.

    from gdngen.integrations import mlx_lm as gdn_mlx_lm

    gdn_mlx_lm.patch()                 # before building / compiling the train step
    ...                                # mlx_lm.tuner.trainer.train(...) as usual
    gdn_mlx_lm.unpatch()               # or: with gdn_mlx_lm.patched(): ...

Importing this module does not import mlx-lm; `patch` does, and checks its version.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import inspect
import math
import pkgutil
import re
import sys
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from types import ModuleType

import mlx.core as mx
import numpy as np

from gdngen import mlx as gdngen_mlx
from gdngen.algebra import layer_inputs
from gdngen.problem import MAX_HEAD_DIM, MIN_HEAD_DIM, CallShape, dtype_name

__all__ = [
    "SUPPORTED_MLX_LM",
    "check_mlx_lm_version",
    "gdngen_gated_delta_update",
    "is_patched",
    "log_decay",
    "patch",
    "patched",
    "patched_modules",
    "unpatch",
]

SUPPORTED_MLX_LM = ">=0.32,<0.33"
_SUPPORTED_LOW, _SUPPORTED_HIGH = (0, 32), (0, 33)  # tested: mlx-lm 0.32.2
_FUNCTION_NAME = "gated_delta_update"
_EXPECTED_PARAMETERS = ("q", "k", "v", "a", "b", "A_log", "dt_bias", "state", "mask",
                        "use_kernel", "lower_bound", "allow_neg_eigval")


# --------------------------------------------------------------------------- the computation


def log_decay(A_log, a, dt_bias, lower_bound=None):
    """mlx-lm's decay gate in log space, float32, shaped like ``a + dt_bias``.

    ``-exp(A_log) * softplus(a + dt_bias)`` (= log of mlx-lm's ``compute_g``), or with
    ``lower_bound``: ``lower_bound * sigmoid(exp(A_log) * (a + dt_bias))`` (= log of
    ``compute_lower_bound_g``): `gdngen.algebra.layer_inputs.log_gate`, the formula
    ``gdngen.mlx.gated_delta(..., gate="softplus" | "sigmoid_bound")`` applies. No exp/log round
    trip: it cannot underflow, and its gradients to A_log, a and dt_bias are exact.
    """
    return layer_inputs.log_gate(layer_inputs.namespace("mlx"), a, A_log, dt_bias, lower_bound)


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


# --------------------------------------------------------------------------- patch state


@dataclass
class _Patch:
    original: Callable
    inference: bool
    chunk_size: int | None
    mixer: bool = True
    replaced: list[tuple[ModuleType, str]] = field(default_factory=list)
    layers: list[tuple[type, Callable]] = field(default_factory=list)
    caches: list[tuple[type, Callable]] = field(default_factory=list)


_ACTIVE: _Patch | None = None
_ORIGINAL: Callable | None = None  # mlx-lm's function, kept for stale references after unpatch


def _routed_gated_delta_update(q, k, v, a, b, A_log, dt_bias, state=None, mask=None, *,
                               use_kernel=True, lower_bound=None, allow_neg_eigval=False):
    """What `patch` installs as ``gated_delta_update``.

    Runs gdngen when a patch is active, the call is on the training path (``use_kernel=False``,
    or any call with ``patch(inference=True)``) and gdngen takes it (`_takes_chunkwise_path`:
    a per-head ``[B,T,Hv]`` or per-channel ``[B,T,Hv,Dk]`` gate, head dims in 16..256, a
    negative or no ``lower_bound``); otherwise mlx-lm's original function.
    """
    active = _ACTIVE
    if (active is None or (use_kernel and not active.inference)
            or not _takes_chunkwise_path(q, v, a, A_log, dt_bias, lower_bound)):
        return _ORIGINAL(q, k, v, a, b, A_log, dt_bias, state, mask, use_kernel=use_kernel,
                         lower_bound=lower_bound, allow_neg_eigval=allow_neg_eigval)
    return gdngen_gated_delta_update(q, k, v, a, b, A_log, dt_bias, state, mask,
                                     use_kernel=use_kernel, lower_bound=lower_bound,
                                     allow_neg_eigval=allow_neg_eigval,
                                     chunk_size=active.chunk_size)


# --------------------------------------------------------------------------- whole mixers


@dataclass(frozen=True)
class _MixerLayer:
    """How one mlx-lm layer class maps onto `gdngen.mlx.gated_delta_mixer`: ``arguments(layer,
    x)`` its projections and parameters as the mixer's keywords (mixed_qkv, conv_weight, a, b,
    z, Hk, Hv, Dk, Dv, A_log, dt_bias, norm_weight, norm_eps, norm_gate); ``conv_slots`` the
    cache entries holding its conv state(s) ``[B, K-1, channels]``, concatenated along
    channels in that order (equal widths); ``state_slot`` the recurrent state's entry;
    ``output`` the name of its output projection."""

    arguments: Callable
    conv_slots: tuple[int, ...]
    state_slot: int
    output: str


def _dims(Hk, Hv, Dk, Dv):
    return {"Hk": Hk, "Hv": Hv, "Dk": Dk, "Dv": Dv}


def _qwen_norm(layer):
    return {"A_log": layer.A_log, "dt_bias": layer.dt_bias, "norm_weight": layer.norm.weight,
            "norm_eps": layer.norm.eps, "norm_gate": "silu",
            "conv_weight": layer.conv1d.weight[..., 0],
            **_dims(layer.num_k_heads, layer.num_v_heads, layer.head_k_dim, layer.head_v_dim)}


def _qwen3_next_arguments(layer, x):
    """Qwen3-Next: q, k, v, z interleaved per key head in ``in_proj_qkvz`` (mlx-lm's
    ``fix_query_key_value_ordering``)."""
    B, S, _ = x.shape
    q, k, v, z, b, a = layer.fix_query_key_value_ordering(layer.in_proj_qkvz(x),
                                                         layer.in_proj_ba(x))
    mixed = mx.concatenate([t.reshape(B, S, -1) for t in (q, k, v)], axis=-1)
    return {"mixed_qkv": mixed, "z": z, "b": b, "a": a, **_qwen_norm(layer)}


def _qwen3_5_arguments(layer, x):
    """Qwen3.5: separate projections."""
    B, S, _ = x.shape
    z = layer.in_proj_z(x).reshape(B, S, layer.num_v_heads, layer.head_v_dim)
    return {"mixed_qkv": layer.in_proj_qkv(x), "z": z, "b": layer.in_proj_b(x),
            "a": layer.in_proj_a(x), **_qwen_norm(layer)}


def _kimi_linear_arguments(layer, x):
    """Kimi Linear: three depthwise convolutions (q_conv, k_conv, v_conv) are one over the
    concatenated projections; per-channel gate ``a [B,T,H,D]`` with A_log ``[H, 1]`` and
    dt_bias ``[H, D]``; output ``o_norm(y) * sigmoid(g)``."""
    B, S, _ = x.shape
    H, D = layer.num_heads, layer.head_dim
    mixed = mx.concatenate([layer.q_proj(x), layer.k_proj(x), layer.v_proj(x)], axis=-1)
    weight = mx.concatenate([c.conv.weight[..., 0] for c in
                             (layer.q_conv, layer.k_conv, layer.v_conv)], axis=0)
    return {"mixed_qkv": mixed, "conv_weight": weight,
            "a": layer.f_b_proj(layer.f_a_proj(x)).reshape(B, S, H, D),
            "b": layer.b_proj(x).reshape(B, S, H),
            "z": layer.g_b_proj(layer.g_a_proj(x)).reshape(B, S, H, D),
            "A_log": layer.A_log.reshape(H, 1), "dt_bias": layer.dt_bias.reshape(H, D),
            "norm_weight": layer.o_norm.weight, "norm_eps": layer.o_norm.eps,
            "norm_gate": "sigmoid", **_dims(H, H, D, D)}


#: mlx-lm layer classes whose whole ``__call__`` `patch` routes through
#: `gdngen.mlx.gated_delta_mixer`, by ``(module, class name)``
MIXER_LAYERS = {
    ("mlx_lm.models.qwen3_next", "Qwen3NextGatedDeltaNet"):
        _MixerLayer(_qwen3_next_arguments, (0,), 1, "out_proj"),
    ("mlx_lm.models.qwen3_5", "GatedDeltaNet"):
        _MixerLayer(_qwen3_5_arguments, (0,), 1, "out_proj"),
    ("mlx_lm.models.kimi_linear", "KimiDeltaAttention"):
        _MixerLayer(_kimi_linear_arguments, (0, 1, 2), 3, "o_proj"),
}


def _takes_mixer(layer, cache) -> bool:
    """Whether the layer's call may go through the mixer (its head dims checked after): a patch
    with ``mixer=True`` taking this path (training, or ``inference=True``) and no
    tensor-parallel sharding group. A cache with per-row lengths (batched generation) is
    taken: each row's conv window is read at its length, as mlx-lm's layer reads it."""
    active = _ACTIVE
    if active is None or not active.mixer or (not layer.training and not active.inference):
        return False
    return getattr(layer, "sharding_group", None) is None


def _routed_mixer_call(family: _MixerLayer, original):
    """The ``__call__`` `patch` installs on a `MIXER_LAYERS` class."""

    def __call__(self, inputs, mask=None, cache=None):
        if not _takes_mixer(self, cache):
            return _unrecorded(original(self, inputs, mask, cache), cache)
        arguments = family.arguments(self, inputs)
        if not (MIN_HEAD_DIM <= arguments["Dk"] <= MAX_HEAD_DIM
                and MIN_HEAD_DIM <= arguments["Dv"] <= MAX_HEAD_DIM):
            return _unrecorded(original(self, inputs, mask, cache), cache)
        B, S, _ = inputs.shape
        conv_state = state = None
        if cache is not None:
            convs = [cache[i] for i in family.conv_slots]
            if all(c is not None for c in convs):  # mlx-lm keeps [B, K-1, channels]
                conv_state = mx.swapaxes(mx.concatenate(convs, axis=-1), 1, 2)
            state = cache[family.state_slot]
        if mask is not None and mask.dtype != mx.bool_:
            mask = mask.astype(mx.bool_)
        rewind = (not self.training and isinstance(cache, _REWINDABLE or ())
                  and cache.lengths is None)
        steps = rewind and 1 < S <= cache.max_steps  # a verify window: keep every step's state
        start_state, start_conv = state, conv_state
        variant = None
        if self.training:
            shape = CallShape(B, S, *(arguments[n] for n in ("Hk", "Hv", "Dk", "Dv")),
                              arguments["a"].ndim == 4)
            variant = _training_variant(shape, dtype_name(arguments["mixed_qkv"]),
                                        _ACTIVE.chunk_size)
        out, state, conv_state = gdngen_mlx.gated_delta_mixer(
            **arguments, conv_state=conv_state, initial_state=state, mask=mask,
            chunk_size=None if variant is not None else _ACTIVE.chunk_size, variant=variant,
            return_states="steps" if steps else "final")
        if cache is not None:
            lengths = getattr(cache, "lengths", None)
            windows = mx.swapaxes(conv_state, 1, 2)  # [B, K-1, C], mlx-lm's layout
            timeline = None
            if rewind or lengths is not None:
                timeline = _conv_timeline(arguments, mask, start_conv)
            if lengths is not None:  # batched generation: each row's window ends at its length
                ends = mx.clip(lengths, 0, S)
                positions = ends[:, None] + mx.arange(windows.shape[1])
                windows = mx.take_along_axis(timeline, positions[..., None], axis=1)
            parts = mx.split(windows, len(family.conv_slots), axis=-1)
            for slot, part in zip(family.conv_slots, parts):
                cache[slot] = part
            states = state if steps else (state[:, None] if S == 1 else None)
            cache[family.state_slot] = state[:, -1] if steps else state
            if rewind:
                cache.record(family, start_state, start_conv, states, timeline)
            cache.advance(S)
        return getattr(self, family.output)(out.reshape(B, S, -1))

    __call__.__gdngen_original__ = original
    return __call__


def _conv_timeline(arguments, mask, start_conv):
    """``[B, K-1+T, C]``: the conv window before the call (``start_conv [B, C, K-1]``, zeros
    when None) then the call's masked inputs; the window after p steps is
    ``timeline[:, p:p+K-1]``."""
    x = arguments["mixed_qkv"]
    if mask is not None:
        x = mx.where(mask[..., None], x, 0)
    width = int(arguments["conv_weight"].shape[1]) - 1
    window = (mx.zeros((x.shape[0], width, x.shape[2]), x.dtype) if start_conv is None
              else mx.swapaxes(start_conv, 1, 2).astype(x.dtype))
    return mx.concatenate([window, x], axis=1)


def _unrecorded(out, cache):
    """``out`` of mlx-lm's own layer, after which a rewindable ``cache`` cannot rewind."""
    if isinstance(cache, _REWINDABLE or ()):
        cache.forget()
    return out


# --------------------------------------------------------------------------- rewindable cache


_REWINDABLE: type | None = None  # RewindableCache, built on first patch (it subclasses mlx-lm's)
#: how many of the latest steps a rewindable cache can take back (`RewindableCache.max_steps`)
MAX_REWIND = 16


class _Segment:
    """One recorded call of T steps: the state and conv window ``[B, K-1, C]`` before it (None:
    zeros, as mlx-lm's layers take a missing entry), the state after each step ``[B, T, Hv, Dv,
    Dk]`` and the conv window's timeline ``[B, K-1+T, C]`` (the window before, then the call's
    masked inputs: the window after p steps is ``timeline[:, p:p+K-1]``)."""

    __slots__ = ("start_conv", "start_state", "states", "timeline")

    def __init__(self, start_state, start_conv, states, timeline):
        self.start_state, self.start_conv = start_state, start_conv
        self.states, self.timeline = states, timeline

    @property
    def steps(self) -> int:
        return int(self.states.shape[1])


def _rewindable_cache_class() -> type:
    """`RewindableCache` (built once: it subclasses mlx-lm's ``ArraysCache``, and is put in
    ``mlx_lm.models.cache``'s namespace so ``load_prompt_cache`` finds it by name)."""
    global _REWINDABLE
    if _REWINDABLE is not None:
        return _REWINDABLE
    from mlx_lm.models import cache as cache_module

    class RewindableCache(cache_module.ArraysCache):
        """mlx-lm's ``ArraysCache`` for a gated-delta layer, trimmable: speculative decoding
        (``mlx_lm.generate.speculative_generate_step``) rewinds it after a verify window.

        The layer's calls through `gdngen.mlx.gated_delta_mixer` record their steps: a call of
        T <= `max_steps` tokens returns every step's state (``return_states="steps"``, the
        verify window's states written as the recurrence walks) and the conv window's
        timeline; a longer call (a prefill) is a barrier. ``trim(n)`` puts back the state and
        conv window of n steps ago, across calls, up to `max_steps` steps; past what is recorded
        (a prefill, a call that did not go through the mixer) it trims what it can and returns
        the count, as mlx-lm's caches do (``KVCache.trim``), never a state it did not record.
        Memory: up to `max_steps` states of the layer
        (``max_steps * B * Hv * Dv * Dk * 4`` bytes) beyond mlx-lm's cache.
        """

        max_steps = MAX_REWIND

        def is_trimmable(self):
            return True

        def forget(self):
            """Drop the recorded steps: the cache cannot rewind past its current state."""
            self._segments = []

        def record(self, family, start_state, start_conv, states, timeline):
            """A mixer call of ``family`` from ``start_state`` / ``start_conv`` (``[B, C,
            K-1]``, as the mixer takes it) with the conv timeline ``[B, K-1+T, C]``
            (`_conv_timeline`): ``states`` ``[B, T, Hv, Dv, Dk]``, None for a barrier."""
            segments = getattr(self, "_segments", [])
            self._family = family
            if states is None or start_state is not getattr(self, "_head", None):
                segments = []  # a barrier, or the state changed since the latest record
            if states is not None:
                segments.append(_Segment(start_state, start_conv, states, timeline))
                while len(segments) > 1 and sum(g.steps for g in segments[1:]) >= self.max_steps:
                    segments.pop(0)
            self._segments = segments
            self._head = self.cache[family.state_slot]

        def trim(self, n):
            n = int(n)
            if n <= 0:
                return 0
            segments = getattr(self, "_segments", [])
            family = getattr(self, "_family", None)
            recorded = sum(g.steps for g in segments)
            if family is None or self.cache[family.state_slot] is not self._head:
                recorded = 0
            n = min(n, recorded)  # mlx-lm's contract: trim what it can, return the count
            if n == 0:
                return 0
            left = n
            while left:
                last = segments[-1]
                if left >= last.steps:
                    segments.pop()
                    left -= last.steps
                    if not left:
                        state, windows = last.start_state, last.start_conv
                        if windows is not None:
                            windows = mx.swapaxes(windows, 1, 2)
                    continue
                keep = last.steps - left
                K1 = last.timeline.shape[1] - last.steps
                last.states = last.states[:, :keep]
                last.timeline = last.timeline[:, :keep + K1]
                state, windows = last.states[:, -1], last.timeline[:, keep:keep + K1]
                left = 0
            self.cache[family.state_slot] = state
            slots = family.conv_slots
            parts = ([None] * len(slots) if windows is None
                     else mx.split(windows, len(slots), axis=-1))
            for slot, part in zip(slots, parts):
                self.cache[slot] = part
            self._head = state
            self._segments = segments
            if self.lengths is not None:
                self.lengths = self.lengths + n
            if self.left_padding is not None:
                self.left_padding = self.left_padding + n
            return n

        @property
        def state(self):
            return self.cache, self.left_padding, self.lengths

        @state.setter
        def state(self, v):
            self.cache, self.left_padding, self.lengths = v
            self.forget()

        def filter(self, batch_indices):
            self.forget()
            super().filter(batch_indices)

        def extend(self, other):
            self.forget()
            super().extend(other)

    RewindableCache.__module__ = cache_module.__name__
    cache_module.RewindableCache = RewindableCache
    _REWINDABLE = RewindableCache
    return RewindableCache


def _rewindable_make_cache(original):
    """A model class's ``make_cache`` whose ``ArraysCache`` entries are rewindable
    while a ``patch(inference=True)`` is active."""

    def make_cache(self):
        caches = original(self)
        active = _ACTIVE
        if active is None or not active.inference or not active.mixer:
            return caches
        rewindable = _rewindable_cache_class()
        base = rewindable.__mro__[1]
        out = []
        for c in caches:
            if type(c) is base:
                r = rewindable(len(c.cache))
                r.cache, r.left_padding, r.lengths = c.cache, c.left_padding, c.lengths
                c = r
            out.append(c)
        return out

    make_cache.__gdngen_original__ = original
    return make_cache


def _patch_layers(active) -> None:
    """Install `_routed_mixer_call` on every `MIXER_LAYERS` class (once)."""
    for (module_name, class_name), family in MIXER_LAYERS.items():
        cls = getattr(importlib.import_module(module_name), class_name)
        if hasattr(cls.__call__, "__gdngen_original__"):
            continue
        original = cls.__call__
        cls.__call__ = _routed_mixer_call(family, original)
        active.layers.append((cls, original))
    _rewindable_cache_class()
    for module_name in sorted({m for m, _ in MIXER_LAYERS}):
        for cls in list(vars(importlib.import_module(module_name)).values()):
            method = vars(cls).get("make_cache") if isinstance(cls, type) else None
            if method is None or hasattr(method, "__gdngen_original__"):
                continue
            cls.make_cache = _rewindable_make_cache(method)
            active.caches.append((cls, method))


# --------------------------------------------------------------------------- version / discovery


def _parse_version(version: str) -> tuple[int, int]:
    found = re.match(r"\s*(\d+)\.(\d+)", version)
    if not found:
        raise RuntimeError(f"cannot parse the installed mlx-lm version {version!r}; gdngen's "
                           f"mlx-lm integration supports mlx-lm{SUPPORTED_MLX_LM}")
    return int(found.group(1)), int(found.group(2))


def check_mlx_lm_version(version: str | None = None) -> str:
    """Return mlx-lm's version (the installed one by default) if it is in `SUPPORTED_MLX_LM`.

    Raises ``RuntimeError`` naming the installed and the supported versions otherwise.
    """
    if version is None:
        import mlx_lm

        version = str(mlx_lm.__version__)
    if not _SUPPORTED_LOW <= _parse_version(version) < _SUPPORTED_HIGH:
        raise RuntimeError(f"gdngen's mlx-lm integration supports mlx-lm{SUPPORTED_MLX_LM}, but "
                           f"mlx-lm {version} is installed; install a supported mlx-lm or "
                           f"run without gdngen.integrations.mlx_lm.patch()")
    return version


def _check_signature(fn) -> None:
    names = tuple(inspect.signature(fn).parameters)
    if names != _EXPECTED_PARAMETERS:
        raise RuntimeError(f"mlx_lm.models.gated_delta.{_FUNCTION_NAME} has parameters {names}, "
                           f"expected {_EXPECTED_PARAMETERS}; this mlx-lm is not supported")


def _source_mentions(module_name: str, word: str) -> bool:
    spec = importlib.util.find_spec(module_name)
    origin = getattr(spec, "origin", None)
    if not origin or not origin.endswith(".py"):
        return True  # no readable source: import it and look at its namespace
    with open(origin, encoding="utf-8") as source:
        return word in source.read()


def _modules_to_scan() -> list[ModuleType]:
    """mlx_lm.models submodules whose source names ``gated_delta_update`` (imported here; one
    that fails to import is skipped with a warning) plus every mlx_lm module already imported."""
    import mlx_lm.models

    for info in pkgutil.iter_modules(mlx_lm.models.__path__, "mlx_lm.models."):
        if info.name not in sys.modules and _source_mentions(info.name, _FUNCTION_NAME):
            try:
                importlib.import_module(info.name)
            except ImportError as err:  # a missing optional dependency: the model is unusable
                warnings.warn(f"gdngen: not patching {info.name}, which fails to import: {err}",
                              stacklevel=3)
    return [module for name, module in sorted(sys.modules.items())
            if isinstance(module, ModuleType) and (name == "mlx_lm" or name.startswith("mlx_lm."))]


# --------------------------------------------------------------------------- public API


def patch(*, inference: bool = False, chunk_size: int | None = None,
          mixer: bool = True) -> tuple[str, ...]:
    """Route mlx-lm's ``gated_delta_update`` training calls to gdngen; return the patched modules.

    Every global of an mlx_lm module bound to mlx-lm's original function is replaced (aliases
    too). ``inference=True`` also routes ``use_kernel=True`` calls. Idempotent: calling it again
    re-scans and takes the new options; `unpatch` restores the originals. Patch before building
    or compiling a train step: an ``mx.compile``d function keeps the path it was traced with.
    ``chunk_size`` None: each call runs the tuned variant of its shape class and length, else
    the default (`gdngen.dispatch`; decode-length calls take the recurrent kernel below the
    crossover); an int forces that chunk on the default variant.
    ``mixer`` (default): the whole linear-attention layer of the `MIXER_LAYERS` families
    (Qwen3-Next, Qwen3.5) runs `gdngen.mlx.gated_delta_mixer` between its projections (the
    short convolution, norms, gates, recurrence and gated RMSNorm in one call; the conv and
    recurrent states carried in the layer's cache); ``mixer=False`` routes only
    ``gated_delta_update``, as for the other families.
    Raises ``RuntimeError`` for an unsupported mlx-lm (before changing anything).
    """
    global _ACTIVE, _ORIGINAL
    if chunk_size is not None and (not isinstance(chunk_size, int) or isinstance(chunk_size, bool)
                                   or chunk_size < 1):
        raise ValueError(f"chunk_size must be None or a positive int, got {chunk_size!r}")
    check_mlx_lm_version()
    from mlx_lm.models import gated_delta as mlx_gated_delta

    original = _ACTIVE.original if _ACTIVE else getattr(mlx_gated_delta, _FUNCTION_NAME)
    if original is _routed_gated_delta_update:  # installed by hand, not by patch()
        if _ORIGINAL is None:
            raise RuntimeError("mlx_lm.models.gated_delta.gated_delta_update was replaced by "
                               "hand before any patch(); mlx-lm's original is unknown")
        original = _ORIGINAL
    _check_signature(original)
    _ORIGINAL = original
    if _ACTIVE is None:
        _ACTIVE = _Patch(original, inference, chunk_size)
    _ACTIVE.inference, _ACTIVE.chunk_size = bool(inference), chunk_size
    _ACTIVE.mixer = bool(mixer)
    _patch_layers(_ACTIVE)
    for module in _modules_to_scan():
        for name, value in list(vars(module).items()):
            if value is original:
                setattr(module, name, _routed_gated_delta_update)
                _ACTIVE.replaced.append((module, name))
    return patched_modules()


def unpatch() -> None:
    """Put mlx-lm's original function back wherever `patch` replaced it; no-op if unpatched."""
    global _ACTIVE
    if _ACTIVE is None:
        return
    for module, name in _ACTIVE.replaced:
        setattr(module, name, _ACTIVE.original)
    for cls, original in _ACTIVE.layers:
        cls.__call__ = original
    for cls, original in _ACTIVE.caches:
        cls.make_cache = original
    _ACTIVE = None


@contextlib.contextmanager
def patched(*, inference: bool = False, chunk_size: int | None = None,
            mixer: bool = True) -> Iterator[tuple[str, ...]]:
    """`patch` for the duration of a ``with`` block, yielding the patched module names.

    On exit the previous state returns: unpatched if it was, else the outer patch's options.
    """
    outer = None if _ACTIVE is None else (_ACTIVE.inference, _ACTIVE.chunk_size, _ACTIVE.mixer)
    modules = patch(inference=inference, chunk_size=chunk_size, mixer=mixer)
    try:
        yield modules
    finally:
        if outer is None:
            unpatch()
        elif _ACTIVE is not None:
            _ACTIVE.inference, _ACTIVE.chunk_size, _ACTIVE.mixer = outer


def is_patched() -> bool:
    """Whether a `patch` is active."""
    return _ACTIVE is not None


def patched_modules() -> tuple[str, ...]:
    """Sorted names of the modules whose ``gated_delta_update`` the active patch replaced."""
    if _ACTIVE is None:
        return ()
    return tuple(sorted({module.__name__ for module, _ in _ACTIVE.replaced}))
