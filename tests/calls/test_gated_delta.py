"""The public ``gated_delta`` of both frameworks against the float64 reference and its contract."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from slow import marked

from gdngen import validate
from gdngen.algebra import recurrent, reference
from gdngen.cases import BATTERY, get_case

FRAMEWORKS = ("jax", "mlx")
BACKEND_OF = {"jax": "xla", "mlx": "mlx"}


class Framework:
    """Minimal per-framework adapter: arrays in/out and a jit/compile wrapper."""

    def __init__(self, name):
        self.name = name
        if name == "jax":
            import jax
            import jax.numpy as jnp

            import gdngen.jax

            self.jax, self.jnp = jax, jnp
            self.gated_delta = gdngen.jax.gated_delta
            self.dtypes = {"float32": jnp.float32, "bfloat16": jnp.bfloat16,
                           "float16": jnp.float16, "float64": jnp.float32}
        else:
            import mlx.core as mx

            import gdngen.mlx

            self.mx = mx
            self.gated_delta = gdngen.mlx.gated_delta
            self.dtypes = {"float32": mx.float32, "bfloat16": mx.bfloat16,
                           "float16": mx.float16, "float64": mx.float32}

    def array(self, x, dtype="float32"):
        x = np.asarray(x)
        if x.dtype == bool:
            return self.jnp.asarray(x) if self.name == "jax" else self.mx.array(x)
        if self.name == "jax":
            return self.jnp.asarray(x, self.dtypes[dtype])
        return self.mx.array(x.astype(np.float32)).astype(self.dtypes[dtype])

    def numpy(self, x):
        if self.name == "mlx":
            x = x.astype(self.mx.float32)
        return np.asarray(x, np.float64)

    def dtype_name(self, x):
        return str(x.dtype).replace("mlx.core.", "")

    def compiled(self, fn):
        return self.jax.jit(fn) if self.name == "jax" else self.mx.compile(fn)


@pytest.fixture(params=FRAMEWORKS)
def fw(request):
    return Framework(request.param)


def _inputs(B=1, T=20, Hk=2, Hv=4, Dk=16, Dv=16, seed=None):
    rng = np.random.default_rng(seed)
    k = rng.standard_normal((B, T, Hk, Dk))
    return {"q": rng.standard_normal((B, T, Hk, Dk)),
                "k": k / np.linalg.norm(k, axis=-1, keepdims=True),
                "v": rng.standard_normal((B, T, Hv, Dv)),
                "g": -rng.uniform(0.01, 1.0, (B, T, Hv)),
                "beta": rng.uniform(0, 1, (B, T, Hv)),
                "initial_state": rng.standard_normal((B, Hv, Dv, Dk))}


#: the cases xla runs in `make test` (each ~15-40 s of compiling on JAX): the hard ones of every
#: kind (decay, exact gates, identical keys, GVA, T = 1, ragged T, masks, per-channel exact
#: the rest in `make test-all`. mlx's whole battery (test_conformance) runs every case, packed
#: and per-channel ones included, on the same framework-neutral chunk algebra in `make test`,
#: and test_packed / test_chunkwise_channel run xla's packed and per-channel chunk paths (the
#: latter at strong decay with exact zeros and ones, both conventions, against the reference).
#: xla's share of the battery in `make test` (the rest behind slow: mlx's whole battery runs the
#: same framework-neutral algebra; xla's GVA, padding and ragged calls run in test_recurrent's
#: short_masked and test_packed's packed_long_masked)
FAST_HERE = ("strong_decay", "gates_exact_one_and_zero", "t1")
SLOW_HERE = {c.name for c in BATTERY} - set(FAST_HERE)
assert set(FAST_HERE) <= {c.name for c in BATTERY}, "FAST_HERE names a case not in the battery"


@pytest.mark.parametrize("case", [pytest.param(c.name, marks=pytest.mark.slow)
                                  if c.name in SLOW_HERE else c.name for c in BATTERY])
def test_battery_float32(case):
    """Every battery case at float32 thresholds (5e-5 for y, state and every gradient) on JAX's
    portable path, xla (mlx's whole battery runs in test_conformance)."""
    result = validate.check_case("xla", get_case(case), dtype="float32")
    assert result.passed, validate.format_table([result])
    assert set(result.errors) >= set(validate.QUANTITIES) - {"dinitial_state"}


# xla keeps [jax-hard_decay-bfloat16] and [jax-hard_decay-float16]; gva3 and padding_mask run
# in float32 on every backend and in both reduced precisions on mlx (the same framework-neutral
# algebra), their reduced-precision xla runs in make test-all
@pytest.mark.parametrize(("fw", "case", "dtype"), marked(
    [(f, c, d) for f in FRAMEWORKS for c in ("hard_decay", "padding_mask", "gva3")
     for d in ("bfloat16", "float16")],
    {("jax", c, d) for c in ("gva3", "padding_mask") for d in ("bfloat16", "float16")}),
    indirect=["fw"])
def test_battery_reduced_precision(fw, case, dtype):
    """Reduced-precision inputs (float32 accumulation) meet the 2e-2 threshold."""
    result = validate.check_case(BACKEND_OF[fw.name], get_case(case), dtype=dtype)
    assert result.passed, validate.format_table([result])


# JAX's in make test-all (chunk 32 on xla: test_recurrent's short_masked); mlx keeps them
@pytest.mark.parametrize(("fw", "chunk_size"), marked(
    [(f, c) for f in FRAMEWORKS for c in (16, 32, 128)],
    {("jax", 16), ("jax", 32), ("jax", 128)}), indirect=["fw"])
def test_chunk_sizes(fw, chunk_size):
    result = validate.check_case(BACKEND_OF[fw.name], get_case("ragged"), chunk_size=chunk_size)
    assert result.passed, validate.format_table([result])


@pytest.mark.parametrize("path", ["recurrent", "chunkwise"])
@pytest.mark.parametrize("dims", [(16, 256), (256, 16), (48, 80)])
def test_head_dims(fw, dims, path):
    """Any Dk, Dv in 16..256, not only powers of two, agree with the reference, on both paths
    of the recurrent switch (MLX's step loop sums its state-vector products in blocks of 16
    past Dk = 16, `gdngen.backends.portable.mlx_chunkwise.XP.dot_last`: Dk 16 one sum, 48 and 256
    split)."""
    from gdngen import registry
    from gdngen.config import RECURRENT_ALWAYS
    from gdngen.problem import Problem

    Dk, Dv = dims
    x = _inputs(T=9, Dk=Dk, Dv=Dv)
    variant = registry.default_variant(BACKEND_OF[fw.name], Problem(2, 4, Dk, Dv)).replace(
        recurrent_below=RECURRENT_ALWAYS if path == "recurrent" else 0)
    y, S = fw.gated_delta(*(fw.array(x[n]) for n in ("q", "k", "v", "g", "beta",
                                                       "initial_state")), scale=Dk ** -0.5,
                          variant=variant)
    y_ref, S_ref = reference.forward(*(x[n] for n in ("q", "k", "v", "g", "beta",
                                                        "initial_state")), scale=Dk ** -0.5)
    assert validate.relative_error(fw.numpy(y), y_ref) < 5e-6
    assert validate.relative_error(fw.numpy(S), S_ref) < 5e-6


def test_short_chunk_is_the_call_length():
    """A call shorter than the variant's chunk is one chunk of its own length, rounded up to
    whole per-channel sub-chunks past `SUB_CHUNK`; longer calls keep the variant's chunk."""
    from gdngen.backends.portable import SUB_CHUNK, short_chunk

    assert [short_chunk(T, 64) for T in (1, 5, SUB_CHUNK)] == [1, 5, SUB_CHUNK]
    assert short_chunk(13, 64) == 16 and short_chunk(31, 32) == 32
    assert short_chunk(64, 64) == 64 and short_chunk(1000, 32) == 32


@pytest.mark.parametrize("vector", [False, True], ids=["scalar", "vector"])
@pytest.mark.parametrize("T", [5, 13])
def test_short_call_in_one_chunk_of_its_length(fw, T, vector, monkeypatch):
    """T = 5 (a chunk of 5) and T = 13 (a chunk of 16) on the portable chunk path
    (recurrent_below = 0): y, the state and every gradient against the float64 reference;
    the chunk core sees the short chunk, not the variant's."""
    import importlib

    from gdngen import Variant

    backend = BACKEND_OF[fw.name]
    ops = importlib.import_module(f"gdngen.backends.portable.{'jax' if fw.name == 'jax' else 'mlx'}"
                                  "_chunkwise")
    seen = []
    real = ops.chunkwise_gated_delta

    def spy(*args, **kwargs):
        seen.append(kwargs["chunk_size"])
        return real(*args, **kwargs)

    monkeypatch.setattr(ops, "chunkwise_gated_delta", spy)
    x = _inputs(T=T, seed=T)
    if vector:
        x["g"] = -np.random.default_rng(T).uniform(0.01, 3.0, x["k"].shape[:2] + (4, 16))
    rng = np.random.default_rng(T + 1)
    dy, dS = rng.standard_normal(x["v"].shape), rng.standard_normal(x["initial_state"].shape)
    variant = Variant(backend, {"chunk_size": 32, "solve_block": 8, "save_states": True,
                                "recurrent_below": 0})
    names = ("q", "k", "v", "g", "beta", "initial_state")

    def run(*args):
        return fw.gated_delta(*args, scale=0.25, variant=variant)

    args = [fw.array(x[n]) for n in names]
    if fw.name == "jax":
        out, pullback = fw.jax.vjp(run, *args)
        grads = pullback((fw.array(dy), fw.array(dS)))
    else:
        out, grads = fw.mx.vjp(run, args, [fw.array(dy), fw.array(dS)])
    ref = reference.vjp(*(x[n] for n in names), dy, dS, scale=0.25)
    errors = {n: validate.relative_error(fw.numpy(a), ref[n])
              for n, a in zip(("y", "final_state"), out)}
    errors.update({n: validate.relative_error(fw.numpy(a), ref[n])
                   for n, a in zip(("dq", "dk", "dv", "dg", "dbeta", "dinitial_state"), grads)})
    assert max(errors.values()) < 5e-6, errors
    assert seen and set(seen) == {5 if T == 5 else 16}, seen


@pytest.mark.parametrize("vector", [False, True], ids=["scalar", "vector"])
def test_decode_step_is_one_compiled_call_with_gradients(vector, monkeypatch):
    """MLX, T = 1 on the recurrent path (GVA 2, a masked-out step and a live one): y and the
    state against the float64 reference; the step's ops are traced once for three calls of one
    shape (the compiled single step, `recurrent_or_chunkwise`), and the gradients (the chunk
    path's VJP through the compiled custom function) match the reference."""
    import mlx.core as mx

    from gdngen import Variant

    SCALE = 0.2371  # a scale no other test uses: this test's compiled step is its own
    gdngen_mlx = Framework("mlx").gated_delta

    traced = []
    real = recurrent.single_step
    monkeypatch.setattr(recurrent, "single_step",
                        lambda *a: traced.append(a[1].shape) or real(*a))
    variant = Variant("mlx", {"chunk_size": 16, "solve_block": 8, "save_states": False,
                              "recurrent_below": 2})
    names = ("q", "k", "v", "g", "beta", "initial_state")
    for seed in (1, 2, 3, 4, 5):
        x = _inputs(B=2, T=1, seed=seed)
        if vector:
            x["g"] = -np.random.default_rng(seed).uniform(0.01, 3.0, (2, 1, 4, 16))
        y, S = gdngen_mlx(*(mx.array(x[n].astype(np.float32)) for n in names), scale=SCALE,
                          variant=variant)
        y_ref, S_ref = reference.forward(*(x[n] for n in names), scale=SCALE)
        assert validate.relative_error(np.asarray(y, np.float64), y_ref) < 5e-6
        assert validate.relative_error(np.asarray(S, np.float64), S_ref) < 5e-6
        if seed == 2:
            warm = len(traced)
    assert traced and len(traced) == warm, traced  # nothing traced after the warm-up
    rng = np.random.default_rng(7)
    dy, dS = rng.standard_normal(x["v"].shape), rng.standard_normal(x["initial_state"].shape)
    mask = np.array([[True], [False]])
    out, grads = mx.vjp(
        lambda *a: gdngen_mlx(*a, scale=SCALE, variant=variant, mask=mx.array(mask)),
        [mx.array(x[n].astype(np.float32)) for n in names],
        [mx.array(dy.astype(np.float32)), mx.array(dS.astype(np.float32))])
    ref = reference.vjp(*(x[n] for n in names), dy, dS, scale=SCALE, mask=mask)
    for name, got in zip(("y", "final_state", "dq", "dk", "dv", "dg", "dbeta",
                          "dinitial_state"), (*out, *grads)):
        assert validate.relative_error(np.asarray(got, np.float64), ref[name]) < 5e-6, name


def test_dtypes_of_outputs(fw):
    x = _inputs()
    args = [fw.array(x[n], "bfloat16") for n in ("q", "k", "v", "g", "beta")]
    y, S = fw.gated_delta(*args)
    assert fw.dtype_name(y) == "bfloat16"
    assert fw.dtype_name(S) == "float32"
    assert y.shape == (1, 20, 4, 16) and S.shape == (1, 4, 16, 16)


def test_compiled_matches_eager(fw):
    """Works under jax.jit / mx.compile with identical results."""
    x = _inputs(T=70)
    args = [fw.array(x[n]) for n in ("q", "k", "v", "g", "beta", "initial_state")]

    def f(*a):
        return fw.gated_delta(*a, scale=0.25, chunk_size=32)

    eager, compiled = f(*args), fw.compiled(f)(*args)
    for a, b in zip(eager, compiled):
        np.testing.assert_allclose(fw.numpy(a), fw.numpy(b), rtol=1e-5, atol=1e-6)


def test_linear_gate_zero_and_log_gate_minus_inf_agree(fw):
    x = _inputs(T=40)
    x["g"][0, 5, 0] = -np.inf
    x["g"][0, 33, 1] = -np.inf
    names = ("q", "k", "v", "beta", "initial_state")
    log_out = fw.gated_delta(*(fw.array(x[n]) for n in names[:3]), fw.array(x["g"]),
                             fw.array(x["beta"]), fw.array(x["initial_state"]), gate="log")
    lin_out = fw.gated_delta(*(fw.array(x[n]) for n in names[:3]), fw.array(np.exp(x["g"])),
                             fw.array(x["beta"]), fw.array(x["initial_state"]), gate="linear")
    for a, b in zip(log_out, lin_out):
        a, b = fw.numpy(a), fw.numpy(b)
        assert np.isfinite(a).all()
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(("name", "shape", "message"), [
    ("q", (1, 20, 2, 16, 1), "q has shape"),
    ("k", (1, 20, 2, 17), "k has shape (1, 20, 2, 17), expected (1, 20, 2, 16)"),
    ("v", (1, 20, 3, 16), ("v has shape (1, 20, 3, 16), expected (1, 20, Hv, Dv) with Hv a "
                          "multiple of Hk=2")),
    ("g", (1, 20, 3), "g has shape (1, 20, 3), expected (1, 20, 4) or (1, 20, 4, 16)"),
    ("beta", (1, 19, 4), "beta has shape (1, 19, 4), expected (1, 20, 4)"),
    ("initial_state", (1, 4, 16, 8), "initial_state has shape (1, 4, 16, 8)"),
])
def test_shape_errors_name_the_argument(fw, name, shape, message):
    x = _inputs()
    x[name] = np.zeros(shape)
    args = [fw.array(x[n]) for n in ("q", "k", "v", "g", "beta", "initial_state")]
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        fw.gated_delta(*args)


def test_head_dim_out_of_range_and_bad_options(fw):
    x = _inputs(Dk=16)
    args = [fw.array(x[n]) for n in ("q", "k", "v", "g", "beta")]
    with pytest.raises(ValueError, match="gate must be one of"):
        fw.gated_delta(*args, gate="exp")
    with pytest.raises(ValueError, match="chunk_size must be a positive int"):
        fw.gated_delta(*args, chunk_size=0)
    with pytest.raises(ValueError, match="mask has shape"):
        fw.gated_delta(*args, mask=fw.array(np.ones((1, 21), bool)))
    small = _inputs(Dk=16, Dv=8)
    with pytest.raises(ValueError, match="head dim in 16..256"):
        fw.gated_delta(*(fw.array(small[n]) for n in ("q", "k", "v", "g", "beta")))


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_import_isolation(framework):
    """``import gdngen.jax`` never imports mlx, and ``import gdngen.mlx`` never imports jax."""
    other = "mlx" if framework == "jax" else "jax"
    code = (f"import sys, gdngen.{framework}; "
            f"assert not any(m == '{other}' or m.startswith('{other}.') for m in sys.modules)")
    subprocess.run([sys.executable, "-c", code], check=True)
