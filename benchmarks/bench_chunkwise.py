"""Chunkwise vs sequential gated-delta benchmark, without the CLI.

Same measurements as ``gdngen bench`` (see gdngen/bench.py); run from the repo root with
``python benchmarks/bench_chunkwise.py [--framework jax] [--seq-lens 1024,2048] [--json]``.
"""

from __future__ import annotations

import argparse
import json

from gdngen.tools import bench


def main(argv=None) -> None:
    defaults = bench.BenchConfig()
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--framework", choices=[*bench.FRAMEWORKS, "all"], default="all")
    p.add_argument("--seq-lens", default=",".join(map(str, defaults.seq_lens)))
    for name in ("batch", "hk", "hv", "dk", "dv", "chunk_size", "repeats", "baseline_max_T",
                 "matmul_n"):
        p.add_argument("--" + name.replace("_", "-"), dest=name, type=int,
                       default=getattr(defaults, name))
    p.add_argument("--dtype", choices=bench.DTYPES, default=defaults.dtype)
    p.add_argument("--backend", default=defaults.backend,
                   help="backend of the chunkwise rows ('auto': see gdngen bench --help)")
    p.add_argument("--json", action="store_true", help="print rows as JSON instead of a table")
    p.add_argument("--out", help="also write the rows as JSON to this file")
    ns = vars(p.parse_args(argv))
    framework, as_json, out = ns.pop("framework"), ns.pop("json"), ns.pop("out")
    ns["seq_lens"] = tuple(int(t) for t in ns["seq_lens"].split(","))
    cfg = bench.BenchConfig(**ns)
    frameworks = bench.available_frameworks() if framework == "all" else (framework,)
    rows = bench.run(cfg, bench.frameworks_for(cfg, frameworks))
    if out:
        bench.write_json(rows, out)
    if as_json:
        print(json.dumps(rows, indent=2))
    else:
        bench.print_table(rows)


if __name__ == "__main__":
    main()
