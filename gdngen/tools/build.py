"""Build stage: enumerate a backend's variants for a `Problem`, render each, write the sources
and validate every variant on the battery; record it all in ``manifest.json``.

Generic over the backends of `gdngen.registry`. A variant is validated at
`gdngen.tolerance.allowed_error` (the rule ``gdngen tune`` uses too); its spec's hooks add:

* ``lower_check(variant, problem) -> None``: compile/lowering check without the target hardware
  (raises on failure), recorded as ``lowering`` in the manifest;
* ``clear_cache() -> None``: drop loaded/compiled kernels (called after each variant, so a
  long build's memory stays flat).

With a ``device``, only the variants that fit that device's limits are built; with
``compile_for`` (a device name) each variant's programs are also compiled for that device with
its real compiler, attached or not (`gdngen.compilers.compile_variant`), recorded as
``compile`` (`gdngen.compilers.CompileReport.to_json`: ``compiler``, ``target``, ``ok``,
``error``, ``temp_bytes``, ``code_bytes``, ``programs``, ...); a failed compile fails the
variant.

Layout of the output folder: ``<out>/<sha256[:16]>/<output name>`` per distinct rendering (the
problem's own), and ``<out>/manifest.json``::

    {"backend", "problem", "dtype", "templates", "cases", "seed",
     "variants": [{"name", "params", "sha256", "files",
                   "status": "passed" | "rendered" | "failed" | "error", "tolerance",
                   "worst": {quantity: error}, "failed_cases", "lowering", "compile", "error",
                   "seconds"}],
     "summary": {"total", "ok", "failed"}}

Each variant is validated with its parameters rendered for every case's own shape (the variant
params are shape-independent; tiles that must divide a dim are resolved by the backend). A
template override folder (``templates_dir``) applies to the written sources and to validation.
Files are written atomically (temp file + ``os.replace``); the manifest is rewritten after every
variant so a long build shows its progress.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import time
import traceback
from pathlib import Path

from gdngen import registry, settings
from gdngen.fileio import atomic_write_text as write_atomic
from gdngen.problem import Problem
from gdngen.render import render
from gdngen.tolerance import allowed_error
from gdngen.variant import Variant

__all__ = ["VariantBuild", "build", "normalize_backend", "variant_tolerance", "write_atomic"]


def normalize_backend(name: str) -> str:
    """``pallas-tpu`` -> ``pallas_tpu``; ValueError unless the result is registered."""
    backend = name.replace("-", "_")
    if backend not in registry.names():
        raise ValueError(f"backend must be one of {sorted(registry.names())}, got {name!r}")
    return backend


def variant_tolerance(variant: Variant, dtype: str, precision: str = "ieee") -> float:
    """The tolerance ``variant`` is validated at (`gdngen.tolerance.allowed_error`)."""
    return allowed_error(variant, dtype, precision)


@contextlib.contextmanager
def _templates_env(templates_dir):
    """Point ``GDNGEN_TEMPLATES`` at ``templates_dir`` for the duration (validation renders each
    case's shape through the framework entry point, which reads it)."""
    if templates_dir is None:
        yield
        return
    old = os.environ.get(settings.ENV_TEMPLATES)
    os.environ[settings.ENV_TEMPLATES] = str(Path(templates_dir).resolve())
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(settings.ENV_TEMPLATES, None)
        else:
            os.environ[settings.ENV_TEMPLATES] = old


@dataclasses.dataclass
class VariantBuild:
    """Outcome of one variant: ``status`` is "passed" (validated), "rendered" (written and
    lowered, not validated), "failed" (some case over tolerance, or the lowering check failed)
    or "error" (rendering or running raised)."""

    variant: Variant
    sha256: str = ""
    files: list = dataclasses.field(default_factory=list)
    status: str = "error"
    tolerance: float = 0.0
    worst: dict = dataclasses.field(default_factory=dict)
    failed_cases: list = dataclasses.field(default_factory=list)
    lowering: str | None = None
    error: str | None = None
    seconds: float = 0.0
    compile: dict | None = None

    @property
    def ok(self) -> bool:
        """Neither failed nor errored."""
        return self.status in ("passed", "rendered")

    def to_json(self) -> dict:
        def num(x):
            return x if math.isfinite(x) else str(x)

        return {"name": self.variant.name(), "params": self.variant.as_dict(),
                "sha256": self.sha256, "files": self.files, "status": self.status,
                "tolerance": self.tolerance, "worst": {q: num(e) for q, e in self.worst.items()},
                "failed_cases": self.failed_cases, "lowering": self.lowering,
                "compile": self.compile, "error": self.error, "seconds": round(self.seconds, 2)}


def _build_one(variant, problem, out_dir, *, templates_dir, cases, seed, validate,
               compile_for=None, compile_T=None):
    from gdngen import validate as validate_mod

    result = VariantBuild(variant)
    start = time.perf_counter()
    try:
        rendered = render(variant, problem, templates_dir=templates_dir)
        result.sha256 = rendered.sha256
        for name, source in sorted(rendered.sources.items()):
            relative = f"{rendered.sha256[:16]}/{name}"
            write_atomic(Path(out_dir) / relative, source)
            result.files.append(relative)
        failed = False
        lower_check = registry.get(variant.backend).lower_check
        if lower_check is not None:
            try:
                with _templates_env(templates_dir):
                    lower_check(variant, problem)
                result.lowering = "ok"
            except Exception as e:  # noqa: BLE001 - recorded; the variant fails
                result.lowering = f"{type(e).__name__}: {e}"
                failed = True
        if compile_for is not None:
            from gdngen import compilers

            with _templates_env(templates_dir):
                report = compilers.compile_variant(variant, problem, compile_for,
                                                   T=compile_T or compilers.DEFAULT_T)
            result.compile = report.to_json()
            failed = failed or not report.ok
        if validate:
            result.tolerance = variant_tolerance(variant, problem.dtype)
            with _templates_env(templates_dir):
                results = validate_mod.run_battery(None, variant=variant, dtype=problem.dtype,
                                                   cases=cases, seed=seed)
            for res in results:
                res = dataclasses.replace(res, tolerance=result.tolerance)
                for quantity, err in res.errors.items():
                    current = result.worst.get(quantity)
                    if current is None or (not math.isnan(current)
                                           and (math.isnan(err) or err > current)):
                        result.worst[quantity] = err  # NaN is the worst and sticks
                if not res.passed:
                    result.failed_cases.append(res.case)
            failed = failed or bool(result.failed_cases)
        result.status = "failed" if failed else ("passed" if validate else "rendered")
    except Exception as e:  # noqa: BLE001 - a crash is this variant's result
        result.status = "error"
        result.error = f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=-3)}"
    result.seconds = time.perf_counter() - start
    return result


def _resumable(out_dir: Path, backend, problem, templates_dir, case_names, seed, validate):
    """Entries of an existing manifest in ``out_dir`` made with the same settings, by name."""
    try:
        old = json.loads((out_dir / "manifest.json").read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}
    same = (old.get("backend") == backend and old.get("problem") == problem.to_json()
            and old.get("templates") == (None if templates_dir is None
                                         else str(Path(templates_dir).resolve()))
            and old.get("cases") == case_names and old.get("seed") == seed)
    if not same:
        return {}
    wanted = "passed" if validate else "rendered"
    return {e["name"]: e for e in old.get("variants", []) if e.get("status") == wanted}


def _from_entry(variant: Variant, entry: dict) -> VariantBuild:
    return VariantBuild(variant, sha256=entry["sha256"], files=entry["files"],
                        status=entry["status"], tolerance=entry["tolerance"],
                        worst={q: float(e) for q, e in entry["worst"].items()},
                        failed_cases=entry["failed_cases"], lowering=entry["lowering"],
                        error=entry["error"], seconds=entry["seconds"],
                        compile=entry.get("compile"))


def build(backend: str, problem: Problem, out_dir, *, templates_dir=None, cases=None,
          seed=None, variant_list=None, validate=True, progress=None,
          resume=False, device=None, compile_for=None, compile_T=None) -> list[VariantBuild]:
    """Render (and validate) every variant of ``backend`` for ``problem`` into ``out_dir``.

    ``variant_list``: build only these (default: `gdngen.registry.variants` on ``device``,
    else on the backend's reference device); ``cases``: battery
    cases (names or Cases; default the whole battery); ``seed``: input seed (default each
    case's own); ``progress(VariantBuild)`` is called after each variant. ``resume``: keep the
    passing entries of an existing manifest made with the same settings whose sources still
    hash the same (the rest are built again). Returns the results in order;
    ``out_dir/manifest.json`` describes them (module docstring). The backend's ``clear_cache``
    hook, if any, runs after each variant (compiled kernels are not kept across variants).
    ``compile_for``: a device name to compile each variant's programs for with its real
    compiler (`gdngen.compilers`; ``compile_T`` steps, default theirs); a resumed entry is kept
    only if it was compiled for that device.
    """
    backend = normalize_backend(backend)
    if variant_list is None:
        variant_list = registry.variants(backend, problem, device)
    for v in variant_list:
        if v.backend != backend:
            raise ValueError(f"variant_list holds a {v.backend!r} variant, expected {backend!r}")
    case_names = None if cases is None else [getattr(c, "name", c) for c in cases]
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    done = (_resumable(out_dir, backend, problem, templates_dir, case_names, seed, validate)
            if resume else {})
    clear_cache = registry.get(backend).clear_cache
    results = []
    for variant in variant_list:
        entry = done.get(variant.name())
        if compile_for is not None and entry is not None and (
                (entry.get("compile") or {}).get("device") != compile_for
                or not entry["compile"]["ok"]):
            entry = None
        if entry is not None and entry["sha256"] == render(
                variant, problem, templates_dir=templates_dir).sha256:
            results.append(_from_entry(variant, entry))
        else:
            results.append(_build_one(variant, problem, out_dir, templates_dir=templates_dir,
                                      cases=cases, seed=seed, validate=validate,
                                      compile_for=compile_for, compile_T=compile_T))
            if clear_cache is not None:
                clear_cache()
        _write_manifest(out_dir, backend, problem, templates_dir, case_names, seed, results)
        if progress is not None:
            progress(results[-1])
    if not results:
        _write_manifest(out_dir, backend, problem, templates_dir, case_names, seed, results)
    return results


def _write_manifest(out_dir, backend, problem, templates_dir, case_names, seed, results):
    ok = sum(r.ok for r in results)
    manifest = {
        "backend": backend, "problem": problem.to_json(), "dtype": problem.dtype,
        "templates": None if templates_dir is None else str(Path(templates_dir).resolve()),
        "cases": case_names, "seed": seed,
        "variants": [r.to_json() for r in results],
        "summary": {"total": len(results), "ok": ok, "failed": len(results) - ok},
    }
    write_atomic(out_dir / "manifest.json", json.dumps(manifest, indent=2) + "\n")
