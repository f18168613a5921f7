"""What each many-device layout of `gdngen.jax.gated_delta` costs, forward + backward, on one
host with ``--devices`` host-platform devices (XLA's real SPMD partitioner; on a CPU host the
devices share its cores, so the figures compare total work, not scaling).

Layouts, all on the same inputs (default: Qwen3-Next heads Hk=16, Hv=32, D=128, B=2):

- ``one device``: the plain call, inputs on one device;
- ``shard_map``: inside ``jax.shard_map`` over data x heads;
- ``sharded jit``: a jit of inputs sharded over data x heads (custom_partitioning ops; the
  backward op re-runs the shard's forward);
- ``context``: inside ``jax.shard_map`` over data x seq, ``context_axis="seq"``.

Timed interleaved round-robin (each round runs every layout once), median of ``--repeats``;
ratios are to ``shard_map`` from the same run, and the spread (max/min over the rounds) of each
says what the machine's noise was. Run from the repo root::

    python benchmarks/bench_sharding.py [--seq-len 2048] [--devices 4] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--devices", type=int, default=4, help="host devices (2 x devices/2)")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--hk", type=int, default=16)
    parser.add_argument("--hv", type=int, default=32)
    parser.add_argument("--d", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if args.devices < 2 or args.devices % 2:
        parser.error("--devices must be an even number >= 2")
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={args.devices}"

    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from gdngen.jax import gated_delta

    B, T, Hk, Hv, D = args.batch, args.seq_len, args.hk, args.hv, args.d
    rng = np.random.default_rng(0)
    k = rng.standard_normal((B, T, Hk, D)).astype(np.float32)
    arrays = (rng.standard_normal((B, T, Hk, D)).astype(np.float32),
              k / np.linalg.norm(k, axis=-1, keepdims=True),
              rng.standard_normal((B, T, Hv, D)).astype(np.float32),
              -rng.uniform(0.01, 0.5, (B, T, Hv)).astype(np.float32),
              rng.uniform(0.0, 1.0, (B, T, Hv)).astype(np.float32),
              rng.standard_normal((B, Hv, D, D)).astype(np.float32))
    n = args.devices // 2
    heads = Mesh(np.array(jax.devices()).reshape(2, n), ("data", "heads"))
    seq = Mesh(np.array(jax.devices()).reshape(2, n), ("data", "seq"))
    tokens, state = P("data", None, "heads"), P("data", "heads")
    scale = D ** -0.5

    def layer(q, k, v, g, beta, S0, **kw):
        return gated_delta(q, k, v, g, beta, S0, scale=scale, **kw)

    def grad_of(fn):
        def loss(*a):
            y, S = fn(*a)
            return (y * y).sum() + (S * S).sum()
        return jax.jit(jax.grad(loss, argnums=tuple(range(6))))

    def placed(mesh, specs):
        return [jax.device_put(x, NamedSharding(mesh, s)) for x, s in zip(arrays, specs)]

    per_token = (tokens,) * 5 + (state,)
    ctx_specs = (P("data", "seq"),) * 5 + (P("data"),)
    layouts = {
        "one device": (grad_of(layer), [jax.device_put(x, jax.devices()[0]) for x in arrays]),
        "shard_map": (grad_of(jax.shard_map(layer, mesh=heads, in_specs=per_token,
                                            out_specs=(tokens, state))),
                      placed(heads, per_token)),
        "sharded jit": (grad_of(layer), placed(heads, per_token)),
        "context": (grad_of(jax.shard_map(lambda *a: layer(*a, context_axis="seq"), mesh=seq,
                                          in_specs=ctx_specs,
                                          out_specs=(P("data", "seq"), P("data")))),
                    placed(seq, ctx_specs)),
    }
    times = {name: [] for name in layouts}
    for fn, inputs in layouts.values():
        jax.block_until_ready(fn(*inputs))  # compile
    for _ in range(args.repeats):
        for name, (fn, inputs) in layouts.items():
            t0 = time.perf_counter()
            jax.block_until_ready(fn(*inputs))
            times[name].append(time.perf_counter() - t0)
    base = float(np.median(times["shard_map"]))
    rows = {name: {"median_s": float(np.median(t)), "ratio_to_shard_map":
                   float(np.median(t)) / base, "spread": max(t) / min(t)}
            for name, t in times.items()}
    if args.json:
        shape = {"B": B, "T": T, "Hk": Hk, "Hv": Hv, "D": D, "devices": args.devices}
        print(json.dumps({"shape": shape, "layouts": rows}))
        return 0
    print(f"fwd+bwd, B={B} T={T} Hk={Hk} Hv={Hv} D={D}, {args.devices} host devices "
          f"(2 x {n}), median of {args.repeats}")
    print(f"{'layout':<12} {'median s':>9} {'/ shard_map':>12} {'spread':>7}")
    for name, row in rows.items():
        print(f"{name:<12} {row['median_s']:9.3f} {row['ratio_to_shard_map']:12.2f} "
              f"{row['spread']:7.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
