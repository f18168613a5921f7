"""The search: one Optuna study per `Target`, behind a validation gate; the best goes to the cache.

One Optuna study per `Target` (device, framework, backend, Problem, precision, T, B). Each trial
suggests one value per tunable of the backend (categorical over the values its space uses); a
combination outside the space, or one already evaluated or in flight anywhere in the study, is
recorded as a PRUNED trial and not run again (after a run of such misses a not-yet-tried variant
is enqueued, so small spaces are covered). The first trial is the backend's default variant.
Each evaluated trial runs in its own subprocess (`gdngen.tune.worker`) while the tuner beats its
heartbeat (`gdngen.tune.storage.beating`); trials abandoned by a tuner killed on any host are
failed and their variants re-queued (`gdngen.tune.storage.recover_interrupted`). A tuner leaves a
study once the budget is evaluated: while the rest of it is in flight in other tuners it waits
for those trials to finish (or to go stale and be re-queued), so every tuner of a study ends on
the whole study and caches its best.

A variant failing validation is COMPLETE with value inf and user attrs ``feasible=False`` and its
worst error; it never becomes best (only the default variant is still timed, for the speedup).
After the search, the best feasible variant and the default are re-timed together, interleaved
(`Settings.confirm_repeats`); unless the best beats the default by ``Settings.min_gain`` there,
the default is kept. Then the chosen variant's recurrent/chunkwise crossover T is measured
(`gdngen.tune.crossover`) and becomes its ``recurrent_below``. The chosen variant goes to the
tuned cache (`gdngen.cache.write_entry`).
"""

from __future__ import annotations

import dataclasses
import math
import os
import random
import time
import warnings
from collections import Counter
from dataclasses import dataclass, field

from gdngen import cache
from gdngen import settings as env_settings
from gdngen.tune import crossover
from gdngen.tune.memo import _memo_key, memo_get, memo_put
from gdngen.tune.storage import Heartbeat, beating, open_storage, recover_interrupted
from gdngen.tune.target import Target, study_name, tolerance_for
from gdngen.tune.worker import _run_worker
from gdngen.variant import Variant

#: battery cases a trial validates on by default: a ragged tail over several chunks, and keys
#: equal within chunks (near-singular triangular solve) with an initial state.
DEFAULT_CASES = ("ragged", "identical_keys")
_MAX_MISSES = 8  # consecutive pruned suggestions before a fresh variant is enqueued


@dataclass(frozen=True)
class Settings:
    """Search budget and checks. ``trials``: variants evaluated per study (all processes
    together); ``timeout``: wall seconds for this process's search of one study (None: no
    limit); ``trial_timeout``: seconds one trial subprocess may take; ``repeats``: timed runs
    per trial (median); ``confirm_repeats``: interleaved re-timing of best vs default (0: skip);
    ``min_gain``: fraction by which the best must beat the default there; ``heartbeat``: how
    often a trial in flight says it is alive and how long a silent one is trusted;
    ``crossover``: measure the chosen variant's recurrent/chunkwise crossover T
    (`gdngen.tune.crossover`) and cache it as its ``recurrent_below``."""

    trials: int = 8
    timeout: float | None = None
    trial_timeout: float = 900.0
    repeats: int = 3
    confirm_repeats: int = 5
    min_gain: float = 0.02
    cases: tuple = DEFAULT_CASES
    seed: int = 0
    crossover: bool = True
    heartbeat: Heartbeat = field(default_factory=Heartbeat)

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


def _trial_variant(t) -> str | None:
    return t.user_attrs.get("variant")


def _was_evaluated(t) -> bool:
    """Whether the finished trial ``t`` holds its variant's result: COMPLETE, or FAIL with the
    ``failure`` it recorded (a trial failed for a lapsed heartbeat after its variant ran, whose
    tuner then could not tell the result, holds none: its re-queued copy runs it again)."""
    from optuna.trial import TrialState

    return bool(t.user_attrs.get("evaluated")) and (
        t.state == TrialState.COMPLETE
        or (t.state == TrialState.FAIL and "failure" in t.user_attrs))


def _pending_retries(study) -> list:
    """WAITING trials that re-queue a failed (killed, stale) trial's variant."""
    from optuna.trial import TrialState

    return [t for t in study.get_trials(deepcopy=False, states=(TrialState.WAITING,))
            if "retry_of" in t.user_attrs]


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
        elif _was_evaluated(t):
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
    workers: dict = field(default_factory=dict)  # "host:pid" -> trials that tuner evaluated
    entry_path: str | None = None
    notes: list = field(default_factory=list)
    crossover: int | None = None  # the tuned recurrent_below, when measured

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
                "workers": dict(self.workers),
                "cache": self.entry_path, "notes": list(self.notes),
                "crossover": self.crossover}


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
    # Its seed differs per tuner process: tuners sharing a study would otherwise suggest the
    # same variants in lockstep (after the startup trials, measured times steer it anyway).
    seed = random.Random(f"{settings.seed}:{env_settings.host_id()}:{os.getpid()}")
    sampler = optuna.samplers.TPESampler(seed=seed.randrange(2**31),
                                         n_startup_trials=max(2, min(5, settings.trials // 2)))
    return optuna.create_study(study_name=study_name(target), storage=storage,
                               sampler=sampler, direction="minimize", load_if_exists=True)


def tune(target: Target, settings: Settings = Settings(), *, storage=None,
         cache_dir: str | os.PathLike | None = None, on_trial=None,
         finish: bool = True) -> Summary:
    """Tune one target (see the module docstring); write the chosen variant to the tuned cache
    in ``cache_dir`` (default the user's) and return a `Summary`. ``storage``: an Optuna storage
    object, URL or journal path (default: the device's journal file). ``on_trial(evaluated,
    total, message)`` is called after each trial of this process. ``finish`` False: only search
    (no confirmation run, no cache write; the summary has the study's counts, no best), for
    extra local workers of a study another worker of this host finishes."""
    from optuna.exceptions import UpdateFinishedTrialError
    from optuna.trial import TrialState

    if not hasattr(storage, "get_all_studies"):
        storage = open_storage(storage, target.device, settings.heartbeat)
    study = _create_study(target, settings, storage)
    recovered = recover_interrupted(study, storage, settings.heartbeat)
    space = target.space()
    space_names = {v.name(): v for v in space}
    default = target.default()
    choices = _param_choices(space)
    summary = Summary(target, study.study_name, default)

    evaluated, running = _study_state(study)
    waiting = {_decode(target.backend, t.params).name()
               for t in study.get_trials(deepcopy=False, states=(TrialState.WAITING,))}
    if default.name() not in evaluated | running | waiting:
        study.enqueue_trial(_encode(default, choices))
    rng = random.Random(f"{settings.seed}:{os.getpid()}")
    started, misses = time.monotonic(), 0
    budget = min(settings.trials, len(space))
    while True:
        # a concurrent tuner may have died meanwhile
        recovered += recover_interrupted(study, storage, settings.heartbeat)
        evaluated, running = _study_state(study)
        # a killed trial's re-queued variant runs even when the budget is reached meanwhile
        retries = _pending_retries(study)
        if len(evaluated) >= budget and not retries:
            break
        if settings.timeout is not None and time.monotonic() - started > settings.timeout:
            summary.notes.append(f"stopped after the {settings.timeout:g} s timeout")
            break
        if len(evaluated) + len(running) >= budget and not retries:
            time.sleep(min(1.0, settings.heartbeat.interval / 2))  # the rest is in flight
            continue
        with warnings.catch_warnings():  # Optuna expects heartbeats from Study.optimize only
            warnings.filterwarnings("ignore", message="Heartbeat of storage")
            trial = study.ask()
        try:
            with beating(storage, trial, settings.heartbeat):
                outcome = _trial(study, trial, target, settings, choices, space_names, default)
        except UpdateFinishedTrialError:
            # silent past the grace (a stalled host): another tuner failed and re-queued it
            summary.notes.append(f"trial {trial.number} was declared stale meanwhile; its "
                                 "result was dropped")
            continue
        if outcome is None:
            misses += 1
        else:
            misses = 0
            if on_trial is not None:
                done = len(_study_state(study)[0])
                on_trial(min(done, budget), budget, outcome)
        if misses >= _MAX_MISSES:
            evaluated, running = _study_state(study)
            fresh = [v for v in space if v.name() not in evaluated | running]
            if fresh:
                study.enqueue_trial(_encode(rng.choice(fresh), choices))
            misses = 0
    if recovered:
        summary.notes.append(f"{recovered} interrupted trial(s) marked failed and retried")
    _finish(study, summary, target, settings, cache_dir, finish)
    return summary


def _trial(study, trial, target: Target, settings: Settings, choices, space_names,
           default: Variant) -> str | None:
    """Suggest a variant in ``trial``, claim it and evaluate it; the variant's name, or None
    when the suggestion was pruned (outside the space, or claimed elsewhere)."""
    from optuna.trial import TrialState

    trial.set_user_attr("host", env_settings.host_id())
    trial.set_user_attr("pid", os.getpid())
    params = {name: trial.suggest_categorical(name, values) for name, values in choices.items()}
    variant = _decode(target.backend, params)
    name = variant.name()
    trial.set_user_attr("variant", name)
    if name not in space_names:
        trial.set_user_attr("skipped", "outside the backend's space")
        study.tell(trial, state=TrialState.PRUNED)
        return None
    # Claims are made by writing the "variant" attr, then checking for any other live claim:
    # of two concurrent claims at least the later checker sees the other and yields, so no
    # variant is ever evaluated twice (rarely both yield; it stays open).
    claims = [t for t in study.get_trials(deepcopy=False)
              if t.number != trial.number and _trial_variant(t) == name
              and (t.state == TrialState.RUNNING or _was_evaluated(t))
              and t.user_attrs.get("duplicate_of") is None]
    if "retry_of" not in trial.user_attrs:  # a killed trial's re-queued variant is taken
        claims += [t for t in _pending_retries(study)
                   if _decode(target.backend, t.params).name() == name]
    if claims:
        trial.set_user_attr("duplicate_of", claims[0].number)
        study.tell(trial, state=TrialState.PRUNED)
        return None
    _evaluate(study, trial, target, settings, variant, name == default.name())
    return name


def _records(study, target: Target):
    """(records of evaluated trials, counts, evaluated trials per "host:pid") from the study."""
    from optuna.trial import TrialState

    records, failed, infeasible, skipped, run = [], 0, 0, 0, 0
    workers = Counter()
    space = {v.name(): v for v in target.space()}
    for t in study.get_trials(deepcopy=False):
        if t.state == TrialState.PRUNED:
            skipped += 1
            continue
        if not _was_evaluated(t):
            continue
        run += 1
        workers[f"{t.user_attrs.get('host')}:{t.user_attrs.get('pid')}"] += 1
        if t.state == TrialState.FAIL:
            failed += 1
        feasible = bool(t.user_attrs.get("feasible", False))
        if t.state == TrialState.COMPLETE and not feasible:
            infeasible += 1
        name = _trial_variant(t)
        if name in space and t.state == TrialState.COMPLETE:
            records.append(Record(space[name], feasible, t.user_attrs.get("median_s"),
                                  t.user_attrs.get("worst_error"), t.user_attrs.get("sha256")))
    return records, (run, failed, infeasible, skipped), dict(sorted(workers.items()))


def _finish(study, summary: Summary, target: Target, settings: Settings, cache_dir,
            finish: bool = True) -> None:
    """Count the study's trials; unless ``finish`` is False, pick the best feasible variant,
    confirm it against the default and write the cache."""
    records, counts, summary.workers = _records(study, target)
    (summary.trials_run, summary.trials_failed, summary.trials_infeasible,
     summary.trials_skipped) = counts
    if not finish:
        summary.notes.append("searched only; another worker of this host caches the best")
        return
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
    chosen_rec = next(r for r in records if r.variant == chosen)
    summary.worst_error = chosen_rec.worst_error
    if default_s is None:
        summary.best, summary.best_s, summary.default_s = chosen, chosen_s, default_s
        summary.notes.append("the default variant was not timed; nothing cached")
        return
    chosen, measured = _tune_crossover(chosen, summary, target, settings)
    summary.best, summary.best_s, summary.default_s = chosen, chosen_s, default_s
    entry = cache.make_entry(
        device=target.device, framework=target.framework, problem=target.problem,
        precision=target.precision, seq_len=target.seq_len, batch=target.batch,
        variant=chosen, default=default, best_s=chosen_s, default_s=default_s,
        worst_error=chosen_rec.worst_error, tolerance=tolerance_for(target, chosen),
        trials={"run": counts[0], "failed": counts[1], "infeasible": counts[2],
                "skipped": counts[3]},
        study=study.study_name, crossover=measured)
    summary.entry_path = str(cache.write_entry(entry, cache_dir))


def _tune_crossover(chosen: Variant, summary: Summary, target: Target, settings: Settings):
    """``(chosen with its tuned recurrent_below, the measured crossover or None)``: the
    crossover stage of `gdngen.tune.crossover`, in one trial subprocess (skipped when
    ``settings.crossover`` is off or the backend has no recurrent kernel)."""
    if not settings.crossover or not crossover.has_switch(chosen):
        return chosen, None
    spec = _spec(target, settings, chosen, validate=False, crossover=list(crossover.SEQ_LENS))
    result = _run_worker(spec, settings.trial_timeout)
    if result["status"] != "ok":
        summary.notes.append(f"crossover run {result['status']}; keeping recurrent_below="
                             f"{chosen['recurrent_below']}")
        return chosen, None
    curve = result["crossover"]
    recurrent_below = crossover.crossover_from(curve)
    summary.notes.append(f"crossover: recurrent kernel below T={recurrent_below}")
    summary.crossover = recurrent_below
    return (chosen.replace(recurrent_below=recurrent_below),
            {"curve": curve, "seq_lens": list(crossover.SEQ_LENS), "batch": target.batch})
