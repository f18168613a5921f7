"""Where studies live, and recovery of trials a dead tuner left RUNNING.

Studies live in an Optuna storage: by default a JournalStorage file
``<cache root>/studies/<device>.journal``; ``storage`` may be any Optuna storage URL
(``sqlite:///tune.db``) or a journal file path, so several processes or hosts can tune one study
and an interrupted run resumes: RUNNING trials left by a dead process of this host are marked
FAIL (``interrupted``) and their variants are tried again.
"""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

from gdngen import settings

_UNCLAIMED_RUNNING_S = 120.0  # a RUNNING trial without an owner pid this old is abandoned


def default_storage_path(device: str) -> Path:
    return settings.cache_root() / "studies" / f"{device}.journal"


def open_storage(storage: str | os.PathLike | None, device: str):
    """An Optuna storage: a JournalStorage file (``storage`` None: the default path, or a path
    without ``://``), else an Optuna storage URL (sqlite waits up to 60 s for its lock)."""
    import optuna
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend

    if storage is None or "://" not in str(storage):
        path = Path(storage) if storage is not None else default_storage_path(device)
        path.parent.mkdir(parents=True, exist_ok=True)
        return JournalStorage(JournalFileBackend(str(path)))
    import hashlib

    from filelock import FileLock

    url = str(storage)
    kwargs = {"connect_args": {"timeout": 60}} if url.startswith("sqlite") else None
    # Two processes creating the schema of a fresh database at once race ("table already
    # exists"); a host-wide lock per URL serialises that first connection.
    digest = hashlib.sha256(url.encode()).hexdigest()[:20]
    lock = settings.cache_root() / "locks" / f"storage-{digest}.lock"
    lock.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(lock)):
        return optuna.storages.RDBStorage(url, engine_kwargs=kwargs)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def recover_interrupted(study, storage) -> int:
    """Mark RUNNING trials whose owner (same host) is dead, or that never got an owner, FAIL
    with ``interrupted=True`` and enqueue their params again (retried next); returns how
    many."""
    from optuna.exceptions import UpdateFinishedTrialError
    from optuna.trial import TrialState

    host, now, count = socket.gethostname(), time.time(), 0
    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        pid, owner = t.user_attrs.get("pid"), t.user_attrs.get("host")
        if pid is not None:
            if owner != host or _alive(int(pid)):
                continue
        elif t.datetime_start is None or now - t.datetime_start.timestamp() \
                < _UNCLAIMED_RUNNING_S:
            continue
        try:
            storage.set_trial_user_attr(t._trial_id, "interrupted", True)
            storage.set_trial_state_values(t._trial_id, TrialState.FAIL)
        except UpdateFinishedTrialError:
            continue  # another process recovered it first
        if t.params:
            study.enqueue_trial(t.params)
        count += 1
    return count
