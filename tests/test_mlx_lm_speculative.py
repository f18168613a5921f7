"""Speculative decoding and batched generation of mlx-lm's gated-delta models under
``patch(inference=True)`` (`gdngen.integrations.mlx_lm`'s rewindable cache): tiny random
Qwen3.5 / Qwen3-Next models built from mlx-lm's own classes, float32."""

from __future__ import annotations

import copy

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_map

pytest.importorskip("mlx_lm")

from mlx_lm.generate import batch_generate, generate_step, stream_generate
from mlx_lm.models.cache import (
    load_prompt_cache,
    make_prompt_cache,
    save_prompt_cache,
    trim_prompt_cache,
)
from test_mlx_lm_integration import (
    build_olmo_hybrid,
    build_qwen3_5,
    build_qwen3_next,
    linear_attention_layers,
    token_batch,
)
from test_mlx_lm_kda import build_bailing_moe_v3, build_kimi_k3, build_kimi_linear

from gdngen.integrations import mlx_lm as integration

BUILDERS = {"qwen3_5": build_qwen3_5, "qwen3_next": build_qwen3_next}
#: the families speculative decoding is checked on end to end (the KDA ones: per-channel gates;
#: Kimi Linear and Bailing V3 with three short convolutions, Kimi K3 and Bailing V3 with the
#: lower_bound gate and MLA layers' KV caches beside the rewindable ones; OLMo hybrid: beta in
#: [0, 2], three convolutions)
SPECULATIVE = {**BUILDERS, "kimi_linear": build_kimi_linear, "kimi_k3": build_kimi_k3,
               "bailing_moe_v3": build_bailing_moe_v3, "olmo_hybrid": build_olmo_hybrid}
VOCAB = 100


@pytest.fixture(autouse=True)
def always_unpatch():
    yield
    integration.unpatch()


def tokenizer():
    """A word-level tokenizer over the models' 100 ids ("0" .. "99"; "99" ends the text)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.WordLevel(vocab={str(i): i for i in range(VOCAB)}, unk_token="0"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="99")


def models(name):
    """The model, and a draft that agrees with it on part of the tokens: the same weights with
    5% noise."""
    model = SPECULATIVE[name]()
    draft = SPECULATIVE[name]()
    mx.random.seed(5)
    draft.update(tree_map(lambda p: p + 0.05 * mx.std(p) * mx.random.normal(p.shape),
                          draft.parameters()))
    model.eval(), draft.eval()
    mx.eval(draft.parameters())
    return model, draft


def greedy(model, prompt, n):
    return [t for t, _ in generate_step(prompt, model, max_tokens=n)]


@pytest.mark.parametrize("name", sorted(SPECULATIVE))
def test_speculative_decoding_gives_the_greedy_tokens(name, calls):
    """stream_generate with a draft model: mlx-lm refuses without the patch; patched, the
    tokens are plain greedy generation's, with drafts both accepted and rejected (rewinds
    within a verify window and across the draft's calls)."""
    model, draft = models(name)
    # Bailing's tiny model ends the text ("99") 9 tokens after the default prompt: too few to
    # see drafts rejected, so it takes a prompt it generates 40 tokens from
    prompt = token_batch(B=1, T=11, seed=3 if name == "bailing_moe_v3" else 1)[0]
    reference = greedy(model, prompt, 40)
    tok = tokenizer()
    ops = calls["ops"]
    with pytest.raises(ValueError, match="requires a trimmable prompt cache"):
        list(stream_generate(model, tok, prompt, max_tokens=4, draft_model=draft))
    with integration.patched(inference=True):
        out = list(stream_generate(model, tok, prompt, max_tokens=40, draft_model=draft,
                                   num_draft_tokens=4))
    eos = VOCAB - 1  # stream_generate stops after the tokenizer's end token ("99")
    expected = reference[:reference.index(eos) + 1] if eos in reference else reference
    assert [r.token for r in out] == expected
    accepted = sum(r.from_draft for r in out)
    assert 0 < accepted < len(out) - 4, accepted
    assert calls["gdngen"] > 0 and calls["ops"] == ops  # every recurrence on gdngen


def linear_slots(model, cache):
    return [cache[i] for i, layer in enumerate(model.layers) if layer.is_linear]


def fed(model, tokens, splits):
    """A fresh patched cache after ``tokens`` fed in calls of the lengths ``splits``, and the
    logits of the last call."""
    cache = make_prompt_cache(model)
    start = 0
    for n in splits:
        logits = model(tokens[None, start:start + n], cache=cache)
        start += n
    mx.eval(logits, [c.state for c in cache])
    return cache, logits[:, -1]


@pytest.mark.parametrize("replay", [True, False], ids=["replay", "states"])
@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_trim_puts_back_the_state_and_window_of_fewer_tokens(name, replay, monkeypatch):
    """After a prefill of 9, two T=1 calls and a verify window of 5, ``trim(n)`` leaves every
    linear layer's recurrent state and conv window, and the next logits, as feeding the first
    16 - n tokens does (within the window, at its start, and across earlier calls), with the
    window recorded either way (`RewindableCache.replay`)."""
    from gdngen.integrations.mlx_lm import rewind

    model, _ = models(name)
    tokens = token_batch(B=1, T=20, seed=4)[0]
    with integration.patched(inference=True):
        monkeypatch.setattr(rewind._rewindable_cache_class(), "replay", replay)
        whole, _ = fed(model, tokens, [9, 1, 1, 5])
        caches = linear_slots(model, whole)
        assert all(type(c).__name__ == "RewindableCache" for c in caches)
        window = [g for g in caches[0]._segments if g.steps == 5]
        assert len(window) == 1 and (window[0].states is None) == replay
        for n in (1, 4, 5, 6, 7):
            trimmed = copy.deepcopy(whole)
            assert trim_prompt_cache(trimmed, n) == n
            expected, _ = fed(model, tokens, [16 - n])
            for got, want in zip(linear_slots(model, trimmed), linear_slots(model, expected)):
                for slot in (0, 1):
                    np.testing.assert_allclose(np.asarray(got[slot]), np.asarray(want[slot]),
                                               rtol=1e-5, atol=1e-6, err_msg=f"n={n}")
            again = model(tokens[None, 16 - n:17 - n], cache=trimmed)[:, -1]
            next_logits = model(tokens[None, 16 - n:17 - n], cache=expected)[:, -1]
            np.testing.assert_allclose(np.asarray(again), np.asarray(next_logits), rtol=1e-4,
                                       atol=1e-5)


def test_trim_past_what_is_recorded_trims_what_it_can_and_returns_the_count():
    """A prefill longer than max_steps is a barrier: a trim into it takes back the decode
    steps after it and returns their count (mlx-lm's ``trim`` contract), and nothing more."""
    model, _ = models("qwen3_5")
    tokens = token_batch(B=1, T=24, seed=5)[0]
    assert 20 > integration.MAX_REWIND
    with integration.patched(inference=True):
        cache, _ = fed(model, tokens, [20, 1, 1])
        layer = linear_slots(model, cache)[0]
        expected, _ = fed(model, tokens, [20])
        assert layer.trim(3) == 2
        np.testing.assert_allclose(np.asarray(layer[1]),
                                   np.asarray(linear_slots(model, expected)[0][1]),
                                   rtol=1e-5, atol=1e-6)
        state = layer[1]
        assert layer.trim(1) == 0 and layer[1] is state


def test_unpatched_layer_calls_end_the_record():
    """A call that takes mlx-lm's own layer (a patch without the mixer route) advances the
    state outside the record: a trim then takes back nothing instead of putting back a stale
    state."""
    model, _ = models("qwen3_5")
    tokens = token_batch(B=1, T=6, seed=6)[0]
    with integration.patched(inference=True):
        cache, _ = fed(model, tokens, [3, 1])
        integration.patch(inference=True, mixer=False)
        model(tokens[None, 4:5], cache=cache)
        layer = linear_slots(model, cache)[0]
        state = layer[1]
        assert layer.trim(1) == 0 and layer[1] is state


def test_rewindable_caches_save_and_load(tmp_path):
    model, _ = models("qwen3_next")
    tokens = token_batch(B=1, T=6, seed=7)[0]
    with integration.patched(inference=True):
        cache, _ = fed(model, tokens, [6])
        path = str(tmp_path / "cache.safetensors")
        save_prompt_cache(path, cache)
        loaded = load_prompt_cache(path)
    for got, want in zip(linear_slots(model, loaded), linear_slots(model, cache)):
        assert type(got) is type(want)
        np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_batch_generate_gives_the_unpatched_tokens(name, calls, monkeypatch):
    """mlx_lm.batch_generate over prompts of three lengths (left-padded prefill, per-row
    lengths, one row finishing early): patched, the same tokens, every linear-attention call
    through gdngen's mixer (each row's conv window read at its own length)."""
    from mlx_lm.tokenizer_utils import TokenizerWrapper
    from spies import spy_calls

    import gdngen.mlx

    model, _ = models(name)
    prompts = [token_batch(B=1, T=n, seed=n)[0].tolist() for n in (5, 11, 8)]
    tok = TokenizerWrapper(tokenizer())
    reference = batch_generate(model, tok, prompts, max_tokens=[12, 7, 12],
                               return_token_ids=True)
    assert calls["gdngen"] == 0
    mixers = spy_calls(monkeypatch, gdngen.mlx, ["gated_delta_mixer"])
    with integration.patched(inference=True):
        patched = batch_generate(model, tok, prompts, max_tokens=[12, 7, 12],
                                 return_token_ids=True)
    assert patched.token_ids == reference.token_ids
    assert calls["gdngen"] >= 12 * len(linear_attention_layers(model))
    assert len(mixers) == calls["gdngen"]
