"""Command line: help, lazy framework imports, bench rows, validate exit codes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from gdngen.tools import bench
from gdngen.tools.cli import main

ROOT = Path(__file__).resolve().parent.parent
TINY = ["--seq-lens", "64", "--dk", "16", "--dv", "16", "--hk", "1", "--hv", "2",
        "--repeats", "1", "--matmul-n", "128", "--json"]


def test_help_lists_commands():
    result = CliRunner().invoke(main, ["--help"])
    assert result.exit_code == 0, result.output
    assert "validate" in result.output
    assert "bench" in result.output


def test_import_does_not_import_frameworks():
    code = ("import sys, gdngen.tools.cli, gdngen.tools.bench, gdngen.flops, gdngen.resources; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'mlx')))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True, cwd=ROOT)
    assert proc.stdout.strip() == "[]"


def _check_rows(rows, framework):
    assert len(rows) == 1
    row = rows[0]
    assert tuple(row) == bench.ROW_KEYS
    assert row["framework"] == framework and row["T"] == 64
    assert row["chunk_ms"] > 0 and row["baseline_ms"] > 0 and row["speedup"] > 0
    assert row["chunk_gflops"] > 0 and row["matmul_gflops"] > 0 and row["matmul_ratio"] > 0
    assert row["flops"] == bench.chunkwise_flops(1, 64, 1, 2, 16, 16, 64)


@pytest.mark.skipif(not (ROOT / "gdngen" / "jax.py").exists(),
                    reason="gdngen/jax.py (the JAX entry point) does not exist yet")
def test_bench_jax_json_and_out(tmp_path):
    pytest.importorskip("jax")
    out = tmp_path / "rows.json"
    result = CliRunner().invoke(main, ["bench", "--framework", "jax", *TINY, "--out", str(out)])
    assert result.exit_code == 0, result.output
    rows = json.loads(result.stdout)
    _check_rows(rows, "jax")
    assert rows[0]["gate"] == "scalar"
    assert json.loads(out.read_text()) == rows


@pytest.mark.skipif(not (ROOT / "gdngen" / "jax.py").exists(),
                    reason="gdngen/jax.py (the JAX entry point) does not exist yet")
def test_bench_vector_gate():
    """``gdngen bench --gate vector`` times a per-channel-gate problem (g [B,T,Hv,Dk])."""
    pytest.importorskip("jax")
    result = CliRunner().invoke(main, ["bench", "--framework", "jax", "--gate", "vector", *TINY])
    assert result.exit_code == 0, result.output
    rows = json.loads(result.stdout)
    _check_rows(rows, "jax")
    assert rows[0]["gate"] == "vector"
    result = CliRunner().invoke(main, ["bench", "--gate", "channel"])
    assert result.exit_code == 2 and "channel" in result.output


@pytest.mark.skipif(not (ROOT / "gdngen" / "mlx.py").exists(),
                    reason="gdngen/mlx.py (the MLX entry point) does not exist yet")
def test_bench_mlx_json():
    pytest.importorskip("mlx.core")
    pytest.importorskip("mlx_lm")
    result = CliRunner().invoke(main, ["bench", "--framework", "mlx", *TINY])
    assert result.exit_code == 0, result.output
    _check_rows(json.loads(result.stdout), "mlx")


def test_bench_rejects_bad_options():
    result = CliRunner().invoke(main, ["bench", "--seq-lens", "64,x"])
    assert result.exit_code == 2
    result = CliRunner().invoke(main, ["bench", "--hk", "3", "--hv", "8"])
    assert result.exit_code == 2
    assert "multiple" in result.output


def _results(*passed):
    from gdngen.validate import CaseResult

    return [CaseResult(case=f"case{i}", dtype="float32", errors={"y": 0.0 if ok else 1.0},
                       tolerance=1e-3) for i, ok in enumerate(passed)]


def test_validate_exit_code_on_failure(monkeypatch):
    from gdngen import validate

    calls = []

    def fake_run_battery(backend, **kwargs):
        calls.append((backend, kwargs))
        return _results(True, False)

    monkeypatch.setattr(validate, "run_battery", fake_run_battery)
    result = CliRunner().invoke(main, ["validate", "--backend", "xla", "--dtype", "bfloat16",
                                       "--seed", "3", "--chunk-size", "16"])
    assert result.exit_code == 1
    assert "case1" in result.stderr and "case0" not in result.stderr
    assert calls == [("xla", {"dtype": "bfloat16", "cases": None, "seed": 3, "chunk_size": 16})]


def test_validate_json_and_pass(monkeypatch):
    from gdngen import validate

    monkeypatch.setattr(validate, "run_battery", lambda backend, **kw: _results(True, True))
    result = CliRunner().invoke(main, ["validate", "--backend", "mlx", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert [d["case"] for d in data] == ["case0", "case1"]
    assert all(d["passed"] for d in data)


def test_validate_case_selection(monkeypatch):
    from gdngen import cases, validate

    name = cases.BATTERY[0].name
    seen = {}

    def fake_run_battery(backend, *, cases, **kwargs):
        seen["cases"] = cases
        return _results(True)

    monkeypatch.setattr(validate, "run_battery", fake_run_battery)
    result = CliRunner().invoke(main, ["validate", "--backend", "xla", "--case", name])
    assert result.exit_code == 0, result.output
    assert [c.name for c in seen["cases"]] == [name]
    result = CliRunner().invoke(main, ["validate", "--backend", "xla", "--case", "no-such-case"])
    assert result.exit_code == 2
    assert "no-such-case" in result.output
