"""Validation on first use: a generated kernel runs on a device only after it passed there.

Before a generated backend's variant first runs a kind of call (`call_kind`) on a device,
`admitted` checks it there: `probe_cases` (a few battery traps at the call's heads, head dims
and chunk, small B and T) forward and backward through its battery runner
(`gdngen.validate.check_case`) against the float64 reference, at the tuner's tolerance
(`gdngen.tolerance.allowed_error`). The verdict is keyed by (backend, variant, rendered source
sha256, device, framework and gdngen versions, the backend's toolchain, precision, call kind),
stored atomically as ``<cache root>/verdicts/<device>/<backend>-<key hash>.json`` (one
process checks a key while the others wait on its lock, then read its verdict) and reused by
every later process; an active tuned entry of the variant counts as passed (`gdngen tune`
validated it on the device). A variant that failed never runs: the call goes to the
framework's portable backend, with one `FirstUseWarning` per process naming the backend,
variant, case, quantity, error and the verdict's file.

``GDNGEN_VALIDATE``: "first-use" (default), "off" (trust the kernels: a wrong kernel then
returns wrong numbers silently), "always" (check again in every new process). The check runs
eagerly on a thread of its own, so it works while ``jax.jit`` / ``jax.grad`` /
``jax.shard_map`` trace the call; afterwards a call costs one dictionary lookup.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import math
import threading
import time
import warnings
from pathlib import Path

from gdngen import dispatch, registry, settings
from gdngen.problem import Problem
from gdngen.variant import Variant

__all__ = ["ENV_VALIDATE", "MODES", "FirstUseWarning", "Verdict", "admitted", "call_kind",
           "check", "clear_memo", "mode", "planned", "probe_cases", "stored", "verdict_dir",
           "verify"]

ENV_VALIDATE = settings.ENV_VALIDATE
MODES = ("first-use", "off", "always")
_GATE_FORMS = ("softplus", "sigmoid_bound")


class FirstUseWarning(UserWarning):
    """A generated variant failed its first-use check; the call ran the portable backend."""


@dataclasses.dataclass(frozen=True)
class Verdict:
    """One first-use check's outcome (``record``: the stored JSON object, fields in
    docs/VALIDATION.md) and where it is stored (``path``; None for a tuned entry's)."""

    passed: bool
    record: dict
    path: Path | None = None


def mode() -> str:
    """``$GDNGEN_VALIDATE`` ("first-use" when unset); ValueError naming it otherwise."""
    value = settings.validate_mode() or "first-use"
    if value not in MODES:
        raise ValueError(f"{ENV_VALIDATE} must be one of {MODES}, got {value!r}")
    return value


def verdict_dir(device: str) -> Path:
    """The folder of ``device``'s stored verdicts."""
    return settings.cache_root() / "verdicts" / device


# ------------------------------------------------------------------------------ the call kind


def call_kind(call, backend: str | None = None) -> str:
    """What of a `gdngen.call.Call` picks different kernels of ``backend``: gate kind, gate
    convention, packed rows, returned states, the layer inputs its kernels compute
    (`gdngen.backend.Backend.fused_inputs`: ``qk_norm``, the gate form, the conv, the output's
    norm); e.g. "scalar log", "vector linear packed", "scalar log steps", "scalar log qk_norm
    softplus", "scalar log qk_norm softplus conv norm_silu"."""
    parts = [call.problem.gate, call.decay]
    if call.packed:
        parts.append("packed")
    if call.return_states != "final":
        parts.append(call.return_states)
    fused = () if backend is None or call.packed else registry.get(backend).fused_inputs
    if call.qk_norm and "qk_norm" in fused:
        parts.append("qk_norm")
    if call.gate_form is not None and "gate" in fused:
        parts.append(call.gate_form)
    if call.conv_size is not None and "conv" in fused and call.return_states == "final":
        parts.append("conv")
    if call.norm_gate is not None and "norm" in fused and call.return_states == "final":
        parts.append(f"norm_{call.norm_gate}")
    return " ".join(parts)


def probe_cases(problem: Problem, chunk: int, kind: str) -> list:
    """The battery traps a first-use check runs (`gdngen.cases`), at ``problem``'s heads and head
    dims, chunk ``chunk``, T one chunk and a ragged half (crossing a chunk end) or 1: strong
    decay with an initial state, exact g = 0 / 1 with a padding mask, identical keys (scalar
    gates) or per-channel strong halves, exact channel 0 / 1 with padding, a T = 1 decode step
    (vector); a packed row of sequences for packed calls; returned states on the first."""
    from gdngen import cases

    vector = problem.gate == "vector"
    dims = {"Hk": problem.Hk, "Hv": problem.Hv, "Dk": problem.Dk, "Dv": problem.Dv,
            "chunk_size": chunk}
    T = chunk + chunk // 2 + 3
    if "packed" in kind.split():
        name = "packed_vector" if vector else "packed_boundaries"
        return [dataclasses.replace(cases.get_case(name), **dims)]
    states = bool({"steps", "chunks"} & set(kind.split()))
    names = (("vector_strong_half", 1, T), ("vector_masked_gva3", 2, T), ("vector_t1", 1, 1)) \
        if vector else (("hard_decay", 1, T), ("short_masked", 2, T), ("identical_keys", 1, T),
                        ("t1", 1, 1))
    return [dataclasses.replace(cases.get_case(name), B=B, T=t, states=states and i == 0,
                                has_initial_state=True, **dims)
            for i, (name, B, t) in enumerate(names)]


def check(variant: Variant, problem: Problem, kind: str, precision: str = "ieee") -> dict:
    """Run the first-use check of ``variant`` on ``problem``'s ``kind`` of call here, eagerly on
    a thread of its own (a tracing caller's trace is not entered); the verdict record (not
    stored). An exception of the kernels is a failure whose ``reason`` says it."""
    result: dict = {}
    worker = threading.Thread(target=_check_into, args=(result, variant, problem, kind,
                                                         precision), name="gdngen-first-use")
    worker.start()
    worker.join()
    return result["record"]


def _check_into(result: dict, variant: Variant, problem: Problem, kind: str,
                precision: str) -> None:
    from gdngen import validate
    from gdngen.tolerance import allowed_error

    start = time.perf_counter()
    gate = kind.split()[1]
    chunk = int(variant.get("chunk_size", 64))
    record = {"passed": False, "worst_error": math.inf, "worst_case": "", "worst_quantity": "",
              "tolerance": allowed_error(variant, problem.dtype, precision), "cases": {}}
    try:
        runner = validate.runner_for(variant.backend)
        tokens = kind.split()
        form = next((t for t in tokens if t in _GATE_FORMS), None)
        norm = next((t.removeprefix("norm_") for t in tokens if t.startswith("norm_")), None)
        fused = form is not None or "qk_norm" in tokens or "conv" in tokens or norm is not None
        passing = True  # the worst case is the first failing one, else the largest error
        for case in probe_cases(problem, chunk, kind):
            if fused:  # the layer's raw inputs, computed in the kernels' loads
                res = validate.check_fused_case(variant, case, qk_norm="qk_norm" in tokens,
                                                gate_form=form, dtype=problem.dtype,
                                                precision=precision, conv="conv" in tokens,
                                                norm=norm)
            else:
                res = validate.check_case(runner, case, dtype=problem.dtype, variant=variant,
                                          precision=precision, gates=(gate,))
            quantity, err = res.worst
            record["cases"][case.name] = _json_float(err)
            if not record["worst_case"] or (passing and (not res.passed
                                                         or err > record["worst_error"])):
                record.update(worst_error=err, worst_case=case.name, worst_quantity=quantity)
            passing = passing and res.passed
        record["passed"] = passing
    except Exception as e:  # noqa: BLE001 - a kernel that cannot run failed its check
        record["reason"] = f"{type(e).__name__}: {e}"
    record["worst_error"] = _json_float(record["worst_error"])
    record["seconds"] = round(time.perf_counter() - start, 3)
    result["record"] = record


def _json_float(x) -> float | str:
    x = float(x)
    return x if math.isfinite(x) else str(x)


# ------------------------------------------------------------------------------ admitted

_MEMO: dict = {}  # (variant, problem, kind, device arg, precision, mode) -> Verdict
_BY_CALL: dict = {}  # (variant, call, device arg, precision, mode) -> Verdict (at most 4096)
_LOCK = threading.Lock()
_KEY_LOCKS: dict = {}


def clear_memo() -> None:
    """Forget this process's verdicts (the next call reads the stored ones again)."""
    _MEMO.clear()
    _BY_CALL.clear()


def admitted(call, variant: Variant, device: str | None = None,
             precision: str = "ieee") -> Variant:
    """``variant`` if it may run ``call`` (a `gdngen.call.Call`) on ``device`` (default: the
    attached one): a portable backend's, checks off, a passed verdict (stored, or checked now),
    or an active tuned entry of it; else the framework's portable variant, with a
    `FirstUseWarning` once per process."""
    how = settings.validate_mode() or "first-use"
    call_key = (variant, call, device, precision, how)
    verdict = _BY_CALL.get(call_key)
    if verdict is None:
        if registry.get(variant.backend).portable or mode() == "off":
            return variant
        kind = call_kind(call, variant.backend)
        key = (variant, call.problem, kind, device, precision, how)
        with _LOCK:
            key_lock = _KEY_LOCKS.setdefault(key, threading.Lock())
        with key_lock:  # another thread of this process checks it first
            verdict = _MEMO.get(key)
            if verdict is None:
                verdict = _verdict(call.framework, variant, call.problem, device, precision,
                                   kind, how)
                _MEMO[key] = verdict
                if not verdict.passed:
                    _warn(variant, verdict)
        if len(_BY_CALL) >= 4096:
            _BY_CALL.clear()
        _BY_CALL[call_key] = verdict
    if verdict.passed:
        return variant
    return _fallback(call, variant)


def _fallback(call, variant: Variant) -> Variant:
    """The framework's portable default, at the failed variant's chunk where it runs that."""
    fallback = registry.default_variant(registry.portable(call.framework), call.problem)
    try:
        return dispatch._with_chunk(fallback, variant.get("chunk_size"))
    except ValueError:
        return fallback


def _verdict(framework: str, variant: Variant, problem: Problem, device: str | None,
             precision: str, kind: str, how: str) -> Verdict:
    """The stored verdict of this key, else the tuned entry's, else a check run now (under the
    key's file lock) and stored."""
    from filelock import FileLock

    from gdngen import cache

    if device is None:
        from gdngen import devices

        device = devices.detect_framework(framework).name or "unregistered"
    identity = {
        "backend": variant.backend, "variant": variant.to_json(), "problem": problem.to_json(),
        "kind": kind, "precision": precision, "device": device, "framework": framework,
        "sha256": cache.variant_sha256(variant, problem),
        "versions": cache.current_versions(framework),
        "toolchain": _short(registry.get(variant.backend).toolchain()),
        **_own_build(variant, problem, kind),
    }
    digest = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:24]
    path = verdict_dir(device) / f"{variant.backend}-{digest}.json"
    if how != "always":
        found = _read(path)
        if found is not None:
            return Verdict(bool(found["passed"]), found, path)
        # a tuned entry vouches for the variant's own kernels, not for a build of its own
        tuned = None if "packed_sha256" in identity else _tuned(device, variant, problem,
                                                                 precision)
        if tuned is not None:
            return tuned
    path.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(path) + ".lock"):
        found = _read(path)
        # "always": re-checked once per process, unless another process just wrote it
        if found is not None and (how != "always" or _fresh(path)):
            return Verdict(bool(found["passed"]), found, path)
        record = dict(identity, **check(variant, problem, kind, precision),
                      date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                      host=settings.host_id())
        cache.atomic_write_text(path, json.dumps(record, indent=1, sort_keys=True) + "\n")
    return Verdict(bool(record["passed"]), record, path)


_STARTED = time.time()


def _own_build(variant: Variant, problem: Problem, kind: str) -> dict:
    """``{"packed_sha256": ...}`` where ``kind``'s calls run the backend's packed build
    (``render_packed``, sources of its own: a change to them is checked again), else {}."""
    spec = registry.get(variant.backend)
    if "packed" not in kind.split() or spec.portable or not hasattr(spec, "render_packed") \
            or not spec.native_packed(problem.gate == "vector"):
        return {}
    return {"packed_sha256": spec.render_packed(variant, problem).sha256}


def _short(toolchain: str) -> str:
    """A toolchain's first line and the sha256 of all of it (flags, CPU features)."""
    if not toolchain:
        return ""
    return f"{toolchain.splitlines()[0]} ({hashlib.sha256(toolchain.encode()).hexdigest()[:16]})"


def _fresh(path: Path) -> bool:
    """Whether ``path`` was written since this process started (``always`` mode)."""
    try:
        return path.stat().st_mtime >= _STARTED
    except OSError:
        return False


def _read(path: Path) -> dict | None:
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) and "passed" in record else None


def _tuned(device: str, variant: Variant, problem: Problem, precision: str) -> Verdict | None:
    """A passed verdict for an active tuned entry of ``variant`` (`gdngen.cache.load`: stale
    ones are left out), else None."""
    from gdngen import cache

    try:
        loaded = cache.load(device)
    except ValueError:
        return None
    for key, entry in loaded.entries.items():
        if entry.get("backend") == variant.backend and entry.get("precision") == precision \
                and Variant.from_json(entry["variant"]) == variant \
                and Problem.from_json(entry["problem"]) == problem:
            record = {"passed": True, "source": "tuned", "entry": key,
                      "worst_error": entry.get("worst_error"),
                      "tolerance": entry.get("tolerance"), "date": entry.get("date")}
            return Verdict(True, record, None)
    return None


def _warn(variant: Variant, verdict: Verdict) -> None:
    r = verdict.record
    what = r.get("reason") or (f"case {r['worst_case']}, {r['worst_quantity']} relative error "
                               f"{float(r['worst_error']):.2e} > tolerance "
                               f"{r['tolerance']:.1e}")
    warnings.warn(
        f"gdngen: the {variant.backend} variant {variant} failed its first-use check on "
        f"{r.get('device')} ({r.get('kind')} calls): {what}; its calls run the portable "
        f"{registry.portable(registry.get(variant.backend).framework)} backend instead. "
        f"Verdict: {verdict.path} (delete it, or set {ENV_VALIDATE}=always, to check again)",
        FirstUseWarning, stacklevel=settings.caller_stacklevel())


# ------------------------------------------------------------------------------ stored


def stored(device: str) -> list[dict]:
    """``device``'s stored verdict records, each with its ``path``; unreadable files as
    ``{"path": ..., "unreadable": True}``."""
    rows = []
    for path in sorted(verdict_dir(device).glob("*.json")):
        record = _read(path)
        rows.append({"path": str(path), "unreadable": True} if record is None
                    else dict(record, path=str(path)))
    return rows


dispatch.install_gate(admitted)


# ------------------------------------------------------------------------------ on demand


def planned(framework: str, device: str, problems=()) -> list[tuple[Variant, Problem]]:
    """The generated ``(variant, problem)`` pairs calls of ``framework`` on ``device`` would run:
    every active tuned entry's, and the default variant (`gdngen.dispatch.default_choice`) of
    each of their problems and of ``problems``; sorted, without repeats."""
    from gdngen import cache

    found, seen = [], set(problems)
    try:
        entries = cache.load(device).entries.values()
    except ValueError:
        entries = ()
    for entry in entries:
        if entry.get("framework") == framework:
            problem = Problem.from_json(entry["problem"])
            found.append((Variant.from_json(entry["variant"]), problem))
            seen.add(problem)
    for problem in seen:
        found.append((dispatch.default_choice(framework, problem, device)[0], problem))
    unique = {(v, p) for v, p in found if not registry.get(v.backend).portable}
    return sorted(unique, key=lambda vp: (vp[1].key(), str(vp[0])))


def verify(framework: str, variant: Variant, problem: Problem, device: str,
           precision: str = "ieee") -> Verdict:
    """Check ``variant`` on ``problem``'s plain calls (log gates) now, whatever is stored, and
    store the verdict (``gdngen validate --device attached``)."""
    return _verdict(framework, variant, problem, device, precision, f"{problem.gate} log",
                    "always")
