"""ffi_cpu per-channel (vector) gate chunk kernels (templates/ffi_cpu/channel.cc.j2, rendered into
gated_delta.cc for ``Problem(gate="vector")``) against the float64 reference.

Every numerics check runs the compiled kernels through the battery (`gdngen.validate`, log and
linear gates: y, final state, the six gradients, dg in both conventions) with the kernels'
outputs NaN-filled before they are written (``GDNGEN_POISON_OUTPUTS=1``), so an element a
kernel leaves unwritten fails the check. ``recurrent_below=0`` makes every call, forward and
VJP, run the chunk kernels (the runner's other-path check, ``y_other_path``, still forces the
recurrent kernel once per case). Worst relative L2 measured over every ``vector_`` case at
chunk 32, 64 and 128: 1.4e-6 (dbeta, vector_identical_keys, chunk 128); dg 4.2e-7 and
dg_linear 3.9e-7 (vector_strong_half, chunk 128).
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp

from gdngen import validate
from gdngen.backends import ffi_cpu
from gdngen.cases import BATTERY, Case
from gdngen.problem import Problem
from gdngen.render import render
from gdngen.variant import Variant

pytestmark = pytest.mark.skipif(not ffi_cpu.available(),
                                reason="the ffi_cpu backend needs a C++ compiler (g++ or $CXX)")

#: every per-channel battery case that runs through the dense kernels
VECTOR_CASES = [c.name for c in BATTERY if c.name.startswith("vector_")]
#: the per-channel packed rows (``cu_seqlens``): the packed build's walk (`render_packed`);
#: packed_vector runs in tests/calls/test_packed.py
PACKED_VECTOR_CASES = [c.name for c in BATTERY if c.vector_gate and c.cu_seqlens is not None]


@pytest.fixture(autouse=True)
def _poisoned_outputs(monkeypatch):
    monkeypatch.setenv(ffi_cpu.ENV_POISON, "1")


def _variant(chunk_size=ffi_cpu.VECTOR_CHUNK_SIZE, recurrent_below=0):
    """A variant at this host's vector width whose calls all take the chunk kernels."""
    width = ffi_cpu.host_vector_floats()
    return Variant("ffi_cpu", {"chunk_size": chunk_size, "row_block": 6,
                               "panel": 64 if width == 16 else 16, "vector_floats": width,
                               "recurrent_below": recurrent_below})


def _check(results, dtype="float32"):
    tol = validate.tolerance(dtype)
    for r in results:
        assert r.passed, f"{r.case}: {r.errors}"
        assert {"y", "final_state", "dq", "dk", "dv", "dbeta", "dg", "dg_linear"} <= set(r.errors)
        assert all(np.isfinite(e) and e <= tol for e in r.errors.values()), (r.case, r.errors)


def _inputs(B=2, T=70, Hk=2, Hv=4, Dk=32, Dv=32, seed=0):
    """Random inputs of vector_exact_zero's head shape (one library for the fast tests)."""
    rng = np.random.default_rng(seed)
    q, k = (jnp.asarray(rng.standard_normal((B, T, Hk, Dk)), jnp.float32) for _ in range(2))
    v = jnp.asarray(rng.standard_normal((B, T, Hv, Dv)), jnp.float32)
    g = jnp.asarray(-rng.uniform(0.0, 1.0, (B, T, Hv, Dk)), jnp.float32)
    beta = jnp.asarray(rng.uniform(0.0, 1.0, (B, T, Hv)), jnp.float32)
    S0 = jnp.asarray(rng.standard_normal((B, Hv, Dv, Dk)), jnp.float32)
    return q, k, v, g, beta, S0


# ----------------------------------------------------------------------------- wiring


def test_vector_gates_render_their_own_chunk_kernels():
    """The gate kind is a render flag of the one chunk template: per-channel gates include
    channel.cc.j2 in place of the scalar decay factors and walks, sharing the rest."""
    scalar = render(_variant(), Problem(1, 2, 24, 40)).sources["gated_delta.cc"]
    vector = render(_variant(), Problem(1, 2, 24, 40, gate="vector")).sources["gated_delta.cc"]
    assert "constexpr int SC = 8;" in vector and "static void anchored_segments" in vector
    assert "static void gate_cotangent" in scalar and "static void gate_cotangent" not in vector
    for shared in ("static void gemm(", "static void solve_unit_lower(", "ffi::Error forward_impl(",
                   "constexpr int DK = 32;", "constexpr int DV = 48;"):
        assert shared in scalar and shared in vector
    packed = ffi_cpu.render_packed(_variant(), Problem(1, 2, 24, 40, gate="vector"))
    scalar_packed = ffi_cpu.render_packed(_variant(), Problem(1, 2, 24, 40))
    for walk in ("static void anchored_products(", "static void ending_products_vjp("):
        assert walk in packed.sources["gated_delta_packed.cc"] and walk not in vector
        assert walk not in scalar_packed.sources["gated_delta_packed.cc"]


@pytest.mark.parametrize("recurrent_below", [0, 1000])
def test_gradient_runs_the_per_channel_chunk_kernels(recurrent_below):
    """The VJP of a per-channel call is the chunk kernels' at every T (no portable scan); the
    forward alone is the chunk kernels' from recurrent_below on, the recurrent kernel below."""
    arrays = _inputs()
    variant = _variant(recurrent_below=recurrent_below)
    kernels = ffi_cpu.load_kernels(variant, Problem(2, 4, 32, 32, gate="vector"))

    def f(*a):
        return ffi_cpu.gated_delta(*a, scale=0.25, variant=variant)

    def loss(*a):
        y, S = f(*a)
        return y.sum() + S.sum()

    grad = str(jax.make_jaxpr(jax.grad(loss, argnums=tuple(range(6))))(*arrays))
    assert kernels.target_forward in grad and kernels.target_backward in grad
    assert "_recurrent" not in grad and "scan" not in grad
    forward = str(jax.make_jaxpr(f)(*arrays))
    assert ("_recurrent" in forward) == (recurrent_below > 70)
    assert (kernels.target_forward in forward) == (recurrent_below <= 70)


def test_kernel_rejects_scalar_gates():
    kernels = ffi_cpu.load_kernels(_variant(), Problem(2, 4, 32, 32, gate="vector"))
    q, k, v, g, beta, S0 = _inputs()
    f32 = jnp.float32
    call = jax.ffi.ffi_call(kernels.target_forward, (
        jax.ShapeDtypeStruct(v.shape, f32), jax.ShapeDtypeStruct(S0.shape, f32),
        jax.ShapeDtypeStruct((2, 4, 3, 32, 32), f32)))
    with pytest.raises(Exception, match="rendered for per-channel gates"):
        jax.block_until_ready(call(q, k, v, g[..., 0], beta, S0, scale=np.float32(1.0),
                                   threads=np.int64(1), splits=np.int64(1), poison=False))


def test_packed_rows_run_the_per_channel_packed_kernels():
    """A per-channel packed row (initial states, cu_seqlens) runs the packed build's walk,
    forward and backward, and nothing of the portable path or the dense kernels."""
    q, k, v, g, beta, _ = _inputs(B=1)
    S0 = jnp.ones((3, 4, 32, 32), jnp.float32)
    cu = jnp.array([0, 5, 40, 70], jnp.int32)
    variant = _variant()
    problem = Problem(2, 4, 32, 32, gate="vector")
    packed, dense = (ffi_cpu.load_packed_kernels(variant, problem),
                     ffi_cpu.load_kernels(variant, problem))

    def loss(*a):
        y, S = ffi_cpu.packed_gated_delta(*a, scale=0.25, variant=variant, cu_seqlens=cu)
        return y.sum() + S.sum()

    grad = str(jax.make_jaxpr(jax.grad(loss, argnums=tuple(range(6))))(q, k, v, g, beta, S0))
    assert packed.target_forward in grad and packed.target_backward in grad
    assert dense.target_forward not in grad and "dot_general" not in grad


def test_packed_calls_trace_again_without_initial_states():
    """Two jit traces of packed rows without initial states (two rows of different lengths,
    the packed walk's cached custom VJP shared): nothing of the first trace leaks into the
    second, and each matches the per-sequence dense calls."""
    variant = _variant()
    q, k, v, g, beta, _ = _inputs(B=1)

    def run(T, cu):
        def loss(*a):
            y, S = ffi_cpu.packed_gated_delta(*a, scale=0.25, variant=variant,
                                              cu_seqlens=jnp.asarray(cu, jnp.int32))
            return (y * y).sum() + S.sum(), (y, S)

        arrays = tuple(x[:, :T] for x in (q, k, v, g, beta))
        (_, (y, S)), _ = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4),
                                                    has_aux=True))(*arrays)
        for n, (s, e) in enumerate(itertools.pairwise(cu)):
            y_n, S_n = ffi_cpu.gated_delta(*(x[:, s:e] for x in arrays), scale=0.25,
                                           variant=variant)
            for got, want in ((y[:, s:e], y_n), (S[n], S_n[0])):
                want = np.asarray(want, np.float64)
                assert np.linalg.norm(np.asarray(got) - want) <= 1e-5 * np.linalg.norm(want)

    run(70, [0, 5, 40, 70])
    run(50, [0, 20, 50])


# ----------------------------------------------------------------------------- numerics


def test_exact_zero_gates_through_the_chunk_kernels():
    """Four chunks of 32 with exact per-channel zeros (single channels and whole steps, both
    sides of t = 64), g = 1 stretches and an initial state, log and linear gates: the
    straddle sums per channel and the exact-zero rule of linear dg."""
    _check([validate.check_case("ffi_cpu", "vector_exact_zero", variant=_variant())])


def test_packed_rows_carry_initial_states_through_chunk_ends():
    """Per-channel packed rows whose sequences span several chunks, with a padding mask: each
    initial state folded into its first chunk and carried on, each final state taken at its
    sequence's last step (`PACKED_VECTOR_CASES`)."""
    _check([validate.check_case("ffi_cpu", "packed_vector_long_masked", variant=_variant())])


@pytest.mark.slow
@pytest.mark.parametrize("chunk_size", ffi_cpu.CHUNK_SIZES)
def test_every_vector_case_at_every_chunk_size(chunk_size):
    _check(validate.run_battery(None, variant=_variant(chunk_size),
                                cases=VECTOR_CASES + PACKED_VECTOR_CASES))


@pytest.mark.slow
def test_padded_head_dims_and_masks():
    """Dk = 24, Dv = 40 (zero-padded to 32, 48 inside the kernels), GVA 3x, exact gates, a
    padding mask, an initial state and a ragged tail (T = 110, chunk 32)."""
    case = Case("vector_padded", "Dk = 24, Dv = 40", B=2, T=110, Hk=1, Hv=3, Dk=24, Dv=40,
                vector_gate=True, gates="channel_zero_and_one", has_initial_state=True,
                padding=True)
    _check([validate.check_case("ffi_cpu", case, variant=_variant())])


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_low_precision_inputs(dtype):
    _check(validate.run_battery(None, variant=_variant(), dtype=dtype,
                                cases=["vector_masked_gva3"]), dtype)


@pytest.mark.slow
def test_value_head_groups_split_over_many_workers(monkeypatch):
    """More workers than key heads: each key head's value heads split over several tasks, the
    partial dq / dk slots summed afterwards."""
    monkeypatch.setattr(ffi_cpu.kernels, "threads", lambda: 8)
    ffi_cpu.vjp.core.cache_clear()
    try:
        _check(validate.run_battery(None, variant=_variant(), cases=["vector_strong_half"]))
    finally:
        ffi_cpu.vjp.core.cache_clear()
