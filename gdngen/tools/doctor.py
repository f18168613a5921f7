"""``gdngen doctor``: what this host runs gdngen with, on one screen for a bug report.

`collect` returns a JSON-serialisable dict, one key per section (`SECTIONS`): ``host``,
``devices``, ``versions``, ``backends``, ``verdicts``, ``tuned``, ``compilers``,
``environment``. A section that fails is ``{"error": "<type>: <message>"}``; `collect` itself
never raises. `format_report` renders that dict as plain-text tables.

First-use verdicts (`gdngen.firstuse`) are read as files (`gdngen.firstuse.verdict_dir`), each
checked for `VERDICT_KEYS`; the mode is ``$GDNGEN_VALIDATE`` (`gdngen.firstuse.MODES`).
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
import sys
import warnings
from pathlib import Path

from gdngen import firstuse, settings

SECTIONS = ("host", "devices", "versions", "backends", "verdicts", "tuned", "compilers",
            "environment")
ENV_VALIDATE = settings.ENV_VALIDATE
VALIDATE_MODES = firstuse.MODES
#: keys every verdict file holds (the first-use validation's contract)
VERDICT_KEYS = ("backend", "variant", "problem", "kind", "passed", "date", "worst_error",
                "worst_case", "worst_quantity", "tolerance", "seconds")
#: rows of a long list the text report shows (``--json`` has them all)
MAX_ROWS = 20


def _error(e: BaseException) -> dict:
    return {"error": f"{type(e).__name__}: {e}"}


def _guarded(fn, *args) -> dict:
    """``fn(*args)``, or ``{"error": ...}`` when it raises (warnings it issues are kept)."""
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001 (a section's failure is part of the report)
        return _error(e)


# ------------------------------------------------------------------------------ collection


def collect(device: str | None = None) -> dict:
    """The report: one key per section of `SECTIONS`. ``device``: whose verdicts and tuned
    entries to show (default: the attached device, as `gdngen.devices.detect` picks it)."""
    detected = _guarded(_detect)
    chosen = device or _attached_name(detected)
    backends = _guarded(_backends, detected)
    return {
        "host": _guarded(_host, chosen),
        "devices": _guarded(_devices, detected, backends),
        "versions": _guarded(_versions),
        "backends": backends,
        "verdicts": _guarded(_verdicts, chosen),
        "tuned": _guarded(_tuned, chosen),
        "compilers": _guarded(_compilers),
        "environment": _guarded(_environment),
    }


def _detect() -> dict:
    """framework -> `gdngen.devices.Detected` as a dict, or ``{"error": ...}`` per framework."""
    import dataclasses

    from gdngen import devices

    found = {}
    for fw in devices.installed_frameworks():
        try:
            found[fw] = dataclasses.asdict(devices.detect_framework(fw))
        except Exception as e:  # noqa: BLE001
            found[fw] = _error(e)
    return found


def _attached_name(detected: dict) -> str:
    """`gdngen.devices.detect` (framework None) from ``detected``: an Apple GPU, then JAX's
    device, then "cpu"."""
    for fw in ("mlx", "jax"):
        name = detected.get(fw, {}).get("name")
        if name not in (None, "cpu"):
            return name
    return "cpu"


def _host(device: str) -> dict:
    from gdngen._version import __version__

    return {"gdngen": __version__, "python": sys.version.split()[0],
            "executable": sys.executable, "platform": platform.platform(),
            "machine": platform.machine(), "cpus": os.cpu_count(),
            "cache_root": str(settings.cache_root()), "device": device}


def _devices(detected: dict, backends: dict) -> dict:
    """Per installed framework: what it runs on, the backends targeting it (preferred first)
    and the one an untuned call takes (by the availability ``backends`` found)."""
    from gdngen import devices, registry

    if "error" in detected:
        return detected
    available = {r["backend"]: r["available"] for r in backends.get("backends", ())}
    rows = []
    for fw, found in detected.items():
        if "error" in found:
            rows.append({"framework": fw, **found})
            continue
        name = found["name"]
        kind = devices.get_device(name).kind if name else None
        names = list(registry.backends_for(name, fw)) if name else []
        rows.append({"framework": fw, "name": name, "kind": kind,
                     "description": found["description"], "backends": names,
                     "default": _default_backend(names, fw, available)})
    return {"frameworks": rows}


def _default_backend(names: list, framework: str, available: dict) -> str:
    """The backend an untuned call takes (`gdngen.dispatch.default_choice`, for a problem every
    backend implements): the first generated one of ``names`` that runs here
    (``available``: name -> bool), else the portable one."""
    from gdngen import registry

    for name in names:
        if not registry.get(name).portable and available.get(name, False):
            return name
    return registry.portable(framework)


def _versions() -> dict:
    from gdngen import cache, devices
    from gdngen.compilers import targets

    frameworks = {fw: cache.current_versions(fw) for fw in devices.installed_frameworks()}
    packages = {}
    for compiler in targets.COMPILER_PACKAGES:
        for package, version in targets.compiler_versions(compiler).items():
            if package not in ("gdngen", "jax", "jaxlib"):
                packages[package] = version
    return {"frameworks": frameworks, "cxx": _cxx(), "packages": packages}


def _cxx() -> dict:
    """The C++ compiler command and the first line of its ``--version``, or ``{"error"}``."""
    try:
        command = settings.compiler("doctor")
    except RuntimeError as e:
        return {"error": str(e)}
    try:
        out = subprocess.run([*command, "--version"], capture_output=True, text=True,
                             timeout=20, check=False)
        text = (out.stdout or out.stderr).strip()
        version = text.splitlines()[0] if text else f"exit status {out.returncode}"
    except (OSError, subprocess.TimeoutExpired) as e:
        version = f"--version failed: {e}"
    return {"command": command, "version": version}


def _backends(detected: dict) -> dict:
    """Every registered backend (``GDNGEN_PLUGINS`` imported first): framework, the device
    kinds it targets, whether it runs here, how (``mode``) and why (``detail``)."""
    import importlib

    from gdngen import devices, registry

    plugins = {}
    for module in settings.plugins():
        try:
            importlib.import_module(module)
            plugins[module] = "loaded"
        except Exception as e:  # noqa: BLE001
            plugins[module] = f"{type(e).__name__}: {e}"
    installed = devices.installed_frameworks()
    kinds = {fw: (d.get("name") and devices.get_device(d["name"]).kind, d.get("description"))
             for fw, d in detected.items() if "error" not in d} if "error" not in detected \
        else {}
    rows = []
    for name in registry.names():
        try:
            spec = registry.get(name)
        except Exception as e:  # noqa: BLE001
            rows.append({"backend": name, "available": False, "mode": "unavailable",
                         "detail": f"cannot load: {type(e).__name__}: {e}"})
            continue
        row = {"backend": name, "framework": spec.framework, "portable": bool(spec.portable),
               "device_kinds": list(spec.device_kinds)}
        try:
            if spec.framework not in installed:
                available, mode, detail = False, "unavailable", \
                    f"{spec.framework} is not installed"
            else:
                available, mode, detail = _how(spec, kinds.get(spec.framework, (None, None)))
        except Exception as e:  # noqa: BLE001
            available, mode, detail = False, "unavailable", f"{type(e).__name__}: {e}"
        rows.append({**row, "available": available, "mode": mode, "detail": detail})
    return {"backends": rows, "plugins": plugins}


def _how(spec, attached) -> tuple[bool, str, str]:
    """``(available, mode, detail)`` of a backend whose framework is installed; ``attached``:
    (device kind, description) of its framework's device. mode: "native", "interpret",
    "simulator", "portable" or "unavailable"."""
    kind, description = attached
    on = f" on {description}" if description else ""
    if spec.name == "ffi_cpu":
        try:
            command = settings.compiler("the ffi_cpu backend")
        except RuntimeError as e:
            return False, "unavailable", str(e)
        if not spec.available():
            return False, "unavailable", "jax's CPU backend is not available"
        return True, "native", f"generated C++ built with {' '.join(command)}"
    if spec.name == "metal":
        if kind == "apple":
            return True, "native", f"Metal{on}"
        from gdngen.backends.metal import sim

        if sim.available():
            return True, "simulator", "no Apple GPU: the MSL simulator runs the kernels (slow)"
        return False, "unavailable", ("no Apple GPU, and the MSL simulator needs a C++ "
                                      "compiler (set $CXX or install g++)")
    if spec.name in ("pallas_tpu", "pallas_gpu"):
        target = "tpu" if spec.name == "pallas_tpu" else "gpu"
        if spec.name == "pallas_gpu" and settings.flag(settings.ENV_INTERPRET):
            return True, "interpret", f"interpret mode: {settings.ENV_INTERPRET} is set"
        if kind == target:
            return True, "native", f"{'Mosaic' if target == 'tpu' else 'Triton'}{on}"
        return True, "interpret", (f"no {target.upper()} attached: Pallas interpret mode "
                                   "(slow; for validation)")
    if not spec.available():
        return False, "unavailable", f"{spec.name}.available() is False on this host"
    if spec.portable:
        return True, "portable", f"portable path{on}"
    return True, "native", f"available{on}"


def validate_mode() -> dict:
    """``{"mode", "source"}`` of ``$GDNGEN_VALIDATE`` (default "first-use"); an unknown value
    is reported as given, with ``"unknown": True``."""
    value = os.environ.get(ENV_VALIDATE, "")
    if not value:
        return {"mode": "first-use", "source": "default"}
    return {"mode": value, "source": ENV_VALIDATE, **({} if value in VALIDATE_MODES
                                                     else {"unknown": True})}


class UnreadableVerdict(Exception):
    """A verdict file that is not a JSON object with `VERDICT_KEYS` (the message says why)."""


def read_verdict(path: Path) -> dict:
    """One verdict file as a dict (with ``path``, ``problem_key`` and ``variant_name`` added);
    `UnreadableVerdict` saying why it cannot be read."""
    from gdngen.problem import Problem
    from gdngen.variant import Variant

    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UnreadableVerdict(f"not JSON ({e})") from None
    if not isinstance(data, dict):
        raise UnreadableVerdict(f"expected a JSON object, got {type(data).__name__}")
    missing = [k for k in VERDICT_KEYS if k not in data]
    if missing:
        raise UnreadableVerdict(f"lacks {missing}")
    if not isinstance(data["passed"], bool):
        raise UnreadableVerdict(f"passed must be a bool, got {data['passed']!r}")
    try:
        problem_key = Problem.from_json(data["problem"]).key()
    except (TypeError, ValueError, KeyError, AttributeError):
        problem_key = json.dumps(data["problem"], sort_keys=True)
    try:
        variant_name = Variant.from_json(data["variant"]).name()
    except (TypeError, ValueError, KeyError, AttributeError):
        variant_name = json.dumps(data["variant"], sort_keys=True)
    return {**data, "path": str(path), "problem_key": problem_key, "variant_name": variant_name}


def _verdicts(device: str) -> dict:
    """The stored first-use verdicts of ``device``: failed first, then newest first."""
    directory = firstuse.verdict_dir(device)
    verdicts, unreadable = [], []
    for path in sorted(directory.glob("*.json")) if directory.is_dir() else ():
        try:
            verdicts.append(read_verdict(path))
        except UnreadableVerdict as e:
            unreadable.append({"path": str(path), "reason": str(e)})
    verdicts.sort(key=lambda v: str(v.get("date", "")), reverse=True)
    verdicts.sort(key=lambda v: v["passed"])
    return {"device": device, "dir": str(directory), **validate_mode(),
            "passed": sum(v["passed"] for v in verdicts),
            "failed": sum(not v["passed"] for v in verdicts),
            "verdicts": verdicts, "unreadable": unreadable}


def _tuned(device: str) -> dict:
    """`gdngen.cache.describe` of ``device`` with per-file counts (active / overridden /
    stale) and the tuned-cache warnings reading the files gave."""
    from gdngen import cache

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", cache.TunedCacheWarning)
        rows = cache.describe(device)
    files = {}
    for directory in cache.tuned_dirs():
        path = cache.tuned_file(device, directory)
        files[str(path)] = {"exists": path.is_file(), "active": 0, "overridden": 0, "stale": 0}
    for row in rows:
        status = row["status"] if row["status"] in ("active", "overridden") else "stale"
        files.setdefault(row["file"], {"exists": True, "active": 0, "overridden": 0,
                                       "stale": 0})[status] += 1
    return {"device": device, "dirs": [str(d) for d in cache.tuned_dirs()],
            "no_tuned": settings.flag(settings.ENV_NO_TUNED), "files": files, "rows": rows,
            "warnings": [str(w.message) for w in caught
                         if issubclass(w.category, cache.TunedCacheWarning)]}


def _compilers() -> dict:
    """Each real compiler (`gdngen.compilers.targets.COMPILERS`): whether it runs here (why
    not), its packages' versions and the devices it compiles for (with their topology)."""
    from gdngen import devices
    from gdngen.compilers import targets

    rows = []
    for backend, (compiler, kind) in targets.COMPILERS.items():
        reason = targets.missing_reason(compiler)
        rows.append({"compiler": compiler, "backend": backend, "device_kind": kind,
                     "platform": targets.PLATFORMS.get(compiler), "available": reason is None,
                     "reason": reason, "versions": targets.compiler_versions(compiler),
                     "devices": {d.name: d.topology for d in devices.DEVICES.values()
                                 if d.kind == kind and d.topology}})
    return {"compilers": rows}


def _known_variables() -> set:
    return {getattr(settings, n) for n in dir(settings) if n.startswith("ENV_")}


def _environment() -> dict:
    """The ``GDNGEN_*`` variables set (and ``CXX``); ``unknown``: set ones this gdngen does not
    read (a typo?)."""
    known = _known_variables()
    found = {k: v for k, v in sorted(os.environ.items())
             if k.startswith("GDNGEN_") or k == settings.ENV_COMPILER}
    return {"set": found, "unknown": sorted(k for k in found if k not in known)}


# ------------------------------------------------------------------------------ text


def _table(title, columns, rows, footer=()) -> str:
    from gdngen.tables import render_table

    return render_table(title, columns, [tuple(map(str, r)) for r in rows],
                        footer=footer).rstrip("\n")


def _short_date(value) -> str:
    try:
        return datetime.datetime.fromisoformat(str(value)).strftime("%Y-%m-%d %H:%M")
    except ValueError:
        return str(value)


def _number(value) -> str:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return f"{value:.1e}"
    return str(value)


def format_report(report: dict) -> str:
    """``report`` (`collect`) as plain-text tables, one per section."""
    parts = []
    for name in SECTIONS:
        section = report.get(name)
        if section is None:
            continue
        if "error" in section:
            parts.append(f"{name}: error: {section['error']}")
            continue
        try:
            parts.append(_FORMATTERS[name](section))
        except Exception as e:  # noqa: BLE001
            parts.append(f"{name}: cannot format ({type(e).__name__}: {e})")
    return "\n".join(parts) + "\n"


def _format_host(s: dict) -> str:
    return (f"gdngen doctor: gdngen {s['gdngen']}, Python {s['python']} ({s['executable']})\n"
            f"platform {s['platform']} ({s['machine']}, {s['cpus']} CPUs); cache root "
            f"{s['cache_root']}; verdicts and tuned entries of device {s['device']}")


def _format_devices(s: dict) -> str:
    rows = []
    for r in s["frameworks"]:
        if "error" in r:
            rows.append((r["framework"], "error", "", r["error"], "", ""))
            continue
        rows.append((r["framework"], r["name"] or "(not registered)", r["kind"] or "-",
                     r["description"], ", ".join(r["backends"]) or "-", r["default"]))
    return _table("attached devices", ("framework", "device", "kind", "framework sees",
                                       "backends (preferred first)", "untuned default"), rows)


def _format_versions(s: dict) -> str:
    rows = [(fw, ", ".join(f"{k} {v}" for k, v in versions.items() if k != "gdngen"))
            for fw, versions in s["frameworks"].items()]
    cxx = s["cxx"]
    rows.append(("C++ compiler", cxx["error"] if "error" in cxx else
                 f"{' '.join(cxx['command'])}: {cxx['version']}"))
    rows += [(p, v or "not installed") for p, v in s["packages"].items()]
    return _table("versions", ("component", "version"), rows)


def _format_backends(s: dict) -> str:
    rows = [(r["backend"], r.get("framework", "?"), ", ".join(r.get("device_kinds", ())),
             "yes" if r["available"] else "NO", r["mode"], r["detail"]) for r in s["backends"]]
    footer = [f"plugin {m}: {status}" for m, status in s.get("plugins", {}).items()]
    return _table("backends", ("backend", "framework", "targets", "available", "mode",
                               "how / why not"), rows, footer)


def _format_verdicts(s: dict) -> str:
    rows = []
    for v in s["verdicts"][:MAX_ROWS]:
        rows.append(("passed" if v["passed"] else "FAILED", v["variant_name"], v["problem_key"],
                     v["kind"], _short_date(v["date"]),
                     f"{_number(v['worst_error'])} / {_number(v['tolerance'])}",
                     f"{v['worst_case']} ({v['worst_quantity']})"
                     + (f": {v['reason']}" if v.get("reason") else ""),
                     Path(v["path"]).name))
    mode = s["mode"] + (" (unknown value)" if s.get("unknown") else "") + \
        ("" if s["source"] == "default" else f" (${s['source']})")
    summary = (f"first-use verdicts ({s['device']}): mode {mode}; {s['passed']} passed, "
               f"{s['failed']} failed, {len(s['unreadable'])} unreadable in {s['dir']}")
    if not rows and not s["unreadable"]:
        return summary
    footer = [summary]
    if len(s["verdicts"]) > MAX_ROWS:
        footer.append(f"{len(s['verdicts']) - MAX_ROWS} more: gdngen doctor --json")
    footer += [f"unreadable: {Path(u['path']).name}: {u['reason']}" for u in s["unreadable"]]
    return _table(f"first-use verdicts ({s['device']})",
                  ("status", "variant", "problem", "kind", "date", "worst err / tol",
                   "worst case (quantity)", "file"), rows, footer)


def _format_tuned(s: dict) -> str:
    rows = [(path, c["active"], c["overridden"], c["stale"]) if c["exists"] else
            (path, "-", "-", "-") for path, c in s["files"].items()]
    stale = [r for r in s["rows"] if r["status"] not in ("active", "overridden")]
    footer = [f"stale: {r['key']}: {r['status'].removeprefix('ignored: ')}"
              for r in stale[:MAX_ROWS]]
    if len(stale) > MAX_ROWS:
        footer.append(f"{len(stale) - MAX_ROWS} more stale: gdngen doctor --json")
    footer += [f"warning: {w}" for w in s["warnings"]]
    if s["no_tuned"]:
        footer.append(f"{settings.ENV_NO_TUNED} is set: calls skip the tuned cache")
    footer.append("every entry: gdngen show" + (f" --device {s['device']}"
                                                if s["device"] != "cpu" else ""))
    return _table(f"tuned entries ({s['device']})", ("file", "active", "overridden", "stale"),
                  rows, footer)


def _format_compilers(s: dict) -> str:
    rows = []
    for r in s["compilers"]:
        versions = ", ".join(f"{k} {v}" for k, v in r["versions"].items()
                             if k != "gdngen" and v is not None)
        rows.append((r["compiler"], r["backend"],
                     ", ".join(f"{n} {t}" for n, t in r["devices"].items()),
                     "yes" if r["available"] else "NO", r["reason"] or versions))
    return _table("compilers off-device (compile-only)", ("compiler", "backend", "devices",
                                                          "available", "versions / why not"),
                  rows)


def _format_environment(s: dict) -> str:
    if not s["set"]:
        return "environment: no GDNGEN_* variable (nor CXX) is set"
    rows = [(k, v, "not read by this gdngen" if k in s["unknown"] else "")
            for k, v in s["set"].items()]
    return _table("environment", ("variable", "value", ""), rows)


_FORMATTERS = {"host": _format_host, "devices": _format_devices, "versions": _format_versions,
               "backends": _format_backends, "verdicts": _format_verdicts,
               "tuned": _format_tuned, "compilers": _format_compilers,
               "environment": _format_environment}
