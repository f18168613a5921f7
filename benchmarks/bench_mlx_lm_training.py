"""One mlx-lm training step of a small Qwen3.5- or Kimi Linear-style model, with and without
gdngen's patch.

``--model qwen3_5`` (the default) has Qwen3.5's layout in miniature: by default 3 layers, every
3rd one full attention (``--layers``, ``--interval``: mlx-lm's ``full_attention_interval``), the
others GatedDeltaNet (per-head gate ``a [B,T,Hv]``; ``--hk``, ``--hv``, ``--dk``, ``--dv``,
default 2, 4, 64, 64). ``--model kimi_linear`` builds mlx-lm's ``kimi_linear`` model the same
way: every ``--interval``-th layer MLA attention, the others Kimi Delta Attention (per-channel
gate ``a [B,T,Hv,Dk]``, ``A_log [Hv,1]``, ``dt_bias [Hv,Dk]``; Hk = Hv = ``--hv`` heads of Dk =
Dv = ``--dk``, default 4 heads of 128 like the real model's head_dim; A_log and dt_bias random,
as mlx-lm leaves dt_bias at 0), dense MLPs. Both float32. A step is forward + backward + AdamW
update of every parameter, through mlx-lm's own ``default_loss`` and model code, random weights
and tokens (no downloads). Without the patch the linear-attention layers run mlx-lm's per-token
``gated_delta_ops`` loop; with it, gdngen's chunkwise path (``--chunk-size``: 64 for qwen3_5,
gdngen's per-channel default 32 for kimi_linear); the warm-up step checks that every such layer
called gdngen in that mode and none did without it. Reports the median step time and the peak
memory (``mx.get_peak_memory``) per length. Run from the repo root: ``python
benchmarks/bench_mlx_lm_training.py [--model qwen3_5|kimi_linear] [--seq-lens 512,1024]
[--repeats 3] [--compile] [--no-mixer] [--json]`` (``--no-mixer``: the patch routes only
``gated_delta_update``, mlx-lm's conv and norm stay).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import time
from functools import partial

import mlx.core as mx
import mlx.optimizers as optim
import mlx_lm
from mlx import nn
from mlx_lm.models import gated_delta as mlx_gated_delta
from mlx_lm.models import kimi_linear, qwen3_5
from mlx_lm.tuner.trainer import default_loss

from gdngen import mlx as gdngen_mlx
from gdngen.backends.portable import VECTOR_CHUNK
from gdngen.integrations import mlx_lm as integration

MODES = ("mlx-lm", "gdngen")
MODELS = ("qwen3_5", "kimi_linear")
LINEAR_LAYER = {"qwen3_5": "GatedDeltaNet", "kimi_linear": "KDA"}
#: per-model defaults of the head options and the chunk (KDA: hk = hv, dv = dk; its chunk is
#: gdngen's default for per-channel gates)
MODEL_DEFAULTS = {"qwen3_5": {"hk": 2, "hv": 4, "dk": 64, "dv": 64, "chunk_size": 64},
                  "kimi_linear": {"hv": 4, "dk": 128, "chunk_size": VECTOR_CHUNK}}


def build_model(*, hidden, layers, interval, hk, hv, dk, dv, vocab, seed=0):
    """Qwen3.5 text model; every ``interval``-th layer is full attention, the rest GatedDeltaNet."""
    mx.random.seed(seed)
    text = {"model_type": "qwen3_5_text", "hidden_size": hidden, "intermediate_size": 2 * hidden,
            "num_hidden_layers": layers, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": hidden // 4, "vocab_size": vocab, "linear_num_key_heads": hk,
            "linear_num_value_heads": hv, "linear_key_head_dim": dk, "linear_value_head_dim": dv,
            "linear_conv_kernel_dim": 4, "full_attention_interval": interval}
    model = qwen3_5.Model(qwen3_5.ModelArgs(model_type="qwen3_5", text_config=text))
    mx.eval(model.parameters())
    model.train()
    return model


def build_kimi_linear(*, hidden, layers, interval, heads, head_dim, vocab, seed=0):
    """mlx-lm's Kimi Linear; every ``interval``-th layer MLA, the rest KDA (``heads`` heads of
    ``head_dim``), dense MLPs. A_log and dt_bias random (as tests/test_mlx_lm_kda.py: mlx-lm
    leaves dt_bias at 0), so the gate varies per channel."""
    if layers < interval:
        raise ValueError(f"kimi_linear needs an MLA layer: --layers {layers} < --interval "
                         f"{interval}")
    mx.random.seed(seed)
    args = kimi_linear.ModelArgs(
        model_type="kimi_linear", vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=4, intermediate_size=2 * hidden,
        head_dim=hidden // 4, rope_theta=10000.0, rms_norm_eps=1e-5, model_max_length=1 << 16,
        num_experts=0, moe_intermediate_size=hidden, kv_lora_rank=hidden // 2,
        qk_nope_head_dim=hidden // 4, qk_rope_head_dim=hidden // 8, v_head_dim=hidden // 4,
        linear_attn_config={"num_heads": heads, "head_dim": head_dim, "short_conv_kernel_size": 4,
                            "kda_layers": [i for i in range(1, layers + 1) if i % interval]})
    model = kimi_linear.Model(args)
    keys = iter(mx.random.split(mx.random.key(100 + seed), 2 * layers))
    for layer in model.layers:
        if layer.is_linear:
            kda = layer.self_attn
            kda.A_log = mx.random.uniform(-1.0, 1.5, kda.A_log.shape, key=next(keys))
            kda.dt_bias = mx.random.normal(kda.dt_bias.shape, key=next(keys))
    mx.eval(model.parameters())
    model.train()
    return model


@contextlib.contextmanager
def counting_gdngen_calls():
    """Counts the calls of ``gdngen.mlx.gated_delta`` (where the patch routes) in the block."""
    real, count = gdngen_mlx.gated_delta, [0]

    def spy(*args, **kwargs):
        count[0] += 1
        return real(*args, **kwargs)

    gdngen_mlx.gated_delta = spy
    try:
        yield count
    finally:
        gdngen_mlx.gated_delta = real


def make_step(model, optimizer, compile_step):
    """forward + backward + optimizer update; ``mx.compile``d like mlx-lm's trainer if asked."""
    loss_and_grad = nn.value_and_grad(model, lambda m, b, n: default_loss(m, b, n)[0])

    def step(batch, lengths):
        loss, grads = loss_and_grad(model, batch, lengths)
        optimizer.update(model, grads)
        return loss

    if compile_step:
        state = [model.state, optimizer.state]
        step = partial(mx.compile, inputs=state, outputs=state)(step)
    return step


class Trainer:
    """One model, optimizer and step function for a mode; ``run`` times one step."""

    def __init__(self, mode, T, args):
        self.mode, self.chunk_size, self.mixer = mode, args.chunk_size, args.mixer
        if args.model == "kimi_linear":
            self.model = build_kimi_linear(hidden=args.hidden, layers=args.layers,
                                           interval=args.interval, heads=args.hv,
                                           head_dim=args.dk, vocab=args.vocab)
        else:
            self.model = build_model(hidden=args.hidden, layers=args.layers,
                                     interval=args.interval, hk=args.hk, hv=args.hv, dk=args.dk,
                                     dv=args.dv, vocab=args.vocab)
        self.linear_layers = sum(layer.is_linear for layer in self.model.layers)
        self.optimizer = optim.AdamW(learning_rate=1e-4)
        self.batch = mx.random.randint(0, args.vocab, (args.batch, T + 1), key=mx.random.key(1))
        self.lengths = mx.array([[0, T]] * args.batch)
        self.step = make_step(self.model, self.optimizer, args.compile)

    def run(self):
        """``(seconds, peak bytes)`` of one step; the patch is on only for mode "gdngen"."""
        if self.mode == "gdngen":
            integration.patch(chunk_size=self.chunk_size, mixer=self.mixer)
        try:
            mx.clear_cache()
            mx.reset_peak_memory()
            tic = time.perf_counter()
            mx.eval(self.step(self.batch, self.lengths), self.model.state, self.optimizer.state)
            return time.perf_counter() - tic, mx.get_peak_memory()
        finally:
            integration.unpatch()


def measure(T, args):
    """Per mode: median step seconds and peak bytes at length T, after one warm-up (and compile)
    step. The modes' steps alternate, so load from other processes hits both alike. The warm-up
    step checks the route: every linear-attention layer calls gdngen with the patch, none
    without it (counted while tracing with ``--compile``)."""
    trainers = {mode: Trainer(mode, T, args) for mode in MODES}
    first = {}
    for mode, trainer in trainers.items():
        with counting_gdngen_calls() as calls:
            first[mode] = trainer.run()[0]
        expected = trainer.linear_layers if mode == "gdngen" else 0
        if calls[0] != expected:
            raise RuntimeError(f"{mode} step: {calls[0]} gdngen calls, expected {expected} "
                               f"(one per {LINEAR_LAYER[args.model]} layer with the patch)")
    samples = {mode: [] for mode in MODES}
    for _ in range(args.repeats):
        for mode, trainer in trainers.items():
            samples[mode].append(trainer.run())
    return {mode: {"median_s": statistics.median(t for t, _ in samples[mode]),
                   "min_s": min(t for t, _ in samples[mode]), "first_step_s": first[mode],
                   "peak_bytes": max(p for _, p in samples[mode]), "repeats": args.repeats}
            for mode in MODES}


def measure_op(T, args):
    """Median seconds of forward + backward of one ``gated_delta_update`` call at the model's
    linear-attention shapes (KDA: per-channel a, A_log [Hv,1], dt_bias [Hv,Dk] random): what the
    patch replaces, without the rest of the step."""
    B, f32 = args.batch, mx.float32
    keys = iter(mx.random.split(mx.random.key(2), 8))
    q, k = (mx.random.normal((B, T, args.hk, args.dk), key=next(keys)) * args.dk**-0.5
            for _ in range(2))
    v = mx.random.normal((B, T, args.hv, args.dv), key=next(keys))
    b = mx.random.normal((B, T, args.hv), key=next(keys))
    if args.model == "kimi_linear":
        a = mx.random.normal((B, T, args.hv, args.dk), key=next(keys))
        A_log = mx.random.uniform(-1.0, 1.5, (args.hv, 1), key=next(keys))
        dt_bias = mx.random.normal((args.hv, args.dk), key=next(keys))
    else:
        a = mx.random.normal((B, T, args.hv), key=next(keys))
        A_log, dt_bias = mx.zeros(args.hv, f32), mx.ones(args.hv, f32)
    updates = {"mlx-lm": mlx_gated_delta.gated_delta_update,
               "gdngen": partial(integration.gdngen_gated_delta_update,
                                 chunk_size=args.chunk_size)}

    def grad_fn(update):
        def loss(q, k, v, a, b, A_log, dt_bias):
            y, state = update(q, k, v, a, b, A_log, dt_bias, use_kernel=False)
            return (y * y).sum() + (state * state).sum()
        return mx.value_and_grad(loss, argnums=tuple(range(7)))

    fns = {mode: grad_fn(update) for mode, update in updates.items()}
    samples = {mode: [] for mode in MODES}
    for rep in range(args.repeats + 1):
        for mode, fn in fns.items():
            tic = time.perf_counter()
            mx.eval(fn(q, k, v, a, b, A_log, dt_bias))
            if rep:  # the first round warms up
                samples[mode].append(time.perf_counter() - tic)
    return {mode: statistics.median(samples[mode]) for mode in MODES}


def run(args):
    rows = []
    for T in args.seq_lens:
        row = {"T": T, **measure(T, args)}
        row["speedup"] = row["mlx-lm"]["median_s"] / row["gdngen"]["median_s"]
        row["memory_ratio"] = row["mlx-lm"]["peak_bytes"] / row["gdngen"]["peak_bytes"]
        op = measure_op(T, args)
        row["op"] = {**op, "speedup": op["mlx-lm"] / op["gdngen"]}
        rows.append(row)
    return rows


def print_table(rows, args):
    print(f"mlx-lm {mlx_lm.__version__}, mlx {mx.__version__}, device {mx.default_device()}, "
          f"{platform.machine()}; {args.model}, hidden {args.hidden}, {args.layers} layers "
          f"({args.layers - args.layers // args.interval} {LINEAR_LAYER[args.model]}), "
          f"Hk={args.hk} Hv={args.hv} Dk={args.dk} Dv={args.dv}, B={args.batch}, "
          f"chunk {args.chunk_size}, {'compiled' if args.compile else 'eager'} step, "
          f"patch(mixer={args.mixer}), "
          f"median of {args.repeats}")
    print(f"load average {' '.join(f'{x:.1f}' for x in os.getloadavg())} on {os.cpu_count()} "
          f"CPUs (other processes slow both modes alike: their steps alternate)")
    head = (f"{'T':>6} | {'step: mlx-lm s':>14} {'gdngen s':>9} {'speedup':>8} | "
            f"{'peak: mlx-lm MiB':>16} {'gdngen MiB':>10} {'ratio':>6} | "
            f"{'op: mlx-lm s':>12} {'gdngen s':>9} {'speedup':>8}")
    print(head)
    print("-" * len(head))
    for r in rows:
        base, ours, op = r["mlx-lm"], r["gdngen"], r["op"]
        print(f"{r['T']:>6} | {base['median_s']:>14.3f} {ours['median_s']:>9.3f} "
              f"{r['speedup']:>7.2f}x | {base['peak_bytes'] / 2**20:>16.0f} "
              f"{ours['peak_bytes'] / 2**20:>10.0f} {r['memory_ratio']:>5.1f}x | "
              f"{op['mlx-lm']:>12.3f} {op['gdngen']:>9.3f} {op['speedup']:>7.2f}x")
    print("step: forward + backward + AdamW of the whole model; op: forward + backward of one "
          "gated_delta_update call at the same shapes")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=MODELS, default="qwen3_5",
                   help="the mlx-lm model: qwen3_5 (GatedDeltaNet) or kimi_linear (KDA)")
    p.add_argument("--seq-lens", default="512,1024,2048")
    for name, default in (("batch", 1), ("hidden", 256), ("layers", 3), ("interval", 3),
                          ("hk", None), ("hv", None),
                          ("dk", None), ("dv", None), ("vocab", 1024), ("chunk_size", None),
                          ("repeats", 3)):
        p.add_argument("--" + name.replace("_", "-"), dest=name, type=int, default=default)
    p.add_argument("--mixer", action=argparse.BooleanOptionalAction, default=True,
                   help="patch(mixer=...): whole layers through gated_delta_mixer (default), "
                        "or only gated_delta_update")
    p.add_argument("--compile", action="store_true",
                   help="mx.compile the step like mlx_lm.tuner.trainer (slow to trace unpatched)")
    p.add_argument("--json", action="store_true", help="print rows as JSON instead of a table")
    args = p.parse_args(argv)
    for name, default in MODEL_DEFAULTS[args.model].items():
        setattr(args, name, default if getattr(args, name) is None else getattr(args, name))
    if args.model == "kimi_linear":  # KDA: --hv heads of --dk for q, k and v
        for name, same in (("hk", "hv"), ("dv", "dk")):
            if getattr(args, name) not in (None, getattr(args, same)):
                p.error(f"kimi_linear's KDA has {name} = {same}; give --{same} only")
            setattr(args, name, getattr(args, same))
    args.seq_lens = tuple(int(t) for t in args.seq_lens.split(","))
    rows = run(args)
    if args.json:
        print(json.dumps({"config": {k: v for k, v in vars(args).items() if k != "json"},
                          "mlx_lm": mlx_lm.__version__, "mlx": mx.__version__,
                          "device": str(mx.default_device()), "load_average": os.getloadavg(),
                          "rows": rows}, indent=2))
    else:
        print_table(rows, args)


if __name__ == "__main__":
    main()
