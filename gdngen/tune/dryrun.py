"""``gdngen tune --dry-run``: render and validate every candidate of a target off-device.

Each candidate is validated in a trial subprocess (`gdngen.tune.worker`) with
``GDNGEN_INTERPRET=1``, so generated backends can select interpret mode / a simulator and the
device need not be attached; nothing is timed and no study is made. Verdicts go to (and come
from) the validation memo (`gdngen.tune.memo`).
"""

from __future__ import annotations

from gdngen import cache
from gdngen.settings import ENV_INTERPRET
from gdngen.tune.memo import _memo_key, memo_get, memo_put
from gdngen.tune.search import Settings, _spec
from gdngen.tune.target import Target
from gdngen.tune.worker import _run_worker

_DEFAULT_SETTINGS = Settings()


def dry_run(target: Target, settings: Settings = _DEFAULT_SETTINGS,
            on_variant=None) -> list[dict]:
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

