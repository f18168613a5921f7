"""The recurrent/chunkwise crossover: the tuner measures it and caches it as the variant's
``recurrent_below``; calls shorter than every tuned bucket use the smallest bucket's entry; and
``explain`` says which kernels a call runs and why."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from tuned_cache import isolated_cache

from gdngen import cache, registry, tune
from gdngen.problem import Problem
from gdngen.tune import crossover
from gdngen.variant import Variant

PROBLEM = Problem(1, 2, 16, 16)


def row(T, recurrent_ms, chunkwise_ms):
    return {"T": T, "recurrent_s": recurrent_ms / 1e3, "chunkwise_s": chunkwise_ms / 1e3}


def test_crossover_is_the_t_after_the_last_recurrent_win():
    curve = [row(1, 1, 9), row(4, 2, 9), row(16, 8, 9), row(64, 30, 10), row(256, 90, 20)]
    assert crossover.crossover_from(curve) == 64
    # a noisy win past a loss moves the switch past it: no longer T favours the recurrent path
    noisy = [row(1, 1, 9), row(4, 10, 9), row(16, 8, 9), row(64, 30, 10)]
    assert crossover.crossover_from(noisy) == 64
    assert crossover.crossover_from([row(1, 5, 1), row(4, 9, 2)]) == 1  # never recurrent
    assert crossover.crossover_from([row(1, 1, 5), row(8, 2, 9)]) == 16  # recurrent throughout
    with pytest.raises(ValueError, match="curve"):
        crossover.crossover_from([])


@pytest.fixture
def isolated(tmp_path, monkeypatch):
    with isolated_cache(tmp_path, monkeypatch) as root:
        yield root


def test_tuned_entry_records_the_measured_crossover(isolated):
    target = tune.Target("cpu", "mlx", "mlx", PROBLEM, "ieee", 64, 1)
    settings = tune.Settings(trials=1, cases=("short",), repeats=1, confirm_repeats=0)
    summary = tune.tune(target, settings, storage=str(isolated / "crossover.journal"))
    [entry] = json.loads(Path(summary.entry_path).read_text())["entries"].values()
    curve = entry["crossover"]["curve"]
    assert [r["T"] for r in curve] == list(crossover.SEQ_LENS)
    assert all(r["recurrent_s"] > 0 and r["chunkwise_s"] > 0 for r in curve)
    tuned = Variant.from_json(entry["variant"])
    assert tuned["recurrent_below"] == crossover.crossover_from(curve) == summary.crossover
    assert summary.best == tuned
    # the sources hash does not see recurrent_below: the entry is active
    assert cache.stale_reason(entry) is None
    assert "recurrent below T=" in crossover.describe(entry)


def test_short_calls_use_the_smallest_tuned_bucket_and_explain_the_path(isolated):
    import mlx.core as mx

    import gdngen

    tuned = Variant("mlx", {"chunk_size": 16, "solve_block": 8, "save_states": False,
                            "recurrent_below": 8})
    entry = cache.make_entry(
        device="cpu", framework="mlx", problem=PROBLEM, precision="ieee", seq_len=64, batch=1,
        variant=tuned, default=registry.default_variant("mlx", PROBLEM), best_s=0.01,
        default_s=0.02, worst_error=1e-7, tolerance=5e-5, trials={"run": 1},
        crossover={"curve": [row(4, 1, 2), row(8, 3, 2)], "seq_lens": [4, 8], "batch": 1})
    cache.write_entry(entry)
    found = cache.lookup("cpu", ("mlx",), PROBLEM, "ieee", 4)
    assert found.entry["key"] == entry["key"] and "below every tuned bucket" in found.reason
    assert cache.lookup("cpu", ("mlx",), PROBLEM, "ieee", 100).entry is None  # above: not

    rng = np.random.default_rng(0)
    fn = gdngen.load_tuned("mlx")

    def call(T):
        x = {n: mx.array(rng.standard_normal(s).astype(np.float32) * 0.3) for n, s in
             (("q", (1, T, 1, 16)), ("k", (1, T, 1, 16)), ("v", (1, T, 2, 16)))}
        g = mx.array(-rng.uniform(0, 0.2, (1, T, 2)).astype(np.float32))
        beta = mx.array(rng.uniform(0, 1, (1, T, 2)).astype(np.float32))
        return fn.explain(x["q"], x["k"], x["v"], g, beta)

    short, longer = call(4), call(12)
    assert short.source == "tuned" and short.variant == tuned
    assert "recurrent kernel forward, T=4 < recurrent_below=8 (tuned crossover)" in str(short)
    assert "chunk kernels, T=12 >= recurrent_below=8 (tuned crossover)" in str(longer)
