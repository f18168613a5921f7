"""The pallas_gpu recurrent forward kernel (templates/pallas_gpu/recurrent.py.j2): the kernel
function against the float64 reference (scalar and per-channel gates, T = 1 and a T that is no
power of two, GVA 3x, Dk != Dv and neither a multiple of 16, several BK / BV tiles, an exact
reset, an initial state), its Triton lowering for CUDA (no GPU needed), its rendering, and the
switch in the entry point (a masked call; gradients equal to the chunk path's).

Off-GPU the kernel runs in Pallas interpret mode, which starts every output as NaN (the
poisoned-outputs mode of this backend), so an unwritten element fails the comparison.
"""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")

from channel_walks import spy_chunk_walks

import gdngen.jax as gjax
from gdngen import Problem, Variant, render, settings
from gdngen.algebra import reference
from gdngen.backends.pallas import gpu as pallas_gpu

#: bk 32 / bv 32 resolve to 16-wide tiles for Dk = 40 (padded 48: three tiles) and Dv = 24
#: (padded 32: two programs per head).
BASE = {"chunk_size": 16, "precision": "ieee", "bk": 32, "bv": 32, "num_warps": 4,
        "num_stages": 2, "save_states": True}
TOL = 5e-5


def _variant(recurrent_below=1000, **changes):
    return Variant("pallas_gpu", dict(BASE, recurrent_below=recurrent_below, **changes))


@pytest.fixture(autouse=True)
def _poisoned_outputs(monkeypatch):
    monkeypatch.setenv(settings.ENV_POISON_OUTPUTS, "1")


def _rel(x, ref):
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    assert np.isfinite(x).all()
    return float(np.linalg.norm(x - ref) / max(np.linalg.norm(ref), 1e-30))


def _inputs(seed, B, T, Hk, Hv, Dk, Dv, *, vector, log=False):
    """float32 q, k (k L2-normalised), v, decay (linear, with an exact 0 at step T // 2 of
    batch 0, head 0; log gates with -inf there when ``log``), beta, S0."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, T, Hk, Dk)).astype(np.float32)
    k = rng.standard_normal((B, T, Hk, Dk))
    k = (k / np.linalg.norm(k, axis=-1, keepdims=True)).astype(np.float32)
    v = rng.standard_normal((B, T, Hv, Dv)).astype(np.float32)
    decay = rng.uniform(0.6, 1.0, (B, T, Hv) + ((Dk,) if vector else ())).astype(np.float32)
    decay[0, T // 2, 0] = 0.0  # exact reset
    beta = rng.uniform(0.0, 1.5, (B, T, Hv)).astype(np.float32)
    s0 = rng.standard_normal((B, Hv, Dv, Dk)).astype(np.float32)
    if log:
        with np.errstate(divide="ignore"):
            decay = np.log(decay)
    return q, k, v, decay, beta, s0


# ----------------------------------------------------------------------------- the kernel


@pytest.mark.parametrize("vector", [False, True], ids=["scalar", "per_channel"])
@pytest.mark.parametrize("B, T, Hk, Hv, Dk, Dv", [
    (2, 1, 1, 3, 40, 24),
    (1, 37, 1, 3, 40, 24),
    (1, 21, 2, 6, 32, 64),
], ids=["t1", "t37-padded", "t21-gva-hk2"])
def test_kernel_matches_reference(vector, B, T, Hk, Hv, Dk, Dv):
    q, k, v, decay, beta, s0 = _inputs(T + Hk, B, T, Hk, Hv, Dk, Dv, vector=vector)
    problem = Problem(Hk, Hv, Dk, Dv, gate="vector" if vector else "scalar")
    scale = Dk ** -0.5
    y, state = pallas_gpu.recurrent_forward(q, k, v, decay, beta, s0, scale=scale,
                                            variant=_variant(), problem=problem)
    assert y.shape == (B, T, Hv, Dv) and y.dtype == jnp.float32
    assert state.shape == (B, Hv, Dv, Dk) and state.dtype == jnp.float32
    y_ref, s_ref = reference.forward(q, k, v, decay, beta, s0, scale=scale, gate="linear")
    assert _rel(y, y_ref) <= TOL and _rel(state, s_ref) <= TOL
    # the reset at step T // 2 of (batch 0, head 0) forgets S0 exactly: same state from zeros
    s0_changed = s0.copy()
    s0_changed[0, 0] += 1.0
    _, state2 = pallas_gpu.recurrent_forward(q, k, v, decay, beta, s0_changed, scale=scale,
                                             variant=_variant(), problem=problem)
    np.testing.assert_array_equal(np.asarray(state2[0, 0]), np.asarray(state[0, 0]))


@pytest.mark.parametrize("gate", ["scalar", "vector"])
def test_kernel_lowers_through_triton(gate):
    """The recurrent kernel lowers through the Pallas Triton lowering for CUDA (power-of-two
    tiles, scalar loads at a traced step, no scratch memory), with several BK / BV tiles; so do
    the chunk kernels (per-channel gates: the chunk walks, the intra-chunk kernel and its VJP's,
    head dims zero-padded to 48 and 80 in 16-wide tiles)."""
    problem = Problem(1, 3, 40, 72, gate=gate)
    lowered = pallas_gpu.lower_check(_variant(bk=16, bv=16), problem, steps=7)
    expected = ({"channel_walk", "channel_walk_backward", "channel_intra", "channel_grads",
                 "channel_grads_linear", "recurrent"} if gate == "vector"
                else {"forward", "residuals", "backward", "recurrent"})
    assert set(lowered) == expected
    text = lowered["recurrent"]
    assert "gpu.triton" in text or "triton_kernel_call" in text
    assert "gdn_recurrent" in text


def test_rendering_params_and_switch_reach_no_source():
    problem = Problem(2, 6, 40, 72)
    rendered = render(_variant(bk=16, bv=64, num_warps=8), problem)
    source = rendered.sources["recurrent.py"]
    for line in ("DK = 48", "DV = 80", "BK = 16", "BV = 16", "N_DK = 3", "N_DV = 5", "HK = 2",
                 "HV = 6", "GROUP = 3", "PER_CHANNEL = False", "NUM_WARPS = 8",
                 "NUM_STAGES = 2"):
        assert f"\n{line}" in source, line
    assert "{%" not in source
    compile(source, "<rendered>", "exec")
    vector = render(_variant(), Problem(2, 6, 40, 72, gate="vector")).sources["recurrent.py"]
    assert "\nPER_CHANNEL = True" in vector
    # recurrent_below changes no source; the chunk-only params do not reach recurrent.py
    assert render(_variant(0), problem).sha256 == render(_variant(1000), problem).sha256
    assert (render(_variant(chunk_size=64, save_states=False), problem).sources["recurrent.py"]
            == render(_variant(), problem).sources["recurrent.py"])


# ----------------------------------------------------------------------------- the switch


def _counting_recurrent(monkeypatch):
    calls = []
    cls = type(pallas_gpu.SPEC)
    original = cls.run_recurrent

    def counted(self, *args, **kwargs):
        calls.append(1)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(cls, "run_recurrent", counted)
    return calls


def test_entry_short_masked_call_runs_the_recurrent_kernel(monkeypatch):
    """T = 21 < recurrent_below: the forward is the recurrent kernel's (checked against the
    reference, with a padding mask and a -inf log gate); gradients of such calls on every
    backend: tests/calls/test_recurrent.py."""
    B, T, Hk, Hv, Dk, Dv = 2, 21, 1, 3, 32, 16
    q, k, v, g, beta, s0 = _inputs(3, B, T, Hk, Hv, Dk, Dv, vector=False, log=True)
    mask = np.ones((B, T), bool)
    mask[0, :4] = False  # left padding
    mask[1, 15:] = False  # right padding
    v = np.where(mask[:, :, None, None], v, 100.0 * v)  # garbage at padded steps
    args = tuple(jnp.asarray(x) for x in (q, k, v, g, beta, s0))
    scale = Dk ** -0.5
    calls = _counting_recurrent(monkeypatch)
    y, state = gjax.gated_delta(*args, mask=jnp.asarray(mask), scale=scale, gate="log",
                                variant=_variant(1000))
    assert calls, "the recurrent kernel did not run"
    y_ref, s_ref = reference.forward(q, k, v, g, beta, s0, mask=mask, scale=scale, gate="log")
    assert _rel(y, y_ref) <= TOL and _rel(state, s_ref) <= TOL
    assert (np.asarray(y)[~mask] == 0).all()


def _cotangents(B, T, Hv, Dv, Dk):
    rng = np.random.default_rng(7)
    return (rng.standard_normal((B, T, Hv, Dv)).astype(np.float32),
            rng.standard_normal((B, Hv, Dv, Dk)).astype(np.float32))


def test_entry_vector_gates(monkeypatch):
    """Per-channel gates, a short call (T < recurrent_below): the recurrent kernel's values,
    the per-channel chunk core's VJP (the intra-chunk kernel, the kernel walks, the grads
    kernel); values and gradients against the reference."""
    B, T, Hk, Hv, Dk, Dv = 1, 19, 2, 6, 16, 32  # two chunks of 16
    q, k, v, g, beta, s0 = _inputs(5, B, T, Hk, Hv, Dk, Dv, vector=True, log=True)
    mask = np.ones((B, T), bool)
    mask[0, 9:12] = False
    args = tuple(jnp.asarray(x) for x in (q, k, v, g, beta, s0))
    cot = _cotangents(B, T, Hv, Dv, Dk)
    ref = reference.vjp(q, k, v, g, beta, s0, *cot, mask=mask, scale=0.3, gate="log")
    calls = _counting_recurrent(monkeypatch)
    walks = spy_chunk_walks(monkeypatch, pallas_gpu)

    def f(*arrays):
        return gjax.gated_delta(*arrays, mask=jnp.asarray(mask), scale=0.3, gate="log",
                                variant=_variant(1000))

    y, state = f(*args)
    assert calls and walks == []
    assert _rel(y, ref["y"]) <= TOL and _rel(state, ref["final_state"]) <= TOL
    _, vjp = jax.vjp(f, *args)
    grads = vjp(tuple(jnp.asarray(c) for c in cot))
    assert walks.count("backward") == 1 and "forward" in walks and "intra" in walks
    for name, grad in zip(("dq", "dk", "dv", "dg", "dbeta", "dinitial_state"), grads):
        assert _rel(grad, ref[name]) <= TOL, name


def test_low_precision_inputs_take_the_recurrent_kernel_in_float32(monkeypatch):
    """bfloat16 q, k, v: the recurrent kernel runs on them upcast to float32; y comes back in
    bfloat16, the state in float32."""
    B, T, Hk, Hv, Dk, Dv = 1, 5, 1, 2, 32, 32
    q, k, v, g, beta, s0 = _inputs(11, B, T, Hk, Hv, Dk, Dv, vector=False, log=True)
    calls = _counting_recurrent(monkeypatch)
    bf16 = [jnp.asarray(x, jnp.bfloat16) for x in (q, k, v)]
    y, state = gjax.gated_delta(*bf16, jnp.asarray(g), jnp.asarray(beta), jnp.asarray(s0),
                                scale=0.2, variant=_variant())
    assert calls and y.dtype == jnp.bfloat16 and state.dtype == jnp.float32
    up = [np.asarray(x.astype(jnp.float32)) for x in bf16]
    y_ref, s_ref = reference.forward(*up, g, beta, s0, scale=0.2)
    assert _rel(y, y_ref) <= 1e-2 and _rel(state, s_ref) <= TOL
