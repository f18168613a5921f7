"""Build hook: ship the repo-root ``tuned/`` folder inside the package.

Everything else is declared in pyproject.toml (the backends' templates are package data). A
regular (non-editable) build copies ``tuned/**`` into ``<build_lib>/gdngen/tuned``, so wheels
carry it; editable installs read the repo-root folder directly (see ``gdngen/resources.py``).
"""

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py as _build_py

ROOT = Path(__file__).resolve().parent
DATA_DIRS = ("tuned",)
IGNORE = shutil.ignore_patterns("__pycache__", "*.pyc", ".*")


class build_py(_build_py):
    """``build_py`` that also copies the repo-root data folders into ``gdngen/``."""

    def run(self):
        super().run()
        if getattr(self, "editable_mode", False):
            return
        for name in DATA_DIRS:
            src = ROOT / name
            if not src.is_dir():
                raise FileNotFoundError(f"{src} is missing: it must be shipped in the wheel")
            dst = Path(self.build_lib) / "gdngen" / name
            shutil.rmtree(dst, ignore_errors=True)  # no stale files from an earlier build
            shutil.copytree(src, dst, ignore=IGNORE)


setup(cmdclass={"build_py": build_py})
