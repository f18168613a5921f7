"""One conformance suite over the registry: every registered backend through the same scenarios.

Each test is parametrized over `gdngen.registry.names()`, so a backend added to the registry is
held to all of them without a line here: its declaration is consistent, its default variant
passes hard battery cases with poisoned outputs, it runs under jit / compile and vmap with a
mask and gradients, a bad variant is an error naming the field, its space fits every device it
targets, and it says what it does not implement. A backend's own test file keeps only what is
particular to it. Off-device the generated backends run in their interpret mode / simulator.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from generated_kernels import check_entry_point_under_jit, small_call_inputs

from gdngen import registry, tolerance, validate
from gdngen.cases import BATTERY, get_case
from gdngen.devices import DEVICES
from gdngen.problem import Problem
from gdngen.shape import FLOAT_DTYPES, FRAMEWORKS
from gdngen.variant import Variant

BACKENDS = registry.names()
#: a shape every backend implements (metal needs head dims that are multiples of 32).
PROBLEM = Problem(2, 4, 64, 64)
#: hard battery cases each backend's default variant passes in `make test` (a per-channel one
#: where the backend has per-channel gates); the whole battery runs behind the slow marker,
#: except on mlx (eager: no compile per shape)
HARD_CASES = ("ragged", "identical_keys", "gates_exact_one_and_zero", "padding_mask",
              "vector_t1")
#: a backend's share of HARD_CASES in `make test` where not all (pallas_tpu's Mosaic interpreter
#: takes ~40 s a case here; its ragged and padded calls run in test_recurrent's short_masked, T =
#: 37 at chunk 32 with a padding mask, and test_packed; the whole battery behind slow)
HARD_CASES_HERE = {"pallas_tpu": ("identical_keys", "gates_exact_one_and_zero")}
FAST_FULL_BATTERY = {"mlx"}
#: backends whose battery `make test` runs elsewhere: xla's in test_gated_delta (its FAST_HERE
#: hard cases; mlx's whole battery below covers every case), so no hard cases here
BATTERY_ELSEWHERE = {"xla"}
#: interpreted backends whose per-channel case in `make test` is elsewhere: their entry tests
#: (tests/backends/pallas/test_recurrent_pallas_*.py: a masked two-chunk GVA call, values and every
# gradient
#: through the kernel walks against the float64 reference); vector_t1 here would compile the
#: shared jnp stages in interpret mode once more (~35-65 s each); the whole battery is slow
VECTOR_ELSEWHERE = {"pallas_tpu", "pallas_gpu"}


def _spec(name):
    return registry.get(name)


def _framework_available(name) -> bool:
    import importlib.util

    return importlib.util.find_spec(_spec(name).framework) is not None


def _skip_unrunnable(name):
    if not _framework_available(name):
        pytest.skip(f"{_spec(name).framework} is not installed")
    ok, why = _spec(name).capability(PROBLEM)
    if not ok:
        pytest.skip(f"{name} cannot run here: {why}")


@pytest.fixture(autouse=True)
def _poisoned_outputs(monkeypatch):
    """ffi_cpu NaN-fills its outputs first; the Pallas interpret modes and the Metal simulator
    poison their buffers themselves."""
    from gdngen import settings

    monkeypatch.setenv(settings.ENV_POISON_OUTPUTS, "1")


def _check(results, variant, dtype="float32"):
    limit = tolerance.allowed_error(variant, dtype)
    bad = [(r.case, *r.worst) for r in results
           if not all(np.isfinite(e) and e <= limit for e in r.errors.values())]
    assert not bad, f"{variant} over {limit:g}: {bad}"


# ------------------------------------------------------------------------------ declaration


@pytest.mark.parametrize("name", BACKENDS)
def test_declaration_is_consistent(name):
    spec = _spec(name)
    assert spec.name == name and spec.framework in FRAMEWORKS
    assert set(spec.gates) <= {"scalar", "vector"} and set(spec.dtypes) <= set(FLOAT_DTYPES)
    assert set(spec.tolerances) == {"ieee", "tf32", "bf16"}
    assert spec.portable or spec.device_kinds, name
    fields = spec.config.field_names()
    assert "chunk_size" in fields
    assert not {"policy", "save", "chunk"} & set(fields)  # one name per meaning
    space = registry.variants(name, PROBLEM)
    default = registry.default_variant(name, PROBLEM)
    assert space and default in space
    if "vector" in spec.gates:  # per-channel defaults may differ (chunk, crossover)
        vector = dataclasses.replace(PROBLEM, gate="vector")
        assert registry.default_variant(name, vector) in registry.variants(name, vector)
    assert len({v.name() for v in space}) == len(space)
    assert registry.check_variant(default).params() == default.as_dict()
    assert spec.render(default, PROBLEM).sha256 == spec.render(default, PROBLEM).sha256


def test_exactly_one_portable_backend_per_framework():
    for framework in FRAMEWORKS:
        portable = [n for n in registry.names(framework) if _spec(n).portable]
        assert portable == [registry.portable(framework)]


def test_registry_import_pulls_in_no_framework():
    import subprocess
    import sys

    code = ("import sys; from gdngen import registry\n"
            "from gdngen.problem import Problem\n"
            "p = Problem(2, 4, 64, 64)\n"
            "[registry.variants(n, p) for n in registry.names()]\n"
            "print(sorted(m for m in ('jax', 'mlx') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.strip()
    assert out == "[]"


# ------------------------------------------------------------------------------ numerics


@pytest.mark.parametrize("name", [n for n in BACKENDS
                                  if n not in FAST_FULL_BATTERY | BATTERY_ELSEWHERE])
def test_default_variant_passes_hard_cases(name):
    """Every backend's share of the battery in `make test` but mlx's (which runs the whole
    battery below, hard cases included) and xla's (`BATTERY_ELSEWHERE`)."""
    _skip_unrunnable(name)
    variant = registry.default_variant(name, PROBLEM)
    vector = "vector" in _spec(name).gates and name not in VECTOR_ELSEWHERE
    cases = [c for c in HARD_CASES if (vector or not get_case(c).vector_gate)
             and c in HARD_CASES_HERE.get(name, HARD_CASES)]
    results = validate.run_battery(None, variant=variant, cases=cases)
    assert [r.case for r in results] == cases
    _check(results, variant)


@pytest.mark.parametrize("name", [pytest.param(n, marks=() if n in FAST_FULL_BATTERY
                                               else pytest.mark.slow) for n in BACKENDS])
def test_default_variant_passes_the_whole_battery(name):
    """Every case the backend implements (vector-gate cases only where it has vector gates)."""
    _skip_unrunnable(name)
    variant = registry.default_variant(name, PROBLEM)
    results = validate.run_battery(None, variant=variant)
    expected = [c.name for c in BATTERY if not c.vector_gate or "vector" in _spec(name).gates]
    assert [r.case for r in results] == expected
    _check(results, variant)


# ------------------------------------------------------------------------------ transformations


def _small_variant(name):
    """The default variant for the small entry-point call, at chunk 32 (several chunks)."""
    base = registry.default_variant(name, Problem(1, 2, 32, 32))
    return Variant(name, dict(base.as_dict(), chunk_size=32))


def _needs_transformations(name):
    _skip_unrunnable(name)
    if name == "metal":
        import mlx.core as mx

        if not mx.metal.is_available():
            pytest.skip("the Metal simulator runs kernels eagerly; mx.compile / mx.vmap of the "
                        "metal backend need an Apple GPU")


@pytest.mark.parametrize("name", BACKENDS)
def test_under_jit_with_mask_and_gradient(name):
    _needs_transformations(name)
    variant = _small_variant(name)
    if _spec(name).framework == "jax":
        check_entry_point_under_jit(variant, D=32)
        return
    import mlx.core as mx

    from gdngen.algebra import reference
    from gdngen.mlx import gated_delta

    q, k, v, g, beta, s0 = small_call_inputs(D=32)
    mask = np.ones((1, 20), bool)
    mask[0, 3:6] = False

    def loss(v, g):
        y, state = gated_delta(*(mx.array(x.astype(np.float32)) for x in (q, k)), v, g,
                               mx.array(beta.astype(np.float32)),
                               mx.array(s0.astype(np.float32)), mask=mx.array(mask),
                               scale=0.25, variant=variant)
        return mx.sum(y ** 2) + mx.sum(state)

    grad = mx.compile(mx.grad(loss, argnums=(0, 1)))
    dv, dg = grad(mx.array(v.astype(np.float32)), mx.array(g.astype(np.float32)))
    ref_y, ref_state = reference.forward(q, k, v, g, beta, s0, mask=mask, scale=0.25)
    ref = reference.vjp(q, k, v, g, beta, s0, 2 * ref_y, np.ones_like(ref_state), mask=mask,
                        scale=0.25)
    assert validate.relative_error(np.array(dv), ref["dv"]) < 1e-5
    assert validate.relative_error(np.array(dg), ref["dg"]) < 1e-5


@pytest.mark.parametrize("name", BACKENDS)
def test_vmap_matches_separate_calls(name):
    _needs_transformations(name)
    variant = _small_variant(name)
    calls = [small_call_inputs(D=32, seed=seed) for seed in (1, 2)]
    if _spec(name).framework == "jax":
        import jax
        import jax.numpy as jnp

        from gdngen.jax import gated_delta

        def as_array(x):
            return jnp.asarray(x, jnp.float32)

        vmap = jax.vmap
    else:
        import mlx.core as mx

        from gdngen.mlx import gated_delta

        def as_array(x):
            return mx.array(np.asarray(x, np.float32))

        vmap = mx.vmap
    stacked = [as_array(np.stack(xs)) for xs in zip(*calls)]
    ys, states = vmap(lambda *a: gated_delta(*a, variant=variant))(*stacked)
    for i, inputs in enumerate(calls):
        y, state = gated_delta(*(as_array(x) for x in inputs), variant=variant)
        np.testing.assert_allclose(np.asarray(ys[i]), np.asarray(y), rtol=2e-6, atol=2e-6)
        np.testing.assert_allclose(np.asarray(states[i]), np.asarray(state), rtol=2e-6,
                                   atol=2e-6)


# ------------------------------------------------------------------------------ bad input


@pytest.mark.parametrize("name", BACKENDS)
def test_bad_variant_is_an_error_naming_the_field(name):
    default = registry.default_variant(name, PROBLEM).as_dict()
    for field in default:
        bad = Variant(name, dict(default, **{field: "bogus"}))
        with pytest.raises(ValueError, match=f"{name} variant param {field} must be"):
            registry.check_variant(bad)
    missing = dict(default)
    missing.pop("chunk_size")
    with pytest.raises(ValueError, match=r"missing \['chunk_size'\]"):
        registry.check_variant(Variant(name, missing))
    with pytest.raises(ValueError, match=r"unknown \['tile'\]"):
        registry.check_variant(Variant(name, dict(default, tile=8)))


@pytest.mark.parametrize("name", BACKENDS)
def test_entry_point_rejects_a_bad_variant_before_running(name):
    if not _framework_available(name):
        pytest.skip(f"{_spec(name).framework} is not installed")
    arrays = _framework_arrays(_spec(name).framework, small_call_inputs(D=32))
    bad = Variant(name, dict(registry.default_variant(name, Problem(1, 2, 32, 32)).as_dict(),
                             chunk_size=-3))
    with pytest.raises(ValueError, match=f"{name} variant param chunk_size must be"):
        _entry(_spec(name).framework)(*arrays, variant=bad)


@pytest.mark.parametrize("name", BACKENDS)
def test_unimplemented_gate_kind_is_said(name):
    spec = _spec(name)
    vector = dataclasses.replace(PROBLEM, gate="vector")
    ok, why = spec.capability(vector)
    if "vector" in spec.gates:
        assert ok or "cannot run on this host" in why
        return
    assert not ok and "vector" in why


def test_a_dtype_the_backend_lacks_is_refused_at_bind_and_at_its_entry():
    """An explicit variant of a backend without the call's dtype (pallas_tpu: no float16) is
    a ValueError naming q's dtype, from the public call's one check (`gdngen.entry.bind`) and
    from the backend's own entry point (`gdngen.backend.Backend.checked_args`)."""
    from gdngen.backends.pallas import tpu as pallas_tpu
    from gdngen.jax import gated_delta

    q, k, v, g, beta, s0 = _framework_arrays("jax", small_call_inputs(D=32))
    q, k, v = (x.astype("float16") for x in (q, k, v))
    variant = registry.default_variant("pallas_tpu", Problem(1, 2, 32, 32))
    expected = r"q has dtype float16, expected one of \('float32', 'bfloat16'\)"
    with pytest.raises(ValueError, match=expected):
        gated_delta(q, k, v, g, beta, s0, variant=variant)
    with pytest.raises(ValueError, match=expected):
        pallas_tpu.gated_delta(q, k, v, g, beta, s0, variant=variant)


def _framework_arrays(framework, xs):
    if framework == "jax":
        import jax.numpy as jnp

        return [jnp.asarray(x, jnp.float32) for x in xs]
    import mlx.core as mx

    return [mx.array(np.asarray(x, np.float32)) for x in xs]


def _entry(framework):
    if framework == "jax":
        from gdngen.jax import gated_delta
    else:
        from gdngen.mlx import gated_delta
    return gated_delta


# ------------------------------------------------------------------------------ devices


@pytest.mark.parametrize("name", BACKENDS)
def test_space_fits_every_device_it_targets(name):
    """Each targeted device gets only the variants whose footprint fits its limit (e.g. no
    a100 variant over its 163 KiB of shared memory, no tpu-v4 variant over 16 MiB of VMEM);
    the default is in every device's space."""
    spec = _spec(name)
    targeted = [d for d in DEVICES.values() if d.kind in spec.device_kinds]
    assert targeted
    big = Problem(1, 8, 256, 256)
    sizes = {}
    for device in targeted:
        space = registry.variants(name, big, device.name)
        assert registry.default_variant(name, big, device.name) in space
        sizes[device.name] = len(space)
        assert name in registry.backends_for(device.name)
        if spec.device_limit is None:
            continue
        limit = device.limits[spec.device_limit]
        assert all(spec.footprint(v, big) <= limit for v in space), device.name
    if spec.device_limit is not None:
        full = spec.space(big, dataclasses.replace(targeted[0], limits={
            spec.device_limit: 2 ** 62}))
        limited = min(targeted, key=lambda d: d.limits[spec.device_limit])
        if any(spec.footprint(Variant(name, c.params()), big) > limited.limits[spec.device_limit]
               for c in full):
            assert sizes[limited.name] < len(full)
        other = next(d for d in DEVICES.values() if spec.device_limit not in d.limits)
        with pytest.raises(ValueError, match=f"has no {spec.device_limit} limit"):
            registry.variants(name, big, other.name)


@pytest.mark.parametrize("name", BACKENDS)
def test_device_prefers_its_generated_backend(name):
    spec = _spec(name)
    for device in (d for d in DEVICES.values() if d.kind in spec.device_kinds):
        order = registry.backends_for(device.name, spec.framework)
        assert name in order
        if not spec.portable:
            assert order.index(name) < order.index(registry.portable(spec.framework))
