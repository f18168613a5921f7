"""The two records of mlx-lm's rewindable gated-delta cache (`RewindableCache.replay`) side by
side: per request and linear-attention layer, the bytes a verify window's record holds, the
verify call's time, and the time of a trim that keeps part of the window (replay: one mixer
call over the kept steps; per-step states: a slice), at Qwen3-Next's head sizes.

A random Qwen3.5 model of mlx-lm's classes (``--layers`` linear-attention layers, Hk, Hv, D of
``--heads``/``--dim``), patched with ``patch(inference=True)``: a ``--prompt`` prefill, then per
round and design a verify window of W tokens and a trim of each n in 1..W-1, the designs
alternated ``--rounds`` times; medians. Run from the repo root::

    python benchmarks/bench_rewind.py [--windows 4,8] [--rounds 5] [--json]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--windows", default="4,8")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", default="16,32", help="linear-attention Hk,Hv")
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", action="store_true")
    ns = parser.parse_args(argv)
    import mlx.core as mx
    from bench_generate import build
    from mlx_lm.models.cache import make_prompt_cache

    from gdngen.integrations import mlx_lm as integration
    from gdngen.integrations.mlx_lm import rewind

    hk, hv = (int(x) for x in ns.heads.split(","))
    model = build(ns.layers + 1, hk, hv, ns.dim, 1000, 0)  # the last layer: full attention
    tokens = mx.random.randint(0, 1000, (1, ns.prompt + 16), key=mx.random.key(2))
    windows = [int(w) for w in ns.windows.split(",")]
    results = []
    with integration.patched(inference=True):
        cache_class = rewind._rewindable_cache_class()
        prefilled = make_prompt_cache(model)
        mx.eval(model(tokens[:, :ns.prompt], cache=prefilled), [c.state for c in prefilled])
        for W in windows:
            window = tokens[:, ns.prompt:ns.prompt + W]
            times = {d: {"verify": [], "trim": []} for d in ("replay", "states")}
            held = {}
            for round_ in range(ns.rounds + 1):  # round 0 warms up
                for design in ("replay", "states"):
                    cache_class.replay = design == "replay"
                    for n in range(1, W):
                        cache = copy.deepcopy(prefilled)
                        mx.eval([c.state for c in cache])
                        start = time.perf_counter()
                        mx.eval(model(window, cache=cache), [c.state for c in cache])
                        verify = time.perf_counter() - start
                        linear = [c for c in cache if isinstance(c, cache_class)]
                        held[design] = linear[0].recorded_bytes()
                        start = time.perf_counter()
                        for c in linear:
                            c.trim(n)
                        mx.eval([c.state for c in cache])
                        trim = (time.perf_counter() - start) / len(linear)
                        if round_:
                            times[design]["verify"].append(verify)
                            times[design]["trim"].append(trim)
            results.append({
                "window": W, "bytes_per_layer": held,
                "verify_ms": {d: 1e3 * statistics.median(t["verify"]) for d, t in times.items()},
                "trim_ms_per_layer": {d: 1e3 * statistics.median(t["trim"])
                                      for d, t in times.items()},
                "spread": {d: max(t["verify"]) / min(t["verify"]) for d, t in times.items()}})
    cache_class.replay = rewind.REPLAY
    if ns.json:
        json.dump(results, sys.stdout, indent=2)
        return 0
    print(f"Qwen3.5 layers of mlx-lm, linear attention Hk={hk} Hv={hv} D={ns.dim}, "
          f"{ns.layers} of them; B=1; medians of {ns.rounds} alternated rounds")
    print("window  design   record MiB/layer  verify ms (all layers)  trim ms/layer  "
          "verify max/min")
    for r in results:
        for d in ("replay", "states"):
            print(f"{r['window']:<7} {d:<8} {r['bytes_per_layer'][d] / 2**20:>16.2f}  "
                  f"{r['verify_ms'][d]:>22.2f}  {r['trim_ms_per_layer'][d]:>13.3f}  "
                  f"{r['spread'][d]:>14.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
