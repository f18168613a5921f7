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
from gdngen.variant import Problem, Variant

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


def _check_report(report, device):
    assert report.ok, report.first_error()
    assert report.compiler == "xla-gpu" and report.device == device
    assert report.target == compilers.GPU_SPECS[device]["description"]
    limit = devices.get_device(device).limits["shared_memory"]
    for program in report.programs:
        assert program.kernels, program.name
        for kernel in program.kernels:
            assert 0 < kernel["shared_memory"] <= kernel["shared_memory_limit"] == limit, (
                program.name, kernel)
            assert kernel["threads"][0] == 32 * report_warps(program, kernel), kernel


def report_warps(program, kernel):
    """A Triton launch has 32 threads per warp: its threads are a multiple of 32."""
    assert kernel["threads"][0] % 32 == 0 and kernel["threads"][1:] == [1, 1], (program.name,
                                                                                 kernel)
    return kernel["threads"][0] // 32


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
    report = compilers.compile_variant(_variant(problem, device), problem, device, T=64,
                                       only=("chunk_fwd_bwd", "recurrent_forward"))
    _check_report(report, device)
    names = {p.name: {k["name"] for k in p.kernels} for p in report.programs}
    assert names == {"chunk_fwd_bwd": CHUNK_KERNELS["scalar"],
                     "recurrent_forward": {"gdn_recurrent"}}
    record = json.loads(json.dumps(report.to_json()))
    assert record["ok"] is True and record["shared_memory_used"] == report.shared_memory_used > 0
    assert "vmem_used" not in record


@pytest.mark.parametrize("gate", ["scalar", "vector"])
def test_every_program_of_a_call_compiles(gate):
    """Chunk fwd+bwd, recurrent, packed row (scalar) and the fused-input build (qk_norm,
    softplus gate; fwd+bwd and recurrent) of a chunk-16 variant, for H100."""
    problem = SMALL[gate]
    report = compilers.compile_variant(_variant(problem, "h100"), problem, "h100", T=32)
    _check_report(report, "h100")
    expected = {"chunk_fwd_bwd", "recurrent_forward", "fused_fwd_bwd", "fused_recurrent_forward"}
    assert {p.name for p in report.programs} == expected | (
        {"packed_fwd_bwd"} if gate == "scalar" else set())


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
    device's shared memory) for D=128 heads compiles for the chip: the model never admits a
    variant the compiler rejects for size (minutes: chunk 32/64 ieee kernels)."""
    from gdngen.backends.pallas import gpu as pallas_gpu

    problem = Problem(1, 2, 128, 128, "bfloat16", "scalar")
    space = registry.variants("pallas_gpu", problem, device)
    largest = max(space, key=lambda v: pallas_gpu.shared_memory_bytes(v, problem))
    report = compilers.compile_variant(largest, problem, device, T=128,
                                       only=("chunk_fwd_bwd",))
    _check_report(report, device)
