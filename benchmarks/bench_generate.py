"""Text generation through mlx-lm with and without ``gdngen.integrations.mlx_lm.patch(
inference=True)``: a random Qwen3.5 built from mlx-lm's own classes generates greedily from the
same prompt both ways; prints whether the tokens agree and the per-token decode time of each
(median over the decode steps, the two runs interleaved ``--rounds`` times).

The model is small but its linear-attention layers have Qwen3.5's head shape by default
(Hk=16, Hv=32, D=128), so the decode step's gated delta update is a real one. Run from the repo
root::

    python benchmarks/bench_generate.py [--tokens 64] [--layers 3] [--rounds 3] [--json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time


def build(layers: int, hk: int, hv: int, dim: int, vocab: int, seed: int,
          interval: int | None = None):
    """A random Qwen3.5 model of mlx-lm's classes: ``layers`` layers, a full-attention layer
    every ``interval`` (default: the last only), linear-attention heads ``hk``, ``hv`` of
    ``dim``."""
    import mlx.core as mx
    from mlx_lm.models import qwen3_5

    mx.random.seed(seed)
    text = {"model_type": "qwen3_5_text", "hidden_size": 512, "intermediate_size": 1024,
            "num_hidden_layers": layers, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 64, "vocab_size": vocab, "linear_num_value_heads": hv,
            "linear_num_key_heads": hk, "linear_key_head_dim": dim,
            "linear_value_head_dim": dim, "linear_conv_kernel_dim": 4,
            "full_attention_interval": layers if interval is None else interval}
    model = qwen3_5.Model(qwen3_5.ModelArgs(model_type="qwen3_5", text_config=text))
    mx.eval(model.parameters())
    model.eval()
    return model


def generate(model, prompt, tokens: int):
    """Greedy tokens and the wall time of each decode step (prefill excluded)."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    logits = model(prompt[None], cache=cache)[:, -1]
    out, times = [], []
    for _ in range(tokens):
        token = mx.argmax(logits, axis=-1)
        mx.eval(token)
        out.append(token.item())
        t0 = time.perf_counter()
        logits = model(token[None], cache=cache)[:, -1]
        mx.eval(logits)
        times.append(time.perf_counter() - t0)
    return out, times


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--prompt", type=int, default=16)
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--heads", default="16,32", help="linear-attention Hk,Hv")
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    ns = parser.parse_args(argv)
    import mlx.core as mx

    from gdngen.integrations import mlx_lm as integration

    hk, hv = (int(x) for x in ns.heads.split(","))
    vocab = 1000
    model = build(ns.layers, hk, hv, ns.dim, vocab, seed=0)
    prompt = mx.random.randint(0, vocab, (ns.prompt,), key=mx.random.key(1))
    runs = {"mlx-lm": [], "gdngen": []}
    tokens = {}
    for _ in range(ns.rounds):
        for name, times in runs.items():
            with (integration.patched(inference=True) if name == "gdngen"
                  else contextlib.nullcontext()):
                tokens[name], step_times = generate(model, prompt, ns.tokens)
            times.extend(step_times[1:])  # the first decode step compiles
    per_token = {n: statistics.median(t) * 1e3 for n, t in runs.items()}
    spread = {n: max(t) / min(t) for n, t in runs.items()}
    result = {"tokens_equal": tokens["mlx-lm"] == tokens["gdngen"], "per_token_ms": per_token,
              "spread": spread, "mlx_lm_over_gdngen": per_token["mlx-lm"] / per_token["gdngen"],
              "shape": {"layers": ns.layers, "Hk": hk, "Hv": hv, "D": ns.dim}}
    if ns.json:
        json.dump(result, sys.stdout, indent=2)
        return 0
    print(f"{ns.tokens} greedy tokens, {ns.layers} layers (linear attention Hk={hk} Hv={hv} "
          f"D={ns.dim}), {ns.rounds} interleaved rounds")
    print(f"tokens equal: {result['tokens_equal']}")
    for n in runs:
        print(f"{n:7} per-token decode {per_token[n]:.2f} ms (max/min {spread[n]:.2f})")
    print(f"mlx-lm / gdngen: {result['mlx_lm_over_gdngen']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
