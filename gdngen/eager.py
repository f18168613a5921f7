"""A JAX ``gated_delta`` called eagerly runs as one compiled step.

Outside any JAX transformation the body of a call would run op by op, each jnp op dispatched
from Python: at decode lengths that is ~25 ms a call on a CPU against ~0.3 ms for the same
call under ``jax.jit`` (``benchmarks/bench_decode_step.py``). `run` runs it as one ``jax.jit``
of the call instead, built once per entry point, option set and chosen variant (`compiled`);
jit's own cache keys the shapes and dtypes. Before it, in Python, the call is checked
(`gdngen.call.check`, memoised per shapes and options), the values only a concrete call has are
read (``cu_seqlens``, ``state_indices``) and the variant is chosen as for any call
(`gdngen.dispatch.resolve`), so a new tuned entry is picked up on the next call, as before: the
chosen variant is part of the key. Calls with a traced argument (under ``jax.jit``,
``jax.grad``, ``jax.vmap``, ``jax.shard_map``) trace the body as always, and so do calls on
arrays sharded over several devices. The compiled steps hold the Python the body ran when
traced: `clear` forgets them (tests that spy on that Python do, `tests/spies.py`). JAX only.
"""

from __future__ import annotations

import functools

#: the array arguments of ``gated_delta``, in the order `run` passes them
ARRAYS = ("q", "k", "v", "g", "beta", "initial_state", "mask", "A_log", "dt_bias",
          "cu_seqlens", "state_indices")


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
def compiled(entry, static: tuple):
    """``jax.jit`` of ``entry(**arrays, **dict(static))`` taking the dict ``arrays``."""
    import jax

    options = dict(static)

    def step(arrays):
        return entry(**arrays, **options)

    return jax.jit(step)


def run(entry, arrays: dict, static: dict):
    """``entry(**arrays, **static)`` as one compiled step. ``static``: the call's Python options
    (hashable; the caller checked them), its chosen ``variant`` among them."""
    return compiled(entry, tuple(sorted(static.items())))(arrays)


def clear() -> None:
    """Forget the compiled steps (the next eager call of each traces and compiles again)."""
    compiled.cache_clear()
