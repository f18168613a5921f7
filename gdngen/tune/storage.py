"""Where studies live, how a trial says it is alive, and recovery of trials a dead tuner left.

Studies live in an Optuna storage: by default a JournalStorage file
``<cache root>/studies/<device>.journal``; ``storage`` may be any Optuna storage URL
(``sqlite:///tune.db``, ``postgresql://user@host:5432/db``) or a journal file path, so several
processes on one or many hosts can tune one study and an interrupted run resumes.

A trial in flight beats a heartbeat every `Heartbeat.interval` seconds (`beating`): on an RDB
storage Optuna's own (``RDBStorage(heartbeat_interval=, grace_period=)``, stamped with the
database server's clock); on a journal, which has none, a ``heartbeat`` user attr holding the
tuner host's wall time (so hosts sharing a journal need clocks in sync to well within the grace).
`recover_interrupted` fails, and re-enqueues the variant of, every RUNNING trial that

* has not beaten for `Heartbeat.grace` seconds (a tuner killed on any host),
* belongs to a dead process of this host (`settings.host_id`; no need to wait for the grace), or
* never got an owner pid and started over ``_UNCLAIMED_RUNNING_S`` ago.

Failing a trial is the arbiter: of several tuners recovering one trial only the one whose FAIL
lands (the RDB row lock, the journal's log order) re-enqueues it, so the variant is re-queued
exactly once. The re-queued trial carries ``retry_of`` (the failed trial's number) and
``retry_reason`` ("heartbeat", "dead pid", "unclaimed") user attrs; the failed one, where gdngen
failed it, ``interrupted=True``.
"""

from __future__ import annotations

import os
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

from gdngen import settings

_UNCLAIMED_RUNNING_S = 120.0  # a RUNNING trial without an owner pid this old is abandoned
#: database drivers an extra of gdngen installs (``pip install 'gdngen[X]'``).
DRIVER_EXTRAS = {"psycopg": "postgres"}


@dataclass(frozen=True)
class Heartbeat:
    """Liveness of trials in flight: each beats every ``interval`` seconds; one silent for
    ``grace`` seconds is failed and its variant re-queued (whole seconds, as Optuna's RDB
    heartbeat takes; ``grace`` > ``interval``)."""

    interval: int = 10
    grace: int = 60

    def __post_init__(self):
        if int(self.interval) != self.interval or self.interval < 1:
            raise ValueError(f"heartbeat interval must be a whole number of seconds >= 1, got "
                             f"{self.interval}")
        if int(self.grace) != self.grace or self.grace <= self.interval:
            raise ValueError(f"heartbeat grace must be whole seconds > the interval "
                             f"({self.interval}), got {self.grace}")


def default_storage_path(device: str) -> Path:
    return settings.cache_root() / "studies" / f"{device}.journal"


def is_url(storage) -> bool:
    return storage is not None and "://" in str(storage)


def database_url(url: str) -> str:
    """``url`` with the driver gdngen's ``postgres`` extra installs made explicit: a plain
    ``postgresql://`` (or ``postgres://``) URL becomes ``postgresql+psycopg://`` whatever
    SQLAlchemy's default driver; any other URL is returned as it is."""
    scheme, sep, rest = str(url).partition("://")
    return f"postgresql+psycopg://{rest}" if sep and scheme in ("postgresql", "postgres") \
        else str(url)


def check_storage_url(url: str) -> None:
    """ValueError unless ``url`` is a database URL whose driver is importable; a missing driver
    names the extra that installs it (``pip install 'gdngen[postgres]'``)."""
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError, NoSuchModuleError

    try:
        parsed = make_url(database_url(url))
        dialect = parsed.get_dialect()
    except (ArgumentError, NoSuchModuleError, ValueError) as e:
        raise ValueError(f"--storage {url!r} is not a database URL Optuna can open "
                         f"(e.g. sqlite:///tune.db, postgresql://user@host:5432/db): {e}") \
            from None
    try:
        (getattr(dialect, "import_dbapi", None) or dialect.dbapi)()
    except ImportError as e:
        backend = parsed.get_backend_name()
        extra = DRIVER_EXTRAS.get(dialect.driver)
        hint = (f"pip install 'gdngen[{extra}]'" if extra else
                f"install the Python package of the {dialect.driver} driver")
        raise ValueError(f"--storage {parsed.render_as_string(hide_password=True)}: the "
                         f"{backend} driver ({dialect.driver}) is not installed: {hint} "
                         f"(import failed: {e})") from None


def open_storage(storage: str | os.PathLike | None, device: str,
                 heartbeat: Heartbeat = Heartbeat()):
    """An Optuna storage: a JournalStorage file (``storage`` None: the default path, or a path
    without ``://``), else an RDBStorage of the URL with Optuna's heartbeat (``heartbeat``) and
    a stale-trial callback that re-queues the variant (sqlite waits up to 60 s for its lock).
    ValueError for a URL that is not one or whose driver is missing (see `check_storage_url`),
    RuntimeError for a database that cannot be reached."""
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend

    if not is_url(storage):
        path = Path(storage) if storage is not None else default_storage_path(device)
        path.parent.mkdir(parents=True, exist_ok=True)
        return JournalStorage(JournalFileBackend(str(path)))
    url = database_url(str(storage))
    check_storage_url(url)
    return _open_rdb(url, heartbeat)


def _open_rdb(url: str, heartbeat: Heartbeat):
    import hashlib

    import optuna
    import sqlalchemy.exc
    from filelock import FileLock
    from sqlalchemy.engine import make_url

    kwargs = ({"connect_args": {"timeout": 60}} if url.startswith("sqlite") else
              {"pool_pre_ping": True})  # a server may drop a connection idle over a long trial
    # Two processes creating the schema of a fresh database at once race ("table already
    # exists"): a host-wide lock per URL serialises that first connection here, and a retry
    # covers a race with another host.
    digest = hashlib.sha256(url.encode()).hexdigest()[:20]
    lock = settings.cache_root() / "locks" / f"storage-{digest}.lock"
    lock.parent.mkdir(parents=True, exist_ok=True)
    for attempt in range(3):
        try:
            with FileLock(str(lock)), warnings.catch_warnings():
                warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                return optuna.storages.RDBStorage(
                    url, engine_kwargs=kwargs, heartbeat_interval=int(heartbeat.interval),
                    grace_period=int(heartbeat.grace),
                    heartbeat_stale_trial_callback=_requeue_stale)
        except sqlalchemy.exc.OperationalError as e:
            where = make_url(url).render_as_string(hide_password=True)
            raise RuntimeError(f"cannot open the Optuna storage {where}: "
                               f"{str(e.orig).strip()}") from None
        except (sqlalchemy.exc.IntegrityError, sqlalchemy.exc.ProgrammingError):
            if attempt == 2:
                raise
            time.sleep(0.5 + attempt)
    raise AssertionError("unreachable: the third attempt returns or raises")


def _optuna_heartbeat(storage) -> bool:
    from optuna.storages._heartbeat import is_heartbeat_enabled

    return is_heartbeat_enabled(storage)


def _beat(storage, trial_id: int) -> None:
    if _optuna_heartbeat(storage):
        storage.record_heartbeat(trial_id)
    else:
        storage.set_trial_user_attr(trial_id, "heartbeat", time.time())


class beating:
    """``with beating(storage, trial, heartbeat):`` the trial beats now and then every
    ``heartbeat.interval`` seconds from a thread until the block ends (a beat after the trial
    finished, or a storage hiccup, ends or skips that beat, never the block)."""

    def __init__(self, storage, trial, heartbeat: Heartbeat):
        self._storage, self._id, self._interval = storage, trial._trial_id, heartbeat.interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="gdngen-heartbeat")

    def __enter__(self):
        _beat(self._storage, self._id)  # before the trial is claimed: it is never unbeaten
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    def _run(self):
        from optuna.exceptions import UpdateFinishedTrialError

        while not self._stop.wait(self._interval):
            try:
                _beat(self._storage, self._id)
            except UpdateFinishedTrialError:
                return
            except Exception:  # noqa: BLE001, S112 - a missed beat; the next one may land
                continue


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _requeue(study, trial, reason: str) -> None:
    if trial.params:
        study.enqueue_trial(trial.params, user_attrs={"retry_of": trial.number,
                                                      "retry_reason": reason})


class _Counter:
    stale = 0


def _requeue_stale(study, trial) -> None:
    """RDBStorage's ``heartbeat_stale_trial_callback``: Optuna failed ``trial`` (no heartbeat
    for the grace period) in this process; enqueue its variant again."""
    _requeue(study, trial, "heartbeat")
    _Counter.stale += 1


def _why_dead(t, host: str, now: float, grace: float) -> str | None:
    """Why the RUNNING trial ``t`` is abandoned, or None while its owner may be alive."""
    pid, owner, beat = t.user_attrs.get("pid"), t.user_attrs.get("host"), \
        t.user_attrs.get("heartbeat")
    if pid is not None and owner == host and not _alive(int(pid)):
        return "dead pid"
    if beat is not None:
        return "heartbeat" if now - float(beat) > grace else None
    if pid is None and t.datetime_start is not None \
            and now - t.datetime_start.timestamp() > _UNCLAIMED_RUNNING_S:
        return "unclaimed"
    return None


def recover_interrupted(study, storage, heartbeat: Heartbeat = Heartbeat()) -> int:
    """Fail the study's abandoned RUNNING trials (see the module docstring) and enqueue their
    params again (retried next); returns how many this call recovered. ``heartbeat.grace``
    applies to journal heartbeats; an RDB storage's own grace to its heartbeats."""
    import optuna
    from optuna.exceptions import UpdateFinishedTrialError
    from optuna.trial import TrialState

    count = 0
    if _optuna_heartbeat(storage):
        before = _Counter.stale
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            optuna.storages.fail_stale_trials(study)
        count += _Counter.stale - before
    host, now = settings.host_id(), time.time()
    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        reason = _why_dead(t, host, now, heartbeat.grace)
        if reason is None:
            continue
        try:
            storage.set_trial_user_attr(t._trial_id, "interrupted", True)
            if not storage.set_trial_state_values(t._trial_id, TrialState.FAIL):
                continue
        except UpdateFinishedTrialError:
            continue  # another process recovered it first
        _requeue(study, t, reason)
        count += 1
    return count
