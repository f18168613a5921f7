"""pallas_gpu compiled for real NVIDIA GPUs without one: XLA GPU + Triton + ptxas through jax's
CUDA plugin, deviceless, on compile-only devices of each chip's ``GpuTargetConfigProto``
(`gdngen.compilers`); the shared memory each kernel launch takes against the device's limit and
the footprint model.

Skips (with the reason) when the plugin or ptxas/libdevice is not installed
(``pip install 'gdngen[cuda]'``). The fast tests compile chunk-16 variants of small heads (a
chunk-64 ieee variant at D=128 takes minutes per program: docs/COMPILE.md).
"""

from __future__ import annotations

import json

import pytest

from gdngen import compilers, devices, registry
from gdngen.problem import Problem
from gdngen.variant import Variant

pytestmark = pytest.mark.skipif(compilers.missing_reason("xla-gpu") is not None,
                                reason=str(compilers.missing_reason("xla-gpu")))

GPUS = [name for name, d in devices.DEVICES.items() if d.kind == "gpu"]
SMALL = {"scalar": Problem(1, 2, 32, 32, "bfloat16", "scalar"),
         "vector": Problem(2, 2, 32, 32, "bfloat16", "vector")}
CHUNK_KERNELS = {"scalar": {"gdn_intra", "gdn_walk", "gdn_state_grads", "gdn_chunk_grads"}}


def _variant(problem, device, **params):
    """The device's default variant of ``problem`` with ``params`` (chunk 16 unless given)."""
    base = registry.default_variant("pallas_gpu", problem, device)
    return Variant("pallas_gpu", dict(base.params, **({"chunk_size": 16} | params)))


def _check_report(report, device, variant):
    """Every program compiled, each Triton launch within the device's shared memory and with
    the variant's ``num_warps`` (32 threads each)."""
    assert report.ok, report.first_error()
    assert report.compiler == "xla-gpu" and report.device == device
    assert report.target == compilers.GPU_SPECS[device]["description"]
    limit = devices.get_device(device).limits["shared_memory"]
    for program in report.programs:
        assert program.kernels, program.name
        for kernel in program.kernels:
            assert 0 < kernel["shared_memory"] <= kernel["shared_memory_limit"] == limit, (
                program.name, kernel)
            assert kernel["threads"] == [32 * variant.get("num_warps"), 1, 1], kernel


def test_every_gpu_device_has_a_target():
    """Each NVIDIA device gives a compile-only jax device the registry names back, its target
    config opting in to exactly the device's shared memory limit."""
    assert set(GPUS) == {"a100", "h100", "h200"} == set(compilers.GPU_SPECS)
    kinds = {name: compilers.target_device(name).device_kind for name in GPUS}
    assert {name: devices.device_from_jax("gpu", kind) for name, kind in kinds.items()} == {
        name: name for name in GPUS}, kinds
    for name in GPUS:
        limit = devices.get_device(name).limits["shared_memory"]
        assert f"shared_memory_per_block_optin: {limit}\n" in compilers.gpu_target_config(name)


@pytest.mark.parametrize("device", ["h100", "a100"])
def test_chunk_and_recurrent_programs_compile(device):
    """A chunk-16 variant's chunk forward + backward (the four chunk kernels) and its recurrent
    forward, compiled for the chip."""
    problem = SMALL["scalar"]
    variant = _variant(problem, device, num_warps=8)
    report = compilers.compile_variant(variant, problem, device, T=64,
                                       only=("chunk_fwd_bwd", "recurrent_forward"))
    _check_report(report, device, variant)
    names = {p.name: {k["name"] for k in p.kernels} for p in report.programs}
    assert names == {"chunk_fwd_bwd": CHUNK_KERNELS["scalar"],
                     "recurrent_forward": {"gdn_recurrent"}}
    record = json.loads(json.dumps(report.to_json()))
    assert record["ok"] is True and record["shared_memory_used"] == report.shared_memory_used > 0
    assert "vmem_used" not in record


def test_vector_gate_programs_compile():
    """Per-channel gates: chunk fwd+bwd (the intra-chunk kernel, the two chunk walks) and the
    fused-input recurrent kernel (qk_norm, softplus gate, the output norm in its stores: bv is
    the padded Dv here) of a chunk-16 variant, for H100."""
    problem = SMALL["vector"]
    variant = _variant(problem, "h100")
    report = compilers.compile_variant(variant, problem, "h100", T=32,
                                       only=("chunk_fwd_bwd", "fused_recurrent_forward"))
    _check_report(report, "h100", variant)
    names = {p.name: {k["name"] for k in p.kernels} for p in report.programs}
    assert names["fused_recurrent_forward"] == {"gdn_recurrent"}, names
    assert len(names["chunk_fwd_bwd"]) >= 3, names  # the forward and the reverse walk
    assert "gdn_channel_intra" in names["chunk_fwd_bwd"], names  # the forward's intra stages
    assert "gdn_channel_decayed_keys" in names["chunk_fwd_bwd"], names  # the reverse walk's


@pytest.mark.parametrize("gate", ["scalar", "vector"])
def test_the_chunk_forward_norm_build_compiles(gate):
    """A variant whose walk programs hold the head's whole Dv (``bv`` = Dv) has the
    ``fused_chunk_forward`` program (the chunk forward's norm build: the 4-tap conv, qk_norm
    and the softplus gate in its loads, the gated norm in the walk's stores); it compiles for
    H100 to the two forward kernels (per-channel: the intra-chunk kernel, which convolves, and
    the walk) and nothing else (no conv before them, no norm after them, no backward). A
    variant splitting Dv has no such program."""
    problem = SMALL[gate]
    variant = _variant(problem, "h100", bv=32)
    assert registry.get("pallas_gpu").holds_whole_head(variant, problem)
    report = compilers.compile_variant(variant, problem, "h100", T=48,
                                       only=("fused_chunk_forward",))
    _check_report(report, "h100", variant)
    assert {p.name: {k["name"] for k in p.kernels} for p in report.programs} == {
        "fused_chunk_forward": {"gdn_intra", "gdn_walk"} if gate == "scalar" else
        {"gdn_channel_intra", "gdn_channel_walk"}}
    split = _variant(problem, "h100", bv=16)
    assert "fused_chunk_forward" not in dict(compilers.programs(split, problem, 48))


def test_build_compile_records_the_compile(tmp_path):
    """``gdngen build --backend pallas_gpu --device h100 --compile --json``: every program of a
    call (chunk fwd+bwd, recurrent, packed row, fused inputs) compiled, in the manifest."""
    from click.testing import CliRunner

    from gdngen.tools.cli import main

    problem = SMALL["scalar"]
    variant = json.dumps(dict(_variant(problem, "h100").params))
    result = CliRunner().invoke(main, [
        "build", "--backend", "pallas_gpu", "--problem", "Hk=1,Hv=2,Dk=32,Dv=32,dtype=bfloat16",
        "--device", "h100", "--compile", "--compile-seq", "32", "--no-validate", "--variant",
        variant, "--out", str(tmp_path / "out"), "--json"])
    assert result.exit_code == 0, result.output
    printed = json.loads(result.output[result.output.index("["):])
    entry = json.loads((tmp_path / "out" / "manifest.json").read_text())["variants"][0]
    assert printed[0]["compile"] == entry["compile"]
    record = entry["compile"]
    assert record["compiler"] == "xla-gpu" and record["target"] == "NVIDIA H100 80GB HBM3"
    assert record["ok"] is True and record["error"] is None and record["temp_bytes"] > 0
    assert 0 < record["shared_memory_used"] <= 227 * 1024
    assert [p["name"] for p in record["programs"]] == [
        "chunk_fwd_bwd", "recurrent_forward", "packed_fwd_bwd", "fused_fwd_bwd",
        "fused_recurrent_forward", "fused_chunk_forward", "steps_forward"]


def test_tune_space_drops_what_does_not_compile_for_a_gpu(tmp_path, monkeypatch):
    """`check_targets` runs the XLA GPU check for an NVIDIA target (a rejected variant leaves
    its space, the verdicts are remembered)."""
    from gdngen.tune.target import targets

    monkeypatch.setenv("GDNGEN_CACHE_DIR", str(tmp_path))
    (target,) = targets("a100", ("jax",), [SMALL["scalar"]], backends=("pallas_gpu",))
    space = target.space()
    rejected = space[0].name()
    compiled = []

    def compile_variant(variant, problem, device, **kwargs):
        compiled.append((variant.name(), device.name))
        error = "Shared memory size limit exceeded" if variant.name() == rejected else None
        return compilers.CompileReport("xla-gpu", "NVIDIA A100-SXM4-80GB", "a100", error=error)

    monkeypatch.setattr(compilers.verdicts, "compile_variant", compile_variant)
    ((checked, dropped),) = compilers.check_targets([target])
    assert dropped == {rejected: "Shared memory size limit exceeded"}
    assert [v.name() for v in checked.space()] == [v.name() for v in space[1:]]
    assert sorted(compiled) == sorted((v.name(), "a100") for v in space)
    compiled.clear()
    assert compilers.check_targets([target])[0][1] == dropped and compiled == []


def test_shared_memory_over_the_limit_is_the_compilers_rejection():
    """A variant the footprint model keeps out of A100's space (over its 163 KiB) is rejected by
    the compiler for shared memory: the failed program says so, the report is not ok."""
    from gdngen.backends.pallas import gpu as pallas_gpu

    problem = Problem(1, 2, 128, 128, "float32", "scalar")
    variant = _variant(problem, "a100", chunk_size=32, num_stages=3, bk=128, bv=128)
    assert pallas_gpu.shared_memory_bytes(variant, problem) > 163 * 1024
    report = compilers.compile_variant(variant, problem, "a100", T=64, only=("chunk_fwd_bwd",))
    assert not report.ok
    assert "shared memory" in report.first_error().lower(), report.first_error()


@pytest.mark.slow
@pytest.mark.parametrize("device", ["h100", "a100"])
def test_footprint_model_admits_what_fits(device):
    """The variant the footprint model admits with the largest estimate (closest to the
    device's shared memory) for D=128 heads compiles for the chip, every launch within the
    limit (h100: chunk 64, about 19 min on 2 busy cores; a100: chunk 32, about 3). Only that
    variant: the model's underestimate of the ieee chunk-parallel backward (up to 1.27x at
    D <= 64, docs/COMPILE.md) is far below the limits there."""
    from gdngen.backends.pallas import gpu as pallas_gpu

    problem = Problem(1, 2, 128, 128, "bfloat16", "scalar")
    space = registry.variants("pallas_gpu", problem, device)
    largest = max(space, key=lambda v: pallas_gpu.shared_memory_bytes(v, problem))
    report = compilers.compile_variant(largest, problem, device, T=128,
                                       only=("chunk_fwd_bwd",))
    _check_report(report, device, largest)


@pytest.mark.slow
def test_kimi_heads_default_vector_variant_compiles():
    """Kimi Linear's heads (Hk = Hv = 32, D = 128): the default per-channel variant's chunk
    fwd+bwd (six kernels) compiles for H100 (10-25 s here). Its loops over the BK tiles and
    its 32-wide tiles at 8 warps keep ptxas's time independent of D (at bk 64 / 4 warps the grads
    kernel alone had not compiled after 7 minutes: `CHANNEL_MAX_TILE`)."""
    from gdngen.backends.pallas.gpu import config

    problem = Problem(32, 32, 128, 128, "bfloat16", "vector")
    variant = registry.default_variant("pallas_gpu", problem, "h100")
    assert variant.get("bk") <= config.CHANNEL_MAX_TILE and variant.get("num_warps") == 8
    report = compilers.compile_variant(variant, problem, "h100", T=128,
                                       only=("chunk_fwd_bwd",))
    _check_report(report, "h100", variant)
    names = {k["name"] for p in report.programs for k in p.kernels}
    assert {"gdn_channel_intra", "gdn_channel_grads"} <= names, names
