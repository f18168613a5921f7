"""One study, 1 vs N tuner processes on a PostgreSQL server, one of the N SIGKILLed mid-trial.

Runs ``gdngen tune`` on a fresh database (and fresh cache roots, so no validation memo is
shared between the runs) first with one worker, then with ``--workers`` processes posing as
hosts ``host-0..`` (``GDNGEN_HOST``, each its own cache root); in that run the worker whose trial
starts a trial after two evaluated trials is SIGKILLed mid-trial. Prints, per run: the wall time,
evaluated trials per worker, duplicates (evaluated trials minus distinct variants), lost trials
(left RUNNING, or re-queued and never evaluated), the killed trial's fate, and the
tuned entries (each host's, then merged with ``gdngen merge`` and listed by ``gdngen show``).
Without ``--storage`` it starts a throwaway server (Debian's postgresql package).

    python benchmarks/bench_shared_study.py --framework jax --backend xla --heads 1,2 \\
        --dim 32,32 --seq 256 --trials 12 --workers 3 --json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _study(storage):
    import optuna

    [summary] = optuna.get_all_study_summaries(storage)
    return optuna.load_study(study_name=summary.study_name, storage=storage)


def _cli(*args, env) -> str:
    proc = subprocess.run([sys.executable, "-m", "gdngen.tools.cli", *args], env=env,
                          capture_output=True, text=True, check=True)
    return proc.stdout


def _tune_args(ns, url) -> list[str]:
    return ["tune", "--device", "cpu", "--framework", ns.framework, "--backend", ns.backend,
            "--heads", ns.heads, "--dim", ns.dim, "--seq", ns.seq, "--trials", str(ns.trials),
            "--repeats", str(ns.repeats), "--cases", ns.cases, "--storage", url,
            "--heartbeat", str(ns.heartbeat), "--heartbeat-grace", str(ns.grace), "--json"]


def _run(ns, url, folder: Path, workers: int, kill: bool) -> dict:
    """One run of ``workers`` tuners on ``url``; what happened (see the module docstring)."""
    from gdngen import tune

    storage = tune.open_storage(url, "cpu")
    hosts = [f"host-{i}" for i in range(workers)]
    started = time.monotonic()
    procs = {h: subprocess.Popen(
        [sys.executable, "-m", "gdngen.tools.cli", *_tune_args(ns, url)],
        env=dict(os.environ, GDNGEN_HOST=h, GDNGEN_CACHE_DIR=str(folder / h)),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for h in hosts}
    victim, seen = None, set()
    if kill:  # a trial seen running for the first time, after two evaluated: mid-trial
        while victim is None:
            time.sleep(0.05)
            try:
                study = _study(storage)
            except ValueError:
                continue
            trials = study.get_trials()
            running = [t for t in trials if t.state.name == "RUNNING" and "sha256" in
                       t.user_attrs]
            fresh = [t for t in running if t.number not in seen]
            seen.update(t.number for t in running)
            if fresh and sum(1 for t in trials if t.user_attrs.get("evaluated")) >= 2:
                victim = fresh[0]
        os.kill(procs[victim.user_attrs["host"]].pid, signal.SIGKILL)
    outputs = {h: p.communicate() for h, p in procs.items()}
    wall = time.monotonic() - started
    study = _study(storage)
    trials = study.get_trials()
    done = [t for t in trials if t.user_attrs.get("evaluated")]
    names = [t.user_attrs["variant"] for t in done]
    requeued = [t for t in trials if "retry_of" in t.user_attrs]
    per_worker: dict = {}
    for t in done:
        key = t.user_attrs["host"]
        per_worker[key] = per_worker.get(key, 0) + 1
    out = {"workers": workers, "wall_s": round(wall, 1), "evaluated": len(done),
           "trials_per_worker": per_worker, "duplicates": len(names) - len(set(names)),
           "lost": len([t for t in trials if t.state.name == "RUNNING"])
           + len([t for t in requeued if not t.user_attrs.get("evaluated")]),
           "states": {s: sum(t.state.name == s for t in trials)
                      for s in ("COMPLETE", "PRUNED", "FAIL", "RUNNING", "WAITING")},
           "exit_codes": {h: p.returncode for h, p in procs.items()}}
    if victim is not None:
        killed = trials[victim.number]
        [retry] = [t for t in requeued if t.user_attrs["retry_of"] == victim.number]
        out["killed"] = {
            "trial": victim.number, "host": victim.user_attrs["host"],
            "variant": victim.user_attrs["variant"], "state": killed.state.name,
            "retry": {"trial": retry.number, "reason": retry.user_attrs["retry_reason"],
                      "host": retry.user_attrs.get("host"), "state": retry.state.name,
                      "median_ms": None if retry.value is None else retry.value * 1e3},
            "evaluated_times": names.count(victim.user_attrs["variant"])}
    files = [folder / h / "tuned" / "cpu.json" for h in hosts
             if (folder / h / "tuned" / "cpu.json").exists()]
    out["host_entries"] = {f.parent.parent.name: [
        {"key": k, "variant": e["variant"]["params"], "best_ms": round(e["best_ms"], 3),
         "default_ms": round(e["default_ms"], 3), "trials_run": e["trials"]["run"]}
        for k, e in json.loads(f.read_text())["entries"].items()] for f in files}
    merged = dict(os.environ, GDNGEN_CACHE_DIR=str(folder / "merged"))
    _cli("merge", *map(str, files), env=merged)
    out["merged_show"] = [r for r in json.loads(_cli("show", "--device", "cpu", "--json",
                                                     env=merged))
                          if r["file"].startswith(str(folder / "merged"))]
    best = min((t for t in done if t.user_attrs.get("feasible")), key=lambda t: t.value)
    out["study_best"] = {"variant": best.user_attrs["variant"], "median_ms": best.value * 1e3}
    for h, (_, err) in outputs.items():
        if procs[h].returncode not in (0, -signal.SIGKILL):
            out.setdefault("errors", {})[h] = err[-2000:]
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--storage", help="a PostgreSQL server URL without the database name "
                   "(postgresql://user@host:port); default: start a throwaway server")
    p.add_argument("--framework", default="jax")
    p.add_argument("--backend", default="xla")
    p.add_argument("--heads", default="1,2")
    p.add_argument("--dim", default="32,32")
    p.add_argument("--seq", default="256")
    p.add_argument("--trials", type=int, default=12)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--cases", default="short", help="battery cases each trial validates on")
    p.add_argument("--workers", type=int, default=3)
    p.add_argument("--heartbeat", type=int, default=2)
    p.add_argument("--grace", type=int, default=10)
    p.add_argument("--json", action="store_true")
    ns = p.parse_args(argv)
    with contextlib.ExitStack() as stack:
        if ns.storage:
            import psycopg

            def database(count=[0]):  # noqa: B006 - a counter across calls
                count[0] += 1
                name = f"gdngen_bench_{os.getpid()}_{count[0]}"
                with psycopg.connect(f"{ns.storage}/postgres", autocommit=True) as conn:
                    conn.execute(f"CREATE DATABASE {name}")
                return f"{ns.storage}/{name}"
        else:
            sys.path.insert(0, str(ROOT / "tests"))
            from postgres_server import server_bin, temporary_server

            database = stack.enter_context(temporary_server(server_bin()))
        folder = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="gdngen-bench-")))
        runs = [_run(ns, database(), folder / "one", 1, kill=False),
                _run(ns, database(), folder / "many", ns.workers, kill=True)]
    if ns.json:
        print(json.dumps(runs, indent=2))
        return
    for r in runs:
        print(f"{r['workers']} worker(s): {r['wall_s']} s, {r['evaluated']} evaluated, per "
              f"worker {r['trials_per_worker']}, duplicates {r['duplicates']}, lost "
              f"{r['lost']}")
        if "killed" in r:
            print(f"  killed: {r['killed']}")
        print(f"  entries: {r['host_entries']}")
        print(f"  merged: {[(x['key'], x['variant'], x['status']) for x in r['merged_show']]}")


if __name__ == "__main__":
    main()
