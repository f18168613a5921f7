"""Tests for gdngen.cases: shapes, finiteness, normalised keys, each case's claimed statistics."""

from __future__ import annotations

import numpy as np
import pytest

from gdngen.cases import BATTERY, get_case

CASE_NAMES = [case.name for case in BATTERY]
REQUIRED = ("mild_decay", "strong_decay", "hard_decay", "gates_exact_one_and_zero",
            "identical_keys", "negative_eigenvalues", "gva3", "t1", "short", "ragged",
            "padding_mask", "initial_state", "vector_gate")


def test_battery_has_required_cases_with_descriptions():
    assert len(set(CASE_NAMES)) == len(CASE_NAMES)
    for name in REQUIRED:
        assert name in CASE_NAMES
    for case in BATTERY:
        assert len(case.description) > 15, case.name


def test_get_case_unknown_names_known_cases():
    assert get_case("hard_decay").name == "hard_decay"
    with pytest.raises(ValueError, match="identical_keys"):
        get_case("no_such_case")


@pytest.mark.parametrize("name", CASE_NAMES)
def test_shapes_dtypes_and_finiteness(name):
    case = get_case(name)
    x = case.inputs(seed=1)
    B, T, Hk, Hv, Dk, Dv = case.B, case.T, case.Hk, case.Hv, case.Dk, case.Dv
    expected = {"q": (B, T, Hk, Dk), "k": (B, T, Hk, Dk), "v": (B, T, Hv, Dv),
                "g_log": (B, T, Hv, Dk) if case.vector_gate else (B, T, Hv),
                "beta": (B, T, Hv), "dy": (B, T, Hv, Dv), "dfinal_state": (B, Hv, Dv, Dk)}
    assert set(x) == set(expected) | {"initial_state", "mask"}
    for key, shape in expected.items():
        assert x[key].shape == shape, key
        assert x[key].dtype == np.float64, key
        if key != "g_log":
            assert np.all(np.isfinite(x[key])), key
    assert not np.any(np.isnan(x["g_log"]))
    assert np.all(x["g_log"] <= 0.0)
    assert np.all(np.isfinite(x["g_log"]) | (x["g_log"] == -np.inf))
    if case.gates != "exact_one_and_zero":
        assert np.all(np.isfinite(x["g_log"]))
    if case.has_initial_state:
        assert x["initial_state"].shape == (B, Hv, Dv, Dk)
        assert x["initial_state"].dtype == np.float64
        assert np.all(np.isfinite(x["initial_state"]))
        assert np.linalg.norm(x["initial_state"]) > 0
    else:
        assert x["initial_state"] is None
    if case.padding:
        assert x["mask"].shape == (B, T) and x["mask"].dtype == bool
    else:
        assert x["mask"] is None
    # Cotangents are never zero.
    assert np.linalg.norm(x["dy"]) > 0 and np.linalg.norm(x["dfinal_state"]) > 0
    np.testing.assert_allclose(np.linalg.norm(x["k"], axis=-1), 1.0, rtol=1e-12)
    assert case.scale == pytest.approx(Dk ** -0.5)
    assert np.all((x["beta"] >= 0.0) & (x["beta"] <= 2.0))


@pytest.mark.parametrize("name", CASE_NAMES)
def test_fresh_randomness_and_seed_reproducibility(name):
    case = get_case(name)
    a, b = case.inputs(seed=7), case.inputs(seed=7)
    for key in a:
        if a[key] is None:
            assert b[key] is None
        else:
            np.testing.assert_array_equal(a[key], b[key])
    fresh1, fresh2 = case.inputs(), case.inputs()
    assert not np.array_equal(fresh1["q"], fresh2["q"])
    assert not np.array_equal(fresh1["dy"], fresh2["dy"])
    assert not np.array_equal(a["q"], case.inputs(seed=8)["q"])


def test_cases_differ_for_the_same_seed():
    assert not np.array_equal(get_case("ragged").inputs(0)["v"][:, :128],
                              get_case("initial_state").inputs(0)["v"])


def test_mild_decay_gates():
    g = get_case("mild_decay").inputs(0)["g_log"]
    assert np.all((g <= -0.01) & (g >= -0.1))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_strong_decay_mean_log_gate(seed):
    g = get_case("strong_decay").inputs(seed)["g_log"]
    assert abs(g.mean() + 8.5) < 1.0


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_hard_decay_chunk_sums_and_beta(seed):
    case = get_case("hard_decay")
    assert case.chunk_size == 64
    x = case.inputs(seed)
    g = x["g_log"]
    assert np.all((g >= -5.4) & (g <= 0.0))
    n_full = case.T // 64
    assert n_full >= 2
    sums = g[:, :n_full * 64].reshape(case.B, n_full, 64, case.Hv).sum(axis=2)
    assert np.all((sums > -220.0) & (sums < -120.0)), sums
    assert abs(sums.mean() + 172.8) < 15.0
    assert np.all((x["beta"] >= 0.85) & (x["beta"] <= 1.0))


def test_gates_exact_one_and_zero():
    case = get_case("gates_exact_one_and_zero")
    g = case.inputs(0)["g_log"]
    assert np.any(g == 0.0)
    assert np.any(g == -np.inf)
    ordinary = np.isfinite(g) & (g != 0.0)
    assert ordinary.mean() > 0.5
    assert g[0, 0, 0] == -np.inf  # resets the initial state of one head
    assert np.all(g[0, 64:128, 1] == 0.0)  # a whole chunk without decay
    assert np.all(np.exp(g)[g == -np.inf] == 0.0)


def test_identical_keys_within_chunks():
    case = get_case("identical_keys")
    assert case.chunk_size == 64 and case.T >= 128
    x = case.inputs(0)
    k = x["k"]
    for start in range(0, case.T, 64):
        block = k[:, start:start + 64]
        np.testing.assert_array_equal(block, np.broadcast_to(block[:, :1], block.shape))
    assert not np.array_equal(k[:, 0], k[:, 64])  # different chunks, different keys
    np.testing.assert_allclose(np.exp(x["g_log"]), 0.95, rtol=1e-15)
    np.testing.assert_array_equal(x["beta"], 1.0)
    assert x["initial_state"] is not None


def test_negative_eigenvalues_beta_range():
    beta = get_case("negative_eigenvalues").inputs(0)["beta"]
    assert np.all((beta >= 0.0) & (beta <= 2.0))
    assert beta.max() > 1.5 and np.mean(beta > 1.0) > 0.3


def test_shape_cases():
    assert (get_case("gva3").Hk, get_case("gva3").Hv) == (2, 6)
    assert get_case("t1").T == 1
    short = get_case("short")
    assert short.T < short.chunk_size
    ragged = get_case("ragged")
    assert ragged.T % ragged.chunk_size != 0 and ragged.T > 2 * ragged.chunk_size
    assert get_case("vector_gate").vector_gate


def test_padding_mask_layout():
    case = get_case("padding_mask")
    x = case.inputs(0)
    mask = x["mask"]
    assert not mask[0, 0] and mask[0, -1]  # left padding
    assert mask[1, 0] and not mask[1, -1]  # right padding
    for b in range(2):
        on = np.flatnonzero(mask[b])
        assert np.any(~mask[b, on[0]:on[-1] + 1])  # a hole in the middle
    assert x["initial_state"] is not None


def test_default_distributions():
    x = get_case("initial_state").inputs(0)
    assert np.all((x["beta"] > 0.0) & (x["beta"] < 1.0))
    assert abs(x["q"].std() - 1.0) < 0.05 and abs(x["v"].std() - 1.0) < 0.05
