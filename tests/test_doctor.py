"""``gdngen doctor``: every section in --json, the attached device, backend availability, stored
first-use verdicts (and unreadable ones), tuned entries active or stale, settings, a failing
section."""

from __future__ import annotations

import json
import os

import pytest
from click.testing import CliRunner

from gdngen import cache, registry
from gdngen.tools import doctor
from gdngen.tools.cli import main

PROBLEM = {"Hk": 2, "Hv": 4, "Dk": 128, "Dv": 128, "dtype": "float32", "gate": "scalar"}


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    """An empty user cache root; no gdngen variable of the caller's environment leaks in."""
    for name in [k for k in os.environ if k.startswith("GDNGEN_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("GDNGEN_CACHE_DIR", str(tmp_path))
    return tmp_path


def _run(*args):
    result = CliRunner().invoke(main, ["doctor", *args])
    assert result.exit_code == 0, result.output
    return result.output


def _verdict(passed: bool, **extra) -> dict:
    return {"backend": "ffi_cpu", "variant": {"backend": "ffi_cpu", "params": {"chunk_size": 64}},
            "problem": PROBLEM, "kind": "vector packed" if not passed else "scalar",
            "passed": passed, "date": "2026-01-02T03:04:05+00:00",
            "worst_error": 1.5e-7 if passed else "nan",
            "worst_case": "long_T" if passed else "reset_gate",
            "worst_quantity": "y" if passed else "dk", "tolerance": 1e-5, "seconds": 0.5,
            **extra}


def _line(text: str, *words) -> str:
    """The one line of ``text`` holding every word of ``words``."""
    found = [line for line in text.splitlines() if all(w in line for w in words)]
    assert len(found) == 1, (words, text)
    return found[0]


def _row(text: str, first: str) -> str:
    """The table row of ``text`` whose first cell is ``first``."""
    found = [line for line in text.splitlines() if line.startswith(f"│ {first} ")]
    assert len(found) == 1, (first, text)
    return found[0]


def test_json_has_every_section(cache_dir):
    report = json.loads(_run("--json"))
    assert tuple(report) == doctor.SECTIONS
    assert not [name for name, section in report.items() if "error" in section], report
    jax_row = next(r for r in report["devices"]["frameworks"] if r["framework"] == "jax")
    assert jax_row["name"] == "cpu" and jax_row["backends"] == ["ffi_cpu", "xla"]
    assert report["host"]["device"] == "cpu"
    assert report["host"]["cache_root"] == str(cache_dir)
    assert [r["backend"] for r in report["backends"]["backends"]] == list(registry.names())
    assert {r["compiler"] for r in report["compilers"]["compilers"]} == {"mosaic", "xla-gpu"}
    assert report["verdicts"]["mode"] == "first-use" and report["verdicts"]["verdicts"] == []
    assert report["environment"]["set"] == {"GDNGEN_CACHE_DIR": str(cache_dir)}


def test_text_names_device_and_ffi_cpu_availability(cache_dir):
    text = _run()
    assert "attached devices" in text
    jax_row = _line(text, "│ jax ", "ffi_cpu, xla")
    assert "│ cpu " in jax_row and "cpu: cpu" in jax_row  # registry name, jax's own words
    ffi = _row(text, "ffi_cpu")
    if registry.get("ffi_cpu").available():
        assert "│ yes " in ffi and "native" in ffi and ("g++" in ffi or "c++" in ffi)
    else:
        assert "│ NO " in ffi
    assert "│ yes " in _row(text, "xla") and "portable" in _row(text, "xla")


def test_ffi_cpu_without_compiler_says_why(cache_dir, monkeypatch):
    monkeypatch.setenv("CXX", "/nonexistent/g++")
    report = json.loads(_run("--json"))
    ffi = next(r for r in report["backends"]["backends"] if r["backend"] == "ffi_cpu")
    assert ffi["available"] is False and "needs a C++ compiler" in ffi["detail"]
    assert "error" in report["versions"]["cxx"]
    assert report["environment"]["set"]["CXX"] == "/nonexistent/g++"
    assert "│ NO " in _row(_run(), "ffi_cpu")
    jax_row = next(r for r in report["devices"]["frameworks"] if r["framework"] == "jax")
    assert jax_row["default"] == "xla"  # no compiler: an untuned call takes the portable path


def test_verdicts_passed_failed_and_unreadable(cache_dir):
    folder = cache_dir / "verdicts" / "cpu"
    folder.mkdir(parents=True)
    (folder / "good.json").write_text(json.dumps(_verdict(True)))
    (folder / "bad.json").write_text(json.dumps(_verdict(False, reason="NaN in dk")))
    (folder / "corrupt.json").write_text("{not json")
    (folder / "partial.json").write_text(json.dumps({"backend": "xla"}))
    (folder / "notes.txt").write_text("not a verdict")

    text = _run("--device", "cpu")
    passed = _line(text, "│ passed ")
    assert "ffi_cpu" in passed and "hk2-hv4-dk128-dv128-float32-scalar" in passed
    assert "1.5e-07 / 1.0e-05" in passed and "long_T (y)" in passed and "good.json" in passed
    failed = _line(text, "│ FAILED ")
    assert "vector packed" in failed and "nan / 1.0e-05" in failed
    assert "reset_gate (dk): NaN in dk" in failed and "bad.json" in failed
    assert text.index("FAILED") < text.index("│ passed ")  # failures first
    assert "1 passed, 1 failed, 2 unreadable" in text
    assert "not JSON" in _line(text, "unreadable: corrupt.json")
    assert "lacks" in _line(text, "unreadable: partial.json")

    section = json.loads(_run("--json", "--device", "cpu"))["verdicts"]
    assert [(v["passed"], v["path"]) for v in section["verdicts"]] == [
        (False, str(folder / "bad.json")), (True, str(folder / "good.json"))]
    assert sorted(u["path"] for u in section["unreadable"]) == [
        str(folder / "corrupt.json"), str(folder / "partial.json")]


def test_validate_mode_and_unknown_variables(cache_dir, monkeypatch):
    monkeypatch.setenv("GDNGEN_VALIDATE", "off")
    monkeypatch.setenv("GDNGEN_NO_TUNED", "1")
    monkeypatch.setenv("GDNGEN_NO_TUNNED", "1")
    text = _run()
    assert "mode off ($GDNGEN_VALIDATE)" in text
    assert "not read by this gdngen" in _line(text, "GDNGEN_NO_TUNNED")
    assert "not read" not in _row(text, "GDNGEN_NO_TUNED")
    assert "GDNGEN_NO_TUNED is set: calls skip the tuned cache" in text


def test_tuned_entries_active_and_stale(cache_dir):
    shipped = cache.tuned_file("cpu", cache.shipped_tuned_dir())
    entries = cache.load_file(shipped)
    assert entries, "the shipped tuned/cpu.json has entries"
    key, entry = min(entries.items())
    stale = dict(entry, versions=dict(entry["versions"], gdngen="0.0.0-old"))
    user = cache_dir / "tuned" / "cpu.json"
    user.parent.mkdir(parents=True)
    user.write_text(json.dumps({"format": cache.FORMAT, "device": "cpu",
                                "entries": {key: stale}}))

    text = _run("--device", "cpu")
    row = _line(text, str(shipped))
    assert f"│ {len(entries)} " in row  # every shipped entry active (the stale copy loses)
    assert [c.strip() for c in _line(text, str(user)).split("│")[2:5]] == ["0", "0", "1"]
    assert "tuned with gdngen 0.0.0-old" in _line(text, f"stale: {key}")

    rows = json.loads(_run("--json", "--device", "cpu"))["tuned"]["rows"]
    status = {(r["file"], r["key"]): r["status"] for r in rows}
    assert status[(str(shipped), key)] == "active"
    assert status[(str(user), key)].startswith("ignored: tuned with gdngen 0.0.0-old")


def test_failing_section_is_recorded(cache_dir, monkeypatch):
    def broken():
        raise OSError("disk on fire")

    monkeypatch.setattr(doctor, "_compilers", broken)
    report = doctor.collect("cpu")
    assert report["compilers"] == {"error": "OSError: disk on fire"}
    assert "error" not in report["backends"]
    text = doctor.format_report(report)
    assert "compilers: error: OSError: disk on fire" in text
    assert "backends" in text


def test_unknown_device_is_a_usage_error(cache_dir):
    result = CliRunner().invoke(main, ["doctor", "--device", "tpu-v99"])
    assert result.exit_code == 2
    assert "device must be one of" in result.output
