"""ffi_cpu recurrent kernel (templates/ffi_cpu/recurrent.cc.j2): the forward of short calls and
of per-channel gates, against the float64 reference, with every kernel output NaN-filled
before the kernel writes it (``GDNGEN_POISON_OUTPUTS=1``).

Every test here uses head dims Dk=20, Dv=36 (not multiples of 16), so the default run compiles
two libraries (scalar and per-channel gates) once per host and cache."""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp

from gdngen import validate
from gdngen.algebra import reference
from gdngen.backends import ffi_cpu
from gdngen.problem import Problem
from gdngen.render import render
from gdngen.variant import Variant

pytestmark = pytest.mark.skipif(not ffi_cpu.available(),
                                reason="the ffi_cpu backend needs a C++ compiler (g++ or $CXX)")

TOL = 5e-5
DK, DV = 20, 36


@pytest.fixture(autouse=True)
def _poisoned_outputs(monkeypatch):
    monkeypatch.setenv(ffi_cpu.ENV_POISON, "1")


def _variant(recurrent_below=ffi_cpu.RECURRENT_BELOW, **changes):
    params = ffi_cpu.default_config(Problem(1, 1, DK, DV)).params()
    return Variant("ffi_cpu", dict(params, recurrent_below=recurrent_below, **changes))


def _inputs(seed, B, T, Hk, Hv, Dk=DK, Dv=DV, per_channel=False, gate="linear"):
    """Fresh random inputs: unit-norm keys, gates in [0.5, 1] with one exact zero (linear) /
    -inf (log) at step T // 2 of batch 0, beta in [0, 1], a random initial state."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, T, Hk, Dk)).astype(np.float32)
    k = rng.standard_normal((B, T, Hk, Dk)).astype(np.float32)
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    v = rng.standard_normal((B, T, Hv, Dv)).astype(np.float32)
    a = rng.uniform(0.5, 1.0, (B, T, Hv, Dk) if per_channel else (B, T, Hv)).astype(np.float32)
    if T > 1:
        a[0, T // 2] = 0.0  # an exact reset of every head (every channel)
    if per_channel and Dk > 1:
        a[-1, -1, -1, 0] = 0.0  # one channel only
    beta = rng.uniform(0.0, 1.0, (B, T, Hv)).astype(np.float32)
    S0 = rng.standard_normal((B, Hv, Dv, Dk)).astype(np.float32)
    with np.errstate(divide="ignore"):
        g = np.log(a) if gate == "log" else a
    return q, k, v, g.astype(np.float32), beta, S0


def _rel(x, ref):
    return validate.relative_error(np.asarray(x, np.float64), ref)


# ----------------------------------------------------------------------------- the kernel


@pytest.mark.parametrize("per_channel", [False, True], ids=["scalar", "per_channel"])
@pytest.mark.parametrize("B, T, Hk, Hv", [(1, 1, 1, 3), (2, 37, 1, 3), (1, 37, 2, 6)],
                         ids=["t1_gva3", "t37_gva3", "t37_hk2_hv6"])
def test_kernel_matches_reference(per_channel, B, T, Hk, Hv):
    q, k, v, a, beta, S0 = _inputs(1 + T + Hv, B, T, Hk, Hv, per_channel=per_channel)
    scale = DK ** -0.5
    y, S = ffi_cpu.recurrent_forward(*map(jnp.asarray, (q, k, v, a, beta, S0)), scale=scale,
                                     variant=_variant())
    y_ref, S_ref = reference.forward(q, k, v, a, beta, S0, scale=scale, gate="linear")
    assert y.shape == (B, T, Hv, DV) and S.shape == (B, Hv, DV, DK)
    assert y.dtype == S.dtype == jnp.float32
    assert _rel(y, y_ref) <= TOL and _rel(S, S_ref) <= TOL, (_rel(y, y_ref), _rel(S, S_ref))


def test_kernel_zero_decay_resets_the_state_exactly():
    """A zero decay at the last step forgets the whole state: S_T = beta v k^T exactly as the
    reference forms it from a zero state."""
    q, k, v, a, beta, S0 = _inputs(7, 1, 5, 1, 3)
    a[:, -1] = 0.0
    S0 *= 1e6  # anything left of the old state would show
    y, S = ffi_cpu.recurrent_forward(*map(jnp.asarray, (q, k, v, a, beta, S0)), scale=1.0,
                                     variant=_variant())
    y_ref, S_ref = reference.forward(q[:, -1:], k[:, -1:], v[:, -1:], a[:, -1:], beta[:, -1:],
                                     None, gate="linear")
    assert _rel(S, S_ref) <= TOL and _rel(y[:, -1:], y_ref) <= TOL


def test_kernel_jits_and_vmaps():
    q, k, v, a, beta, S0 = _inputs(3, 1, 6, 1, 3)
    stacked = [np.stack([x, 0.5 * x]) for x in (q, k, v, a, beta, S0)]

    def f(*xs):
        return ffi_cpu.recurrent_forward(*xs, scale=0.5, variant=_variant())

    y, S = jax.jit(jax.vmap(f))(*map(jnp.asarray, stacked))
    for i in range(2):
        y_ref, S_ref = reference.forward(*(x[i] for x in stacked), scale=0.5, gate="linear")
        assert _rel(y[i], y_ref) <= TOL and _rel(S[i], S_ref) <= TOL
    # two independent calls in one program (XLA may run them at once: one takes the kernel's
    # thread pool, the other threads of its own)
    both = jax.jit(lambda a, b: (f(*a), f(*b)))(*(tuple(jnp.asarray(x[i]) for x in stacked)
                                                  for i in range(2)))
    for i in range(2):
        np.testing.assert_array_equal(both[i][0], y[i])
        np.testing.assert_array_equal(both[i][1], S[i])


def test_kernel_rejects_a_decay_of_the_other_gate_kind():
    q, k, v, a, beta, S0 = _inputs(4, 1, 3, 1, 3)
    scalar = ffi_cpu.load_kernels(_variant(), Problem(1, 3, DK, DV))
    call = ffi_cpu.vjp.recurrent(scalar.sha256, 1.0, False)
    with pytest.raises(Exception, match="rendered for scalar decay"):
        jax.block_until_ready(call(q, k, v, np.repeat(a[..., None], DK, -1), beta, S0))


def test_recurrent_source_is_rendered_with_the_variant():
    """The recurrent kernel is part of the rendering (so `gdngen build` / the source hash see
    it), per gate kind; recurrent_below renders into nothing."""
    scalar = render(_variant(), Problem(1, 3, DK, DV))
    assert set(scalar.sources) == {"gated_delta.cc", "recurrent.cc"}
    assert "constexpr bool PER_CHANNEL = false;" in scalar.sources["recurrent.cc"]
    assert render(_variant(recurrent_below=0), Problem(1, 3, DK, DV)).sha256 == scalar.sha256
    vector = render(_variant(), Problem(1, 3, DK, DV, gate="vector"))
    assert "constexpr bool PER_CHANNEL = true;" in vector.sources["recurrent.cc"]
    # per-channel gates have chunk kernels of their own (templates/ffi_cpu/channel.cc.j2)
    assert "constexpr int SC = 8;" in vector.sources["gated_delta.cc"]
    assert "constexpr int SC" not in scalar.sources["gated_delta.cc"]


# ----------------------------------------------------------------------------- the entry


def _entry(args, mask, gate, variant, scale):
    def f(q, k, v, g, beta, S0):
        return ffi_cpu.gated_delta(q, k, v, g, beta, S0, mask=mask, scale=scale, gate=gate,
                                   variant=variant)
    return f


@pytest.mark.parametrize("gate", ["log", "linear"])
def test_entry_short_call_forward_and_vjp(gate):
    """Below recurrent_below a forward-only call runs the recurrent kernel (equal to the
    reference) and its VJP is the chunk path's (equal to the recurrent_below=0 variant's)."""
    B, T, Hk, Hv = 2, 13, 1, 3
    args = _inputs(11, B, T, Hk, Hv, gate=gate)
    mask = np.ones((B, T), bool)
    mask[0, :3] = False  # left padding
    mask[1, 7] = False
    scale = DK ** -0.5
    arrays = tuple(map(jnp.asarray, args))
    short = _entry(args, jnp.asarray(mask), gate, _variant(1000), scale)
    chunk = _entry(args, jnp.asarray(mask), gate, _variant(0), scale)
    assert "_recurrent" in str(jax.make_jaxpr(short)(*arrays))
    assert "_recurrent" not in str(jax.make_jaxpr(chunk)(*arrays))
    y, S = jax.jit(short)(*arrays)
    y_ref, S_ref = reference.forward(*args, mask=mask, scale=scale, gate=gate)
    assert _rel(y, y_ref) <= TOL and _rel(S, S_ref) <= TOL
    assert np.all(np.asarray(y)[~mask] == 0.0)
    rng = np.random.default_rng(12)
    dy = jnp.asarray(rng.standard_normal(y.shape).astype(np.float32))
    dS = jnp.asarray(rng.standard_normal(S.shape).astype(np.float32))
    _, vjp_short = jax.vjp(short, *arrays)
    _, vjp_chunk = jax.vjp(chunk, *arrays)
    ref = reference.vjp(*args, dy, dS, mask=mask, scale=scale, gate=gate)
    names = ("dq", "dk", "dv", "dg", "dbeta", "dinitial_state")
    for name, a, b in zip(names, vjp_short((dy, dS)), vjp_chunk((dy, dS)), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6, err_msg=name)
        assert _rel(a, ref[name]) <= TOL, name


def test_entry_vector_gate_forward_and_vjp():
    """A short per-channel-gate call: the recurrent kernel forward, the per-channel chunk
    kernels' VJP."""
    B, T, Hk, Hv = 1, 9, 2, 6
    args = _inputs(21, B, T, Hk, Hv, per_channel=True, gate="log")
    mask = np.ones((B, T), bool)
    mask[0, 4] = False
    scale = 0.7
    arrays = tuple(map(jnp.asarray, args))
    f = _entry(args, jnp.asarray(mask), "log", _variant(1000), scale)
    assert "_recurrent" in str(jax.make_jaxpr(f)(*arrays))
    assert "_backward" in str(jax.make_jaxpr(lambda *a: jax.vjp(f, *a)[1]((a[2], a[5])))(
        *arrays))
    y, S = f(*arrays)
    y_ref, S_ref = reference.forward(*args, mask=mask, scale=scale, gate="log")
    assert _rel(y, y_ref) <= TOL and _rel(S, S_ref) <= TOL
    rng = np.random.default_rng(22)
    dy = rng.standard_normal(y.shape).astype(np.float32)
    dS = rng.standard_normal(S.shape).astype(np.float32)
    _, vjp = jax.vjp(f, *arrays)
    ref = reference.vjp(*args, dy, dS, mask=mask, scale=scale, gate="log")
    names = ("dq", "dk", "dv", "dg", "dbeta", "dinitial_state")
    for name, grad in zip(names, vjp((jnp.asarray(dy), jnp.asarray(dS))), strict=True):
        assert _rel(grad, ref[name]) <= TOL, name


@pytest.mark.slow
@pytest.mark.parametrize("per_channel", [False, True], ids=["scalar", "per_channel"])
def test_kernel_matches_reference_at_full_head_dims(per_channel):
    q, k, v, a, beta, S0 = _inputs(31, 2, 64, 2, 8, Dk=128, Dv=128, per_channel=per_channel)
    problem = Problem(2, 8, 128, 128, gate="vector" if per_channel else "scalar")
    variant = Variant("ffi_cpu", ffi_cpu.default_config(problem).params())
    y, S = ffi_cpu.recurrent_forward(*map(jnp.asarray, (q, k, v, a, beta, S0)), scale=128 ** -0.5,
                                     variant=variant)
    y_ref, S_ref = reference.forward(q, k, v, a, beta, S0, scale=128 ** -0.5, gate="linear")
    assert _rel(y, y_ref) <= TOL and _rel(S, S_ref) <= TOL
