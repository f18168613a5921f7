"""Where the shipped data is: each templated backend's Jinja sources (in its own folder, beside
its code) and the tuned configurations.

A wheel carries the tuned configurations as ``gdngen/tuned/`` (copied there by setup.py); an
editable or source-tree checkout has them at the repository root (``tuned/``). The templates
are package data of their backend's package in both.
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


@functools.cache
def template_folders() -> dict[str, Path]:
    """Backend name -> the folder of its Jinja sources, which sits beside its code:
    ``gdngen/backends/<path>/templates/`` for the backend ``<path>`` with "/" read as "_"
    (``backends/pallas/tpu/templates`` holds pallas_tpu's). Template names are
    ``<backend>/<file>`` (`gdngen.sources.environment`)."""
    backends = _PACKAGE / "backends"
    return {"_".join(folder.parent.relative_to(backends).parts): folder
            for folder in sorted(backends.rglob("templates")) if folder.is_dir()}


def templates_dir(backend: str) -> Path:
    """The folder of ``backend``'s shipped Jinja sources (`template_folders`)."""
    folders = template_folders()
    if backend not in folders:
        raise ValueError(f"backend must be one of {sorted(folders)} (the templated backends), "
                         f"got {backend!r}")
    return folders[backend]


def tuned_dir() -> Path:
    """Folder of the shipped tuned configurations (one JSON per device kind).

    The installed copy inside the package if present (treat it as read-only), else the
    repo-root ``tuned/``.
    """
    return _data_dir("tuned")
