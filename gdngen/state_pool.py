"""Recurrent states kept in a pool, for serving: ``state_indices`` and ``state_dtype`` of
``gated_delta`` (both frameworks and ``load_tuned()``'s callable).

A server holds one state per request in a pool ``[P, Hv, Dv, Dk]``; a batch's row b (or, with
``cu_seqlens``, sequence b) reads ``pool[state_indices[b]]`` and writes its final state back
there, or to ``pool[output_state_indices[b]]`` when given (FlashInfer's name: a server keeps
the state before a verify window in its row while the new one goes to another). A negative
index is a padding row: it reads a zero state (``state_indices``) or writes nothing. All rows
are read before any is written. The call returns ``(y, pool')``, the pool with exactly the
written rows replaced:

* JAX: functional, ``pool.at[rows].set(final, mode="drop")``; under ``jax.jit`` with the pool
  donated (``donate_argnums``) XLA updates it in place (the compiled program aliases the pool's
  buffer to the returned one), so the untouched rows are never copied.
* MLX: the pool array is updated in place (``pool[rows] = final``, as mlx-lm's caches assign
  their states) and returned; the rows are gathered (and evaluated) first, so the update
  reuses the pool's buffer when nothing else holds it (a pool the caller keeps only in the
  array it passes and gets back). Padding rows write the value their target row ends with, so
  no row outside ``state_indices`` changes.

``state_dtype`` ("float32" default, or "bfloat16"): the dtype the states are stored in. The
pool (or ``initial_state``) must have it; the recurrence reads it as float32 and the returned
states are rounded to it. Compute stays float32.

Duplicate non-negative indices, or indices past the pool, are a ValueError naming
``state_indices`` / ``output_state_indices`` when the indices are concrete (not traced; MLX
reads them, which waits for them to be computed).
"""

from __future__ import annotations

import contextlib

import numpy as np

from gdngen.shape import dtype_name

__all__ = ["STATE_DTYPES", "as_dtype", "check_pool", "check_state_dtype", "gather", "scatter"]

STATE_DTYPES = ("float32", "bfloat16")


def check_state_dtype(state_dtype, initial_state) -> None:
    """ValueError unless ``state_dtype`` is one of `STATE_DTYPES` and ``initial_state`` (when
    given) is stored in it."""
    if state_dtype not in STATE_DTYPES:
        raise ValueError(f"state_dtype must be one of {STATE_DTYPES}, got {state_dtype!r}")
    if initial_state is not None and dtype_name(initial_state) != state_dtype:
        raise ValueError(f"initial_state has dtype {dtype_name(initial_state)}, expected "
                         f"{state_dtype} (state_dtype={state_dtype!r})")


def _concrete(framework: str, x):
    """``x`` as a NumPy array, or None when it is traced (jit / mx.compile)."""
    if framework == "jax":
        import jax

        if isinstance(x, jax.core.Tracer):
            return None
        return np.asarray(x)
    try:
        return np.array(x)
    except (RuntimeError, ValueError):  # inside mx.compile: not evaluable
        return None


def check_pool(framework: str, pool, state_indices, rows: int, heads: tuple,
               output_state_indices=None) -> None:
    """ValueError naming the argument unless ``pool`` is ``[P, Hv, Dv, Dk]`` (``heads`` =
    (Hv, Dv, Dk)) and ``state_indices`` (and ``output_state_indices``, when given) int32
    ``[rows]`` (rows: B, or N with cu_seqlens), their non-negative entries distinct and below P
    when concrete."""
    if pool is None:
        raise ValueError("state_indices needs initial_state: the pool [P, Hv, Dv, Dk] the "
                         "rows read their states from")
    shape = tuple(pool.shape)
    if len(shape) != 4 or shape[1:] != tuple(heads) or shape[0] < 1:
        raise ValueError(f"initial_state has shape {shape}, expected a pool "
                         f"(P, {', '.join(map(str, heads))}) with P >= 1 (state_indices given)")
    _check_indices(framework, "state_indices", state_indices, rows, shape[0])
    if output_state_indices is not None:
        _check_indices(framework, "output_state_indices", output_state_indices, rows, shape[0])


def _check_indices(framework: str, name: str, indices, rows: int, size: int) -> None:
    if tuple(indices.shape) != (rows,):
        raise ValueError(f"{name} has shape {tuple(indices.shape)}, expected ({rows},): one "
                         "index per row (per sequence with cu_seqlens)")
    if dtype_name(indices) != "int32":
        raise ValueError(f"{name} has dtype {dtype_name(indices)}, expected int32")
    idx = _concrete(framework, indices)
    if idx is None:
        return
    live = idx[idx >= 0]
    if live.size and live.max() >= size:
        raise ValueError(f"{name} has {int(live.max())}, past the pool of {size} states")
    values, counts = np.unique(live, return_counts=True)
    if (counts > 1).any():
        raise ValueError(f"{name} repeats {values[counts > 1].tolist()}: two rows cannot "
                         "write the same state")


def gather(framework: str, pool, state_indices):
    """``(states, spare)``: the float32 states ``[rows, Hv, Dv, Dk]`` the rows start from
    (``pool[i]``, zeros for a negative ``i``) and, for MLX's `scatter`, ``pool[0]`` as stored
    (None for JAX). MLX evaluates both here when it can (not under ``mx.compile``), so no
    later op of the call holds the pool and its update can reuse the pool's buffer."""
    if framework == "jax":
        import jax.numpy as jnp

        valid = state_indices >= 0
        rows = jnp.take(pool, jnp.maximum(state_indices, 0), axis=0).astype(jnp.float32)
        return jnp.where(valid[:, None, None, None], rows, 0.0), None
    import mlx.core as mx

    valid = state_indices >= 0
    taken = mx.take(pool, mx.concatenate([mx.maximum(state_indices, 0),
                                          mx.zeros((1,), mx.int32)]), axis=0)
    rows, spare = taken[:-1].astype(mx.float32), taken[-1]
    states = mx.where(valid[:, None, None, None], rows, mx.zeros_like(rows))
    with contextlib.suppress(RuntimeError, ValueError):  # mx.compile: evaluated with the call
        mx.eval(states, spare)
    return states, spare


def scatter(framework: str, pool, state_indices, states, spare=None):
    """``pool`` with row ``state_indices[b]`` set to ``states[b]`` (rounded to the pool's dtype)
    for every non-negative index; JAX: a new array (in place when the pool is donated); MLX:
    ``pool`` itself, updated in place (``spare``: `gather`'s ``pool[0]``)."""
    if framework == "jax":
        import jax.numpy as jnp

        target = jnp.where(state_indices >= 0, state_indices, pool.shape[0])
        return pool.at[target].set(states.astype(pool.dtype), mode="drop")
    import mlx.core as mx

    # MLX's scatter has no "drop" mode: a padding row writes, at the first live row's index,
    # the value that row writes there (or, with no live row, pool[0] onto row 0): equal values
    # at a repeated index, whatever order the writes land in.
    valid = state_indices >= 0
    any_live = mx.any(valid)
    first = mx.argmax(valid.astype(mx.int32))
    fill_index = mx.where(any_live, state_indices[first], 0)
    fill_value = mx.where(any_live, states[first].astype(pool.dtype), spare)
    target = mx.where(valid, state_indices, fill_index)
    values = mx.where(valid[:, None, None, None], states.astype(pool.dtype), fill_value[None])
    pool[target] = values
    return pool


def as_dtype(framework: str, x, dtype: str):
    """``x`` cast to the dtype named ``dtype``."""
    if framework == "jax":
        import jax.numpy as jnp

        return x.astype(jnp.dtype(dtype))
    import mlx.core as mx

    return x.astype(getattr(mx, dtype))
