"""Speculative decoding of a Qwen3.5 model through mlx-lm with
``gdngen.integrations.mlx_lm.patch(inference=True)`` against plain greedy decoding of the same
model (patched, and mlx-lm's own path), in one process, the runs interleaved ``--rounds``
times: tokens/s of each, the draft's acceptance, and whether the tokens agree.

The models are random, built from mlx-lm's own classes, their linear-attention layers with
Qwen3.5's head shape by default (Hk=16, Hv=32, D=128). A random draft would agree with a random
model on no token, so the draft is the small model (``--draft-layers``) and the model is the
draft with ``--layers - --draft-layers`` more layers whose output projections are scaled by
``--extra-scale``: the two then agree on most tokens, as a real draft does, and the model costs
about ``layers / draft-layers`` times the draft per token. Run from the repo root::

    python benchmarks/bench_speculative.py [--tokens 64] [--layers 16] [--draft-layers 4]
        [--num-draft 3] [--rounds 3] [--json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def extended(draft, model, draft_layers: int, scale: float):
    """``model`` made the draft plus small layers: the draft's embedding, norm, head and first
    layers copied; every later layer's output projections scaled by ``scale``."""
    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_map

    ours, theirs = model.language_model.model, draft.language_model.model
    ours.embed_tokens.update(theirs.embed_tokens.parameters())
    ours.norm.update(theirs.norm.parameters())
    if hasattr(model.language_model, "lm_head"):
        model.language_model.lm_head.update(draft.language_model.lm_head.parameters())
    for i, layer in enumerate(ours.layers):
        if i < draft_layers:
            layer.update(theirs.layers[i].parameters())
            continue
        for name, p in tree_flatten(layer.parameters()):
            if name.endswith(("out_proj.weight", "o_proj.weight", "down_proj.weight")):
                layer.update(tree_map(lambda x: x, _nested(name, p * scale)))
    mx.eval(model.parameters())
    return model


def _nested(name: str, value):
    out = node = {}
    parts = name.split(".")
    for part in parts[:-1]:
        node[part] = {}
        node = node[part]
    node[parts[-1]] = value
    return out


def timed(fn):
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--prompt", type=int, default=16)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--draft-layers", type=int, default=4)
    parser.add_argument("--extra-scale", type=float, default=0.05)
    parser.add_argument("--num-draft", type=int, default=3)
    parser.add_argument("--heads", default="16,32", help="linear-attention Hk,Hv")
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    ns = parser.parse_args(argv)
    import mlx.core as mx
    from bench_generate import build
    from mlx_lm.generate import generate_step, speculative_generate_step

    from gdngen.integrations import mlx_lm as integration

    hk, hv = (int(x) for x in ns.heads.split(","))
    vocab, interval = 1000, ns.draft_layers
    draft = build(ns.draft_layers, hk, hv, ns.dim, vocab, 0, interval)
    model = extended(draft, build(ns.layers, hk, hv, ns.dim, vocab, 1, interval), ns.draft_layers,
                     ns.extra_scale)
    prompt = mx.random.randint(0, vocab, (ns.prompt,), key=mx.random.key(1))

    def plain():
        return [t for t, _ in generate_step(prompt, model, max_tokens=ns.tokens)], None

    def speculative():
        out = list(speculative_generate_step(prompt, model, draft, max_tokens=ns.tokens,
                                             num_draft_tokens=ns.num_draft))
        return [t for t, _, _ in out], sum(d for _, _, d in out)

    runs = {"mlx-lm greedy": (plain, False), "gdngen greedy": (plain, True),
            "gdngen speculative": (speculative, True)}
    times = {n: [] for n in runs}
    tokens, accepted = {}, None
    for round_ in range(ns.rounds + 1):  # round 0 warms up (compiles) and is not timed
        for name, (fn, patched) in runs.items():
            with (integration.patched(inference=True) if patched else contextlib.nullcontext()):
                (tokens[name], got), seconds = timed(fn)
            if got is not None:
                accepted = got
            if round_:
                times[name].append(seconds)
    per_s = {n: ns.tokens / statistics.median(t) for n, t in times.items()}
    spread = {n: max(t) / min(t) for n, t in times.items()}
    result = {
        "tokens_equal": len({tuple(t) for t in tokens.values()}) == 1,
        "tokens_per_s": per_s, "spread": spread, "accepted": accepted, "tokens": ns.tokens,
        "speculative_over_greedy": per_s["gdngen speculative"] / per_s["gdngen greedy"],
        "speculative_over_mlx_lm": per_s["gdngen speculative"] / per_s["mlx-lm greedy"],
        "shape": {"layers": ns.layers, "draft_layers": ns.draft_layers, "Hk": hk, "Hv": hv,
                  "D": ns.dim, "num_draft": ns.num_draft}}
    if ns.json:
        json.dump(result, sys.stdout, indent=2)
        return 0
    print(f"{ns.tokens} tokens after a {ns.prompt}-token prompt; model {ns.layers} layers, "
          f"draft {ns.draft_layers} (linear attention Hk={hk} Hv={hv} D={ns.dim}), "
          f"{ns.num_draft} draft tokens a round, median of {ns.rounds} interleaved rounds")
    print(f"tokens equal: {result['tokens_equal']}; drafts accepted {accepted}/{ns.tokens}")
    for n in runs:
        print(f"{n:20} {per_s[n]:8.1f} tokens/s (max/min {spread[n]:.2f})")
    print(f"speculative / greedy (both gdngen): {result['speculative_over_greedy']:.2f}x; "
          f"speculative / mlx-lm greedy: {result['speculative_over_mlx_lm']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
