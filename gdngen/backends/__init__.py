"""Backends: one module per execution target. Each exposes ``runner`` (see docs/CONTRACT.md)."""

from __future__ import annotations

import importlib

BACKENDS = {"xla": "gdngen.backends.xla", "mlx": "gdngen.backends.mlx"}


def get_runner(name: str):
    """Return the battery runner of backend ``name`` (imports its framework lazily)."""
    if name not in BACKENDS:
        raise ValueError(f"backend must be one of {sorted(BACKENDS)}, got {name!r}")
    return importlib.import_module(BACKENDS[name]).runner
