"""ffi_cpu's variant parameters: the `Config` dataclass, the values each parameter takes, this
host's vector width, the untuned defaults (measured where they are set) and the tolerances."""

from __future__ import annotations

import functools
from dataclasses import dataclass

from gdngen.config import VECTOR_CHUNK, VariantConfig, recurrent_switch
from gdngen.problem import Problem

BACKEND = "ffi_cpu"
CHUNK_SIZES = (32, 64, 128)
ROW_BLOCKS = (4, 6)
#: columns per register panel of the matmul kernel (row_block x panel float32 accumulators):
#: 64 fills AVX-512's 32 vector registers, 16 AVX2's 16 (a wider panel spills there).
PANELS = (16, 32, 64)
#: floats per vector of the matmul and dot kernels: 16 for AVX-512 registers, 8 for AVX2 (a
#: 16-float vector on an AVX2 host is split in two by the compiler, and spills).
VECTOR_FLOATS = (8, 16)
INPUT_DTYPES = ("float32", "bfloat16", "float16")

#: relative L2 error per precision policy: the kernels compute in float32 under every policy
#: (worst measured 9.7e-7, dbeta / identical_keys; per-channel gates 1.4e-6, dbeta /
#: vector_identical_keys at chunk 128, tests/backends/ffi_cpu/test_ffi_cpu_channel.py).
TOLERANCES = {"ieee": 5e-5, "tf32": 5e-5, "bf16": 5e-5}

#: untuned crossover T (`gdngen.config.recurrent_switch`), measured on this 2-core AVX2 host
#: at B=1, Hk=16, Hv=32, Dk=Dv=128, the forward with a state, on a quiet machine: the recurrent
#: kernel's 0.73 / 1.7 / 4.7 / 9.4 / 20.1 ms at T = 1 / 16 / 64 / 128 / 256 against the chunk
#: kernels' 5.6 / 6.4 / 5.1 / 9.4 / 17.0 ms (equal at 128, slower from 256)
RECURRENT_BELOW = 128

#: default chunk of per-channel gates (the portable path's, `gdngen.config.VECTOR_CHUNK`):
#: measured fwd+bwd at B=1, Hk=4, Hv=8, Dk=Dv=128, T=2048 on the 2-core AVX-512 host (shared,
#: load ~5): chunk 32 / 64 / 128 in 344 / 401 / 627 ms (medians of 5)
VECTOR_CHUNK_SIZE = VECTOR_CHUNK

#: untuned crossover T of per-channel gates: measured forward with a state at B=1, Hk=16,
#: Hv=32, Dk=Dv=128 on the same host (shared, load ~4.5; medians of 11), the per-channel
#: recurrent kernel's 7.9 / 8.0 / 14.5 / 20.0 / 22.4 ms at T = 16 / 24 / 32 / 48 / 64 against
#: the chunk kernels' (chunk 32) 8.2 / 8.2 / 11.9 / 17.9 / 16.4 ms (equal near 24, slower from 32)
VECTOR_RECURRENT_BELOW = 32


def padded(dim: int) -> int:
    """``dim`` rounded up to whole 16-float vectors."""
    return -(-dim // 16) * 16


def untuned_recurrent_below(problem: Problem) -> int:
    """The untuned ``recurrent_below`` of ``problem``'s gate kind."""
    return VECTOR_RECURRENT_BELOW if problem.gate == "vector" else RECURRENT_BELOW


@dataclass(frozen=True)
class Config(VariantConfig):
    """``chunk_size``: steps per chunk; ``row_block`` / ``panel``: output rows / columns per
    register block of the matmul kernel; ``vector_floats``: floats per vector register."""

    backend = BACKEND
    chunk_size: int = 64
    panel: int = 64
    row_block: int = 6
    vector_floats: int = 16
    recurrent_below: int = recurrent_switch(RECURRENT_BELOW)

    def check(self) -> None:
        self.check_count("recurrent_below")
        self.check_choice("chunk_size", CHUNK_SIZES)
        self.check_choice("panel", PANELS)
        self.check_choice("row_block", ROW_BLOCKS)
        self.check_choice("vector_floats", VECTOR_FLOATS)  # every panel holds whole vectors


@functools.cache
def host_vector_bits() -> int:
    """Widest float vector registers of this host: 512 with AVX-512F, 256 with AVX/AVX2, else
    128 (read from /proc/cpuinfo; 128 where it cannot be read)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "").split()
    except OSError:
        return 128
    return 512 if "avx512f" in flags else 256 if "avx" in flags else 128


def host_vector_floats() -> int:
    """The `VECTOR_FLOATS` entry of this host: 16 with AVX-512, else 8."""
    return 16 if host_vector_bits() >= 512 else 8
