"""Tuned cache: keys and buckets, user-over-shipped precedence, locked atomic writes under
concurrent writers, corrupt files and stale entries skipped with exactly one warning."""

from __future__ import annotations

import json
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
from click.testing import CliRunner

from gdngen import cache
from gdngen.problem import Problem
from gdngen.registry import default_variant
from gdngen.tools.cli import main
from gdngen.variant import Variant

ROOT = Path(__file__).resolve().parent.parent
PROBLEM = Problem(1, 2, 16, 16)


@pytest.fixture(autouse=True)
def isolated(tmp_path, monkeypatch):
    """Own cache root and an empty 'shipped' folder; memo cleared before and after."""
    monkeypatch.setenv("GDNGEN_CACHE_DIR", str(tmp_path / "root"))
    shipped = tmp_path / "shipped"
    shipped.mkdir()
    monkeypatch.setattr(cache, "shipped_tuned_dir", lambda: shipped)
    cache.clear_memo()
    yield shipped
    cache.clear_memo()


def entry(seq_len=64, chunk=16, best_s=0.01, device="cpu", problem=PROBLEM, backend="mlx"):
    framework = "mlx" if backend == "mlx" else "jax"
    variant = Variant(backend, {"chunk_size": chunk, "solve_block": 8, "save_states": False})
    return cache.make_entry(device=device, framework=framework, problem=problem,
                            precision="ieee", seq_len=seq_len, batch=1, variant=variant,
                            default=default_variant(backend, problem), best_s=best_s,
                            default_s=0.02, worst_error=1e-7, tolerance=5e-5,
                            trials={"run": 3, "failed": 0, "infeasible": 0, "skipped": 0})


def test_seq_bucket_is_next_power_of_two():
    assert [cache.seq_bucket(t) for t in (1, 2, 3, 64, 65, 2000, 2048, 2049)] == \
        [1, 2, 4, 64, 128, 2048, 2048, 4096]
    for bad in (0, -3, 2.0, True):
        with pytest.raises(ValueError, match="seq_len"):
            cache.seq_bucket(bad)


def test_entry_records_key_hash_versions_and_times():
    e = entry(seq_len=50)
    assert e["key"] == "cpu|mlx|hk1-hv2-dk16-dv16-float32-scalar|ieee|T64"
    assert e["seq_bucket"] == 64 and e["seq_len"] == 50
    from gdngen.render import render

    assert e["sha256"] == render(Variant.from_json(e["variant"]), PROBLEM).sha256
    assert set(e["versions"]) == {"gdngen", "mlx"} and e["versions"]["mlx"]
    assert e["best_ms"] == pytest.approx(10.0) and e["speedup"] == pytest.approx(2.0)
    assert cache.stale_reason(e) is None


def test_write_then_lookup_user_dir_wins_over_shipped(isolated):
    shipped = isolated
    cache.write_entry(entry(chunk=32), shipped)
    path = cache.write_entry(entry(chunk=16))
    assert path == cache.user_tuned_dir() / "cpu.json"
    found = cache.lookup("cpu", ("mlx",), PROBLEM, "ieee", 60)
    assert found.entry["variant"]["params"]["chunk_size"] == 16 and found.path == path
    assert [r["status"] for r in cache.describe("cpu")] == ["overridden", "active"]
    missing = cache.lookup("cpu", ("mlx",), PROBLEM, "ieee", 100)
    assert missing.entry is None and "T bucket 128" in missing.reason
    assert "tuned buckets: [64]" in missing.reason
    assert cache.lookup("cpu", ("xla",), PROBLEM, "ieee", 60).entry is None


def test_lookup_takes_the_fastest_backend(isolated):
    cache.write_entry(entry(best_s=0.010, backend="mlx"))
    cache.write_entry(entry(best_s=0.005, backend="xla"))
    assert cache.lookup("cpu", ("mlx", "xla"), PROBLEM, "ieee", 64).entry["backend"] == "xla"
    assert cache.lookup("cpu", ("mlx",), PROBLEM, "ieee", 64).entry["backend"] == "mlx"


def test_files_are_replaced_atomically_and_memo_follows_mtime(isolated):
    cache.write_entry(entry(seq_len=64))
    directory = cache.user_tuned_dir()
    assert len(cache.load("cpu").entries) == 1
    cache.write_entry(entry(seq_len=128))
    assert len(cache.load("cpu").entries) == 2  # the memo saw the new file
    assert sorted(p.name for p in directory.iterdir()) == ["cpu.json"]  # no temp files left
    data = json.loads((directory / "cpu.json").read_text())
    assert data["format"] == cache.FORMAT and len(data["entries"]) == 2


WRITER = """
import sys
from gdngen import cache
from gdngen.registry import default_variant
from gdngen.problem import Problem
from gdngen.variant import Variant
writer, count = int(sys.argv[1]), int(sys.argv[2])
problem = Problem(1, 2, 16, 16)
for i in range(count):
    variant = Variant("mlx", {"chunk_size": 16, "solve_block": 8, "save_states": True})
    cache.write_entry(cache.make_entry(
        device="cpu", framework="mlx", problem=problem, precision="ieee",
        seq_len=2 ** (writer * count + i), batch=1, variant=variant,
        default=default_variant("mlx", problem), best_s=0.01, default_s=0.02,
        worst_error=1e-7, tolerance=5e-5, trials={}))
"""


def test_concurrent_writers_lose_nothing(isolated, tmp_path):
    writers, count = 4, 6
    env = {"GDNGEN_CACHE_DIR": str(tmp_path / "root"), "PYTHONPATH": str(ROOT),
           "PATH": "/usr/bin:/bin"}
    procs = [subprocess.Popen([sys.executable, "-c", WRITER, str(w), str(count)], env=env,
                              stderr=subprocess.PIPE, text=True) for w in range(writers)]
    for p in procs:
        assert p.wait(timeout=120) == 0, p.stderr.read()
    data = json.loads((cache.user_tuned_dir() / "cpu.json").read_text())
    assert sorted(e["seq_bucket"] for e in data["entries"].values()) == \
        [2 ** i for i in range(writers * count)]
    assert sorted(p.name for p in cache.user_tuned_dir().iterdir()) == ["cpu.json"]


def test_corrupt_file_is_reported_once_and_skipped(isolated):
    shipped = isolated
    (shipped / "cpu.json").write_text('{"format": 1, "entries": {"x": ')
    cache.write_entry(entry())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = cache.lookup("cpu", ("mlx",), PROBLEM, "ieee", 64)
        second = cache.lookup("cpu", ("mlx",), PROBLEM, "ieee", 64)
    assert first.entry is not None and second.entry is not None  # the other file still works
    corrupt = [w for w in caught if issubclass(w.category, cache.TunedCacheWarning)]
    assert len(corrupt) == 1 and "corrupt" in str(corrupt[0].message)
    assert str(shipped / "cpu.json") in str(corrupt[0].message)


@pytest.mark.parametrize("text", ["not json", "[]", '{"format": 2, "entries": []}',
                                  '{"format": 2, "entries": {"k": {"key": "k"}}}'])
def test_corrupt_layouts_never_raise(isolated, text):
    (isolated / "cpu.json").write_text(text)
    with pytest.warns(cache.TunedCacheWarning, match="corrupt"):
        assert cache.load("cpu").entries == {}


def test_old_format_file_is_stale_with_one_warning(isolated):
    """A format-1 file (metal's params had other names then) is never read, and says so once."""
    old = entry()
    (isolated / "cpu.json").write_text(json.dumps({"format": 1, "device": "cpu",
                                                   "entries": {old["key"]: old}}))
    with pytest.warns(cache.TunedCacheWarning, match="stale.*cache format 1.*re-run gdngen tune"):
        assert cache.load("cpu").entries == {}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert cache.load("cpu").entries == {}  # memoised: no second warning


def test_writing_over_a_corrupt_file_moves_it_aside(isolated):
    path = cache.user_tuned_dir() / "cpu.json"
    path.parent.mkdir(parents=True)
    path.write_text("garbage")
    with pytest.warns(cache.TunedCacheWarning, match="moved unreadable"):
        cache.write_entry(entry())
    assert path.with_name("cpu.json.corrupt").read_text() == "garbage"
    assert len(cache.load("cpu").entries) == 1


@pytest.mark.parametrize("changes, reason", [
    ({"sha256": "0" * 64}, "source changed"),
    ({"versions": {"gdngen": "0.0.1"}}, "tuned with gdngen 0.0.1"),
    ({"versions": {"mlx": "0.1.0"}}, "mlx 0.1.0"),
])
def test_stale_entry_is_ignored_with_one_warning(isolated, changes, reason):
    stale = entry()
    stale["sha256"] = changes.get("sha256", stale["sha256"])
    stale["versions"] = dict(stale["versions"], **changes.get("versions", {}))
    path = cache.user_tuned_dir() / "cpu.json"
    cache.atomic_write_text(path, json.dumps({"format": cache.FORMAT, "device": "cpu",
                                              "entries": {stale["key"]: stale}}))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            found = cache.lookup("cpu", ("mlx",), PROBLEM, "ieee", 64)
            assert found.entry is None and reason in found.reason
    ours = [w for w in caught if issubclass(w.category, cache.TunedCacheWarning)]
    assert len(ours) == 1 and reason in str(ours[0].message)
    assert cache.describe("cpu")[0]["status"].startswith("ignored: ")


def test_show_prints_the_cache(isolated):
    cache.write_entry(entry())
    result = CliRunner().invoke(main, ["show", "--device", "cpu", "--json"])
    assert result.exit_code == 0, result.output
    rows = json.loads(result.output)
    assert [r["status"] for r in rows] == ["active"]
    assert rows[0]["variant"] == "mlx[chunk_size=16,save_states=False,solve_block=8]"
    table = CliRunner().invoke(main, ["show", "--device", "cpu"])
    assert "chunk_size=16" in table.output and "2.00x" in table.output
