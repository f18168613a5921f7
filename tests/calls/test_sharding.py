"""gated_delta on many devices: inside jax.shard_map (check_vma=True), under a jit of sharded
inputs (partitioned, no collectives), with context parallelism over a sequence axis, and vmap
on a many-device host — every JAX backend, against the float64 reference of the battery.

Each check runs `tests/calls/sharding_checks.py` in a subprocess on an 8-device host platform
(``--xla_force_host_platform_device_count=8``: the real SPMD partitioner), with poisoned
ffi_cpu outputs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from slow import marked

pytest.importorskip("jax")

CHECKS = Path(__file__).with_name("sharding_checks.py")
JAX_BACKENDS = ("xla", "ffi_cpu", "pallas_tpu", "pallas_gpu")
#: Pallas' HLO interpreter (pallas_gpu off-GPU) evaluates the kernel body on shard_map's
#: varying values without inserting the casts its trace skipped, so under check_vma=True it
#: fails off-device (a JAX interpret-mode limitation); the same code runs there with
#: check_vma=False, and test_pallas_gpu_lowers_under_checked_shard_map lowers it through Triton
#: with check_vma=True.
CHECK_VMA = {"pallas_gpu": False}
CONTEXT_CASES = ("strong_decay", "hard_decay", "identical_keys", "gates_exact_one_and_zero",
                 "padding_mask", "gva3")
#: the interpret-mode backends skip the two Dk = Dv = 64 cases (a local pass of 128 value rows
#: in the interpreters on 8 devices takes most of an hour); the combine is the same code for
#: every backend, and xla / ffi_cpu run the whole list
INTERPRETED_CONTEXT_CASES = ("strong_decay", "gates_exact_one_and_zero", "padding_mask", "gva3")


def run_checks(request: dict, timeout: int = 900) -> dict:
    # XLA without its backend optimizations (LLVM at -O0): the checks are compile-bound (about
    # half the time), and what they check (the partitioned HLO, its collectives and output
    # specs, values against the float64 reference and the one-device call) is the same
    env = dict(os.environ, GDNGEN_POISON_OUTPUTS="1", JAX_DISABLE_MOST_OPTIMIZATIONS="1")
    env.pop("XLA_FLAGS", None)
    proc = subprocess.run([sys.executable, str(CHECKS), json.dumps(request)], check=False,
                          env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def assert_cases_pass(report: dict, cases) -> None:
    assert sorted(report["cases"]) == sorted(cases)
    for name, result in report["cases"].items():
        errors = result["errors"]
        assert {"y", "final_state", "dq", "dk", "dv", "dg", "dbeta", "dg_linear"} <= set(errors)
        worst = max(errors.values())
        assert result["passed"] and worst <= result["tolerance"], (name, errors)
        # and the same numbers as the one-device call, to float32 rounding
        assert result["vs_unsharded"] < 1e-5, (name, result["vs_unsharded"])


# xla's in make test-all (xla sharded: the sharded jit below); pallas_gpu's too (pallas_gpu
# sharded: test_pallas_gpu_lowers_under_checked_shard_map)
@pytest.mark.parametrize("backend", marked(JAX_BACKENDS, {"xla", "pallas_gpu"}))
def test_shard_map_over_data_and_heads_matches_reference(backend):
    # padding_mask: initial state given, masks; gva3: 3 value heads per key head, no initial
    # state (None inside shard_map), Dk != Dv (ffi_cpu; the others padding_mask only: ~30 s of
    # interpreting a case on the Pallas backends, ~25 s of compiling one on xla)
    cases = ("padding_mask", "gva3") if backend == "ffi_cpu" else ("padding_mask",)
    report = run_checks({"mode": "shard_map", "backend": backend, "cases": cases,
                         "check_vma": CHECK_VMA.get(backend, True)})
    assert_cases_pass(report, cases)
    assert "dinitial_state" in report["cases"]["padding_mask"]["errors"]


# the Pallas ones in make test-all: each runs sharded in test_shard_map_... above (pallas_gpu:
# test_pallas_gpu_lowers_under_checked_shard_map)
@pytest.mark.parametrize(("backend", "mode"), marked(
    [(b, "jit") for b in JAX_BACKENDS] + [("ffi_cpu", "explicit")],
    {("pallas_tpu", "jit"), ("pallas_gpu", "jit")}))
def test_sharded_jit_runs_per_shard_without_collectives(backend, mode):
    # jit: mesh axes Auto (custom_partitioning ops); explicit: shardings in the types (an inner
    # shard_map over the input mesh, the path every backend takes in the shard_map test)
    # ffi_cpu (both modes) adds gva3; the shard_map test runs it on every backend
    cases = ("padding_mask", "gva3") if backend == "ffi_cpu" else ("padding_mask",)
    report = run_checks({"mode": mode, "backend": backend, "cases": cases})
    assert_cases_pass(report, cases)
    tokens, state = "P('data', None, 'heads')", "P('data', 'heads')"
    for name, result in report["cases"].items():
        assert result["collectives"] == [], name
        y, final_state, *grads = result["output_specs"]
        assert (y, final_state) == (tokens, state)
        # dq dk dv dg dbeta (and dinitial_state where the case has an initial state)
        assert grads == [tokens] * 5 + [state] * (name == "padding_mask")


def test_load_tuned_under_a_sharded_jit_runs_per_shard_without_collectives():
    # the callable model code uses: the same entry body as gated_delta, so the same placement
    # (it once skipped it, all-gathered every input and returned replicated outputs)
    cases = ("padding_mask",)
    report = run_checks({"mode": "jit", "backend": "ffi_cpu", "cases": cases,
                         "entry": "load_tuned"})
    assert_cases_pass(report, cases)
    result = report["cases"]["padding_mask"]
    assert result["collectives"] == []
    tokens, state = "P('data', None, 'heads')", "P('data', 'heads')"
    assert result["output_specs"] == [tokens, state] + [tokens] * 5 + [state]


def test_sharded_jit_rejects_shardings_that_split_time_head_dims_or_groups():
    errors = run_checks({"mode": "errors"})
    assert "q is sharded as P(None, 'model', None, None)" in errors["time"]
    assert "time axis is sharded" in errors["time"] and "context_axis" in errors["time"]
    assert "v is sharded as P(None, None, 'model', None)" in errors["gva_group"]
    assert "whole GVA groups (Hk=2 key heads, 4 value heads each)" in errors["gva_group"]
    assert "v is sharded as P(None, None, None, 'model')" in errors["head_dim"]
    assert "head-dim axis is sharded" in errors["head_dim"]
    assert all(kind == "ValueError" for kind in errors["eager_types"].values())


# pallas_gpu's too: context parallelism keeps [ffi_cpu] and
# test_context_parallel_composes_with_head_sharding
@pytest.mark.parametrize("backend", marked(JAX_BACKENDS, {"pallas_tpu", "xla", "pallas_gpu"}))
def test_context_parallel_matches_reference(backend):
    # pallas_tpu's (~50 s of interpreting) and xla's (~30 s of compiling) in make test-all: the
    # combine is the same code for every backend, and both run shard_map and the sharded jit
    # in make test
    cases = {"ffi_cpu": ("gates_exact_one_and_zero", "padding_mask"),
             "xla": ("gates_exact_one_and_zero",)}.get(backend, ("strong_decay",))
    report = run_checks({"mode": "context", "backend": backend, "cases": cases,
                         "check_vma": CHECK_VMA.get(backend, True)})
    assert_cases_pass(report, cases)


def test_context_parallel_composes_with_head_sharding():
    # data x seq x heads = 2 x 2 x 2; gva3: each head shard holds one group of 3 value heads
    cases = ("gva3", "padding_mask")
    assert_cases_pass(run_checks({"mode": "context3", "backend": "ffi_cpu", "cases": cases}),
                      cases)


@pytest.mark.slow
@pytest.mark.parametrize("backend", JAX_BACKENDS)
def test_context_parallel_battery(backend):
    cases = INTERPRETED_CONTEXT_CASES if backend.startswith("pallas") else CONTEXT_CASES
    report = run_checks({"mode": "context", "backend": backend, "cases": cases,
                         "check_vma": CHECK_VMA.get(backend, True)}, timeout=3000)
    assert_cases_pass(report, cases)


def test_context_parallel_communication_does_not_grow_with_T():
    report = run_checks({"mode": "communication"})
    short, long = report["T=64"], report["T=256"]
    assert short == long
    # per device (B=1 of 2 on "data"), P=4 seq shards, Hv=4, Dk=Dv=16, float32: the forward
    # gathers the transitions (M, N), the backward all-reduces the entering-state cotangents
    P, B, Hv, Dk, Dv = 4, 1, 4, 16, 16
    assert short == {"all-gather": P * B * Hv * Dk * (Dk + Dv) * 4,
                     "all-reduce": P * B * Hv * Dv * Dk * 4}


def test_vmap_on_a_many_device_host():
    report = run_checks({"mode": "vmap", "backend": "ffi_cpu"})
    assert report["n"] == 6 and report["max_relative_difference"] < 1e-6


@pytest.mark.parametrize("backend", marked(["xla", "ffi_cpu"], {"xla"}))  # [ffi_cpu] keeps it
def test_layer_inputs_on_a_many_device_host(backend):
    """qk_norm, the softplus gate and beta logits on 8 devices: an eager one-device forward, a
    differentiated one-device call, a jit of inputs sharded over data x heads (the partitioned
    path; also per-channel gates with Hk = Hv, where Shardy takes no GVA factor of size 1), a
    shard_map over heads (A_log, dt_bias per shard) and per-row gradients under vmap of the
    sharded jit give the value and every gradient of the same loss with the inputs computed
    outside the op; on every one of those paths the chunk core computes the gate (never
    `computed_gate` before the call), and the fused norm keeps no normalised q, k for the
    backward."""
    report = run_checks({"mode": "layer_inputs", "backend": backend})
    assert set(report["differences"]) == {"eager_forward", "eager", "jit_sharded", "shard_map",
                                          "jit_sharded_vector", "vmap_grads"}
    assert max(report["differences"].values()) < 1e-5, report["differences"]
    assert report["gate_computed_outside"] == 0
    saved = report["residual_bytes"]["outside"] - report["residual_bytes"]["fused"]
    assert saved >= report["qk_bytes"], report["residual_bytes"]


def test_output_norm_on_a_many_device_host():
    """``gated_delta(..., norm_weight=, output_gate=)`` on 8 devices (ffi_cpu): eager
    one-device calls (a short row through the recurrent kernel's norm build, a chunked row),
    a jit over inputs sharded over data x heads and a shard_map over heads give the value and
    every gradient of the call followed by the gated norm on one device."""
    report = run_checks({"mode": "output_norm", "backend": "ffi_cpu"})
    assert len(report["differences"]) == 8, report
    assert max(report["differences"].values()) < 1e-5, report["differences"]


def test_pallas_gpu_lowers_under_checked_shard_map():
    report = run_checks({"mode": "lower_gpu"})
    assert report["triton_calls"] >= 3  # forward, residuals / state grads, chunk grads
