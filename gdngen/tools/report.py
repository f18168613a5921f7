"""Tuning report: PNG plots (matplotlib, Agg) and their numbers.

* ``history-<study>.png`` per current study of the device: fwd+bwd time of every trial in
  order (feasible trials as dots, the running best as a step line, the default variant's time
  dashed; infeasible and failed trials marked along the top);
* ``speedup-vs-seq.png``: tuned-vs-default speedup per sequence-length bucket, one line per
  (framework, backend, problem, precision), from the tuned cache's usable entries.

`report` writes both plus ``report.json`` (the plotted numbers) atomically into one folder.
A study is "current" when its name is what `gdngen.tune.study_name` gives today (same gdngen
version and render hash); older studies are counted, not plotted.
"""

from __future__ import annotations

import io
import json
import math
import os
import re
from pathlib import Path

from gdngen import cache
from gdngen.problem import Problem


def _parse_study(name: str):
    """`gdngen.tune.Target` of a study name, or None if it is not a gdngen study or cannot be
    rebuilt here (unknown backend, ...)."""
    from gdngen.registry import framework_of
    from gdngen.tune import Target

    match = re.fullmatch(r"gdngen-[^:]+:([^:]+):([^:]+):hk(\d+)-hv(\d+)-dk(\d+)-dv(\d+)-"
                         r"(\w+)-(\w+):(\w+):B(\d+):T(\d+):[0-9a-f]+", name)
    if not match:
        return None
    device, backend, hk, hv, dk, dv, dtype, gate, precision, batch, seq = match.groups()
    try:
        problem = Problem(int(hk), int(hv), int(dk), int(dv), dtype, gate)
        return Target(device, framework_of(backend), backend, problem, precision, int(seq),
                      int(batch))
    except ValueError:
        return None


def study_histories(device: str, storage=None) -> tuple[list[dict], int]:
    """(per current study of ``device``: its trials in order, number of non-current studies)."""
    import optuna

    from gdngen.tune import open_storage, study_name

    if not hasattr(storage, "get_all_studies"):
        storage = open_storage(storage, device)
    histories, stale = [], 0
    for summary in optuna.get_all_study_summaries(storage, include_best_trial=False):
        target = _parse_study(summary.study_name)
        if target is None or target.device != device:
            continue
        try:
            current = study_name(target) == summary.study_name
        except (ValueError, ImportError, OSError):
            current = False
        if not current:
            stale += 1
            continue
        study = optuna.load_study(study_name=summary.study_name, storage=storage)
        default = target.default().name()
        trials = []
        for t in study.get_trials(deepcopy=False):
            if not t.user_attrs.get("evaluated"):
                continue
            median = t.user_attrs.get("median_s")
            trials.append({
                "number": t.number, "variant": t.user_attrs.get("variant"),
                "state": t.state.name, "feasible": bool(t.user_attrs.get("feasible", False)),
                "failure": t.user_attrs.get("failure"),
                "ms": None if median is None else median * 1e3,
                "worst_error": t.user_attrs.get("worst_error"),
            })
        default_ms = next((t["ms"] for t in trials if t["variant"] == default), None)
        histories.append({"study": summary.study_name, "label": target.label(),
                          "default": default, "default_ms": default_ms, "trials": trials})
    return histories, stale


def speedup_series(device: str, dirs=None) -> list[dict]:
    """Tuned cache entries of ``device`` grouped into series over the sequence-length bucket."""
    groups: dict = {}
    for entry in cache.load(device, dirs).entries.values():
        problem = Problem.from_json(entry["problem"]).key()
        label = f"{entry['framework']}/{entry['backend']} {problem} {entry['precision']}"
        groups.setdefault(label, []).append({
            "seq_bucket": entry["seq_bucket"], "seq_len": entry.get("seq_len"),
            "speedup": float(entry["default_ms"]) / float(entry["best_ms"]),
            "best_ms": float(entry["best_ms"]), "default_ms": float(entry["default_ms"]),
            "variant": entry["variant"], "worst_error": entry.get("worst_error")})
    return [{"label": label, "points": sorted(points, key=lambda p: p["seq_bucket"])}
            for label, points in sorted(groups.items())]


def _figure():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save_png(fig, path: Path) -> None:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110, bbox_inches="tight")
    cache.atomic_write_bytes(path, buffer.getvalue())


def plot_history(history: dict, path: Path) -> None:
    """One study's trials: time per trial, running best, default; failures along the top."""
    plt = _figure()
    fig, ax = plt.subplots(figsize=(7, 4))
    ok = [t for t in history["trials"] if t["feasible"] and t["ms"] is not None
          and t["state"] == "COMPLETE"]
    if ok:
        ax.plot([t["number"] for t in ok], [t["ms"] for t in ok], "o", label="feasible trial")
        best, xs, ys = math.inf, [], []
        for t in ok:
            best = min(best, t["ms"])
            xs.append(t["number"])
            ys.append(best)
        ax.step(xs, ys, where="post", label="best so far")
    if history["default_ms"] is not None:
        ax.axhline(history["default_ms"], linestyle="--", color="gray", label="default variant")
    top = max([t["ms"] for t in ok] + [history["default_ms"] or 0, 1e-9]) * 1.05
    bad = [t for t in history["trials"] if t not in ok]
    for kind, marker, color in (("infeasible", "x", "red"), ("failed", "v", "black")):
        sel = [t for t in bad if (t["state"] == "FAIL") == (kind == "failed")]
        if sel:
            ax.plot([t["number"] for t in sel], [top] * len(sel), marker, color=color,
                    linestyle="none", label=kind)
    ax.set_xlabel("trial")
    ax.set_ylabel("fwd+bwd median (ms)")
    ax.set_title(history["label"], fontsize=9)
    ax.legend(fontsize=8)
    _save_png(fig, path)
    plt.close(fig)


def plot_speedup(series: list[dict], path: Path, device: str) -> None:
    """Speedup of the tuned over the default variant against the sequence-length bucket."""
    plt = _figure()
    fig, ax = plt.subplots(figsize=(7, 4))
    for s in series:
        ax.plot([p["seq_bucket"] for p in s["points"]], [p["speedup"] for p in s["points"]],
                "o-", label=s["label"])
    ax.axhline(1.0, linestyle="--", color="gray")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("sequence length bucket T")
    ax.set_ylabel("speedup (default / tuned)")
    ax.set_title(f"tuned vs default on {device}", fontsize=9)
    if series:
        ax.legend(fontsize=7)
    _save_png(fig, path)
    plt.close(fig)


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", text).strip("_")[:120]


def report(device: str, out_dir: str | os.PathLike, *, storage=None, dirs=None) -> dict:
    """Write the plots and ``report.json`` for ``device`` into ``out_dir``; returns the numbers
    (``histories``, ``speedup``, ``stale_studies``, ``files``)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    histories, stale = study_histories(device, storage)
    series = speedup_series(device, dirs)
    files = []
    for history in histories:
        path = out / f"history-{_slug(history['study'].split(':', 2)[2])}.png"
        plot_history(history, path)
        files.append(str(path))
    path = out / "speedup-vs-seq.png"
    plot_speedup(series, path, device)
    files.append(str(path))
    data = {"device": device, "histories": histories, "speedup": series,
            "stale_studies": stale, "files": files}
    cache.atomic_write_text(out / "report.json", json.dumps(data, indent=1) + "\n")
    return data
