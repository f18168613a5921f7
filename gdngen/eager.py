"""A JAX ``gated_delta`` called eagerly runs as one compiled step.

Outside any JAX transformation the body of a call would run op by op, each jnp op dispatched
from Python: at decode lengths that is ~25 ms a call on a CPU against ~0.3 ms for the same
call under ``jax.jit`` (``benchmarks/bench_decode_step.py``). The entry body
(`gdngen.entry.body`) binds the call and chooses its variant in Python, as for any call
(so a new tuned entry is picked up on the next call: the variant is part of the key), then
`run` runs the rest as one ``jax.jit``, built once per function and static arguments (the bound
`gdngen.call.Call`, the options with the chosen variant, device, precision); jit's own cache
keys the dtypes. Calls with a traced argument (under ``jax.jit``, ``jax.grad``, ``jax.vmap``,
``jax.shard_map``) trace the body as always, and so do calls on arrays sharded over several
devices. The compiled steps hold the Python the body ran when traced: `clear` forgets them
(tests that spy on that Python do, `tests/spies.py`). JAX only.
"""

from __future__ import annotations

import functools


def is_eager(arrays) -> bool:
    """Whether none of ``arrays`` (None allowed) is a JAX tracer, nor an array placed on
    several devices (a concrete sharded call keeps the eager path, whose layout checks raise
    their ValueError at the call: `gdngen.sharding.run`)."""
    import jax

    for x in arrays:
        if isinstance(x, jax.core.Tracer):
            return False
        if isinstance(x, jax.Array) and len(x.sharding.device_set) > 1:
            return False
    return True


@functools.lru_cache(maxsize=512)
def compiled(fn, static: tuple):
    """``jax.jit`` of ``fn(arrays, *static)`` taking the dict ``arrays``."""
    import jax

    def step(arrays):
        return fn(arrays, *static)

    return jax.jit(step)


def run(fn, arrays: dict, *static):
    """``fn(arrays, *static)`` as one compiled step (``static``: hashable Python values)."""
    return compiled(fn, static)(arrays)


def clear() -> None:
    """Forget the compiled steps (the next eager call of each traces and compiles again)."""
    compiled.cache_clear()
