"""Where the shipped data folders are: Jinja templates and tuned configurations.

A wheel carries them as ``gdngen/templates/`` and ``gdngen/tuned/`` (copied there by setup.py);
an editable or source-tree checkout has them at the repository root (``templates/``, ``tuned/``).
"""

from __future__ import annotations

import functools
from pathlib import Path

_PACKAGE = Path(__file__).resolve().parent


@functools.cache
@functools.cache
def _data_dir(name: str) -> Path:
    """The package's data folder ``name`` (found once per process: a decode-length dispatch asks
    for the tuned folder per call)."""
    for candidate in (_PACKAGE / name, _PACKAGE.parent / name):
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError(
        f"gdngen data folder {name!r} not found in {_PACKAGE} or {_PACKAGE.parent}"
    )


def templates_dir() -> Path:
    """Folder of the Jinja sources, one subfolder per backend (``templates/<backend>/``).

    The installed copy inside the package if present, else the repo-root ``templates/``.
    """
    return _data_dir("templates")


def tuned_dir() -> Path:
    """Folder of the shipped tuned configurations (one JSON per device kind).

    The installed copy inside the package if present (treat it as read-only), else the
    repo-root ``tuned/``.
    """
    return _data_dir("tuned")
