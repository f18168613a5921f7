"""Many tuners, one study: a real PostgreSQL server and a shared journal file, three workers
"on three hosts" (``GDNGEN_HOST``), one SIGKILLed mid-trial. Nothing is evaluated twice,
nothing is lost or left RUNNING after the heartbeat grace, the killed variant is evaluated
exactly once, and the cache holds the study's best. Plus ``--workers`` and the storage errors.

The server is Debian's ``postgresql`` package (``make test`` installs it): ``initdb`` in a
temporary folder, listening on a loopback port, run as the ``postgres`` user when the tests run
as root (PostgreSQL refuses root). Trials tune a planted MLX backend whose variants sleep a
known time per call (the ranking is the sleeps'), at a tiny shape.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import optuna
import pytest
from click.testing import CliRunner
from polling import wait_for
from postgres_server import free_port, server_bin, temporary_server

from gdngen import tune
from gdngen.tools import cli

ROOT = Path(__file__).resolve().parent.parent
BUDGET = 9
HEARTBEAT = ("--heartbeat", "1", "--heartbeat-grace", "5")

# Variants differ only in how long each call sleeps (the default is the slowest); a trial
# process also sleeps once, on its first call, so a trial lasts long enough to be killed in.
PLUGIN = textwrap.dedent('''
    import dataclasses, os, time
    from gdngen import registry
    from gdngen.backends.portable import TOLERANCES
    from gdngen.config import VariantConfig
    from gdngen.variant import Variant

    NAME = "sleepy"
    DELAYS = tuple(range(3, 39, 3))  # ms per call
    _FIRST = []

    @dataclasses.dataclass(frozen=True)
    class Config(VariantConfig):
        backend = NAME
        chunk_size: int = 16
        delay_ms: int = 36

        def check(self):
            self.check_choice("delay_ms", DELAYS)

    def space(problem, device=None):
        return [Config(16, d) for d in DELAYS]

    def default(problem, device=None):
        return Config(16, DELAYS[-1])

    def gated_delta(q, k, v, g, beta, initial_state, *, mask, scale, gate, variant):
        from gdngen.mlx import gated_delta as mlx_gated_delta
        if not _FIRST:
            _FIRST.append(1)
            time.sleep(float(os.environ.get("SLEEPY_FIRST_S", "0")))
        time.sleep(variant["delay_ms"] / 1e3)
        portable = Variant("mlx", {"chunk_size": variant["chunk_size"], "solve_block": 8,
                                   "save_states": True})
        return mlx_gated_delta(q, k, v, g, beta, initial_state, mask=mask, scale=scale,
                               gate=gate, variant=portable)

    SPEC = registry.BackendSpec(
        name=NAME, framework="mlx", config=Config, space=space, default=default,
        entry=gated_delta, tolerances=TOLERANCES, device_kinds=("cpu", "apple"),
        source_modules=(__name__,))
    registry.register(NAME, __name__)
''')

TINY = ["--framework", "mlx", "--device", "cpu", "--heads", "1,2", "--dim", "16,16", "--seq",
        "32", "--cases", "short", "--repeats", "1", "--backend", "sleepy", "--json"]


# ------------------------------------------------------------------------------ the server

@pytest.fixture(scope="module")
def postgres():
    """A PostgreSQL server on a loopback port for this module (`postgres_server`): yields a
    function that makes a fresh database and returns its URL; stopped afterwards."""
    bindir = server_bin()
    if bindir is None:
        pytest.skip("no PostgreSQL server binaries (initdb) on PATH or in /usr/lib/postgresql; "
                    "install Debian's postgresql package (make test does)")
    pytest.importorskip("psycopg", reason="the postgres extra: pip install 'gdngen[postgres]'")
    with temporary_server(bindir) as database:
        yield database


# ------------------------------------------------------------------------------ the workers

@pytest.fixture
def env(tmp_path):
    """A tuner's environment: its own cache root, the sleepy plugin, short trials' first sleep."""
    (tmp_path / "sleepy_backend.py").write_text(PLUGIN)
    values = dict(os.environ, GDNGEN_CACHE_DIR=str(tmp_path / "root"),
                  GDNGEN_PLUGINS="sleepy_backend", SLEEPY_FIRST_S="1.0",
                  PYTHONPATH=os.pathsep.join([str(ROOT), str(tmp_path)]))
    values.pop("GDNGEN_HOST", None)
    return values


def _cli(*args, env) -> str:
    proc = subprocess.run([sys.executable, "-m", "gdngen.tools.cli", *args], env=env,
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def _start(args, env, **extra):
    return subprocess.Popen([sys.executable, "-m", "gdngen.tools.cli", "tune", *args],
                            env=dict(env, **extra), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _study(storage):
    try:
        [summary] = optuna.get_all_study_summaries(storage)
    except ValueError:
        return None
    return optuna.load_study(study_name=summary.study_name, storage=storage)


def _evaluated(study):
    return [t for t in study.get_trials() if t.user_attrs.get("evaluated")]


def _delay(variant_name: str) -> int:
    return int(variant_name.split("delay_ms=")[1].split(",")[0].rstrip("]"))


def run_killed_study(storage_arg: str, storage, env, tmp_path) -> dict:
    """Three workers ("hosts" a, b, c) on one study; the first to start a trial
    after two evaluated trials is SIGKILLed. Returns what happened, for the assertions."""
    args = [*TINY, "--trials", str(BUDGET), "--storage", storage_arg, *HEARTBEAT]
    started = time.monotonic()
    # each "host" has a cache root of its own (validation memo, locks, tuned files)
    procs = {host: _start(args, env, GDNGEN_HOST=host,
                          GDNGEN_CACHE_DIR=str(tmp_path / host))
             for host in ("host-a", "host-b", "host-c")}

    seen = set()

    def in_flight_after_two():
        """A trial whose process has just started (seen running for the first time), after
        two trials are evaluated: it has over a second to go, the kill lands mid-trial."""
        study = _study(storage)
        if study is None:
            return None
        running = [t for t in study.get_trials(states=(optuna.trial.TrialState.RUNNING,))
                   if "sha256" in t.user_attrs]  # its trial process is under way
        fresh = [t for t in running if t.number not in seen]
        seen.update(t.number for t in running)
        return fresh[0] if fresh and len(_evaluated(study)) >= 2 else None

    try:
        victim = wait_for(in_flight_after_two, 120, "two trials and one in flight")
        host = victim.user_attrs["host"]
        assert victim.user_attrs["pid"] == procs[host].pid
        os.kill(procs[host].pid, signal.SIGKILL)
        procs[host].wait()
        outputs = {h: p.communicate(timeout=240) for h, p in procs.items() if h != host}
    finally:
        for p in procs.values():
            p.kill()
            p.wait()
    wall = time.monotonic() - started
    for h, (_, err) in outputs.items():
        assert procs[h].returncode == 0, err[-3000:]
    return {"victim": victim, "summaries": {h: json.loads(out)[0] for h, (out, _) in
                                            outputs.items()},
            "study": _study(storage), "wall": wall}


def _runner(trials, retry):
    """The trial that evaluated ``retry``'s variant: ``retry`` itself, or the trial it yielded
    to (``duplicate_of``, same variant, evaluated); None if neither."""
    if retry.state.name == "COMPLETE":
        return retry
    other = retry.user_attrs.get("duplicate_of")
    if retry.state.name != "PRUNED" or other is None:
        return None
    other = trials[other]
    same = other.user_attrs.get("variant") == retry.user_attrs.get("variant")
    return other if same and other.user_attrs.get("evaluated") else None


def check_killed_study(result, env, tmp_path, fate: dict) -> None:
    """The guarantees both storages give; ``fate``: user attrs the killed trial ends with."""
    study, victim = result["study"], result["victim"]
    trials = study.get_trials()
    done = _evaluated(study)
    names = [t.user_attrs["variant"] for t in done]
    assert len(names) == len(set(names))  # no variant evaluated twice
    # the budget, plus at most one more per other worker that asked at the same moment
    assert BUDGET <= len(done) <= BUDGET + 2
    assert all(t.state.name == "COMPLETE" for t in done), \
        [(t.number, t.state.name, t.user_attrs) for t in trials]
    table = [(t.number, t.state.name, t.user_attrs) for t in trials]
    assert not [t for t in trials if t.state.name == "RUNNING"], table  # nothing in flight
    # nothing lost: every re-queued trial ran, or yielded to a fresh trial that claimed its
    # variant between the failure and the re-queue and evaluated it (others may stay
    # WAITING: spare suggestions)
    retries = {t.number: _runner(trials, t) for t in trials if "retry_of" in t.user_attrs}
    assert all(r is not None and r.state.name == "COMPLETE" for r in retries.values()), table
    killed = trials[victim.number]
    assert killed.state.name == "FAIL" and not killed.user_attrs.get("evaluated")
    assert {k: killed.user_attrs.get(k) for k in fate} == fate
    [retry] = [t for t in trials if t.user_attrs.get("retry_of") == victim.number]
    assert retry.user_attrs["retry_reason"] == "heartbeat"  # another "host": no pid check
    runner = retries[retry.number]
    assert runner.user_attrs["variant"] == victim.user_attrs["variant"]
    assert runner.user_attrs["evaluated"] and runner.user_attrs["host"] != \
        victim.user_attrs["host"]
    assert names.count(victim.user_attrs["variant"]) == 1  # the killed variant: exactly once
    for summary in result["summaries"].values():  # every survivor ended on the whole study
        assert summary["study"] == study.study_name and summary["trials"]["run"] == len(done)
        assert sum(summary["workers"].values()) == len(done)
    # every survivor's cache holds the study's best: the fastest feasible trial (the default
    # sleeps 33 ms more per call than the fastest variant)
    best = min((t for t in done if t.user_attrs["feasible"]), key=lambda t: t.value)
    files = [tmp_path / h / "tuned" / "cpu.json" for h in result["summaries"]]
    for path in files:
        [entry] = json.loads(path.read_text())["entries"].values()
        assert entry["variant"]["params"] == best.params
        assert entry["study"] == study.study_name and entry["trials"]["run"] == len(done)
        assert entry["best_ms"] < entry["default_ms"]
    # the hosts' files merged into one cache, as `gdngen show` lists it
    merged = dict(env, GDNGEN_CACHE_DIR=str(tmp_path / "merged"))
    out = _cli("merge", *map(str, files), "--json", env=merged)
    assert json.loads(out)["taken"] == [entry["key"]]
    [row] = [r for r in json.loads(_cli("show", "--device", "cpu", "--json", env=merged))
             if r["key"] == entry["key"]]
    assert row["status"] == "active" and row["file"] == str(tmp_path / "merged" / "tuned" /
                                                            "cpu.json")
    assert row["variant"] == best.user_attrs["variant"]


def test_three_workers_one_postgres_study_survive_a_sigkill(postgres, env, tmp_path):
    url = postgres()
    storage = tune.open_storage(url, "cpu")
    result = run_killed_study(url, storage, env, tmp_path)
    # Optuna failed the silent trial (it sets no attrs; the re-queued trial says why)
    check_killed_study(result, env, tmp_path, {"interrupted": None})


@pytest.mark.slow  # shared studies: the PostgreSQL one keeps them
def test_three_workers_one_journal_study_survive_a_sigkill(env, tmp_path):
    path = tmp_path / "shared" / "study.journal"  # an NFS-style shared file
    result = run_killed_study(str(path), tune.open_storage(path, "cpu"), env, tmp_path)
    check_killed_study(result, env, tmp_path, {"interrupted": True})


def test_workers_option_shares_one_study(env, tmp_path):
    path = tmp_path / "workers.journal"
    proc = _start([*TINY, "--trials", "6", "--storage", str(path), "--workers", "2",
                   "--cache-dir", str(tmp_path / "tuned")], dict(env, SLEEPY_FIRST_S="0"))
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == 0, err[-3000:]
    assert "2 workers: mlx/sleepy" in err  # one bar per target, fed by both workers
    [summary] = json.loads(out)
    study = _study(tune.open_storage(path, "cpu"))
    done = _evaluated(study)
    names = [t.user_attrs["variant"] for t in done]
    assert len(names) == len(set(names)) and 6 <= len(done) <= 7
    assert len(summary["workers"]) == 2 and sum(summary["workers"].values()) == len(done)
    assert len({t.user_attrs["pid"] for t in done}) == 2
    assert "2 local workers" in summary["notes"]
    best = min((t for t in done if t.user_attrs["feasible"]), key=lambda t: t.value)
    [entry] = json.loads((tmp_path / "tuned" / "cpu.json").read_text())["entries"].values()
    assert entry["variant"]["params"] == best.params == summary["best"]["params"]


def _tune_in_process(*args):
    return CliRunner().invoke(cli.main, ["tune", "--framework", "mlx", "--device", "cpu",
                                         "--heads", "1,2", "--dim", "16,16", *args])


def test_storage_url_without_its_driver_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "psycopg", None)  # import psycopg -> ImportError
    monkeypatch.setitem(sys.modules, "psycopg2", None)
    result = _tune_in_process("--storage", "postgresql://me:secret@127.0.0.1:9/db")
    assert result.exit_code == 2
    assert "pip install 'gdngen[postgres]'" in result.output and "--storage" in result.output
    assert "secret" not in result.output
    result = _tune_in_process("--storage", "nosuchdb://x/y")
    assert result.exit_code == 2 and "not a database URL" in result.output


def test_unreachable_storage_is_a_clear_error(env):
    port = free_port()  # nothing listens there
    proc = subprocess.run([sys.executable, "-m", "gdngen.tools.cli", "tune", *TINY, "--storage",
                           f"postgresql://me:secret@127.0.0.1:{port}/db"], env=env,
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 1 and "cannot open the Optuna storage" in proc.stderr
    assert "Traceback" not in proc.stderr and "secret" not in proc.stderr


@pytest.mark.parametrize("args, hint", [
    (["--workers", "0"], "--workers"),
    (["--heartbeat", "0"], "--heartbeat"),
    (["--heartbeat", "10", "--heartbeat-grace", "10"], "--heartbeat-grace"),
    (["--workers", "2", "--dry-run"], "--workers"),
])
def test_bad_worker_and_heartbeat_options_are_named(args, hint):
    result = _tune_in_process(*args)
    assert result.exit_code == 2, result.output
    assert re.search(f"Invalid value for '?{hint}'?:", result.output), result.output


def test_merge_takes_the_entry_that_saw_more_of_its_study(tmp_path, monkeypatch):
    from gdngen import cache, registry
    from gdngen.problem import Problem

    monkeypatch.setenv("GDNGEN_CACHE_DIR", str(tmp_path / "root"))
    problem = Problem(1, 2, 16, 16)
    variant = registry.default_variant("mlx", problem)

    def entry(run, best_s):
        return cache.make_entry(device="cpu", framework="mlx", problem=problem,
                                precision="ieee", seq_len=64, batch=1, variant=variant,
                                default=variant, best_s=best_s, default_s=0.01,
                                worst_error=1e-7, tolerance=5e-5,
                                trials={"run": run, "failed": 0, "infeasible": 0,
                                        "skipped": 0}, study="s")

    here = cache.write_entry(entry(8, 0.004))
    fuller = cache.write_entry(entry(9, 0.005), tmp_path / "host-b")
    partial = cache.write_entry(entry(5, 0.003), tmp_path / "host-c")
    result = CliRunner().invoke(cli.main, ["merge", str(partial), str(fuller), "--json"])
    assert result.exit_code == 0, result.output
    key = entry(1, 1.0)["key"]
    assert json.loads(result.output) == {"taken": [key], "kept": []}  # the 9-trial one
    assert cache.load_file(here)[key]["trials"]["run"] == 9
    result = CliRunner().invoke(cli.main, ["merge", str(partial), "--json"])
    assert json.loads(result.output) == {"taken": [], "kept": [key]}
    assert cache.load_file(here)[key]["best_ms"] == 5.0
    stale = dict(entry(12, 0.002), sha256="0" * 64)  # tuned from sources changed since
    cache.write_entry(stale)
    assert cache.stale_reason(cache.load_file(here)[key]).startswith("source changed")
    result = CliRunner().invoke(cli.main, ["merge", str(partial), "--json"])
    assert json.loads(result.output) == {"taken": [key], "kept": []}  # fewer trials, usable
    assert cache.load_file(here)[key]["trials"]["run"] == 5
    (tmp_path / "bad.json").write_text("{}")
    result = CliRunner().invoke(cli.main, ["merge", str(tmp_path / "bad.json")])
    assert result.exit_code == 2 and "expected {'format'" in result.output
