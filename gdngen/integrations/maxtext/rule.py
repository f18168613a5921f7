"""gdngen's ``jax_chunk_gated_delta_rule`` for MaxText, and which calls it takes.

MaxText's conventions (``maxtext.models.qwen3``, 0.2.5), mapped exactly:

- q, k ``[B,T,H,Dk]``, v ``[B,T,H,Dv]``: the layer has already repeated q's and k's key heads
  to the value heads (``jnp.repeat``, so value head h reads key head h // (Hv/Hk), gdngen's
  GVA grouping); gdngen gets them as given, Hk = Hv;
- g ``[B,T,H]`` is the log decay (``-exp(A_log) * softplus(a + dt_bias)``): ``gate="log"``,
  kept float32 as MaxText keeps it;
- beta ``[B,T,H]`` in (0, 1) (already the sigmoid);
- the scale is ``Dk ** -0.5`` on q; ``use_qk_norm_in_gdn`` is MaxText's
  ``x * rsqrt(sum(x^2) + 1e-6)`` over Dk, gdngen's ``qk_norm=True`` (fused in the kernels);
- the state is ``[B,H,Dk,Dv]`` in MaxText and ``[B,Hv,Dv,Dk]`` float32 in gdngen (transposed
  both ways); the final state is returned, cast to ``compute_dtype``, only when an
  ``initial_state`` was given, else None, as MaxText does;
- q, k, v and beta are cast to ``compute_dtype`` first (MaxText's memory saving, so gdngen sees
  the same rounded inputs), but unlike MaxText's bfloat16 path, which rounds the scaled q, the
  WY factors and the chunk outputs to bfloat16 between float32 matmuls, gdngen accumulates and
  keeps every intermediate in float32; ``y`` (gdngen's, in ``compute_dtype``) is returned cast
  to the query's incoming dtype (in the layer the query already arrives in ``compute_dtype``);
- ``cp_axis`` (inside MaxText's ``shard_map``: the mesh axis, or a one-name tuple, that splits
  the sequence) becomes gdngen's ``context_axis``;
- ``chunk_size`` (MaxText's ``gdn_chunk_size``) is a choice of MaxText's implementation, not of
  the result: gdngen runs its tuned variant's chunk unless `patch` was given one.

Calls it does not take (two context axes at once, head dims outside 16..256, a rank other than
the above) run MaxText's original function.
"""

from __future__ import annotations

import dataclasses

__all__ = ["gdngen_chunk_gated_delta_rule", "takes"]

_UNSUPPORTED = object()


@dataclasses.dataclass
class _Patch:
    """The active patch: MaxText's original function, where it was replaced, the tuned
    callable and the options."""

    original: object
    tuned: object
    chunk_size: int | None = None
    replaced: list = dataclasses.field(default_factory=list)
    calls: int = 0  # calls gdngen took (traced calls count once per trace)


_ACTIVE: _Patch | None = None
_ORIGINAL = None  # MaxText's function, once seen


def context_axis(cp_axis):
    """gdngen's ``context_axis`` for MaxText's ``cp_axis`` (None, a name, or a tuple of names,
    `maxtext.models.qwen3.gdn_context_axes`): None, the one name, or `_UNSUPPORTED`."""
    if cp_axis is None or cp_axis == ():
        return None
    if isinstance(cp_axis, str):
        return cp_axis
    if isinstance(cp_axis, (tuple, list)) and len(cp_axis) == 1 and isinstance(cp_axis[0], str):
        return cp_axis[0]
    return _UNSUPPORTED


def takes(query, key, value, g, beta, initial_state, cp_axis) -> bool:
    """Whether gdngen takes this ``jax_chunk_gated_delta_rule`` call (else MaxText's runs)."""
    if context_axis(cp_axis) is _UNSUPPORTED:
        return False
    if query.ndim != 4 or key.shape != query.shape or value.ndim != 4 or g.ndim != 3:
        return False
    B, T, H, Dk = query.shape
    if value.shape[:3] != (B, T, H) or g.shape != (B, T, H) or beta.shape != (B, T, H):
        return False
    Dv = value.shape[3]
    if not (16 <= Dk <= 256 and 16 <= Dv <= 256):
        return False
    return initial_state is None or tuple(initial_state.shape) == (B, H, Dk, Dv)


def gdngen_chunk_gated_delta_rule(query, key, value, g, beta, chunk_size=64, initial_state=None,
                                  use_qk_norm_in_gdn=False, cp_axis=None, compute_dtype=None):
    """``maxtext.models.qwen3.jax_chunk_gated_delta_rule``'s signature and result ``(o,
    final_state or None)``, computed by gdngen's tuned variant (module docstring: the
    conventions; float32 accumulation whatever ``compute_dtype``). MaxText's own function
    runs for calls `takes` refuses, and when no patch is active."""
    import jax.numpy as jnp

    active = _ACTIVE
    if compute_dtype is None:
        compute_dtype = jnp.bfloat16
    if active is None or not takes(query, key, value, g, beta, initial_state, cp_axis):
        original = active.original if active is not None else _ORIGINAL
        if original is None:  # never patched: MaxText's function is still in its module
            from maxtext.models import qwen3

            original = qwen3.jax_chunk_gated_delta_rule
            if original is gdngen_chunk_gated_delta_rule:
                raise RuntimeError("maxtext.models.qwen3.jax_chunk_gated_delta_rule was replaced "
                                   "by hand before any patch(); MaxText's original is unknown")
        return original(query, key, value, g, beta, chunk_size=chunk_size,
                        initial_state=initial_state, use_qk_norm_in_gdn=use_qk_norm_in_gdn,
                        cp_axis=cp_axis, compute_dtype=compute_dtype)
    active.calls += 1
    out_dtype, compute = query.dtype, jnp.dtype(compute_dtype)
    q, k, v, b = (x.astype(compute) for x in (query, key, value, beta))
    state = None if initial_state is None else \
        jnp.swapaxes(initial_state.astype(jnp.float32), -1, -2)  # [B,H,Dk,Dv] -> [B,H,Dv,Dk]
    y, final = active.tuned(q, k, v, g.astype(jnp.float32), b, state,
                            scale=float(query.shape[-1]) ** -0.5, gate="log",
                            qk_norm=bool(use_qk_norm_in_gdn),
                            context_axis=context_axis(cp_axis), chunk_size=active.chunk_size)
    final = None if initial_state is None else jnp.swapaxes(final, -1, -2).astype(compute)
    return y.astype(out_dtype), final
