"""XLA's temp bytes of a long prefill's forward with the output's gated norm, compiled for a TPU
or an NVIDIA GPU with its real compiler (no chip needed; `gdngen.compilers`): the chunk
forward's norm build (the norm in the walk's stores, the output in the call's layout) against
the same variant with the norm after the kernels (`norm_in_stores` patched off), side by side.
The program is `gdngen.compilers`' ``fused_chunk_forward`` (qk_norm, softplus gate,
norm_weight / output_gate; B = 1). One JSON line per (T, build).

    python benchmarks/bench_compile_norm.py DEVICE HK,HV,DK,DV,DTYPE[,GATE] T[,T...] [VARIANT]
    python benchmarks/bench_compile_norm.py --fwd-bwd DEVICE HK,HV,DK,DV,DTYPE T[,T...] [VARIANT]

``--fwd-bwd``: the training program instead (``fused_fwd_bwd``: the same call differentiated),
the chunk core's forward convolving in its kernel's loads (`differentiated_conv`, pallas_tpu's
scalar gates) against the same variant with the conv before its kernels (patched off).

DEVICE: tpu-v5e, tpu-v7x, h100, ...; GATE: scalar (default) or vector; VARIANT: a JSON
object of parameter overrides of the device's default variant (e.g. ``'{"bv": 128}'`` for
pallas_gpu at D = 128). The variant must hold a head's whole Dv (pallas_tpu ``dv_tile``,
pallas_gpu ``bv``), else it has no norm build.
"""

import json
import sys

from gdngen import devices, registry
from gdngen.backends.pallas.backend import PallasBackend
from gdngen.compilers import compiling
from gdngen.problem import Problem


def main(argv):
    if argv and argv[0] == "--fwd-bwd":
        fwd_bwd(argv[1:])
        return
    device, spec, steps = argv[0], argv[1], [int(t) for t in argv[2].split(",")]
    overrides = json.loads(argv[3]) if len(argv) > 3 else {}
    hk, hv, dk, dv, dtype, *gate = spec.split(",")
    problem = Problem(int(hk), int(hv), int(dk), int(dv), dtype, gate[0] if gate else "scalar")
    backend = "pallas_tpu" if devices.get_device(device).kind == "tpu" else "pallas_gpu"
    spec_ = registry.get(backend)
    variant = registry.default_variant(backend, problem, device).replace(**overrides)
    if not (spec_.chunk_norm(variant, problem) and spec_.holds_whole_head(variant, problem)):
        raise SystemExit(f"{variant.name()} has no chunk forward norm build for {problem.key()}")
    dev = compiling._check_device(backend, device)
    target = compiling.target_device(dev, backend)
    original = PallasBackend.norm_in_stores
    for T in steps:
        for build in ("norm in the stores", "norm after the kernels"):
            if build == "norm after the kernels":
                PallasBackend.norm_in_stores = lambda self, call, variant: False
            try:
                program = compiling._compile_program("fused_chunk_forward", variant, problem, T,
                                                     target, dev)
            finally:
                PallasBackend.norm_in_stores = original
                spec_.clear_cache()
            print(json.dumps({"device": device, "variant": variant.name(), "T": T,
                              "build": build, "ok": program.ok, "error": program.error,
                              "temp_MiB": round(program.temp_bytes / 2**20, 2),
                              "kernels": [k["name"] for k in program.kernels],
                              "seconds": round(program.seconds, 1)}), flush=True)


def fwd_bwd(argv):
    """``--fwd-bwd``: ``fused_fwd_bwd``'s temp bytes and each kernel's scoped VMEM, the conv
    in the core forward's loads against before its kernels."""
    device, spec, steps = argv[0], argv[1], [int(t) for t in argv[2].split(",")]
    overrides = json.loads(argv[3]) if len(argv) > 3 else {}
    hk, hv, dk, dv, dtype = spec.split(",")
    problem = Problem(int(hk), int(hv), int(dk), int(dv), dtype, "scalar")
    backend = "pallas_tpu" if devices.get_device(device).kind == "tpu" else "pallas_gpu"
    spec_ = registry.get(backend)
    variant = registry.default_variant(backend, problem, device).replace(**overrides)
    if not spec_.differentiated_conv(variant, problem):
        raise SystemExit(f"{backend}'s chunk core does not convolve in its loads")
    dev = compiling._check_device(backend, device)
    target = compiling.target_device(dev, backend)
    original = type(spec_).differentiated_conv
    for T in steps:
        for build in ("conv in the core's loads", "conv before the kernels"):
            if build == "conv before the kernels":
                type(spec_).differentiated_conv = lambda self, variant, problem: False
            try:
                program = compiling._compile_program("fused_fwd_bwd", variant, problem, T,
                                                     target, dev)
            finally:
                type(spec_).differentiated_conv = original
                spec_.clear_cache()
            print(json.dumps({"device": device, "variant": variant.name(), "T": T,
                              "build": build, "ok": program.ok, "error": program.error,
                              "temp_MiB": round(program.temp_bytes / 2**20, 2),
                              "kernels": {k["name"]: k.get("vmem_used") for k in
                                          program.kernels},
                              "seconds": round(program.seconds, 1)}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
