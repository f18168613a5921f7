"""Device registry: target names, the backends each can run, and their on-chip memory limits.

One table, `DEVICES`; each limit names its source. Detection of the attached device lives in
`detect` (filled in by the tuner).
"""

from __future__ import annotations

from dataclasses import dataclass, field

KiB, MiB = 1024, 1024 * 1024


@dataclass(frozen=True)
class Device:
    """A tuning target. ``limits`` holds on-chip memory budgets in bytes (``vmem`` for TPUs,
    ``threadgroup_memory`` for Apple GPUs, ``shared_memory`` per block for NVIDIA)."""

    name: str
    kind: str  # "cpu" | "tpu" | "gpu" | "apple"
    backends: tuple
    limits: dict = field(default_factory=dict)
    source: str = ""


# VMEM per TensorCore: v4 16 MiB, v5e 128 MiB, v5p 95 MiB, v6e 128 MiB (Pallas TPU docs,
# "TPU memory spaces" / jax.experimental.pallas.tpu; Mosaic's default scoped-VMEM limit is
# lower, 16-32 MiB, so variants are planned against `vmem_budget`).
# Apple GPUs: 32 KiB threadgroup memory per threadgroup (Metal feature set tables, all families).
# NVIDIA: 227 KiB shared memory per block on Hopper (H100/H200), 163 KiB on A100 (CUDA guide).
DEVICES: dict[str, Device] = {
    d.name: d for d in (
        Device("cpu", "cpu", ("xla", "mlx")),
        Device("tpu-v4", "tpu", ("xla", "pallas_tpu"),
               {"vmem": 16 * MiB, "vmem_budget": 16 * MiB}, "Pallas TPU docs"),
        Device("tpu-v5e", "tpu", ("xla", "pallas_tpu"),
               {"vmem": 128 * MiB, "vmem_budget": 32 * MiB}, "Pallas TPU docs"),
        Device("tpu-v5p", "tpu", ("xla", "pallas_tpu"),
               {"vmem": 95 * MiB, "vmem_budget": 32 * MiB}, "Pallas TPU docs"),
        Device("tpu-v6e", "tpu", ("xla", "pallas_tpu"),
               {"vmem": 128 * MiB, "vmem_budget": 32 * MiB}, "Pallas TPU docs"),
        Device("a100", "gpu", ("xla", "pallas_gpu"), {"shared_memory": 163 * KiB},
               "CUDA programming guide, compute capability 8.0"),
        Device("h100", "gpu", ("xla", "pallas_gpu"), {"shared_memory": 227 * KiB},
               "CUDA programming guide, compute capability 9.0"),
        Device("h200", "gpu", ("xla", "pallas_gpu"), {"shared_memory": 227 * KiB},
               "CUDA programming guide, compute capability 9.0"),
        *(Device(f"apple-m{i}", "apple", ("mlx", "metal"), {"threadgroup_memory": 32 * KiB},
                 "Metal feature set tables") for i in range(1, 6)),
    )
}


def get_device(name: str) -> Device:
    """The registered device ``name``; ValueError listing the known names otherwise."""
    if name not in DEVICES:
        raise ValueError(f"device must be one of {sorted(DEVICES)}, got {name!r}")
    return DEVICES[name]
