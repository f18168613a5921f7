"""Layer inputs computed in the Metal kernels' own loads (`gdngen.backends.kernel_inputs`,
`gdngen.backends.metal.render_fused`): ``qk_norm`` (raw q, k normalised per loaded row) and a
parameterised gate (``a``, ``A_log``, ``dt_bias``: the log gate formed in the kernel), in
`gdngen.backends.metal.sim`.

Values and gradients through the public entry (`gdngen.mlx.gated_delta` with a metal variant)
against a float64 reference (`gdngen.algebra.reference` composed with the transform and its chain
rule, masked steps folded as the backends fold them), on the recurrent path (T < recurrent_below:
the fused recurrent kernel's forward, the chunk path's VJP) and the chunk path; a spy shows the
fused forward forms neither a normalised q, k nor a log gate as arrays; the plain build renders
byte for byte as before the fused blocks existed.
"""

from __future__ import annotations

import numpy as np
import pytest
from spies import spy_calls

from gdngen import Problem, Variant, registry, sources
from gdngen.algebra import layer_inputs, recurrent, reference
from gdngen.backends import metal
from gdngen.backends.kernel_inputs import QK_NORM_EPS, KernelInputs
from gdngen.backends.metal import launch as metal_launch
from gdngen.backends.metal import sim as metal_sim
from gdngen.validate import relative_error

mx = pytest.importorskip("mlx.core", reason="the Metal backend runs through MLX")
pytestmark = pytest.mark.skipif(not metal_sim.available(), reason="no C++ compiler (g++)")

RTOL = 5e-5  # y, final state and every gradient, float32
B, Hk, Hv, D = 2, 1, 2, 32  # GVA: two value heads read one key head; Dk = Dv = 32 (simulator)
SCALE = D ** -0.5
CHUNK = 16


# --------------------------------------------------------------------------- float64 reference


def _sigmoid(x):
    e = np.exp(-np.abs(x))
    return np.where(x >= 0, 1.0 / (1.0 + e), e / (1.0 + e))


def _softplus(x):
    return np.logaddexp(x, 0.0)


def _log_gate(a, A_log, dt_bias, lower_bound):
    """float64 log gate of a `layer_inputs.ParameterGate` (parameters broadcast against ``a``),
    0 where ``a`` is -inf."""
    live = np.isfinite(a) | (a > 0)
    x = np.where(live, a + dt_bias, 0.0)
    rate = np.exp(A_log)
    log_g = -rate * _softplus(x) if lower_bound is None else lower_bound * _sigmoid(rate * x)
    return np.where(live, log_g, 0.0), x, rate


def _broadcast_parameter(p, vector):
    return p.reshape(-1, 1) if vector and p.ndim == 1 else p


def _sum_to(x, shape):
    """A gate-shaped ``[B,T,Hv(,Dk)]`` gradient summed down to a parameter's ``shape``."""
    per_head = x.sum(axis=(0, 1))
    return per_head if per_head.shape == shape else per_head.sum(axis=-1).reshape(shape)


def _reference(x, gate, lower_bound, dy, dS):
    """float64 ``(y, final_state, grads)`` of ``<y, dy> + <final_state, dS>`` w.r.t. the raw
    q, k, v, g (the raw projection for a parameterised gate), beta, A_log, dt_bias; masked steps
    are identity steps (log g = 0, beta = 0) with y = 0, as `layer_inputs.fold_mask` folds them."""
    live_t = x["mask"]  # [B, T]
    vector = x["g"].ndim == 4
    live = live_t.reshape(live_t.shape + (1,) * (x["g"].ndim - 2))
    q, k = x["q"], x["k"]
    rq, rk = (np.sqrt((z * z).sum(-1, keepdims=True) + QK_NORM_EPS) for z in (q, k))
    qn, kn = q / rq, k / rk
    if gate == "log":
        log_g = x["g"]
    else:
        A = _broadcast_parameter(x["A_log"], vector)
        dt = _broadcast_parameter(x["dt_bias"], vector)
        log_g, pre, rate = _log_gate(x["g"], A, dt, lower_bound)
    log_g = np.where(live, log_g, 0.0)
    beta = np.where(live_t[..., None], x["beta"], 0.0)
    dy = np.where(live_t[..., None, None], dy, 0.0)  # y is zeroed there
    out = reference.vjp(qn, kn, x["v"], log_g, beta, x["initial_state"], dy, dS, scale=SCALE,
                        gate="log")
    grads = {"v": out["dv"], "beta": np.where(live_t[..., None], out["dbeta"], 0.0),
             "initial_state": out["dinitial_state"]}
    for name, xn, r in (("q", qn, rq), ("k", kn, rk)):  # through the norm's VJP
        d = out[f"d{name}"]
        grads[name] = (d - xn * (xn * d).sum(-1, keepdims=True)) / r
    dlog_g = np.where(live, out["dg"], 0.0)
    if gate == "log":
        grads["g"] = dlog_g
    else:
        if lower_bound is None:  # d/dx = -rate sigmoid(x), d/dA_log = log g
            d_pre, d_A = -rate * _sigmoid(pre) * dlog_g, log_g * dlog_g
        else:  # z = rate x: d/dz = lower_bound sigmoid(z) sigmoid(-z); d/dA_log = d/dz z
            z = rate * pre
            dz = lower_bound * _sigmoid(z) * _sigmoid(-z) * dlog_g
            d_pre, d_A = dz * rate, dz * z
        grads["g"] = d_pre
        grads["A_log"] = _sum_to(d_A, x["A_log"].shape)
        grads["dt_bias"] = _sum_to(d_pre, x["dt_bias"].shape)
    y = np.where(live_t[..., None, None], out["y"], 0.0)
    return y, out["final_state"], grads


# --------------------------------------------------------------------------- setups


# name -> (gate, lower_bound, vector, A_log shape, dt_bias shape)
SETUPS = {
    "qk_norm_only": ("log", None, False, None, None),
    "softplus_per_head": ("softplus", None, False, (Hv,), (Hv,)),
    "sigmoid_bound_per_head": ("sigmoid_bound", -5.0, False, (Hv,), (Hv,)),
    # mlx-lm's Kimi Linear / Bailing V3 shapes
    "softplus_per_channel": ("softplus", None, True, (Hv, 1), (Hv, D)),
}


def _inputs(name, T, seed=0):
    gate, _, vector, A_shape, dt_shape = SETUPS[name]
    rng = np.random.default_rng(seed)
    gate_shape = (B, T, Hv) + ((D,) if vector else ())
    x = {"q": rng.standard_normal((B, T, Hk, D)) * 2.0,  # not unit norm: the norm matters
         "k": rng.standard_normal((B, T, Hk, D)) * 0.5,
         "v": rng.standard_normal((B, T, Hv, D)),
         "beta": rng.uniform(0.1, 1.0, (B, T, Hv)),
         "initial_state": 0.5 * rng.standard_normal((B, Hv, D, D))}
    if gate == "log":
        x["g"] = -rng.uniform(0.01, 1.0, gate_shape)
    else:
        x["g"] = rng.standard_normal(gate_shape)
        x["A_log"] = rng.uniform(-1.0, 1.0, A_shape)
        x["dt_bias"] = rng.uniform(-0.5, 0.5, dt_shape)
    mask = np.ones((B, T), bool)
    mask[0, min(3, T - 1)] = False  # a masked row (batch 0, step 3) and a left-padded row
    mask[1, :min(2, T - 1)] = False
    x["mask"] = mask
    return x


def _variant(vector, recurrent_below, **params):
    problem = Problem(Hk, Hv, D, D, gate="vector" if vector else "scalar")
    defaults = registry.default_variant("metal", problem).as_dict()
    return Variant("metal", {**defaults, "chunk_size": CHUNK, "dv_tile": 16, "simdgroups": 2,
                             "recurrent_below": recurrent_below, **params})


def _call(name, arrays, variant):
    from gdngen.mlx import gated_delta

    gate, lower_bound, *_ = SETUPS[name]
    options = {"qk_norm": True, "gate": gate}
    if gate != "log":
        options.update(A_log=arrays["A_log"], dt_bias=arrays["dt_bias"])
    if lower_bound is not None:
        options["lower_bound"] = lower_bound
    return gated_delta(arrays["q"], arrays["k"], arrays["v"], arrays["g"], arrays["beta"],
                       arrays["initial_state"], mask=arrays["mask"], scale=SCALE,
                       variant=variant, **options)


def _values_and_grads(name, x, variant, dy, dS):
    names = [n for n in ("q", "k", "v", "g", "beta", "initial_state", "A_log", "dt_bias")
             if n in x]
    arrays = {n: mx.array(x[n].astype(np.float32)) for n in names}
    arrays["mask"] = mx.array(x["mask"])
    dy_m, dS_m = mx.array(dy.astype(np.float32)), mx.array(dS.astype(np.float32))

    def loss(*args):
        y, state = _call(name, {**arrays, **dict(zip(names, args))}, variant)
        return (y * dy_m).sum() + (state * dS_m).sum()

    y, state = _call(name, arrays, variant)
    grads = mx.grad(loss, argnums=list(range(len(names))))(*(arrays[n] for n in names))
    return np.array(y), np.array(state), {n: np.array(g) for n, g in zip(names, grads)}


def _check_against_reference(name, path, T, seed=0, **params):
    x = _inputs(name, T, seed)
    rng = np.random.default_rng(seed + 100)
    dy, dS = rng.standard_normal((B, T, Hv, D)), rng.standard_normal((B, Hv, D, D))
    gate, lower_bound, vector, *_ = SETUPS[name]
    variant = _variant(vector, T + 1 if path == "recurrent" else 0, **params)
    launcher = metal.default_launcher()
    launcher.threadgroup_bytes.clear()
    y, state, grads = _values_and_grads(name, x, variant, dy, dS)
    ran = set(launcher.threadgroup_bytes)
    assert ("recurrent" in ran) == (path == "recurrent"), ran
    y_ref, state_ref, grads_ref = _reference(x, gate, lower_bound, dy, dS)
    assert np.all(y[~x["mask"]] == 0.0)
    errors = {"y": relative_error(y, y_ref), "final_state": relative_error(state, state_ref)}
    assert set(grads) == set(grads_ref)
    errors.update({f"d{n}": relative_error(grads[n], grads_ref[n]) for n in grads})
    worst = max(errors.items(), key=lambda item: item[1])
    print(f"{name} {path}: " + ", ".join(f"{n} {e:.1e}" for n, e in errors.items()))
    assert worst[1] <= RTOL, (name, path, worst)


# --------------------------------------------------------------------------- tests


@pytest.mark.parametrize("path", ["recurrent", "chunkwise"])
@pytest.mark.parametrize("name", sorted(SETUPS))
def test_fused_inputs_match_float64(name, path):
    """qk_norm with the log gate, softplus and sigmoid_bound per head, softplus per channel
    (A_log [Hv, 1], dt_bias [Hv, Dk]); GVA, a masked row and a left-padded batch row; T = 9 on
    the recurrent path, T = 20 (two chunks, a padded tail) on the chunk path."""
    _check_against_reference(name, path, 9 if path == "recurrent" else 20)


@pytest.mark.parametrize("params", [{"save_states": False}, {"mma": "fma", "simdgroups": 1},
                                    {"precision": "tf32", "chunk_size": 32}],
                         ids=["no_saved_states", "fma", "tf32_chunk32"])
def test_fused_chunk_forward_variants(params):
    """The fused chunk forward of other variants: without saved states (fwd_intra and fwd_scan
    fused; the backward recomputes with the plain fwd_intra_tinv / fwd_scan_states), scalar FMA
    matmuls, tf32 operands (its own tolerance: the fused loads add nothing to it)."""
    if params.get("precision") == "tf32":
        x = _inputs("sigmoid_bound_per_head", 40, seed=3)
        variant = _variant(False, 0, **params)
        arrays = {n: mx.array(v.astype(np.float32)) for n, v in x.items() if n != "mask"}
        arrays["mask"] = mx.array(x["mask"])
        y, state = _call("sigmoid_bound_per_head", arrays, variant)
        y_ref, state_ref, _ = _reference(x, "sigmoid_bound", -5.0, np.zeros((B, 40, Hv, D)),
                                         np.zeros((B, Hv, D, D)))
        assert relative_error(np.array(y), y_ref) <= metal.POLICY_TOLERANCES["tf32"]
        assert relative_error(np.array(state), state_ref) <= metal.POLICY_TOLERANCES["tf32"]
        return
    _check_against_reference("sigmoid_bound_per_head", "chunkwise", 20, seed=1, **params)
    _check_against_reference("qk_norm_only", "chunkwise", 20, seed=2, **params)


@pytest.mark.parametrize("path", ["recurrent", "chunkwise"])
def test_fused_inputs_in_bfloat16(path):
    """bfloat16 q, k, v: the kernels read the raw 16-bit rows and normalise them in float32; y
    (in q's dtype) and the state within the bfloat16 tolerance of float64 (the inputs' own
    rounding dominates: measured 3.1e-3)."""
    from gdngen.tolerance import allowed_error

    name, T = "sigmoid_bound_per_head", 20
    x = _inputs(name, T, seed=4)
    arrays = {n: mx.array(v.astype(np.float32)) for n, v in x.items() if n != "mask"}
    for n in ("q", "k", "v"):
        arrays[n] = arrays[n].astype(mx.bfloat16)
    arrays["mask"] = mx.array(x["mask"])
    variant = _variant(False, T + 1 if path == "recurrent" else 0)
    y, state = _call(name, arrays, variant)
    assert y.dtype == mx.bfloat16 and state.dtype == mx.float32
    y_ref, state_ref, _ = _reference(x, "sigmoid_bound", -5.0, np.zeros((B, T, Hv, D)),
                                     np.zeros((B, Hv, D, D)))
    limit = allowed_error(variant, "bfloat16")
    assert relative_error(np.array(y.astype(mx.float32)), y_ref) <= limit
    assert relative_error(np.array(state), state_ref) <= limit


@pytest.mark.metal
@pytest.mark.skipif(not mx.metal.is_available(), reason="needs an Apple GPU (MLX Metal backend)")
@pytest.mark.parametrize("path", ["recurrent", "chunkwise"])
@pytest.mark.parametrize("name", sorted(SETUPS))
def test_fused_gpu_matches_simulator(name, path, monkeypatch):
    """The fused builds on an Apple GPU (MLX) against the simulator: values and gradients."""
    T = 9 if path == "recurrent" else 20
    x = _inputs(name, T)
    rng = np.random.default_rng(7)
    dy, dS = rng.standard_normal((B, T, Hv, D)), rng.standard_normal((B, Hv, D, D))
    variant = _variant(SETUPS[name][2], T + 1 if path == "recurrent" else 0)
    results = []
    for launcher in (metal.MLXLauncher(), metal.SimLauncher()):
        monkeypatch.setattr(metal_launch, "default_launcher", lambda launcher=launcher: launcher)
        results.append(_values_and_grads(name, x, variant, dy, dS))
    (y, S, grads), (y_sim, S_sim, grads_sim) = results
    np.testing.assert_allclose(y, y_sim, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(S, S_sim, rtol=1e-5, atol=1e-6)
    for n in grads:
        np.testing.assert_allclose(grads[n], grads_sim[n], rtol=1e-4, atol=1e-5, err_msg=n)


@pytest.mark.slow
@pytest.mark.parametrize("T", [1, 2, 33])
@pytest.mark.parametrize("path", ["recurrent", "chunkwise"])
@pytest.mark.parametrize("name", sorted(SETUPS))
def test_fused_inputs_match_float64_sweep(name, path, T):
    if T == 1 and path == "chunkwise":
        T = 17  # one chunk and one step
    _check_against_reference(name, path, T, seed=T)


def _spied_forward(monkeypatch, vector, path):
    """A forward-only call with qk_norm and a softplus gate; the chunkwise functions that
    would form a normalised q, k or a log gate as arrays, spied."""
    name = "softplus_per_channel" if vector else "softplus_per_head"
    T = 9
    x = _inputs(name, T)
    arrays = {n: mx.array(v.astype(np.float32)) for n, v in x.items() if n != "mask"}
    arrays["mask"] = mx.array(x["mask"])
    ran = spy_calls(monkeypatch, layer_inputs, ["l2_normalize", "linear_decay"])
    ran += spy_calls(monkeypatch, recurrent, ["linear_decay"])  # its own binding
    ran += spy_calls(monkeypatch, layer_inputs.ParameterGate, ["log_gates"])
    variant = _variant(vector, T + 1 if path == "recurrent" else 0)
    launcher = metal.default_launcher()
    launcher.threadgroup_bytes.clear()
    y, state = _call(name, arrays, variant)
    mx.eval(y, state)
    return ran, set(launcher.threadgroup_bytes)


@pytest.mark.parametrize("vector", [False, True], ids=["per_head", "per_channel"])
def test_recurrent_kernel_computes_the_norm_and_the_gate(monkeypatch, vector):
    """The recurrent path's forward hands the kernel raw q, k and a: no normalised q, k and no
    log gate (nor decay) exist as arrays."""
    ran, kernels = _spied_forward(monkeypatch, vector, "recurrent")
    assert kernels == {"recurrent"}
    assert ran == [], ran


def test_chunk_forward_kernels_compute_the_norm_and_the_gate(monkeypatch):
    """Scalar gates, chunk path: the forward's two kernels (the fused build) take raw q, k and
    a; no normalised q, k and no log gate exist as arrays. (Per-channel gates' chunk path is
    `gdngen.algebra.chunkwise_channel`'s, which computes them in its core.)"""
    ran, kernels = _spied_forward(monkeypatch, False, "chunkwise")
    assert kernels == set(metal.fused_kernels(_variant(False, 0)))
    assert ran == [], ran


@pytest.mark.parametrize("params", [{}, {"save_states": False, "mma": "fma"}],
                         ids=["default", "no_saved_states_fma"])
def test_fused_kernels_do_not_depend_on_thread_order(params, monkeypatch):
    """The fused forward kernels (chunk and recurrent) give bit-identical results under every
    thread schedule of the simulator (a missing barrier around the norm factors or the log
    gates would show as a difference)."""
    name = "sigmoid_bound_per_head"
    x = _inputs(name, 20, seed=8)
    arrays = {n: mx.array(v.astype(np.float32)) for n, v in x.items() if n != "mask"}
    arrays["mask"] = mx.array(x["mask"])
    results = {}
    for schedule, seed in (("forward", 0), ("reverse", 0), ("random", 1), ("low_first", 0),
                           ("high_first", 0)):
        launcher = metal.SimLauncher(schedule, seed)
        monkeypatch.setattr(metal_launch, "default_launcher", lambda launcher=launcher: launcher)
        for path, below in (("chunkwise", 0), ("recurrent", 100)):
            y, state = _call(name, arrays, _variant(False, below, **params))
            results.setdefault(path, []).append((np.array(y), np.array(state)))
        assert launcher.threadgroup_bytes, "the patched launcher ran the kernels"
    for path, runs in results.items():
        for y, state in runs[1:]:
            np.testing.assert_array_equal(y, runs[0][0], err_msg=path)
            np.testing.assert_array_equal(state, runs[0][1], err_msg=path)


def test_fused_chunk_plan_declares_what_the_kernels_use():
    """The fused plan: fused forward kernels (raw q, k; a, A_log, dt_bias in place of g), the
    plain backward; the threadgroup memory it declares is what the simulator measured."""
    x = _inputs("sigmoid_bound_per_head", 20)
    arrays = {n: mx.array(v.astype(np.float32)) for n, v in x.items() if n != "mask"}
    arrays["mask"] = mx.array(x["mask"])
    variant = _variant(False, 0)
    inputs = KernelInputs(True, "sigmoid_bound", -5.0)
    plan = metal.launch_plan(variant, Problem(Hk, Hv, D, D), 2, B, inputs)
    plain = metal.launch_plan(variant, Problem(Hk, Hv, D, D), 2, B)
    fwd = {launch.kernel: launch for launch in plan.forward}
    assert set(fwd) == set(metal.fused_kernels(variant)) and plan.fused
    for launch in plan.forward:
        assert "g" not in launch.inputs and launch.inputs[-3:] == ("A_log", "dt_bias", "prm")
        assert plan.kernels[launch.kernel].name.startswith(
            f"gdngen_{launch.kernel}_qknorm_sigmoid_bound_")
    assert plan.backward == plain.backward and plan.saved == plain.saved
    assert all(plan.kernels[n] == plain.kernels[n] for n in ("bwd_scan", "bwd_tri", "bwd_qk"))
    launcher = metal.default_launcher()
    launcher.threadgroup_bytes.clear()

    def loss(q, k):
        y, state = _call("sigmoid_bound_per_head", {**arrays, "q": q, "k": k}, variant)
        return y.sum() + state.sum()

    mx.eval(mx.grad(loss, argnums=[0, 1])(arrays["q"], arrays["k"]))
    assert launcher.threadgroup_bytes == plan.threadgroup_bytes
    C = variant["chunk_size"]
    for name in fwd:
        extra = 4 * C * (1 if name.startswith("fwd_intra") else 2)  # rk (and rq)
        assert plan.threadgroup_bytes[name] == plain.threadgroup_bytes[name] + extra


def test_fused_recurrent_build_is_keyed_on_the_context_not_the_bound():
    problem = Problem(Hk, Hv, D, D)
    variant = _variant(False, 100)
    plans = [metal.recurrent_plan(variant, problem, 3, 1, inputs=KernelInputs(True, form, lb))
             for form, lb in (("sigmoid_bound", -5.0), ("sigmoid_bound", -1.0),
                              ("softplus", 0.0))]
    assert plans[0].kernels == plans[1].kernels != plans[2].kernels
    spec = plans[0].kernels["recurrent"]
    assert spec.name.startswith("gdngen_recurrent_qknorm_sigmoid_bound_")
    assert spec.input_names[-2:] == ("A_log", "dt_bias")
    assert "QK_NORM_EPS = 1e-6f" in spec.header and QK_NORM_EPS == 1e-6
    plain = metal.recurrent_plan(variant, problem, 3, 1)
    assert plain.kernels["recurrent"].header == "" and not plain.fused
    only_norm = metal.recurrent_plan(variant, problem, 3, 1, inputs=KernelInputs(True))
    assert only_norm.kernels["recurrent"].input_names == plain.kernels["recurrent"].input_names
    with pytest.raises(ValueError, match="inputs must fuse"):
        metal.render_fused(variant, problem, KernelInputs())


def _recurrence64(q, k, v, log_g, beta, S0, scale):
    """float64 recurrence, normalised q, k given; log_g [B,T,Hv] or [B,T,Hv,Dk]."""
    r = v.shape[2] // q.shape[2]
    S = S0.copy()
    ys = []
    for t in range(q.shape[1]):
        qt, kt = (np.repeat(z[:, t], r, axis=1) for z in (q, k))
        a = np.exp(log_g[:, t])
        a = a[..., None, :] if a.ndim == 3 else a[..., None, None]
        S = S * a
        u = beta[:, t, :, None] * (v[:, t] - np.einsum("bhij,bhj->bhi", S, kt))
        S = S + u[..., None] * kt[:, :, None, :]
        ys.append(scale * np.einsum("bhij,bhj->bhi", S, qt))
    return np.stack(ys, 1), S


@pytest.mark.parametrize("path, vector", [("recurrent", False), ("recurrent", True),
                                          ("chunkwise", False)],
                         ids=["recurrent-per_head", "recurrent-per_channel", "chunk-per_head"])
@pytest.mark.parametrize("lower_bound", [None, -5.0], ids=["softplus", "sigmoid_bound"])
def test_fused_kernels_at_extreme_projections(lower_bound, path, vector):
    """The fused recurrent kernel (and the scalar chunk forward's fused kernels) from a = -80
    to 80 and a = -inf (an identity step), through large rates (A_log up to 2), against
    float64: no inf or NaN, y and the state within 5e-5."""
    T, Hv1 = 11, 2
    rng = np.random.default_rng(5)
    steps = np.array([-80.0, -50.0, -20.0, -1.0, 0.0, 1.0, 20.0, 50.0, 80.0, -np.inf, 3.0])
    gate_shape = (1, T, Hv1) + ((D,) if vector else ())
    a = np.broadcast_to(steps.reshape(1, T, 1, *((1,) if vector else ())), gate_shape).copy()
    a = a + np.where(np.isfinite(a), 0.1 * rng.standard_normal(gate_shape), 0.0)
    A_log = np.array([2.0, -1.0]).reshape((Hv1, 1) if vector else (Hv1,))
    dt_bias = rng.uniform(-0.5, 0.5, (Hv1, D) if vector else (Hv1,))
    q, k = rng.standard_normal((1, T, 1, D)) * 3.0, rng.standard_normal((1, T, 1, D))
    v, beta = rng.standard_normal((1, T, Hv1, D)), rng.uniform(0.1, 1.0, (1, T, Hv1))
    S0 = rng.standard_normal((1, Hv1, D, D))
    gate = layer_inputs.ParameterGate(lower_bound)
    f32 = [mx.array(z.astype(np.float32)) for z in (q, k, v, a, A_log, dt_bias, beta, S0)]
    problem = Problem(1, Hv1, D, D, gate="vector" if vector else "scalar")
    if path == "recurrent":
        y, S = metal.recurrent_forward(*f32[:3], tuple(f32[3:6]), f32[6], f32[7], scale=SCALE,
                                       variant=_variant(vector, 100), problem=problem,
                                       launcher=metal.SimLauncher(), qk_norm=True, gate=gate)
    else:  # T = 11 in one chunk of 16, the padded tail identity steps
        launcher = metal.SimLauncher()
        y, S = metal.gated_delta(*f32[:3], tuple(f32[3:6]), f32[6], f32[7], scale=SCALE,
                                 gate=gate, variant=_variant(vector, 0), launcher=launcher,
                                 qk_norm=True)
        assert set(launcher.threadgroup_bytes) == set(metal.fused_kernels(_variant(vector, 0)))
    y, S = np.array(y), np.array(S)
    assert np.all(np.isfinite(y)) and np.all(np.isfinite(S))
    log_g, _, _ = _log_gate(a, _broadcast_parameter(A_log, vector),
                            _broadcast_parameter(dt_bias, vector), lower_bound)
    assert np.all(log_g[:, 9] == 0.0)  # the identity step
    assert log_g.min() < (-100.0 if lower_bound is None else 0.99 * lower_bound)  # saturated
    qn, kn = (z / np.sqrt((z * z).sum(-1, keepdims=True) + QK_NORM_EPS) for z in (q, k))
    y_ref, S_ref = _recurrence64(qn, kn, v, log_g, beta, S0, SCALE)
    errors = (relative_error(y, y_ref), relative_error(S, S_ref))
    print(f"extreme {path} vector={vector} lower_bound={lower_bound}: y {errors[0]:.1e}, "
          f"state {errors[1]:.1e}")
    assert max(errors) <= RTOL, errors


@pytest.mark.parametrize("vector", [False, True], ids=["per_head", "per_channel"])
@pytest.mark.parametrize("lower_bound", [None, -5.0], ids=["softplus", "sigmoid_bound"])
def test_fused_recurrent_decay_per_element(lower_bound, vector):
    """The decay the fused recurrent kernel forms, element by element, against float64: one
    step per batch row with beta = 0 and a state of ones, so the final state is the decay;
    a from -80 to 80 and -inf (exactly 1), within a few float32 ulps of exp(log g) (and of
    the smallest normal float where it underflows)."""
    steps = np.array([-80.0, -50.0, -20.0, -1.0, 0.0, 1.0, 20.0, 50.0, 80.0, -np.inf])
    Bs, Hv1 = steps.size, 2
    gate_shape = (Bs, 1, Hv1) + ((D,) if vector else ())
    rng = np.random.default_rng(6)
    a = np.broadcast_to(steps.reshape((Bs, 1, 1) + ((1,) if vector else ())), gate_shape)
    A_log = np.array([2.0, -1.0]).reshape((Hv1, 1) if vector else (Hv1,))
    dt_bias = rng.uniform(-0.5, 0.5, (Hv1, D) if vector else (Hv1,))
    f32 = [mx.array(np.asarray(z, np.float32)) for z in (
        rng.standard_normal((Bs, 1, 1, D)), rng.standard_normal((Bs, 1, 1, D)),
        rng.standard_normal((Bs, 1, Hv1, D)), a, A_log, dt_bias, np.zeros((Bs, 1, Hv1)),
        np.ones((Bs, Hv1, D, D)))]
    _, S = metal.recurrent_forward(*f32[:3], tuple(f32[3:6]), f32[6], f32[7], scale=SCALE,
                                   variant=_variant(vector, 100),
                                   problem=Problem(1, Hv1, D, D, gate="vector" if vector
                                                   else "scalar"),
                                   launcher=metal.SimLauncher(), qk_norm=True,
                                   gate=layer_inputs.ParameterGate(lower_bound))
    log_g, _, _ = _log_gate(np.asarray(a, np.float32).astype(np.float64),
                            _broadcast_parameter(A_log, vector),
                            _broadcast_parameter(np.float32(dt_bias).astype(np.float64),
                                                 vector), lower_bound)
    log_g = log_g[:, 0, :, None, :] if vector else log_g[:, 0, :, None, None]  # like S
    want = np.exp(log_g)
    got = np.array(S)
    assert np.all(got[-1] == 1.0)  # a = -inf: the identity step, exactly
    # exp turns log g's relative rounding into |log g| times it
    tol = 4e-7 * np.maximum(1.0, np.abs(log_g)) * want + np.finfo(np.float32).tiny
    assert np.all(np.abs(got - want) <= tol), np.abs(got - want).max()


def test_recurrent_forward_rejects_a_gate_without_its_parameters():
    x = [mx.zeros((1, 2, 1, D)), mx.zeros((1, 2, 1, D)), mx.zeros((1, 2, 1, D)),
         mx.zeros((1, 2, 1)), mx.zeros((1, 2, 1)), mx.zeros((1, 1, D, D))]
    with pytest.raises(ValueError, match="decay must be the tuple"):
        metal.recurrent_forward(*x, scale=1.0, variant=_variant(False, 100),
                                gate=layer_inputs.ParameterGate())
    with pytest.raises(ValueError, match="gate must be None or a layer_inputs.ParameterGate"):
        metal.recurrent_forward(*x, scale=1.0, variant=_variant(False, 100), gate="softplus")


# sha256 of the default variant's plain render, recorded before the fused blocks were added
# (re-recorded when issue 45 corrected the templates' comments, nothing else changed)
#: per-channel renders re-pinned when the intra-chunk kernels joined them and again when
#: channel_keys did, and the forward walk's dCC input took its one name (issue 37; no
#: metal entry is shipped in tuned/)
PLAIN_SHA256 = {
    Problem(16, 32, 128, 128):
        "1d4cea005fd79f1434f7f3d2b70a48e94540662ab73244ea92176aeda19e601f",
    Problem(32, 32, 128, 128, gate="vector"):
        "ac1dc112d197d3feab5afe5509c6c87f172e6b4f406c4206f972d16315e2fbee",
    Problem(1, 2, 32, 32): "2b1ae997302a543e2b3e7463984c797dd9171b4985ab82558f2f0798eefdbb36",
    Problem(1, 2, 32, 32, gate="vector"):
        "3b2545025b4f77c14693f0d328fe7acc613fdfd4de532c6618fb697ddee13f19",
}


@pytest.mark.parametrize("problem", list(PLAIN_SHA256), ids=lambda p: p.key())
def test_plain_render_is_unchanged(problem):
    """Nothing fused renders every template byte for byte as before (tuned entries are keyed on
    the sha256); the fused build differs and carries its helpers."""
    variant = registry.default_variant("metal", problem)
    rendered = sources.render_spec(metal.SPEC, variant, problem)
    assert rendered.sha256 == PLAIN_SHA256[problem]
    assert not any("gdn_log_gate" in text for text in rendered.sources.values())
    fused = metal.render_fused(variant, problem, KernelInputs(True, "softplus"))
    assert "gdn_log_gate" in fused.sources["recurrent.metal"]
    assert "precise::rsqrt" in fused.sources["recurrent.metal"]
