"""ffi_cpu backend: generated C++ kernels compiled on this host and called as XLA FFI custom calls.

Every numerics check runs the real compiled kernels against the float64 reference, with the
kernels' outputs NaN-filled before they are written (``GDNGEN_POISON_OUTPUTS=1``), so an element
a kernel leaves unwritten fails the check.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp

from gdngen import settings, validate
from gdngen.backends import ffi_cpu
from gdngen.cases import Case
from gdngen.problem import Problem
from gdngen.registry import default_variant, variants
from gdngen.render import render
from gdngen.variant import Variant

pytestmark = pytest.mark.skipif(not ffi_cpu.available(),
                                reason="the ffi_cpu backend needs a C++ compiler (g++ or $CXX)")


@pytest.fixture(autouse=True)
def _poisoned_outputs(monkeypatch):
    monkeypatch.setenv(ffi_cpu.ENV_POISON, "1")


def _variant(chunk_size=64, row_block=6):
    """A variant at this host's vector width (`ffi_cpu.host_vector_floats`) and its panel."""
    width = ffi_cpu.host_vector_floats()
    return Variant("ffi_cpu", {"chunk_size": chunk_size, "row_block": row_block,
                               "panel": 64 if width == 16 else 16, "vector_floats": width,
                               "recurrent_below": ffi_cpu.RECURRENT_BELOW})


def _check(results, dtype="float32"):
    tol = validate.tolerance(dtype)
    for r in results:
        assert r.passed, f"{r.case}: {r.errors}"
        assert all(np.isfinite(e) and e <= tol for e in r.errors.values()), (r.case, r.errors)


# ----------------------------------------------------------------------------- variant space


def test_variant_space_and_default():
    problem = Problem(4, 8, 128, 128)
    space = variants("ffi_cpu", problem)
    width = ffi_cpu.host_vector_floats()
    assert len({v.name() for v in space}) == len(space) == \
        len(ffi_cpu.CHUNK_SIZES) * len(ffi_cpu.ROW_BLOCKS) * len(ffi_cpu.PANELS)
    assert {v["vector_floats"] for v in space} == {width}
    assert default_variant("ffi_cpu", problem) == _variant(64, 6)
    # per-channel gates: chunk kernels of every chunk size, default chunk 32, tuned too
    vector = Problem(4, 8, 128, 128, gate="vector")
    assert {v["chunk_size"] for v in variants("ffi_cpu", vector)} == set(ffi_cpu.CHUNK_SIZES)
    assert default_variant("ffi_cpu", vector)["chunk_size"] == ffi_cpu.VECTOR_CHUNK_SIZE == 32
    assert default_variant("ffi_cpu", vector)["recurrent_below"] == ffi_cpu.VECTOR_RECURRENT_BELOW
    assert default_variant("ffi_cpu", vector) in variants("ffi_cpu", vector)
    assert ffi_cpu.SPEC.tuned_gates == ("scalar", "vector")


@pytest.mark.parametrize("changes, match", [
    ({"chunk_size": 48}, "chunk_size must be one of"),
    ({"row_block": 5}, "row_block must be one of"),
    ({"panel": 8}, "panel must be one of"),
    ({"panel": 16, "vector_floats": 16, "chunk_size": 64}, None),
    ({"panel": 48}, "panel must be one of"),
    ({"vector_floats": 4}, "vector_floats must be one of"),
    ({"threads": 2}, "params must be"),
])
def test_kernel_params_reject_bad_variants(changes, match):
    params = dict(_variant().as_dict(), **changes)
    if match is None:  # a valid combination
        assert ffi_cpu.kernel_params(Variant("ffi_cpu", params), Problem(1, 2, 16, 16))
        return
    with pytest.raises(ValueError, match=match):
        ffi_cpu.kernel_params(Variant("ffi_cpu", params), Problem(1, 2, 16, 16))


def test_host_vector_width_is_read_from_the_cpu():
    assert ffi_cpu.host_vector_bits() in (128, 256, 512)
    assert ffi_cpu.host_vector_floats() == (16 if ffi_cpu.host_vector_bits() == 512 else 8)


def test_render_bakes_the_specialisation_in():
    source = render(_variant(32, 4), Problem(1, 3, 24, 40)).sources["gated_delta.cc"]
    width = ffi_cpu.host_vector_floats()
    for line in ("constexpr int C = 32;", "constexpr int DK = 32;", "constexpr int DV = 48;",
                 "constexpr int MR = 4;", f"constexpr int VW = {width};"):
        assert line in source
    space = variants("ffi_cpu", Problem(2, 4, 128, 128))
    assert len({render(v, Problem(2, 4, 128, 128)).sha256 for v in space}) == len(space)


# ----------------------------------------------------------------------------- numerics


@pytest.mark.parametrize("chunk_size, row_block", [(32, 4), (128, 6), (64, 4)])
def test_other_variants_pass_the_hard_cases(chunk_size, row_block):
    results = validate.run_battery(
        None, variant=_variant(chunk_size, row_block),
        cases=["identical_keys", "gates_exact_one_and_zero", "strong_decay", "ragged", "gva3"])
    _check(results)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_low_precision_inputs(dtype):
    results = validate.run_battery(None, variant=_variant(), dtype=dtype,
                                   cases=["gates_exact_one_and_zero", "padding_mask"])
    _check(results, dtype)


def test_padded_head_dims():
    """Head dims that are not multiples of 16 (zero-padded to 32 and 48 inside the kernels),
    hard gates, beta in [0, 2], an initial state and a ragged tail."""
    case = Case("padded", "Dk = 24, Dv = 40", B=2, T=45, Hk=1, Hv=3, Dk=24, Dv=40,
                chunk_size=32, gates="hard", beta_range=(0.0, 2.0), has_initial_state=True)
    _check([validate.check_case("ffi_cpu", case, variant=_variant(32, 6))])


def test_key_head_groups_split_over_many_workers(monkeypatch):
    """With more workers than key heads the backward splits each group of value heads over
    several tasks (partial dq / dk slots summed afterwards)."""
    assert ffi_cpu.head_splits(1, 4, 2, 2) == 1
    assert ffi_cpu.head_splits(1, 2, 3, 8) == 3
    assert ffi_cpu.head_splits(1, 1, 4, 2) == 2
    assert ffi_cpu.head_splits(2, 1, 6, 3) == 2
    monkeypatch.setattr(ffi_cpu.kernels, "threads", lambda: 8)
    ffi_cpu.vjp.core.cache_clear()
    try:
        _check(validate.run_battery(None, variant=_variant(32, 6), cases=["gva3", "ragged"]))
    finally:
        ffi_cpu.vjp.core.cache_clear()


def test_kernel_rejects_shapes_it_was_not_rendered_for():
    kernels = ffi_cpu.load_kernels(_variant(32, 6), Problem(1, 2, 16, 16))
    f32 = jnp.float32
    q = jnp.ones((1, 8, 1, 32), f32)
    v = jnp.ones((1, 8, 2, 16), f32)
    gates = jnp.zeros((1, 8, 2), f32)
    s0 = jnp.zeros((1, 2, 16, 32), f32)
    call = jax.ffi.ffi_call(kernels.target_forward, (
        jax.ShapeDtypeStruct((1, 8, 2, 16), f32), jax.ShapeDtypeStruct((1, 2, 16, 32), f32),
        jax.ShapeDtypeStruct((1, 2, 1, 32, 16), f32)))
    with pytest.raises(Exception, match="rendered for Dk=16, Dv=16 called with Dk=32"):
        jax.block_until_ready(call(q, q, v, gates, gates, s0, scale=np.float32(1.0),
                                   threads=np.int64(1), splits=np.int64(1), poison=False))
    q16 = jnp.ones((1, 8, 1, 16), f32)
    call = jax.ffi.ffi_call(kernels.target_forward, (
        jax.ShapeDtypeStruct((1, 8, 2, 16), f32), jax.ShapeDtypeStruct((1, 2, 16, 16), f32),
        jax.ShapeDtypeStruct((1, 2, 1, 16, 16), f32)))
    with pytest.raises(Exception, match="splits must divide Hv / Hk = 2, got 3"):
        jax.block_until_ready(call(q16, q16, v, gates, gates, s0[..., :16],
                                   scale=np.float32(1.0), threads=np.int64(1),
                                   splits=np.int64(3), poison=False))


# ----------------------------------------------------------------------------- build + cache


def test_compiled_library_is_cached_per_source_and_written_atomically(tmp_path, monkeypatch):
    monkeypatch.setenv("GDNGEN_CACHE_DIR", str(tmp_path))
    rendered = render(_variant(32, 4), Problem(1, 1, 16, 16))
    path = ffi_cpu.library_path(rendered.sha256)
    assert path.parent == tmp_path / "ffi_cpu" and not path.exists()
    ffi_cpu.compile_library(rendered.sources["gated_delta.cc"], path)
    assert path.stat().st_size > 0
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary left behind
    other = render(_variant(64, 4), Problem(1, 1, 16, 16))
    assert ffi_cpu.library_path(other.sha256) != path


def test_compile_failure_names_the_compiler_output(tmp_path):
    target = tmp_path / "broken.so"
    with pytest.raises(RuntimeError, match="compiling the rendered kernel failed") as info:
        ffi_cpu.compile_library("int main( {", target)
    assert "error" in str(info.value)
    assert not target.exists()


def test_missing_compiler_makes_the_backend_unavailable(monkeypatch):
    from gdngen.registry import runnable as runnable_backends

    problem = Problem(1, 2, 16, 16)
    assert "ffi_cpu" in runnable_backends("jax", problem)
    monkeypatch.setenv(settings.ENV_COMPILER, os.path.join(os.sep, "nonexistent", "g++"))
    ffi_cpu.available.cache_clear()
    try:
        with pytest.raises(RuntimeError, match=r"needs a C\+\+ compiler"):
            ffi_cpu.compiler()
        assert not ffi_cpu.available()
        assert "ffi_cpu" not in runnable_backends("jax", problem)
    finally:
        monkeypatch.undo()
        ffi_cpu.available.cache_clear()
