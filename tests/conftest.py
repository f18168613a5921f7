"""Fixtures shared by several test files."""

from __future__ import annotations

import gc
import os
import sys

import pytest

# XLA:CPU's YNNPACK fusions (jaxlib 0.10.2, and the flag is still there in 0.12) segfault on
# this project's AMD EPYC hosts in a fused transpose (slinky::can_fuse, a YnnFusionThunk on an
# XLA worker thread): every run of test_returned_states.py's
# test_gradients_through_kernel_chunk_states[ffi_cpu-vector] crashed, at a different Python line
# each time. An empty fusion-type list turns them off; XLA's own fusions run instead. Set before
# jax is imported (here, and inherited by the tests' subprocesses that keep XLA_FLAGS).
_NO_YNN = "--xla_cpu_experimental_ynn_fusion_type="
if _NO_YNN not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_NO_YNN}".strip()

#: cases `make test` leaves to `make test-all` (the ``slow`` marker) to stay under its time
#: budget, each with the case that keeps its backend x feature in `make test`
SLOW_CASES = {
    "tests/calls/test_sharding.py::test_layer_inputs_on_a_many_device_host[xla]":
        "layer inputs on many devices: [ffi_cpu]",
    "tests/calls/test_sharding.py::test_sharded_jit_runs_per_shard_without_collectives"
    "[pallas_tpu-jit]": "pallas_tpu sharded: test_shard_map_over_data_and_heads[pallas_tpu]",
    "tests/calls/test_sharding.py::test_sharded_jit_runs_per_shard_without_collectives"
    "[pallas_gpu-jit]": "pallas_gpu sharded: test_shard_map_over_data_and_heads[pallas_gpu]",
    "tests/calls/test_sharding.py::test_shard_map_over_data_and_heads_matches_reference[xla]":
        "xla sharded: test_sharded_jit_runs_per_shard_without_collectives[xla-jit]",
    "tests/calls/test_sharding.py::test_context_parallel_matches_reference[pallas_gpu]":
        "context parallelism: [ffi_cpu] and test_context_parallel_composes_with_head_sharding",
    "tests/backends/pallas/test_pallas_tpu.py::test_default_variant_on_grouped_heads":
        "GVA on pallas_tpu: the gva3 battery case (test_conformance hard cases)",
    "tests/backends/pallas/test_pallas_tpu.py::test_variants_on_adversarial_cases"
    "[recompute-gva]": "pallas_tpu variants: [tf32], [bf16-policy]",
    "tests/backends/pallas/test_pallas_tpu.py::test_dv_tiles[False]": "Dv tiles: [True]",
    "tests/calls/test_chunkwise_channel.py::test_backward_by_chunk_groups_is_the_whole_backward"
    "[log]": "chunk-group backward: [linear]",
    "tests/calls/test_layer_inputs.py::test_fused_gate_keeps_no_log_gate_for_the_backward"
    "[portable-per_channel]": "per-channel fused gate residuals: [pallas_tpu-per_channel]",
    "tests/calls/test_layer_inputs.py::test_fused_gate_keeps_no_log_gate_for_the_backward"
    "[pallas_gpu-per_channel]": "per-channel fused gate residuals: [pallas_tpu-per_channel]",
    **{f"tests/calls/test_layer_inputs.py::test_layer_inputs_fused_into_the_chunk_core"
       f"[softplus_per_channel_kimi-{path}-jax-{backend}]":
       "Kimi's fused inputs on Pallas: tests/backends/pallas/test_pallas_fused_inputs.py"
       for path in ("chunkwise", "recurrent") for backend in ("pallas_tpu", "pallas_gpu")},
    "tests/calls/test_returned_states.py::test_chunk_boundary_states_match_the_float64_"
    "recurrence[ffi_cpu-vector]": "chunk-boundary states (the portable walk on every backend): "
                                  "[ffi_cpu-scalar] and the other backends' [*-vector]",
    "tests/backends/pallas/test_pallas_gpu.py::test_benchmark_script_dry_run":
        "benchmark scripts: tests/test_bench.py",
    "tests/calls/test_gated_delta.py::test_chunk_sizes[jax-16]": "chunk sizes: [jax-32], mlx",
    "tests/calls/test_gated_delta.py::test_chunk_sizes[jax-128]": "chunk sizes: [jax-32], mlx",
    "tests/test_shared_study.py::test_three_workers_one_journal_study_survive_a_sigkill":
        "shared studies: the PostgreSQL one",
    "tests/calls/test_gated_delta.py::test_chunk_sizes[jax-32]":
        "chunk 32 on xla: test_recurrent's short_masked; chunk sizes: mlx",
    "tests/calls/test_sharding.py::test_shard_map_over_data_and_heads_matches_reference"
    "[pallas_gpu]": "pallas_gpu sharded: test_pallas_gpu_lowers_under_checked_shard_map",
    "tests/calls/test_layer_inputs.py::test_fused_gate_keeps_no_log_gate_for_the_backward"
    "[pallas_tpu-per_channel]": "per-channel fused gate residuals: [ffi_cpu-per_channel]",
    "tests/calls/test_packed.py::test_packed_case_passes[xla-scalar]":
        "the portable packed path: [mlx-scalar]; xla packed rows: test_vmap_over_rows",
    "tests/calls/test_layer_inputs.py::test_layer_inputs_fused_into_the_chunk_core"
    "[softplus_per_channel_kimi-recurrent-jax-portable]": "[...-chunkwise-jax-portable]",
    "tests/test_bench.py::test_vector_gate_bench_smoke": "benchmark scripts: the other smokes",
    **{"tests/calls/test_returned_states.py::test_chunk_boundary_states_match_the_float64_"
       f"recurrence[{b}-vector]": "chunk-boundary states run the portable walk on every "
                                 "backend: [xla-vector], [mlx-vector]"
       for b in ("pallas_tpu", "pallas_gpu")},
    "tests/backends/pallas/test_pallas_gpu.py::test_every_variant_renders_distinct_sources":
        "an every-variant sweep; pallas_gpu renders: its sha256 and lowering tests",
    "tests/backends/pallas/test_pallas_tpu.py::test_variants_on_adversarial_cases[tf32]":
        "pallas_tpu precision policies: [bf16-policy]",
    **{"tests/calls/test_layer_inputs.py::test_layer_inputs_fused_into_the_chunk_core"
       f"[{name}-{path}-jax-{backend}]": "fused inputs on Pallas: [softplus_per_head-*] and "
                                        "tests/backends/pallas/test_pallas_fused_inputs.py"
       for name in ("qk_norm_only", "sigmoid_bound_per_head")
       for path in ("chunkwise", "recurrent") for backend in ("pallas_tpu", "pallas_gpu")},
    **{f"tests/calls/test_gated_delta.py::test_battery_reduced_precision[jax-{case}-bfloat16]":
       "bfloat16 on xla: [jax-hard_decay-bfloat16]; these cases in float32 on every backend"
       for case in ("gva3", "padding_mask")},
    "tests/calls/test_layer_inputs.py::test_fused_qk_norm_keeps_no_normalised_copies_for_the_"
    "backward[pallas_tpu]": "fused q/k norm residuals: [portable], [ffi_cpu], [pallas_gpu]",
}


def pytest_collection_modifyitems(config, items):
    """`SLOW_CASES` get the ``slow`` marker. A whole-suite collection (the default test paths)
    that does not find one of them is a usage error naming it: a renamed or removed test would
    otherwise drop out of the list silently."""
    seen = set()
    for item in items:
        if item.nodeid in SLOW_CASES:
            item.add_marker(pytest.mark.slow)
            seen.add(item.nodeid)
    whole = [str(a).rstrip("/") for a in config.args] == ["tests"] or not config.args
    missing = sorted(set(SLOW_CASES) - seen)
    if whole and missing:
        raise pytest.UsageError("tests/conftest.py SLOW_CASES names tests that were not "
                                f"collected (renamed or removed?): {missing}")


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_executables():
    """Releases each test module's compiled XLA executables when the module ends.

    An XLA:CPU executable holds ~18 memory maps; one suite process compiles thousands, and past
    the kernel's ``vm.max_map_count`` (65530) the next compile segfaults inside XLA.
    """
    yield
    jax = sys.modules.get("jax")
    if jax is not None:
        jax.clear_caches()
        gc.collect()


@pytest.fixture
def calls(monkeypatch):
    """Counts calls of gdngen.mlx.gated_delta and of mlx-lm's per-token gated_delta_ops (the
    mlx-lm integration tests: which path a patched model took)."""
    from mlx_lm.models import gated_delta as mlx_gated_delta

    import gdngen.mlx

    counts = {"gdngen": 0, "ops": 0}
    real_gdngen, real_ops = gdngen.mlx.gated_delta, mlx_gated_delta.gated_delta_ops

    def gdngen_spy(*args, **kwargs):
        counts["gdngen"] += 1
        return real_gdngen(*args, **kwargs)

    def ops_spy(*args, **kwargs):
        counts["ops"] += 1
        return real_ops(*args, **kwargs)

    monkeypatch.setattr(gdngen.mlx, "gated_delta", gdngen_spy)
    monkeypatch.setattr(mlx_gated_delta, "gated_delta_ops", ops_spy)
    return counts
