"""Dispatch: with no tuned entry a call runs the attached device's generated backend when it
implements the call, else the portable path; the decision is memoised and made again when a
tuned file changes."""

from __future__ import annotations

import json

import numpy as np
import pytest

from gdngen import cache, dispatch, registry
from gdngen.backends import ffi_cpu
from gdngen.problem import Problem
from gdngen.shape import CallShape
from gdngen.variant import Variant

UNTUNED = Problem(4, 8, 128, 128)


@pytest.fixture(autouse=True)
def isolated(tmp_path, monkeypatch):
    """An empty user cache; the shipped files hold nothing for the shapes used here."""
    monkeypatch.setenv("GDNGEN_CACHE_DIR", str(tmp_path / "root"))
    cache.clear_memo()
    dispatch.clear_memo()
    yield
    cache.clear_memo()
    dispatch.clear_memo()


def shape(problem, T=4096, vector=False):
    return CallShape(1, T, problem.Hk, problem.Hv, problem.Dk, problem.Dv, vector)


@pytest.mark.skipif(not ffi_cpu.available(), reason="ffi_cpu needs a C++ compiler")
def test_cpu_default_is_the_generated_kernel_and_explain_says_why():
    choice = dispatch.choose("jax", shape(UNTUNED), "float32", device="cpu")
    assert choice.source == "default"
    assert choice.variant == registry.default_variant("ffi_cpu", UNTUNED)
    assert "default of ffi_cpu, cpu's generated backend" in choice.reason
    assert "no tuned entry" in choice.reason


@pytest.mark.skipif(not ffi_cpu.available(), reason="ffi_cpu needs a C++ compiler")
def test_vector_gates_run_the_generated_chunk_kernels_and_explain_says_so():
    vector = dataclasses_replace(UNTUNED, gate="vector")
    choice = dispatch.choose("jax", shape(vector, vector=True), "float32", device="cpu")
    assert choice.variant.backend == "ffi_cpu"
    assert choice.for_length(4096, vector_gate=True).kernel_path.startswith("chunk kernels")
    path = choice.for_length(16, vector_gate=True).kernel_path
    assert path.startswith("recurrent kernel forward, T=16") and "chunk kernels" in path


def test_portable_path_where_the_generated_kernel_does_not_apply():
    variant, why = dispatch.default_choice("jax", UNTUNED, "cpu", chunk_size=16)
    assert variant.backend == "xla" and variant["chunk_size"] == 16
    assert "chunk_size must be one of" in why
    mlx_choice = dispatch.choose("mlx", shape(UNTUNED), "float32", device="cpu")
    assert mlx_choice.variant == registry.default_variant("mlx", UNTUNED)  # metal: Apple GPUs


@pytest.mark.parametrize("device, backend", [("tpu-v5e", "pallas_tpu"), ("h100", "pallas_gpu"),
                                             ("a100", "pallas_gpu"), ("apple-m3", "metal")])
def test_accelerators_default_to_their_generated_backend(device, backend):
    framework = registry.framework_of(backend)
    variant, why = dispatch.default_choice(framework, UNTUNED, device)
    assert variant == registry.default_variant(backend, UNTUNED, device)
    assert backend in why
    metal_cannot = Problem(1, 2, 48, 48)  # metal needs head dims that are multiples of 32
    if backend == "metal":
        variant, why = dispatch.default_choice("mlx", metal_cannot, device)
        assert variant.backend == "mlx" and "multiple of 32" in why


def test_decision_is_memoised_until_a_tuned_file_changes(monkeypatch):
    calls = []
    lookup = cache.lookup
    monkeypatch.setattr(cache, "lookup", lambda *a, **k: calls.append(a) or lookup(*a, **k))
    small = Problem(1, 2, 16, 16)
    first = dispatch.choose("mlx", shape(small, T=1), "float32", device="cpu")
    for _ in range(50):
        assert dispatch.choose("mlx", shape(small, T=1), "float32", device="cpu") is first
    assert len(calls) == 1
    dispatch.choose("mlx", shape(small, T=300), "float32", device="cpu")  # another T bucket
    assert len(calls) == 2
    tuned = Variant("mlx", {"chunk_size": 16, "solve_block": 4, "save_states": False})
    cache.write_entry(cache.make_entry(
        device="cpu", framework="mlx", problem=small, precision="ieee", seq_len=1, batch=1,
        variant=tuned, default=first.variant, best_s=0.001, default_s=0.002,
        worst_error=1e-7, tolerance=5e-5, trials={"run": 2}, study="s"))
    again = dispatch.choose("mlx", shape(small, T=1), "float32", device="cpu")
    assert len(calls) == 3 and again.source == "tuned" and again.variant == tuned


def test_a_file_written_elsewhere_is_seen_after_the_restat_interval(monkeypatch):
    """A tuned file replaced behind gdngen's back (another process) is seen once `RESTAT_S` has
    passed since the files were last stat'ed; before that the memoised decision stands."""
    clock = [1000.0]
    monkeypatch.setattr(dispatch.time, "monotonic", lambda: clock[0])
    small = Problem(1, 2, 16, 16)
    first = dispatch.choose("mlx", shape(small, T=1), "float32", device="cpu")
    assert first.source == "default"
    tuned = Variant("mlx", {"chunk_size": 16, "solve_block": 4, "save_states": False})
    entry = cache.make_entry(
        device="cpu", framework="mlx", problem=small, precision="ieee", seq_len=1, batch=1,
        variant=tuned, default=first.variant, best_s=0.001, default_s=0.002,
        worst_error=1e-7, tolerance=5e-5, trials={"run": 2}, study="s")
    path = cache.user_tuned_dir() / "cpu.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    cache.atomic_write_text(path, json.dumps({"format": cache.FORMAT, "device": "cpu",
                                              "entries": {entry["key"]: entry}}))
    clock[0] += dispatch.RESTAT_S / 2
    assert dispatch.choose("mlx", shape(small, T=1), "float32", device="cpu") is first
    clock[0] += dispatch.RESTAT_S
    again = dispatch.choose("mlx", shape(small, T=1), "float32", device="cpu")
    assert again.source == "tuned" and again.variant == tuned


def test_old_format_user_file_is_reported_not_misread(tmp_path):
    path = cache.user_tuned_dir() / "cpu.json"
    path.parent.mkdir(parents=True)
    small = Problem(1, 2, 32, 32)
    path.write_text(json.dumps({"format": 1, "device": "cpu", "entries": {}}))
    with pytest.warns(cache.TunedCacheWarning, match="cache format 1"):
        choice = dispatch.choose("mlx", shape(small), "float32", device="cpu")
    assert choice.source == "default"


def test_plain_call_runs_the_default_backend(monkeypatch):
    """A plain gdngen.jax.gated_delta call runs what `choose` says, through the registry."""
    import jax.numpy as jnp

    from gdngen.jax import gated_delta

    x = np.random.default_rng(0).standard_normal((1, 8, 2, 16)).astype(np.float32) * 0.1
    g = -np.abs(x[..., 0])
    vector = CallShape(1, 8, 2, 2, 16, 16, True)
    expected = dispatch.choose("jax", vector, "float32").variant
    ran = []
    spec = registry.get(expected.backend)
    forward = spec.forward
    monkeypatch.setattr(spec, "forward", lambda call, operands, variant, **k: ran.append(
        variant) or forward(call, operands, variant, **k))
    gated_delta(jnp.asarray(x), jnp.asarray(x), jnp.asarray(x), jnp.asarray(g[..., None]
                                                                            * np.ones(16)),
                jnp.asarray(np.abs(g)))
    assert ran and ran[-1] == expected


def dataclasses_replace(obj, **changes):
    import dataclasses

    return dataclasses.replace(obj, **changes)
