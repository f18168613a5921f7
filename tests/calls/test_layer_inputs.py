"""Fused layer inputs (qk_norm, gate="softplus" / "sigmoid_bound", beta_activation) on both
frameworks, against a float64 NumPy reference of the transform composed with
`gdngen.algebra.reference`.

The reference gradients of the transform are the chain rule, written out below in float64, on
top of `gdngen.algebra.reference.vjp`'s dq, dk, dg, dbeta (a finite-difference cross-check of that
chain rule is a test of its own). Errors are relative L2 norms (`gdngen.validate.relative_error`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pytest
from slow import marked

from gdngen import call as calls
from gdngen import prepare
from gdngen.algebra import layer_inputs, reference
from gdngen.validate import relative_error

FRAMEWORKS = ("jax", "mlx")
B, T, Hk, Hv, Dk, Dv = 1, 40, 2, 4, 16, 32
SCALE = Dk ** -0.5
RTOL = 5e-5  # y, final state and every gradient, float32
#: raw inputs, in the order the gradient functions take them
ARRAY_NAMES = ("q", "k", "v", "g", "beta", "A_log", "dt_bias")
GRAD_NAMES = ("q", "k", "g", "A_log", "dt_bias", "beta")


# --------------------------------------------------------------------------- float64 reference


def _softplus(x):
    return np.logaddexp(x, 0.0)


def _as_gate_parameter(p, vector_gate):
    """A per-head parameter ``[Hv]`` as ``[Hv, 1]`` against a per-channel gate."""
    return p.reshape(-1, 1) if vector_gate and p.ndim == 1 else p


@dataclass
class Setup:
    """One configuration: the raw float64 inputs and the layer-input options."""

    name: str
    arrays: dict
    options: dict = field(default_factory=dict)

    @property
    def vector_gate(self):
        return self.arrays["g"].ndim == 4


def reference_forward_and_grads(setup: Setup, dy, dstate):
    """Float64 y, final state and the gradients w.r.t. every raw input of the loss
    ``<y, dy> + <final_state, dstate>``."""
    x, opt = setup.arrays, setup.options
    q, k, g, beta = x["q"], x["k"], x["g"], x["beta"]
    if opt.get("qk_norm"):
        (q, rq), (k, rk) = reference.l2_normalize(q), reference.l2_normalize(k)
    gate = opt.get("gate", "log")
    if gate != "log":
        A = _as_gate_parameter(x["A_log"], setup.vector_gate)
        dt = _as_gate_parameter(x["dt_bias"], setup.vector_gate)
        pre = g + dt  # the raw projection plus its bias
        if gate == "softplus":
            log_g = -np.exp(A) * _softplus(pre)
        else:
            z = np.exp(A) * pre
            log_g = opt["lower_bound"] * reference.sigmoid(z)
    else:
        log_g = g
    if opt.get("beta_activation") == "sigmoid":
        beta = reference.sigmoid(beta)

    out = reference.vjp(q, k, x["v"], log_g, beta, None, dy, dstate, scale=SCALE, gate="log")
    grads = {"dq": out["dq"], "dk": out["dk"], "dg": out["dg"], "dbeta": out["dbeta"]}
    if opt.get("qk_norm"):
        grads["dq"] = reference.l2_normalize_vjp(q, rq, out["dq"])
        grads["dk"] = reference.l2_normalize_vjp(k, rk, out["dk"])
    if gate == "softplus":  # d log g / d pre = -exp(A) sigmoid(pre), d log g / d A = log g
        d_pre = out["dg"] * -np.exp(A) * reference.sigmoid(pre)
        d_A = out["dg"] * log_g
    elif gate == "sigmoid_bound":  # d log g / dz = lb s (1 - s), dz / d pre = exp(A), dz/dA = z
        s = reference.sigmoid(z)
        dz = out["dg"] * opt["lower_bound"] * s * (1.0 - s)
        d_pre, d_A = dz * np.exp(A), dz * z
    if gate != "log":
        grads["dg"] = d_pre
        grads["dA_log"] = reference.sum_to(d_A, x["A_log"].shape)
        grads["ddt_bias"] = reference.sum_to(d_pre, x["dt_bias"].shape)
    if opt.get("beta_activation") == "sigmoid":
        grads["dbeta"] = out["dbeta"] * beta * (1.0 - beta)
    return out["y"], out["final_state"], grads, log_g


# --------------------------------------------------------------------------- configurations


def _setup(name, gate="log", vector_gate=False, A_shape=None, dt_shape=None, seed=0,
           lower_bound=None, qk_norm=True, beta_logits=True, g=None, A_log=None):
    rng = np.random.default_rng(seed)
    gate_shape = (B, T, Hv, Dk) if vector_gate else (B, T, Hv)
    arrays = {"q": rng.standard_normal((B, T, Hk, Dk)) * 2.0,  # not unit norm: the norm matters
              "k": rng.standard_normal((B, T, Hk, Dk)) * 0.5,
              "v": rng.standard_normal((B, T, Hv, Dv)),
              "beta": rng.standard_normal((B, T, Hv)) if beta_logits
              else rng.uniform(0.1, 0.9, (B, T, Hv))}
    if not qk_norm:
        arrays["k"] = arrays["k"] / np.linalg.norm(arrays["k"], axis=-1, keepdims=True)
    options = {"qk_norm": qk_norm, "beta_activation": "sigmoid" if beta_logits else None}
    if gate == "log":
        arrays["g"] = -rng.uniform(0.01, 1.0, gate_shape)
    else:
        options["gate"] = gate
        arrays["g"] = rng.standard_normal(gate_shape) if g is None else g(rng, gate_shape)
        arrays["A_log"] = (rng.uniform(-1.0, 1.0, A_shape) if A_log is None
                           else np.broadcast_to(A_log, A_shape).copy())
        arrays["dt_bias"] = rng.uniform(-0.5, 0.5, dt_shape)
    if lower_bound is not None:
        options["lower_bound"] = lower_bound
    return Setup(name, arrays, options)


def _strong_decay_gate(rng, shape):
    """Raw projection giving log g ~ -37 on even steps (exp(4) * softplus(~0)) and ~ -2.7 on
    odd steps (exp(4) * softplus(-3)), with A_log = 4 and dt_bias near 0."""
    steps = np.arange(shape[1]).reshape((1, -1) + (1,) * (len(shape) - 2))
    return np.where(steps % 2 == 0, 0.0, -3.0) + 0.05 * rng.standard_normal(shape)


SETUPS = {
    s.name: s for s in [
        _setup("softplus_per_head", "softplus", A_shape=(Hv,), dt_shape=(Hv,)),
        _setup("sigmoid_bound_per_head", "sigmoid_bound", A_shape=(Hv,), dt_shape=(Hv,),
               lower_bound=-5.0, seed=1),
        # mlx-lm's Kimi Linear / Bailing V3 shapes: A_log [Hv, 1], dt_bias [Hv, Dk]
        _setup("softplus_per_channel_kimi", "softplus", vector_gate=True, A_shape=(Hv, 1),
               dt_shape=(Hv, Dk), seed=2),
        _setup("softplus_per_channel_full", "softplus", vector_gate=True, A_shape=(Hv, Dk),
               dt_shape=(Hv, Dk), seed=3),
        _setup("sigmoid_bound_per_channel_per_head_params", "sigmoid_bound", vector_gate=True,
               A_shape=(Hv,), dt_shape=(Hv,), lower_bound=-3.0, seed=4),
        _setup("qk_norm_only", "log", seed=5, beta_logits=False),
        _setup("beta_logits_only", "log", qk_norm=False, seed=6),
        _setup("strong_decay", "softplus", A_shape=(Hv,), dt_shape=(Hv,), seed=7,
               g=_strong_decay_gate, A_log=4.0),
    ]
}
SETUPS["strong_decay"].arrays["dt_bias"] *= 0.1


# --------------------------------------------------------------------------- frameworks


class Framework:
    """Arrays in and out, and ``value_and_grads(fn, arrays, names)`` for one framework."""

    def __init__(self, name):
        self.name = name
        if name == "jax":
            import jax
            import jax.numpy as jnp

            import gdngen.jax

            self.jax, self.np, self.gated_delta = jax, jnp, gdngen.jax.gated_delta
        else:
            import mlx.core as mx

            import gdngen.mlx

            self.mx, self.np, self.gated_delta = mx, mx, gdngen.mlx.gated_delta

    def array(self, x, dtype=None):
        x = np.asarray(x, np.float32)
        if self.name == "jax":
            return self.np.asarray(x, dtype)
        out = self.mx.array(x)
        return out if dtype is None else out.astype(dtype)

    def numpy(self, x):
        if self.name == "mlx":
            x = x.astype(self.mx.float32)
        return np.asarray(x, np.float64)

    def grads(self, fn, args):
        """Gradients of scalar ``fn(*args)`` w.r.t. every argument."""
        if self.name == "jax":
            return self.jax.grad(fn, argnums=tuple(range(len(args))))(*args)
        grads = self.mx.grad(fn, argnums=list(range(len(args))))(*args)
        return tuple(grads) if isinstance(grads, (tuple, list)) else (grads,)


@pytest.fixture(params=FRAMEWORKS, scope="module")
def fw(request):
    return Framework(request.param)


def _call(fw, setup, arrays, **extra):
    """``gated_delta`` on raw framework arrays (a dict by name) with the setup's options."""
    parameters = {n: arrays[n] for n in ("A_log", "dt_bias") if n in arrays}
    return fw.gated_delta(arrays["q"], arrays["k"], arrays["v"], arrays["g"], arrays["beta"],
                          scale=SCALE, **setup.options, **parameters, **extra)


def _cotangents(seed=11):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((B, T, Hv, Dv)), rng.standard_normal((B, Hv, Dv, Dk))


def framework_forward_and_grads(fw, setup, dy, dstate):
    names = [n for n in ARRAY_NAMES if n in setup.arrays]
    args = [fw.array(setup.arrays[n]) for n in names]
    dy_f, dstate_f = fw.array(dy), fw.array(dstate)

    def loss(*args):
        y, state = _call(fw, setup, dict(zip(names, args)))
        return (y * dy_f).sum() + (state * dstate_f).sum()

    y, state = _call(fw, setup, dict(zip(names, args)))
    grads = dict(zip(names, fw.grads(loss, args)))
    return (fw.numpy(y), fw.numpy(state),
            {f"d{n}": fw.numpy(grads[n]) for n in GRAD_NAMES if n in grads})


# --------------------------------------------------------------------------- tests


@pytest.mark.parametrize("name", sorted(SETUPS))
def test_values_and_gradients_match_float64_reference(fw, name):
    setup = SETUPS[name]
    dy, dstate = _cotangents()
    y_ref, state_ref, grads_ref, log_g = reference_forward_and_grads(setup, dy, dstate)
    y, state, grads = framework_forward_and_grads(fw, setup, dy, dstate)
    errors = {"y": relative_error(y, y_ref), "final_state": relative_error(state, state_ref)}
    assert set(grads) == set(grads_ref)
    errors.update({n: relative_error(grads[n], grads_ref[n]) for n in grads_ref})
    if name == "strong_decay":
        strong = log_g < -30
        assert strong.any() and log_g.max() > -5  # strong and mild steps both present
        errors["dg (strong steps)"] = relative_error(grads["dg"][strong],
                                                     grads_ref["dg"][strong])
    print(f"{fw.name} {name}: " + ", ".join(f"{n} {e:.1e}" for n, e in errors.items()))
    worst = max(errors.items(), key=lambda item: item[1])
    assert worst[1] <= RTOL, (name, worst)


def test_chain_rule_reference_agrees_with_finite_differences():
    """The float64 chain rule above against central differences of the float64 forward."""
    setup = SETUPS["sigmoid_bound_per_channel_per_head_params"]
    dy, dstate = _cotangents()
    _, _, grads, _ = reference_forward_and_grads(setup, dy, dstate)
    rng = np.random.default_rng(3)

    def loss(arrays):
        shifted = Setup(setup.name, arrays, setup.options)
        y, state, _, _ = reference_forward_and_grads(shifted, dy, dstate)
        return (y * dy).sum() + (state * dstate).sum()

    h = 1e-6
    for name in GRAD_NAMES:
        direction = rng.standard_normal(setup.arrays[name].shape)
        plus, minus = dict(setup.arrays), dict(setup.arrays)
        plus[name] = setup.arrays[name] + h * direction
        minus[name] = setup.arrays[name] - h * direction
        numeric = (loss(plus) - loss(minus)) / (2 * h)
        analytic = (grads[f"d{name}"] * direction).sum()
        assert abs(numeric - analytic) <= 1e-6 * max(1.0, abs(analytic)), name


def test_log_gate_is_stable_at_extreme_projections(fw):
    """softplus is x for large x and exp(x) for very negative x: no overflow to inf, no
    underflow to 0 while exp(x) is a normal float32; the gradient is -exp(A_log) sigmoid(x)."""
    xp = prepare.namespace(fw.name)
    pre = np.array([-80.0, -50.0, -20.0, 0.0, 20.0, 50.0, 80.0])
    A_log = np.array([1.5])
    got = fw.numpy(layer_inputs.log_gate(xp, fw.array(pre), fw.array(A_log), fw.array([0.0])))
    want = -np.exp(A_log) * _softplus(pre)
    assert np.all(np.abs(got - want) <= 4e-6 * np.abs(want))  # a few float32 ulps

    def total(a):
        return layer_inputs.log_gate(xp, a, fw.array(A_log), fw.array([0.0])).sum()

    (grad,) = fw.grads(total, [fw.array(pre)])
    want_grad = -np.exp(A_log) * reference.sigmoid(pre)
    assert np.all(np.abs(fw.numpy(grad) - want_grad) <= 4e-6 * np.abs(want_grad))


@pytest.mark.parametrize("lower_bound", [None, -5.0], ids=["softplus", "sigmoid_bound"])
def test_chunk_core_gate_vjp_at_extreme_projections(fw, lower_bound):
    """The chunk cores' own gate (`gdngen.algebra.layer_inputs.ParameterGate`): log gate and its
    VJP to
    a, A_log, dt_bias against float64 from a = -80 to 80, per element within a few float32 ulps of
    each value (the saturated sigmoid tail included: sigmoid'(z) is sigmoid(z) sigmoid(-z));
    a = -inf, a masked or padded step, gives log g = 0 and zero cotangents, never NaN."""
    xp = prepare.namespace(fw.name)
    gate = layer_inputs.ParameterGate(lower_bound)
    a = np.array([[-80.0, -50.0, -20.0, -1.0, 0.0, 1.0, 20.0, 50.0, 80.0, -np.inf]] * 2)
    A_log, dt_bias = np.array([[1.5], [-0.5]]), np.array([[0.25], [-0.5]])  # [H, 1] vs a [H, 10]
    dlog_g = np.linspace(-1.0, 2.0, a.size).reshape(a.shape)
    live = np.isfinite(a)
    rate, x = np.exp(A_log), np.where(live, a + dt_bias, 0.0)
    if lower_bound is None:
        want = -rate * _softplus(x)
        want_da = -rate * reference.sigmoid(x) * dlog_g
        want_dlog_rate = want * dlog_g
    else:
        z = rate * x
        want = lower_bound * reference.sigmoid(z)
        want_da = lower_bound * reference.sigmoid(z) * reference.sigmoid(-z) * rate * dlog_g
        want_dlog_rate = want_da * x
    want, want_da, want_dlog_rate = (np.where(live, w, 0.0) for w in
                                     (want, want_da, want_dlog_rate))
    args = [fw.array(v) for v in (a, A_log, dt_bias)]
    got = fw.numpy(gate.log_gates(xp, *args))
    da, dA_log, ddt_bias = (fw.numpy(d) for d in gate.vjp(xp, *args, fw.array(dlog_g)))
    for name, g, w in (("log_g", got, want), ("da", da, want_da)):
        assert np.all(np.isfinite(g)), name
        assert np.all(np.abs(g - w) <= 8e-6 * np.abs(w) + 1e-30), (name, g, w)
    np.testing.assert_allclose(dA_log, want_dlog_rate.sum(1, keepdims=True), rtol=1e-5)
    np.testing.assert_allclose(ddt_bias, want_da.sum(1, keepdims=True), rtol=1e-5)


def test_qk_norm_matches_mlx_lm_normalize_qk():
    """qk_norm's formula is mlx-lm's normalize_qk with inv_scale = Dk**-0.5 (k exactly; q
    carries the Dk**-0.5 readout scale there, passed as ``scale`` here)."""
    mx = pytest.importorskip("mlx.core")
    gated_delta = pytest.importorskip("mlx_lm.models.gated_delta")
    rng = np.random.default_rng(0)
    q, k = (mx.array(rng.standard_normal((B, T, Hk, Dk)).astype(np.float32) * 3)
            for _ in range(2))
    ref_q, ref_k = gated_delta.normalize_qk(q, k, inv_scale=Dk ** -0.5, eps=1e-6)
    xp = prepare.namespace("mlx")
    got_q, got_k = (layer_inputs.l2_normalize(xp, x) for x in (q, k))
    assert relative_error(np.array(got_k), np.array(ref_k)) < 1e-6
    assert relative_error(np.array(got_q) * Dk ** -0.5, np.array(ref_q)) < 1e-6


def test_output_dtype_follows_q_and_compiled_matches_eager(fw):
    setup = SETUPS["softplus_per_channel_kimi"]
    arrays = {n: fw.array(x) for n, x in setup.arrays.items()}
    for n in ("q", "k", "v"):
        arrays[n] = arrays[n].astype(fw.np.bfloat16)
    y, state = _call(fw, setup, arrays)
    assert "bfloat16" in str(y.dtype) and "float32" in str(state.dtype)

    names = sorted(arrays)

    def f(*args):
        return _call(fw, setup, dict(zip(names, args)))

    compiled = fw.jax.jit(f) if fw.name == "jax" else fw.mx.compile(f)
    for eager, traced in zip(f(*(arrays[n] for n in names)), compiled(*(arrays[n] for n in names))):
        np.testing.assert_allclose(fw.numpy(traced), fw.numpy(eager), rtol=1e-5, atol=1e-6)


def test_defaults_pass_the_arrays_through_unchanged(fw):
    arrays = [fw.array(x) for x in (np.ones((B, T, Hk, Dk)), np.ones((B, T, Hk, Dk)),
                                    np.ones((B, T, Hv, Dv)), -np.ones((B, T, Hv)),
                                    np.ones((B, T, Hv)))]
    q, k, v, g, beta = arrays
    call, operands = calls.check(fw.name, q, k, v, g, beta)
    prepared_call, prepared = prepare.prepared(call, operands)
    assert prepared_call is call and prepared is operands
    out_call, out = prepare.computed(call, operands, fused=())
    assert out_call == call and all(a is b for a, b in zip(out, operands))


def _bad(gate="softplus", vector_gate=False, **options):
    return gate, vector_gate, options


_A, _A_VEC = np.zeros(Hv), np.zeros((Hv, Dk))
BAD = [
    (_bad(), "gate='softplus' needs A_log and dt_bias \\(A_log and dt_bias not given\\)"),
    (_bad(A_log=_A), "gate='softplus' needs A_log and dt_bias \\(dt_bias not given\\)"),
    (_bad("sigmoid_bound", A_log=_A, dt_bias=_A), "gate='sigmoid_bound' needs lower_bound"),
    (_bad(A_log=_A, dt_bias=_A, lower_bound=-5.0),
     "lower_bound is only for gate='sigmoid_bound', got gate='softplus'"),
    (_bad("sigmoid_bound", A_log=_A, dt_bias=_A, lower_bound=0.0), "lower_bound must be < 0"),
    (_bad("sigmoid_bound", A_log=_A, dt_bias=_A, lower_bound=True),
     "lower_bound must be a Python float"),
    (_bad("log", A_log=_A), "A_log is only for gate='softplus' or gate='sigmoid_bound'"),
    (_bad("linear", dt_bias=_A), "dt_bias is only for gate='softplus' or gate='sigmoid_bound'"),
    (_bad(A_log=np.zeros(3), dt_bias=_A),
     "A_log has shape \\(3,\\), expected \\(4,\\) for Hv=4, Dk=16"),
    (_bad(A_log=_A_VEC, dt_bias=_A), "A_log has shape \\(4, 16\\), expected \\(4,\\) for"),
    (_bad(vector_gate=True, A_log=_A, dt_bias=np.zeros((Hv, Dk + 1))),
     ("dt_bias has shape \\(4, 17\\), expected \\(4,\\), \\(4, 1\\) or \\(4, 16\\) for Hv=4, "
      "Dk=16 \\(per-channel g")),
    (_bad("log", beta_activation="softmax"), "beta_activation must be None or 'sigmoid'"),
    (_bad("log", qk_norm=1), "qk_norm must be a bool"),
    (_bad("exp"), "gate must be one of \\('log', 'linear', 'softplus', 'sigmoid_bound'\\)"),
]


@pytest.mark.parametrize("bad, message", BAD, ids=[m.split(" ")[0] + str(i)
                                                   for i, (_, m) in enumerate(BAD)])
def test_bad_combinations_raise_a_value_error_naming_the_argument(fw, bad, message):
    gate, vector_gate, options = bad
    setup = _setup("bad", "log", vector_gate=vector_gate)
    arrays = {n: fw.array(x) for n, x in setup.arrays.items()}
    options = {n: fw.array(x) if isinstance(x, np.ndarray) else x for n, x in options.items()}
    with pytest.raises(ValueError, match=message):
        fw.gated_delta(arrays["q"], arrays["k"], arrays["v"], arrays["g"], arrays["beta"],
                       gate=gate, **options)


def test_load_tuned_takes_the_layer_input_keywords(fw):
    import gdngen

    setup = SETUPS["softplus_per_head"]
    arrays = {n: fw.array(x) for n, x in setup.arrays.items()}
    tuned = gdngen.load_tuned(fw.name)
    parameters = {n: arrays[n] for n in ("A_log", "dt_bias")}
    args = (arrays["q"], arrays["k"], arrays["v"], arrays["g"], arrays["beta"])
    y, state = tuned(*args, scale=SCALE, **setup.options, **parameters)
    y_plain, state_plain = _call(fw, setup, arrays)
    assert relative_error(fw.numpy(y), fw.numpy(y_plain)) < 1e-6
    assert relative_error(fw.numpy(state), fw.numpy(state_plain)) < 1e-6
    choice = tuned.explain(*args, scale=SCALE, **setup.options, **parameters)
    assert choice.variant.backend in gdngen.registry.names(fw.name)
    with pytest.raises(ValueError, match="A_log and dt_bias"):
        tuned.explain(*args, scale=SCALE, gate="softplus")


def _fusing_variant(framework, backend, recurrent_below):
    from gdngen import Variant, registry
    from gdngen.problem import Problem

    backend = registry.portable(framework) if backend == "portable" else backend
    spec = registry.get(backend)
    if not spec.available():
        pytest.skip(f"{backend} cannot run on this host")
    assert {"qk_norm", "gate"} <= set(spec.fused_inputs)
    params = registry.default_variant(backend, Problem(Hk, Hv, Dk, Dv)).as_dict()
    return Variant(backend, dict(params, chunk_size=32, recurrent_below=recurrent_below))


def _fusing_backends():
    """(framework, backend) of every registered backend that takes the q/k norm and a
    parameterised gate raw (its ``fused_inputs``), the portable ones as "portable"; metal's
    kernels need head dims that are multiples of 32 (this module's Dk is 16): its case is
    `test_metal_fuses_layer_inputs`."""
    from gdngen import registry

    out = []
    for name in registry.names():
        spec = registry.get(name)
        if {"qk_norm", "gate"} <= set(spec.fused_inputs) and name != "metal":
            out.append((spec.framework, "portable" if spec.portable else name))
    return out


FUSING_BACKENDS = _fusing_backends()


#: (name, path) of JAX's portable backend (xla: each case compiles its chunk core's forward and
#: backward, ~15 s) left to make test-all. [softplus_per_head-*-jax-portable] keep the norm
#: and the gate fused into xla's chunk core and its recurrent path (qk_norm_only: the same
#: norm, next to a log gate; sigmoid_bound: the same fused-gate path, its formula and VJP
#: test_chunk_core_gate_vjp_at_extreme_projections[jax-sigmoid_bound]); the Kimi form's
#: recurrent path (its chunkwise path keeps it)
SLOW_PORTABLE_JAX = {("qk_norm_only", "chunkwise"), ("qk_norm_only", "recurrent"),
                     ("sigmoid_bound_per_head", "chunkwise"),
                     ("sigmoid_bound_per_head", "recurrent"),
                     ("softplus_per_channel_kimi", "recurrent")}


def _fused_cases() -> list:
    """(name, path, framework, backend) of `test_layer_inputs_fused_into_the_chunk_core`. Slow
    (make test-all): every case on the Pallas backends (interpret mode here;
    tests/backends/pallas/test_pallas_fused_inputs.py keeps the layer-input forms' values and
    gradients there on both paths, GVA and a mask included, and spies that the forward computes
    neither the norm nor the gate as array ops), and `SLOW_PORTABLE_JAX`."""
    cases = []
    for name in ("qk_norm_only", "softplus_per_head", "sigmoid_bound_per_head",
                 "softplus_per_channel_kimi"):
        for path in ("chunkwise", "recurrent"):
            for framework, backend in FUSING_BACKENDS:
                slow = backend.startswith("pallas") or (
                    (framework, backend) == ("jax", "portable")
                    and (name, path) in SLOW_PORTABLE_JAX)
                cases.append(pytest.param(name, path, framework, backend,
                                          marks=[pytest.mark.slow] if slow else [],
                                          id=f"{name}-{path}-{framework}-{backend}"))
    return cases


@pytest.mark.parametrize(("name", "path", "framework", "backend"), _fused_cases())
def test_layer_inputs_fused_into_the_chunk_core(name, path, framework, backend, monkeypatch):
    """xla, mlx, ffi_cpu, pallas_tpu and pallas_gpu (interpret mode here) take ``qk_norm`` and
    a parameterised gate raw (`BackendSpec.fused_inputs`): the chunk core normalises q, k and
    computes the log gate from ``(a, A_log, dt_bias)`` itself (the generated backends in their
    kernels' loads: tests/backends/ffi_cpu/test_ffi_cpu_fused_inputs.py,
    tests/backends/pallas/test_pallas_fused_inputs.py), and its backward recomputes them; a short
    call's recurrent path does the same (the portable step loop as array ops, the generated
    recurrent kernels in their loads). Nothing computes the gate outside the backend
    (`gdngen.prepare.computed_gate` only passes gates through). Values and gradients
    against float64 (metal: `test_metal_fuses_layer_inputs`)."""
    fw = Framework(framework)
    setup = SETUPS[name]
    variant = _fusing_variant(fw.name, backend, 0 if path == "chunkwise" else T + 1)
    assert setup.options["qk_norm"]
    computed = prepare.computed_gate

    def passes_gates_through(framework, g, gate):
        assert not isinstance(gate, layer_inputs.ParameterGate), "gate computed before the call"
        return computed(framework, g, gate)

    monkeypatch.setattr(prepare, "computed_gate", passes_gates_through)
    dy, dstate = _cotangents()
    y_ref, state_ref, grads_ref, _ = reference_forward_and_grads(setup, dy, dstate)
    names = [n for n in ARRAY_NAMES if n in setup.arrays]
    args = [fw.array(setup.arrays[n]) for n in names]
    dy_f, dstate_f = fw.array(dy), fw.array(dstate)

    def call(*args):
        return _call(fw, setup, dict(zip(names, args)), variant=variant)

    def loss(*args):
        y, state = call(*args)
        return (y * dy_f).sum() + (state * dstate_f).sum()

    def value_and_grads(*args):  # the value of a call that is only evaluated (its path's)
        return call(*args), fw.grads(loss, args)

    # JAX: one compiled program (XLA compiles the chunk core's forward and backward once,
    # not the evaluated call, then autodiff's forward, then its backward, each on its own)
    (y, state), grads = (fw.jax.jit(value_and_grads) if fw.name == "jax"
                         else value_and_grads)(*args)
    grads = dict(zip(names, grads))
    errors = {"y": relative_error(fw.numpy(y), y_ref),
              "final_state": relative_error(fw.numpy(state), state_ref)}
    errors.update({f"d{n}": relative_error(fw.numpy(grads[n]), grads_ref[f"d{n}"])
                   for n in names if f"d{n}" in grads_ref})
    worst = max(errors.items(), key=lambda item: item[1])
    assert worst[1] <= RTOL, (name, path, worst)


@pytest.mark.parametrize("gate", ["log", "softplus"])
@pytest.mark.parametrize("vector", [False, True], ids=["scalar", "vector"])
@pytest.mark.parametrize("path", ["chunkwise", "recurrent"])
def test_metal_fuses_layer_inputs(path, vector, gate):
    """metal (its MSL simulator here; Dk a multiple of 32) takes ``qk_norm`` and a
    parameterised gate raw: its chunk core (scalar gates) or the per-channel path's core
    normalises q, k and computes the log gate from ``(a, A_log, dt_bias)``, and its VJP maps
    the kernels' dq, dk, dlog g back to the raw arrays; the recurrent kernel and the scalar
    chunk forward compute them in their loads (tests/backends/metal/test_metal_fused_inputs.py).
    Values and the gradients of every raw array against float64."""
    import mlx.core as mx

    from gdngen import Variant, registry
    from gdngen.algebra import reference
    from gdngen.backends import metal
    from gdngen.problem import Problem

    Tm, Hkm, Hvm, D = 40, 1, 2, 32
    rng = np.random.default_rng(21)
    gate_shape = (1, Tm, Hvm) + ((D,) if vector else ())
    x = {"q": rng.standard_normal((1, Tm, Hkm, D)), "k": rng.standard_normal((1, Tm, Hkm, D)),
         "v": rng.standard_normal((1, Tm, Hvm, D)), "g": -rng.uniform(0.0, 0.5, gate_shape),
         "beta": rng.uniform(0.1, 1.0, (1, Tm, Hvm))}
    names = ["q", "k", "v", "g", "beta"]
    if gate == "softplus":  # mlx-lm's Kimi Linear shapes for a per-channel gate
        x["g"] = rng.standard_normal(gate_shape)
        x["A_log"] = rng.standard_normal((Hvm, 1) if vector else (Hvm,)) * 0.5
        x["dt_bias"] = rng.standard_normal((Hvm, D) if vector else (Hvm,)) * 0.5
        names += ["A_log", "dt_bias"]
    dy = rng.standard_normal((1, Tm, Hvm, D))
    problem = Problem(Hkm, Hvm, D, D, gate="vector" if vector else "scalar")
    params = registry.default_variant("metal", problem).as_dict()
    variant = Variant("metal", dict(params, chunk_size=32, recurrent_below=(
        0 if path == "chunkwise" else Tm + 1)))
    args = [mx.array(x[n].astype(np.float32)) for n in names]

    def run(q, k, v, g, beta, *parameters):
        if parameters:
            g, parameter_gate = (g, *parameters), layer_inputs.ParameterGate()
        return metal.gated_delta(q, k, v, g, beta, scale=D ** -0.5, variant=variant,
                                 qk_norm=True, gate=parameter_gate if parameters else "log")

    def loss(*a):
        y, state = run(*a)
        return (y * mx.array(dy.astype(np.float32))).sum() + state.sum()

    grads = mx.grad(loss, argnums=list(range(len(names))))(*args)
    qn, kn = (x[n] / np.sqrt((x[n] ** 2).sum(-1, keepdims=True) + layer_inputs.QK_NORM_EPS)
              for n in ("q", "k"))
    log_g = x["g"]
    if gate == "softplus":
        pre = x["g"] + x["dt_bias"]
        log_g = -np.exp(x["A_log"]) * _softplus(pre)
    ref = reference.vjp(qn, kn, x["v"], log_g, x["beta"], None, dy,
                        np.ones((1, Hvm, D, D)), scale=D ** -0.5)
    # the reference's dq, dk are w.r.t. the normalised q, k: through the norm's VJP
    for n, xn in (("q", qn), ("k", kn)):
        d = ref[f"d{n}"]
        norm = np.sqrt((x[n] ** 2).sum(-1, keepdims=True) + layer_inputs.QK_NORM_EPS)
        ref[f"d{n}"] = (d - xn * (xn * d).sum(-1, keepdims=True)) / norm
    if gate == "softplus":  # chain rule through log g = -exp(A_log) softplus(a + dt_bias)
        dlog_g = ref["dg"]
        ref["dg"] = -np.exp(x["A_log"]) * reference.sigmoid(pre) * dlog_g
        ref["dA_log"] = reference.sum_to(dlog_g * log_g, x["A_log"].shape)
        ref["ddt_bias"] = reference.sum_to(ref["dg"], x["dt_bias"].shape)
    errors = {n: relative_error(np.array(gr), ref[f"d{n}"]) for n, gr in zip(names, grads)}
    y, _ = run(*args)
    errors["y"] = relative_error(np.array(y), ref["y"])
    assert max(errors.values()) <= RTOL, errors


# pallas_tpu's in make test-all: [portable], [ffi_cpu], [pallas_gpu] keep it
@pytest.mark.parametrize("backend", marked(["portable", "ffi_cpu", "pallas_tpu", "pallas_gpu"],
                                           {"pallas_tpu"}))
def test_fused_qk_norm_keeps_no_normalised_copies_for_the_backward(backend):
    """Under ``jax.vjp`` (the forward's residuals kept for the backward), the chunk core with
    the fused norm keeps the raw q, k only: its residuals are smaller by the normalised q and
    k (and the norm's per-row factors) than with the norm computed before the call."""
    import jax.numpy as jnp

    from gdngen.jax import gated_delta

    rng = np.random.default_rng(3)
    Tl = 64  # two of the variants' chunks; residuals scale with T (same ratios at T = 256)
    q, k = (jnp.asarray(rng.standard_normal((B, Tl, Hk, Dk)), jnp.float32) for _ in range(2))
    v = jnp.asarray(rng.standard_normal((B, Tl, Hv, Dv)), jnp.float32)
    g = jnp.asarray(-rng.uniform(0, 0.2, (B, Tl, Hv)), jnp.float32)
    beta = jnp.asarray(rng.uniform(0, 1, (B, Tl, Hv)), jnp.float32)
    variant = _fusing_variant("jax", backend, 0)

    def fused(q, k):
        return gated_delta(q, k, v, g, beta, qk_norm=True, variant=variant)

    def outside(q, k):
        return gated_delta(*prepare.normalize_qk("jax", q, k), v, g, beta,
                           variant=variant)

    # outside, autodiff keeps the normalised q, k (and per-row factors of the norm's VJP)
    (y_outside, _), outside_bytes = _residual_bytes(outside, q, k)
    (y_fused, _), fused_bytes = _residual_bytes(fused, q, k)
    saved = outside_bytes - fused_bytes
    assert q.nbytes + k.nbytes <= saved < (q.nbytes + k.nbytes) * 1.25
    np.testing.assert_allclose(np.asarray(y_fused), np.asarray(y_outside), rtol=1e-5, atol=1e-6)


def _residual_bytes(fn, *args):
    """``fn(*args)`` and the bytes ``jax.vjp(fn, *args)`` keeps for the backward (its primal
    output: the forward that keeps them; no second compile of an evaluated call)."""
    import jax

    out, vjp = jax.vjp(fn, *args)
    return out, sum(x.nbytes for x in jax.tree.leaves(vjp))


# per-channel residuals: [ffi_cpu-per_channel] keeps them; the others in make test-all
@pytest.mark.parametrize(("backend", "vector"), marked(
    [(b, v) for b in ("portable", "ffi_cpu", "pallas_tpu", "pallas_gpu") for v in (False, True)],
    {("portable", True), ("pallas_tpu", True), ("pallas_gpu", True)}),
    ids=lambda x: {False: "per_head", True: "per_channel"}.get(x, x) if isinstance(x, bool)
    else x)
def test_fused_gate_keeps_no_log_gate_for_the_backward(backend, vector):
    """Under ``jax.vjp``, the chunk core given ``gate="softplus"`` keeps the raw projection
    ``a`` (and A_log, dt_bias) only: computing the log gate before the call keeps the log gate
    as the core's input and autodiff's residuals of softplus on top, at least one more
    gate-sized array (a per-channel gate is the size of k)."""
    import jax.numpy as jnp

    from gdngen.jax import gated_delta

    rng = np.random.default_rng(4)
    Tl = 64  # two of the variants' chunks; residuals scale with T (same ratios at T = 256)
    q, k = (rng.standard_normal((B, Tl, Hk, Dk)) for _ in range(2))
    # unit keys keep the recurrence bounded (|k|^2 = Dk lets y grow past 1e23 over 256 steps,
    # where a one-ulp difference between libm's and XLA's exp grows past any tolerance)
    q, k = (jnp.asarray(x, jnp.float32) for x in (q, k / np.linalg.norm(k, axis=-1,
                                                                          keepdims=True)))
    v = jnp.asarray(rng.standard_normal((B, Tl, Hv, Dv)), jnp.float32)
    a = jnp.asarray(rng.standard_normal((B, Tl, Hv) + ((Dk,) if vector else ())), jnp.float32)
    beta = jnp.asarray(rng.uniform(0, 1, (B, Tl, Hv)), jnp.float32)
    A_log = jnp.asarray(rng.standard_normal((Hv, 1) if vector else (Hv,)) * 0.5, jnp.float32)
    dt_bias = jnp.asarray(rng.standard_normal((Hv, Dk) if vector else (Hv,)), jnp.float32)
    variant = _fusing_variant("jax", backend, 0)

    def fused(a, A_log, dt_bias):
        return gated_delta(q, k, v, a, beta, gate="softplus", A_log=A_log, dt_bias=dt_bias,
                           variant=variant)

    def outside(a, A_log, dt_bias):
        log_g = layer_inputs.log_gate(prepare.namespace("jax"), a, A_log, dt_bias)
        return gated_delta(q, k, v, log_g, beta, variant=variant)

    outside_out, outside_bytes = _residual_bytes(outside, a, A_log, dt_bias)
    fused_out, fused_bytes = _residual_bytes(fused, a, A_log, dt_bias)
    saved = outside_bytes - fused_bytes
    # measured: 5.25 gate-sized arrays (log g, then softplus's exp / sigmoid factors)
    assert saved >= 2 * a.nbytes, (saved, a.nbytes)
    for got, want in zip(fused_out, outside_out):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)
