"""Tests for gdngen.validate: the reference passes the battery, broken runners fail as named."""

from __future__ import annotations

import json
import math

import ml_dtypes
import numpy as np
import pytest
from spies import spy_calls

from gdngen import validate
from gdngen.algebra import reference
from gdngen.cases import BATTERY, get_case


def reference_runner(inputs, *, gate, dtype, chunk_size, scale):
    """A runner that is the float64 reference itself (ignores dtype and chunk_size)."""
    arrays = (inputs["q"], inputs["k"], inputs["v"], inputs["g"], inputs["beta"],
              inputs["initial_state"], inputs["dy"], inputs["dfinal_state"])
    if inputs.get("cu_seqlens") is not None:
        return reference.packed_vjp(*arrays, inputs["cu_seqlens"], mask=inputs["mask"],
                                    scale=scale, gate=gate)
    return reference.vjp(*arrays, mask=inputs["mask"], scale=scale, gate=gate)


def float32_output_runner(inputs, **kwargs):
    """The reference with every output rounded to float32: a near-perfect float32 backend."""
    out = reference_runner(inputs, **kwargs)
    return {key: validate.round_to_dtype(val, "float32") for key, val in out.items()}


@pytest.fixture(scope="module")
def battery_results():
    return validate.run_battery(float32_output_runner, dtype="float32", seed=0)


def test_reference_passes_every_case_at_float32(battery_results):
    assert [r.case for r in battery_results] == [c.name for c in BATTERY]
    for res in battery_results:
        assert res.passed, (res.case, res.worst)
        assert set(res.errors) == set(validate.QUANTITIES), res.case
        assert res.worst[1] < 1e-6
        assert res.tolerance == 5e-5


def test_reference_runner_is_exact_at_bfloat16():
    res = validate.check_case(reference_runner, "gates_exact_one_and_zero", dtype="bfloat16")
    assert res.passed and res.tolerance == 2e-2
    assert all(err == 0.0 for err in res.errors.values())


def test_format_table_and_json(battery_results):
    failing = validate.CaseResult("broken", "float32", {"y": 1e-7, "dq": math.inf,
                                                       "dg": math.nan}, 5e-5)
    results = [*battery_results, failing]
    table = validate.format_table(results)
    for case in BATTERY:
        assert case.name in table
    for quantity in validate.QUANTITIES:
        assert quantity in table
    assert "PASS" in table and "FAIL" in table
    rows = validate.results_to_json(results)
    json.dumps(rows)
    assert rows[-1]["passed"] is False
    assert rows[-1]["worst"]["quantity"] == "dg" and rows[-1]["errors"]["dq"] == "inf"
    assert rows[0]["passed"] is True and rows[0]["case"] == BATTERY[0].name


def _perturbed(quantity, *, gate=None, factor=1.0 + 1e-3, zero=False, nan=False):
    """A runner returning the reference with one quantity broken (for one gate, or both)."""
    def runner(inputs, **kwargs):
        out = reference_runner(inputs, **kwargs)
        if gate is None or kwargs["gate"] == gate:
            x = np.array(out[quantity])
            if zero:
                x[...] = 0.0
            elif nan:
                x.flat[3] = np.nan
            else:
                x *= factor
            out[quantity] = x
        return out
    return runner


@pytest.mark.parametrize("runner, quantity", [
    (_perturbed("dg", gate="linear"), "dg_linear"),
    (_perturbed("dg", gate="log"), "dg"),
    (_perturbed("dbeta", zero=True), "dbeta"),
    (_perturbed("dq", nan=True), "dq"),
    (_perturbed("dinitial_state", gate="linear"), "dinitial_state"),
])
def test_broken_runner_fails_naming_quantity(runner, quantity):
    res = validate.check_case(runner, "initial_state", seed=3)
    assert not res.passed
    assert res.worst[0] == quantity
    others = {q: e for q, e in res.errors.items() if q != quantity}
    assert all(e == 0.0 for e in others.values()), others


def test_dg_linear_perturbation_is_measured():
    res = validate.check_case(_perturbed("dg", gate="linear"), "mild_decay", seed=1)
    assert res.errors["dg_linear"] == pytest.approx(1e-3, rel=1e-6)
    assert res.errors["dg"] == 0.0


def test_runner_without_beta_term_fails():
    """A runner that forgets beta (uses beta = 1) fails on y and the gradients."""
    def no_beta_runner(inputs, **kwargs):
        return reference_runner(dict(inputs, beta=np.ones_like(inputs["beta"])), **kwargs)
    res = validate.check_case(no_beta_runner, "mild_decay", seed=0)
    assert not res.passed
    assert res.errors["y"] > 1e-2 and res.errors["dbeta"] > 1e-2


def test_runner_ignoring_mask_fails_on_padding():
    def no_mask_runner(inputs, **kwargs):
        return reference_runner(dict(inputs, mask=None), **kwargs)
    res = validate.check_case(no_mask_runner, "padding_mask", seed=0)
    assert not res.passed and res.errors["y"] > 1e-2


def test_runner_sees_rounded_inputs_case_scale_and_chunk_size():
    seen, q_norms = [], []

    def spy(inputs, *, gate, dtype, chunk_size, scale):
        seen.append((gate, dtype, chunk_size, scale))
        q_norms.append(float(np.linalg.norm(inputs["q"])))
        for key in ("q", "k", "v", "g", "beta", "dy", "dfinal_state"):
            np.testing.assert_array_equal(inputs[key], validate.round_to_dtype(inputs[key],
                                                                             "bfloat16"))
        assert inputs["initial_state"].dtype == np.float64
        np.testing.assert_array_equal(inputs["initial_state"],
                                      validate.round_to_dtype(inputs["initial_state"], "float32"))
        assert "g_log" not in inputs
        if gate == "linear":
            assert np.all((inputs["g"] >= 0.0) & (inputs["g"] <= 1.0))
        out = reference_runner(inputs, gate=gate, dtype=dtype, chunk_size=chunk_size,
                               scale=scale)
        inputs["q"][...] = 0.0  # mutating its copy must not reach the next run
        return out

    case = get_case("t1")
    res = validate.check_case(spy, case, dtype="bfloat16", seed=0)
    assert res.passed and res.worst[1] == 0.0
    assert seen == [("log", "bfloat16", 64, case.scale), ("linear", "bfloat16", 64, case.scale)]
    assert q_norms[0] > 0 and q_norms[0] == q_norms[1]
    seen.clear()
    validate.run_battery(spy, dtype="bfloat16", cases=["t1"], seed=0, chunk_size=16)
    assert [s[2] for s in seen] == [16, 16]


def test_backend_name_resolves_through_runner_for(monkeypatch):
    monkeypatch.setattr(validate, "runner_for",
                        lambda name: reference_runner if name == "fake" else None)
    (res,) = validate.run_battery("fake", cases=["short"], seed=0)
    assert res.passed and res.case == "short"


def test_registered_backend_runner_runs_that_backend():
    """The runner of a backend name runs that backend's default variant (not whatever a plain
    call would dispatch to)."""
    runner = validate.runner_for("xla")
    assert runner.backend == "xla"
    (res,) = validate.run_battery("xla", cases=["short"], seed=0)
    assert res.passed


@pytest.mark.parametrize("recurrent_below", [64, 0])
def test_runner_checks_the_path_the_call_did_not_take(monkeypatch, recurrent_below):
    """"short" is T = 37: below a crossover of 64 the differentiated call's forward is the
    recurrent loop and the other-path call forces the chunk path; with 0 the reverse. Both
    forwards meet the reference, and each path runs forward-only once per gate convention."""
    from gdngen import registry
    from gdngen.backends.portable import mlx_chunkwise
    from gdngen.problem import Problem

    calls = spy_calls(monkeypatch, mlx_chunkwise,
                      ("recurrent_gated_delta", "chunkwise_gated_delta"))
    case = get_case("short")
    variant = registry.default_variant("mlx", Problem(case.Hk, case.Hv, case.Dk, case.Dv))
    (res,) = validate.run_battery("mlx", cases=["short"], seed=0,
                                  variant=variant.replace(recurrent_below=recurrent_below))
    assert res.passed and {"y_other_path", "final_state_other_path"} <= set(res.errors)
    assert res.errors["y_other_path"] <= 5e-5 and res.errors["final_state_other_path"] <= 5e-5
    assert not set(validate.STATE_QUANTITIES) & set(res.errors)  # "short": no states checked
    # per gate convention: recurrent forward + chunk VJP, plus the chunk forward alone (64);
    # chunk forward + VJP, plus the recurrent forward alone (0); "short" checks no returned
    # states (`Case.states`), so no step loop of a return_states="steps" window
    assert calls.count("recurrent_gated_delta") == 2
    assert calls.count("chunkwise_gated_delta") == (4 if recurrent_below else 2)


def test_missing_dinitial_state_skipped_only_without_initial_state():
    def no_dinit(inputs, **kwargs):
        return dict(reference_runner(inputs, **kwargs), dinitial_state=None)
    res = validate.check_case(no_dinit, "short", seed=0)
    assert res.passed and "dinitial_state" not in res.errors
    res = validate.check_case(no_dinit, "initial_state", seed=0)
    assert not res.passed and res.worst == ("dinitial_state", math.inf)


def test_tolerance():
    assert validate.tolerance("float32") == 5e-5
    assert validate.tolerance("bfloat16") == 2e-2
    assert validate.tolerance("float16") == 2e-2
    with pytest.raises(ValueError):
        validate.tolerance("int8")


def test_relative_error_edge_cases():
    ref = np.array([3.0, 4.0])
    assert validate.relative_error(ref, ref) == 0.0
    assert validate.relative_error(np.array([3.0, 4.5]), ref) == pytest.approx(0.1)
    assert validate.relative_error(np.array([3.0, np.nan]), ref) == math.inf
    assert validate.relative_error(np.array([3.0, np.inf]), ref) == math.inf
    assert validate.relative_error(np.array([3.0, 4.0, 0.0]), ref) == math.inf
    assert validate.relative_error(ref.reshape(2, 1), ref) == math.inf
    assert validate.relative_error(None, ref) == math.inf
    assert validate.relative_error(np.zeros(2), np.zeros(2)) == 0.0
    assert validate.relative_error(np.array([0.0, 1e-3]), np.zeros(2)) == pytest.approx(1e-3)
    assert validate.relative_error(np.float32([3.0, 4.0]), ref) == 0.0
    # with a scale: over the larger of ||ref|| and ||scale||
    assert validate.relative_error(np.array([3.0, 4.5]), ref, np.zeros(2)) == pytest.approx(0.1)
    assert validate.relative_error(np.array([1e-3, 0.0]), np.zeros(2), np.array([0.0, 2.0])) \
        == pytest.approx(5e-4)
    assert validate.relative_error(np.array([3.0, np.nan]), ref, ref) == math.inf
    with pytest.raises(ValueError):
        validate.relative_error(ref, np.array([np.nan, 1.0]))


def test_a_cancelling_parameter_sum_is_measured_against_its_terms():
    """dA_log sums dg * log g over every step: where the sum cancels, a float32 sum's error
    is ulp-sized against its terms' size (`LayerInputsVJP.reduction_scales`: their root sum
    of squares), not against the sum; a sum that drops a step's term is still far off."""
    rng = np.random.default_rng(5)
    B, T, Hv, D = 1, 64, 2, 8
    q, k = (rng.standard_normal((B, T, 1, D)) for _ in range(2))
    layer = reference.LayerInputsVJP(q, k, rng.standard_normal((B, T, Hv)),
                                     np.zeros((B, T, Hv)), rng.uniform(-1, 2, Hv),
                                     rng.uniform(-0.5, 0.5, Hv), "softplus")
    dg = rng.standard_normal((B, T, Hv))  # head 0's terms sum to (nearly) zero
    terms = dg * layer.log_g
    dg[0, -1, 0] = -terms[0, :-1, 0].sum() / layer.log_g[0, -1, 0]
    terms = dg * layer.log_g
    ref = layer.grads({"dq": q, "dk": k, "dg": dg, "dbeta": np.zeros((B, T, Hv))})["dA_log"]
    scale = layer.reduction_scales(np.abs(dg))["dA_log"]
    assert abs(ref[0]) < 1e-9 * scale[0] and abs(ref[1]) > 0.1 * scale[1]
    in_float32 = terms.astype(np.float32).sum(axis=(0, 1), dtype=np.float32)
    assert validate.relative_error(in_float32[:1], ref[:1]) > 1e-3  # its own digits: gone
    assert validate.relative_error(in_float32[:1], ref[:1], scale[:1]) < 1e-6
    assert validate.relative_error(in_float32, ref, scale) < 1e-6
    dropped = terms[:, 1:].sum(axis=(0, 1))
    assert validate.relative_error(dropped, ref, scale) > 1e-3


def test_round_to_dtype_bfloat16():
    x = np.array([1.0, 1.0 + 2.0**-7, 1.0 + 2.0**-9, 3.14159265, -np.inf, 0.0, 1e-30])
    r = validate.round_to_dtype(x, "bfloat16")
    assert r.dtype == np.float64
    assert r[0] == 1.0 and r[1] == 1.0 + 2.0**-7  # representable: 8 significant bits
    assert r[2] == 1.0  # below half an ulp: rounds away
    assert r[3] == 3.140625
    assert r[4] == -np.inf and r[5] == 0.0
    np.testing.assert_array_equal(r, x.astype(ml_dtypes.bfloat16).astype(np.float64))
    np.testing.assert_array_equal(validate.round_to_dtype(r, "bfloat16"), r)  # idempotent
    assert validate.round_to_dtype(x, "float32")[3] == np.float32(3.14159265)
    assert validate.round_to_dtype(x, "float16")[3] == np.float16(3.14159265)
    assert validate.round_to_dtype(None, "bfloat16") is None
    with pytest.raises(ValueError):
        validate.round_to_dtype(x, "int4")


def test_case_result_properties():
    res = validate.CaseResult("c", "float32", {"y": 1e-6, "dq": 4e-5}, 5e-5)
    assert res.passed and res.worst == ("dq", 4e-5)
    res.errors["dk"] = 6e-5
    assert not res.passed and res.worst == ("dk", 6e-5)
    res.errors["dv"] = math.nan
    assert not res.passed and res.worst[0] == "dv"


@pytest.mark.parametrize("broken", ["step_states", "chunk_states"])
def test_wrong_returned_states_fail_the_case(monkeypatch, broken):
    """A backend whose returned states are off by one (the "steps" loop's states a step late,
    the checkpoints a chunk early) passes on y and every gradient, and fails the case on that
    quantity: the battery validates the returned states too."""
    from gdngen.algebra import states
    from gdngen.backends.portable import mlx_chunkwise

    if broken == "step_states":
        loop = mlx_chunkwise.recurrent_gated_delta

        def late(*args, steps=False, **kwargs):
            y, s = loop(*args, steps=steps, **kwargs)
            if steps:  # each step's slot holds the state before it
                import mlx.core as mx

                s = mx.concatenate([args[5][:, None], s[:, :-1]], axis=1)
            return y, s

        monkeypatch.setattr(mlx_chunkwise, "recurrent_gated_delta", late)
    else:
        boundary = states.boundary_states
        monkeypatch.setattr(states, "boundary_states",
                            lambda xp, entering, final, m: boundary(
                                xp, xp.module.concatenate([entering[:, :1], entering[:, :-1]],
                                                          axis=1), final, m))
    result = validate.check_case("mlx", "ragged", seed=0)
    assert not result.passed and result.worst[0] == broken, result.errors
    assert all(err <= 5e-5 for name, err in result.errors.items() if name != broken)
