"""ffi_cpu kernels that compute the layer inputs in their own loads (`ffi_cpu.render_fused`,
`gdngen.backends.kernel_inputs`): the recurrent kernel and the chunk forward take the raw q, k
(``qk_norm``) and the raw gate projection ``a`` with A_log, dt_bias (``gate="softplus"`` /
``"sigmoid_bound"``). Values and every gradient against float64 on both paths, a spy that no
normalised q, k and no log gate are computed as arrays in a forward-only call, the gate at
extreme projections, and the plain renders byte for byte as before.

Every kernel output is NaN-filled before the kernel writes it (``GDNGEN_POISON_OUTPUTS=1``).
Head dims Dk=20, Dv=24 (padded inside), Hv = 2 Hk; the first run compiles a dozen small
libraries (cached per host)."""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp
from spies import spy_calls

import gdngen.jax
from gdngen import sources
from gdngen.algebra import layer_inputs, recurrent, reference
from gdngen.backends import ffi_cpu
from gdngen.backends.kernel_inputs import KernelInputs
from gdngen.problem import Problem
from gdngen.validate import relative_error
from gdngen.variant import Variant

pytestmark = pytest.mark.skipif(not ffi_cpu.available(),
                                reason="the ffi_cpu backend needs a C++ compiler (g++ or $CXX)")

B, T, Hk, Hv, DK, DV = 2, 37, 2, 4, 20, 24
SCALE = DK ** -0.5
RTOL = 5e-5  # relative L2 error of y, the final state and every gradient (float32)
EPS = layer_inputs.QK_NORM_EPS
#: T at and above which the chunk kernels run (the recurrent path: every T here is below)
PATHS = {"chunkwise": 0, "recurrent": 1000}


@pytest.fixture(autouse=True)
def _poisoned_outputs(monkeypatch):
    monkeypatch.setenv(ffi_cpu.ENV_POISON, "1")


def _variant(recurrent_below, vector=False):
    problem = Problem(Hk, Hv, DK, DV, gate="vector" if vector else "scalar")
    params = ffi_cpu.default_config(problem).params()
    return Variant("ffi_cpu", dict(params, chunk_size=32, recurrent_below=recurrent_below))


# --------------------------------------------------------------------------- float64 reference


def _sigmoid(x):
    e = np.exp(-np.abs(x))
    return np.where(x >= 0, 1.0 / (1.0 + e), e / (1.0 + e))


def _log_gate(a, A_log, dt_bias, form, lower_bound):
    """``(log g, d log g / da, d log g / dA_log)`` in float64, a = -inf an identity step."""
    live = a > -np.inf
    x = np.where(live, a + dt_bias, 0.0)
    rate = np.exp(A_log)
    if form == "softplus":
        log_g = -rate * np.logaddexp(x, 0.0)
        da, dA = -rate * _sigmoid(x), log_g
    else:
        z = rate * x
        s = _sigmoid(z)
        log_g = lower_bound * s
        da = lower_bound * s * _sigmoid(-z) * rate
        dA = da / rate * z
    return tuple(np.where(live, t, 0.0) for t in (log_g, da, dA))


def _sum_to(x, shape):
    """A gate-shaped gradient ``[B,T,Hv(,Dk)]`` summed down to a parameter's ``shape``."""
    x = x.sum(axis=(0, 1))
    if x.ndim > len(shape):
        x = x.sum(axis=-1)
    return x.sum(axis=tuple(i for i, n in enumerate(shape) if n == 1 and x.shape[i] != 1),
                 keepdims=True).reshape(shape)


def _normalized(x):
    r = np.sqrt((x * x).sum(-1, keepdims=True) + EPS)
    return x / r, r


def _reference(x, options, mask, dy, dS):
    """Float64 ``(y, final state, {grad name: array})`` of the loss <y, dy> + <S_T, dS> w.r.t.
    the raw arrays of ``x``."""
    q, k, g = x["q"], x["k"], x["g"]
    if options["qk_norm"]:
        (q, rq), (k, rk) = _normalized(q), _normalized(k)
    form = options.get("gate")
    if form is not None:
        g, dg_da, dg_dA = _log_gate(g, x["A_log"], x["dt_bias"], form,
                                    options.get("lower_bound"))
    out = reference.vjp(q, k, x["v"], g, x["beta"], x["S0"], dy, dS, mask=mask, scale=SCALE)
    grads = {"v": out["dv"], "beta": out["dbeta"], "S0": out["dinitial_state"],
             "q": out["dq"], "k": out["dk"], "g": out["dg"]}
    if options["qk_norm"]:  # dx = (dn - n (n . dn)) / r
        for name, n, r in (("q", q, rq), ("k", k, rk)):
            d = grads[name]
            grads[name] = (d - n * (n * d).sum(-1, keepdims=True)) / r
    if form is not None:
        grads["g"] = out["dg"] * dg_da
        grads["A_log"] = _sum_to(out["dg"] * dg_dA, x["A_log"].shape)
        grads["dt_bias"] = _sum_to(grads["g"], x["dt_bias"].shape)
    return out["y"], out["final_state"], grads


# --------------------------------------------------------------------------- setups


def _setup(seed, qk_norm, gate=None, vector=False, A_shape=(Hv,), dt_shape=(Hv,),
           lower_bound=None, masked=False):
    rng = np.random.default_rng(seed)
    x = {"q": rng.standard_normal((B, T, Hk, DK)) * 2.0,  # not unit norm: the norm matters
         "k": rng.standard_normal((B, T, Hk, DK)) * 0.5,
         "v": rng.standard_normal((B, T, Hv, DV)),
         "beta": rng.uniform(0.1, 0.9, (B, T, Hv)),
         "S0": rng.standard_normal((B, Hv, DV, DK)) * 0.5}
    if not qk_norm:
        x["k"] /= np.linalg.norm(x["k"], axis=-1, keepdims=True)
    gate_shape = (B, T, Hv, DK) if vector else (B, T, Hv)
    options = {"qk_norm": qk_norm}
    if gate is None:
        x["g"] = -rng.uniform(0.01, 1.0, gate_shape)
    else:
        x["g"] = rng.standard_normal(gate_shape)
        x["A_log"] = rng.uniform(-1.0, 1.0, A_shape)
        x["dt_bias"] = rng.uniform(-0.5, 0.5, dt_shape)
        options.update(gate=gate, **({} if lower_bound is None else
                                     {"lower_bound": lower_bound}))
    mask = None
    if masked:  # a row with left padding and a hole
        mask = np.ones((B, T), bool)
        mask[1, :5] = False
        mask[1, 20] = False
    return x, options, mask


SETUPS = {
    "qk_norm_only": lambda: _setup(1, True),
    "softplus_per_head": lambda: _setup(2, True, "softplus"),
    "sigmoid_bound_per_head": lambda: _setup(3, False, "sigmoid_bound", lower_bound=-4.0),
    # mlx-lm's Kimi Linear shapes: A_log [Hv, 1], dt_bias [Hv, Dk]
    "softplus_per_channel_masked": lambda: _setup(4, True, "softplus", vector=True,
                                                  A_shape=(Hv, 1), dt_shape=(Hv, DK),
                                                  masked=True),
}
NAMES = ("q", "k", "v", "g", "beta", "S0", "A_log", "dt_bias")


def _call(arrays, options, mask, variant):
    parameters = {n: arrays[n] for n in ("A_log", "dt_bias") if n in arrays}
    return gdngen.jax.gated_delta(arrays["q"], arrays["k"], arrays["v"], arrays["g"],
                                  arrays["beta"], arrays["S0"], mask=mask, scale=SCALE,
                                  variant=variant, **options, **parameters)


# --------------------------------------------------------------------------- tests


@pytest.mark.parametrize("path", sorted(PATHS))
@pytest.mark.parametrize("name", sorted(SETUPS))
def test_fused_values_and_gradients_match_float64(name, path):
    """Values (the recurrent kernel on the recurrent path, the fused chunk forward on the
    chunk path) and the gradients of every raw array (the chunk VJP: fused forward, plain
    backward fed the recomputed inputs) against float64."""
    x, options, mask = SETUPS[name]()
    variant = _variant(PATHS[path], vector=x["g"].ndim == 4)
    rng = np.random.default_rng(7)
    dy, dS = rng.standard_normal((B, T, Hv, DV)), rng.standard_normal((B, Hv, DV, DK))
    y_ref, S_ref, grads_ref = _reference(x, options, mask, dy, dS)
    names = [n for n in NAMES if n in x]
    args = [jnp.asarray(x[n], jnp.float32) for n in names]
    mask_j = None if mask is None else jnp.asarray(mask)
    dy_j, dS_j = jnp.asarray(dy, jnp.float32), jnp.asarray(dS, jnp.float32)

    def loss(*args):
        y, S = _call(dict(zip(names, args)), options, mask_j, variant)
        return (y * dy_j).sum() + (S * dS_j).sum()

    y, S = _call(dict(zip(names, args)), options, mask_j, variant)
    grads = jax.grad(loss, argnums=tuple(range(len(args))))(*args)
    errors = {"y": relative_error(np.asarray(y, np.float64), y_ref),
              "final_state": relative_error(np.asarray(S, np.float64), S_ref)}
    errors.update({f"d{n}": relative_error(np.asarray(d, np.float64), grads_ref[n])
                   for n, d in zip(names, grads)})
    assert max(errors.values()) <= RTOL, errors
    if mask is not None:
        assert np.all(np.asarray(y)[~mask] == 0.0)


@pytest.mark.parametrize("vector", [False, True], ids=["per_head", "per_channel"])
@pytest.mark.parametrize("path", sorted(PATHS))
def test_forward_only_call_computes_no_layer_inputs_as_arrays(path, vector, monkeypatch):
    """A forward-only call with qk_norm and a parameterised gate runs kernels that take the raw
    q, k and (a, A_log, dt_bias): neither `layer_inputs.l2_normalize` nor
    `layer_inputs.ParameterGate.log_gates` runs (under jit, eagerly, and on both paths); the
    gradient's backward does recompute them (the spies see it)."""
    x, options, _ = _setup(5, True, "softplus", vector=vector,
                           A_shape=(Hv, 1) if vector else (Hv,),
                           dt_shape=(Hv, DK) if vector else (Hv,))
    variant = _variant(PATHS[path], vector=vector)
    arrays = {n: jnp.asarray(v, jnp.float32) for n, v in x.items()}
    # fresh cores and no traces cached from other tests: every trace runs the Python below
    jax.clear_caches()
    ffi_cpu.vjp.core.cache_clear()
    ffi_cpu.vjp.recurrent.cache_clear()
    arrays_ran = spy_calls(monkeypatch, layer_inputs,
                           ["l2_normalize", "normalized_qk", "linear_decay"])
    arrays_ran += spy_calls(monkeypatch, recurrent, ["linear_decay"])  # its own binding
    gate_ran = spy_calls(monkeypatch, layer_inputs.ParameterGate, ["log_gates", "vjp"])
    y, S = _call(arrays, options, None, variant)
    jax.jit(lambda a: _call(a, options, None, variant))(arrays)
    assert arrays_ran == [] and gate_ran == [], (arrays_ran, gate_ran)
    kernel = "_recurrent" if path == "recurrent" else "_forward"
    assert kernel in str(jax.make_jaxpr(lambda a: _call(a, options, None, variant))(arrays))
    y_ref, S_ref, _ = _reference(x, options, None, np.zeros((B, T, Hv, DV)),
                                 np.zeros((B, Hv, DV, DK)))
    assert relative_error(np.asarray(y, np.float64), y_ref) <= RTOL
    assert relative_error(np.asarray(S, np.float64), S_ref) <= RTOL
    jax.grad(lambda a: _call(a, options, None, variant)[0].sum())(arrays)
    assert "l2_normalize" in arrays_ran and {"log_gates", "vjp"} <= set(gate_ran)


def _conv64(x, w, state):
    """Float64 causal depthwise conv + SiLU of a raw ``x [B, T, H, D]`` (channels H D),
    ``w [H D, K]``, ``state [B, H D, K-1]``."""
    rows, steps = x.shape[:2]
    K = w.shape[1]
    window = np.concatenate([np.swapaxes(state, 1, 2), x.reshape(rows, steps, -1)], axis=1)
    pre = sum(window[:, j:j + steps] * w[:, j] for j in range(K))
    return (pre * _sigmoid(pre)).reshape(x.shape)


def _walk_ops(jaxpr, inside=False, out=None):
    """The (primitive, output shapes) of the elementwise products, exps and sigmoids inside a
    ``custom_vjp_call`` of ``jaxpr``."""
    out = [] if out is None else out
    for e in jaxpr.eqns:
        if inside and e.primitive.name in ("logistic", "exp", "mul", "integer_pow"):
            out.append((e.primitive.name, [tuple(o.aval.shape) for o in e.outvars]))
        for value in e.params.values():
            sub = getattr(value, "jaxpr", None)
            if sub is not None:
                _walk_ops(getattr(sub, "jaxpr", sub), inside or e.primitive.name ==
                          "custom_vjp_call", out)
    return out


@pytest.mark.parametrize("path", sorted(PATHS))
@pytest.mark.parametrize("qk_norm, gate, vector", [
    (True, "softplus", False), (False, None, False), (True, "softplus", True)],
    ids=["qknorm_softplus", "plain", "per_channel_qknorm_softplus"])
def test_forwards_convolve_in_their_loads(qk_norm, gate, vector, path):
    """``gated_delta(..., conv_weight=, conv_state=)`` with a padding mask, on the chunk path
    and the recurrent kernel's: the forward-only call's custom VJP is one kernel, the conv
    build of the chunk forward or of the recurrent kernel (``KernelInputs.conv``), with no
    array op around it (no product, exp or sigmoid: the conv, the norm and the gate are its
    loads'); y and the final state against float64 (the masked inputs zeroed, the conv +
    SiLU, then the recurrence). Every gradient through these kernels against the float64
    mixer: tests/calls/test_mixer.py."""
    x, options, mask = _setup(11, qk_norm, gate, masked=True, vector=vector,
                              A_shape=(Hv, 1) if vector else (Hv,),
                              dt_shape=(Hv, DK) if vector else (Hv,))
    rng = np.random.default_rng(12)
    C = 2 * Hk * DK + Hv * DV
    w, state = 0.5 * rng.standard_normal((C, 4)), rng.standard_normal((B, C, 3))
    variant = _variant(PATHS[path], vector=vector)
    problem = Problem(Hk, Hv, DK, DV, gate="vector" if vector else "scalar")
    arrays = {n: jnp.asarray(v, jnp.float32) for n, v in x.items()}
    conv = {"conv_weight": jnp.asarray(w, jnp.float32),
            "conv_state": jnp.asarray(state, jnp.float32)}

    def call(a):
        return _call(a, dict(options, **conv), jnp.asarray(mask), variant)

    jaxpr = jax.make_jaxpr(call)(arrays).jaxpr
    # (the recurrent kernel without the gate's build takes the linear decay exp(log g))
    linear = [("exp", [(B, T, Hv)])] if path == "recurrent" and not gate else []
    assert _walk_ops(jaxpr) == linear
    source = ffi_cpu.RECURRENT_SOURCE_NAME if path == "recurrent" else ffi_cpu.SOURCE_NAME
    built = ffi_cpu.render_fused(variant, problem, KernelInputs.of(
        qk_norm, layer_inputs.ParameterGate(None) if gate else "log", True), source)
    (name, text), = built.sources.items()
    assert "_conv" in name and "conv_row(" in text
    kernel = "_recurrent" if path == "recurrent" else "_forward"
    assert kernel in str(jaxpr)
    y, S = call(arrays)
    raw = {n: np.where(mask[:, :, None, None], x[n], 0.0) for n in ("q", "k", "v")}
    kd = Hk * DK
    x64 = dict(x, q=_conv64(raw["q"], w[:kd], state[:, :kd]),
               k=_conv64(raw["k"], w[kd:2 * kd], state[:, kd:2 * kd]),
               v=_conv64(raw["v"], w[2 * kd:], state[:, 2 * kd:]))
    y_ref, S_ref, _ = _reference(x64, options, mask, np.zeros((B, T, Hv, DV)),
                                 np.zeros((B, Hv, DV, DK)))
    assert relative_error(np.asarray(y, np.float64), y_ref) <= RTOL
    assert relative_error(np.asarray(S, np.float64), S_ref) <= RTOL
    assert np.all(np.asarray(y)[~mask] == 0.0)


#: raw gate projections from -80 to 80, and -inf (an identity step)
EXTREMES = np.array([-np.inf, -80.0, -30.0, -5.0, -1.0, 0.0, 1.0, 5.0, 30.0, 80.0])


@pytest.mark.parametrize("vector", [False, True], ids=["per_head", "per_channel"])
@pytest.mark.parametrize("form", ["softplus", "sigmoid_bound"])
@pytest.mark.parametrize("path", sorted(PATHS))
def test_in_kernel_gate_at_extreme_projections(path, form, vector):
    """The kernels' log gate at a from -80 to 80 and -inf (A_log up to 2, so log g down to
    about -600; decay 0 exactly, never NaN): with beta = 0 one step leaves S_1 = decay * S0,
    the decay itself, equal to float64's to float32 rounding (denormals within 1e-36); a
    short walk of such steps (beta > 0) matches float64 in y and the final state."""
    lower_bound = -5.0 if form == "sigmoid_bound" else None
    options = {"qk_norm": form == "softplus", "gate": form,
               **({"lower_bound": lower_bound} if lower_bound else {})}
    variant = _variant(PATHS[path], vector=vector)
    rng = np.random.default_rng(9)
    A_log = np.array([-1.0, 0.0, 1.0, 2.0])
    dt_bias = np.array([0.0, 0.5, -0.5, 0.25])
    if vector:
        A_log, dt_bias = A_log[:, None], np.repeat(dt_bias[:, None], DK, axis=1)
    n = len(EXTREMES)

    def arrays(batch, steps, a, beta):
        return {"q": rng.standard_normal((batch, steps, Hk, DK)),
                "k": rng.standard_normal((batch, steps, Hk, DK)) / np.sqrt(DK),
                "v": rng.standard_normal((batch, steps, Hv, DV)), "g": a, "beta": beta,
                "S0": rng.standard_normal((batch, Hv, DV, DK)), "A_log": A_log,
                "dt_bias": dt_bias}

    # every extreme in every head (and channel), one step each: S_1 = decay * S0
    index = np.arange(n)[:, None, None] + np.arange(Hv)[None, None, :]  # [n, 1, Hv]
    a = EXTREMES[((index[..., None] + np.arange(DK)) if vector else index) % n]
    x = arrays(n, 1, a, np.zeros((n, 1, Hv)))
    with np.errstate(over="ignore"):
        decay = np.exp(_log_gate(a, A_log, dt_bias, form, lower_bound)[0])[:, 0]
    y, S = _call({k_: jnp.asarray(v, jnp.float32) for k_, v in x.items()}, options, None,
                 variant)
    S, want = np.asarray(S, np.float64), (decay[..., None, :] if vector
                                          else decay[..., None, None]) * x["S0"]
    assert np.all(np.isfinite(S)) and np.any(want == x["S0"])  # a = -inf: decay 1
    assert np.any(S == 0.0) == (form == "softplus")  # exp(-exp(2) * 80) is 0 in float32
    np.testing.assert_allclose(S, want, rtol=2e-5, atol=1e-36)

    # a walk over the extremes (per head and channel in turn), against float64
    steps = np.arange(n)[None, :, None] + np.arange(Hv)[None, None, :]
    a = EXTREMES[((steps[..., None] + np.arange(DK)) if vector else steps) % n]
    x = arrays(1, n, a, rng.uniform(0.2, 1.0, (1, n, Hv)))
    y, S = _call({k_: jnp.asarray(v, jnp.float32) for k_, v in x.items()}, options, None,
                 variant)
    y_ref, S_ref, _ = _reference(dict(x), options, None, np.zeros((1, n, Hv, DV)),
                                 np.zeros((1, Hv, DV, DK)))
    assert relative_error(np.asarray(y, np.float64), y_ref) <= RTOL
    assert relative_error(np.asarray(S, np.float64), S_ref) <= RTOL


@pytest.mark.parametrize("form", ["softplus", "sigmoid_bound"])
@pytest.mark.parametrize("path", sorted(PATHS))
def test_per_channel_gate_sweep_matches_float64(path, form):
    """The per-channel kernels form a row's log gates in vectors (their own exp / log1p): 2000
    projections from -80 to 80 against float64, one step each with beta = 0 (S_1 = decay *
    S0), relative 2e-5 (denormal decays within 1e-36)."""
    lower_bound = -5.0 if form == "sigmoid_bound" else None
    options = {"qk_norm": False, "gate": form,
               **({"lower_bound": lower_bound} if lower_bound else {})}
    rng = np.random.default_rng(10)
    batch = 25
    a = np.linspace(-80.0, 80.0, batch * Hv * DK).reshape(batch, 1, Hv, DK)
    A_log = rng.uniform(-2.0, 2.0, (Hv, DK))
    dt_bias = rng.uniform(-1.0, 1.0, (Hv, DK))
    x = {"q": rng.standard_normal((batch, 1, Hk, DK)), "k": np.zeros((batch, 1, Hk, DK)),
         "v": np.zeros((batch, 1, Hv, DV)), "g": a, "beta": np.zeros((batch, 1, Hv)),
         "S0": rng.uniform(0.5, 1.5, (batch, Hv, DV, DK)), "A_log": A_log, "dt_bias": dt_bias}
    _, S = _call({n: jnp.asarray(v, jnp.float32) for n, v in x.items()}, options, None,
                 _variant(PATHS[path], vector=True))
    with np.errstate(over="ignore"):
        decay = np.exp(_log_gate(a, A_log, dt_bias, form, lower_bound)[0])[:, 0]
    np.testing.assert_allclose(np.asarray(S, np.float64), decay[..., None, :] * x["S0"],
                               rtol=2e-5, atol=1e-36)


def test_recurrent_forward_takes_the_fused_inputs():
    """`ffi_cpu.recurrent_forward` with ``inputs``: raw q, k and a with A_log, dt_bias, equal to
    the plain kernel on the inputs computed in float64; ValueError naming what is missing."""
    x, options, _ = _setup(6, True, "sigmoid_bound", lower_bound=-3.0)
    inputs = KernelInputs(True, "sigmoid_bound", -3.0)
    variant = _variant(1000)
    j = {n: jnp.asarray(v, jnp.float32) for n, v in x.items()}
    y, S = ffi_cpu.recurrent_forward(j["q"], j["k"], j["v"], j["g"], j["beta"], j["S0"],
                                     scale=SCALE, variant=variant, inputs=inputs,
                                     A_log=j["A_log"], dt_bias=j["dt_bias"])
    y_ref, S_ref, _ = _reference(x, options, None, np.zeros((B, T, Hv, DV)),
                                 np.zeros((B, Hv, DV, DK)))
    assert relative_error(np.asarray(y, np.float64), y_ref) <= RTOL
    assert relative_error(np.asarray(S, np.float64), S_ref) <= RTOL
    with pytest.raises(ValueError, match="A_log and dt_bias are required"):
        ffi_cpu.recurrent_forward(j["q"], j["k"], j["v"], j["g"], j["beta"], j["S0"],
                                  scale=SCALE, variant=variant, inputs=inputs)
    with pytest.raises(ValueError, match="A_log and dt_bias are taken only"):
        ffi_cpu.recurrent_forward(j["q"], j["k"], j["v"], j["g"], j["beta"], j["S0"],
                                  scale=SCALE, variant=variant, inputs=KernelInputs(True),
                                  A_log=j["A_log"], dt_bias=j["dt_bias"])


def test_fused_builds_are_renders_of_their_own():
    """A fused build is its own source file (named by ``KernelInputs.tag``), sha256, library
    and FFI targets; the chunk build holds the forward alone; nothing fused: ValueError."""
    problem = Problem(Hk, Hv, DK, DV)
    variant = _variant(0)
    plain = sources.render_spec(ffi_cpu.SPEC, variant, problem)
    inputs = KernelInputs(True, "softplus")
    recurrent = ffi_cpu.render_fused(variant, problem, inputs)
    chunk = ffi_cpu.render_fused(variant, problem, inputs, ffi_cpu.SOURCE_NAME)
    assert set(recurrent.sources) == {"recurrent_qknorm_softplus.cc"}
    assert set(chunk.sources) == {"gated_delta_qknorm_softplus.cc"}
    assert len({plain.sha256, recurrent.sha256, chunk.sha256}) == 3
    text = chunk.sources["gated_delta_qknorm_softplus.cc"]
    assert "_forward" in text and "_backward" not in text and "log_gate(" in text
    assert "l2_factor" not in plain.sources["gated_delta.cc"]
    assert "l2_factor" not in plain.sources["recurrent.cc"]
    with pytest.raises(ValueError, match="inputs must fuse"):
        ffi_cpu.render_fused(variant, problem, KernelInputs())
    conv = ffi_cpu.render_fused(variant, problem, KernelInputs(True, "softplus", conv=True),
                                ffi_cpu.SOURCE_NAME)
    conv_text = conv.sources["gated_delta_conv_qknorm_softplus.cc"]
    assert "conv_row(" in conv_text and "_backward" not in conv_text
    assert "conv_row" not in text and conv.sha256 != chunk.sha256
    conv_recurrent = ffi_cpu.render_fused(variant, problem, KernelInputs(True, conv=True))
    assert set(conv_recurrent.sources) == {"recurrent_conv_qknorm.cc"}
    assert "conv_row(" in conv_recurrent.sources["recurrent_conv_qknorm.cc"]
    with pytest.raises(ValueError, match="source must be one of"):
        ffi_cpu.render_fused(variant, problem, inputs, "other.cc")


#: sha256 of the default renders before the fused builds existed (commit aa07d1e; re-recorded
#: when issue 45 corrected the templates' comments, nothing else changed); host-
#: independent variants (the vector width fixed)
PLAIN_SHA256 = {
    (Problem(16, 32, 128, 128), 16):
        "0d98d39d407d95244e6e4e1b5f346a8cb8dbec3207b812650963ef5bf9b045f5",
    (Problem(16, 32, 128, 128), 8):
        "dff00f74ad37d1a2f9ecf8e2f4690b510f8b532d1443ed599f8f6b72d5494f27",
    (Problem(32, 32, 128, 128, gate="vector"), 16):
        "77c9bc1ed364fadecd6932fb25cc684fc3ae5ba757466c7773918c166cbb091b",
    (Problem(32, 32, 128, 128, gate="vector"), 8):
        "e3e451d8b104b893ea585619f24cf9ab710ffabc2ac101bf35bf10bdb2033aaf",
    (Problem(2, 4, 16, 32, gate="vector"), 16):
        "1c259a2db55ca608d7839c142c6ac3dcc95efe76dca0ccfcbba237cc296286d3",
}
#: the packed build (its own cache key; no tuned entry reads it): since issue 37 its walk
#: resets the state at each sequence's first step and folds each sequence's initial state
#: (times that step's gate) into its first chunk itself (``initial``, ``starts``)
PACKED_SHA256 = "85f33a914e0188f2799f261022bed5310dac434a4cce001f5a74b72621406726"


def _plain_variant(problem, vector_floats):
    return Variant("ffi_cpu", {"chunk_size": 64 if problem.gate == "scalar" else 32,
                               "panel": 64 if vector_floats == 16 else 16, "row_block": 6,
                               "vector_floats": vector_floats, "recurrent_below": 128})


@pytest.mark.parametrize("problem, vector_floats", sorted(PLAIN_SHA256, key=str))
def test_plain_renders_are_byte_identical_to_before(problem, vector_floats):
    """The fused parts render into nothing with qk_norm and gate_form off: the default
    variants' sha256 (and so their tuned entries and cached libraries) are as before."""
    variant = _plain_variant(problem, vector_floats)
    assert sources.render_spec(ffi_cpu.SPEC, variant, problem).sha256 == \
        PLAIN_SHA256[problem, vector_floats]


def test_packed_render_is_byte_identical_to_before():
    problem = Problem(16, 32, 128, 128)
    assert ffi_cpu.render_packed(_plain_variant(problem, 16), problem).sha256 == PACKED_SHA256
