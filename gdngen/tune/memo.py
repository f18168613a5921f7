"""The validation memo: a trial's validation verdict, remembered across studies and runs.

A record is keyed by the variant's render sha256, its params, the Problem's dtype, the precision
policy, the battery cases and the gdngen and framework versions
(`gdngen.cache.current_versions`), not by the target's T or B: a variant validated for one
sequence length is only timed at another. It lives in ``<cache root>/validation.json``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from gdngen import cache, settings
from gdngen.tune.target import Target
from gdngen.variant import Variant, dumps


def _memo_key(target: Target, variant: Variant, sha: str, cases) -> str:
    versions = cache.current_versions(target.framework)
    return "|".join([sha, dumps(variant), target.problem.dtype, target.precision,
                     ",".join(cases), json.dumps(versions, sort_keys=True)])


def _memo_path() -> Path:
    return settings.cache_root() / "validation.json"


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
