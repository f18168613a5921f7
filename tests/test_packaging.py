"""The wheel carries the backends' templates and tuned/ inside the package, and the console
script."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SOURCES = ("pyproject.toml", "setup.py", "MANIFEST.in", "README.md", "gdngen", "tuned")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """Build the wheel offline from a copy of the sources (so no build/ lands in the repo)."""
    pytest.importorskip("build", reason="the dev extra (python -m build) is not installed")
    src = tmp_path_factory.mktemp("src")
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
    for name in SOURCES:
        path = ROOT / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=ignore)
        else:
            shutil.copy2(path, src / name)
    out = tmp_path_factory.mktemp("dist")
    proc = subprocess.run(
        [sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(out),
         str(src)],
        capture_output=True, text=True, check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (whl,) = out.glob("gdngen-*.whl")
    return whl


def _repo_files(folder: str) -> set[str]:
    base = ROOT / folder
    return {
        f"gdngen/{folder}/{p.relative_to(base).as_posix()}"
        for p in base.rglob("*")
        if p.is_file() and "__pycache__" not in p.parts and not p.name.startswith(".")
    }


def test_wheel_carries_templates_and_tuned(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    expected = _repo_files("tuned")
    assert "gdngen/tuned/README.md" in expected
    for folder in ROOT.joinpath("gdngen", "backends").rglob("templates"):
        files = {p.relative_to(ROOT).as_posix() for p in folder.iterdir() if p.is_file()}
        assert any(f.endswith(".j2") for f in files), folder
        expected |= files
    assert expected <= names, sorted(expected - names)
    assert not any(n.startswith(("templates/", "tuned/")) for n in names)


def test_wheel_has_console_script_and_packages(wheel):
    zf = zipfile.ZipFile(wheel)
    names = zf.namelist()
    for module in ("gdngen/__init__.py", "gdngen/__main__.py", "gdngen/tools/cli.py",
                   "gdngen/backends/__init__.py"):
        assert module in names
    (entry_points,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
    text = zf.read(entry_points).decode()
    assert "[console_scripts]" in text
    assert "gdngen = gdngen.tools.cli:main" in text


def test_installed_resources_point_inside_package(wheel, tmp_path):
    """Unpacked wheel: resources resolve to the package copies, not a repo checkout."""
    zipfile.ZipFile(wheel).extractall(tmp_path)
    code = ("import gdngen.resources as r; "
            "print(r.templates_dir('pallas_tpu')); print(r.tuned_dir())")
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                          text=True, check=True, env={"PYTHONPATH": str(tmp_path)})
    templates, tuned = proc.stdout.split()
    assert Path(templates) == tmp_path / "gdngen" / "backends" / "pallas" / "tpu" / "templates"
    assert Path(tuned) == tmp_path / "gdngen" / "tuned"


def test_dev_resources_fall_back_to_repo_root():
    import gdngen
    from gdngen import resources

    if Path(gdngen.__file__).resolve().parent != ROOT / "gdngen":
        pytest.skip("gdngen is imported from an installed (non-editable) copy")
    assert resources.templates_dir("metal") == ROOT / "gdngen" / "backends" / "metal" / "templates"
    assert resources.tuned_dir() == ROOT / "tuned"
