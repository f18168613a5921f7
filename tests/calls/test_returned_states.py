"""Per-step states (``return_states="steps"``, `gdngen.algebra.step_states`): a verify window
on every registered backend, scalar and per-channel gates, against the float64 recurrence step
by step; masked steps; the layer inputs; gradients through the steps; the argument errors."""

from __future__ import annotations

import numpy as np
import pytest
from framework_arrays import dtype, entry
from slow import marked

from gdngen import registry, settings
from gdngen.algebra import reference
from gdngen.problem import Problem
from gdngen.validate import relative_error

B, T, HK, HV, DK, DV = 2, 6, 1, 3, 32, 32
TOL = 5e-5
pytestmark = pytest.mark.usefixtures("unoptimized_xla")  # compile-bound: conftest


def _inputs(seed, vector=False, T=T, decay=(0.02, 0.6), reset=(0, 2), masked=((1, 3), (0, 0))):
    """Inputs of B rows of T steps: log g ~ -U(decay), an exact reset (log g = -inf) at
    ``reset`` (row, step), masked (row, step or slice) ``masked``."""
    rng = np.random.default_rng(seed)
    k = rng.standard_normal((B, T, HK, DK))
    g = -rng.uniform(*decay, (B, T, HV, DK) if vector else (B, T, HV))
    g[reset] = -np.inf
    mask = np.ones((B, T), bool)
    for where in masked:
        mask[where] = False
    return {"q": rng.standard_normal((B, T, HK, DK)).astype(np.float32),
            "k": (k / np.linalg.norm(k, axis=-1, keepdims=True)).astype(np.float32),
            "v": rng.standard_normal((B, T, HV, DV)).astype(np.float32),
            "g": g.astype(np.float32),
            "beta": rng.uniform(0.1, 1.0, (B, T, HV)).astype(np.float32),
            "initial_state": rng.standard_normal((B, HV, DV, DK)).astype(np.float32),
            "mask": mask}


def _reference_steps(x, scale):
    """float64 y and the state after each step t (the final state of the first t+1 steps)."""
    names = ("q", "k", "v", "g", "beta")
    y, _ = reference.forward(*(x[n] for n in names), x["initial_state"], mask=x["mask"],
                             scale=scale)
    states = [reference.forward(*(x[n][:, :t + 1] for n in names), x["initial_state"],
                                mask=x["mask"][:, :t + 1], scale=scale)[1] for t in range(T)]
    return y, np.stack(states, axis=1)


def _run(backend, gate, x, **options):
    """``(y, states, numpy)`` of ``x`` on ``backend``'s default variant (skips where it cannot
    run here)."""
    spec = registry.get(backend)
    problem = Problem(HK, HV, DK, DV, gate=gate)
    ok, why = spec.capability(problem)
    if not ok:
        pytest.skip(f"{backend} cannot run here: {why}")
    gated_delta, array, numpy = entry(spec.framework)
    y, states = gated_delta(*(array(x[n]) for n in ("q", "k", "v", "g", "beta",
                                                    "initial_state")),
                            mask=array(x["mask"]), scale=DK ** -0.5,
                            variant=registry.default_variant(backend, problem), **options)
    return y, states, numpy


@pytest.mark.parametrize("gate", ["scalar", "vector"])
@pytest.mark.parametrize("backend", registry.names())
def test_window_states_match_the_float64_recurrence(backend, gate, monkeypatch):
    """Outputs poisoned; a backend listing the gate kind in ``step_states`` runs its own
    kernels' ``steps`` hook, every other the portable step loop."""
    from spies import spy_calls

    monkeypatch.setenv(settings.ENV_POISON_OUTPUTS, "1")
    spec = registry.get(backend)
    hooks = spy_calls(monkeypatch, type(spec), ["steps"])
    x = _inputs(1, vector=gate == "vector")
    y, states, numpy = _run(backend, gate, x, return_states="steps")
    assert bool(hooks) == (gate in spec.step_states)
    y_ref, states_ref = _reference_steps(x, DK ** -0.5)
    states = numpy(states)
    assert states.shape == (B, T, HV, DV, DK) and states.dtype == np.float32
    assert relative_error(numpy(y), y_ref) <= TOL
    for t in range(T):
        assert relative_error(states[:, t], states_ref[:, t]) <= TOL, t
    np.testing.assert_array_equal(states[1, 3], states[1, 2])  # a masked step: unchanged
    assert not numpy(y)[~x["mask"]].any()


@pytest.mark.parametrize("framework", ["jax", "mlx"])
def test_layer_inputs_and_bfloat16_storage(framework):
    """qk_norm with a softplus gate from its parameters, states stored in bfloat16: the last
    step's state is the plain call's final state, rounded."""
    gated_delta, array, numpy = entry(framework)
    x = _inputs(2)
    rng = np.random.default_rng(3)
    a = rng.standard_normal((B, T, HV)).astype(np.float32)
    params = {"A_log": array(rng.standard_normal(HV).astype(np.float32) * 0.3),
              "dt_bias": array(rng.standard_normal(HV).astype(np.float32))}
    args = [array(x[n]) for n in ("q", "k", "v")] + [array(a), array(x["beta"])]
    s0 = array(x["initial_state"])
    y, final = gated_delta(*args, s0, gate="softplus", qk_norm=True, **params)
    y_s, states = gated_delta(*args, s0, gate="softplus", qk_norm=True, return_states="steps",
                              **params)
    assert relative_error(numpy(y_s), numpy(y)) <= TOL
    assert relative_error(numpy(states)[:, -1], numpy(final)) <= TOL
    bf16 = s0.astype(dtype(framework, "bfloat16"))
    _, stored = gated_delta(*args, bf16, gate="softplus", qk_norm=True, return_states="steps",
                            state_dtype="bfloat16", **params)
    assert str(stored.dtype).endswith("bfloat16") and stored.shape == (B, T, HV, DV, DK)


#: (framework, backend): each framework's default call and every backend whose kernels write
#: the steps (their VJP is the portable step loop's)
GRADIENT_CASES = [("jax", None), ("mlx", None)] + [
    (registry.get(n).framework, n) for n in registry.names() if registry.get(n).step_states]


def _grad(framework, f, arrays):
    """The gradient of ``f`` at ``arrays``, a JAX one compiled: one program instead of hundreds
    of eager ops (the Pallas interpreters discharge their kernels into jnp ops, each compiled on
    its own when eager: several times slower). Under jit pallas_tpu skips its race check; the
    forward kernels these gradients run (the backward is the portable path's) run eagerly, on
    the same shapes, in test_window_states_... and test_chunk_boundary_states_..."""
    if framework == "jax":
        import jax

        return jax.jit(jax.grad(f, argnums=tuple(range(len(arrays)))))(*arrays)
    import mlx.core as mx

    return mx.grad(f, argnums=list(range(len(arrays))))(*arrays)


@pytest.mark.parametrize("framework, backend", GRADIENT_CASES,
                         ids=[f"{f}-{b or 'default'}" for f, b in GRADIENT_CASES])
def test_gradients_through_the_steps_match_the_chunk_vjp(framework, backend):
    """The gradient of a loss on y and the last step's state, through the steps (the default
    call's step loop, or a backend's per-step-states kernel with its VJP), equals the plain
    call's (the chunk path's hand-derived VJP): two independent derivations."""
    gated_delta, array, numpy = entry(framework)
    options = {}
    if backend is not None:
        problem = Problem(HK, HV, DK, DV)
        ok, why = registry.get(backend).capability(problem)
        if not ok:
            pytest.skip(f"{backend} cannot run here: {why}")
        options["variant"] = registry.default_variant(backend, problem)
    x = _inputs(4)
    names = ("q", "k", "v", "g", "beta", "initial_state")
    arrays = [array(x[n]) for n in names]
    mask = array(x["mask"])
    w = array(np.random.default_rng(5).standard_normal((B, HV, DV, DK)).astype(np.float32))

    def loss(steps):
        def f(*xs):
            y, s = gated_delta(*xs, mask=mask, scale=0.3,
                               return_states="steps" if steps else "final", **options)
            s = s[:, -1] if steps else s
            return (y ** 2).sum() + (w * s).sum()
        return f

    got, want = _grad(framework, loss(True), arrays), _grad(framework, loss(False), arrays)
    for name, a, b in zip(names, got, want):
        assert relative_error(numpy(a), numpy(b)) <= 1e-4, name


@pytest.mark.parametrize("framework", ["jax", "mlx"])
def test_bad_return_states_name_the_argument(framework):
    gated_delta, array, _ = entry(framework)
    x = _inputs(6)
    args = [array(x[n]) for n in ("q", "k", "v", "g", "beta", "initial_state")]
    with pytest.raises(ValueError, match="return_states must be one of"):
        gated_delta(*args, return_states="all")
    with pytest.raises(ValueError, match="return_states='steps' takes dense rows"):
        gated_delta(*(a[:1] for a in args[:5]), args[5],
                    cu_seqlens=array(np.array([0, 2, T], np.int32)), return_states="steps")
    with pytest.raises(ValueError, match="not a pool: pass state_indices=None"):
        gated_delta(*args, state_indices=array(np.array([0, 1], np.int32)),
                    return_states="steps")


# ------------------------------------------------------------------ chunk-boundary states

TC, EVERY = 150, 64


def _chunk_inputs(seed, vector=False):
    """T = 150: a reset inside the second checkpoint span, a masked stretch across the first."""
    return _inputs(seed, vector, T=TC, decay=(0.01, 0.2), reset=(1, 70),
                   masked=((0, slice(60, 70)),))


# per-channel on ffi_cpu and the Pallas backends in make test-all: [ffi_cpu-scalar] and the
# other backends' [*-vector] keep them
@pytest.mark.parametrize(("backend", "gate"), marked(
    [(b, g) for b in registry.names() for g in ("scalar", "vector")],
    {("ffi_cpu", "vector"), ("pallas_tpu", "vector"), ("pallas_gpu", "vector")}))
def test_chunk_boundary_states_match_the_float64_recurrence(backend, gate, monkeypatch):
    """return_states="chunks", checkpoint_every=64 over T = 150: the states at t = 64, 128
    and the final one (t = 150), each against the float64 recurrence of that prefix; outputs
    poisoned; a backend listing the gate kind in ``chunk_states`` runs its ``chunks`` hook."""
    from spies import spy_calls

    monkeypatch.setenv(settings.ENV_POISON_OUTPUTS, "1")
    spec = registry.get(backend)
    hooks = spy_calls(monkeypatch, type(spec), ["chunks"])
    x = _chunk_inputs(11, vector=gate == "vector")
    names = ("q", "k", "v", "g", "beta", "initial_state")
    y, states, numpy = _run(backend, gate, x, return_states="chunks", checkpoint_every=EVERY)
    assert bool(hooks) == (gate in spec.chunk_states)
    states = numpy(states)
    assert states.shape == (B, 3, HV, DV, DK) and states.dtype == np.float32
    y_ref, _ = reference.forward(*(x[n] for n in names), mask=x["mask"], scale=DK ** -0.5)
    assert relative_error(numpy(y), y_ref) <= TOL
    for j, t in enumerate((64, 128, 150)):
        _, s_ref = reference.forward(*(x[n][:, :t] for n in names[:5]), x["initial_state"],
                                     mask=x["mask"][:, :t], scale=DK ** -0.5)
        assert relative_error(states[:, j], s_ref) <= TOL, t


#: (backend, gate kind) of every chunk forward kernel that gives the chunk-boundary states
CHUNK_KERNELS = [(n, gate) for n in registry.names() for gate in registry.get(n).chunk_states]


# the VJP is the portable chunk path's on every backend (`gdngen.backends.generated.kernel_chunks`):
# ffi_cpu's per-channel and pallas_tpu's (interpret mode; compiled, ~20 s scalar, ~70 s
# per-channel) in make test-all; [ffi_cpu-scalar], [pallas_gpu-scalar] and metal's keep the
# wiring (pallas_gpu's per-channel, ~40 s in interpret mode, in make test-all), and the forward
# states of every kernel stay in test_chunk_boundary_states_match_the_float64_recurrence
@pytest.mark.parametrize(("backend", "gate"), marked(
    CHUNK_KERNELS, {("ffi_cpu", "vector"), ("pallas_tpu", "scalar"), ("pallas_tpu", "vector"),
                    ("pallas_gpu", "vector")}))
def test_gradients_through_kernel_chunk_states(backend, gate):
    """A loss on y and every checkpoint, through a backend's chunk-states kernel (its VJP the
    portable chunk path's) and through the portable path itself: equal gradients."""
    spec = registry.get(backend)
    framework = spec.framework
    gated_delta, array, numpy = entry(framework)
    problem = Problem(HK, HV, DK, DV, gate=gate)
    ok, why = spec.capability(problem)
    if not ok:
        pytest.skip(f"{backend} cannot run here: {why}")
    x = _chunk_inputs(13, vector=gate == "vector")
    names = ("q", "k", "v", "g", "beta", "initial_state")
    arrays = [array(x[n]) for n in names]
    mask = array(x["mask"])
    w = array(np.random.default_rng(6).standard_normal((B, 3, HV, DV, DK)).astype(np.float32))
    variant = registry.default_variant(backend, problem)
    chunk = int(variant.get("chunk_size"))

    def loss(**options):
        def f(*xs):
            y, s = gated_delta(*xs, mask=mask, scale=0.3, return_states="chunks",
                               checkpoint_every=2 * chunk, **options)
            return (y ** 2).sum() + (w[:, :s.shape[1]] * s).sum()
        return f

    got = _grad(framework, loss(variant=variant), arrays)
    want = _grad(framework, loss(chunk_size=chunk), arrays)
    for name, a, b in zip(names, got, want):
        assert relative_error(numpy(a), numpy(b)) <= 1e-4, name


@pytest.mark.parametrize("framework", ["jax", "mlx"])
def test_chunk_states_checks(framework):
    gated_delta, array, _ = entry(framework)
    x = _chunk_inputs(12)
    args = [array(x[n]) for n in ("q", "k", "v", "g", "beta", "initial_state")]
    with pytest.raises(ValueError, match="checkpoint_every=48 must be a multiple of the chunk"):
        gated_delta(*args, return_states="chunks", checkpoint_every=48, chunk_size=64)
    with pytest.raises(ValueError, match="checkpoint_every must be a positive int"):
        gated_delta(*args, return_states="chunks")
    with pytest.raises(ValueError, match="checkpoint_every goes with return_states='chunks'"):
        gated_delta(*args, checkpoint_every=64)
    _, one = gated_delta(*args, return_states="chunks", checkpoint_every=256, chunk_size=64)
    _, final = gated_delta(*args, chunk_size=64)
    assert one.shape == (B, 1, HV, DV, DK)  # T <= N: the final state alone
    assert relative_error(np.asarray(one[:, 0]), np.asarray(final)) <= TOL
