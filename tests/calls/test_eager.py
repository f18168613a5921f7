"""An eager JAX call runs as one compiled step (`gdngen.eager`): the plain call and
``load_tuned()``'s agree with the traced call and the float64 reference, an unchanged call is
not traced again, a new variant (a new tuned entry, an explicit one) compiles its own step, and
the checks only a concrete call can make (``state_indices``' and ``cu_seqlens``' values) still
raise."""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp

import gdngen
import gdngen.jax
from gdngen import eager, entry, registry
from gdngen.algebra import reference
from gdngen.problem import Problem
from gdngen.validate import relative_error

B, T, HK, HV, D = 2, 5, 1, 2, 32
TOL = 5e-5


@pytest.fixture(autouse=True)
def _fresh_steps():
    eager.clear()
    yield
    eager.clear()


def _inputs(seed=0, B=B, T=T):
    rng = np.random.default_rng(seed)
    k = rng.standard_normal((B, T, HK, D))
    return {"q": rng.standard_normal((B, T, HK, D)),
            "k": k / np.linalg.norm(k, axis=-1, keepdims=True),
            "v": rng.standard_normal((B, T, HV, D)),
            "g": -rng.uniform(0.05, 0.5, (B, T, HV)),
            "beta": rng.uniform(0.1, 1.0, (B, T, HV)),
            "initial_state": 0.1 * rng.standard_normal((B, HV, D, D))}


def _arrays(x):
    return [jnp.asarray(x[n], jnp.float32) for n in ("q", "k", "v", "g", "beta",
                                                     "initial_state")]


def _traces(monkeypatch):
    """Counts the traces of the entry's bound body, `gdngen.entry.run` (each compile of a step
    traces it once; plain and ``load_tuned()`` calls both run it)."""
    count = [0]
    body = entry.run

    def counted(*args, **kwargs):
        count[0] += 1
        return body(*args, **kwargs)

    monkeypatch.setattr(entry, "run", counted)
    return count


def test_an_unchanged_call_is_traced_once_and_agrees_with_the_reference(monkeypatch):
    traces = _traces(monkeypatch)
    x = _inputs(1)
    y_ref, s_ref = reference.forward(*(x[n] for n in ("q", "k", "v", "g", "beta",
                                                      "initial_state")), scale=D ** -0.5)
    for _ in range(3):
        y, state = gdngen.jax.gated_delta(*_arrays(x), scale=D ** -0.5)
        assert relative_error(np.asarray(y), y_ref) <= TOL
        assert relative_error(np.asarray(state), s_ref) <= TOL
    assert traces[0] == 1
    traced = jax.jit(lambda *a: gdngen.jax.gated_delta(*a, scale=D ** -0.5))(*_arrays(x))
    np.testing.assert_allclose(np.asarray(traced[0]), np.asarray(y), rtol=1e-6, atol=1e-6)
    assert traces[0] == 2  # the caller's own jit traces the body as before
    gdngen.jax.gated_delta(*_arrays(_inputs(2, T=T + 1)), scale=D ** -0.5)
    assert traces[0] == 3  # a new shape: jit's own cache traces it once


def test_each_variant_compiles_its_own_step(monkeypatch):
    """Two variants of one call (as a new tuned entry would change it) run each its own."""
    traces = _traces(monkeypatch)
    x = _arrays(_inputs(3))
    problem = Problem(HK, HV, D, D)
    chunked, stepped = (registry.default_variant("xla", problem).replace(recurrent_below=r)
                        for r in (0, 64))
    a = gdngen.jax.gated_delta(*x, scale=D ** -0.5, variant=chunked)
    b = gdngen.jax.gated_delta(*x, scale=D ** -0.5, variant=stepped)
    gdngen.jax.gated_delta(*x, scale=D ** -0.5, variant=chunked)
    assert traces[0] == 2
    np.testing.assert_allclose(np.asarray(a[1]), np.asarray(b[1]), rtol=1e-5, atol=1e-6)


def test_load_tuned_runs_eagerly_as_one_step(monkeypatch):
    count = _traces(monkeypatch)
    x = _inputs(4)
    tuned = gdngen.load_tuned("jax")
    y_ref, s_ref = reference.forward(*(x[n] for n in ("q", "k", "v", "g", "beta",
                                                      "initial_state")), scale=D ** -0.5)
    for _ in range(3):
        y, state = tuned(*_arrays(x), scale=D ** -0.5)
        assert relative_error(np.asarray(y), y_ref) <= TOL
        assert relative_error(np.asarray(state), s_ref) <= TOL
    assert count[0] == 1


@pytest.mark.parametrize("framework_call", ["plain", "tuned"])
def test_concrete_value_checks_still_raise(framework_call):
    x = _arrays(_inputs(5))
    call = gdngen.jax.gated_delta if framework_call == "plain" else gdngen.load_tuned("jax")
    pool = jnp.zeros((4, HV, D, D))
    with pytest.raises(ValueError, match=r"state_indices repeats \[1\]"):
        call(*x[:5], pool, state_indices=jnp.array([1, 1], jnp.int32), scale=D ** -0.5)
    with pytest.raises(ValueError, match="state_indices has 7, past the pool of 4"):
        call(*x[:5], pool, state_indices=jnp.array([0, 7], jnp.int32), scale=D ** -0.5)
    packed = [a[:1] for a in x[:5]]
    with pytest.raises(ValueError, match="cu_seqlens"):
        call(*packed, cu_seqlens=jnp.array([0, 4, 3], jnp.int32), scale=D ** -0.5)
