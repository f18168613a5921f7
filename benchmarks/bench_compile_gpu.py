"""Compile pallas_gpu variants for an NVIDIA GPU with its real compiler (XLA GPU + Triton +
ptxas through jax's CUDA plugin, no GPU needed; `gdngen.compilers`): one JSON line per variant
with the compile verdict, the footprint model's shared-memory estimate, each Triton kernel's
shared memory and XLA's HBM temp bytes of the program ("temp"; docs/COMPILE.md).

    python benchmarks/bench_compile_gpu.py DEVICE HK,HV,DK,DV,DTYPE,GATE VARIANTS [T] [DUMP]

VARIANTS: a JSON list of parameter overrides of chunk 16, ieee, 2 stages, 4 warps, 64/64 tiles,
saving states, e.g. ``'[{"chunk_size": 32}]'``; program ``chunk_fwd_bwd`` at T steps (default
64); DUMP: keep XLA's dump (LLVM IR, PTX, thunk sequence) under DUMP/<variant>/.
"""

import json
import sys
import time

from gdngen import compilers
from gdngen.backends.pallas import gpu as pallas_gpu
from gdngen.problem import Problem
from gdngen.variant import Variant

BASE = {"bk": 64, "bv": 64, "chunk_size": 16, "num_stages": 2, "num_warps": 4,
        "precision": "ieee", "save_states": True, "recurrent_below": 64}


def main(argv):
    device, spec, overrides = argv[0], argv[1], json.loads(argv[2])
    T = int(argv[3]) if len(argv) > 3 else 64
    dump = argv[4] if len(argv) > 4 else None
    hk, hv, dk, dv, dtype, gate = spec.split(",")
    problem = Problem(int(hk), int(hv), int(dk), int(dv), dtype, gate)
    for params in overrides:
        variant = Variant("pallas_gpu", dict(BASE, **params))
        start = time.perf_counter()
        report = compilers.compile_variant(
            variant, problem, device, T=T, only=("chunk_fwd_bwd",),
            dump_to=None if dump is None else f"{dump}/{variant.name()}")
        print(json.dumps({"variant": variant.name(), "ok": report.ok,
                          "error": report.first_error(),
                          "predicted": pallas_gpu.shared_memory_bytes(variant, problem),
                          "shared_memory_used": report.shared_memory_used,
                          "temp": report.temp_bytes,
                          "kernels": {k["name"]: k["shared_memory"]
                                      for p in report.programs for k in p.kernels},
                          "seconds": round(time.perf_counter() - start, 1)}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
