"""Tune stage: search a backend's variants with Optuna behind a validation gate; cache the best.

One Optuna study per `Target` (device, framework, backend, Problem, precision, T, B) searches the
backend's variants; every trial validates its variant on the battery and times forward+backward
in a subprocess of its own, so a crashing, hanging or wrong variant is a recorded result, never
the best and never cached. The best feasible variant, confirmed against the default, goes to the
tuned cache. The parts:

* `gdngen.tune.target`: `Target`, `targets`, `study_name`, `tolerance_for`, `skip_reason`
  (targets not worth a study), `default_frameworks`;
* `gdngen.tune.search`: `Settings`, `tune` (the study loop, claims of variants shared by
  concurrent tuners, the confirmation run), `Record`, `select_best`, `Summary`;
* `gdngen.tune.worker`: the trial subprocess (``python -m gdngen.tune --worker``, speaking
  `gdngen.worker_protocol`), `load_plugins` (``GDNGEN_PLUGINS``);
* `gdngen.tune.crossover`: the recurrent/chunkwise crossover stage (`crossover_from`,
  `describe`);
* `gdngen.tune.memo`: the validation memo (`memo_get`, `memo_put`, `summarize_validation`);
* `gdngen.tune.storage`: Optuna storages (`open_storage`, `check_storage_url`), trial heartbeats
  (`Heartbeat`) and `recover_interrupted` (trials of a tuner killed on any host re-queued);
* `gdngen.tune.pool`: `run_workers`, N local tuner processes on one storage (``--workers``);
* `gdngen.tune.dryrun`: `dry_run`, validation of every candidate off-device;
* `gdngen.tune.tables`: `format_summaries`, `format_dry_run`.

The names are re-exported here. A test replacing a function must patch it in the module that
calls it (e.g. ``gdngen.tune.search._run_worker``), not here.
"""

from __future__ import annotations

from gdngen.settings import ENV_INTERPRET, ENV_PLUGINS
from gdngen.tune.dryrun import dry_run
from gdngen.tune.memo import _memo_key as _memo_key
from gdngen.tune.memo import memo_get, memo_put, summarize_validation
from gdngen.tune.pool import run_workers
from gdngen.tune.search import DEFAULT_CASES, Record, Settings, Summary, select_best, tune
from gdngen.tune.storage import (
    Heartbeat,
    check_storage_url,
    default_storage_path,
    is_url,
    open_storage,
    recover_interrupted,
)
from gdngen.tune.tables import format_dry_run, format_summaries
from gdngen.tune.target import (
    Target,
    default_frameworks,
    skip_reason,
    study_name,
    targets,
    tolerance_for,
)
from gdngen.tune.target import _precision_allowed as _precision_allowed
from gdngen.tune.worker import RESULT_TAG, load_plugins
from gdngen.tune.worker import _run_worker as _run_worker
from gdngen.tune.worker import _worker as _worker
from gdngen.tune.worker import _worker_main as _worker_main

__all__ = [
    "DEFAULT_CASES", "ENV_INTERPRET", "ENV_PLUGINS", "RESULT_TAG", "Heartbeat", "Record",
    "Settings", "Summary", "Target", "check_storage_url", "default_frameworks",
    "default_storage_path", "dry_run", "format_dry_run", "format_summaries", "is_url",
    "load_plugins", "memo_get", "memo_put", "open_storage", "recover_interrupted",
    "run_workers", "select_best", "skip_reason", "study_name", "summarize_validation",
    "targets", "tolerance_for", "tune",
]
