"""The trial worker: one variant validated and/or timed in a fresh subprocess.

A trial runs in a subprocess (``python -m gdngen.tune --worker``, through
`gdngen.worker_protocol`) with a timeout, so a variant that crashes the process, hangs or fails
to compile is recorded as a FAIL trial and the study goes on. The subprocess

1. validates the variant on the battery cases ``Settings.cases`` (`gdngen.validate.run_battery`,
   at the Problem's dtype; tolerance: `gdngen.tolerance.allowed_error`, as in ``gdngen build``),
   unless the validation memo (`gdngen.tune.memo`) already knows the answer;
2. times forward+backward at the target shape (`gdngen.tools.timing.time_fwd_bwd`);
3. or times the forward alone of the variant's recurrent and chunk paths over a range of T
   (``spec["crossover"]``, `gdngen.tune.crossover`).

``GDNGEN_PLUGINS`` (comma-separated module names) is imported by the tuner and by every trial
subprocess, so out-of-tree backends can add themselves to the registry
(`gdngen.registry.register`). ``--dry-run`` workers get ``GDNGEN_INTERPRET=1`` so generated
backends can select interpret mode / a simulator off-device. A trial process dies with its
tuner (``GDNGEN_TUNER_PID``, Linux ``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import importlib
import os
import sys
import traceback

from gdngen import dispatch, settings, worker_protocol
from gdngen.problem import Problem
from gdngen.settings import ENV_TUNER_PID
from gdngen.tune.memo import summarize_validation
from gdngen.variant import Variant

RESULT_TAG = "GDNGEN_TRIAL_RESULT "


def load_plugins() -> list[str]:
    """Import the modules named in ``$GDNGEN_PLUGINS`` (comma-separated); returns their names."""
    names = settings.plugins()
    for name in names:
        importlib.import_module(name)
    return names


def _worker(spec: dict) -> dict:
    """Validate and/or time one variant as described by ``spec`` (see `_run_worker`); the
    tuner validates on the battery itself, so its calls skip the first-use gate."""
    with dispatch.ungated():
        return _trial(spec)


def _trial(spec: dict) -> dict:
    load_plugins()
    from gdngen.precision import precision_context
    from gdngen.tools.timing import time_fwd_bwd, variant_fn

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
        if spec.get("crossover"):
            out["crossover"] = _crossover_curve(spec, framework, problem, variant, precision)
    except Exception:  # noqa: BLE001 - any failure of the variant is a result, not a crash
        out.update(status="error", error=traceback.format_exc()[-3000:])
    return out


def _crossover_curve(spec: dict, framework: str, problem: Problem, variant: Variant,
                     precision: str) -> list[dict]:
    """Forward-only times of ``variant``'s two paths at each T of ``spec["crossover"]``
    (`gdngen.tune.crossover`)."""
    from gdngen.tools.timing import time_forward, variant_fn
    from gdngen.tune.crossover import paths

    fns = {name: variant_fn(framework, v) for name, v in paths(variant).items()}
    curve = []
    for T in spec["crossover"]:
        timings = time_forward(framework, fns, problem, batch=spec["batch"], seq_len=T,
                               precision=precision, repeats=spec["repeats"],
                               seed=spec.get("seed", 0))
        curve.append({"T": T, "recurrent_s": timings["recurrent"].median_s,
                      "chunkwise_s": timings["chunkwise"].median_s})
    return curve


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
    if os.environ.get(ENV_TUNER_PID) not in (None, str(os.getppid())):
        os._exit(1)


def _run_worker(spec: dict, timeout: float, env_extra: dict | None = None) -> dict:
    """Run `_worker` in a fresh interpreter; status "ok" / "error" (exception in the variant) /
    "crash" (the process died) / "timeout" (killed after ``timeout`` seconds)."""
    outcome = worker_protocol.call(
        "gdngen.tune", spec, args=("--worker",), tag=RESULT_TAG, label="trial",
        env_extra={**(env_extra or {}), ENV_TUNER_PID: str(os.getpid())}, timeout=timeout)
    if outcome.status != "ok":
        return {"status": outcome.status, "error": outcome.error}
    return outcome.result


def _worker_main() -> int:
    _die_with_parent()
    worker_protocol.reply(RESULT_TAG, _worker(worker_protocol.read_request()))
    return 0
