"""Which gdngen modules one traced, jitted fwd+bwd of ``gated_delta`` runs, per JAX backend.

    python benchmarks/entry_trace.py [--backends xla,ffi_cpu,pallas_tpu,pallas_gpu] [--json]

A profile hook records every Python call made while ``jax.jit(jax.grad(loss)).trace(...)`` runs
(the tracing of the call, its custom VJP and the kernels' Python; nothing is compiled), after a
first trace at another length (so module imports do not count). Per backend it prints the
gdngen modules whose functions ran (the rendered kernel modules count as one, "<rendered>"),
and the call paths on which a module is re-entered after the path left it for another gdngen
module (down and back up: ``a -> b -> a``). The call is ``gdngen.jax.gated_delta`` with the
backend's default variant (``--tuned``: ``load_tuned("jax")``'s callable, which picks its own).
"""

from __future__ import annotations

import argparse
import json
import sys


def _modules_of(fn) -> dict:
    """``{"modules": sorted gdngen modules run, "revisits": [paths re-entering a module]}``
    of calling ``fn()``."""
    seen, revisits, stack = set(), set(), []

    def hook(frame, event, arg):
        if event == "call":
            name = frame.f_globals.get("__name__", "")
            if name.startswith("gdngen_"):  # a rendered kernel module (`gdngen.sources`)
                name = "gdngen.<rendered>"
            stack.append(name)
            if name.startswith("gdngen"):
                seen.add(name)
                path = []
                for m in stack:
                    if m.startswith("gdngen") and (not path or path[-1] != m):
                        path.append(m)
                if len(path) != len(set(path)):
                    revisits.add(" -> ".join(path))
        elif event == "return" and stack:
            stack.pop()

    sys.setprofile(hook)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return {"modules": sorted(seen), "revisits": sorted(revisits)}


def trace(backend: str, tuned: bool = False, T: int = 256) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from gdngen import registry
    from gdngen.jax import gated_delta
    from gdngen.problem import Problem

    B, Hk, Hv, D = 1, 2, 4, 64
    rng = np.random.default_rng(0)
    q, k = (jnp.asarray(rng.standard_normal((B, T, Hk, D)), jnp.float32) for _ in range(2))
    v = jnp.asarray(rng.standard_normal((B, T, Hv, D)), jnp.float32)
    g = jnp.asarray(-rng.uniform(0.01, 0.2, (B, T, Hv)), jnp.float32)
    beta = jnp.asarray(rng.uniform(0.1, 0.9, (B, T, Hv)), jnp.float32)
    if tuned:
        import gdngen

        call = gdngen.load_tuned("jax")
    else:
        variant = registry.default_variant(backend, Problem(Hk, Hv, D, D))

        def call(*a, **kw):
            return gated_delta(*a, variant=variant, **kw)

    def loss(q, k, v, g, beta):
        y, s = call(q, k, v, g, beta, scale=D ** -0.5)
        return (y ** 2).sum() + (s ** 2).sum()

    step = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))
    return _modules_of(lambda: step.trace(q, k, v, g, beta))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", default="xla,ffi_cpu,pallas_tpu,pallas_gpu")
    parser.add_argument("--tuned", action="store_true")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    import warnings

    warnings.simplefilter("ignore", RuntimeWarning)  # "no TPU attached: interpret mode"
    out = {}
    for backend in args.backends.split(","):
        trace(backend, args.tuned, T=128)  # imports and first-use setup, not measured
        out[backend] = trace(backend, args.tuned)
    if args.json:
        print(json.dumps(out, indent=1))
        return
    for backend, result in out.items():
        print(f"{backend}: {len(result['modules'])} modules, "
              f"{len(result['revisits'])} paths re-entering a module")
        print("  " + " ".join(m.removeprefix("gdngen.") for m in result["modules"]))
        for path in result["revisits"][:5]:
            print("  re-entered: " + path)


if __name__ == "__main__":
    main()
