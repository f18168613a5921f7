"""Tests for gdngen.cases: shapes, finiteness, normalised keys, each case's claimed statistics."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from gdngen.algebra import reference
from gdngen.cases import BATTERY, INF_GATE_KINDS, VECTOR_GATE_KINDS, Case, get_case

CASE_NAMES = [case.name for case in BATTERY]
REQUIRED = ("mild_decay", "strong_decay", "hard_decay", "gates_exact_one_and_zero",
            "identical_keys", "negative_eigenvalues", "gva3", "t1", "short", "ragged",
            "padding_mask", "initial_state", "vector_gate")
#: the per-channel-gate cases beyond vector_gate (issue 14)
VECTOR_CASES = ("vector_strong_half", "vector_exact_zero", "vector_masked_gva3", "vector_t1",
                "vector_identical_keys")


def test_battery_has_required_cases_with_descriptions():
    assert len(set(CASE_NAMES)) == len(CASE_NAMES)
    for name in REQUIRED + VECTOR_CASES:
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
    states = B if case.cu_seqlens is None else len(case.cu_seqlens) - 1  # one per sequence
    expected = {"q": (B, T, Hk, Dk), "k": (B, T, Hk, Dk), "v": (B, T, Hv, Dv),
                "g_log": (B, T, Hv, Dk) if case.vector_gate else (B, T, Hv),
                "beta": (B, T, Hv), "dy": (B, T, Hv, Dv), "dfinal_state": (states, Hv, Dv, Dk)}
    assert set(x) == set(expected) | {"initial_state", "mask", "cu_seqlens"}
    for key, shape in expected.items():
        assert x[key].shape == shape, key
        assert x[key].dtype == np.float64, key
        if key != "g_log":
            assert np.all(np.isfinite(x[key])), key
    assert not np.any(np.isnan(x["g_log"]))
    assert np.all(x["g_log"] <= 0.0)
    assert np.all(np.isfinite(x["g_log"]) | (x["g_log"] == -np.inf))
    if case.gates not in INF_GATE_KINDS:
        assert np.all(np.isfinite(x["g_log"]))
    if case.has_initial_state:
        assert x["initial_state"].shape == (states, Hv, Dv, Dk)
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


@pytest.mark.parametrize("name", CASE_NAMES)
def test_every_case_draws_for_one_value_head(name):
    """Each case's inputs draw at Hk = Hv = 1 (a first-use probe of a one-head problem): no
    case writes a fixed second head."""
    import dataclasses

    case = dataclasses.replace(get_case(name), Hk=1, Hv=1)
    x = case.inputs(0)
    assert x["v"].shape[2] == 1 and x["g_log"].shape[2] == 1
    assert np.isfinite(x["q"]).all()


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


# ------------------------------------------------------------------------------ per-channel gates


def test_vector_gate_kinds_need_a_vector_gate():
    for kind in VECTOR_GATE_KINDS:
        with pytest.raises(ValueError, match="needs vector_gate=True"):
            Case("bad", "a scalar case drawing a per-channel kind", B=1, T=8, Hk=1, Hv=1,
                 Dk=32, Dv=32, gates=kind)


def test_vector_cases_are_small_and_cover_the_features():
    cases = [get_case(name) for name in VECTOR_CASES]
    for case in cases:
        assert case.vector_gate and case.name.startswith("vector_")
        assert case.B <= 2 and case.T <= 150 and case.Hk <= 2, case.name
        assert case.Dk in (32, 64) and case.Dv in (32, 64), case.name
    assert {c.gates for c in cases} >= set(VECTOR_GATE_KINDS)
    assert any(c.Hv == 3 * c.Hk and c.padding for c in cases)  # GVA 3x with a mask
    assert any(c.Dk != c.Dv for c in cases)
    assert any(c.T % c.chunk_size and c.T > 2 * c.chunk_size for c in cases)  # ragged
    assert any(c.T == 1 and c.has_initial_state for c in cases)
    assert any(c.identical_keys for c in cases)
    assert all(c.has_initial_state for c in cases)
    # Each new shape is a compile per backend in `make test`: the five add two shapes.
    shapes = {(c.B, c.T, c.Hk, c.Hv, c.Dk, c.Dv) for c in cases}
    old = get_case("vector_gate")
    assert len(shapes - {(old.B, old.T, old.Hk, old.Hv, old.Dk, old.Dv)}) <= 2, shapes


@pytest.mark.parametrize("seed", [0, 1])
def test_half_strong_gates(seed):
    case = get_case("vector_strong_half")
    g = case.inputs(seed)["g_log"]
    strong = g < -1.0
    # The same half of each head's channels is strong at every batch and step...
    np.testing.assert_array_equal(strong, np.broadcast_to(strong[:1, :1], strong.shape))
    np.testing.assert_array_equal(strong[0, 0].sum(axis=-1), case.Dk // 2)
    assert not np.array_equal(strong[0, 0, 0], strong[0, 0, 1])  # ...a different half per head
    assert np.all((g[strong] >= -40.0) & (g[strong] <= -30.0))
    assert np.all((g[~strong] >= -0.02) & (g[~strong] <= 0.0))
    assert g[strong].min() < -39.0 and g[strong].max() > -31.0
    # a full chunk of a strong channel sums far beyond float64's exp range (~ -745)
    assert g[:, :64][strong[:, :64]].reshape(case.B, 64, -1).sum(axis=1).max() < -1800.0


@pytest.mark.parametrize("name", ["vector_exact_zero", "vector_masked_gva3"])
def test_channel_zero_and_one_gates(name):
    case = get_case(name)
    assert case.gates == "channel_zero_and_one"
    g = case.inputs(0)["g_log"]
    zero = g == -np.inf
    whole = zero.all(axis=-1)  # [B,T,Hv]: every channel of a step at g = 0
    single = zero.any(axis=-1) & ~whole
    assert single.sum() > 10 and whole.sum() > 5
    assert whole[0, 0, 0]  # resets head 0's initial state in batch 0
    assert np.all(whole[-1, 63:65])  # both sides of the first chunk boundary, every head
    assert not whole[0, 1:].any()  # batch 0 has no other whole -inf step
    one = g == 0.0
    assert one.any(axis=-1).mean() > 0.5 and not one.all(axis=-1).any()  # single channels
    # g = 1 stretches across t = 64: a quarter of each head's channels over steps 40..99
    stretch = one[0, 40:100].all(axis=0)  # [Hv, Dk]
    np.testing.assert_array_less(case.Dk // 4 - 1, stretch.sum(axis=-1))
    ordinary = np.isfinite(g) & (g != 0.0)
    assert ordinary.mean() > 0.7
    assert np.all((g[ordinary] >= -0.5) & (g[ordinary] <= -0.01))


def test_channel_mix_gates_at_t1():
    case = get_case("vector_t1")
    x = case.inputs(0)
    g = x["g_log"]
    assert case.T == 1 and x["initial_state"] is not None
    assert np.all(g[0, 0, 0] == -np.inf)  # one whole head wiped
    assert np.all(g[-1, 0, -1] == 0.0)  # one whole head kept exactly
    rest = np.ones(g.shape, dtype=bool)
    rest[0, 0, 0] = rest[-1, 0, -1] = False
    gr = g[rest]
    kinds = [gr == -np.inf, gr == 0.0, (gr >= -40.0) & (gr <= -30.0),
             (gr >= -0.02) & (gr < 0.0)]
    np.testing.assert_array_equal(sum(k.astype(int) for k in kinds), 1)  # nothing else
    fractions = [k.mean() for k in kinds]
    for got, want in zip(fractions, (0.10, 0.15, 0.25, 0.50)):
        assert abs(got - want) < 0.07, fractions


def test_vector_identical_keys():
    case = get_case("vector_identical_keys")
    x = case.inputs(0)
    for start in range(0, case.T, 64):
        block = x["k"][:, start:start + 64]
        np.testing.assert_array_equal(block, np.broadcast_to(block[:, :1], block.shape))
    np.testing.assert_array_equal(x["beta"], 1.0)
    assert x["g_log"].shape == case.gate_shape and case.gate_shape[-1] == case.Dk


def test_vector_masked_gva3_padding():
    case = get_case("vector_masked_gva3")
    mask = case.inputs(0)["mask"]
    assert case.Hv == 3 * case.Hk and case.Dk != case.Dv
    assert not mask[0, 0] and mask[0, -1]  # left padding
    assert not mask[1, 128:].any()  # right padding covers the whole partial chunk


@pytest.mark.parametrize("name", ("vector_gate",) + VECTOR_CASES)
def test_vector_cases_reference_is_finite(name):
    """The float64 reference (forward and every gradient) is finite in both gate conventions,
    and dg is exactly 0 where log g = -inf."""
    case = get_case(name)
    x = case.inputs(0)
    for gate, g in (("log", x["g_log"]), ("linear", np.exp(x["g_log"]))):
        out = reference.vjp(x["q"], x["k"], x["v"], g, x["beta"], x["initial_state"], x["dy"],
                            x["dfinal_state"], mask=x["mask"], scale=case.scale, gate=gate)
        for key, val in out.items():
            assert np.all(np.isfinite(val)), (gate, key)
            assert np.linalg.norm(val) > 0, (gate, key)
        if gate == "log":
            assert np.all(out["dg"][x["g_log"] == -np.inf] == 0.0)


def test_packed_cases_cover_their_boundaries():
    """The packed cases' offsets: int32, empty and length-1 sequences, boundaries inside a
    chunk and at its edges, a sequence over two chunk ends; a bad packed case is refused."""
    from gdngen.cases import Case

    lengths, edges, inside = set(), False, False
    for name in ("packed_boundaries", "packed_long_masked", "packed_vector"):
        case = get_case(name)
        x = case.inputs(seed=3)
        assert x["cu_seqlens"].dtype == np.int32 and case.B == 1
        np.testing.assert_array_equal(x["cu_seqlens"], case.cu_seqlens)
        offsets = np.asarray(case.cu_seqlens)
        lengths |= set(np.diff(offsets).tolist())
        edges |= bool(np.any(offsets[1:-1] % case.chunk_size == 0))
        inside |= bool(np.any(offsets[1:-1] % case.chunk_size != 0))
        assert x["cu_seqlens"] is not case.inputs(seed=3)["cu_seqlens"]
    assert {0, 1} <= lengths and max(lengths) > 2 * 64 and edges and inside
    # packed_boundaries injects a live initial state at a chunk end: some sequence starting
    # inside a chunk runs past its end with no exact-zero gate in some head until then
    case = get_case("packed_boundaries")
    C, offsets = case.chunk_size, np.asarray(case.cu_seqlens)
    for seed in range(5):
        g = case.inputs(seed=seed)["g_log"][0]  # [T, Hv]
        live = [bool(np.isfinite(g[s:(s // C + 1) * C]).all(axis=0).any())
                for s, e in itertools.pairwise(offsets)
                if s % C and e > (s // C + 1) * C]
        assert any(live), seed
    with pytest.raises(ValueError, match="packed case needs B = 1"):
        Case("bad", "a packed case with two rows", B=2, T=8, Hk=1, Hv=1, Dk=16, Dv=16,
             cu_seqlens=(0, 8))
    with pytest.raises(ValueError, match="non-decreasing"):
        Case("bad", "offsets going back", B=1, T=8, Hk=1, Hv=1, Dk=16, Dv=16,
             cu_seqlens=(0, 5, 3, 8))
