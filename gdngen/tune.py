"""Tune stage: search a backend's variants with Optuna behind a validation gate; cache the best.

One Optuna study per `Target` (device, framework, backend, Problem, precision, T, B). Each trial
suggests one value per tunable of the backend (categorical over the values its space uses); a
combination outside the space, or one already evaluated or in flight anywhere in the study, is
recorded as a PRUNED trial and not run again (after a run of such misses a not-yet-tried variant
is enqueued, so small spaces are covered). The first trial is the backend's default variant.

A trial runs in a subprocess (``python -m gdngen.tune --worker``) with a timeout, so a variant
that crashes the process, hangs or fails to compile is recorded as a FAIL trial and the study
goes on. The subprocess

1. validates the variant on the battery cases ``Settings.cases`` (`gdngen.validate.run_battery`,
   at the Problem's dtype; tolerance: `gdngen.tolerance.allowed_error`, as in ``gdngen build``),
   unless the validation memo (keyed by render sha256, params, dtype, precision, cases and
   versions) already knows the answer;
2. times forward+backward at the target shape (`gdngen.timing.time_fwd_bwd`).

A variant failing validation is COMPLETE with value inf and user attrs ``feasible=False`` and its
worst error; it never becomes best (only the default variant is still timed, for the speedup).
After the search, the best feasible variant and the default are re-timed together, interleaved
(`Settings.confirm_repeats`); unless the best beats the default by ``Settings.min_gain`` there,
the default is kept. The chosen variant goes to the tuned cache (`gdngen.cache.write_entry`).

Studies live in an Optuna storage: by default a JournalStorage file
``<cache root>/studies/<device>.journal``; ``storage`` may be any Optuna storage URL
(``sqlite:///tune.db``) or a journal file path, so several processes or hosts can tune one study
and an interrupted run resumes: RUNNING trials left by a dead process of this host are marked
FAIL (``interrupted``) and their variants are tried again.

`skip_reason` names targets not worth a study (the command skips them): those whose execution
ignores the variant (a gate kind outside the backend's ``tuned_gates``: the portable backends run
vector gates on a sequential path without tunables) or whose space has a single variant.

``GDNGEN_PLUGINS`` (comma-separated module names) is imported by the tuner and by every trial
subprocess, so out-of-tree backends can add themselves to the registry
(`gdngen.registry.register`). ``--dry-run``
workers get ``GDNGEN_INTERPRET=1`` so generated backends can select interpret mode / a
simulator off-device.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import math
import os
import random
import socket
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

from gdngen import cache
from gdngen.registry import default_variant, variants
from gdngen.tables import render_table
from gdngen.variant import Problem, Variant, dumps

__all__ = [
    "DEFAULT_CASES", "Settings", "Summary", "Target", "dry_run", "load_plugins", "open_storage",
    "select_best", "study_name", "targets", "tune",
]

#: battery cases a trial validates on by default: a ragged tail over several chunks, and keys
#: equal within chunks (near-singular triangular solve) with an initial state.
DEFAULT_CASES = ("ragged", "identical_keys")
ENV_PLUGINS = "GDNGEN_PLUGINS"
ENV_INTERPRET = "GDNGEN_INTERPRET"
RESULT_TAG = "GDNGEN_TRIAL_RESULT "
_MAX_MISSES = 8  # consecutive pruned suggestions before a fresh variant is enqueued
_UNCLAIMED_RUNNING_S = 120.0  # a RUNNING trial without an owner pid this old is abandoned


def load_plugins() -> list[str]:
    """Import the modules named in ``$GDNGEN_PLUGINS`` (comma-separated); returns their names."""
    names = [n.strip() for n in os.environ.get(ENV_PLUGINS, "").split(",") if n.strip()]
    for name in names:
        importlib.import_module(name)
    return names


# ------------------------------------------------------------------------------ targets


def _precision_allowed(variant: Variant, policy: str) -> bool:
    """A variant's own ``precision`` param may be as accurate as ``policy`` or more."""
    from gdngen.precision import rank

    own = variant.get("precision")
    return own is None or rank(own) <= rank(policy)


@dataclass(frozen=True)
class Target:
    """What one study tunes: ``backend`` on ``device`` through ``framework`` for ``problem`` at
    sequence length ``seq_len`` and batch ``batch`` under a precision policy."""

    device: str
    framework: str
    backend: str
    problem: Problem
    precision: str = "ieee"
    seq_len: int = 2048
    batch: int = 1

    def default(self) -> Variant:
        """The backend's default variant on the device (its own precision param, if any,
        raised to the policy when the default is less accurate)."""
        variant = default_variant(self.backend, self.problem, self.device)
        if not _precision_allowed(variant, self.precision):
            variant = Variant(variant.backend, dict(variant.as_dict(), precision=self.precision))
        return variant

    def space(self) -> list[Variant]:
        """The backend's variants that fit the device and whose own precision param (if any)
        is at least as accurate as the target's policy."""
        return [v for v in variants(self.backend, self.problem, self.device)
                if _precision_allowed(v, self.precision)]

    def label(self) -> str:
        return (f"{self.framework}/{self.backend} {self.problem.key()} {self.precision} "
                f"B={self.batch} T={self.seq_len}")


def study_name(target: Target) -> str:
    """Study name: the target, the gdngen version and the default variant's render sha256
    prefix, so that a code change starts a fresh study instead of mixing old timings in."""
    from gdngen._version import __version__

    sha = cache.variant_sha256(target.default(), target.problem)
    return (f"gdngen-{__version__}:{target.device}:{target.backend}:{target.problem.key()}:"
            f"{target.precision}:B{target.batch}:T{target.seq_len}:{sha[:12]}")


def targets(device: str, frameworks, problems, *, precision: str = "ieee", seq_lens=(2048,),
            batch: int = 1, backends=None) -> list[Target]:
    """Every (framework, backend, problem, T) the device can tune: backends of the framework
    targeting the device, implementing the problem and runnable here (`gdngen.registry
    .runnable`), and (if given) in ``backends``."""
    from gdngen.devices import get_device
    from gdngen.precision import check_precision
    from gdngen.registry import runnable

    get_device(device)
    out = []
    for framework in frameworks:
        check_precision(framework, precision)
        for problem in problems:
            for backend in runnable(framework, problem, device):
                if backends and backend not in backends:
                    continue
                out.extend(Target(device, framework, backend, problem, precision, int(t), batch)
                           for t in seq_lens)
    return out


@dataclass(frozen=True)
class Settings:
    """Search budget and checks. ``trials``: variants evaluated per study (all processes
    together); ``timeout``: wall seconds for this process's search of one study (None: no
    limit); ``trial_timeout``: seconds one trial subprocess may take; ``repeats``: timed runs
    per trial (median); ``confirm_repeats``: interleaved re-timing of best vs default (0: skip);
    ``min_gain``: fraction by which the best must beat the default there."""

    trials: int = 8
    timeout: float | None = None
    trial_timeout: float = 900.0
    repeats: int = 3
    confirm_repeats: int = 5
    min_gain: float = 0.02
    cases: tuple = DEFAULT_CASES
    seed: int = 0

    def __post_init__(self):
        if self.trials < 1:
            raise ValueError(f"trials must be >= 1, got {self.trials}")
        if self.repeats < 1 or self.confirm_repeats < 0:
            raise ValueError("repeats must be >= 1 and confirm_repeats >= 0")
        if self.trial_timeout <= 0 or (self.timeout is not None and self.timeout <= 0):
            raise ValueError("trial_timeout and timeout must be positive seconds")
        if not 0 <= self.min_gain < 1:
            raise ValueError(f"min_gain must be in [0, 1), got {self.min_gain}")
        from gdngen.cases import get_case

        for name in self.cases:
            get_case(name)  # ValueError/KeyError for an unknown case


def tolerance_for(target: Target, variant: Variant) -> float:
    """Validation tolerance of ``variant`` in ``target``: `gdngen.tolerance.allowed_error` at
    the problem's dtype under the target's policy (the rule ``gdngen build`` uses too)."""
    from gdngen.tolerance import allowed_error

    return allowed_error(variant, target.problem.dtype, target.precision)


# ------------------------------------------------------------------------------ storage


def default_storage_path(device: str) -> Path:
    return cache.cache_root() / "studies" / f"{device}.journal"


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
    lock = cache.cache_root() / "locks" / f"storage-{digest}.lock"
    lock.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(lock)):
        return optuna.storages.RDBStorage(url, engine_kwargs=kwargs)


# ------------------------------------------------------------------------------ validation memo


def _memo_key(target: Target, variant: Variant, sha: str, cases) -> str:
    versions = cache.current_versions(target.framework)
    return "|".join([sha, dumps(variant), target.problem.dtype, target.precision,
                     ",".join(cases), json.dumps(versions, sort_keys=True)])


def _memo_path() -> Path:
    return cache.cache_root() / "validation.json"


def memo_get(key: str) -> dict | None:
    """The remembered validation record for ``key``, if any (an unreadable memo is ignored)."""
    try:
        return json.loads(_memo_path().read_text()).get(key)
    except (OSError, ValueError, AttributeError):
        return None


def memo_put(key: str, record: dict) -> None:
    """Remember a validation record (locked read-merge-write, atomic replace)."""
    from filelock import FileLock

    path = _memo_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(path) + ".lock"):
        try:
            data = json.loads(path.read_text())
            data = data if isinstance(data, dict) else {}
        except (OSError, ValueError):
            data = {}
        data[key] = record
        cache.atomic_write_text(path, json.dumps(data, sort_keys=True) + "\n")


def summarize_validation(results, tol: float) -> dict:
    """``passed``, worst error (with its case and quantity) and each case's worst error."""
    worst = ("", "", 0.0)
    per_case = {}
    for res in results:
        quantity, err = res.worst
        err = math.inf if math.isnan(err) else float(err)
        per_case[res.case] = err
        if err > worst[2] or not worst[0]:
            worst = (res.case, quantity, err)
    return {"passed": all(e <= tol for e in per_case.values()), "worst_error": worst[2],
            "worst_case": worst[0], "worst_quantity": worst[1], "tolerance": tol,
            "cases": per_case}


# ------------------------------------------------------------------------------ trial worker


def _worker(spec: dict) -> dict:
    """Validate and/or time one variant as described by ``spec`` (see `_run_worker`)."""
    load_plugins()
    from gdngen.precision import precision_context
    from gdngen.timing import time_fwd_bwd, variant_fn

    framework, precision = spec["framework"], spec["precision"]
    problem = Problem.from_json(spec["problem"])
    variant = Variant.from_json(spec["variant"])
    out: dict = {"status": "ok"}
    try:
        if spec.get("validate"):
            from gdngen.validate import run_battery

            with precision_context(framework, precision):
                results = run_battery(None, variant=variant, cases=list(spec["cases"]),
                                      dtype=problem.dtype, precision=precision)
            out["validation"] = summarize_validation(results, spec["tolerance"])
        timed = spec.get("time") or {}
        passed = out.get("validation", {}).get("passed", True)
        if timed and (passed or spec.get("time_even_if_invalid")):
            fns = {name: variant_fn(framework, Variant.from_json(v)) for name, v in timed.items()}
            timings = time_fwd_bwd(framework, fns, problem, batch=spec["batch"],
                                   seq_len=spec["seq_len"], precision=precision,
                                   repeats=spec["repeats"], seed=spec.get("seed", 0))
            out["timings"] = {name: t.to_json() for name, t in timings.items()}
    except Exception:  # noqa: BLE001 - any failure of the variant is a result, not a crash
        out.update(status="error", error=traceback.format_exc()[-3000:])
    return out


def _die_with_parent() -> None:
    """Linux: have the kernel SIGKILL this trial process when the tuner dies, so a killed tuner
    leaves no orphaned trial running; exit at once if the tuner is already gone."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes
        import signal

        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.environ.get("GDNGEN_TUNER_PID") not in (None, str(os.getppid())):
        os._exit(1)


def _run_worker(spec: dict, timeout: float, env_extra: dict | None = None) -> dict:
    """Run `_worker` in a fresh interpreter; status "ok" / "error" (exception in the variant) /
    "crash" (the process died) / "timeout" (killed after ``timeout`` seconds)."""
    env = dict(os.environ)
    src_root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src_root, env.get("PYTHONPATH")) if p)
    env.update(env_extra or {}, GDNGEN_TUNER_PID=str(os.getpid()))
    proc = subprocess.Popen(
        [sys.executable, "-m", "gdngen.tune", "--worker"], stdin=subprocess.PIPE,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        stdout, stderr = proc.communicate(json.dumps(spec), timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        return {"status": "timeout", "error": f"trial exceeded {timeout:g} s and was killed"}
    tagged = [ln for ln in stdout.splitlines() if ln.startswith(RESULT_TAG)]
    if proc.returncode != 0 or not tagged:
        return {"status": "crash",
                "error": f"trial process exited with {proc.returncode}: {stderr[-2000:]}"}
    return json.loads(tagged[-1][len(RESULT_TAG):])


def _worker_main() -> int:
    _die_with_parent()
    spec = json.loads(sys.stdin.read())
    print(RESULT_TAG + json.dumps(_worker(spec)), flush=True)
    return 0


# ------------------------------------------------------------------------------ search


def _param_choices(space: list[Variant]) -> dict:
    """Per tunable, the sorted values the space uses (None where a variant lacks it)."""
    names = sorted({name for v in space for name, _ in v.params})
    choices = {}
    for name in names:
        values = {v.get(name) for v in space}
        choices[name] = sorted(values, key=lambda x: (x is None, type(x).__name__, x
                                                      if x is not None else 0))
    return choices


def _encode(variant: Variant, names) -> dict:
    return {name: variant.get(name) for name in names}


def _decode(backend: str, params: dict) -> Variant:
    return Variant(backend, {k: v for k, v in params.items() if v is not None})


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


def _trial_variant(t) -> str | None:
    return t.user_attrs.get("variant")


def _study_state(study):
    """(evaluated variant names, in-flight variant names) of the study."""
    from optuna.trial import TrialState

    evaluated, running = set(), set()
    for t in study.get_trials(deepcopy=False):
        name = _trial_variant(t)
        if name is None or t.user_attrs.get("duplicate_of") is not None:
            continue
        if t.state == TrialState.RUNNING:
            running.add(name)
        elif t.user_attrs.get("evaluated"):
            evaluated.add(name)
    return evaluated, running


@dataclass
class Record:
    """One evaluated trial, as `select_best` sees it."""

    variant: Variant
    feasible: bool
    median_s: float | None
    worst_error: float | None
    sha256: str


def select_best(records, current_sha: dict) -> Record | None:
    """Fastest timed record that passed validation and was measured on the current source
    (``current_sha``: variant -> render sha256); infeasible ones never qualify."""
    ok = [r for r in records if r.feasible and r.median_s is not None
          and math.isfinite(r.median_s) and current_sha.get(r.variant) == r.sha256]
    return min(ok, key=lambda r: r.median_s, default=None)


@dataclass
class Summary:
    """Outcome of tuning one target (times in seconds)."""

    target: Target
    study: str
    default: Variant
    default_s: float | None = None
    default_feasible: bool | None = None
    best: Variant | None = None
    best_s: float | None = None
    worst_error: float | None = None
    trials_run: int = 0
    trials_failed: int = 0
    trials_infeasible: int = 0
    trials_skipped: int = 0
    entry_path: str | None = None
    notes: list = field(default_factory=list)

    @property
    def speedup(self) -> float | None:
        if self.best_s and self.default_s:
            return self.default_s / self.best_s
        return None

    def to_json(self) -> dict:
        t = self.target
        return {"device": t.device, "framework": t.framework, "backend": t.backend,
                "problem": t.problem.to_json(), "precision": t.precision, "seq_len": t.seq_len,
                "batch": t.batch, "study": self.study, "default": self.default.to_json(),
                "default_ms": None if self.default_s is None else self.default_s * 1e3,
                "default_feasible": self.default_feasible,
                "best": None if self.best is None else self.best.to_json(),
                "best_ms": None if self.best_s is None else self.best_s * 1e3,
                "speedup": self.speedup, "worst_error": self.worst_error,
                "trials": {"run": self.trials_run, "failed": self.trials_failed,
                           "infeasible": self.trials_infeasible,
                           "skipped": self.trials_skipped},
                "cache": self.entry_path, "notes": list(self.notes)}


def _spec(target: Target, settings: Settings, variant: Variant, **extra) -> dict:
    return {"framework": target.framework, "precision": target.precision,
            "problem": target.problem.to_json(), "variant": variant.to_json(),
            "batch": target.batch, "seq_len": target.seq_len, "repeats": settings.repeats,
            "cases": list(settings.cases), "tolerance": tolerance_for(target, variant),
            "seed": settings.seed, **extra}


def _evaluate(study, trial, target: Target, settings: Settings, variant: Variant,
              is_default: bool) -> None:
    """Validate (memoised) and time ``variant`` in a subprocess; tell the study the outcome."""
    from optuna.trial import TrialState

    sha = cache.variant_sha256(variant, target.problem)
    trial.set_user_attr("sha256", sha)
    key = _memo_key(target, variant, sha, settings.cases)
    known = memo_get(key)
    if known is not None and not known["passed"] and not is_default:
        result = {"status": "ok", "validation": known}
    else:
        spec = _spec(target, settings, variant, validate=known is None,
                     time={"variant": variant.to_json()}, time_even_if_invalid=is_default)
        result = _run_worker(spec, settings.trial_timeout)
    validation = result.get("validation") or known
    if result["status"] == "ok" and known is None and validation is not None:
        memo_put(key, validation)
    if validation is not None:
        for name in ("worst_error", "worst_case", "worst_quantity", "tolerance"):
            trial.set_user_attr(name, validation[name])
        trial.set_user_attr("feasible", bool(validation["passed"]))
        # feasible iff <= 0: how far the worst error is above the tolerance
        excess = min(validation["worst_error"], 1e30) - validation["tolerance"]
        trial.set_constraint("validation", 0.0 if validation["passed"] else max(excess, 1e-30))
    timing = (result.get("timings") or {}).get("variant")
    if timing is not None:
        trial.set_user_attr("median_s", timing["median_s"])
        trial.set_user_attr("times_s", timing["times_s"])
        trial.set_user_attr("first_s", timing["first_s"])
    trial.set_user_attr("evaluated", True)
    if result["status"] == "ok" and timing is None and (validation is None
                                                        or validation["passed"]):
        result = {"status": "error", "error": "the trial process returned no timing"}
    if result["status"] != "ok":
        trial.set_user_attr("failure", result["status"])
        trial.set_user_attr("error", result.get("error", "")[-1500:])
        study.tell(trial, state=TrialState.FAIL)
    elif validation is not None and not validation["passed"]:
        study.tell(trial, math.inf)
    else:
        study.tell(trial, timing["median_s"])


def _create_study(target: Target, settings: Settings, storage):
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    # Trials carry their validation verdict as a constraint (Trial.set_constraint), which the
    # TPE sampler reads, so infeasible variants inform the search without ever ranking best.
    sampler = optuna.samplers.TPESampler(seed=settings.seed,
                                         n_startup_trials=max(2, min(5, settings.trials // 2)))
    return optuna.create_study(study_name=study_name(target), storage=storage,
                               sampler=sampler, direction="minimize", load_if_exists=True)


def tune(target: Target, settings: Settings = Settings(), *, storage=None,
         cache_dir: str | os.PathLike | None = None, on_trial=None) -> Summary:
    """Tune one target (see the module docstring); write the chosen variant to the tuned cache
    in ``cache_dir`` (default the user's) and return a `Summary`. ``storage``: an Optuna storage
    object, URL or journal path (default: the device's journal file). ``on_trial(evaluated,
    total, message)`` is called after each trial of this process."""
    from optuna.trial import TrialState

    if not hasattr(storage, "get_all_studies"):
        storage = open_storage(storage, target.device)
    study = _create_study(target, settings, storage)
    recovered = recover_interrupted(study, storage)
    space = target.space()
    space_names = {v.name(): v for v in space}
    default = target.default()
    choices = _param_choices(space)
    summary = Summary(target, study.study_name, default)
    if recovered:
        summary.notes.append(f"{recovered} interrupted trial(s) marked failed and retried")

    evaluated, running = _study_state(study)
    waiting = {_decode(target.backend, t.params).name()
               for t in study.get_trials(deepcopy=False, states=(TrialState.WAITING,))}
    if default.name() not in evaluated | running | waiting:
        study.enqueue_trial(_encode(default, choices))
    rng = random.Random(f"{settings.seed}:{os.getpid()}")
    started, misses = time.monotonic(), 0
    budget = min(settings.trials, len(space))
    while True:
        recover_interrupted(study, storage)  # a concurrent tuner may have died meanwhile
        evaluated, running = _study_state(study)
        if len(evaluated) + len(running) >= budget:
            break
        if settings.timeout is not None and time.monotonic() - started > settings.timeout:
            summary.notes.append(f"stopped after the {settings.timeout:g} s timeout")
            break
        trial = study.ask()
        trial.set_user_attr("host", socket.gethostname())
        trial.set_user_attr("pid", os.getpid())
        params = {name: trial.suggest_categorical(name, values)
                  for name, values in choices.items()}
        variant = _decode(target.backend, params)
        name = variant.name()
        trial.set_user_attr("variant", name)
        if name not in space_names:
            trial.set_user_attr("skipped", "outside the backend's space")
            study.tell(trial, state=TrialState.PRUNED)
            misses += 1
        else:
            # Claims are made by writing the "variant" attr, then checking for any other live
            # claim: of two concurrent claims at least the later checker sees the other and
            # yields, so no variant is ever evaluated twice (rarely both yield; it stays open).
            claims = [t for t in study.get_trials(deepcopy=False)
                      if t.number != trial.number and _trial_variant(t) == name
                      and (t.state == TrialState.RUNNING or t.user_attrs.get("evaluated"))
                      and t.user_attrs.get("duplicate_of") is None]
            if claims:
                trial.set_user_attr("duplicate_of", claims[0].number)
                study.tell(trial, state=TrialState.PRUNED)
                misses += 1
            else:
                misses = 0
                _evaluate(study, trial, target, settings, variant, name == default.name())
                if on_trial is not None:
                    done = len(_study_state(study)[0])
                    on_trial(min(done, budget), budget, f"{name}")
        if misses >= _MAX_MISSES:
            evaluated, running = _study_state(study)
            fresh = [v for v in space if v.name() not in evaluated | running]
            if fresh:
                study.enqueue_trial(_encode(rng.choice(fresh), choices))
            misses = 0
    _finish(study, summary, target, settings, cache_dir)
    return summary


def _records(study, target: Target):
    """(records of evaluated trials, counts) from the study."""
    from optuna.trial import TrialState

    records, failed, infeasible, skipped, run = [], 0, 0, 0, 0
    space = {v.name(): v for v in target.space()}
    for t in study.get_trials(deepcopy=False):
        if t.state == TrialState.PRUNED:
            skipped += 1
            continue
        if not t.user_attrs.get("evaluated"):
            continue
        run += 1
        if t.state == TrialState.FAIL:
            failed += 1
        feasible = bool(t.user_attrs.get("feasible", False))
        if t.state == TrialState.COMPLETE and not feasible:
            infeasible += 1
        name = _trial_variant(t)
        if name in space and t.state == TrialState.COMPLETE:
            records.append(Record(space[name], feasible, t.user_attrs.get("median_s"),
                                  t.user_attrs.get("worst_error"), t.user_attrs.get("sha256")))
    return records, (run, failed, infeasible, skipped)


def _finish(study, summary: Summary, target: Target, settings: Settings, cache_dir) -> None:
    """Pick the best feasible variant, confirm it against the default, write the cache."""
    records, counts = _records(study, target)
    (summary.trials_run, summary.trials_failed, summary.trials_infeasible,
     summary.trials_skipped) = counts
    current = {r.variant: cache.variant_sha256(r.variant, target.problem) for r in records}
    default = summary.default
    default_rec = next((r for r in records if r.variant == default
                        and current[r.variant] == r.sha256), None)
    if default_rec is not None:
        summary.default_s, summary.default_feasible = default_rec.median_s, default_rec.feasible
    best = select_best(records, current)
    if best is None:
        summary.notes.append("no variant passed validation and timing; nothing cached")
        return
    best_s, default_s = best.median_s, summary.default_s
    if best.variant != default and settings.confirm_repeats and default_s is not None:
        confirm = dataclasses.replace(settings, repeats=settings.confirm_repeats)
        spec = _spec(target, confirm, default, validate=False,
                     time={"default": default.to_json(), "best": best.variant.to_json()})
        result = _run_worker(spec, settings.trial_timeout * 2)
        if result["status"] == "ok":
            confirmed = result["timings"]
            best_s = confirmed["best"]["median_s"]
            default_s = confirmed["default"]["median_s"]
            summary.notes.append(f"confirmed over {settings.confirm_repeats} interleaved runs")
        else:
            summary.notes.append(f"confirmation run {result['status']}; using trial times")
    chosen, chosen_s = best.variant, best_s
    if (chosen != default and summary.default_feasible and default_s is not None
            and best_s > default_s * (1 - settings.min_gain)):
        summary.notes.append(f"best {chosen} within {settings.min_gain:.0%} of the default; "
                             "keeping the default")
        chosen, chosen_s = default, default_s
    summary.best, summary.best_s, summary.default_s = chosen, chosen_s, default_s
    chosen_rec = next(r for r in records if r.variant == chosen)
    summary.worst_error = chosen_rec.worst_error
    if default_s is None:
        summary.notes.append("the default variant was not timed; nothing cached")
        return
    entry = cache.make_entry(
        device=target.device, framework=target.framework, problem=target.problem,
        precision=target.precision, seq_len=target.seq_len, batch=target.batch,
        variant=chosen, default=default, best_s=chosen_s, default_s=default_s,
        worst_error=chosen_rec.worst_error, tolerance=tolerance_for(target, chosen),
        trials={"run": counts[0], "failed": counts[1], "infeasible": counts[2],
                "skipped": counts[3]},
        study=study.study_name)
    summary.entry_path = str(cache.write_entry(entry, cache_dir))


# ------------------------------------------------------------------------------ dry run


def dry_run(target: Target, settings: Settings = Settings(), on_variant=None) -> list[dict]:
    """Render and validate every candidate of ``target`` without timing, each in a subprocess
    with ``GDNGEN_INTERPRET=1`` (the device need not be attached). One row per variant:
    variant, sha256, status ("pass" / "fail" / "render error" / "error" / "crash" /
    "timeout"), worst error, worst case and quantity."""
    rows, space = [], target.space()
    for variant in space:
        if on_variant is not None:
            on_variant(len(rows), len(space), variant.name())
        row = {"variant": variant.name(), "sha256": None, "status": None, "worst_error": None,
               "worst_case": None, "worst_quantity": None}
        try:
            row["sha256"] = cache.variant_sha256(variant, target.problem)
        except Exception as e:  # noqa: BLE001 - a render failure is this variant's result
            row.update(status="render error", error=str(e))
            rows.append(row)
            continue
        key = _memo_key(target, variant, row["sha256"], settings.cases)
        validation = memo_get(key)
        if validation is None:
            result = _run_worker(_spec(target, settings, variant, validate=True, time=None),
                                 settings.trial_timeout, {ENV_INTERPRET: "1"})
            validation = result.get("validation")
            if result["status"] != "ok":
                row.update(status=result["status"], error=result.get("error", "")[-500:])
            elif validation is not None:
                memo_put(key, validation)
        if validation is not None and row["status"] is None:
            row.update(status="pass" if validation["passed"] else "fail",
                       worst_error=validation["worst_error"],
                       worst_case=validation["worst_case"],
                       worst_quantity=validation["worst_quantity"])
        rows.append(row)
    return rows


# ------------------------------------------------------------------------------ command glue

def skip_reason(target: Target) -> str | None:
    """Why tuning ``target`` would be pointless (nothing to choose between), or None: a gate
    kind outside the backend's ``tuned_gates`` runs a path without tunables (the portable
    backends' sequential vector-gate recurrence), or the space has a single variant."""
    from gdngen.registry import get

    if target.problem.gate not in get(target.backend).tuned_gates:
        return (f"{target.backend} runs {target.problem.gate} gates on its sequential path, "
                "which has no tunables")
    if len(target.space()) < 2:
        return f"{target.backend} has a single variant for {target.problem.key()}"
    return None


def default_frameworks(device: str) -> tuple[str, ...]:
    """Frameworks tuned when none is named: MLX on Apple GPUs, JAX on TPUs/NVIDIA GPUs, every
    installed one on the CPU."""
    from gdngen.devices import get_device, installed_frameworks

    kind = get_device(device).kind
    wanted = {"apple": ("mlx",), "tpu": ("jax",), "gpu": ("jax",)}.get(kind, ("jax", "mlx"))
    return tuple(fw for fw in wanted if fw in installed_frameworks())


def format_summaries(summaries) -> str:
    """The end-of-run table: default vs best, speedup, validation error, trial counts."""
    def ms(x):
        return "-" if x is None else f"{x * 1e3:.1f}"

    rows = [(s.target.label(), str(s.default), ms(s.default_s),
             "-" if s.best is None else str(s.best), ms(s.best_s),
             "-" if s.speedup is None else f"{s.speedup:.2f}x",
             "-" if s.worst_error is None else f"{s.worst_error:.1e}",
             f"{s.trials_run}/{s.trials_failed}/{s.trials_infeasible}", "; ".join(s.notes))
            for s in summaries]
    return render_table("gdngen tune", ("target", "default", "default ms", "best", "best ms",
                                        "speedup", "worst err", "run/failed/infeasible", "notes"),
                        rows)


def format_dry_run(target: Target, rows) -> str:
    """The ``--dry-run`` table: every candidate's sources hash, validation status and worst
    error."""
    cells = []
    for r in rows:
        err = "-" if r["worst_error"] is None else f"{r['worst_error']:.1e}"
        where = f"{r['worst_case']}/{r['worst_quantity']}" if r["worst_case"] else \
            r.get("error", "")[-120:]
        cells.append((r["variant"], (r["sha256"] or "-")[:12], r["status"], err, where))
    return render_table(f"dry run: {target.label()} on {target.device} (no timing)",
                        ("variant", "sha256", "status", "worst err", "where"), cells)


if __name__ == "__main__":
    if sys.argv[1:] == ["--worker"]:
        sys.exit(_worker_main())
    sys.exit("usage: python -m gdngen.tune --worker  (internal; use `gdngen tune`)")
