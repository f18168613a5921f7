"""The pallas_tpu recurrent kernel (``templates/pallas_tpu/recurrent.py.j2``): the kernel function
against the float64 reference (scalar and per-channel gates, T = 1 and an odd T, GVA, Dk != Dv,
exact resets, an initial state), its wiring into the entry point (short calls evaluate through it;
their VJP is the chunk path's: the chunk kernels, or for per-channel gates
gdngen.algebra.chunkwise_channel with the kernel chunk walks), and its place in the rendered
sources.

Off a TPU everything runs in TPU interpret mode, whose buffers (the outputs included) start
NaN-filled, so an output element the kernel leaves unwritten fails the comparisons; the tests also
set ``GDNGEN_POISON_OUTPUTS=1``, the project's poisoned-outputs switch.
"""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")

from channel_walks import spy_chunk_walks

from gdngen import Problem, Variant, default_variant, render, settings
from gdngen.algebra import reference
from gdngen.backends.pallas import tpu as pallas_tpu
from gdngen.validate import relative_error

TOL = 5e-5


@pytest.fixture(autouse=True)
def _poisoned(monkeypatch):
    monkeypatch.setenv(settings.ENV_POISON_OUTPUTS, "1")
    params = pallas_tpu.interpret_mode()
    assert params is False or params.uninitialized_memory == "nan"


def _inputs(rng, B, T, Hk, Hv, Dk, Dv, per_channel):
    q = rng.standard_normal((B, T, Hk, Dk)).astype(np.float32)
    k = rng.standard_normal((B, T, Hk, Dk)).astype(np.float32)
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    v = rng.standard_normal((B, T, Hv, Dv)).astype(np.float32)
    decay = rng.uniform(0.6, 1.0, (B, T, Hv) + ((Dk,) if per_channel else ())).astype(np.float32)
    beta = rng.uniform(0.0, 1.0, (B, T, Hv)).astype(np.float32)
    s0 = rng.standard_normal((B, Hv, Dv, Dk)).astype(np.float32)
    return q, k, v, decay, beta, s0


def _variant(problem, **changes):
    return Variant("pallas_tpu", dict(default_variant("pallas_tpu", problem).as_dict(), **changes))


def _run_kernel(B, T, Hk, Hv, Dk, Dv, per_channel, seed, reset_at=(), **changes):
    rng = np.random.default_rng(seed)
    q, k, v, decay, beta, s0 = _inputs(rng, B, T, Hk, Hv, Dk, Dv, per_channel)
    for b, t, h in reset_at:  # decay exactly 0: the state before step t is forgotten
        decay[b, t, h] = 0.0
    problem = Problem(Hk, Hv, Dk, Dv, "float32", "vector" if per_channel else "scalar")
    scale = Dk ** -0.5
    y, state = pallas_tpu.recurrent_forward(q, k, v, decay, beta, s0, scale=scale,
                                            variant=_variant(problem, **changes),
                                            problem=problem)
    ref_y, ref_state = reference.forward(q, k, v, decay, beta, s0, scale=scale, gate="linear")
    errors = relative_error(y, ref_y), relative_error(state, ref_state)
    assert y.shape == ref_y.shape and state.shape == ref_state.shape
    assert max(errors) <= TOL, errors
    return errors


@pytest.mark.parametrize("per_channel", [False, True], ids=["scalar", "per_channel"])
def test_kernel_odd_length_gva_with_resets(per_channel):
    """T = 37, GVA 3x (Hk=2, Hv=6), Dk=32 != Dv=48, zero decays, an initial state."""
    _run_kernel(1, 37, 2, 6, 32, 48, per_channel, seed=1,
                reset_at=((0, 0, 1), (0, 11, 4), (0, 36, 5)))


@pytest.mark.parametrize("per_channel", [False, True], ids=["scalar", "per_channel"])
def test_kernel_single_step(per_channel):
    """Decode: T = 1, B = 2, GVA 3x with one key head, Dk=64 != Dv=16, a reset in one head."""
    _run_kernel(2, 1, 1, 3, 64, 16, per_channel, seed=2, reset_at=((1, 0, 2),))


def test_kernel_zero_decay_channels():
    """Per-channel decay 0 on some key channels only: those columns of the state reset."""
    rng = np.random.default_rng(3)
    q, k, v, decay, beta, s0 = _inputs(rng, 1, 9, 1, 2, 16, 24, True)
    decay[0, 4, :, ::3] = 0.0
    problem = Problem(1, 2, 16, 24, "float32", "vector")
    y, state = pallas_tpu.recurrent_forward(q, k, v, decay, beta, s0, scale=0.25,
                                            variant=_variant(problem))
    ref_y, ref_state = reference.forward(q, k, v, decay, beta, s0, scale=0.25, gate="linear")
    assert max(relative_error(y, ref_y), relative_error(state, ref_state)) <= TOL


def test_kernel_rejects_mismatched_gate_kind():
    rng = np.random.default_rng(4)
    q, k, v, decay, beta, s0 = _inputs(rng, 1, 2, 1, 1, 16, 16, True)
    problem = Problem(1, 1, 16, 16)
    with pytest.raises(ValueError, match="scalar gates"):
        pallas_tpu.recurrent_forward(q, k, v, decay, beta, s0, scale=1.0,
                                     variant=_variant(problem), problem=problem)


@pytest.mark.slow
@pytest.mark.parametrize("per_channel", [False, True], ids=["scalar", "per_channel"])
def test_kernel_time_blocks_and_dv_tiles(per_channel):
    """T = 2 * TIME_BLOCK + 3 (three time blocks, the last padded) and Dv = 256 in two tiles."""
    T = 2 * pallas_tpu.RECURRENT_TIME_BLOCK + 3
    _run_kernel(1, T, 1, 2, 64, 256, per_channel, seed=5, reset_at=((0, 130, 1),), dv_tile=128)


# ----------------------------------------------------------------------------- entry point


def _entry_inputs(seed, B, T, Hk, Hv, Dk, Dv, per_channel):
    rng = np.random.default_rng(seed)
    q, k, v, decay, beta, s0 = _inputs(rng, B, T, Hk, Hv, Dk, Dv, per_channel)
    g = np.log(decay)
    g[0, 2] = -np.inf  # an exact reset through the log gate
    mask = np.ones((B, T), bool)
    mask[0, 5:8] = False
    mask[-1, -1] = False
    dy = rng.standard_normal((B, T, Hv, Dv)).astype(np.float32)
    ds = rng.standard_normal((B, Hv, Dv, Dk)).astype(np.float32)
    return (q, k, v, g, beta, s0), mask, dy, ds


def _entry_vjp(args, mask, dy, ds, variant, scale):
    from gdngen.jax import gated_delta

    def f(*xs):
        return gated_delta(*xs, mask=jnp.asarray(mask), scale=scale, variant=variant)

    out, vjp = jax.vjp(f, *(jnp.asarray(x) for x in args))
    return out, vjp((jnp.asarray(dy), jnp.asarray(ds)))


def _spy_recurrent(monkeypatch):
    calls = []
    cls = type(pallas_tpu.SPEC)
    original = cls.recurrent_forward

    def spy(self, *args, **kwargs):
        calls.append(args[3].ndim)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(cls, "recurrent_forward", spy)
    return calls


def test_entry_short_masked_call_runs_the_recurrent_kernel(monkeypatch):
    """recurrent_below=1000: the evaluated forward is the recurrent kernel's and equals the
    reference (gradients of such calls on every backend: tests/calls/test_recurrent.py)."""
    from gdngen.jax import gated_delta

    problem = Problem(1, 3, 32, 16)
    args, mask, dy, ds = _entry_inputs(6, 2, 13, 1, 3, 32, 16, False)
    scale = 32 ** -0.5
    short = _variant(problem, recurrent_below=1000)
    calls = _spy_recurrent(monkeypatch)
    y, state = gated_delta(*(jnp.asarray(x) for x in args), mask=jnp.asarray(mask), scale=scale,
                           variant=short)
    assert calls == [3]
    ref = reference.vjp(*args, dy, ds, mask=mask, scale=scale)
    assert relative_error(y, ref["y"]) <= TOL
    assert relative_error(state, ref["final_state"]) <= TOL
    assert not np.asarray(y)[~mask].any()  # masked steps give exact zeros


def _per_channel_entry_call():
    """A per-channel call of two chunks at chunk 32: (variant, inputs, mask, dy, dS, reference)."""
    problem = Problem(1, 3, 16, 24, gate="vector")
    args, mask, dy, ds = _entry_inputs(7, 1, 40, 1, 3, 16, 24, True)
    ref = reference.vjp(*args, dy, ds, mask=mask, scale=0.25)
    return _variant(problem, recurrent_below=1000, chunk_size=32), args, mask, dy, ds, ref


def test_entry_per_channel_gates_take_the_recurrent_kernel(monkeypatch):
    """A short per-channel gate call (T < recurrent_below) evaluates through the recurrent
    kernel; its VJP is the per-channel chunk core's over two chunks (the intra-chunk kernel,
    the kernel walks, the grads kernel), checked against the reference."""
    from gdngen.jax import gated_delta

    variant, args, mask, dy, ds, ref = _per_channel_entry_call()
    calls = _spy_recurrent(monkeypatch)
    walks = spy_chunk_walks(monkeypatch, pallas_tpu)
    y, state = gated_delta(*(jnp.asarray(x) for x in args), mask=jnp.asarray(mask), scale=0.25,
                           variant=variant)
    assert calls == [4] and walks == []
    assert relative_error(y, ref["y"]) <= TOL
    assert relative_error(state, ref["final_state"]) <= TOL
    _, grads = _entry_vjp(args, mask, dy, ds, variant, 0.25)
    assert walks.count("backward") == 1 and "forward" in walks and "intra" in walks
    for name, grad in zip(("dq", "dk", "dv", "dg", "dbeta", "dinitial_state"), grads):
        assert relative_error(grad, ref[name]) <= TOL, name


def test_entry_long_per_channel_call_evaluates_on_the_chunk_path(monkeypatch):
    """recurrent_below = 0: the same call evaluates through the per-channel chunk core (the
    intra-chunk kernel, then the kernel walk), not the recurrent kernel."""
    from gdngen.jax import gated_delta

    variant, args, mask, _, _, ref = _per_channel_entry_call()
    calls = _spy_recurrent(monkeypatch)
    walks = spy_chunk_walks(monkeypatch, pallas_tpu)
    y, state = gated_delta(*(jnp.asarray(x) for x in args), mask=jnp.asarray(mask), scale=0.25,
                           variant=variant.replace(recurrent_below=0))
    assert calls == [] and walks == ["intra", "forward"]
    assert relative_error(y, ref["y"]) <= TOL
    assert relative_error(state, ref["final_state"]) <= TOL


# ----------------------------------------------------------------------------- sources


def test_recurrent_source_is_rendered_and_ignores_recurrent_below():
    scalar, vector = Problem(2, 4, 128, 128), Problem(2, 4, 128, 128, gate="vector")
    base = _variant(scalar)
    rendered = render(base, scalar)
    assert set(rendered.sources) == {"forward.py", "backward.py", "recurrent.py"}
    source = rendered.sources["recurrent.py"]
    compile(source, "recurrent.py", "exec")
    assert "PER_CHANNEL = False" in source and "DV_TILE = 128" in source
    assert "TIME_BLOCK = 128" in source
    assert render(_variant(scalar, recurrent_below=0), scalar).sha256 == rendered.sha256
    assert render(_variant(scalar, recurrent_below=7), scalar).sha256 == rendered.sha256
    per_channel = render(_variant(vector), vector)
    assert set(per_channel.sources) == {"forward.py", "backward.py", "recurrent.py"}
    assert "PER_CHANNEL = True" in per_channel.sources["recurrent.py"]
    assert "per-channel gates" in per_channel.sources["forward.py"]


def test_recurrent_kernel_lowers_for_mosaic():
    for problem in (Problem(2, 6, 32, 48), Problem(1, 2, 128, 256, gate="vector")):
        lowered = pallas_tpu.lower_check(_variant(problem, dv_tile=128), problem)
        assert {"recurrent", "recurrent_blocks"} <= set(lowered)


def test_two_simulated_tensorcores_are_race_free():
    """The parallel grid axes (batch, value head, Dv tile) split over two simulated cores, as
    on megacore chips: outputs stay right and the race detector (read after the concrete call)
    stays quiet."""
    from jax.experimental.pallas import tpu as pltpu

    params = pltpu.InterpretParams(detect_races=True, num_cores_or_threads=2)
    with pallas_tpu.interpreting(params):
        _run_kernel(2, 6, 1, 2, 16, 16, False, seed=8, reset_at=((1, 3, 0),))


@pytest.mark.tpu
@pytest.mark.skipif(jax.default_backend() != "tpu", reason="needs a TPU: compiles with Mosaic")
@pytest.mark.parametrize("T", [1, 37, 2 * pallas_tpu.RECURRENT_TIME_BLOCK + 3])
@pytest.mark.parametrize("per_channel", [False, True], ids=["scalar", "per_channel"])
def test_kernel_on_tpu(T, per_channel):
    _run_kernel(2, T, 2, 6, 128, 256, per_channel, seed=9, reset_at=((0, 0, 1),), dv_tile=128)


def test_entry_under_jit_and_kernel_under_vmap():
    """A forward-only call inside jax.jit takes the recurrent kernel (traced: the nested jit);
    jax.vmap of the kernel function runs it once per mapped element."""
    from gdngen.jax import gated_delta

    problem = Problem(1, 2, 16, 16)
    args, mask, _, _ = _entry_inputs(10, 1, 5, 1, 2, 16, 16, False)
    variant = _variant(problem, recurrent_below=1000)
    y, state = jax.jit(lambda *xs: gated_delta(*xs, mask=jnp.asarray(mask), scale=0.25,
                                               variant=variant))(*(jnp.asarray(x) for x in args))
    ref_y, ref_state = reference.forward(*args, mask=mask, scale=0.25)
    assert max(relative_error(y, ref_y), relative_error(state, ref_state)) <= TOL

    rng = np.random.default_rng(11)
    stacked = [np.stack(xs) for xs in zip(*(_inputs(rng, 1, 3, 1, 2, 16, 16, False)
                                            for _ in range(2)))]
    ys, states = jax.vmap(lambda *xs: pallas_tpu.recurrent_forward(
        *xs, scale=0.5, variant=variant, problem=problem))(*(jnp.asarray(x) for x in stacked))
    for i in range(2):
        ref_y, ref_state = reference.forward(*(x[i] for x in stacked), scale=0.5, gate="linear")
        assert max(relative_error(ys[i], ref_y), relative_error(states[i], ref_state)) <= TOL
