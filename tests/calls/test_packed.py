"""Packed sequences (``cu_seqlens``): the offsets' checks, traced offsets under jit, vmap over
rows, the generated backends' packed calls, and MaxText segment ids (`gdngen.algebra.packed`). The
packed battery cases (against the float64 reference, a sequence at a time) run here on every
registered backend, scalar and per-channel gates."""

from __future__ import annotations

import numpy as np
import pytest

from gdngen import registry, validate
from gdngen.algebra import packed, reference
from gdngen.backends import fallback
from gdngen.cases import get_case
from gdngen.problem import Problem

T, HK, HV, DK, DV = 70, 1, 2, 16, 16
OFFSETS = np.array([0, 5, 5, 33, 64, 70], np.int32)
N_SEQ = len(OFFSETS) - 1


def _inputs(seed, T=T, N=N_SEQ, rows=None):
    rng = np.random.default_rng(seed)
    lead = () if rows is None else (rows,)
    k = rng.standard_normal(lead + (1, T, HK, DK))
    return {"q": rng.standard_normal(lead + (1, T, HK, DK)),
            "k": k / np.linalg.norm(k, axis=-1, keepdims=True),
            "v": rng.standard_normal(lead + (1, T, HV, DV)),
            "g": -rng.uniform(0.01, 0.5, lead + (1, T, HV)),
            "beta": rng.uniform(0.2, 1.0, lead + (1, T, HV)),
            "initial_state": rng.standard_normal(lead + (N, HV, DV, DK))}


def _f32(framework, arrays):
    if framework == "jax":
        import jax.numpy as jnp

        return {n: jnp.asarray(x, jnp.float32) for n, x in arrays.items()}
    import mlx.core as mx

    return {n: mx.array(np.asarray(x, np.float32)) for n, x in arrays.items()}


def _int32(framework, x):
    if framework == "jax":
        import jax.numpy as jnp

        return jnp.asarray(x, jnp.int32)
    import mlx.core as mx

    return mx.array(np.asarray(x, np.int32))


def _gated_delta(framework):
    if framework == "jax":
        from gdngen.jax import gated_delta
    else:
        from gdngen.mlx import gated_delta
    return gated_delta


def _rel(x, ref):
    return float(np.linalg.norm(np.asarray(x, np.float64) - ref) / np.linalg.norm(ref))


def _forward_reference(arrays, offsets):
    out = reference.packed_vjp(arrays["q"], arrays["k"], arrays["v"], arrays["g"],
                               arrays["beta"], arrays["initial_state"], None, None, offsets,
                               scale=DK ** -0.5)
    return out["y"], out["final_state"]


PACKED_CASES = {"scalar": "packed_boundaries", "vector": "packed_vector"}
#: per-channel packed rows on JAX compile the shared jnp chunk stages (the portable packed path;
#: the Pallas backends' packed walks between them), ~2-4 min on 2 cores: behind the slow
#: marker; mlx runs the same framework-neutral algebra (`gdngen.algebra.packed`) in `make
#: test`, ffi_cpu its own kernels, and the Pallas packed walks a small row in
#: tests/backends/pallas/test_packed_pallas.py. xla's scalar case too: the portable packed path
#: keeps [mlx-scalar], xla's packed rows test_vmap_over_rows
SLOW_PACKED = {(b, "vector") for b in registry.names() if registry.get(b).framework == "jax"
               and b != "ffi_cpu"} | {("xla", "scalar")}
PACKED_QUANTITIES = {"y", "final_state", "dinitial_state", "dq", "dk", "dv", "dbeta", "dg",
                     "dg_linear"}


def _counting(calls, fn):
    """``fn``, appending each call's keyword arguments to ``calls``."""
    def counted(*args, **kwargs):
        calls.append(kwargs)
        return fn(*args, **kwargs)
    return counted


@pytest.mark.parametrize("backend, gate", [
    pytest.param(b, g, marks=[pytest.mark.slow] if (b, g) in SLOW_PACKED else [])
    for b in registry.names() for g in sorted(PACKED_CASES)])
def test_packed_case_passes(backend, gate, monkeypatch):
    """A packed battery case on every registered backend (outputs poisoned: an element a kernel
    leaves unwritten is NaN), every quantity in both gate conventions; the row runs in the
    backend's own packed kernels for the gate kinds of its ``packed_gates``
    (`gdngen.backend.Backend.packed`), else on the framework's portable packed path."""
    import importlib.util

    from gdngen import settings

    spec = registry.get(backend)
    # xla: the smaller scalar case (its compile is most of the time; mlx runs every packed case)
    case = get_case("packed_long_masked" if (backend, gate) == ("xla", "scalar")
                    else PACKED_CASES[gate])
    if importlib.util.find_spec(spec.framework) is None:
        pytest.skip(f"{spec.framework} is not installed")
    ok, why = spec.capability(Problem(case.Hk, case.Hv, case.Dk, case.Dv, gate=gate))
    if not ok:
        pytest.skip(f"{backend} cannot run here: {why}")
    monkeypatch.setenv(settings.ENV_POISON_OUTPUTS, "1")
    native, portable = [], []
    monkeypatch.setattr(spec, "packed", _counting(native, spec.packed))
    monkeypatch.setattr(fallback, "packed", _counting(portable, fallback.packed))
    result = validate.check_case(backend, case)
    assert result.passed, result.errors
    assert set(result.errors) >= PACKED_QUANTITIES, sorted(result.errors)
    expect_native = spec.native_packed(gate == "vector")
    assert bool(native) == expect_native
    # the portable backends' own packed kernels are the portable packed path
    assert bool(portable) == (spec.portable or not expect_native)


BAD_OFFSETS = [
    (np.array([0, 5, 70], np.int64), "dtype int64, expected int32"),
    (np.array([[0, 70]], np.int32), "expected [N+1] with N >= 1"),
    (np.array([0], np.int32), "expected [N+1] with N >= 1"),
    (np.array([1, 5, 70], np.int32), "must start at 0"),
    (np.array([0, 40, 30, 70], np.int32), "cu_seqlens[1]=40 > cu_seqlens[2]=30"),
    (np.array([0, 5, 69], np.int32), "must end at T=70"),
]


@pytest.mark.parametrize("framework", ["jax", "mlx"])
@pytest.mark.parametrize("offsets,message", BAD_OFFSETS)
def test_bad_offsets_name_cu_seqlens(framework, offsets, message):
    arrays = _f32(framework, _inputs(0))
    arrays["initial_state"] = None
    cu = _int32(framework, offsets) if offsets.dtype == np.int32 else offsets
    if framework == "mlx" and offsets.dtype != np.int32:
        import mlx.core as mx

        cu = mx.array(offsets)  # mlx keeps int64
    with pytest.raises(ValueError, match="cu_seqlens") as info:
        _gated_delta(framework)(**arrays, scale=DK ** -0.5, cu_seqlens=cu)
    assert message in str(info.value)


@pytest.mark.parametrize("framework", ["jax", "mlx"])
def test_packed_call_shape_errors(framework):
    gated_delta = _gated_delta(framework)
    arrays = _f32(framework, _inputs(0))
    cu = _int32(framework, OFFSETS)
    wrong_states = dict(arrays, initial_state=arrays["initial_state"][:3])
    with pytest.raises(ValueError, match=r"initial_state .*\(5, 2, 16, 16\).*N=5"):
        gated_delta(**wrong_states, cu_seqlens=cu)
    two_rows = _f32(framework, {n: np.concatenate([x, x]) for n, x in _inputs(0).items()
                                if n != "initial_state"})
    with pytest.raises(ValueError, match=r"cu_seqlens needs .* \(B == 1\), got B=2"):
        gated_delta(**two_rows, cu_seqlens=cu)
    with pytest.raises(ValueError, match="cu_seqlens must be an int32 array"):
        gated_delta(**arrays, cu_seqlens=[0, 5, 70])


def test_traced_offsets_under_jit():
    """One jitted function, offsets as a traced argument: two different packings both match
    the reference, and the second call does not retrace."""
    import jax
    import jax.numpy as jnp

    from gdngen.jax import gated_delta

    traces = []

    @jax.jit
    def run(arrays, cu):
        traces.append(1)
        return gated_delta(**arrays, scale=DK ** -0.5, cu_seqlens=cu)

    raw = _inputs(1)
    arrays = _f32("jax", raw)
    for offsets in (OFFSETS, np.array([0, 0, 1, 64, 65, 70], np.int32)):
        y, final = run(arrays, jnp.asarray(offsets))
        y_ref, final_ref = _forward_reference(raw, offsets)
        assert _rel(y, y_ref) < 5e-6 and _rel(final, final_ref) < 5e-6
    assert len(traces) == 1


def test_vmap_over_rows():
    """``jax.vmap`` over a leading axis of rows and of their offsets: each row's outputs and
    gradients are its own packed call's (the float64 reference, a row at a time)."""
    import jax
    import jax.numpy as jnp

    from gdngen.jax import gated_delta

    raw = _inputs(2, rows=2)
    arrays = _f32("jax", raw)
    offsets = np.stack([OFFSETS, np.array([0, 20, 20, 21, 50, 70], np.int32)])

    def rows(arrays, cu):
        return jax.vmap(lambda a, c: gated_delta(**a, scale=DK ** -0.5, cu_seqlens=c))(
            arrays, cu)

    def loss(arrays, cu):  # <y, y> + <final, final>: cotangents 2 y and 2 final
        y, final = rows(arrays, cu)
        return (y ** 2).sum() + (final ** 2).sum()

    y, final = rows(arrays, jnp.asarray(offsets))
    grads = jax.grad(loss)(arrays, jnp.asarray(offsets))
    for row in range(2):
        row_raw = {n: x[row] for n, x in raw.items()}
        y_ref, final_ref = _forward_reference(row_raw, offsets[row])
        assert _rel(y[row], y_ref) < 5e-6 and _rel(final[row], final_ref) < 5e-6
        ref = reference.packed_vjp(*(row_raw[n] for n in ("q", "k", "v", "g", "beta",
                                                           "initial_state")),
                                   2 * y_ref, 2 * final_ref, offsets[row], scale=DK ** -0.5)
        for name, of in (("q", "dq"), ("k", "dk"), ("v", "dv"), ("g", "dg"),
                         ("beta", "dbeta"), ("initial_state", "dinitial_state")):
            assert _rel(grads[name][row], ref[of]) < 1e-5, name


@pytest.mark.parametrize("gate", ["scalar", "vector"])
def test_mixed_batch_folds_initial_states_and_runs_short_windows_stepwise(gate, monkeypatch):
    """A server's mixed batch (decode rows of one token, a verify window, prefill rows) on
    MLX's portable packed path (eager: the offsets are concrete): the sequences of at most
    `gdngen.algebra.packed.SHORT_WINDOW` steps run the recurrence over their own steps (y and
    final state, one call for all of them), the initial states of the others fold into the
    row's walk (`gdngen.algebra.packed._fold_initial_states`, the short ones skipped), and
    their per-channel final states run their last windows stepwise where short, else as a
    chunk. Values and every gradient against the float64 reference, a sequence at a time."""
    framework = "mlx"
    pytest.importorskip("mlx.core")
    offsets = np.array([0, 1, 2, 42, 43, 60, 70], np.int32)  # lengths 1, 1, 40, 1, 17, 10
    raw = _inputs(6, N=len(offsets) - 1)
    if gate == "vector":
        raw["g"] = -np.random.default_rng(7).uniform(0.01, 0.5, (1, T, HV, DK))
    windows, chunks, folds = [], [], []
    monkeypatch.setattr(packed, "_short_windows", _counting(windows, packed._short_windows))
    monkeypatch.setattr(packed, "_one_chunk", _counting(chunks, packed._one_chunk))
    monkeypatch.setattr(packed, "_fold_initial_states",
                        _counting(folds, packed._fold_initial_states))
    names = ("q", "k", "v", "g", "beta", "initial_state")
    gated_delta = _gated_delta(framework)
    arrays, cu = _f32(framework, raw), _int32(framework, offsets)
    variant = registry.default_variant("mlx", Problem(HK, HV, DK, DV, gate=gate)).replace(
        chunk_size=32)

    def loss(*xs):
        y, final = gated_delta(*xs, scale=DK ** -0.5, cu_seqlens=cu, variant=variant)
        return (y ** 2).sum() + (final ** 2).sum()

    y, final = gated_delta(*(arrays[n] for n in names), scale=DK ** -0.5, cu_seqlens=cu,
                           variant=variant)
    # the short sequences 0, 1, 3, 5 stepwise, skipped by the fold; per-channel final states
    # of the others: the 40-step sequence's last window (10 steps) stepwise, the 17-step one a
    # chunk
    assert (len(folds), len(windows), len(chunks)) == ((1, 2, 1) if gate == "vector"
                                                       else (1, 1, 0))
    assert list(folds[0]["skip"]) == [0, 1, 3, 5]
    import mlx.core as mx

    grads = mx.grad(loss, argnums=tuple(range(6)))(*(arrays[n] for n in names))
    y_ref, final_ref = _forward_reference(raw, offsets)
    assert _rel(y, y_ref) < 5e-6 and _rel(final, final_ref) < 5e-6
    ref = reference.packed_vjp(*(raw[n] for n in names), 2 * y_ref, 2 * final_ref, offsets,
                               scale=DK ** -0.5)
    for name, got in zip(names, grads):
        assert _rel(got, ref["d" + name]) < 1e-5, name


@pytest.mark.parametrize("framework", ["jax", "mlx"])
def test_empty_sequence_returns_its_initial_state(framework):
    """An empty sequence's final state is its initial state exactly, wherever it sits."""
    raw = _inputs(3)
    offsets = np.array([0, 0, 33, 33, 70, 70], np.int32)
    y, final = _gated_delta(framework)(**_f32(framework, raw), scale=DK ** -0.5,
                                       cu_seqlens=_int32(framework, offsets))
    final = np.asarray(final)
    for n in (0, 2, 4):
        np.testing.assert_array_equal(final[n], raw["initial_state"][n].astype(np.float32))
    y_ref, final_ref = _forward_reference(raw, offsets)
    assert _rel(y, y_ref) < 5e-6 and _rel(final, final_ref) < 5e-6


def test_packed_paths_of_generated_backends():
    """ffi_cpu runs packed rows in its own kernels and matches xla's packed row (the Pallas
    and Metal packed builds: tests/backends/pallas/test_packed_pallas.py,
    tests/backends/metal/test_packed_metal.py), per-channel gates too; `explain` / `describe`
    say which ran."""
    import jax.numpy as jnp

    from gdngen import registry
    from gdngen.entry import load_tuned
    from gdngen.jax import gated_delta
    from gdngen.problem import Problem

    arrays = _f32("jax", _inputs(4))
    cu = jnp.asarray(OFFSETS)
    problem = Problem(HK, HV, DK, DV, "float32", "scalar")
    y_xla, final_xla = gated_delta(
        **arrays, cu_seqlens=cu,
        variant=registry.default_variant("xla", problem).replace(chunk_size=32))
    variant = registry.default_variant("ffi_cpu", problem).replace(chunk_size=32)
    if registry.get("ffi_cpu").available():
        y, final = gated_delta(**arrays, cu_seqlens=cu, variant=variant)
        np.testing.assert_allclose(np.asarray(y), np.asarray(y_xla), rtol=0, atol=2e-6)
        np.testing.assert_allclose(np.asarray(final), np.asarray(final_xla), rtol=0, atol=2e-6)
    for name in ("ffi_cpu", "pallas_tpu", "pallas_gpu", "metal"):
        spec = registry.get(name)
        for vector in (False, True):
            assert f"{name} chunk kernels (their packed build)" in spec.describe_packed(
                variant, vector, 5)
    for name in ("xla", "mlx"):  # the portable backends' packed path is their chunk path
        for vector in (False, True):
            assert f"the {name} chunk kernels at" in registry.get(name).describe_packed(
                variant, vector, 5)
    text = str(load_tuned("jax").explain(**arrays, cu_seqlens=cu))
    assert "packed row of 5 sequences" in text and "chunk_size=" in text


def test_cu_seqlens_from_segment_ids():
    ids = np.array([3, 3, 3, 7, 1, 1, 1, 1, 2])
    np.testing.assert_array_equal(packed.cu_seqlens_from_segment_ids(ids),
                                  np.array([0, 3, 4, 8, 9], np.int32))
    assert packed.cu_seqlens_from_segment_ids(ids).dtype == np.int32
    with pytest.raises(ValueError, match="segment_ids is empty"):
        packed.cu_seqlens_from_segment_ids([])
