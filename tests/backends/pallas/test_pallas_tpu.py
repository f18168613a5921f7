"""Generated Pallas TPU kernels: the battery in TPU interpret mode (race detection on, buffers
poisoned with NaN), Mosaic lowering for the TPU platform, the variant space and the entry point;
the per-channel chunk walks (their contract against gdngen.algebra.chunkwise_channel's, a battery
case through them).

Interpret mode compiles one host executable per kernel and shape (seconds each), so the whole
battery runs for the default variants only; other variants run a few adversarial cases each.
The full enumeration is validated by ``gdngen build --backend pallas-tpu`` (see the report in
the backend's docstring). The tests marked ``tpu`` run the same kernels compiled by Mosaic.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings

import numpy as np
import pytest
from slow import marked

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")

from channel_walks import (
    check_battery_case_through_the_walks,
    check_grads_match_the_float64_stages,
    check_intra_matches_the_float64_stages,
    check_walks_match_the_portable_walks,
)
from generated_kernels import small_call_inputs

from gdngen import Problem, Variant, default_variant, validate
from gdngen.algebra import reference
from gdngen.backends.pallas import tpu as pallas_tpu
from gdngen.cases import BATTERY, Case, get_case
from gdngen.registry import variants
from gdngen.tolerance import allowed_error

PROBLEM = Problem(2, 4, 128, 128)
GVA3 = Problem(1, 3, 128, 128)
ON_TPU = jax.default_backend() == "tpu"


pytestmark = pytest.mark.usefixtures("unoptimized_xla")  # compile-bound: conftest


def _variant(problem=PROBLEM, **changes):
    return Variant("pallas_tpu", dict(default_variant("pallas_tpu", problem).as_dict(), **changes))


def _check(results, variant, dtype):
    tol = allowed_error(variant, dtype)
    for res in results:
        assert all(err <= tol for err in res.errors.values()), (variant.name(), res.case,
                                                                 res.worst, tol)


# ----------------------------------------------------------------------------- variant space


def test_variant_space_and_default():
    space = variants("pallas_tpu", PROBLEM)
    assert len(space) == 36  # 3 chunks x 3 policies x head tiles {1, 2} x save {T, F}
    assert {v["chunk_size"] for v in space} == {32, 64, 128}
    assert {v["head_tile"] for v in space} == {1, 2}
    assert {v["head_tile"] for v in variants("pallas_tpu", GVA3)} == {1, 3}
    assert {v["dv_tile"] for v in variants("pallas_tpu", Problem(1, 2, 64, 256))} == {128, 256}
    assert default_variant("pallas_tpu", PROBLEM).as_dict() == {
        "chunk_size": 64, "precision": "ieee", "head_tile": 2, "dv_tile": 128,
        "save_states": True, "recurrent_below": pallas_tpu.RECURRENT_BELOW}
    # per-channel gates: the chunk walks' parameters only (ieee, saving states), tuned
    vector = variants("pallas_tpu", Problem(2, 4, 128, 128, gate="vector"))
    assert len(vector) == 6  # 3 chunks x head tiles {1, 2}
    assert {(v["precision"], v["save_states"]) for v in vector} == {("ieee", True)}
    assert "vector" in pallas_tpu.SPEC.tuned_gates
    with pytest.raises(ValueError, match="dtype"):
        variants("pallas_tpu", Problem(2, 4, 128, 128, dtype="float16"))


def test_vmem_estimate_excludes_variants_per_generation():
    big = Problem(1, 8, 256, 256)
    v4 = variants("pallas_tpu", big, "tpu-v4")
    v5e = variants("pallas_tpu", big, "tpu-v5e")
    assert 0 < len(v4) < len(v5e)
    assert all(pallas_tpu.vmem_bytes(v, big) <= 16 * 2**20 for v in v4)
    assert any(pallas_tpu.vmem_bytes(v, big) > 16 * 2**20 for v in v5e)
    small, large = (pallas_tpu.vmem_bytes(_variant(big, chunk_size=c, head_tile=h), big)
                    for c, h in ((32, 1), (128, 8)))
    assert small < large
    with pytest.raises(ValueError, match="device"):
        variants("pallas_tpu", big, "h100")


def test_kernel_params_fit_other_shapes():
    variant = _variant(GVA3, head_tile=3, dv_tile=128)
    assert pallas_tpu.kernel_params(variant, Problem(2, 4, 32, 32))["head_tile"] == 2
    assert pallas_tpu.kernel_params(variant, Problem(2, 6, 32, 64))["head_tile"] == 3
    assert pallas_tpu.kernel_params(variant, Problem(2, 6, 32, 64))["dv_tile"] == 64
    assert pallas_tpu.kernel_params(variant, Problem(2, 6, 32, 256))["dv_tile"] == 128


# ----------------------------------------------------------------------------- Mosaic lowering


@pytest.mark.parametrize("params", [
    {"chunk_size": 64, "precision": "ieee", "head_tile": 2, "dv_tile": 256, "save_states": True},
    {"chunk_size": 128, "precision": "tf32", "head_tile": 1, "dv_tile": 128,
     "save_states": False},
    {"chunk_size": 32, "precision": "bf16", "head_tile": 2, "dv_tile": 128, "save_states": True},
])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_kernels_lower_for_mosaic(params, dtype):
    """Block shapes legal for TPU and every op supported by the Mosaic lowering (no TPU
    needed; the TPU compiler's own passes run only on a TPU)."""
    lowered = pallas_tpu.lower_check(Variant("pallas_tpu", params),
                                     Problem(2, 4, 128, 256, dtype=dtype))
    expected = {"forward", "backward", "recurrent", "recurrent_blocks"} | (
        set() if params["save_states"] else {"chunk_states"})
    assert set(lowered) == expected
    assert all("tpu_custom_call" in text for text in lowered.values())


def test_channel_walks_lower_for_mosaic():
    """The per-channel chunk walks (several Dv tiles and head tiles; the whole Dv), the
    intra-chunk kernel and its VJP's (both gate conventions) lower through Mosaic, with the
    recurrent kernel; nothing of the scalar chunk kernels."""
    for params, problem in (
            ({"chunk_size": 64, "head_tile": 2, "dv_tile": 128}, Problem(2, 4, 128, 256)),
            ({"chunk_size": 32, "head_tile": 3, "dv_tile": 256}, Problem(1, 3, 64, 256))):
        variant = Variant("pallas_tpu", dict(params, precision="ieee", save_states=True))
        lowered = pallas_tpu.lower_check(variant, dataclasses.replace(problem, gate="vector"))
        assert set(lowered) == {"channel_walk", "channel_walk_backward", "channel_intra",
                                "channel_grads", "channel_grads_linear", "recurrent",
                                "recurrent_blocks"}
        assert all("tpu_custom_call" in text for text in lowered.values())


# ----------------------------------------------------------------------------- battery


@pytest.mark.slow  # GVA on pallas_tpu: the gva3 battery case (test_conformance hard cases)
def test_default_variant_on_grouped_heads():
    """The default variant of a 3-head group (head_tile 3); the scalar battery on the default
    shape is the conformance suite's (tests/calls/test_conformance.py)."""
    variant = default_variant("pallas_tpu", GVA3)
    cases = ["gva3", "equal_heads"]  # padding_mask: the conformance suite's hard cases
    results = validate.run_battery(None, variant=variant, cases=cases, dtype="float32")
    assert [r.case for r in results] == cases
    _check(results, variant, "float32")


#: the battery's hard_decay (g = exp(U(-5.4, 0)): a 64-chunk's log g sums to ~ -170; beta in
#: [0.85, 1]; T = 128 in two chunks; its returned states) on one row of one key head with two
#: value heads (one head tile of 2): [bf16-policy]'s case, a quarter of the battery case's grid
HARD_DECAY_ROW = dataclasses.replace(get_case("hard_decay"), name="hard_decay_row", B=1, Hk=1,
                                     Hv=2)


@pytest.mark.parametrize("changes, cases, dtype", [
    pytest.param({"head_tile": 1, "save_states": False, "chunk_size": 32}, ["gva3"],
                 "float32", marks=pytest.mark.slow),  # variants: [bf16-policy] keeps them
    pytest.param({"chunk_size": 128}, ["identical_keys"], "float32", marks=pytest.mark.slow),
    pytest.param({"precision": "tf32"}, ["identical_keys"], "float32",
                 marks=pytest.mark.slow),  # precision policies: [bf16-policy] keeps them
    ({"precision": "bf16", "save_states": False}, [HARD_DECAY_ROW], "float32"),
    pytest.param({}, ["gates_exact_one_and_zero"], "bfloat16", marks=pytest.mark.slow),
], ids=["recompute-gva", "chunk128", "tf32", "bf16-policy", "bf16-inputs"])
def test_variants_on_adversarial_cases(changes, cases, dtype):
    problem = Problem(2, 4, 128, 128, dtype=dtype)
    variant = _variant(problem, **changes)
    _check(validate.run_battery(None, variant=variant, cases=cases, dtype=dtype), variant, dtype)


@pytest.mark.parametrize("save_states", marked([True, False], {False}))  # [True] keeps Dv tiles
def test_dv_tiles(save_states):
    """Dv split into 128-column grid steps (per-chunk factors cached at the first tile, the
    backward's sums accumulated over the tiles); the battery has no Dv this large."""
    case = Case("dv_tiles", "Dv = 256 in two tiles, hard gates, beta in [0, 2]", B=1, T=40,
                Hk=1, Hv=2, Dk=16, Dv=256, chunk_size=32, gates="hard", beta_range=(0.0, 2.0),
                has_initial_state=True)
    variant = Variant("pallas_tpu", {"chunk_size": 32, "precision": "ieee", "head_tile": 2,
                                     "dv_tile": 128, "save_states": save_states})
    assert pallas_tpu.kernel_params(variant, Problem(1, 2, 16, 256))["dv_tile"] == 128
    _check([validate.check_case("pallas_tpu", case, variant=variant)], variant, "float32")


# ----------------------------------------------------------------------------- per-channel gates


def test_channel_walks_match_the_portable_walks():
    """Three chunks, two value heads per program (head_tile 2), Dv = 256 in two 128-column
    tiles (the reverse walk's sums over Dv accumulated over the tiles), Dk != Dv: every output of
    both walks, in interpret mode (buffers NaN-poisoned)."""
    problem = Problem(1, 2, 32, 256, gate="vector")
    variant = Variant("pallas_tpu", {"chunk_size": 32, "precision": "ieee", "head_tile": 2,
                                     "dv_tile": 128, "save_states": True})
    kernels = pallas_tpu.load_kernels(variant, problem)
    assert kernels.params["dv_tile"] == 128 and kernels.params["head_tile"] == 2
    check_walks_match_the_portable_walks(
        *pallas_tpu.chunk_walks((kernels.sha256, kernels.interpret)), (3, 2, 1, 2, 32, 32, 256))


@pytest.mark.parametrize("gate, chunk", [
    ("linear", 32),  # the exact-zero rule too
    pytest.param("log", 64, marks=pytest.mark.slow),  # eight sub-chunks
])
def test_channel_intra_and_grads_match_the_float64_stages(gate, chunk):
    """The intra-chunk kernel (decay factors, decayed products in sub-chunks of 8 steps, the
    exact triangular inverse, the WY form) and its VJP's (the straddle sums, the exact-zero
    rule of linear gates) against chunkwise_channel's stages in float64: two chunks, two value
    heads per key head, Dk != Dv, exact zeros and log g = -37 on some channels; interpret mode
    (buffers NaN-poisoned)."""
    problem = Problem(1, 2, 32, 64, gate="vector")
    variant = Variant("pallas_tpu", {"chunk_size": chunk, "precision": "ieee", "head_tile": 1,
                                     "dv_tile": 64, "save_states": True})
    kernels = pallas_tpu.load_kernels(variant, problem)
    key = (kernels.sha256, kernels.interpret)
    shape = (2, 1, 1, 2, chunk, 32, 64)
    check_intra_matches_the_float64_stages(pallas_tpu.channel_intra(key, gate, 0.25), shape,
                                           gate, 0.25)
    check_grads_match_the_float64_stages(pallas_tpu.channel_grads(key, gate, 0.25), shape,
                                         gate, 0.25)


@pytest.mark.slow
def test_per_channel_battery_case_runs_the_kernel_walks(monkeypatch):
    """pallas_tpu's kernel walks on a per-channel battery case (slow: about a minute here;
    `make test` has the walks' contract and the entry point's VJP through them)."""
    variant = default_variant("pallas_tpu", Problem(2, 4, 64, 64))
    check_battery_case_through_the_walks(monkeypatch, pallas_tpu, variant, _check)


@pytest.mark.slow
@pytest.mark.parametrize("params", [
    {"chunk_size": 32, "head_tile": 2},
    {"chunk_size": 128, "head_tile": 1},
], ids=["chunk32-heads2", "chunk128"])
def test_per_channel_battery_on_other_variants(params):
    """Every per-channel case on two more points of the vector variant space."""
    base = default_variant("pallas_tpu", Problem(2, 4, 64, 64)).as_dict()
    variant = Variant("pallas_tpu", dict(base, **params))
    cases = [c.name for c in BATTERY if c.name.startswith("vector_")]
    _check(validate.run_battery(None, variant=variant, cases=cases), variant, "float32")


# ----------------------------------------------------------------------------- entry point


def test_entry_point_rejects_float16():
    q, k, v, g, beta, s0 = (jnp.asarray(x, jnp.float32) for x in small_call_inputs())
    variant = _variant(Problem(1, 2, 16, 16))
    with pytest.raises(ValueError, match="q has dtype float16"):
        pallas_tpu.gated_delta(q.astype(jnp.float16), k, v, g, beta, s0, variant=variant)


@pytest.mark.skipif(ON_TPU, reason="interpret mode is only used without a TPU")
def test_interpret_mode_warns_once_and_poisons_buffers():
    pallas_tpu._default_interpret_mode.cache_clear()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            params = pallas_tpu.interpret_mode()
            assert pallas_tpu.interpret_mode() is params
        assert [str(w.message) for w in caught if "interpret mode" in str(w.message)] == \
            [str(caught[0].message)]
        assert params.detect_races and params.uninitialized_memory == "nan"
    finally:
        pallas_tpu._default_interpret_mode.cache_clear()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            pallas_tpu.interpret_mode()


def test_two_simulated_tensorcores_are_race_free():
    """The parallel grid axes (batch, head tile) split over two simulated cores, as on
    megacore chips: outputs stay right and the race detector stays quiet."""
    from jax.experimental.pallas import tpu as pltpu

    q, k, v, g, beta, s0 = small_call_inputs(B=2, T=8, Hk=2, Hv=2)
    variant = Variant("pallas_tpu", {"chunk_size": 32, "precision": "ieee", "head_tile": 1,
                                     "dv_tile": 128, "save_states": True})
    params = pltpu.InterpretParams(detect_races=True, num_cores_or_threads=2)
    args = [jnp.asarray(x, jnp.float32) for x in (q, k, v, g, beta, s0)]
    with pallas_tpu.interpreting(params):
        assert pallas_tpu.interpret_mode() is params
        (y, state), vjp = jax.vjp(functools.partial(pallas_tpu.gated_delta, variant=variant),
                                  *args)
        dq = vjp((jnp.ones_like(y), jnp.zeros_like(state)))[0]
    assert pallas_tpu.interpret_mode() is not params
    ref = reference.vjp(q, k, v, g, beta, s0, np.ones(y.shape), np.zeros(state.shape))
    for got, name in ((y, "y"), (state, "final_state"), (dq, "dq")):
        assert validate.relative_error(got, ref[name]) < 1e-5, name


@pytest.mark.skipif(ON_TPU, reason="interpret mode is only used without a TPU")
def test_detected_race_raises_and_resets_interpreter(monkeypatch):
    """The race detector's verdict is read after every kernel; a race is an error."""
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call as tpu_interpret
    from jax.experimental.pallas import tpu as pltpu

    class Flagged:
        races_found = True

    resets = []
    monkeypatch.setattr(tpu_interpret, "races", Flagged())
    monkeypatch.setattr(pltpu, "reset_tpu_interpret_mode_state", lambda: resets.append(1))
    params = pltpu.InterpretParams(detect_races=True)
    with pytest.raises(RuntimeError, match="data race in the forward kernel"):
        pallas_tpu.run_kernel((lambda interpret: jnp.zeros(3), None), what="forward",
                              interpret=params)
    assert resets == [1]


@pytest.mark.tpu
@pytest.mark.skipif(not ON_TPU, reason="needs a TPU: compiles the kernels with Mosaic")
def test_default_variant_on_tpu():
    variant = default_variant("pallas_tpu", PROBLEM)
    _check(validate.run_battery(None, variant=variant, dtype="float32"), variant, "float32")
