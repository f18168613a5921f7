"""The tune command's tables: the end-of-run summaries and the ``--dry-run`` verdicts."""

from __future__ import annotations

from gdngen.tables import render_table
from gdngen.tune.target import Target


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
