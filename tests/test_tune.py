"""Tuner: the validation gate (a planted wrong-but-fast variant is never best nor cached),
crashing / hanging / failing trials recorded while the study goes on, a SIGKILLed study resumed
without losing trials, two processes tuning one storage, dry runs off-device, report plots.

The studies tune MLX at a tiny shape (fast, no compile step) with per-trial subprocesses.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import optuna
import pytest
from polling import wait_for

from gdngen import cache, registry, tune
from gdngen.problem import Problem
from gdngen.tune import search
from gdngen.variant import Variant

ROOT = Path(__file__).resolve().parent.parent


def tiny(seq=64):
    """`gdngen tune` options for a tiny MLX problem on the CPU."""
    return ["--framework", "mlx", "--device", "cpu", "--heads", "1,2", "--dim", "16,16",
            "--seq", str(seq), "--cases", "short", "--repeats", "1"]



# A backend registered from outside gdngen (GDNGEN_PLUGINS), run through gdngen.mlx.gated_delta.
# mode "ok" is correct but does 4x the work; "wrong" is 1% off in y but fast; "crash" kills its
# process; "hang" never returns.
PLUGIN = textwrap.dedent('''
    import dataclasses, os, time
    from gdngen import registry
    from gdngen.backends.portable import TOLERANCES
    from gdngen.config import VariantConfig
    from gdngen.variant import Variant

    NAME = "planted"
    MODES = ("ok", "wrong", "crash", "hang")

    @dataclasses.dataclass(frozen=True)
    class Config(VariantConfig):
        backend = NAME
        chunk_size: int = 16
        mode: str = "ok"

        def check(self):
            self.check_choice("mode", MODES)

    def space(problem, device=None):
        return [Config(16, m) for m in MODES]

    def default(problem, device=None):
        return Config(16, "ok")

    def _portable(v):
        return Variant("mlx", {"chunk_size": v["chunk_size"], "solve_block": 8,
                               "save_states": True})

    def _act(mode):
        if mode == "crash":
            os._exit(3)
        if mode == "hang":
            time.sleep(3600)

    def gated_delta(q, k, v, g, beta, initial_state, *, mask, scale, gate, variant):
        from gdngen.mlx import gated_delta as mlx_gated_delta
        _act(variant["mode"])
        def run():
            return mlx_gated_delta(q, k, v, g, beta, initial_state, mask=mask, scale=scale,
                                   gate=gate, variant=_portable(variant))
        y, s = run()
        if variant["mode"] == "wrong":
            return y * 1.01, s
        for _ in range(3):  # MLX is lazy: fold the extra work into the result
            y2, s2 = run()
            y, s = y + 0.0 * y2, s + 0.0 * s2
        return y, s

    SPEC = registry.BackendSpec(
        name=NAME, framework="mlx", config=Config, space=space, default=default,
        entry=gated_delta, tolerances=TOLERANCES, device_kinds=("cpu", "apple"),
        source_modules=(__name__,))
    registry.register(NAME, __name__)
''')



@pytest.fixture
def env(tmp_path, monkeypatch):
    """Environment of a tuner subprocess: own cache root, the plugin importable."""
    (tmp_path / "planted_backend.py").write_text(PLUGIN)
    monkeypatch.setenv("GDNGEN_CACHE_DIR", str(tmp_path / "root"))
    values = dict(os.environ, GDNGEN_CACHE_DIR=str(tmp_path / "root"),
                  PYTHONPATH=os.pathsep.join([str(ROOT), str(tmp_path)]))
    values.pop("GDNGEN_PLUGINS", None)
    return values


def gdngen_cli(*args, env, timeout=300):
    proc = subprocess.run([sys.executable, "-m", "gdngen.tools.cli", *args], env=env, check=False,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def evaluated(study):
    """Trials that hold their variant's result: COMPLETE, or FAIL with the failure recorded.
    A tuner killed between recording a trial's result and telling the study leaves it RUNNING
    with ``evaluated`` set; it holds nothing, and its re-queued copy runs the variant again."""
    return [t for t in study.get_trials() if t.user_attrs.get("evaluated")
            and (t.state.name == "COMPLETE"
                 or (t.state.name == "FAIL" and "failure" in t.user_attrs))]


def test_select_best_never_picks_an_infeasible_variant():
    fast_wrong = tune.Record(Variant("xla", {"c": 1}), False, 0.001, 0.5, "s1")
    slow_right = tune.Record(Variant("xla", {"c": 2}), True, 0.010, 1e-7, "s2")
    stale = tune.Record(Variant("xla", {"c": 3}), True, 0.002, 1e-7, "old")
    failed = tune.Record(Variant("xla", {"c": 4}), True, None, 1e-7, "s4")
    current = {fast_wrong.variant: "s1", slow_right.variant: "s2", stale.variant: "new",
               failed.variant: "s4"}
    assert tune.select_best([fast_wrong, stale, failed, slow_right], current) is slow_right
    assert tune.select_best([fast_wrong, stale], current) is None


def test_precision_policy_bounds_the_space_and_the_tolerance():
    def allowed(target_policy, **params):
        return tune._precision_allowed(Variant("b", params), target_policy)

    assert allowed("ieee", precision="ieee") and not allowed("ieee", precision="tf32")
    assert allowed("tf32", precision="ieee") and allowed("tf32", precision="tf32")
    assert not allowed("tf32", precision="bf16") and allowed("bf16", precision="bf16")
    assert allowed("ieee", chunk_size=64)  # backends without a precision param: unfiltered
    problem = Problem(1, 2, 16, 16)
    xla = Variant("xla", {"chunk_size": 64, "solve_block": 8, "save_states": True})

    def tolerance(precision, variant=xla, problem=problem):
        return tune.tolerance_for(tune.Target("cpu", "jax", variant.backend, problem,
                                              precision), variant)

    assert tolerance("ieee") == 5e-5 and tolerance("tf32") == 1e-2
    assert tolerance("ieee", problem=Problem(1, 2, 16, 16, "bfloat16")) == 2e-2
    # a variant with its own precision is held to that precision's tolerance under any policy
    tpu = registry.default_variant("pallas_tpu", Problem(1, 2, 128, 128))
    assert tolerance("tf32", tpu) == 5e-5
    tpu_tf32 = Variant("pallas_tpu", dict(tpu.as_dict(), precision="tf32"))
    assert tolerance("tf32", tpu_tf32) == 2e-4


def test_planted_failures_are_recorded_and_never_cached(env, tmp_path):
    env = dict(env, GDNGEN_PLUGINS="planted_backend")
    storage = str(tmp_path / "planted.journal")
    proc = gdngen_cli("tune", *tiny(), "--backend", "planted", "--trials", "4",
                      "--trial-timeout", "15", "--storage", storage, "--json", env=env)
    [summary] = json.loads(proc.stdout)
    assert summary["best"]["params"] == {"chunk_size": 16, "mode": "ok"}
    assert summary["trials"] == {"run": 4, "failed": 2, "infeasible": 1,
                                 "skipped": summary["trials"]["skipped"]}
    study = optuna.load_study(study_name=summary["study"], storage=tune.open_storage(storage,
                                                                                     "cpu"))
    by_mode = {Variant.from_json({"backend": "planted", "params": t.params})["mode"]: t
               for t in evaluated(study)}
    wrong = by_mode["wrong"]
    assert wrong.state.name == "COMPLETE" and wrong.value == math.inf
    # y is 1% off, and so is every gradient that flows back through it
    assert wrong.user_attrs["feasible"] is False and wrong.user_attrs["worst_error"] > 9e-3
    assert wrong.user_attrs["worst_error"] > wrong.user_attrs["tolerance"]
    assert by_mode["crash"].state.name == "FAIL" and by_mode["crash"].user_attrs["failure"] == \
        "crash"
    assert by_mode["hang"].state.name == "FAIL" and by_mode["hang"].user_attrs["failure"] == \
        "timeout"
    ok = by_mode["ok"]
    assert ok.user_attrs["feasible"] is True and ok.value == ok.user_attrs["median_s"]
    entries = json.loads(Path(summary["cache"]).read_text())["entries"]
    assert [e["variant"]["params"]["mode"] for e in entries.values()] == ["ok"]
    assert next(iter(entries.values()))["worst_error"] <= 5e-5


def test_dry_run_renders_and_validates_off_device(env):
    env = dict(env, GDNGEN_PLUGINS="planted_backend")
    proc = gdngen_cli("tune", "--device", "apple-m3", "--framework", "mlx", "--backend",
                      "planted", "--heads", "1,2", "--dim", "16,16", "--cases", "short",
                      "--trial-timeout", "15", "--dry-run", "--json", env=env)
    [result] = json.loads(proc.stdout)
    assert result["device"] == "apple-m3"
    status = {r["variant"].split("mode=")[1].rstrip("]"): r for r in result["rows"]}
    assert {m: r["status"] for m, r in status.items()} == \
        {"ok": "pass", "wrong": "fail", "crash": "crash", "hang": "timeout"}
    assert all(len(r["sha256"]) == 64 for r in result["rows"])
    assert status["wrong"]["worst_error"] > 5e-5 and status["ok"]["worst_error"] < 5e-5
    assert not (Path(env["GDNGEN_CACHE_DIR"]) / "studies").exists()  # nothing was timed


def test_sigkilled_study_resumes_without_losing_trials(env, tmp_path):
    storage_path = tmp_path / "kill.journal"
    args = ["tune", *tiny(), "--trials", "7", "--storage", str(storage_path), "--json"]
    proc = subprocess.Popen([sys.executable, "-m", "gdngen.tools.cli", *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    storage = tune.open_storage(storage_path, "cpu")

    def in_flight_after_two():
        try:
            [summary] = optuna.get_all_study_summaries(storage)
        except ValueError:
            return None
        study = optuna.load_study(study_name=summary.study_name, storage=storage)
        running = [t for t in study.get_trials() if t.state.name == "RUNNING"
                   and t.user_attrs.get("variant") and "sha256" in t.user_attrs]
        return (study, running[0]) if len(evaluated(study)) >= 2 and running else None

    try:
        study, running = wait_for(in_flight_after_two, 120, "two trials and one in flight",
                                  every=0.1)
        before = {t.number: (t.user_attrs["variant"], t.value) for t in evaluated(study)}
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    # the trial subprocess dies with its tuner (PR_SET_PDEATHSIG): the trial stays RUNNING
    frozen = next(t for t in study.get_trials() if t.number == running.number)
    assert frozen.state.name == "RUNNING"

    out = gdngen_cli(*args, env=env).stdout
    [summary] = json.loads(out)
    study = optuna.load_study(study_name=summary["study"], storage=storage)
    after = {t.number: (t.user_attrs["variant"], t.value) for t in evaluated(study)}
    for number, record in before.items():  # nothing lost, nothing re-run
        assert after[number] == record
    interrupted = next(t for t in study.get_trials() if t.number == running.number)
    assert interrupted.state.name == "FAIL" and interrupted.user_attrs["interrupted"] is True
    names = [variant for variant, _ in after.values()]
    assert len(names) == len(set(names)) == 7  # each variant evaluated once, budget met
    assert running.user_attrs["variant"] in names  # the interrupted variant was retried
    assert summary["trials"]["run"] == 7 and summary["best"] is not None
    assert "1 interrupted trial(s)" in " ".join(summary["notes"])


def test_two_processes_tune_one_sqlite_study(env, tmp_path):
    url = f"sqlite:///{tmp_path / 'shared.db'}"
    args = ["tune", *tiny(), "--trials", "8", "--storage", url, "--json"]
    procs = [subprocess.Popen([sys.executable, "-m", "gdngen.tools.cli", *args], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    outputs = [p.communicate(timeout=300) for p in procs]
    for p, (_, err) in zip(procs, outputs):
        assert p.returncode == 0, err[-3000:]
    summaries = [json.loads(out)[0] for out, _ in outputs]
    assert summaries[0]["study"] == summaries[1]["study"]
    study = optuna.load_study(study_name=summaries[0]["study"], storage=url)
    done = evaluated(study)
    names = [t.user_attrs["variant"] for t in done]
    assert len(names) == len(set(names))  # no variant evaluated twice
    assert 8 <= len(done) <= 9  # the shared budget, plus at most one in flight at the end
    assert len({t.user_attrs["pid"] for t in done}) == 2  # both processes contributed
    entries = json.loads(Path(summaries[0]["cache"]).read_text())["entries"]
    assert list(entries) == ["cpu|mlx|hk1-hv2-dk16-dv16-float32-scalar|ieee|T64"]


def test_validation_is_memoised_by_render_hash(env, tmp_path, monkeypatch):
    target = tune.Target("cpu", "mlx", "mlx", Problem(1, 2, 16, 16), "ieee", 64, 1)
    settings = tune.Settings(trials=2, cases=("short",), repeats=1, confirm_repeats=0)
    storage = str(tmp_path / "memo.journal")
    first = tune.tune(target, settings, storage=storage)
    memo = json.loads((tmp_path / "root" / "validation.json").read_text())
    assert len(memo) == 2 and all(r["passed"] for r in memo.values())
    sha = cache.variant_sha256(target.default(), target.problem)
    assert all(key.startswith(sha) for key in memo)
    # the second target reuses both validations: its workers are asked to time only
    specs = []
    original = search._run_worker  # patched where the search calls it
    monkeypatch.setattr(search, "_run_worker", lambda spec, *a: specs.append(spec) or
                        original(spec, *a))
    second = tune.tune(tune.Target("cpu", "mlx", "mlx", target.problem, "ieee", 32, 1),
                       settings, storage=storage)
    assert first.best is not None and second.best is not None
    assert specs and not any(s["validate"] for s in specs)


def test_report_writes_plots_and_numbers(env, tmp_path):
    storage = str(tmp_path / "report.journal")
    for seq in (32, 64):
        gdngen_cli("tune", *tiny(seq), "--trials", "3", "--storage", storage, env=env)
    out = tmp_path / "report"
    proc = gdngen_cli("report", "--device", "cpu", "--storage", storage, "--out", str(out),
                      "--json", env=env)
    data = json.loads(proc.stdout)
    assert len(data["histories"]) == 2
    assert all(len(h["trials"]) == 3 and h["default_ms"] > 0 for h in data["histories"])
    # the shipped tuned/cpu.json contributes series of its own; this run's problem has exactly one
    [series] = [s for s in data["speedup"] if "hk1-hv2-dk16-dv16" in s["label"]]
    assert [p["seq_bucket"] for p in series["points"]] == [32, 64]
    assert all(p["speedup"] > 0 for p in series["points"])
    pngs = sorted(p.name for p in out.glob("*.png"))
    assert len(pngs) == 3 and "speedup-vs-seq.png" in pngs
    assert all((out / p).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in pngs)
    assert json.loads((out / "report.json").read_text())["files"] == data["files"]
