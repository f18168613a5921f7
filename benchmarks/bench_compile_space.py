"""Compile every variant of a shape class for a TPU with its real compiler (libtpu, no TPU
needed; `gdngen.compilers`): one JSON line per variant with the compile verdict, the footprint
model's VMEM estimate and the VMEM Mosaic used (docs/COMPILE.md).

    python benchmarks/bench_compile_space.py DEVICE HK,HV,D,DTYPE,GATE [PROGRAMS] [STRIDE] [T]

e.g. ``tpu-v5e 16,32,128,bfloat16,scalar chunk_fwd_bwd 1`` (STRIDE 3: every third variant;
``default``: the default variant only); T the chunk programs' steps (default 256). "temp" is
XLA's HBM temp bytes of the program.
"""

import json
import sys
import time

from gdngen import compilers, registry
from gdngen.backends.pallas import tpu as pallas_tpu
from gdngen.problem import Problem


def main(argv):
    device, spec = argv[0], argv[1]
    only = argv[2].split(",") if len(argv) > 2 else None
    stride = argv[3] if len(argv) > 3 else "1"
    T = int(argv[4]) if len(argv) > 4 else 256
    hk, hv, d, dtype, gate = spec.split(",")
    problem = Problem(int(hk), int(hv), int(d), int(d), dtype, gate)
    space = registry.variants("pallas_tpu", problem, device)
    print(json.dumps({"device": device, "problem": problem.key(), "space": len(space),
                      "stride": stride, "T": T}), flush=True)
    chosen = ([registry.default_variant("pallas_tpu", problem, device)] if stride == "default"
              else space[::int(stride)])
    for variant in chosen:
        start = time.perf_counter()
        report = compilers.compile_variant(variant, problem, device, T=T, only=only)
        limits = [k["vmem_limit"] for p in report.programs for k in p.kernels]
        print(json.dumps({"variant": variant.name(), "ok": report.ok,
                          "error": report.first_error(),
                          "predicted": pallas_tpu.vmem_bytes(variant, problem),
                          "vmem_used": report.vmem_used, "vmem_limit": max(limits, default=0),
                          "temp": report.temp_bytes,
                          "seconds": round(time.perf_counter() - start, 1)}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
