"""Backends: one module per execution target. Each exposes ``runner`` (see docs/CONTRACT.md).

A backend that generates kernels (pallas_tpu, pallas_gpu, metal, ...) registers here the module
holding its battery runner; generated-kernel backends that share a framework's entry point reuse
its runner.
"""

from __future__ import annotations

import importlib

#: backend name -> module whose ``runner`` validates it on the battery.
RUNNERS = {"xla": "gdngen.backends.xla", "mlx": "gdngen.backends.mlx",
           "pallas_tpu": "gdngen.backends.xla", "pallas_gpu": "gdngen.backends.xla",
           "metal": "gdngen.backends.metal",
           "ffi_cpu": "gdngen.backends.xla"}

#: backends that implement vector gates ([B,T,Hv,Dk]); the others are scalar-gate only.
VECTOR_GATE_BACKENDS = ("xla", "mlx")


def get_runner(name: str):
    """Return the battery runner of backend ``name`` (imports its framework lazily)."""
    if name not in RUNNERS:
        raise ValueError(f"backend must be one of {sorted(RUNNERS)}, got {name!r}")
    return importlib.import_module(RUNNERS[name]).runner
