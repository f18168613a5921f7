"""``gdngen tune --workers N``: N local tuner processes on one storage, one progress feed.

Each worker is a fresh interpreter (multiprocessing "spawn") running `gdngen.tune.search.tune`
on every target in order, on the same storage, so the workers share each study exactly as
tuners on several hosts do (claims, heartbeats, re-queues); every trial still runs in its own
subprocess with its timeout. Worker 0 finishes each study (confirmation run, cache write); the
others only search (``finish=False``), so one host confirms and writes each entry once.
"""

from __future__ import annotations

import queue as queue_mod
import traceback


def _child(index: int, targets, settings, storage, cache_dir, events) -> None:
    from gdngen.tune.search import tune
    from gdngen.tune.worker import load_plugins

    try:
        load_plugins()
        for i, target in enumerate(targets):
            def update(done, total, name, i=i):
                events.put(("progress", index, i, done, total, name))

            summary = tune(target, settings, storage=storage, cache_dir=cache_dir,
                           on_trial=update, finish=index == 0)
            events.put(("summary", index, i, summary))
    except BaseException:  # noqa: BLE001 - reported to the parent, which fails the run
        events.put(("error", index, traceback.format_exc()[-3000:]))
        return
    events.put(("done", index))


def run_workers(targets, settings, workers: int, *, storage=None, cache_dir=None,
                on_progress=None) -> list:
    """Tune ``targets`` with ``workers`` local processes sharing ``storage`` (a URL or journal
    path, not an object); returns worker 0's `Summary` per target (it cached the best), with a
    note of the worker count. ``on_progress(target_index, evaluated, total, name)`` follows the
    study-wide count of evaluated trials, from any worker. RuntimeError when a worker fails (the
    others are stopped)."""
    import multiprocessing

    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    if hasattr(storage, "get_all_studies"):
        raise ValueError("run_workers needs a storage URL or journal path, not an object")
    ctx = multiprocessing.get_context("spawn")
    events = ctx.Queue()
    procs = [ctx.Process(target=_child, args=(i, list(targets), settings, storage, cache_dir,
                                              events), name=f"gdngen-tune-{i}")
             for i in range(workers)]
    for p in procs:
        p.start()
    summaries, done, best = {}, set(), {}
    try:
        while len(done) < workers:
            try:
                event = events.get(timeout=1.0)
            except queue_mod.Empty:
                dead = [i for i, p in enumerate(procs) if i not in done and p.exitcode is not None]
                if dead and events.empty():
                    raise RuntimeError(f"tune worker {dead[0]} died (exit code "
                                       f"{procs[dead[0]].exitcode})") from None
                continue
            kind, index = event[0], event[1]
            if kind == "progress":
                _, _, i, evaluated, total, name = event
                best[i] = max(best.get(i, 0), evaluated)
                if on_progress is not None:
                    on_progress(i, best[i], total, name)
            elif kind == "summary" and index == 0:
                summaries[event[2]] = event[3]
            elif kind == "error":
                raise RuntimeError(f"tune worker {index} failed:\n{event[2]}")
            elif kind == "done":
                done.add(index)
    finally:
        for p in procs:
            if p.exitcode is None and len(done) < workers:
                p.terminate()
            p.join()
    out = [summaries[i] for i in range(len(targets))]
    for s in out:
        s.notes.append(f"{workers} local workers")
    return out
