"""gdngen.integrations.mlx_lm on mlx-lm's own model code (tiny random models, no downloads).

Every comparison is patched (gdngen chunkwise) against unpatched (mlx-lm's per-token
``gated_delta_ops``) in float32, as the relative L2 error per array, worst one reported.
"""

from __future__ import annotations

import contextlib
import importlib.util
import inspect
import pkgutil
import sys
import types

import mlx.core as mx
import mlx.optimizers as optim
import pytest
from mlx import nn
from mlx.utils import tree_flatten
from spies import spy_calls

mlx_lm = pytest.importorskip("mlx_lm")

from mlx_lm.models import gated_delta as mlx_gated_delta
from mlx_lm.models import olmo_hybrid, qwen3_5, qwen3_next
from mlx_lm.models.cache import ArraysCache
from mlx_lm.tuner.callbacks import TrainingCallback
from mlx_lm.tuner.trainer import TrainingArgs, default_loss, train
from mlx_lm.tuner.utils import linear_to_lora_layers

from gdngen.integrations import mlx_lm as integration

ORIGINAL = mlx_gated_delta.gated_delta_update
VOCAB = 100
CHUNK = 16  # several chunks (and a padded tail) at the short lengths used here
GRAD_RTOL = 1e-4


@pytest.fixture(autouse=True)
def always_unpatch():
    yield
    integration.unpatch()


# --------------------------------------------------------------------------- tiny models


def build_qwen3_5(seed=0):
    """Layers: linear, linear, full attention. Hk=2, Hv=4, Dk=16, Dv=32."""
    mx.random.seed(seed)
    text = {"model_type": "qwen3_5_text", "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 16, "vocab_size": VOCAB, "linear_num_value_heads": 4,
            "linear_num_key_heads": 2, "linear_key_head_dim": 16, "linear_value_head_dim": 32,
            "linear_conv_kernel_dim": 4, "full_attention_interval": 3}
    return _ready(qwen3_5.Model(qwen3_5.ModelArgs(model_type="qwen3_5", text_config=text)))


def build_qwen3_next(seed=0):
    """Layers: linear, linear, full attention, MoE MLPs. Hk=2, Hv=4, Dk=32, Dv=16."""
    mx.random.seed(seed)
    args = qwen3_next.ModelArgs(
        model_type="qwen3_next", hidden_size=64, num_hidden_layers=3, intermediate_size=128,
        num_attention_heads=4, linear_num_value_heads=4, linear_num_key_heads=2,
        linear_key_head_dim=32, linear_value_head_dim=16, linear_conv_kernel_dim=4,
        num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1,
        shared_expert_intermediate_size=32, mlp_only_layers=[], moe_intermediate_size=32,
        rms_norm_eps=1e-6, vocab_size=VOCAB, num_key_value_heads=2, rope_theta=10000.0,
        partial_rotary_factor=0.25, max_position_embeddings=512, head_dim=16,
        full_attention_interval=3)
    return _ready(qwen3_next.Model(args))


def build_olmo_hybrid(seed=0):
    """Layers: linear (allow_neg_eigval: beta in [0, 2]), full attention. Dk=Dv=16."""
    mx.random.seed(seed)
    args = olmo_hybrid.ModelArgs(
        model_type="olmo_hybrid", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6, vocab_size=VOCAB,
        max_position_embeddings=512, linear_num_key_heads=2, linear_num_value_heads=2,
        linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
        linear_allow_neg_eigval=True, tie_word_embeddings=False, attention_bias=False,
        layer_types=["linear_attention", "full_attention"])
    return _ready(olmo_hybrid.Model(args))


def _ready(model):
    mx.eval(model.parameters())
    model.train()
    return model


BUILDERS = {"qwen3_5": build_qwen3_5, "qwen3_next": build_qwen3_next,
            "olmo_hybrid": build_olmo_hybrid}


def token_batch(B=2, T=45, seed=1):
    return mx.random.randint(0, VOCAB, (B, T + 1), key=mx.random.key(seed))


def loss_and_grads(model, batch):
    """mlx-lm's trainer loss (``default_loss``) and its gradient for every parameter."""
    lengths = mx.array([[0, batch.shape[1] - 1]] * batch.shape[0])
    fn = nn.value_and_grad(model, lambda m, b, n: default_loss(m, b, n)[0])
    loss, grads = fn(model, batch, lengths)
    mx.eval(loss, grads)
    return loss, dict(tree_flatten(grads))


def relative_error(ref, got):
    ref, got = ref.astype(mx.float32), got.astype(mx.float32)
    den = mx.linalg.norm(ref.flatten()).item()
    num = mx.linalg.norm((ref - got).flatten()).item()
    return num / den if den > 0 else num


def worst_relative_error(ref: dict, got: dict):
    """``(name, error)`` of the worst array; every ref key must be in got."""
    assert ref.keys() == got.keys()
    return max(((name, relative_error(ref[name], got[name])) for name in ref),
               key=lambda item: item[1])


def linear_attention_layers(model):
    return [layer.linear_attn for layer in model.layers if hasattr(layer, "linear_attn")]


# --------------------------------------------------------------------------- patch mechanics


def modules_binding(fn):
    return {name for name, module in sys.modules.items()
            if name.startswith("mlx_lm.") and isinstance(module, types.ModuleType)
            and any(value is fn for value in vars(module).values())}


def test_patch_covers_every_module_that_imports_gated_delta_update():
    import mlx_lm.models

    users = set()
    for info in pkgutil.iter_modules(mlx_lm.models.__path__, "mlx_lm.models."):
        with open(importlib.util.find_spec(info.name).origin, encoding="utf-8") as source:
            if "gated_delta_update" in source.read():
                users.add(info.name)
    assert {"mlx_lm.models.qwen3_5", "mlx_lm.models.qwen3_next",
            "mlx_lm.models.gated_delta"} <= users
    patched = integration.patch()
    assert set(patched) == users  # qwen3_5_moe reaches it through qwen3_5
    assert modules_binding(ORIGINAL) == set()
    assert modules_binding(integration.route._routed_gated_delta_update) == users


def test_installed_function_has_mlx_lm_signature():
    def shape(fn):
        return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]

    assert shape(integration.route._routed_gated_delta_update) == shape(ORIGINAL)


def test_unpatch_restores_originals_exactly_and_patch_is_idempotent():
    alias_probe = types.ModuleType("mlx_lm.models._gdngen_alias_probe")
    alias_probe.gdu = ORIGINAL  # an aliased import is patched too
    sys.modules[alias_probe.__name__] = alias_probe
    try:
        before = {name: dict(vars(sys.modules[name])) for name in modules_binding(ORIGINAL)}
        first = integration.patch()
        assert integration.patch(chunk_size=32) == first and integration.is_patched()
        assert alias_probe.gdu is integration.route._routed_gated_delta_update
        integration.unpatch()
        integration.unpatch()  # no-op
        assert not integration.is_patched() and integration.patched_modules() == ()
        for name, namespace in before.items():
            now = vars(sys.modules[name])
            assert all(now[key] is value for key, value in namespace.items()), name
        assert alias_probe.gdu is ORIGINAL
    finally:
        del sys.modules[alias_probe.__name__]


def test_context_manager_restores_the_state_it_found():
    with integration.patched(chunk_size=CHUNK) as modules:
        assert "mlx_lm.models.qwen3_5" in modules
        assert qwen3_5.gated_delta_update is integration.route._routed_gated_delta_update
    assert qwen3_5.gated_delta_update is ORIGINAL and not integration.is_patched()

    integration.patch(inference=False, chunk_size=32)
    with integration.patched(inference=True, chunk_size=CHUNK):
        assert integration.route._ACTIVE.inference and integration.route._ACTIVE.chunk_size == CHUNK
    assert integration.is_patched()  # the outer patch survives with its options
    assert not integration.route._ACTIVE.inference and integration.route._ACTIVE.chunk_size == 32


@pytest.mark.parametrize("version", ["0.33.0", "0.31.9", "1.0.0"])
def test_unsupported_mlx_lm_version_fails_clearly_and_patches_nothing(monkeypatch, version):
    monkeypatch.setattr(mlx_lm, "__version__", version)
    with pytest.raises(RuntimeError) as err:
        integration.patch()
    assert version in str(err.value) and integration.SUPPORTED_MLX_LM in str(err.value)
    assert not integration.is_patched() and qwen3_5.gated_delta_update is ORIGINAL


def test_installed_mlx_lm_is_in_the_supported_range():
    assert integration.check_mlx_lm_version() == mlx_lm.__version__


def test_training_forward_runs_gdngen_and_never_the_per_token_loop(calls):
    model, batch = build_qwen3_5(), token_batch()
    integration.patch(chunk_size=CHUNK)
    loss_and_grads(model, batch)
    assert calls == {"gdngen": len(linear_attention_layers(model)), "ops": 0}


@pytest.mark.parametrize("name", ["qwen3_5", "qwen3_next", "olmo_hybrid"])
@pytest.mark.parametrize("mixer", [True, False], ids=["mixer", "update_only"])
def test_whole_layers_run_the_mixer_and_match_unpatched(monkeypatch, name, mixer):
    """Qwen3.5 / Qwen3-Next / OLMo hybrid (beta in [0, 2], three convs as one)
    linear-attention layers run gdngen.mlx.gated_delta_mixer whole (``patch(mixer=True)``, the
    default; mlx-lm's conv1d and gated norm never run), loss and every gradient as
    unpatched; ``mixer=False`` routes gated_delta_update alone."""
    import gdngen.mlx

    model, batch = BUILDERS[name](), token_batch()
    ref_loss, ref_grads = loss_and_grads(model, batch)
    ran = spy_calls(monkeypatch, gdngen.mlx, ["gated_delta_mixer"])
    convs = spy_calls(monkeypatch, nn.Conv1d, ["__call__"])
    with integration.patched(chunk_size=CHUNK, mixer=mixer):
        loss, grads = loss_and_grads(model, batch)
    layers = len(linear_attention_layers(model))
    assert len(ran) == (layers if mixer else 0)
    assert len(convs) == (0 if mixer else layers * (3 if name == "olmo_hybrid" else 1))
    worst = worst_relative_error(ref_grads, grads)
    assert relative_error(ref_loss, loss) < GRAD_RTOL
    assert worst[1] < GRAD_RTOL, worst


def test_olmo_hybrid_mixer_continues_through_the_cache_and_leaves_masks_to_mlx_lm(monkeypatch):
    """OLMo hybrid through ``patch(mixer=True, inference=True)``: a prefix then a suffix
    through the cache (three conv states and the recurrent one) as unpatched; a call with a
    mask keeps mlx-lm's layer (whose conv reads masked steps' inputs as they are, where the
    mixer zeros them) and gives its outputs at the unmasked steps."""
    import gdngen.mlx

    model, tokens = build_olmo_hybrid(), token_batch(B=2, T=30, seed=4)[:, :-1]
    model.eval()

    def continue_from_prefix():
        cache = model.make_cache()
        model(tokens[:, :11], cache=cache)
        logits = model(tokens[:, 11:], cache=cache)
        states = [c[i] for c in cache if isinstance(c, ArraysCache) for i in range(4)]
        mx.eval(logits, states)
        return logits, states

    ref_logits, ref_states = continue_from_prefix()
    layer = linear_attention_layers(model)[0]
    x = mx.random.normal((2, 9, 64), key=mx.random.key(8))
    mask = mx.array([[True] * 9, [False] * 3 + [True] * 6])
    ref_masked = layer(x, mask=mask)
    ran = spy_calls(monkeypatch, gdngen.mlx, ["gated_delta_mixer"])
    with integration.patched(chunk_size=CHUNK, inference=True):
        logits, states = continue_from_prefix()
        assert len(ran) == 2 * len(linear_attention_layers(model))
        masked = layer(x, mask=mask)
        assert len(ran) == 2 * len(linear_attention_layers(model))  # the masked call: mlx-lm's
    assert relative_error(ref_logits, logits) < 1e-5
    assert len(states) == len(ref_states) == 4 * len(linear_attention_layers(model))
    for ref, got in zip(ref_states, states):
        assert relative_error(ref, got) < 1e-5
    keep = mask[..., None]  # padded steps' outputs are not defined alike (gdngen zeros them)
    assert relative_error(mx.where(keep, ref_masked, 0), mx.where(keep, masked, 0)) < 1e-5


def test_inference_keeps_mlx_lm_unless_asked(calls):
    model, inputs = build_qwen3_5(), token_batch()[:, :-1]
    model.eval()  # use_kernel=True: mlx-lm's kernel on Metal, its ops loop on CPU
    reference = model(inputs)
    integration.patch()
    model(inputs)
    assert calls["gdngen"] == 0
    integration.patch(inference=True, chunk_size=CHUNK)
    logits = model(inputs)
    assert calls["gdngen"] == len(linear_attention_layers(model))
    assert relative_error(reference, logits) < GRAD_RTOL


# --------------------------------------------------------------------------- equivalence


@pytest.mark.parametrize("name, chunk_size", [(name, CHUNK) for name in sorted(BUILDERS)]
                         + [("qwen3_5", 64)])
def test_loss_and_every_gradient_match_unpatched(name, chunk_size):
    model, batch = BUILDERS[name](), token_batch()
    ref_loss, ref_grads = loss_and_grads(model, batch)
    with integration.patched(chunk_size=chunk_size):
        loss, grads = loss_and_grads(model, batch)
    worst = worst_relative_error(ref_grads, grads)
    print(f"{name} (chunk {chunk_size}): loss rel {relative_error(ref_loss, loss):.2e}, "
          f"worst grad {worst}")
    assert relative_error(ref_loss, loss) < GRAD_RTOL
    assert worst[1] < GRAD_RTOL, worst


def test_allow_neg_eigval_doubles_beta():
    q, k, v = (mx.random.normal((1, 20, 2, 16), key=mx.random.key(i)) * 0.3 for i in range(3))
    a, b = (mx.random.normal((1, 20, 2), key=mx.random.key(i)) for i in (3, 4))
    A_log, dt_bias = mx.zeros(2), mx.ones(2)
    with integration.patched(chunk_size=CHUNK):
        for neg in (False, True):
            y, state = olmo_hybrid.gated_delta_update(q, k, v, a, b, A_log, dt_bias,
                                                      use_kernel=False, allow_neg_eigval=neg)
            ref_y, ref_state = ORIGINAL(q, k, v, a, b, A_log, dt_bias, use_kernel=False,
                                        allow_neg_eigval=neg)
            assert relative_error(ref_y, y) < 1e-5 and relative_error(ref_state, state) < 1e-5
            if not neg:
                y_plain = y
    assert relative_error(y_plain, y) > 1e-2  # the flag changes the result


def test_lower_bound_gate_values_and_gradients_match():
    shape = (2, 24, 4)
    q, k = (mx.random.normal((2, 24, 2, 16), key=mx.random.key(i)) * 0.3 for i in range(2))
    v = mx.random.normal((2, 24, 4, 16), key=mx.random.key(2))
    a, b = (mx.random.normal(shape, key=mx.random.key(i)) for i in (3, 4))
    A_log, dt_bias = mx.array([0.0, 0.5, 1.0, 2.0]), mx.array([0.1, -0.2, 0.3, 1.0])

    def loss(update):
        def fn(q, k, v, a, b, A_log, dt_bias):
            y, state = update(q, k, v, a, b, A_log, dt_bias, use_kernel=False, lower_bound=-5.0)
            return (y * y).sum() + (state * state).sum()
        return mx.value_and_grad(fn, argnums=tuple(range(7)))(q, k, v, a, b, A_log, dt_bias)

    ref_value, ref_grads = loss(ORIGINAL)
    with integration.patched(chunk_size=CHUNK):
        value, grads = loss(qwen3_5.gated_delta_update)
    assert relative_error(ref_value, value) < 1e-5
    for ref, got in zip(ref_grads, grads):
        assert relative_error(ref, got) < GRAD_RTOL


@pytest.mark.parametrize("vector", [False, True])
def test_training_path_runs_chunkwise_and_inference_path_switches(monkeypatch, vector):
    """mlx-lm's training calls (``use_kernel=False``) are differentiated, so they run the chunk
    path at every T (no step-loop forward paid on top of the chunk forward the VJP needs);
    inference calls (``use_kernel=True`` under ``patch(inference=True)``) take the recurrent
    switch (T = 24 is under the default crossover of every MLX backend here). Both match
    mlx-lm's ops loop, values and (training) every gradient."""
    from gdngen.backends.portable import mlx_chunkwise

    ran = spy_calls(monkeypatch, mlx_chunkwise,
                    ("recurrent_gated_delta", "chunkwise_gated_delta"))
    q, k = (mx.random.normal((1, 24, 2, 16), key=mx.random.key(i)) * 0.3 for i in range(2))
    v = mx.random.normal((1, 24, 4, 16), key=mx.random.key(2))
    gate_shape = (1, 24, 4, 16) if vector else (1, 24, 4)
    a = mx.random.normal(gate_shape, key=mx.random.key(3))
    b = mx.random.normal((1, 24, 4), key=mx.random.key(4))
    A_log = mx.array([0.0, 0.5, 1.0, 2.0])
    dt_bias = mx.random.normal((4, 16) if vector else (4,), key=mx.random.key(5))
    if vector:
        A_log = A_log.reshape(4, 1)

    def loss(update):
        def fn(q, k, v, a, b, A_log, dt_bias):
            y, state = update(q, k, v, a, b, A_log, dt_bias, use_kernel=False)
            return (y * y).sum() + (state * state).sum()
        return mx.value_and_grad(fn, argnums=tuple(range(7)))(q, k, v, a, b, A_log, dt_bias)

    ref_value, ref_grads = loss(ORIGINAL)
    with integration.patched(inference=True):
        value, grads = loss(qwen3_5.gated_delta_update)
        mx.eval(value, grads)
        assert ran and "recurrent_gated_delta" not in ran
        ran.clear()
        y, state = qwen3_5.gated_delta_update(q, k, v, a, b, A_log, dt_bias, use_kernel=True)
        mx.eval(y, state)
        assert ran == ["recurrent_gated_delta"]
    assert relative_error(ref_value, value) < 1e-5
    for ref, got in zip(ref_grads, grads):
        assert relative_error(ref, got) < GRAD_RTOL
    ref_y, ref_state = ORIGINAL(q, k, v, a, b, A_log, dt_bias, use_kernel=False)
    assert relative_error(ref_y, y) < 1e-5 and relative_error(ref_state, state) < 1e-5


def test_output_and_state_dtypes_follow_mlx_lm():
    """bfloat16 activations: y in q's dtype, state float32, values within bfloat16 rounding."""
    bf16 = mx.bfloat16
    q, k = (mx.random.normal((1, 30, 2, 16), key=mx.random.key(i)).astype(bf16) * 0.3
            for i in range(2))
    v = mx.random.normal((1, 30, 4, 32), key=mx.random.key(2)).astype(bf16)
    a, b = (mx.random.normal((1, 30, 4), key=mx.random.key(i)).astype(bf16) for i in (3, 4))
    A_log, dt_bias = mx.zeros(4), mx.ones(4).astype(bf16)
    state = mx.random.normal((1, 4, 32, 16), key=mx.random.key(5)) * 0.1
    ref_y, ref_state = ORIGINAL(q, k, v, a, b, A_log, dt_bias, state, use_kernel=False)
    with integration.patched(chunk_size=CHUNK):
        y, new_state = qwen3_5.gated_delta_update(q, k, v, a, b, A_log, dt_bias, state,
                                                  use_kernel=False)
    assert (y.dtype, new_state.dtype) == (ref_y.dtype, ref_state.dtype) == (bf16, mx.float32)
    assert relative_error(ref_y, y) < 2e-2 and relative_error(ref_state, new_state) < 2e-2


def test_log_decay_is_the_log_of_mlx_lm_gates():
    a = mx.random.normal((3, 5, 4), key=mx.random.key(0)) * 3
    A_log, dt_bias = mx.array([-1.0, 0.0, 1.0, 2.0]), mx.array([0.5, -0.5, 1.0, 0.0])
    g = mlx_gated_delta.compute_g(A_log, a, dt_bias)
    assert relative_error(mx.log(g), integration.log_decay(A_log, a, dt_bias)) < 1e-6
    g = mlx_gated_delta.compute_lower_bound_g(A_log, a, dt_bias, -5.0)
    assert relative_error(mx.log(g), integration.log_decay(A_log, a, dt_bias, -5.0)) < 1e-6


def test_strong_decay_gradients_are_finite_and_match():
    model, batch = build_qwen3_5(), token_batch()
    for layer in linear_attention_layers(model):
        layer.A_log = mx.full(layer.A_log.shape, 4.0)  # log g = -e^4 softplus(a + dt_bias)
    log_g = [integration.log_decay(layer.A_log, mx.zeros((1, 1, 4)), layer.dt_bias)
             for layer in linear_attention_layers(model)]
    assert max(x.max().item() for x in log_g) < -30  # strong decay, below exp's comfort zone
    ref_loss, ref_grads = loss_and_grads(model, batch)
    with integration.patched(chunk_size=CHUNK):
        loss, grads = loss_and_grads(model, batch)
    assert all(mx.all(mx.isfinite(g)).item() for g in grads.values())
    if all(mx.all(mx.isfinite(g)).item() for g in ref_grads.values()):
        worst = worst_relative_error(ref_grads, grads)
        print(f"strong decay: worst grad {worst}")
        assert relative_error(ref_loss, loss) < GRAD_RTOL and worst[1] < GRAD_RTOL, worst


def test_masked_batch_matches_at_kept_positions():
    layer = linear_attention_layers(build_qwen3_5())[0]
    B, T = 2, 40
    x = mx.random.normal((B, T, 64), key=mx.random.key(5))
    mask = mx.arange(T)[None, :] >= mx.array([0, 7])[:, None]  # row 1 left-padded by 7
    weight = mx.random.normal((B, T, 64), key=mx.random.key(6)) * mask[..., None]

    def run():
        def fn(params, x):
            layer.update(params)
            return (layer(x, mask, None) * weight).sum()
        value, (d_params, d_x) = mx.value_and_grad(fn, argnums=(0, 1))(
            layer.trainable_parameters(), x)
        out = layer(x, mask, None)
        mx.eval(value, d_params, d_x, out)
        grads = dict(tree_flatten(d_params), x=d_x)
        return out * mask[..., None], value, grads

    ref_out, ref_value, ref_grads = run()
    with integration.patched(chunk_size=CHUNK):
        out, value, grads = run()
    assert relative_error(ref_out, out) < 1e-5
    assert relative_error(ref_value, value) < 1e-5
    worst = worst_relative_error(ref_grads, grads)
    assert worst[1] < GRAD_RTOL, worst


def test_incoming_cache_state_continues_the_sequence():
    model, tokens = build_qwen3_5(), token_batch(T=40)[:, :-1]
    prefix, suffix = tokens[:, :21], tokens[:, 21:]

    def continue_from_prefix():
        cache = model.make_cache()
        model(prefix, cache=cache)  # training mode: the state comes from the use_kernel=False path
        logits = model(suffix, cache=cache)
        states = [c[1] for c in cache if isinstance(c, ArraysCache)]
        mx.eval(logits, states)
        return logits, states

    ref_logits, ref_states = continue_from_prefix()
    with integration.patched(chunk_size=CHUNK):
        logits, states = continue_from_prefix()
        whole = model(tokens)[:, 21:]
    assert relative_error(ref_logits, logits) < 1e-5
    assert relative_error(whole, logits) < 1e-5
    assert all(s.dtype == mx.float32 for s in states)
    for ref, got in zip(ref_states, states):
        assert relative_error(ref, got) < 1e-5


def test_incoming_state_gradient_matches():
    layer = linear_attention_layers(build_qwen3_5())[0]
    x = mx.random.normal((2, 30, 64), key=mx.random.key(7))
    state0 = mx.random.normal((2, 4, 32, 16), key=mx.random.key(8)) * 0.1

    def run():
        def fn(params, state0):
            layer.update(params)
            cache = qwen3_5.ArraysCache(size=2)
            cache[1] = state0
            out = layer(x, None, cache)
            return (out * out).sum() + (cache[1] * cache[1]).sum()
        value, (d_params, d_state0) = mx.value_and_grad(fn, argnums=(0, 1))(
            layer.trainable_parameters(), state0)
        mx.eval(value, d_params, d_state0)
        return value, dict(tree_flatten(d_params), state0=d_state0)

    ref_value, ref_grads = run()
    with integration.patched(chunk_size=CHUNK):
        value, grads = run()
    assert relative_error(ref_value, value) < 1e-5
    worst = worst_relative_error(ref_grads, grads)
    assert worst[1] < GRAD_RTOL, worst


def test_mx_compile_of_loss_and_grad():
    model, batch = build_qwen3_5(), token_batch()
    lengths = mx.array([[0, batch.shape[1] - 1]] * batch.shape[0])
    ref_loss, ref_grads = loss_and_grads(model, batch)
    params = model.trainable_parameters()

    def loss_fn(params, batch, lengths):
        model.update(params)
        return default_loss(model, batch, lengths)[0]

    with integration.patched(chunk_size=CHUNK):
        compiled = mx.compile(mx.value_and_grad(loss_fn))
        loss, grads = compiled(params, batch, lengths)
        again, _ = compiled(params, batch, lengths)
    mx.eval(loss, grads, again)
    assert relative_error(ref_loss, loss) < GRAD_RTOL and again.item() == loss.item()
    worst = worst_relative_error(ref_grads, dict(tree_flatten(grads)))
    assert worst[1] < GRAD_RTOL, worst


def test_calls_gdngen_cannot_speed_up_stay_on_mlx_lm(calls):
    """Head dims below 16 keep mlx-lm's function, per-head and per-channel gates alike
    (per-channel calls in range go to gdngen: tests/test_mlx_lm_kda.py)."""
    integration.patch()
    B, T, H = 1, 8, 2
    for Dk, vector_gate in ((8, True), (8, False)):
        q, k, v = (mx.random.normal((B, T, H, Dk), key=mx.random.key(i)) for i in range(3))
        a = mx.random.normal((B, T, H, Dk) if vector_gate else (B, T, H), key=mx.random.key(3))
        A_log = mx.zeros((H, 1)) if vector_gate else mx.zeros(H)
        dt_bias = mx.zeros((H, Dk)) if vector_gate else mx.zeros(H)
        b = mx.zeros((B, T, H))
        ops_before = calls["ops"]
        y, _ = qwen3_5.gated_delta_update(q, k, v, a, b, A_log, dt_bias, use_kernel=False)
        assert calls == {"gdngen": 0, "ops": ops_before + 1}
        ref_y, _ = ORIGINAL(q, k, v, a, b, A_log, dt_bias, use_kernel=False)
        assert mx.array_equal(y, ref_y)


# --------------------------------------------------------------------------- LoRA training


class LossLog(TrainingCallback):
    def __init__(self):
        self.losses = []

    def on_train_loss_report(self, train_info):
        self.losses.append(train_info["train_loss"])


def lora_loss_curve(tmp_path, *, patched, grad_checkpoint=False, iters=20):
    """Per-step losses of mlx-lm's trainer (compiled step, Adam) on LoRA layers.

    Training on 2 random sequences is chaotic: at lr 1e-3 a 1e-6 relative perturbation of the
    embeddings alone moves the curve by 3e-2 within 20 steps. At lr 3e-4 the same perturbation
    moves it by <= 2e-3 and the loss still falls from 4.8 to 1.8.
    """
    model = build_qwen3_5(seed=3)
    model.freeze()
    linear_to_lora_layers(model, num_layers=3,
                          config={"rank": 4, "scale": 10.0, "dropout": 0.0})
    tokens = token_batch(B=2, T=40, seed=4).tolist()
    dataset = [(row, 0) for row in tokens]
    args = TrainingArgs(batch_size=2, iters=iters, steps_per_report=1, steps_per_eval=10**6,
                        steps_per_save=10**6, max_seq_length=64, grad_checkpoint=grad_checkpoint,
                        adapter_file=str(tmp_path / f"adapters_{patched}.safetensors"))
    log = LossLog()
    layer_type = type(model.layers[0])
    call = layer_type.__call__  # grad_checkpoint rebinds it on the class
    scope = integration.patched(chunk_size=CHUNK) if patched else contextlib.nullcontext()
    try:
        with scope:
            train(model, optim.Adam(learning_rate=3e-4), dataset, args=args,
                  training_callback=log)
    finally:
        layer_type.__call__ = call
    assert len(log.losses) == iters
    return log.losses


@pytest.fixture(scope="module")
def unpatched_lora_curve(tmp_path_factory):
    return lora_loss_curve(tmp_path_factory.mktemp("unpatched"), patched=False)


@pytest.mark.parametrize("grad_checkpoint", [False, True], ids=["plain", "grad_checkpoint"])
def test_lora_training_loss_curve_matches(unpatched_lora_curve, tmp_path, grad_checkpoint,
                                         calls):
    curve = lora_loss_curve(tmp_path, patched=True, grad_checkpoint=grad_checkpoint)
    assert calls["gdngen"] > 0 and calls["ops"] == 0  # counted while tracing the compiled step
    rel = [abs(a - b) / abs(a) for a, b in zip(unpatched_lora_curve, curve)]
    print(f"LoRA ({'checkpointed' if grad_checkpoint else 'plain'}): worst step rel "
          f"{max(rel):.2e}; loss {unpatched_lora_curve[0]:.4f} -> {unpatched_lora_curve[-1]:.4f}")
    assert unpatched_lora_curve[-1] < 0.9 * unpatched_lora_curve[0]  # it actually trains
    assert max(rel) < 1e-3, rel


# --------------------------------------------------------------------------- generation


def greedy_tokens(model, prompt, steps):
    """``steps`` greedy tokens after ``prompt`` through mlx-lm's prompt cache (one T=len(prompt)
    prefill, then T=1 decode calls), with the logits of each step."""
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    logits = model(prompt[None], cache=cache)[:, -1]
    tokens, every = [], []
    for _ in range(steps):
        token = mx.argmax(logits, axis=-1)
        mx.eval(token, logits)
        tokens.append(token.item())
        every.append(logits)
        logits = model(token[None], cache=cache)[:, -1]
    return tokens, mx.concatenate(every)


def test_generation_with_patched_inference_gives_the_same_tokens(monkeypatch, calls):
    """A tiny Qwen3.5 generating 64 tokens: patched (prefill and T=1 decode through gdngen, the
    decode steps on its recurrent kernel) the same tokens and logits as mlx-lm's own path."""
    model = build_qwen3_5()
    model.eval()
    prompt = token_batch(B=1, T=11)[0]
    reference, reference_logits = greedy_tokens(model, prompt, 64)
    assert calls["gdngen"] == 0
    import gdngen.mlx

    mixers = spy_calls(monkeypatch, gdngen.mlx, ["gated_delta_mixer"])
    with integration.patched(inference=True):
        tokens, logits = greedy_tokens(model, prompt, 64)
    assert calls["gdngen"] == 65 * len(linear_attention_layers(model))  # prefill + 64 decodes
    assert len(mixers) == calls["gdngen"]  # whole layers, conv and norm states in the cache
    assert tokens == reference
    assert relative_error(reference_logits, logits) < GRAD_RTOL
