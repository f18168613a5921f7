"""MaxText's Qwen3-Next GatedDeltaNet layer with and without gdngen's patch
(`gdngen.integrations.maxtext`): fwd+bwd time, and the recurrence's accuracy against float64.

**Time.** MaxText's own ``Qwen3NextGatedDeltaNet`` (built from its ``pyconfig``; one layer,
Qwen3-Next's heads by default: Hk=16, Hv=32, Dk=Dv=128; ``--emb`` the model width, default
512 so the projections, identical in both, do not drown the recurrence on a small CPU) on a
one-device MaxText mesh, one jitted step = forward + gradient of every parameter and the input;
``--dtype`` MaxText's ``dtype`` (its ``compute_dtype``). Median of ``--repeats`` after a warm-up,
with the spread (min..max). Also the recurrence alone (``jax_chunk_gated_delta_rule``, fwd+bwd).

**Accuracy.** ``jax_chunk_gated_delta_rule`` on a strong-decay case (log gate uniform in
[-12, -2], unit-norm q and k, a random initial state; q, k, v and beta bfloat16-representable,
so that the bfloat16 rows measure the computation, not the inputs' rounding) against
`gdngen.algebra.reference` in float64: relative L2 error of y, the final state and every input
gradient, MaxText's own function beside the patched one, at compute_dtype float32 and bfloat16.

Run from the repo root in a Python >= 3.12 environment with ``gdngen[maxtext]``:
``python benchmarks/bench_maxtext.py [--seq 2048] [--emb 512] [--hk 16 --hv 32 --d 128]
[--dtypes float32,bfloat16] [--repeats 3] [--acc-seq 512] [--no-layer] [--skip-accuracy]``.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from flax.linen import partitioning as nn_partitioning
from jax.sharding import Mesh
from maxtext.configs import pyconfig
from maxtext.models import qwen3
from maxtext.utils.globals import MAXTEXT_PKG_DIR

from gdngen.algebra import reference
from gdngen.integrations import maxtext as gdn_maxtext


def config(args, dtype):
    settings = {"run_name": "bench_maxtext", "dtype": dtype, "weight_dtype": "float32",
                "matmul_precision": "highest", "decoder_block": "qwen3_next",
                "base_emb_dim": args.emb, "base_num_query_heads": 16, "base_num_kv_heads": 2,
                "head_dim": 256, "gdn_num_value_heads": args.hv, "gdn_num_key_heads": args.hk,
                "gdn_key_head_dim": args.d, "gdn_value_head_dim": args.d,
                "gdn_conv_kernel_dim": 4, "gdn_chunk_size": 64, "use_qk_norm_in_gdn": True,
                "normalization_layer_epsilon": 1e-6, "skip_jax_distributed_system": True,
                "enable_checkpointing": False}
    return pyconfig.initialize([None, os.path.join(MAXTEXT_PKG_DIR, "configs", "base.yml"),
                                *(f"{k}={v}" for k, v in settings.items())])


def timed(fn, *xs, repeats):
    jax.block_until_ready(fn(*xs))  # compile + warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*xs))
        times.append(time.perf_counter() - start)
    return statistics.median(times), min(times), max(times)


def layer_step(cfg):
    devices = np.array(jax.devices()[:1])
    mesh = Mesh(devices.reshape([1] * len(cfg.mesh_axes)), cfg.mesh_axes)
    layer = qwen3.Qwen3NextGatedDeltaNet(config=cfg, mesh=mesh, dtype=jnp.dtype(cfg.dtype),
                                         rngs=nnx.Rngs(0))
    graphdef, params, rest = nnx.split(layer, nnx.Param, ...)

    def loss(params, x):
        out, _ = nnx.merge(graphdef, params, rest)(x)
        return jnp.sum(out.astype(jnp.float32) ** 2)

    return mesh, params, jax.jit(jax.grad(loss, argnums=(0, 1)))


def time_layer(args, dtype):
    rows = []
    cfg = config(args, dtype)
    x = jax.random.normal(jax.random.key(1), (1, args.seq, cfg.emb_dim)).astype(dtype)
    for patched in () if args.no_layer else (False, True):
        mesh, params, step = layer_step(cfg)
        with jax.set_mesh(mesh), nn_partitioning.axis_rules(cfg.logical_axis_rules):
            if patched:
                gdn_maxtext.patch()
            rows.append(("layer", dtype, patched, *timed(step, params, x, repeats=args.repeats)))
            gdn_maxtext.unpatch()
    H, D = args.hv, args.d
    keys = jax.random.split(jax.random.key(2), 5)
    q, k = (jax.random.normal(kk, (1, args.seq, H, D)).astype(dtype) for kk in keys[:2])
    v = jax.random.normal(keys[2], (1, args.seq, H, D)).astype(dtype)
    g = -jax.random.uniform(keys[3], (1, args.seq, H), minval=0.01, maxval=2.0)
    beta = jax.nn.sigmoid(jax.random.normal(keys[4], (1, args.seq, H))).astype(dtype)
    for patched in (False, True):
        if patched:
            gdn_maxtext.patch()

        def loss(q, k, v, g, beta):
            y, _ = qwen3.jax_chunk_gated_delta_rule(q, k, v, g, beta, use_qk_norm_in_gdn=True,
                                                    compute_dtype=jnp.dtype(dtype))
            return jnp.sum(y.astype(jnp.float32) ** 2)

        step = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))
        rows.append(("recurrence", dtype, patched,
                     *timed(step, q, k, v, g, beta, repeats=args.repeats)))
        gdn_maxtext.unpatch()
    return rows


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def accuracy(args):
    B, T, H, D = 1, args.acc_seq, 4, 128
    keys = jax.random.split(jax.random.key(0), 8)

    def exact(x, unit=False):  # bfloat16-representable, so both dtypes see the same inputs
        x = x / jnp.linalg.norm(x, axis=-1, keepdims=True) if unit else x
        return np.asarray(x.astype(jnp.bfloat16), np.float64)

    q = exact(jax.random.normal(keys[0], (B, T, H, D)), unit=True)
    k = exact(jax.random.normal(keys[1], (B, T, H, D)), unit=True)
    v = exact(jax.random.normal(keys[2], (B, T, H, D)))
    g = -np.asarray(jax.random.uniform(keys[3], (B, T, H), minval=2.0, maxval=12.0), np.float64)
    beta = exact(jax.nn.sigmoid(jax.random.normal(keys[4], (B, T, H))))
    h0 = np.asarray(jax.random.normal(keys[5], (B, H, D, D)), np.float64) * 0.1  # [B,H,Dk,Dv]
    dy = np.asarray(jax.random.normal(keys[6], (B, T, H, D)), np.float64)
    dh = np.asarray(jax.random.normal(keys[7], (B, H, D, D)), np.float64)
    scale = D ** -0.5
    ref = reference.vjp(q * scale, k, v, g, beta, np.swapaxes(h0, -1, -2), dy,
                        np.swapaxes(dh, -1, -2), gate="log")
    want = {"y": ref["y"], "state": np.swapaxes(ref["final_state"], -1, -2),
            "dq": ref["dq"] * scale, "dk": ref["dk"], "dv": ref["dv"], "dg": ref["dg"],
            "dbeta": ref["dbeta"], "dh0": np.swapaxes(ref["dinitial_state"], -1, -2)}
    rows = []
    for dtype in ("float32", "bfloat16"):
        xs = [jnp.asarray(x, jnp.float32) for x in (q, k, v, g, beta, h0)]
        for patched in (False, True):
            if patched:
                gdn_maxtext.patch()

            def run(q, k, v, g, beta, h0, dtype=dtype):
                y, h = qwen3.jax_chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0,
                                                        compute_dtype=jnp.dtype(dtype))
                return y, h.astype(jnp.float32)

            (y, h), pullback = jax.vjp(jax.jit(run), *xs)
            grads = pullback((jnp.asarray(dy, jnp.float32), jnp.asarray(dh, jnp.float32)))
            got = {"y": y, "state": h, **dict(zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"),
                                                  grads))}
            rows.append((dtype, patched, {n: rel(got[n], want[n]) for n in want}))
            gdn_maxtext.unpatch()
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--emb", type=int, default=512)
    parser.add_argument("--hk", type=int, default=16)
    parser.add_argument("--hv", type=int, default=32)
    parser.add_argument("--d", type=int, default=128)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--acc-seq", type=int, default=512)
    parser.add_argument("--skip-time", action="store_true")
    parser.add_argument("--no-layer", action="store_true", help="time the recurrence only")
    parser.add_argument("--skip-accuracy", action="store_true")
    args = parser.parse_args()
    print(f"# {platform.processor() or platform.machine()}, {os.cpu_count()} cpus, "
          f"jax {jax.__version__}, device {jax.devices()[0].device_kind}")
    if not args.skip_time:
        print(f"\nfwd+bwd, B=1, T={args.seq}, Hk={args.hk}, Hv={args.hv}, D={args.d}, "
              f"emb={args.emb}; median of {args.repeats} (min..max)\n")
        print("| what | compute dtype | path | median s | min..max s |")
        print("| --- | --- | --- | --- | --- |")
        for dtype in args.dtypes.split(","):
            for what, dt, patched, med, lo, hi in time_layer(args, dtype):
                path = "gdngen (patched)" if patched else "MaxText"
                print(f"| {what} | {dt} | {path} | {med:.3f} | {lo:.3f}..{hi:.3f} |", flush=True)
    if args.skip_accuracy:
        return
    print(f"\nstrong decay (log g in [-12, -2]), B=1, T={args.acc_seq}, H=4, D=128: relative L2 "
          "error against float64\n")
    names = ("y", "state", "dq", "dk", "dv", "dg", "dbeta", "dh0")
    print("| compute dtype | path | " + " | ".join(names) + " |")
    print("| --- | --- | " + " | ".join("---" for _ in names) + " |")
    for dtype, patched, errs in accuracy(args):
        path = "gdngen (patched)" if patched else "MaxText"
        print(f"| {dtype} | {path} | " + " | ".join(f"{errs[n]:.1e}" for n in names) + " |",
              flush=True)


if __name__ == "__main__":
    main()
