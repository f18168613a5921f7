"""benchmarks/device/nvidia.sh (docs/DEVICE.md), checked cheaply: its shell syntax, the plan it
prints (steps, time boxes, the ``gdngen tune`` arguments, which the CLI must parse) and the
summary its steps' files make. The dry run itself (minutes on CPU) is run by hand."""

from __future__ import annotations

import importlib.util
import json
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "device" / "nvidia.sh"
STEPS = ("install", "env", "battery", "tune-qwen", "tune-kimi", "compare")

pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")


def _steps_module():
    spec = importlib.util.spec_from_file_location("device_steps", SCRIPT.parent / "steps.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _plan(tmp_path: Path, *flags: str, **env) -> list[tuple[str, int, list[str]]]:
    """(step, box seconds, command) of each step ``nvidia.sh --plan`` prints."""
    run_env = {"PATH": "/usr/bin:/bin", "PYTHON": sys.executable, "WORK": str(tmp_path),
               **({} if "--dry-run" in flags else {"DEVICE": "h100"}), **env}
    out = subprocess.run(["bash", str(SCRIPT), "--plan", *flags], env=run_env, check=True,
                         capture_output=True, text=True, timeout=60).stdout
    found = re.findall(r"^=== \[([\w-]+)\] \S+ box (\d+)s: (.*)$", out, re.MULTILINE)
    return [(name, int(box), shlex.split(cmd)) for name, box, cmd in found]


def test_shell_syntax():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True, timeout=30)


@pytest.mark.parametrize("dry_run", [False, True])
def test_plan_steps_boxes_and_tune_arguments(tmp_path, dry_run):
    from gdngen.tools.commands.tuning import tune

    plan = _plan(tmp_path, *(["--dry-run"] if dry_run else []))
    assert [name for name, _, _ in plan] == list(STEPS)
    if not dry_run:  # the run tool's timeout_s (570) leaves a minute over the boxes
        assert sum(box for _, box, _ in plan) <= 510
    tunes = {name: cmd for name, _, cmd in plan if name.startswith("tune-")}
    for name, cmd in tunes.items():
        args = cmd[cmd.index("tune") + 1:]
        assert args[args.index("--device") + 1] == ("h200" if dry_run else "h100")
        assert "--no-crossover" in args and args[args.index("--dtype") + 1] == "bfloat16"
        if not dry_run:
            model = {"tune-qwen": "qwen3-next", "tune-kimi": "kimi-linear"}[name]
            assert args[args.index("--model") + 1] == model
            assert args[args.index("--seq") + 1] == "4096"
            assert cmd[1:3] == ["-m", "gdngen"]
        ctx = tune.make_context("tune", list(args))  # every flag is one the CLI takes
        assert ctx.params["backends"] == ("pallas_gpu",)


def test_steps_subset_and_deadline(tmp_path):
    plan = _plan(tmp_path, STEPS="compare", TOTAL_S="40")
    assert [name for name, _, _ in plan] == ["compare"]
    assert plan[0][1] <= 35  # cut to what is left of TOTAL_S


def test_summary_from_partial_steps(tmp_path):
    steps = _steps_module()
    work, out, tuned = tmp_path / "work", tmp_path / "out", tmp_path / "tuned"
    for d in (work, out, tuned):
        d.mkdir()
    for step, rc in (("install", "0"), ("battery", "124"), ("tune-qwen", "skipped")):
        steps.main(["record", "--work", str(work), "--step", step, "--rc", rc, "--seconds", "1",
                    "--box", "10"])
    (work / "env.json").write_text(json.dumps({"device": "h100", "dry_run": False,
                                               "versions": {"jax": "0.11.2"}}))
    (work / "battery.json").write_text(json.dumps({"backend": "pallas_gpu", "dtypes": {
        "float32": [{"case": "t1", "status": "pass", "worst": 1e-7, "worst_quantity": "y",
                     "tolerance": 5e-5}, {"case": "short", "status": "not run (time budget)"}]}}))
    (work / "compare.json").write_text(json.dumps({
        "dtype": "bfloat16", "variants": {}, "fla_skipped": {"kimi-linear": "no fla"},
        "timing": "t", "published_source": "p",
        "rows": [{"model": "qwen3-next", "B": 1, "T": 4096, "gdngen": {"fwd_ms": 1.0,
                  "fwd_bwd_ms": 3.0}, "fla": {"fwd_ms": 0.5, "fwd_bwd_ms": 1.5},
                  "published": steps.PUBLISHED[(1, 4096)]}]}))
    steps.main(["summary", "--work", str(work), "--out", str(out), "--device", "h100",
                "--tuned-dir", str(tuned)])
    results = json.loads((out / "results.json").read_text())
    assert [s["step"] for s in results["steps"]] == ["install", "battery", "tune-qwen"]
    assert results["steps"][1]["timed_out"] and results["steps"][2]["rc"] is None
    md = (out / "summary.md").read_text()
    assert "TIMED OUT" in md and "| float32 | 1 | 0 | 1 |" in md
    assert "| qwen3-next | 1 | 4096 | 1.000 | 0.500 | 0.50 | 3.000 | 1.500 | 0.50 |" in md
    assert "fla not timed for kimi-linear: no fla" in md


def test_tune_args_and_problems():
    steps = _steps_module()
    assert steps.problem_of("qwen3-next", False).key() == \
        "hk16-hv32-dk128-dv128-bfloat16-scalar"
    assert steps.problem_of("kimi-linear", False).gate == "vector"
    assert steps.problem_of("kimi-linear", True).gate == "vector"
    assert "--model" not in steps.tune_args("qwen3-next", True)


def test_wheels_target_and_ignore():
    makefile = (ROOT / "Makefile").read_text()
    target = makefile[makefile.index("DEVICE_PACKAGES ?="):]
    for name in ("optuna==", "sqlalchemy==", "alembic==", "platformdirs==", "fla-core==0.6"):
        assert name in target
    assert "--python-version 3.12" in target and "--only-binary=:all:" in target
    assert ".device-wheels/" in (ROOT / ".gitignore").read_text().splitlines()


def test_timing_uses_prepared_inputs(monkeypatch):
    """``inputs=`` (the compare step draws them on the GPU) replaces `make_inputs`."""
    from gdngen.problem import Problem
    from gdngen.tools import timing

    problem = Problem(1, 1, 16, 16, "float32")
    inputs = timing.make_inputs(problem, 1, 3)

    def drawn_again(*args, **kwargs):
        raise AssertionError("make_inputs called despite inputs=")

    def stand_in(q, k, v, g, beta, s0, *, scale, gate):
        return v * scale, s0

    monkeypatch.setattr(timing, "make_inputs", drawn_again)
    kw = {"batch": 1, "seq_len": 3, "repeats": 1, "inputs": inputs}
    assert timing.time_forward("jax", {"f": stand_in}, problem, **kw)["f"].median_s >= 0
    assert timing.time_fwd_bwd("jax", {"f": stand_in}, problem, **kw)["f"].median_s >= 0
