"""Generated Pallas GPU (Triton lowering) kernels: the variant space, rendering, the Triton
lowering for CUDA (no GPU needed), the battery in Pallas interpret mode (outputs start as NaN),
and the entry point.

Interpret mode compiles host executables per kernel and shape (seconds each), so the whole
battery runs for the default variant; every enumerated variant of a small problem is shown to
pass through its numerics class: ``num_warps`` and ``num_stages`` only reach
``plgpu.CompilerParams``, so variants that differ only there render to the same kernels up to
those two constants (checked), and one representative per class is lowered and validated by
``gdngen.tools.build`` on the hardest battery case. The test marked ``gpu`` runs on a CUDA device.
Per-channel gates: the chunk walks' contract against gdngen.algebra.chunkwise_channel's, their
Triton lowering, and a battery case through them.
"""

from __future__ import annotations

import importlib.util
import json
import re
import warnings
from pathlib import Path

import numpy as np
import pytest

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")


from channel_walks import (
    check_battery_case_through_the_walks,
    check_grads_match_the_float64_stages,
    check_intra_matches_the_float64_stages,
    check_walks_match_the_portable_walks,
)

from gdngen import Problem, Variant, default_variant, render, validate
from gdngen.backends.pallas import gpu as pallas_gpu
from gdngen.cases import BATTERY, Case
from gdngen.registry import variants
from gdngen.tolerance import allowed_error

SMALL = Problem(2, 4, 32, 32)
PROBLEM = Problem(2, 4, 64, 64)
ON_GPU = jax.default_backend() == "gpu"
BASE = {"chunk_size": 32, "precision": "ieee", "bk": 32, "bv": 32, "num_warps": 4,
        "num_stages": 2, "save_states": True}
#: the lines a variant's launch parameters change in the rendered sources.
_LAUNCH_LINES = re.compile(r"^(NUM_WARPS|NUM_STAGES) = \d+$|^.* warps, .* stages, .*$",
                           re.MULTILINE)


def _variant(**changes):
    return Variant("pallas_gpu", dict(BASE, **changes))


def _check(results, variant, dtype):
    tol = allowed_error(variant, dtype)
    assert results
    for res in results:
        assert all(err <= tol for err in res.errors.values()), (variant.name(), res.case,
                                                                 res.worst, tol)


# ----------------------------------------------------------------------------- variant space


def test_variant_space_and_default():
    space = variants("pallas_gpu", SMALL)
    # 3 chunks x 3 policies x bk {32} x bv {32} x 2 warps x 2 stages x save {T, F}
    assert len(space) == 72
    assert {v["chunk_size"] for v in space} == {16, 32, 64}
    assert {v["precision"] for v in space} == {"ieee", "tf32", "bf16"}
    assert {(v["num_warps"], v["num_stages"]) for v in space} == {(4, 2), (4, 3), (8, 2), (8, 3)}
    assert {v["bk"] for v in variants("pallas_gpu", Problem(1, 2, 128, 64))} == {32, 64, 128}
    assert {v["bv"] for v in variants("pallas_gpu", Problem(1, 2, 128, 64))} == {32, 64}
    assert pallas_gpu.tiles(16) == [16] and pallas_gpu.tiles(24) == [32]
    assert pallas_gpu.tiles(96) == [32]
    # padded dims of an odd number of 16s have no 32-wide tile: the 16-wide one (the default
    # variant of Dk = 40 or 80 used to fail on an empty list)
    assert pallas_gpu.tiles(40) == pallas_gpu.tiles(80) == [16]
    for d in (40, 80):
        for gate in ("scalar", "vector"):
            v = default_variant("pallas_gpu", Problem(1, 2, d, d, gate=gate))
            assert (v["bk"], v["bv"]) == (16, 16), (d, gate)
    assert default_variant("pallas_gpu", PROBLEM).as_dict() == {
        "chunk_size": 64, "precision": "ieee", "bk": 64, "bv": 64, "num_warps": 4,
        "num_stages": 2, "save_states": True, "recurrent_below": pallas_gpu.RECURRENT_BELOW}
    # per-channel gates: the chunk walks' parameters (chunk, tiles, launch params; ieee,
    # saving states), tuned
    vector = variants("pallas_gpu", Problem(2, 4, 32, 32, gate="vector"))
    assert len(vector) == 12  # 3 chunks x bk {32} x bv {32} x 2 warps x 2 stages
    assert {(v["precision"], v["save_states"]) for v in vector} == {("ieee", True)}
    # bk <= CHANNEL_MAX_TILE (ptxas's time on the intra-chunk kernels), 8 warps by default
    wide = Problem(2, 4, 128, 128, gate="vector")
    assert {v["bk"] for v in variants("pallas_gpu", wide)} == {32}
    assert {v["bv"] for v in variants("pallas_gpu", wide)} == {32, 64, 128}
    assert default_variant("pallas_gpu", wide)["num_warps"] == 8
    assert "vector" in pallas_gpu.SPEC.tuned_gates


def test_shared_memory_estimate_prunes_per_device():
    big = Problem(1, 8, 128, 128, dtype="float32")
    a100 = variants("pallas_gpu", big, "a100")
    h200 = variants("pallas_gpu", big, "h200")
    assert 0 < len(a100) < len(h200) <= len(variants("pallas_gpu", big))
    assert all(pallas_gpu.shared_memory_bytes(v, big) <= 163 * 1024 for v in a100)
    assert any(pallas_gpu.shared_memory_bytes(v, big) > 163 * 1024 for v in h200)
    deep, shallow = (pallas_gpu.shared_memory_bytes(_variant(chunk_size=64, bv=128,
                                                             num_stages=s), big)
                     for s in (3, 2))
    assert deep > shallow
    with pytest.raises(ValueError, match="has no shared_memory limit"):
        variants("pallas_gpu", big, "tpu-v5e")


@pytest.mark.parametrize("changes, match", [
    ({"chunk_size": 128}, r"chunk_size must be one of \(16, 32, 64\), got 128"),
    ({"bk": 48}, r"bk must be one of \(16, 32, 64, 128\), got 48"),
    ({"bv": True}, r"bv must be one of"),
    ({"num_warps": 3}, r"num_warps must be one of"),
    ({"num_stages": 0}, r"num_stages must be one of"),
    ({"precision": "fp8"}, r"precision must be one of \('ieee', 'tf32', 'bf16'\), got 'fp8'"),
    ({"save_states": 1}, r"save_states must be a bool, got 1"),
    ({"head_tile": 2}, r"pallas_gpu variant params must be"),
])
def test_kernel_params_reject_bad_variants(changes, match):
    with pytest.raises(ValueError, match=match):
        pallas_gpu.kernel_params(_variant(**changes), PROBLEM)


def test_kernel_params_resolve_tiles_and_padding():
    params = pallas_gpu.kernel_params(_variant(bk=128, bv=64), Problem(1, 2, 24, 96))
    assert (params["dk"], params["bk"]) == (32, 32)  # 24 padded to 32
    assert (params["dv"], params["bv"]) == (96, 32)  # 96 = 3 x 32
    with pytest.raises(ValueError, match="variant backend must be 'pallas_gpu'"):
        pallas_gpu.kernel_params(Variant("pallas_tpu", BASE), PROBLEM)


def test_tune_targets_on_h200_search_this_space():
    from gdngen import tune

    targets = tune.targets("h200", ("jax",), [PROBLEM], precision="tf32")
    target = next(t for t in targets if t.backend == "pallas_gpu")
    space = target.space()
    assert space and {v["precision"] for v in space} == {"ieee", "tf32"}
    assert tune.skip_reason(target) is None
    assert not any(t.backend == "pallas_gpu" for t in tune.targets("tpu-v5e", ("jax",),
                                                                      [PROBLEM]))


# ----------------------------------------------------------------------------- rendering


def test_render_is_deterministic_and_bakes_the_specialisation_in():
    variant = _variant(chunk_size=16, bk=32, bv=64, num_warps=8, num_stages=3,
                       precision="tf32", save_states=False)
    problem = Problem(2, 6, 64, 128, dtype="float16")
    first, again = render(variant, problem), render(variant, problem)
    assert first.sha256 == again.sha256 and first.sources == again.sources
    fwd = first.sources["forward.py"]
    for line in ("CHUNK = 16", "DK = 64", "DV = 128", "BK = 32", "BV = 64", "N_DK = 2",
                 "N_DV = 2", "HK = 2", "HV = 6", "GROUP = 3", "INPUT_DTYPE = jnp.float16",
                 'PRECISION = "tf32"', "SAVE_STATES = False", "NUM_WARPS = 8",
                 "NUM_STAGES = 3"):
        assert f"\n{line}" in fwd, line
    assert "Precision.HIGH," in fwd and "reduce_precision" in fwd  # tf32: native + emulated
    assert "return y, s_final, ()" in fwd and "{%" not in fwd
    ieee = render(_variant(), PROBLEM).sources["forward.py"]
    assert "reduce_precision" not in ieee and "Precision.HIGH," not in ieee
    assert "return y, s_final, (u, wk, pm, tinv[0], s_in[0])" in ieee
    bf16 = render(_variant(precision="bf16"), PROBLEM).sources["backward.py"]
    assert "a.astype(jnp.bfloat16)" in bf16
    for source in (*first.sources.values(), ieee, bf16):
        compile(source, "<rendered>", "exec")


@pytest.mark.slow  # an every-variant sweep; pallas_gpu renders: its sha256 and lowering tests
def test_every_variant_renders_distinct_sources():
    space = variants("pallas_gpu", PROBLEM)
    shas = {render(v, PROBLEM).sha256 for v in space}
    assert len(shas) == len(space)


@pytest.mark.parametrize("changes, problem", [
    ({}, Problem(2, 4, 64, 64)),
    ({"chunk_size": 64, "bk": 32, "bv": 64, "precision": "tf32", "save_states": False},
     Problem(1, 2, 64, 128, dtype="bfloat16")),
    ({"chunk_size": 16, "precision": "bf16", "bk": 16, "bv": 16},
     Problem(1, 3, 24, 40, dtype="float16")),
], ids=["f32-ieee", "bf16-tf32-tiles", "f16-bf16-padded"])
def test_kernels_lower_through_triton(changes, problem):
    """Power-of-two shapes, no scratch memory and every op supported by the Pallas Triton
    lowering (checked for the CUDA platform without a GPU)."""
    lowered = pallas_gpu.lower_check(_variant(**changes), problem)
    assert set(lowered) == {"forward", "residuals", "backward", "recurrent"}
    assert all("gpu.triton" in text or "triton_kernel_call" in text
               for text in lowered.values())



# ----------------------------------------------------------------------------- battery


#: one small case combining what separates the variants: keys equal within 16-step blocks
#: (near-singular T in every chunk size; the worst case of every policy), a partial last chunk,
#: two value heads per key head and an initial state.
SWEEP_CASE = Case("sweep", "identical keys per 16 steps, g = 0.95, beta = 1, T = 40, GVA 2",
                  B=1, T=40, Hk=1, Hv=2, Dk=32, Dv=32, chunk_size=16, gates="constant_0.95",
                  beta_range=(1.0, 1.0), identical_keys=True, has_initial_state=True)


@pytest.mark.slow
def test_every_enumerated_variant_passes_via_its_numerics_class(tmp_path):
    """All 72 variants of SMALL: one representative per numerics class is lowered for Triton
    and validated by ``gdngen.tools.build`` on `SWEEP_CASE`; every other variant renders to its
    representative's sources up to the launch constants."""
    from gdngen.tools import build

    space = variants("pallas_gpu", SMALL)
    classes: dict = {}
    for variant in space:
        classes.setdefault(pallas_gpu.numerics_key(variant, SMALL), []).append(variant)
    assert len(classes) == 18
    representatives = [members[0] for members in classes.values()]
    for members in classes.values():
        reference_sources = render(members[0], SMALL).sources
        for member in members[1:]:
            for name, source in render(member, SMALL).sources.items():
                assert source != reference_sources[name]
                assert (_LAUNCH_LINES.sub("", source)
                        == _LAUNCH_LINES.sub("", reference_sources[name])), member.name()
    results = build.build("pallas_gpu", SMALL, tmp_path, cases=[SWEEP_CASE],
                          variant_list=representatives)
    failed = [(r.variant.name(), r.status, r.lowering, r.error, r.worst) for r in results
              if r.status != "passed" or r.lowering != "ok"]
    assert not failed
    worst = {}
    for r in results:
        policy = r.variant["precision"]
        worst[policy] = max(worst.get(policy, 0.0), max(r.worst.values()))
    assert worst["ieee"] <= 5e-5 and worst["tf32"] <= 5e-3 and worst["bf16"] <= 2e-2
    assert worst["ieee"] < worst["tf32"] < worst["bf16"]  # the policies really differ


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_low_precision_inputs(dtype):
    variant = _variant(chunk_size=64, bk=32, bv=32)
    results = validate.run_battery(None, variant=variant, dtype=dtype,
                                   cases=["gates_exact_one_and_zero", "padding_mask"])
    _check(results, variant, dtype)


@pytest.mark.parametrize("save_states", [True, False])
def test_padded_head_dims_and_several_tiles(save_states):
    """Head dims that are not multiples of 16 (zero-padded), several BK/BV tiles, hard gates,
    beta in [0, 2] and an initial state; the battery has no such shapes."""
    case = Case("padded", "Dk = 40, Dv = 72: padded to 48 and 80, 16-wide tiles", B=1, T=45,
                Hk=1, Hv=3, Dk=40, Dv=72, chunk_size=16, gates="hard", beta_range=(0.0, 2.0),
                has_initial_state=True)
    variant = _variant(chunk_size=16, bk=32, bv=64, save_states=save_states)
    params = pallas_gpu.kernel_params(variant, Problem(1, 3, 40, 72))
    assert (params["dk"], params["bk"], params["dv"], params["bv"]) == (48, 16, 80, 16)
    _check([validate.check_case("pallas_gpu", case, variant=variant)], variant, "float32")


# ----------------------------------------------------------------------------- per-channel gates


def test_channel_walks_match_the_portable_walks():
    """Three chunks of 16, three value heads, Dk = 40 and Dv = 72 zero-padded to 48 and 80 in
    16-wide tiles (3 BK x 5 BV: the state walks over the BV tiles, the chunk-parallel sums over
    Dv): every output of both walks, in interpret mode (outputs start as NaN)."""
    problem = Problem(1, 3, 40, 72, gate="vector")
    kernels = pallas_gpu.load_kernels(_variant(chunk_size=16, bk=16, bv=16), problem)
    p = kernels.params
    assert (p["dk"], p["bk"], p["dv"], p["bv"]) == (48, 16, 80, 16)
    check_walks_match_the_portable_walks(
        *pallas_gpu.chunk_walks((kernels.sha256, kernels.interpret)), (3, 1, 1, 3, 16, 40, 72))


@pytest.mark.parametrize("gate, changes", [
    ("linear", {"chunk_size": 16, "bk": 16, "bv": 16}),  # the exact-zero rule, padded tiles
    pytest.param("log", {"chunk_size": 32}, marks=pytest.mark.slow),
])
def test_channel_intra_and_grads_match_the_float64_stages(gate, changes):
    """The intra-chunk kernel (decay factors, decayed products in sub-chunks of 8 steps, the
    exact triangular inverse, the WY form; DK and DV in BK / BV tiles) and its VJP's (the
    straddle sums, the exact-zero rule of linear gates) against chunkwise_channel's stages in
    float64: two chunks, three value heads, Dk = 40 and Dv = 72 zero-padded, exact zeros and
    log g = -37 on some channels; interpret mode (outputs start as NaN)."""
    problem = Problem(1, 3, 40, 72, gate="vector")
    kernels = pallas_gpu.load_kernels(_variant(**changes), problem)
    key = (kernels.sha256, kernels.interpret)
    shape = (2, 1, 1, 3, kernels.params["chunk_size"], 40, 72)
    check_intra_matches_the_float64_stages(pallas_gpu.channel_intra(key, gate, 0.25), shape,
                                           gate, 0.25)
    check_grads_match_the_float64_stages(pallas_gpu.channel_grads(key, gate, 0.25), shape,
                                         gate, 0.25)


@pytest.mark.slow
def test_per_channel_battery_case_runs_the_kernel_walks(monkeypatch):
    """pallas_gpu's kernel walks on a per-channel battery case (slow: about a minute here;
    `make test` has the walks' contract and the entry point's VJP through them)."""
    variant = default_variant("pallas_gpu", PROBLEM)
    check_battery_case_through_the_walks(monkeypatch, pallas_gpu, variant, _check)


@pytest.mark.slow
@pytest.mark.parametrize("changes", [
    {"chunk_size": 16, "bk": 16, "bv": 16},
    {"chunk_size": 32, "bk": 32, "bv": 32, "num_warps": 8},
], ids=["chunk16-tiles16", "chunk32"])
def test_per_channel_battery_on_other_variants(changes):
    """Every per-channel case on two more points of the vector variant space."""
    variant = Variant("pallas_gpu", dict(default_variant("pallas_gpu", PROBLEM).as_dict(),
                                         **changes))
    cases = [c.name for c in BATTERY if c.name.startswith("vector_")]
    _check(validate.run_battery(None, variant=variant, cases=cases), variant, "float32")


# ----------------------------------------------------------------------------- entry point


@pytest.mark.skipif(ON_GPU, reason="interpret mode is only used without a GPU")
def test_interpret_mode_warns_once_and_can_be_forced(monkeypatch):
    pallas_gpu._default_interpret_mode.cache_clear()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert pallas_gpu.interpret_mode() is True
            assert pallas_gpu.interpret_mode() is True
        assert len([w for w in caught if "interpret mode" in str(w.message)]) == 1
        pallas_gpu._default_interpret_mode.cache_clear()
        monkeypatch.setenv(pallas_gpu.ENV_INTERPRET, "1")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert pallas_gpu.interpret_mode() is True
        assert not caught  # asked for: no warning
    finally:
        pallas_gpu._default_interpret_mode.cache_clear()


def test_unwritten_outputs_are_poisoned_in_interpret_mode():
    """Interpret mode starts every output as NaN, so a kernel that skips part of an output
    fails the battery instead of passing on zeros."""
    from jax.experimental import pallas as pl

    def kernel(x_ref, o_ref):
        o_ref[:8] = x_ref[:8]

    out = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((16,), jnp.float32),
                         interpret=True)(jnp.ones(16, jnp.float32))
    assert np.isnan(np.asarray(out[8:])).all() and (np.asarray(out[:8]) == 1).all()


@pytest.mark.slow  # benchmark scripts: tests/test_bench.py
def test_benchmark_script_dry_run(tmp_path, monkeypatch):
    """benchmarks/bench_gpu_vs_fla.py parses its arguments and runs its validate and time steps
    at toy sizes in interpret mode (fla skipped without torch/CUDA), writing its tables."""
    from gdngen.flops import chunkwise_flops

    path = Path(__file__).resolve().parents[3] / "benchmarks/bench_gpu_vs_fla.py"
    spec = importlib.util.spec_from_file_location("bench_gpu_vs_fla", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    args = bench.parse_args(["--batches", "1,8", "--heads", "16", "--out", str(tmp_path)])
    assert (args.batches, args.heads, args.seq_lens[0]) == ([1, 8], [16], 4096)
    with pytest.raises(SystemExit):
        bench.parse_args(["--batches", "0"])
    monkeypatch.setenv(pallas_gpu.ENV_INTERPRET, "1")
    assert bench.main(["--dry-run", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "results.json").read_text())
    assert data["dry_run"] and [v["status"] for v in data["validation"]["2"]] == ["passed"] * 2
    (row,) = data["rows"]
    assert row["gdngen_ms"] > 0 and row["flops"] == chunkwise_flops(1, 64, 2, 2, 32, 32, 64)
    if data["fla_skipped"] is None:
        assert row["fla_ms"] > 0
    else:
        assert "fla_ms" not in row
    assert "| 1 | 64 | 2 |" in (tmp_path / "results.md").read_text()


@pytest.mark.cuda
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU: compiles the kernels with Triton "
                    "(the same kernels run in interpret mode above)")
def test_default_variant_on_gpu():
    problem = Problem(2, 4, 64, 64)
    for precision in pallas_gpu.PRECISIONS:
        variant = Variant("pallas_gpu", dict(default_variant("pallas_gpu", problem).as_dict(),
                                             precision=precision))
        assert pallas_gpu.interpret_mode() is False
        _check(validate.run_battery(None, variant=variant, dtype="float32"), variant,
               "float32")
