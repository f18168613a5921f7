"""Cache stage: tuned variants per device, one JSON file per device.

Files live in two folders, read in this order with later entries winning: the shipped
``tuned/<device>.json`` (`gdngen.resources.tuned_dir`) and the user's
``<cache root>/tuned/<device>.json`` (`user_tuned_dir`; the cache root is ``$GDNGEN_CACHE_DIR``
or platformdirs' user cache dir for "gdngen"). A file is::

    {"format": 2, "device": "cpu", "entries": {KEY: ENTRY, ...}}

KEY is `entry_key` (device | backend | Problem.key() | precision | T<bucket>); the sequence-length
bucket of T is the next power of two >= T (`seq_bucket`). An ENTRY (`make_entry`) holds the
tuned variant, the render sha256 of that variant for its Problem, the gdngen and framework
versions, median fwd+bwd times of the tuned and the default variant, the worst validation error,
trial counts and the date.

Reading never fails: a corrupt file (or entry) is reported once with a `TunedCacheWarning` and
skipped, and so is a file of another format version (format 1 files predate the typed variant
configs: their params are not read under the new names); an entry whose sha256 or versions differ
from this installation is ignored, with one warning when a lookup first consults it. Parsed files
are kept in memory keyed by (mtime, size, inode), so a lookup is a few ``stat`` calls. Writes
(`write_entry`) merge one entry under a file lock and replace the file atomically, so concurrent
tuners lose nothing. The lock lives in this host's cache root: tuners on several hosts each write
their own user cache, and `merge_files` (``gdngen merge``) folds copies of other hosts' files in
(per key, the entry that saw more of its study wins).
"""

from __future__ import annotations

import datetime
import functools
import importlib.metadata
import json
import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path

from gdngen import settings
from gdngen.fileio import atomic_write_bytes, atomic_write_text  # noqa: F401 (re-exported)
from gdngen.problem import Problem
from gdngen.variant import Variant, dumps

#: 2: typed variant configs (metal's ``policy``/``save`` became ``precision``/``save_states``).
FORMAT = 2
ENV_CACHE_DIR = settings.ENV_CACHE_DIR
#: packages whose versions an entry records, per framework.
FRAMEWORK_PACKAGES = {"jax": ("jax", "jaxlib"), "mlx": ("mlx",)}
_ENTRY_FIELDS = ("key", "device", "framework", "backend", "problem", "precision", "seq_bucket",
                 "variant", "sha256", "versions", "best_ms", "default_ms")


class TunedCacheWarning(UserWarning):
    """A tuned-cache file or entry was skipped (corrupt, stale source hash, other versions)."""


class CorruptCacheFile(ValueError):
    """A tuned-cache file that is not valid JSON of the expected layout."""


class StaleFormatFile(CorruptCacheFile):
    """A tuned-cache file written by a gdngen with another cache format version."""


# ------------------------------------------------------------------------------ locations


def cache_root() -> Path:
    """gdngen's user cache folder (`gdngen.settings.cache_root`)."""
    return settings.cache_root()


def user_tuned_dir() -> Path:
    """Folder of the user's tuned files (wins over the shipped ones)."""
    return tuned_dirs()[-1]


def shipped_tuned_dir() -> Path | None:
    from gdngen.resources import tuned_dir

    try:
        return tuned_dir()
    except FileNotFoundError:
        return None


def tuned_dirs() -> list[Path]:
    """Folders read by lookups, lowest precedence first: shipped, then the user's."""
    return list(_dirs(shipped_tuned_dir(), cache_root()))


@functools.lru_cache(maxsize=16)
def _dirs(shipped: Path | None, root: Path) -> tuple[Path, ...]:
    """`tuned_dirs` per (shipped folder, cache root): a decode-length dispatch asks per call."""
    return ((shipped,) if shipped is not None else ()) + (root / "tuned",)


def tuned_file(device: str, directory: str | os.PathLike | None = None) -> Path:
    return Path(directory if directory is not None else user_tuned_dir()) / f"{device}.json"


# ------------------------------------------------------------------------------ keys


def seq_bucket(seq_len: int) -> int:
    """Sequence-length bucket of ``seq_len``: the smallest power of two >= it."""
    if not isinstance(seq_len, int) or isinstance(seq_len, bool) or seq_len < 1:
        raise ValueError(f"seq_len must be a positive int, got {seq_len!r}")
    return 1 << (seq_len - 1).bit_length()


def entry_key(device: str, backend: str, problem: Problem, precision: str, bucket: int) -> str:
    """``cpu|xla|hk16-hv32-dk128-dv128-float32-scalar|ieee|T2048``."""
    return f"{device}|{backend}|{problem.key()}|{precision}|T{bucket}"


@functools.cache
def framework_versions(framework: str) -> dict:
    """Installed versions of ``framework``'s packages (read from metadata, nothing imported)."""
    if framework not in FRAMEWORK_PACKAGES:
        raise ValueError(f"framework must be one of {sorted(FRAMEWORK_PACKAGES)}, "
                         f"got {framework!r}")
    versions = {}
    for package in FRAMEWORK_PACKAGES[framework]:
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            versions[package] = None
    return versions


def current_versions(framework: str) -> dict:
    """``{"gdngen": ..., <framework packages>: ...}`` of this installation."""
    from gdngen._version import __version__

    return {"gdngen": __version__, **framework_versions(framework)}


@functools.lru_cache(maxsize=512)
def _render_sha256(variant_json: str, problem_json: str) -> str:
    from gdngen.render import render

    variant = Variant.from_json(json.loads(variant_json))
    return render(variant, Problem.from_json(json.loads(problem_json))).sha256


def variant_sha256(variant: Variant, problem: Problem) -> str:
    """``gdngen.render.render(variant, problem).sha256``, memoised per process."""
    return _render_sha256(dumps(variant), dumps(problem))


# ------------------------------------------------------------------------------ entries


def make_entry(*, device: str, framework: str, problem: Problem, precision: str, seq_len: int,
               batch: int, variant: Variant, default: Variant, best_s: float, default_s: float,
               worst_error: float, tolerance: float, trials: dict, study: str = "",
               crossover: dict | None = None) -> dict:
    """A cache entry for ``variant`` tuned at ``[batch, seq_len]`` (times in seconds in);
    ``crossover``: the measured recurrent/chunkwise curve (`gdngen.tune.crossover`)."""
    bucket = seq_bucket(seq_len)
    entry = {
        "key": entry_key(device, variant.backend, problem, precision, bucket),
        "device": device,
        "framework": framework,
        "backend": variant.backend,
        "problem": problem.to_json(),
        "precision": precision,
        "seq_bucket": bucket,
        "seq_len": seq_len,
        "batch": batch,
        "variant": variant.to_json(),
        "default_variant": default.to_json(),
        "sha256": variant_sha256(variant, problem),
        "versions": current_versions(framework),
        "best_ms": best_s * 1e3,
        "default_ms": default_s * 1e3,
        "speedup": default_s / best_s,
        "worst_error": worst_error,
        "tolerance": tolerance,
        "trials": dict(trials),
        "study": study,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }
    if crossover is not None:
        entry["crossover"] = crossover
    return entry


def _check_entry(key: str, entry) -> None:
    """CorruptCacheFile unless ``entry`` has the fields a lookup reads, of usable types."""
    if not isinstance(entry, dict):
        raise CorruptCacheFile(f"entry {key!r} is not an object")
    missing = [f for f in _ENTRY_FIELDS if f not in entry]
    if missing:
        raise CorruptCacheFile(f"entry {key!r} lacks {missing}")
    try:
        problem = Problem.from_json(entry["problem"])
        Variant.from_json(entry["variant"])
        float(entry["best_ms"]), float(entry["default_ms"])
    except (TypeError, ValueError, KeyError, AttributeError) as e:
        raise CorruptCacheFile(f"entry {key!r}: {e}") from None
    expected = entry_key(entry["device"], entry["backend"], problem, entry["precision"],
                         entry["seq_bucket"])
    if key != expected or entry["key"] != key:
        raise CorruptCacheFile(f"entry {key!r} does not match its own fields ({expected!r})")


def parse(text: str, path: str | os.PathLike = "<text>") -> dict:
    """Entries ``{key: entry}`` of a tuned file's text; CorruptCacheFile if it is not one."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise CorruptCacheFile(f"{path}: not JSON ({e})") from None
    if isinstance(data, dict) and isinstance(data.get("format"), int) \
            and data["format"] != FORMAT:
        raise StaleFormatFile(f"{path}: cache format {data['format']}, this gdngen reads format "
                              f"{FORMAT}; its entries are ignored (re-run gdngen tune)")
    if not isinstance(data, dict) or data.get("format") != FORMAT \
            or not isinstance(data.get("entries"), dict):
        raise CorruptCacheFile(f"{path}: expected {{'format': {FORMAT}, 'entries': {{...}}}}")
    for key, entry in data["entries"].items():
        try:
            _check_entry(key, entry)
        except CorruptCacheFile as e:
            raise CorruptCacheFile(f"{path}: {e}") from None
    return data["entries"]


_warned: set = set()
_parsed: dict = {}  # path -> ((mtime_ns, size, ino), entries)
_loaded: dict = {}  # (device, paths) -> (stamps, Loaded)
_writes = [0]  # tuned files written by this process (`writes`)


def writes() -> int:
    """How many times this process has written a tuned file (`write_entry`, `merge_files`): a
    memo of what the files say is stale when this changed since it was made."""
    return _writes[0]


def clear_memo() -> None:
    """Forget parsed files and issued warnings (the next lookup re-reads and re-warns)."""
    _warned.clear()
    _parsed.clear()
    _loaded.clear()
    _render_sha256.cache_clear()


def _warn_once(token, message: str) -> None:
    if token not in _warned:
        _warned.add(token)
        warnings.warn(message, TunedCacheWarning, stacklevel=3)


def _stamp(path: Path):
    """(mtime_ns, size, inode) of ``path``, None if it cannot be stat'ed."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_mtime_ns, st.st_size, st.st_ino)


def load_file(path: str | os.PathLike) -> dict:
    """Entries of one tuned file; {} if it is missing, and {} with one `TunedCacheWarning` per
    file version if it is corrupt. Memoised by (mtime, size, inode)."""
    path = Path(path)
    stamp = _stamp(path)
    if stamp is None:
        _parsed.pop(str(path), None)
        return {}
    cached = _parsed.get(str(path))
    if cached is not None and cached[0] == stamp:
        return cached[1]
    try:
        entries = parse(path.read_text(), path)
    except StaleFormatFile as e:
        _warn_once(("stale", str(path), stamp), f"skipping stale tuned cache file: {e}")
        entries = {}
    except (CorruptCacheFile, OSError, UnicodeDecodeError) as e:
        _warn_once(("corrupt", str(path), stamp), f"skipping corrupt tuned cache file: {e}")
        entries = {}
    _parsed[str(path)] = (stamp, entries)
    return entries


def stale_reason(entry: dict) -> str | None:
    """Why ``entry`` cannot be used here (source hash or versions differ), or None."""
    have = current_versions(entry["framework"]) if entry["framework"] in FRAMEWORK_PACKAGES \
        else None
    if have is None:
        return f"unknown framework {entry['framework']!r}"
    recorded = entry["versions"] if isinstance(entry["versions"], dict) else {}
    diffs = [f"{pkg} {recorded.get(pkg)} (now {ver})" for pkg, ver in have.items()
             if recorded.get(pkg) != ver]
    if diffs:
        return "tuned with " + ", ".join(diffs)
    try:
        sha = variant_sha256(Variant.from_json(entry["variant"]),
                             Problem.from_json(entry["problem"]))
    except (ValueError, ImportError, OSError) as e:
        return f"cannot render the variant here ({e})"
    if sha != entry["sha256"]:
        return f"source changed (render sha256 {entry['sha256'][:12]} -> {sha[:12]})"
    return None


@dataclass
class Loaded:
    """Usable entries of one device (``entries``: key -> entry, ``paths``: key -> file) and the
    ignored ones (``ignored``: key -> reason)."""

    entries: dict = field(default_factory=dict)
    paths: dict = field(default_factory=dict)
    ignored: dict = field(default_factory=dict)


def file_stamps(device: str, dirs=None) -> tuple:
    """The stat stamps of ``device``'s tuned files (a change in any means: look again)."""
    return tuple(_stamp(path) for path in _tuned_paths(
        device, tuple(tuned_dirs() if dirs is None else dirs)))


@functools.lru_cache(maxsize=64)
def _tuned_paths(device: str, dirs: tuple) -> tuple:
    return tuple(str(tuned_file(device, d)) for d in dirs)


def load(device: str, dirs=None) -> Loaded:
    """Entries of ``device`` from ``dirs`` (default `tuned_dirs`; later folders win). Stale
    entries go to ``ignored`` (`lookup` warns about those it consults). Memoised by the
    files' (mtime, size, inode): an unchanged cache costs one ``stat`` per folder."""
    paths = [tuned_file(device, d) for d in (tuned_dirs() if dirs is None else dirs)]
    memo_key = (device, tuple(str(p) for p in paths))
    stamps = tuple(_stamp(p) for p in paths)
    cached = _loaded.get(memo_key)
    if cached is not None and cached[0] == stamps:
        return cached[1]
    loaded = Loaded()
    for path in paths:
        for key, entry in load_file(path).items():
            reason = stale_reason(entry)
            if reason is not None:
                loaded.ignored[key] = f"{reason} [{path}]"
                continue
            loaded.entries[key] = entry
            loaded.paths[key] = path
            loaded.ignored.pop(key, None)
    _loaded[memo_key] = (stamps, loaded)
    return loaded


# ------------------------------------------------------------------------------ writing


def _lock_path(path: Path) -> Path:
    # Locks live in the cache root, not beside the file, so the shipped tuned/ folder stays clean.
    import hashlib

    digest = hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:20]
    return cache_root() / "locks" / f"{path.name}.{digest}.lock"


def write_entry(entry: dict, directory: str | os.PathLike | None = None) -> Path:
    """Merge ``entry`` into ``<directory>/<device>.json`` (default the user's tuned folder)
    under a file lock, replacing the file atomically; returns its path. A corrupt existing file
    is moved aside to ``<name>.corrupt`` (with a warning) and a fresh one started."""
    _check_entry(entry.get("key", ""), entry)
    path, _ = _merge_into(entry["device"], [entry], directory, lambda new, old: True)
    return path


def _fuller(new: dict, old: dict) -> bool:
    """Whether ``new`` should replace ``old``: an entry this host can use beats a stale one
    (`stale_reason`: a source or version changed since it was tuned), then the one that saw
    more of its study (more trials run), then the newer."""
    def rank(e):
        return (stale_reason(e) is None, int((e.get("trials") or {}).get("run", 0)),
                str(e.get("date", "")))

    return rank(new) > rank(old)


def merge_files(paths, directory: str | os.PathLike | None = None) -> dict:
    """Merge the tuned files ``paths`` (e.g. copied from other hosts that tuned shared studies)
    into ``<directory>/<device>.json`` (default the user's tuned folder), locked and atomic as
    `write_entry`: per key an incoming entry replaces the present one if the present one is
    stale here and the incoming one is not, else only if it saw more of its study (more trials
    run, then a newer date). Returns ``{"taken": [...], "kept": [...]}``
    (keys); CorruptCacheFile for a source that is not a tuned file of this format."""
    by_device: dict = {}
    for source in paths:
        source = Path(source)
        for entry in parse(source.read_text(), source).values():
            by_device.setdefault(entry["device"], []).append(entry)
    taken, kept = [], []
    for device, entries in sorted(by_device.items()):
        _, took = _merge_into(device, entries, directory, _fuller)
        taken += took
        kept += [e["key"] for e in entries if e["key"] not in took]
    return {"taken": sorted(set(taken)), "kept": sorted(set(kept) - set(taken))}


def _merge_into(device: str, incoming, directory, prefer) -> tuple[Path, list]:
    """Put each of ``incoming`` in the device's tuned file where its key is absent or
    ``prefer(new, old)``, under the file's lock; (path, keys written)."""
    from filelock import FileLock

    path = tuned_file(device, directory)
    lock = _lock_path(path)
    lock.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(lock)):
        entries = {}
        if path.exists():
            try:
                entries = parse(path.read_text(), path)
            except (CorruptCacheFile, UnicodeDecodeError) as e:
                aside = path.with_name(path.name + (".stale" if isinstance(e, StaleFormatFile)
                                                    else ".corrupt"))
                os.replace(path, aside)
                warnings.warn(f"moved unreadable tuned cache file to {aside}: {e}",
                              TunedCacheWarning, stacklevel=3)
        written = []
        for entry in incoming:
            old = entries.get(entry["key"])
            if old is None or prefer(entry, old):
                entries[entry["key"]] = entry
                written.append(entry["key"])
        data = {"format": FORMAT, "device": device,
                "entries": {k: entries[k] for k in sorted(entries)}}
        atomic_write_text(path, json.dumps(data, indent=1, sort_keys=True) + "\n")
        _writes[0] += 1
    return path, written


# ------------------------------------------------------------------------------ lookup


@dataclass
class Lookup:
    """Result of `lookup`: the chosen entry (None: nothing usable) and why."""

    entry: dict | None
    path: Path | None
    reason: str


def lookup(device: str, backends, problem: Problem, precision: str, seq_len: int,
           dirs=None) -> Lookup:
    """The fastest usable entry for ``problem`` at ``seq_len``'s bucket among ``backends``.

    A call shorter than every tuned bucket of ``problem`` (decode, short prefill) uses the
    smallest tuned bucket's entry: its variant's tuned ``recurrent_below`` (the crossover the
    tuner measured, `gdngen.tune.crossover`) decides whether the recurrent kernel runs."""
    bucket = seq_bucket(seq_len)
    loaded = load(device, dirs)
    keys = [entry_key(device, b, problem, precision, bucket) for b in backends]
    found = [loaded.entries[k] for k in keys if k in loaded.entries]
    if found:
        return _best_of(found, loaded)
    stale = [f"{k}: {loaded.ignored[k]}" for k in keys if k in loaded.ignored]
    for text in stale:
        _warn_once(("stale", text), f"ignoring tuned entry {text}; re-run gdngen tune")
    if stale:
        return Lookup(None, None, "tuned entry ignored (" + "; ".join(stale) + ")")
    prefix = f"{device}|"
    same_problem = sorted({e["seq_bucket"] for e in loaded.entries.values()
                           if e["key"].startswith(prefix) and e["backend"] in backends
                           and e["problem"] == problem.to_json()
                           and e["precision"] == precision})
    if same_problem and bucket < same_problem[0]:
        keys = [entry_key(device, b, problem, precision, same_problem[0]) for b in backends]
        return _best_of([loaded.entries[k] for k in keys if k in loaded.entries], loaded,
                        f"; T={seq_len} is below every tuned bucket, so the smallest one's")
    where = f"T bucket {bucket}" + (f"; tuned buckets: {same_problem}" if same_problem else "")
    return Lookup(None, None, f"no tuned entry for {device}/{problem.key()}/{precision} "
                              f"({where})")


def _best_of(found: list, loaded, why: str = "") -> Lookup:
    best = min(found, key=lambda e: float(e["best_ms"]))
    return Lookup(best, loaded.paths[best["key"]],
                  f"tuned entry {best['key']} ({float(best['speedup']):.2f}x vs default at "
                  f"T={best['seq_len']}, tuned {best['date']}{why})")


# ------------------------------------------------------------------------------ listing


def describe(device: str, dirs=None) -> list[dict]:
    """Every entry of ``device`` in ``dirs`` (default `tuned_dirs`), with its file and status:
    "active", "overridden" (a later folder has the same key) or "ignored: <reason>"."""
    loaded = load(device, dirs)
    rows = []
    for directory in (tuned_dirs() if dirs is None else dirs):
        path = tuned_file(device, directory)
        for key, entry in sorted(load_file(path).items()):
            reason = stale_reason(entry)
            if reason is not None:
                status = f"ignored: {reason}"
            else:
                status = "active" if loaded.paths.get(key) == path else "overridden"
            variant = Variant.from_json(entry["variant"])
            rows.append({"key": key, "file": str(path), "status": status,
                         "variant": variant.name(),
                         "recurrent_below": variant.get("recurrent_below"),
                         "crossover_tuned": bool(entry.get("crossover")),
                         "best_ms": entry["best_ms"], "default_ms": entry["default_ms"],
                         "speedup": float(entry["default_ms"]) / float(entry["best_ms"]),
                         "worst_error": entry.get("worst_error"), "date": entry.get("date")})
    return rows


def format_rows(rows: list[dict]) -> str:
    """``gdngen show`` table of `describe` rows."""
    from gdngen.tables import render_table

    cells = [(r["key"], r["variant"], f"{r['best_ms']:.1f}", f"{r['default_ms']:.1f}",
              f"{r['speedup']:.2f}x", "-" if r["worst_error"] is None else
              f"{r['worst_error']:.1e}", _recurrent_cell(r), str(r["date"]), r["status"],
              r["file"]) for r in rows]
    return render_table("gdngen tuned cache", ("key", "variant", "best ms", "default ms",
                                               "speedup", "worst err", "recurrent T <", "date",
                                               "status", "file"),
                        cells, width=240)


def _recurrent_cell(row: dict) -> str:
    """``gdngen show``'s crossover column: the variant's recurrent_below, tuned or default."""
    if row.get("recurrent_below") is None:
        return "-"
    return f"{row['recurrent_below']} ({'tuned' if row['crossover_tuned'] else 'default'})"
