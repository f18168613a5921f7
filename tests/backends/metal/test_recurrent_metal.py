"""The Metal recurrent kernel (``templates/metal/recurrent.metal.j2``): the forward of short calls
(T < recurrent_below, scalar and per-channel gates), checked in `gdngen.backends.metal.sim` against
the float64 reference.

The simulator poisons every output before a launch and fails on anything left unwritten (the
project's poisoned-outputs mode, ``GDNGEN_POISON_OUTPUTS=1``, is set as well: on an Apple GPU it
NaN-fills the outputs). The `metal`-marked test compares the GPU with the simulator.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from gdngen import Problem, Variant, render, variants
from gdngen.algebra import reference
from gdngen.backends import metal
from gdngen.backends.metal import sim as metal_sim
from gdngen.resources import templates_dir
from gdngen.validate import relative_error

mx = pytest.importorskip("mlx.core", reason="the Metal backend runs through MLX")
pytestmark = pytest.mark.skipif(not metal_sim.available(), reason="no C++ compiler (g++)")

ROOT = Path(__file__).resolve().parents[3]
TOL = 5e-5


@pytest.fixture(autouse=True)
def _poison(monkeypatch):
    monkeypatch.setenv("GDNGEN_POISON_OUTPUTS", "1")


def _variant(problem: Problem, dv_tile: int, simdgroups: int, **params) -> Variant:
    """The first variant of ``problem``'s space with this recurrent tiling (and ``params``)."""
    for v in variants("metal", problem):
        p = v.as_dict()
        if p["dv_tile"] == dv_tile and p["simdgroups"] == simdgroups and all(
                p[n] == x for n, x in params.items() if n != "recurrent_below"):
            return Variant("metal", dict(p, **params))
    raise AssertionError(f"no variant with dv_tile={dv_tile}, simdgroups={simdgroups}")


def _inputs(rng, B, T, Hk, Hv, Dk, Dv, per_channel, gate="linear"):
    """Fresh float32 inputs (NumPy): unit-norm keys, decays in [0.6, 1) with one exact 0 (a
    reset) at step T // 2 of batch 0, head 0 (all channels), and a random initial state."""
    q = rng.standard_normal((B, T, Hk, Dk)).astype(np.float32)
    k = rng.standard_normal((B, T, Hk, Dk))
    k = (k / np.linalg.norm(k, axis=-1, keepdims=True)).astype(np.float32)
    v = rng.standard_normal((B, T, Hv, Dv)).astype(np.float32)
    a = rng.uniform(0.6, 1.0, (B, T, Hv, Dk) if per_channel else (B, T, Hv))
    a[0, T // 2, 0] = 0.0
    beta = rng.uniform(0.1, 1.0, (B, T, Hv)).astype(np.float32)
    s0 = (0.5 * rng.standard_normal((B, Hv, Dv, Dk))).astype(np.float32)
    with np.errstate(divide="ignore"):
        g = (np.log(a) if gate == "log" else a).astype(np.float32)
    return {"q": q, "k": k, "v": v, "g": g, "beta": beta, "initial_state": s0}


# per_channel, B, T, Hk, Hv, Dk, Dv, dv_tile, simdgroups: T = 1 and 37 (not a power of two),
# GVA 3x, Dk != Dv both ways, 4 / 8 / 32 / 64 state rows per simdgroup (64: two per lane).
KERNEL_CASES = (
    (False, 1, 1, 1, 3, 32, 64, 16, 4),
    (False, 1, 37, 2, 6, 64, 32, 32, 1),
    (True, 2, 1, 1, 3, 64, 32, 32, 4),
    (True, 2, 37, 1, 3, 32, 64, 64, 1),
)


@pytest.mark.parametrize("case", KERNEL_CASES, ids=lambda c: "pc{}-b{}-t{}-hk{}-hv{}-dk{}-dv{}"
                         "-rows{}-sg{}".format(*c))
def test_kernel_matches_reference(case):
    per_channel, B, T, Hk, Hv, Dk, Dv, dvt, sg = case
    rng = np.random.default_rng(abs(hash(case)) % 2**32)
    x = _inputs(rng, B, T, Hk, Hv, Dk, Dv, per_channel)
    problem = Problem(Hk, Hv, Dk, Dv, "float32", "vector" if per_channel else "scalar")
    variant = _variant(Problem(Hk, Hv, Dk, Dv), dvt, sg)
    scale = Dk ** -0.5
    launcher = metal.SimLauncher()
    y, S = metal.recurrent_forward(*(mx.array(x[n]) for n in ("q", "k", "v", "g", "beta",
                                                                "initial_state")),
                                   scale=scale, variant=variant, problem=problem,
                                   launcher=launcher)
    assert launcher.threadgroup_bytes == {"recurrent": 0}
    y_ref, S_ref = reference.forward(x["q"], x["k"], x["v"], x["g"], x["beta"],
                                     x["initial_state"], scale=scale, gate="linear")
    assert y.shape == (B, T, Hv, Dv) and S.shape == (B, Hv, Dv, Dk)
    assert y.dtype == mx.float32 and S.dtype == mx.float32
    err_y, err_s = relative_error(np.array(y), y_ref), relative_error(np.array(S), S_ref)
    assert err_y <= TOL and err_s <= TOL, (err_y, err_s)


def test_unwritten_outputs_are_caught(tmp_path):
    """A kernel that skips a row of y fails the launch (the poisoned outputs show it)."""
    text = (templates_dir("metal") / "recurrent.metal.j2").read_text()
    broken = text.replace("if (lane == r % 32) {", "if (lane == r % 32 && r != 1) {")
    assert broken != text
    (tmp_path / "metal").mkdir()
    (tmp_path / "metal/recurrent.metal.j2").write_text(broken)
    x = _inputs(np.random.default_rng(1), 1, 2, 1, 1, 32, 32, False)
    args = [mx.array(x[n]) for n in ("q", "k", "v", "g", "beta", "initial_state")]
    variant = _variant(Problem(1, 1, 32, 32), 32, 4)
    with pytest.raises(metal_sim.SimulatorError, match="poison pattern"):
        metal.recurrent_forward(*args, scale=1.0, variant=variant, templates_dir=str(tmp_path),
                                launcher=metal.SimLauncher())


def test_render_plan_holds_the_recurrent_kernel():
    problem = Problem(2, 4, 64, 32)
    base = _variant(problem, 16, 4)
    sources = render(base, problem).sources
    assert "recurrent.metal" in sources and "bwd_qk.metal" in sources
    assert "[[kernel]]" not in sources["recurrent.metal"]  # a body: MLX adds the signature
    # recurrent_below changes no source; the chunk size does not reach the recurrent kernel
    for other in ({"recurrent_below": 0}, {"recurrent_below": 1000}):
        assert render(Variant("metal", dict(base.as_dict(), **other)), problem).sources == sources
    chunk = 32 if base["chunk_size"] != 32 else 16
    other = Variant("metal", dict(base.as_dict(), chunk_size=chunk))
    assert render(other, problem).sources["recurrent.metal"] == sources["recurrent.metal"]
    vector = render(base, Problem(2, 4, 64, 32, gate="vector")).sources
    assert set(vector) == {"common.metal", "recurrent.metal",
                           *(f"{name}.metal" for name in metal.CHANNEL_KERNELS)}
    assert vector["recurrent.metal"] != sources["recurrent.metal"]
    assert "ap[j]" in vector["recurrent.metal"] and "ap[j]" not in sources["recurrent.metal"]


def _entry_inputs(rng, B, T, Hk, Hv, Dk, Dv, per_channel):
    x = _inputs(rng, B, T, Hk, Hv, Dk, Dv, per_channel, gate="log")
    mask = np.ones((B, T), bool)
    mask[0, :3] = False  # left padding
    mask[-1, T - 2] = False
    x["mask"] = mask
    x["dy"] = rng.standard_normal((B, T, Hv, Dv)).astype(np.float32)
    x["dfinal_state"] = rng.standard_normal((B, Hv, Dv, Dk)).astype(np.float32)
    return x


def _entry_vjp(x, variant, scale):
    from gdngen.mlx import gated_delta

    mask = mx.array(x["mask"])

    def f(q, k, v, g, beta, s0):
        return gated_delta(q, k, v, g, beta, s0, mask=mask, scale=scale, gate="log",
                           variant=variant)

    primals = [mx.array(x[n]) for n in ("q", "k", "v", "g", "beta", "initial_state")]
    (y, S), grads = mx.vjp(f, primals, [mx.array(x["dy"]), mx.array(x["dfinal_state"])])
    return np.array(y), np.array(S), [np.array(g) for g in grads]


def _reference(x, scale):
    return reference.vjp(x["q"], x["k"], x["v"], x["g"], x["beta"], x["initial_state"], x["dy"],
                         x["dfinal_state"], mask=x["mask"], scale=scale, gate="log")


GRADS = ("dq", "dk", "dv", "dg", "dbeta", "dinitial_state")


def test_entry_short_call_takes_the_recurrent_kernel_with_the_chunk_vjp():
    """T < recurrent_below: the forward is the recurrent kernel's (equal to the reference), the
    gradients those of the chunk path (the same variant with recurrent_below=0)."""
    B, T, Hk, Hv, Dk, Dv = 2, 11, 1, 3, 32, 64
    x = _entry_inputs(np.random.default_rng(7), B, T, Hk, Hv, Dk, Dv, False)
    scale = Dk ** -0.5
    base = _variant(Problem(Hk, Hv, Dk, Dv), 32, 4, chunk_size=16)
    launcher = metal.default_launcher()
    launcher.threadgroup_bytes.clear()
    y, S, grads = _entry_vjp(x, Variant("metal", dict(base.as_dict(), recurrent_below=1000)),
                             scale)
    assert "recurrent" in launcher.threadgroup_bytes  # the forward ran the recurrent kernel
    launcher.threadgroup_bytes.clear()
    y0, S0, grads0 = _entry_vjp(x, Variant("metal", dict(base.as_dict(), recurrent_below=0)),
                                scale)
    assert "recurrent" not in launcher.threadgroup_bytes
    ref = _reference(x, scale)
    assert np.all(y[~x["mask"]] == 0.0)
    for got, want in ((y, ref["y"]), (S, ref["final_state"]), (y0, ref["y"]),
                      (S0, ref["final_state"])):
        assert relative_error(got, want) <= TOL
    for name, g, g0 in zip(GRADS, grads, grads0):
        np.testing.assert_allclose(g, g0, rtol=1e-5, atol=1e-6, err_msg=name)
        assert relative_error(g, ref[name]) <= TOL, name


def test_entry_vector_gate_switches_like_scalar_gates():
    """Per-channel gates, T < recurrent_below: the recurrent kernel's forward, the VJP of the
    chunk path (`gdngen.algebra.chunkwise_channel` on the walk kernels); T >= recurrent_below: the
    chunk path forward and backward. Same gradients, both equal to the reference."""
    B, T, Hk, Hv, Dk, Dv = 1, 9, 2, 6, 32, 32
    x = _entry_inputs(np.random.default_rng(8), B, T, Hk, Hv, Dk, Dv, True)
    scale = Dk ** -0.5
    problem = Problem(Hk, Hv, Dk, Dv, gate="vector")
    base = _variant(problem, 16, 4, chunk_size=16).as_dict()
    launcher = metal.default_launcher()
    launcher.threadgroup_bytes.clear()
    y, S, grads = _entry_vjp(x, Variant("metal", dict(base, recurrent_below=1000)), scale)
    assert set(launcher.threadgroup_bytes) == {"recurrent", *metal.CHANNEL_KERNELS}
    launcher.threadgroup_bytes.clear()
    y0, S0, grads0 = _entry_vjp(x, Variant("metal", dict(base, recurrent_below=0)), scale)
    assert set(launcher.threadgroup_bytes) == set(metal.CHANNEL_KERNELS)
    ref = _reference(x, scale)
    for got, want in ((y, ref["y"]), (S, ref["final_state"]), (y0, ref["y"]),
                      (S0, ref["final_state"])):
        assert relative_error(got, want) <= TOL
    for name, g, g0 in zip(GRADS, grads, grads0):
        np.testing.assert_allclose(g, g0, rtol=1e-5, atol=1e-6, err_msg=name)
        assert relative_error(g, ref[name]) <= TOL, name


@pytest.mark.metal
@pytest.mark.skipif(not mx.metal.is_available(), reason="needs an Apple GPU (MLX Metal backend)")
@pytest.mark.parametrize("per_channel", (False, True))
def test_gpu_matches_simulator(per_channel):
    B, T, Hk, Hv, Dk, Dv = 2, 37, 2, 6, 64, 32
    x = _inputs(np.random.default_rng(9), B, T, Hk, Hv, Dk, Dv, per_channel)
    args = [mx.array(x[n]) for n in ("q", "k", "v", "g", "beta", "initial_state")]
    variant = _variant(Problem(Hk, Hv, Dk, Dv), 32, 4)
    results = [metal.recurrent_forward(*args, scale=0.125, variant=variant, launcher=launcher)
               for launcher in (metal.MLXLauncher(), metal.SimLauncher())]
    for gpu, sim in zip(*results):
        np.testing.assert_allclose(np.array(gpu), np.array(sim), rtol=1e-5, atol=1e-6)
