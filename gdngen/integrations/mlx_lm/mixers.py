"""Whole linear-attention layers on `gdngen.mlx.gated_delta_mixer`: how each `MIXER_LAYERS`
family's projections and parameters map onto the mixer, and the ``__call__`` `patch` installs
(its conv and recurrent states kept in the layer's cache, recorded in a rewindable one)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx

from gdngen import mlx as gdngen_mlx
from gdngen.integrations.mlx_lm import rewind as rewind_mod
from gdngen.integrations.mlx_lm import route
from gdngen.integrations.mlx_lm.update import _takes_lower_bound, _training_variant
from gdngen.shape import MAX_HEAD_DIM, MIN_HEAD_DIM, CallShape, dtype_name


@dataclass(frozen=True)
class _MixerLayer:
    """How one mlx-lm layer class maps onto `gdngen.mlx.gated_delta_mixer`: ``arguments(layer,
    x)`` its projections and parameters as the mixer's keywords (mixed_qkv, conv_weight, a, b,
    z, Hk, Hv, Dk, Dv, A_log, dt_bias, norm_weight, norm_eps, norm_gate); ``conv_slots`` the
    cache entries holding its conv state(s) ``[B, K-1, channels]``, concatenated along
    channels in that order (equal widths); ``state_slot`` the recurrent state's entry;
    ``output`` the name of its output projection; ``conv_masks`` below."""

    arguments: Callable
    conv_slots: tuple[int, ...]
    state_slot: int
    output: str
    #: whether mlx-lm's layer zeros masked steps' conv inputs and reads each row's window at
    #: the cache's per-row length, as the mixer does (OLMo hybrid's does neither: its calls
    #: with a mask or per-row lengths stay on mlx-lm's layer)
    conv_masks: bool = True


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


def _three_convs(x, projections, convs):
    """``(mixed_qkv, conv_weight)`` of a layer with separate q, k, v projections and depthwise
    convolutions (``nn.Conv1d``, weight ``[C, K, 1]``): three depthwise convolutions are one
    over the concatenation."""
    mixed = mx.concatenate([proj(x) for proj in projections], axis=-1)
    return mixed, mx.concatenate([c.weight[..., 0] for c in convs], axis=0)


def _kimi_linear_arguments(layer, x):
    """Kimi Linear: three depthwise convolutions (q_conv, k_conv, v_conv) are one over the
    concatenated projections; per-channel gate ``a [B,T,H,D]`` with A_log ``[H, 1]`` and
    dt_bias ``[H, D]``; output ``o_norm(y) * sigmoid(g)``."""
    B, S, _ = x.shape
    H, D = layer.num_heads, layer.head_dim
    mixed, weight = _three_convs(x, (layer.q_proj, layer.k_proj, layer.v_proj),
                                 (layer.q_conv.conv, layer.k_conv.conv, layer.v_conv.conv))
    return {"mixed_qkv": mixed, "conv_weight": weight,
            "a": layer.f_b_proj(layer.f_a_proj(x)).reshape(B, S, H, D),
            "b": layer.b_proj(x).reshape(B, S, H),
            "z": layer.g_b_proj(layer.g_a_proj(x)).reshape(B, S, H, D),
            "A_log": layer.A_log.reshape(H, 1), "dt_bias": layer.dt_bias.reshape(H, D),
            "norm_weight": layer.o_norm.weight, "norm_eps": layer.o_norm.eps,
            "norm_gate": "sigmoid", **_dims(H, H, D, D)}


def _kda_gate(layer):
    """The gate keywords of a KDA layer with a ``lower_bound`` attribute (Kimi K3's
    ``gate_lower_bound``, Bailing V3's ``kda_lower_bound``): "sigmoid_bound" with it, or
    "softplus" when it is None."""
    bound = layer.lower_bound
    return {"gate": "softplus"} if bound is None else \
        {"gate": "sigmoid_bound", "lower_bound": bound}


def _kda_parameters(layer, H, D):
    """A KDA layer's gate and output-norm parameters (``A_log [H]`` stored, taken ``[H, 1]``;
    ``dt_bias [H*D]`` taken ``[H, D]``; ``o_norm(y) * sigmoid(g)``)."""
    return {"A_log": layer.A_log.reshape(H, 1), "dt_bias": layer.dt_bias.reshape(H, D),
            "norm_weight": layer.o_norm.weight, "norm_eps": layer.o_norm.eps,
            "norm_gate": "sigmoid", **_dims(H, H, D, D)}


def _kimi_k3_arguments(layer, x):
    """Kimi K3: one projection ``qkv_proj`` and one depthwise ``qkv_conv`` over it; per-channel
    gate from the low-rank ``f_b_proj(f_a_proj(x))``, the ``gate_lower_bound`` gate when set;
    output gate ``g_proj`` (full rank) or ``g_b_proj(g_a_proj(x))``."""
    B, S, _ = x.shape
    H, D = layer.num_heads, layer.head_dim
    z = layer.g_proj(x) if layer.use_full_rank_gate else layer.g_b_proj(layer.g_a_proj(x))
    return {"mixed_qkv": layer.qkv_proj(x), "conv_weight": layer.qkv_conv.conv.weight[..., 0],
            "a": layer.f_b_proj(layer.f_a_proj(x)).reshape(B, S, H, D),
            "b": layer.b_proj(x).reshape(B, S, H), "z": z.reshape(B, S, H, D),
            **_kda_parameters(layer, H, D), **_kda_gate(layer)}


def _bailing_v3_arguments(layer, x):
    """Bailing V3 (``BailingKDA``): three projections and three depthwise convolutions
    (``q_conv1d``, ``k_conv1d``, ``v_conv1d``), one over the concatenation; full-rank
    per-channel gate ``f_proj`` with ``kda_lower_bound``; output gate ``g_proj``."""
    B, S, _ = x.shape
    H, D = layer.num_heads, layer.head_dim
    mixed, weight = _three_convs(x, (layer.q_proj, layer.k_proj, layer.v_proj),
                                 (layer.q_conv1d, layer.k_conv1d, layer.v_conv1d))
    return {"mixed_qkv": mixed, "conv_weight": weight,
            "a": layer.f_proj(x).reshape(B, S, H, D), "b": layer.b_proj(x).reshape(B, S, H),
            "z": layer.g_proj(x).reshape(B, S, H, D), **_kda_parameters(layer, H, D),
            **_kda_gate(layer)}


def _olmo_hybrid_arguments(layer, x):
    """OLMo hybrid: three projections and three depthwise convolutions (``q_conv1d``,
    ``k_conv1d``, ``v_conv1d``) as one; per-head softplus gate; ``allow_neg_eigval`` (beta =
    2 sigmoid(b)); output ``o_norm(y, g)`` = rmsnorm(y) * weight * silu(g)."""
    B, S, _ = x.shape
    mixed, weight = _three_convs(x, (layer.q_proj, layer.k_proj, layer.v_proj),
                                 (layer.q_conv1d, layer.k_conv1d, layer.v_conv1d))
    return {"mixed_qkv": mixed, "conv_weight": weight, "a": layer.a_proj(x),
            "b": layer.b_proj(x),
            "z": layer.g_proj(x).reshape(B, S, layer.num_v_heads, layer.head_v_dim),
            "A_log": layer.A_log, "dt_bias": layer.dt_bias, "norm_weight": layer.o_norm.weight,
            "norm_eps": layer.o_norm.eps, "norm_gate": "silu",
            "allow_neg_eigval": bool(layer.allow_neg_eigval),
            **_dims(layer.num_k_heads, layer.num_v_heads, layer.head_k_dim, layer.head_v_dim)}


#: mlx-lm layer classes whose whole ``__call__`` `patch` routes through
#: `gdngen.mlx.gated_delta_mixer`, by ``(module, class name)``
MIXER_LAYERS = {
    ("mlx_lm.models.qwen3_next", "Qwen3NextGatedDeltaNet"):
        _MixerLayer(_qwen3_next_arguments, (0,), 1, "out_proj"),
    ("mlx_lm.models.qwen3_5", "GatedDeltaNet"):
        _MixerLayer(_qwen3_5_arguments, (0,), 1, "out_proj"),
    ("mlx_lm.models.kimi_linear", "KimiDeltaAttention"):
        _MixerLayer(_kimi_linear_arguments, (0, 1, 2), 3, "o_proj"),
    ("mlx_lm.models.kimi_k3", "KimiK3DeltaAttention"):
        _MixerLayer(_kimi_k3_arguments, (0,), 1, "o_proj"),
    ("mlx_lm.models.bailing_moe_v3", "BailingKDA"):
        _MixerLayer(_bailing_v3_arguments, (0, 1, 2), 3, "o_proj"),
    ("mlx_lm.models.olmo_hybrid", "GatedDeltaNet"):
        _MixerLayer(_olmo_hybrid_arguments, (0, 1, 2), 3, "o_proj", conv_masks=False),
}


def _takes_mixer(layer, cache) -> bool:
    """Whether the layer's call may go through the mixer (its head dims checked after): a patch
    with ``mixer=True`` taking this path (training, or ``inference=True``) and no
    tensor-parallel sharding group. A cache with per-row lengths (batched generation) is
    taken: each row's conv window is read at its length, as mlx-lm's layer reads it."""
    active = route._ACTIVE
    if active is None or not active.mixer or (not layer.training and not active.inference):
        return False
    return getattr(layer, "sharding_group", None) is None


def _routed_mixer_call(family: _MixerLayer, original):
    """The ``__call__`` `patch` installs on a `MIXER_LAYERS` class."""

    def __call__(self, inputs, mask=None, cache=None):
        if not _takes_mixer(self, cache) or not (
                family.conv_masks or (mask is None
                                      and getattr(cache, "lengths", None) is None)):
            return _unrecorded(original(self, inputs, mask, cache), cache)
        arguments = family.arguments(self, inputs)
        if not (MIN_HEAD_DIM <= arguments["Dk"] <= MAX_HEAD_DIM
                and MIN_HEAD_DIM <= arguments["Dv"] <= MAX_HEAD_DIM
                and _takes_lower_bound(arguments.get("lower_bound"))):
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
        rewind = (not self.training and isinstance(cache, rewind_mod._REWINDABLE or ())
                  and cache.lengths is None)
        window = rewind and 1 < S <= cache.max_steps  # a verify window: recorded
        steps = window and not cache.replay  # recorded as every step's state
        start_state, start_conv = state, conv_state
        variant = None
        if self.training:
            shape = CallShape(B, S, *(arguments[n] for n in ("Hk", "Hv", "Dk", "Dv")),
                              arguments["a"].ndim == 4)
            variant = _training_variant(shape, dtype_name(arguments["mixed_qkv"]),
                                        route._ACTIVE.chunk_size)
        out, state, conv_state = gdngen_mlx.gated_delta_mixer(
            **arguments, conv_state=conv_state, initial_state=state, mask=mask,
            chunk_size=None if variant is not None else route._ACTIVE.chunk_size, variant=variant,
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
                replay = None
                if window and cache.replay:  # the inputs that replay it (not mixed_qkv, z)
                    replay = {n: x for n, x in arguments.items() if n not in ("mixed_qkv", "z")}
                    replay["mask"] = mask
                cache.record(family, start_state, start_conv, states, timeline, S, replay)
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
    if isinstance(cache, rewind_mod._REWINDABLE or ()):
        cache.forget()
    return out
