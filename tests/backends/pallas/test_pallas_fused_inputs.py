"""The fused layer inputs of pallas_tpu and pallas_gpu (`gdngen.backends.kernel_inputs`): the
recurrent kernel and the scalar chunk forward kernels rendered to take raw q, k (normalised per
loaded row) and the raw gate projection ``a`` with ``A_log``, ``dt_bias`` (and a runtime
``lower_bound``), computing the log gate in their loads (`render_fused`).

Against a float64 chain rule on `gdngen.algebra.reference.vjp`: the value of a short call (the fused
recurrent kernel), and the value and every raw input's gradient of a differentiated call (the
chunk path: the fused chunk forward, then the plain backward on recomputed inputs), for qk_norm
alone, softplus and sigmoid_bound per head and softplus per channel (mlx-lm's Kimi shapes),
GVA, a mask row, T padded to whole chunks. Spies show that the forward of a fused call computes
neither the norm nor the log gate as array ops; the default render is unchanged (tuned entries
keep their sha256); projections from -80 to 80 and +-inf go through the fused recurrent kernel
exactly; the fused kernels lower for Mosaic and for Triton (no device needed).

Off-device everything runs in interpret mode (TPU interpret mode's buffers start NaN-filled;
the GPU interpreter's outputs start NaN), so an unwritten output fails the comparisons.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")

from slow import marked
from spies import spy_calls

import gdngen.jax as gjax
from gdngen import Problem, Variant, default_variant, settings, sources
from gdngen.algebra import layer_inputs, reference
from gdngen.backends.kernel_inputs import KernelInputs
from gdngen.backends.pallas import gpu as pallas_gpu
from gdngen.backends.pallas import tpu as pallas_tpu
from gdngen.validate import relative_error

BACKENDS = {"pallas_tpu": pallas_tpu, "pallas_gpu": pallas_gpu}
#: chunk 32 on the TPU (its smallest), 16 on the GPU: T = 40 pads to whole chunks either way
CHUNK = {"pallas_tpu": 32, "pallas_gpu": 16}
B, T, Hk, Hv, Dk, Dv = 2, 40, 1, 2, 16, 32  # GVA: two value heads read the key head
SCALE = Dk ** -0.5
EPS = 1e-6  # the qk norm's (gdngen.algebra.layer_inputs.QK_NORM_EPS)
RTOL = 5e-5  # y, final state and every gradient, float32
GRAD_NAMES = ("q", "k", "v", "a", "beta", "A_log", "dt_bias")
SETUPS = ("qk_norm_only", "softplus_per_head", "sigmoid_bound_per_head",
          "softplus_per_channel_kimi")


@pytest.fixture(autouse=True)
def _poisoned(monkeypatch):
    monkeypatch.setenv(settings.ENV_POISON_OUTPUTS, "1")


PROBLEM = Problem(Hk, Hv, Dk, Dv)


def _variant(backend, recurrent_below, problem=PROBLEM, **changes):
    params = default_variant(backend, problem).as_dict()
    return Variant(backend, params | {"chunk_size": CHUNK[backend],
                                      "recurrent_below": recurrent_below} | changes)


# --------------------------------------------------------------------------- float64 reference


def _sigmoid(x):
    e = np.exp(-np.abs(x))
    return np.where(x >= 0, 1.0 / (1.0 + e), e / (1.0 + e))


def _log_gate(a, A_log, dt_bias, lower_bound):
    """float64 log gate of the raw projection (a = -inf: 0), and d log g / d(a + dt_bias),
    d log g / d A_log."""
    live = a > -np.inf
    x = np.where(live, a + dt_bias, 0.0)
    rate = np.exp(A_log)
    if lower_bound is None:
        log_g = -rate * np.logaddexp(x, 0.0)
        d_x, d_A = -rate * _sigmoid(x), log_g
    else:
        s = _sigmoid(rate * x)
        log_g = lower_bound * s
        d_x = lower_bound * s * _sigmoid(-rate * x) * rate
        d_A = d_x * x
    return tuple(np.where(live, t, 0.0) for t in (log_g, d_x, d_A))


def _sum_to(x, shape):
    """A gate-shaped [B, T, Hv(, Dk)] gradient summed down to a parameter's ``shape``."""
    per_head = x.sum(axis=(0, 1))
    return per_head if per_head.shape == shape else per_head.sum(-1).reshape(shape)


def _reference(x, options, mask, dy, ds):
    """float64 y, final state and the gradient of every raw input in ``x`` of the loss
    ``<y, dy> + <S_T, ds>``."""
    qn, kn = x["q"], x["k"]
    if options.get("qk_norm"):
        norms = {n: np.sqrt((x[n] ** 2).sum(-1, keepdims=True) + EPS) for n in ("q", "k")}
        qn, kn = x["q"] / norms["q"], x["k"] / norms["k"]
    if "A_log" in x:
        vector, heads = x["a"].ndim == 4, x["v"].shape[2]
        A_log, dt_bias = (p.reshape(heads, -1) if vector else p
                          for p in (x["A_log"], x["dt_bias"]))
        log_g, d_x, d_A = _log_gate(x["a"], A_log, dt_bias, options.get("lower_bound"))
    else:
        log_g = x["a"]
    out = reference.vjp(qn, kn, x["v"], log_g, x["beta"], None, dy, ds, mask=mask,
                        scale=SCALE)
    grads = {"v": out["dv"], "beta": out["dbeta"], "q": out["dq"], "k": out["dk"]}
    if options.get("qk_norm"):
        for n, xn in (("q", qn), ("k", kn)):  # through the norm: (d - n (n . d)) / |x|
            d = out[f"d{n}"]
            grads[n] = (d - xn * (xn * d).sum(-1, keepdims=True)) / norms[n]
    if "A_log" in x:
        grads["a"] = out["dg"] * d_x
        grads["A_log"] = _sum_to(out["dg"] * d_A, x["A_log"].shape)
        grads["dt_bias"] = _sum_to(grads["a"], x["dt_bias"].shape)
    else:
        grads["a"] = out["dg"]
    return out["y"], out["final_state"], grads


def _setup(name, seed=0):
    """Raw float64 inputs (``a`` the gate: log gates for qk_norm_only), the call's options
    and a mask with a masked run and a masked last step in its second row."""
    rng = np.random.default_rng(seed)
    vector = name.endswith("per_channel_kimi")
    x = {"q": rng.standard_normal((B, T, Hk, Dk)) * 2.0,  # not unit norm: the norm matters
         "k": rng.standard_normal((B, T, Hk, Dk)) * 0.5,
         "v": rng.standard_normal((B, T, Hv, Dv)),
         "beta": rng.uniform(0.1, 0.9, (B, T, Hv))}
    options = {"qk_norm": True}
    if name == "qk_norm_only":
        x["a"] = -rng.uniform(0.01, 1.0, (B, T, Hv))
    else:
        x["a"] = rng.standard_normal((B, T, Hv) + ((Dk,) if vector else ()))
        x["A_log"] = rng.uniform(-1.0, 1.0, (Hv, 1) if vector else (Hv,))
        x["dt_bias"] = rng.uniform(-0.5, 0.5, (Hv, Dk) if vector else (Hv,))
        options["gate"] = "sigmoid_bound" if name.startswith("sigmoid_bound") else "softplus"
        if options["gate"] == "sigmoid_bound":
            options["lower_bound"] = -5.0
    mask = np.ones((B, T), bool)
    mask[1, 5:9] = False
    mask[1, -1] = False
    return x, options, mask


def _call(x, options, mask, variant):
    """`gdngen.jax.gated_delta` on float32 arrays ``x`` (a dict by name)."""
    parameters = {n: x[n] for n in ("A_log", "dt_bias") if n in x}
    return gjax.gated_delta(x["q"], x["k"], x["v"], x["a"], x["beta"], mask=jnp.asarray(mask),
                            scale=SCALE, variant=variant, **options, **parameters)


def _errors_of_both_paths(x, options, mask, variant, seed=11, dtype=jnp.float32):
    """Relative errors against float64 of a call of ``variant`` (its ``recurrent_below``
    above T): the value of a short call (the fused recurrent kernel), then under ``jax.vjp``
    the chunk path's value and every raw input's gradient (the fused chunk forward, the plain
    backward on recomputed inputs). q, k, v in ``dtype``."""
    rng = np.random.default_rng(seed)
    dy, ds = rng.standard_normal(x["v"].shape), rng.standard_normal(
        (x["v"].shape[0],) + x["v"].shape[2:] + (x["q"].shape[-1],))
    y_ref, s_ref, grads_ref = _reference(x, options, mask, dy, ds)
    names = [n for n in GRAD_NAMES if n in x]
    arrays = {n: jnp.asarray(x[n], dtype if n in ("q", "k", "v") else jnp.float32) for n in names}

    y, state = _call(arrays, options, mask, variant)
    errors = {"recurrent y": relative_error(y, y_ref),
              "recurrent final_state": relative_error(state, s_ref)}
    assert not np.asarray(y)[~mask].any()  # masked steps give exact zeros

    def f(*xs):
        return _call(dict(zip(names, xs)), options, mask, variant)

    (y, state), vjp = jax.vjp(f, *(arrays[n] for n in names))
    grads = vjp((jnp.asarray(dy, dtype), jnp.asarray(ds, jnp.float32)))
    errors |= {"chunk y": relative_error(y, y_ref),
               "chunk final_state": relative_error(state, s_ref)}
    errors |= {f"d{n}": relative_error(g, grads_ref[n]) for n, g in zip(names, grads)}
    assert all(math.isfinite(e) for e in errors.values()), errors
    return errors


# --------------------------------------------------------------------------- tests


# pallas_tpu's per-channel case in make test-all (~45 s: XLA compiles the per-channel chunk
# path, the portable core that computes the norm and the gate, with the kernels' chunk walks):
# its one fused per-channel kernel, the recurrent one, is checked against float64 by
# test_extreme_projections_through_the_fused_recurrent_kernel[pallas_tpu] (per channel, both
# gate forms), and [pallas_gpu-softplus_per_channel_kimi] keeps the fused core under the
# Pallas chunk walks
@pytest.mark.parametrize(("backend", "name"), marked(
    [(backend, name) for backend in sorted(BACKENDS) for name in SETUPS],
    {("pallas_tpu", "softplus_per_channel_kimi")}))
def test_fused_values_and_gradients_against_float64(backend, name):
    """Both paths of a fused call (`_errors_of_both_paths`) within 5e-5 of float64."""
    x, options, mask = _setup(name, seed=SETUPS.index(name))
    errors = _errors_of_both_paths(x, options, mask, _variant(backend, recurrent_below=T + 1))
    print(f"{backend} {name}: " + ", ".join(f"{n} {e:.1e}" for n, e in errors.items()))
    worst = max(errors.items(), key=lambda item: item[1])
    assert worst[1] <= RTOL, (backend, name, worst)


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_fused_forward_computes_no_layer_inputs_as_array_ops(backend, monkeypatch):
    """A forward-only call with qk_norm and a parameterised gate, on the recurrent path and on
    the scalar chunk path, loads the fused build and calls neither `layer_inputs.l2_normalize`
    nor `layer_inputs.ParameterGate.log_gates`; the backward of the chunk path does (it
    recomputes both for the plain backward kernels), so the spies do see them there."""
    module = BACKENDS[backend]
    x, options, mask = _setup("sigmoid_bound_per_head", seed=7)
    arrays = {n: jnp.asarray(v, jnp.float32) for n, v in x.items()}
    norms = spy_calls(monkeypatch, layer_inputs, ["l2_normalize"])
    gates = spy_calls(monkeypatch, layer_inputs.ParameterGate, ["log_gates"])
    loads = spy_calls(monkeypatch, type(module.SPEC), ["load_fused_kernels"])
    for recurrent_below in (T + 1, 0):  # the recurrent kernel, the chunk kernels
        variant = _variant(backend, recurrent_below)
        y, _ = _call(arrays, options, mask, variant)
        assert np.isfinite(np.asarray(y)).all()
        assert norms == [] and gates == [], (recurrent_below, norms, gates)
        assert loads, recurrent_below
        loads.clear()

    names = sorted(arrays)
    _, vjp = jax.vjp(lambda *xs: _call(dict(zip(names, xs)), options, mask, variant)[0],
                     *(arrays[n] for n in names))
    vjp(jnp.ones((B, T, Hv, Dv), jnp.float32))
    assert norms and gates  # the backward's recomputation


#: default-variant sha256 of the plain renders before the fused builds existed (re-recorded
#: when issue 45 corrected the templates' comments; the per-channel ones when issue 37 added
#: the intra-chunk kernel to their forward template, and pallas_gpu's again when its
#: per-channel kernels looped over the tiles with bk <= 32, both again when their reverse
#: walks formed G = Pm^T dY and the decayed keys, no Pallas entry being shipped in tuned/):
#: they must not change (tuned entries are keyed on them)
DEFAULT_SHA256 = {
    ("pallas_tpu", Problem(16, 32, 128, 128)):
        "0f4526253a1e3641673f8293cf65e387ceef49242228b0b30ef24af835ebc993",
    ("pallas_tpu", Problem(32, 32, 128, 128, gate="vector")):
        "d59293463b308a7788d7198f8cde61878041605d5b22b65335603b0da4057f22",
    ("pallas_tpu", Problem(1, 3, 128, 128, "bfloat16")):
        "ec1e92b5a51e2634e4f7adb79f4326fa1c71770c1de6354e30e14746e748becd",
    ("pallas_gpu", Problem(16, 32, 128, 128)):
        "0983b0787384746f7795f9b7ae45f071252f902407c072d6aab5813aeb0d0286",
    ("pallas_gpu", Problem(32, 32, 128, 128, gate="vector")):
        "36b2be45cff60b2f0ba1920e99a81020974b20e4a77bcf1358a809db40ec1cfb",
    ("pallas_gpu", Problem(1, 3, 128, 128, "bfloat16")):
        "23dac634b8c82754a3b7ba40ea913d0e6ab450b09d49fb2558769b358ceb12b3",
}


def test_default_render_is_unchanged_and_fused_builds_differ():
    """The plain render plan (nothing fused) renders byte for byte as before; each fused build
    has its own sources, one per rendering context whatever the runtime lower_bound."""
    for (backend, problem), sha in DEFAULT_SHA256.items():
        module, variant = BACKENDS[backend], default_variant(backend, problem)
        assert sources.render_spec(module.SPEC, variant, problem).sha256 == sha, (backend,
                                                                                 problem)
        builds = {inputs.tag(): module.render_fused(variant, problem, inputs) for inputs in (
            KernelInputs(True), KernelInputs(False, "softplus"),
            KernelInputs(True, "sigmoid_bound", -5.0))}
        assert len({r.sha256 for r in builds.values()} | {sha}) == 4
        names = {"recurrent_qknorm.py"} | ({"forward_qknorm.py"} if problem.gate == "scalar"
                                           else set())
        assert set(builds["_qknorm"].sources) == names
        other_bound = module.render_fused(variant, problem,
                                          KernelInputs(True, "sigmoid_bound", -0.5))
        assert other_bound.sha256 == builds["_qknorm_sigmoid_bound"].sha256
    with pytest.raises(ValueError, match="inputs must fuse"):
        pallas_tpu.render_fused(variant, problem, KernelInputs())


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_extreme_projections_through_the_fused_recurrent_kernel(backend):
    """a from -80 to 80 and +-inf (a = -inf an identity step, a = +inf a reset under softplus),
    per head and per channel, both gate forms: the fused recurrent kernel's y and final state
    against float64, finite; the decay is produced in log space, so no overflow and no
    inf * 0 NaN."""
    module = BACKENDS[backend]
    rng = np.random.default_rng(5)
    levels = np.array([-80.0, -50.0, -20.0, -1.0, 0.0, 1.0, 20.0, 50.0, 80.0, -np.inf,
                       np.inf, -np.inf])
    Te = len(levels)
    q, k = (rng.standard_normal((1, Te, Hk, Dk)) for _ in range(2))
    v = rng.standard_normal((1, Te, Hv, Dv))
    beta = rng.uniform(0.2, 0.9, (1, Te, Hv))
    beta[0, levels == -np.inf] = 0.0  # an identity step, as a folded mask makes it
    s0 = rng.standard_normal((1, Hv, Dv, Dk))
    A_log, dt_bias = np.array([1.5, -0.5]), np.array([0.25, -0.5])
    for vector in (False, True):
        problem = Problem(Hk, Hv, Dk, Dv, gate="vector" if vector else "scalar")
        a = np.broadcast_to(levels[None, :, None], (1, Te, Hv))
        params = (A_log, dt_bias)
        if vector:  # per channel: a shifted per key channel, dt_bias [Hv, Dk]
            a = a[..., None] + np.linspace(-1.0, 1.0, Dk)
            params = (A_log[:, None], dt_bias[:, None] + np.zeros(Dk))
        for lower_bound in (None, -5.0):
            inputs = KernelInputs.of(True, layer_inputs.ParameterGate(lower_bound))
            log_g = _log_gate(a, *(p.reshape(Hv, -1) if vector else p for p in params),
                              lower_bound)[0]
            norm = [x / np.sqrt((x ** 2).sum(-1, keepdims=True) + EPS) for x in (q, k)]
            y_ref, s_ref = reference.forward(*norm, v, log_g, beta, s0, scale=SCALE)
            f32 = [jnp.asarray(z, jnp.float32) for z in (q, k, v, a, *params, beta, s0)]
            y, state = module.recurrent_forward(
                f32[0], f32[1], f32[2], tuple(f32[3:6]), f32[6], f32[7], scale=SCALE,
                variant=_variant(backend, 1000, problem), problem=problem, inputs=inputs)
            assert np.isfinite(np.asarray(y)).all() and np.isfinite(np.asarray(state)).all()
            errors = relative_error(y, y_ref), relative_error(state, s_ref)
            assert max(errors) <= RTOL, (vector, lower_bound, errors)


def test_fused_recurrent_forward_rejects_a_bare_decay():
    x, _, _ = _setup("softplus_per_head")
    f32 = {n: jnp.asarray(v, jnp.float32) for n, v in x.items()}
    with pytest.raises(ValueError, match=r"decay must be the tuple \(a, A_log, dt_bias\)"):
        pallas_tpu.recurrent_forward(
            f32["q"], f32["k"], f32["v"], f32["a"], f32["beta"], jnp.zeros((B, Hv, Dv, Dk)),
            scale=SCALE, variant=_variant("pallas_tpu", 1000),
            inputs=KernelInputs(False, "softplus"))


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_fused_kernels_lower_without_a_device(backend):
    """Every fused build (qk norm, each gate form, per head and per channel; several Dv tiles
    and head tiles on the TPU, several DK / DV tiles on the GPU) lowers through Mosaic / the
    Pallas Triton lowering: only ops those lower (exp, log1p, abs, maximum, where, rsqrt,
    sums) and legal block shapes."""
    module = BACKENDS[backend]
    if backend == "pallas_tpu":
        cases = [(Problem(2, 6, 32, 48), {}),
                 (Problem(1, 4, 128, 256), {"dv_tile": 128, "head_tile": 2}),
                 (Problem(1, 2, 128, 256, gate="vector"), {"dv_tile": 128})]
    else:  # Dk = 40, Dv = 24: padded to 48 and 32, three and two 16-wide tiles
        cases = [(Problem(2, 6, 40, 24), {"bk": 16, "bv": 16}),
                 (Problem(1, 2, 64, 64, gate="vector"), {"bk": 32, "bv": 32})]
    for problem, changes in cases:
        variant = _variant(backend, 64, Problem(2, 6, 32, 32, gate=problem.gate), **changes)
        for inputs in (KernelInputs(True), KernelInputs(True, "softplus"),
                       KernelInputs(False, "sigmoid_bound", -5.0)):
            lowered = module.lower_check(variant, problem, inputs=inputs)
            want = {"recurrent"} | ({"forward"} if problem.gate == "scalar" else set())
            assert want <= set(lowered), (problem, inputs)


# --------------------------------------------------------------------------- slow sweeps


SWEEP = {
    "pallas_tpu": [{"save_states": False}, {"head_tile": 2}, {"dv_tile": 128},
                   {"chunk_size": 64, "precision": "tf32"}],
    "pallas_gpu": [{"save_states": False}, {"bk": 16, "bv": 16},
                   {"chunk_size": 32, "precision": "tf32"}],
}


@pytest.mark.slow
@pytest.mark.parametrize("backend, changes", [(b, c) for b in sorted(SWEEP) for c in SWEEP[b]],
                         ids=lambda x: x if isinstance(x, str) else "-".join(
                             f"{k}={v}" for k, v in x.items()))
def test_fused_sweep_over_variants(backend, changes):
    """Other variants of the fused builds (recomputed states, head and Dv tiles, chunk sizes,
    the tf32 policy at its tolerance) on a GVA call with Hv = 4 heads and Dv = 256 (two Dv tiles
    where the variant splits it): the fused recurrent kernel's value, then the chunk path's
    value and gradients against float64, both gate forms and the qk norm alone."""
    from gdngen.tolerance import allowed_error

    Hk4, Hv4, Dv4 = 2, 4, 256
    problem = Problem(Hk4, Hv4, Dk, Dv4)
    variant = _variant(backend, T + 1, problem, **changes)
    rtol = max(RTOL, allowed_error(variant.replace(recurrent_below=0), "float32"))
    rng = np.random.default_rng(3)
    x = {"q": rng.standard_normal((1, T, Hk4, Dk)), "k": rng.standard_normal((1, T, Hk4, Dk)),
         "v": rng.standard_normal((1, T, Hv4, Dv4)), "beta": rng.uniform(0.1, 0.9, (1, T, Hv4)),
         "a": rng.standard_normal((1, T, Hv4)), "A_log": rng.uniform(-1, 1, Hv4),
         "dt_bias": rng.uniform(-0.5, 0.5, Hv4)}
    mask = np.ones((1, T), bool)
    mask[0, 3] = False
    for options in ({"qk_norm": True, "gate": "softplus"},
                    {"qk_norm": False, "gate": "sigmoid_bound", "lower_bound": -2.0},
                    {"qk_norm": True}):
        xs = dict(x)
        if "gate" not in options:  # log gates
            xs = {n: v for n, v in x.items() if n not in ("A_log", "dt_bias")}
            xs["a"] = -np.abs(x["a"])
        if not options["qk_norm"]:  # unit-norm keys, as a call without the norm takes them
            xs["k"] = xs["k"] / np.linalg.norm(xs["k"], axis=-1, keepdims=True)
        errors = _errors_of_both_paths(xs, options, mask, variant)
        worst = max(errors.items(), key=lambda item: item[1])
        assert worst[1] <= rtol, (backend, changes, options, worst)


@pytest.mark.slow
@pytest.mark.parametrize("backend", sorted(BACKENDS))
@pytest.mark.parametrize("name", ["softplus_per_head", "sigmoid_bound_per_head"])
def test_fused_low_precision_inputs(backend, name):
    """bfloat16 q, k, v: the fused chunk forward normalises in float32 and rounds to bfloat16
    as the backward's recomputation does; both paths within the bfloat16 tolerance."""
    from gdngen.tolerance import dtype_tolerance

    x, options, mask = _setup(name, seed=9)
    errors = _errors_of_both_paths(x, options, mask, _variant(backend, T + 1),
                                   dtype=jnp.bfloat16)
    worst = max(errors.items(), key=lambda item: item[1])
    assert worst[1] <= dtype_tolerance("bfloat16"), (backend, name, worst)
