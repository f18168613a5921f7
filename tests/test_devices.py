"""Device registry and detection: framework device descriptions -> registry names, fail-fast
checks for devices that are not attached, and ``gdngen devices``."""

from __future__ import annotations

import time

import pytest
from click.testing import CliRunner

from gdngen import devices
from gdngen.tools.cli import main


@pytest.mark.parametrize("platform, kind, expected", [
    ("cpu", "cpu", "cpu"),
    ("tpu", "TPU v4", "tpu-v4"),
    ("tpu", "TPU v5 lite", "tpu-v5e"),
    ("tpu", "TPU v5e", "tpu-v5e"),
    ("tpu", "TPU v5p", "tpu-v5p"),
    ("tpu", "TPU v5", "tpu-v5p"),
    ("tpu", "TPU v6 lite", "tpu-v6e"),
    ("tpu", "TPU7x", "tpu-v7x"),
    ("tpu", "TPU7", None),
    ("tpu", "TPU v3", None),
    ("gpu", "NVIDIA A100-SXM4-40GB", "a100"),
    ("gpu", "NVIDIA H100 80GB HBM3", "h100"),
    ("cuda", "NVIDIA H200", "h200"),
    ("gpu", "NVIDIA L4", None),
    ("rocm", "AMD Instinct MI300X", None),
])
def test_jax_device_kinds_map_to_registry(platform, kind, expected):
    assert devices.device_from_jax(platform, kind) == expected


@pytest.mark.parametrize("gpu, info, expected", [
    (False, {"architecture": "x86_64", "device_name": "Intel(R) Xeon(R) Processor"}, "cpu"),
    (True, {"device_name": "Apple M1", "architecture": "applegpu_g13g"}, "apple-m1"),
    (True, {"device_name": "Apple M3 Max"}, "apple-m3"),
    (True, {"device_name": "Apple M5 Pro"}, "apple-m5"),
    (True, {"device_name": "Apple M9"}, None),
    (True, {}, None),
])
def test_mlx_device_info_maps_to_registry(gpu, info, expected):
    assert devices.device_from_mlx(gpu, info) == expected


def test_detect_matches_what_each_framework_reports():
    import jax

    dev = jax.devices()[0]
    assert devices.detect("jax") == devices.device_from_jax(dev.platform, dev.device_kind)
    import mlx.core as mx

    gpu = mx.metal.is_available() and mx.default_device().type == mx.DeviceType.gpu
    assert devices.detect("mlx") == devices.device_from_mlx(gpu, mx.device_info())
    assert devices.detect() in devices.DEVICES


def test_unknown_device_and_framework_are_value_errors():
    with pytest.raises(ValueError, match="device must be one of"):
        devices.get_device("tpu-v9")
    with pytest.raises(ValueError, match="framework must be one of"):
        devices.detect_framework("torch")


def test_require_attached_says_what_was_found():
    attached = devices.detect("jax")
    assert devices.require_attached(attached, "jax").name == attached
    other = "tpu-v5e" if attached != "tpu-v5e" else "h100"
    with pytest.raises(ValueError, match=rf"{other}.*not attached.*jax runs on {attached}"):
        devices.require_attached(other, "jax")


def test_tune_on_a_device_that_is_not_attached_fails_fast(tmp_path, monkeypatch):
    monkeypatch.setenv("GDNGEN_CACHE_DIR", str(tmp_path))
    other = "tpu-v5e" if devices.detect("jax") != "tpu-v5e" else "h100"
    start = time.perf_counter()
    result = CliRunner().invoke(main, ["tune", "--device", other, "--framework", "jax",
                                       "--heads", "1,2", "--dim", "16,16", "--seq", "64"])
    assert result.exit_code == 2, result.output
    assert "not attached" in result.output and "jax runs on" in result.output
    assert time.perf_counter() - start < 20
    assert not (tmp_path / "studies").exists()  # nothing was started


def test_devices_command_marks_the_attached_device():
    result = CliRunner().invoke(main, ["devices"])
    assert result.exit_code == 0, result.output
    attached = devices.detect("jax")
    row = next(line for line in result.output.splitlines() if f" {attached} " in line)
    assert "* jax" in row
    for name in devices.DEVICES:
        assert name in result.output


def test_devices_table_marks_topologies_that_cannot_be_compiled_for_here():
    """A device whose compile-only topology is missing here (e.g. TPU7x with a libtpu that does
    not know ``tpu7x:2x2x1``) stays listed, its topology marked unavailable and the reason below
    the table; every TPU row shows its MXU."""
    reason = "the installed libtpu 0.0.1 does not know the topology 'tpu7x:2x2x1' (...)"
    table = devices.format_table({}, {}, {"tpu-v7x": reason, "tpu-v4": reason})
    row = next(line for line in table.splitlines() if " tpu-v7x " in line)
    assert "tpu7x:2x2x1 (unavailable)" in row and "vmem=64 MiB" in row and "mxu=256x256" in row
    assert f"no compile-only topology here for tpu-v7x, tpu-v4: {reason}" in " ".join(
        table.split())
    assert "(unavailable)" not in next(line for line in table.splitlines() if " tpu-v5e " in line)
