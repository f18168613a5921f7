"""Runtime dispatch: load_tuned and the plain gated_delta pick the tuned variant of the call's
shape class and T bucket, else the default; explain says which and why."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from tuned_cache import isolated_cache

from gdngen import cache, dispatch, registry
from gdngen.problem import Problem
from gdngen.registry import default_variant
from gdngen.variant import Variant

ROOT = Path(__file__).resolve().parents[2]
PROBLEM = Problem(1, 2, 16, 16)
TUNED = {"chunk_size": 16, "solve_block": 8, "save_states": False, "recurrent_below": 16}
#: what the chunk path runs with (the spy of `mlx_calls` sees these)
TUNED_CHUNK = {n: TUNED[n] for n in ("chunk_size", "solve_block", "save_states")}


@pytest.fixture(autouse=True)
def isolated(tmp_path, monkeypatch):
    with isolated_cache(tmp_path, monkeypatch) as root:
        yield root


def plant(backend: str, seq_len: int = 64, precision: str = "ieee", **changes) -> dict:
    framework = registry.framework_of(backend)
    e = cache.make_entry(device="cpu", framework=framework, problem=PROBLEM, precision=precision,
                         seq_len=seq_len, batch=1, variant=Variant(backend, TUNED),
                         default=default_variant(backend, PROBLEM), best_s=0.01, default_s=0.02,
                         worst_error=1e-7, tolerance=5e-5, trials={"run": 4})
    e.update(changes)
    cache.write_entry(e)
    return e


def inputs(T, rng):
    B, Hk, Hv, D = 1, PROBLEM.Hk, PROBLEM.Hv, PROBLEM.Dk
    k = rng.standard_normal((B, T, Hk, D))
    return {"q": rng.standard_normal((B, T, Hk, D)).astype(np.float32),
            "k": (k / np.linalg.norm(k, axis=-1, keepdims=True)).astype(np.float32),
            "v": rng.standard_normal((B, T, Hv, D)).astype(np.float32),
            "g": np.log(rng.uniform(0.8, 1.0, (B, T, Hv))).astype(np.float32),
            "beta": rng.uniform(0, 1, (B, T, Hv)).astype(np.float32)}


@pytest.fixture
def mlx_calls(monkeypatch):
    """Records the params each MLX chunkwise call runs with."""
    from gdngen.backends.portable import mlx_chunkwise as mlx_backend

    calls = []
    original = mlx_backend.chunkwise_gated_delta

    def spy(*args, **kwargs):
        calls.append({k: kwargs[k] for k in ("chunk_size", "solve_block", "save_states")})
        return original(*args, **kwargs)

    monkeypatch.setattr(mlx_backend, "chunkwise_gated_delta", spy)
    return calls


def test_load_tuned_mlx_dispatches_per_bucket_and_explains(mlx_calls):
    import mlx.core as mx

    import gdngen
    from gdngen.mlx import gated_delta

    plant("mlx", seq_len=64)
    tuned = gdngen.load_tuned("mlx")
    rng = np.random.default_rng()
    x = {n: mx.array(a) for n, a in inputs(50, rng).items()}  # T=50 -> bucket 64
    choice = tuned.explain(x["q"], x["k"], x["v"], x["g"], x["beta"])
    assert choice.source == "tuned" and choice.variant == Variant("mlx", TUNED)
    assert "cpu|mlx|hk1-hv2-dk16-dv16-float32-scalar|ieee|T64" in str(choice)
    y, s = tuned(x["q"], x["k"], x["v"], x["g"], x["beta"], scale=0.25)
    assert mlx_calls[-1] == TUNED_CHUNK
    y_ref, s_ref = gated_delta(x["q"], x["k"], x["v"], x["g"], x["beta"], scale=0.25,
                               variant=Variant("mlx", TUNED))
    np.testing.assert_array_equal(np.array(y), np.array(y_ref))
    np.testing.assert_array_equal(np.array(s), np.array(s_ref))

    # bucket 256, not tuned; T = 256 reaches the default's crossover, so the chunk path runs
    long = {n: mx.array(a) for n, a in inputs(256, rng).items()}
    choice = tuned.explain(long["q"], long["k"], long["v"], long["g"], long["beta"])
    assert choice.source == "default" and choice.variant == default_variant("mlx", PROBLEM)
    assert "T bucket 256" in choice.reason and "tuned buckets: [64]" in choice.reason
    tuned(long["q"], long["k"], long["v"], long["g"], long["beta"])
    default = default_variant("mlx", PROBLEM).as_dict()
    assert mlx_calls[-1] == {n: default[n] for n in mlx_calls[-1]}


def test_plain_gated_delta_uses_the_cache_unless_disabled(mlx_calls, monkeypatch):
    import mlx.core as mx

    from gdngen.mlx import gated_delta

    plant("mlx", seq_len=64)
    x = {n: mx.array(a) for n, a in inputs(64, np.random.default_rng()).items()}
    gated_delta(x["q"], x["k"], x["v"], x["g"], x["beta"])
    assert mlx_calls[-1] == TUNED_CHUNK
    # past the default variant's crossover and chunk, so its chunk path runs whole chunks
    T = max(default_variant("mlx", PROBLEM)["recurrent_below"],
            default_variant("mlx", PROBLEM)["chunk_size"])
    long = {n: mx.array(a) for n, a in inputs(T, np.random.default_rng()).items()}
    gated_delta(long["q"], long["k"], long["v"], long["g"], long["beta"], chunk_size=32)
    assert mlx_calls[-1]["chunk_size"] == 32
    assert mlx_calls[-1]["solve_block"] == default_variant("mlx", PROBLEM)["solve_block"]
    monkeypatch.setenv(dispatch.ENV_NO_TUNED, "1")
    gated_delta(long["q"], long["k"], long["v"], long["g"], long["beta"])
    default = default_variant("mlx", PROBLEM).as_dict()
    assert mlx_calls[-1] == {n: default[n] for n in mlx_calls[-1]}


def test_stale_entry_falls_back_to_default_and_says_why():
    import mlx.core as mx

    import gdngen

    plant("mlx", sha256="f" * 64)
    x = {n: mx.array(a) for n, a in inputs(64, np.random.default_rng()).items()}
    with pytest.warns(cache.TunedCacheWarning, match="source changed"):
        choice = gdngen.load_tuned("mlx").explain(x["q"], x["k"], x["v"], x["g"], x["beta"])
    assert choice.source == "default" and "source changed" in choice.reason


def test_load_tuned_jax_runs_the_tuned_variant_under_jit():
    import jax
    import jax.numpy as jnp

    import gdngen
    from gdngen.jax import gated_delta

    plant("xla", seq_len=64)
    tuned = gdngen.load_tuned("jax", precision="ieee")
    x = {n: jnp.asarray(a) for n, a in inputs(40, np.random.default_rng()).items()}
    assert tuned.explain(x["q"], x["k"], x["v"], x["g"], x["beta"]).variant == \
        Variant("xla", TUNED)
    y, s = jax.jit(lambda *a: tuned(*a, scale=0.25))(x["q"], x["k"], x["v"], x["g"], x["beta"])
    y_ref, s_ref = gated_delta(x["q"], x["k"], x["v"], x["g"], x["beta"], scale=0.25,
                               variant=Variant("xla", TUNED))
    np.testing.assert_allclose(np.asarray(y), np.asarray(y_ref), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(s), np.asarray(s_ref), rtol=1e-6, atol=1e-6)


def test_load_tuned_runs_the_entries_of_its_precision_policy(mlx_calls):
    """An entry tuned under "bf16" runs through ``load_tuned(precision="bf16")`` only: the plain
    call and ``load_tuned()`` (precision "ieee") find no entry and run the default variant."""
    import mlx.core as mx

    import gdngen
    from gdngen.mlx import gated_delta

    plant("mlx", seq_len=64, precision="bf16")
    x = {n: mx.array(a) for n, a in inputs(50, np.random.default_rng()).items()}
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"])
    mx.eval(*gdngen.load_tuned("mlx", precision="bf16")(*args))
    assert mlx_calls == [TUNED_CHUNK]
    mx.eval(*gated_delta(*args), *gdngen.load_tuned("mlx")(*args))
    default = default_variant("mlx", PROBLEM)  # below its recurrent_below: no chunk call
    runs_chunks = 50 >= default["recurrent_below"]
    assert mlx_calls[1:] == [{n: default[n] for n in TUNED_CHUNK}] * 2 * runs_chunks


def test_explain_takes_every_option_of_the_call():
    import mlx.core as mx

    import gdngen

    plant("mlx", seq_len=64)
    tuned = gdngen.load_tuned("mlx")
    x = {n: mx.array(a) for n, a in inputs(50, np.random.default_rng()).items()}
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"])
    pool = mx.zeros((4, PROBLEM.Hv, PROBLEM.Dv, PROBLEM.Dk), mx.bfloat16)
    rows = mx.array([2], mx.int32)
    for options in ({"state_indices": rows, "state_dtype": "bfloat16"},
                    {"return_states": "chunks", "checkpoint_every": 16},
                    {"return_states": "steps"}):
        initial = pool if "state_indices" in options else None
        choice = tuned.explain(*args, initial, **options)
        assert choice.source == "tuned" and choice.variant == Variant("mlx", TUNED), options
    # and checks them as the call does
    with pytest.raises(ValueError, match="state_indices has 9, past the pool of 4"):
        tuned.explain(*args, pool, state_indices=mx.array([9], mx.int32),
                      state_dtype="bfloat16")
    with pytest.raises(ValueError, match="checkpoint_every goes with return_states='chunks'"):
        tuned.explain(*args, checkpoint_every=16)
    with pytest.raises(TypeError, match="unexpected keyword argument.*'reverse'"):
        tuned(*args, reverse=True)


def test_load_tuned_rejects_absent_device_and_bad_arguments():
    import gdngen

    with pytest.raises(ValueError, match="not attached.*mlx runs on cpu"):
        gdngen.load_tuned("mlx", device="apple-m3")
    with pytest.raises(ValueError, match="precision must be one of"):
        gdngen.load_tuned("jax", precision="fp8")
    with pytest.raises(ValueError, match="framework must be one of"):
        gdngen.load_tuned("torch")


def test_import_gdngen_exports_load_tuned_without_frameworks():
    code = ("import sys, json, gdngen; print(json.dumps([callable(gdngen.load_tuned), "
            "sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'mlx', 'optuna'))]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=ROOT).stdout
    assert json.loads(out) == [True, []]
