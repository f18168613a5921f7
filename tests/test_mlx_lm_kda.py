"""gdngen.integrations.mlx_lm on mlx-lm's Kimi Delta Attention models (per-channel gates).

Kimi Linear, Kimi K3 and Bailing V3 call ``gated_delta_update`` with a per-channel gate
``a [B,T,Hv,Dk]``, ``A_log [Hv,1]`` and ``dt_bias [Hv,Dk]`` (Kimi K3 and Bailing V3 with the
``lower_bound`` gate). Tiny random models built from mlx-lm's own classes, float32; every
comparison is patched (gdngen) against unpatched (mlx-lm's per-token ``gated_delta_ops``), as
the relative L2 error per array, worst one reported.
"""

from __future__ import annotations

import contextlib

import mlx.core as mx
import mlx.optimizers as optim
import pytest

mlx_lm = pytest.importorskip("mlx_lm")

from mlx_lm.models import bailing_moe_v3, kimi_k3, kimi_linear
from mlx_lm.models import gated_delta as mlx_gated_delta
from mlx_lm.models.cache import ArraysCache
from mlx_lm.tuner.trainer import TrainingArgs, train
from mlx_lm.tuner.utils import linear_to_lora_layers
from test_mlx_lm_integration import (
    VOCAB,
    LossLog,
    loss_and_grads,
    relative_error,
    token_batch,
    worst_relative_error,
)

from gdngen.integrations import mlx_lm as integration

ORIGINAL = mlx_gated_delta.gated_delta_update
GRAD_RTOL = 1e-4
CHUNK = 16


@pytest.fixture(autouse=True)
def always_unpatch():
    yield
    integration.unpatch()


# --------------------------------------------------------------------------- tiny models


def build_kimi_linear(seed=0):
    """Layers: KDA, KDA, MLA; dense MLPs. KDA: 2 heads, Dk=Dv=16, softplus gate,
    A_log stored [1,1,Hv,1]."""
    mx.random.seed(seed)
    args = kimi_linear.ModelArgs(
        model_type="kimi_linear", vocab_size=VOCAB, hidden_size=64, num_hidden_layers=3,
        num_attention_heads=2, num_key_value_heads=2, intermediate_size=96, head_dim=16,
        rope_theta=10000.0, rms_norm_eps=1e-5, model_max_length=512, num_experts=0,
        moe_intermediate_size=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8,
        v_head_dim=16,
        linear_attn_config={"num_heads": 2, "head_dim": 16, "short_conv_kernel_size": 4,
                            "kda_layers": [1, 2]})
    return _ready(kimi_linear.Model(args), seed)


def build_kimi_k3(seed=0, lower_bound=-5.0):
    """Layers: KDA, MLA, KDA with K3's attention residuals; dense MLPs. KDA: 2 heads,
    Dk=Dv=32, ``gate_lower_bound`` (the sigmoid_bound gate), A_log stored [Hv]."""
    mx.random.seed(seed)
    text = {"model_type": "kimi_linear", "vocab_size": VOCAB, "hidden_size": 64,
            "num_hidden_layers": 3, "num_attention_heads": 2, "num_key_value_heads": 2,
            "intermediate_size": 96, "rms_norm_eps": 1e-5, "attn_res_block_size": 2,
            "kv_lora_rank": 16, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8,
            "v_head_dim": 16, "num_experts": None,
            "linear_attn_config": {"num_heads": 2, "head_dim": 32, "short_conv_kernel_size": 4,
                                   "kda_layers": [1, 3], "gate_lower_bound": lower_bound}}
    return _ready(kimi_k3.Model(kimi_k3.ModelArgs(text_config=text)), seed)


def build_bailing_moe_v3(seed=0):
    """Layers: KDA, MLA; dense MLPs. KDA: 2 heads, Dk=Dv=16, ``kda_lower_bound`` -5 (the
    sigmoid_bound gate), A_log stored [Hv], beta logits cast to float32."""
    mx.random.seed(seed)
    args = bailing_moe_v3.ModelArgs(
        model_type="bailing_hybrid", vocab_size=VOCAB, hidden_size=64, intermediate_size=96,
        num_hidden_layers=2, num_attention_heads=2, head_dim=16, layer_group_size=2,
        first_k_dense_replace=2, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=16, short_conv_kernel_size=4, kda_lower_bound=-5.0,
        max_position_embeddings=512, rope_theta=10000.0)
    return _ready(bailing_moe_v3.Model(args), seed)


def kda_layers(model):
    """The KDA modules (those that call gated_delta_update) of a model."""
    found = []
    for layer in model.layers:
        if layer.is_linear:
            found.append(getattr(layer, "self_attn", None) or layer.attention)
    return found


def _ready(model, seed):
    """Random A_log and dt_bias (mlx-lm's init leaves dt_bias, and Bailing's A_log, at 0) so
    their gradients and the per-channel spread of the gate are exercised."""
    keys = iter(mx.random.split(mx.random.key(100 + seed), 8))
    for layer in kda_layers(model):
        layer.A_log = mx.random.uniform(-1.0, 1.5, layer.A_log.shape, key=next(keys))
        layer.dt_bias = mx.random.normal(layer.dt_bias.shape, key=next(keys))
    mx.eval(model.parameters())
    model.train()
    return model


BUILDERS = {"kimi_linear": build_kimi_linear, "kimi_k3": build_kimi_k3,
            "bailing_moe_v3": build_bailing_moe_v3}


def test_tiny_models_take_the_per_channel_call_forms(monkeypatch):
    """What each model passes: a [B,T,Hv,Dk], A_log [Hv,1], dt_bias [Hv,Dk], its lower_bound."""
    seen = []

    def spy(q, k, v, a, b, A_log, dt_bias, state=None, mask=None, **kwargs):
        seen.append((a.ndim, tuple(A_log.shape), tuple(dt_bias.shape), kwargs.get("lower_bound"),
                     kwargs.get("allow_neg_eigval", False), mask is None, q.shape[-1]))
        return ORIGINAL(q, k, v, a, b, A_log, dt_bias, state, mask, **kwargs)

    expected = {"kimi_linear": (16, None), "kimi_k3": (32, -5.0), "bailing_moe_v3": (16, -5.0)}
    for name, module in (("kimi_linear", kimi_linear), ("kimi_k3", kimi_k3),
                         ("bailing_moe_v3", bailing_moe_v3)):
        model = BUILDERS[name]()
        monkeypatch.setattr(module, "gated_delta_update", spy)
        seen.clear()
        model(token_batch(B=1, T=8)[:, :-1])
        D, bound = expected[name]
        assert seen == [(4, (2, 1), (2, D), bound, False, True, D)] * len(kda_layers(model)), name


# --------------------------------------------------------------------------- equivalence


@pytest.mark.parametrize("name, T, chunk_size", [("kimi_linear", 45, CHUNK),
                                                 ("kimi_k3", 61, None),
                                                 ("bailing_moe_v3", 52, CHUNK)])
def test_loss_and_every_gradient_match_unpatched(name, T, chunk_size, calls):
    model, batch = BUILDERS[name](), token_batch(B=2, T=T, seed=11 + T)
    ref_loss, ref_grads = loss_and_grads(model, batch)
    assert calls == {"gdngen": 0, "ops": len(kda_layers(model))}
    with integration.patched(chunk_size=chunk_size):
        loss, grads = loss_and_grads(model, batch)
    assert calls == {"gdngen": len(kda_layers(model)), "ops": len(kda_layers(model))}
    gate_params = [n for n in ref_grads if n.endswith(("A_log", "dt_bias"))]
    assert len(gate_params) == 2 * len(kda_layers(model))  # the gate's parameters are checked
    assert all(mx.linalg.norm(ref_grads[n]).item() > 0 for n in gate_params)
    worst = worst_relative_error(ref_grads, grads)
    print(f"{name} (T={T}): loss rel {relative_error(ref_loss, loss):.2e}, worst grad {worst}")
    assert relative_error(ref_loss, loss) < GRAD_RTOL
    assert worst[1] < GRAD_RTOL, worst


@pytest.mark.parametrize("name", ["kimi_linear", "kimi_k3"])
def test_inference_is_routed_only_with_inference_true(name, calls):
    model, inputs = BUILDERS[name](), token_batch(B=1, T=24, seed=5)[:, :-1]
    model.eval()  # use_kernel=True (on CPU: mlx-lm's ops loop)
    reference = model(inputs)
    integration.patch()
    model(inputs)
    assert calls["gdngen"] == 0
    integration.patch(inference=True)
    logits = model(inputs)
    assert calls["gdngen"] == len(kda_layers(model))
    assert relative_error(reference, logits) < 1e-5


def test_incoming_cache_state_continues_the_sequence():
    """Bailing V3 (lower_bound gate) through a cache: prefix then suffix, as one sequence."""
    model, tokens = build_bailing_moe_v3(), token_batch(B=2, T=40, seed=9)[:, :-1]
    prefix, suffix = tokens[:, :17], tokens[:, 17:]

    def continue_from_prefix():
        cache = model.make_cache()
        model(prefix, cache=cache)
        logits = model(suffix, cache=cache)
        states = [c[3] for c in cache if isinstance(c, ArraysCache)]
        mx.eval(logits, states)
        return logits, states

    ref_logits, ref_states = continue_from_prefix()
    with integration.patched(chunk_size=CHUNK):
        logits, states = continue_from_prefix()
        whole = model(tokens)[:, 17:]
    assert relative_error(ref_logits, logits) < 1e-5 and relative_error(whole, logits) < 1e-5
    assert states and all(s.dtype == mx.float32 for s in states)
    for ref, got in zip(ref_states, states):
        assert relative_error(ref, got) < 1e-5


#: per KDA family: (its cache entries, the conv module mlx-lm's own layer calls)
MIXER_CONVS = {"kimi_linear": (4, (kimi_linear.ShortConv1d, "__call__")),
               "kimi_k3": (2, (kimi_linear.ShortConv1d, "__call__")),
               "bailing_moe_v3": (4, (bailing_moe_v3.BailingKDA, "_causal_conv"))}


@pytest.mark.parametrize("name", sorted(MIXER_CONVS))
def test_kda_layers_run_the_mixer_whole(monkeypatch, name):
    """Kimi Linear's, Kimi K3's and Bailing V3's KDA layers run gdngen.mlx.gated_delta_mixer
    (Kimi Linear's and Bailing's three convolutions as one over the concatenated projections;
    mlx-lm's own conv never called): loss and every gradient as unpatched, and a prefix then a
    suffix through the cache (its conv states and the recurrent one) as unpatched."""
    from spies import spy_calls

    import gdngen.mlx

    entries, (conv_owner, conv_method) = MIXER_CONVS[name]
    model, batch = BUILDERS[name](), token_batch(B=2, T=37, seed=21)
    ref_loss, ref_grads = loss_and_grads(model, batch)
    tokens = batch[:, :-1]

    def continue_from_prefix():
        cache = model.make_cache()
        model(tokens[:, :13], cache=cache)
        logits = model(tokens[:, 13:], cache=cache)
        states = [c[i] for c in cache if isinstance(c, ArraysCache)
                  for i in range(entries)]
        mx.eval(logits, states)
        return logits, states

    model.eval()
    ref_logits, ref_states = continue_from_prefix()
    model.train()
    mixers = spy_calls(monkeypatch, gdngen.mlx, ["gated_delta_mixer"])
    convs = spy_calls(monkeypatch, conv_owner, [conv_method])
    with integration.patched(chunk_size=CHUNK, inference=True):
        loss, grads = loss_and_grads(model, batch)
        model.eval()
        logits, states = continue_from_prefix()
    assert len(mixers) == 3 * len(kda_layers(model)) and not convs
    gate_params = [n for n in ref_grads if n.endswith(("A_log", "dt_bias", "conv1d.weight",
                                                       "conv.weight", "o_norm.weight"))]
    assert len(gate_params) >= 4 * len(kda_layers(model))
    worst = worst_relative_error(ref_grads, grads)
    print(f"{name}: loss rel {relative_error(ref_loss, loss):.2e}, worst grad {worst}")
    assert relative_error(ref_loss, loss) < GRAD_RTOL
    assert worst[1] < GRAD_RTOL, worst
    assert relative_error(ref_logits, logits) < 1e-5
    assert len(states) == len(ref_states) == entries * len(kda_layers(model))
    for ref, got in zip(ref_states, states):
        assert relative_error(ref, got) < 1e-5


def test_kda_mixer_with_a_bound_gdngen_lacks_stays_on_mlx_lm(monkeypatch, calls):
    """A Kimi K3 layer whose ``gate_lower_bound`` is not a finite negative number (here 0.5, a
    gate above 1) keeps mlx-lm's whole layer under ``patch(mixer=True)``: no mixer call, and
    mlx-lm's own ``gated_delta_update`` runs it (the route leaves such a bound to mlx-lm too)."""
    from spies import spy_calls

    import gdngen.mlx

    model, batch = build_kimi_k3(lower_bound=0.5), token_batch(B=1, T=12, seed=4)
    reference = model(batch[:, :-1])
    mixers = spy_calls(monkeypatch, gdngen.mlx, ["gated_delta_mixer"])
    with integration.patched(chunk_size=CHUNK):
        logits = model(batch[:, :-1])
    assert not mixers and calls == {"gdngen": 0, "ops": 2 * len(kda_layers(model))}
    assert relative_error(reference, logits) < 1e-6


# --------------------------------------------------------------------------- what stays on mlx-lm


def per_channel_call(Dk=16, Dv=16, H=2, T=10):
    keys = iter(mx.random.split(mx.random.key(3), 8))
    q, k = (mx.random.normal((1, T, H, Dk), key=next(keys)) * Dk**-0.5 for _ in range(2))
    v = mx.random.normal((1, T, H, Dv), key=next(keys))
    a = mx.random.normal((1, T, H, Dk), key=next(keys))
    b = mx.random.normal((1, T, H), key=next(keys))
    A_log = mx.random.normal((H, 1), key=next(keys)) * 0.5
    dt_bias = mx.random.normal((H, Dk), key=next(keys))
    return q, k, v, a, b, A_log, dt_bias


@pytest.mark.parametrize("Dk, Dv, lower_bound", [
    (8, 16, None), (16, 8, -5.0), (272, 16, None),  # head dims outside 16..256
    (16, 16, 2.0), (16, 16, 0.0), (16, 16, -float("inf")), (16, 16, True),  # bounds it lacks
])
def test_calls_gdngen_cannot_take_stay_on_mlx_lm(calls, Dk, Dv, lower_bound):
    q, k, v, a, b, A_log, dt_bias = per_channel_call(Dk, Dv, T=6)
    integration.patch(inference=True)
    for use_kernel in (False, True):
        before = calls["ops"]
        y, state = kimi_linear.gated_delta_update(q, k, v, a, b, A_log, dt_bias,
                                                  use_kernel=use_kernel, lower_bound=lower_bound)
        assert calls == {"gdngen": 0, "ops": before + 1}
        ref_y, ref_state = ORIGINAL(q, k, v, a, b, A_log, dt_bias, use_kernel=use_kernel,
                                    lower_bound=lower_bound)
        assert mx.array_equal(y, ref_y, equal_nan=True)
        assert mx.array_equal(state, ref_state, equal_nan=True)


@pytest.mark.parametrize("shapes", [
    ((1, 1, 2, 1), (2, 16)),  # Kimi Linear's stored A_log [1,1,Hv,1], not reshaped
    ((16,), (16,)),           # [Dk]: mlx-lm broadcasts a 1-D parameter over a's last axis
    ((1,), (2, 1)),
    ((2, 1), (1, 2, 16)),
])
def test_parameter_shapes_follow_mlx_lm_broadcasting(calls, shapes):
    """A_log / dt_bias in other shapes mlx-lm broadcasts against a per-channel a: routed, with
    mlx-lm's broadcast (not gdngen's "[Hv] is per head")."""
    q, k, v, a, b, _, _ = per_channel_call(16, 16, H=2, T=20)
    A_log = mx.random.normal(shapes[0], key=mx.random.key(1)) * 0.5
    dt_bias = mx.random.normal(shapes[1], key=mx.random.key(2))
    with integration.patched():
        y, state = kimi_linear.gated_delta_update(q, k, v, a, b, A_log, dt_bias,
                                                  use_kernel=False, lower_bound=-3.0)
    assert calls["gdngen"] == 1
    ref_y, ref_state = ORIGINAL(q, k, v, a, b, A_log, dt_bias, use_kernel=False,
                                lower_bound=-3.0)
    assert relative_error(ref_y, y) < 1e-5 and relative_error(ref_state, state) < 1e-5


def test_parameters_with_batch_extent_stay_on_mlx_lm(calls):
    """A_log with a batch / time extent (not one of gdngen's parameter shapes) stays on
    mlx-lm; one that does not broadcast gets mlx-lm's own error."""
    q, k, v, a, b, _, dt_bias = per_channel_call(16, 16, H=2, T=6)
    A_log = mx.random.normal((6, 2, 1), key=mx.random.key(4))  # [T, Hv, 1]
    integration.patch()
    y, _ = kimi_linear.gated_delta_update(q, k, v, a, b, A_log, dt_bias, use_kernel=False)
    assert calls == {"gdngen": 0, "ops": 1}
    assert mx.array_equal(y, ORIGINAL(q, k, v, a, b, A_log, dt_bias, use_kernel=False)[0])
    with pytest.raises(ValueError, match="broadcast"):  # [Hv] against Dk=16: mlx-lm refuses
        kimi_linear.gated_delta_update(q, k, v, a, b, mx.zeros(2), dt_bias, use_kernel=False)
    assert calls["gdngen"] == 0


# --------------------------------------------------------------------------- per-call options


@pytest.mark.parametrize("lower_bound", [None, -5.0, -2])
def test_per_channel_values_and_gradients_match(lower_bound):
    """One call with an incoming state, both gates (an int bound too): y, the final state and
    the gradients to every input, A_log and dt_bias included."""
    q, k, v, a, b, A_log, dt_bias = per_channel_call(16, 32, H=2, T=37)
    state = mx.random.normal((1, 2, 32, 16), key=mx.random.key(6)) * 0.1
    args = (q, k, v, a, b, A_log, dt_bias, state)

    def value_and_grads(update):
        def fn(*xs):
            y, s = update(*xs, use_kernel=False, lower_bound=lower_bound)
            return (y * y).sum() + (s * s).sum()
        return mx.value_and_grad(fn, argnums=tuple(range(len(args))))(*args)

    ref_value, ref_grads = value_and_grads(ORIGINAL)
    with integration.patched(chunk_size=CHUNK):
        value, grads = value_and_grads(kimi_linear.gated_delta_update)
    assert relative_error(ref_value, value) < 1e-5
    errors = [relative_error(r, g) for r, g in zip(ref_grads, grads)]
    assert max(errors) < GRAD_RTOL, errors


def test_per_channel_mask_keeps_the_state_at_masked_steps():
    """A masked (left-padded) per-channel call: the state and the kept outputs match mlx-lm."""
    *arrays, A_log, dt_bias = per_channel_call(16, 16, H=2, T=24)
    q, k, v, a, b = (mx.concatenate([x, x[:, ::-1]]) for x in arrays)  # B=2
    mask = mx.arange(24)[None, :] >= mx.array([0, 5])[:, None]
    ref_y, ref_state = ORIGINAL(q, k, v, a, b, A_log, dt_bias, None, mask, use_kernel=False,
                                lower_bound=-5.0)
    with integration.patched():
        y, state = bailing_moe_v3.gated_delta_update(q, k, v, a, b, A_log, dt_bias, None, mask,
                                                     use_kernel=False, lower_bound=-5.0)
    keep = mask[..., None, None]
    assert relative_error(ref_y * keep, y * keep) < 1e-5
    assert relative_error(ref_state, state) < 1e-5


# --------------------------------------------------------------------------- LoRA training


def kimi_lora_loss_curve(tmp_path, *, patched, iters=12):
    """Per-step losses of mlx-lm's trainer (compiled step, Adam) on a tiny Kimi Linear's LoRA
    layers (lr 3e-4, as the Qwen3.5 LoRA test, which explains why)."""
    model = build_kimi_linear(seed=3)
    model.freeze()
    linear_to_lora_layers(model, num_layers=3, config={"rank": 4, "scale": 10.0, "dropout": 0.0})
    tokens = token_batch(B=2, T=40, seed=4).tolist()
    args = TrainingArgs(batch_size=2, iters=iters, steps_per_report=1, steps_per_eval=10**6,
                        steps_per_save=10**6, max_seq_length=64,
                        adapter_file=str(tmp_path / f"adapters_{patched}.safetensors"))
    log = LossLog()
    scope = integration.patched(chunk_size=CHUNK) if patched else contextlib.nullcontext()
    with scope:
        train(model, optim.Adam(learning_rate=3e-4), [(row, 0) for row in tokens], args=args,
              training_callback=log)
    assert len(log.losses) == iters
    return log.losses


def test_kimi_linear_lora_training_loss_curve_matches(tmp_path, calls):
    reference = kimi_lora_loss_curve(tmp_path, patched=False)
    assert calls["gdngen"] == 0 and calls["ops"] > 0
    ops_unpatched = calls["ops"]
    curve = kimi_lora_loss_curve(tmp_path, patched=True)
    assert calls["gdngen"] > 0 and calls["ops"] == ops_unpatched  # counted while tracing
    rel = [abs(a - b) / abs(a) for a, b in zip(reference, curve)]
    print(f"Kimi Linear LoRA: worst step rel {max(rel):.2e}; loss {reference[0]:.4f} -> "
          f"{reference[-1]:.4f}")
    assert reference[-1] < 0.9 * reference[0]  # it actually trains
    assert max(rel) < 1e-3, rel
