"""The active patch (`_ACTIVE`, set by `gdngen.integrations.mlx_lm.patch`) and the
``gated_delta_update`` it installs (`_routed_gated_delta_update`). Other modules read the
state as ``route._ACTIVE`` (it is rebound by each patch / unpatch)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from types import ModuleType

from gdngen.integrations.mlx_lm.update import _takes_chunkwise_path, gdngen_gated_delta_update


@dataclass
class _Patch:
    original: Callable
    inference: bool
    chunk_size: int | None
    mixer: bool = True
    replaced: list[tuple[ModuleType, str]] = field(default_factory=list)
    layers: list[tuple[type, Callable]] = field(default_factory=list)
    caches: list[tuple[type, Callable]] = field(default_factory=list)


_ACTIVE: _Patch | None = None
_ORIGINAL: Callable | None = None  # mlx-lm's function, kept for stale references after unpatch


def _routed_gated_delta_update(q, k, v, a, b, A_log, dt_bias, state=None, mask=None, *,
                               use_kernel=True, lower_bound=None, allow_neg_eigval=False):
    """What `patch` installs as ``gated_delta_update``.

    Runs gdngen when a patch is active, the call is on the training path (``use_kernel=False``,
    or any call with ``patch(inference=True)``) and gdngen takes it (`_takes_chunkwise_path`:
    a per-head ``[B,T,Hv]`` or per-channel ``[B,T,Hv,Dk]`` gate, head dims in 16..256, a
    negative or no ``lower_bound``); otherwise mlx-lm's original function.
    """
    active = _ACTIVE
    if (active is None or (use_kernel and not active.inference)
            or not _takes_chunkwise_path(q, v, a, A_log, dt_bias, lower_bound)):
        return _ORIGINAL(q, k, v, a, b, A_log, dt_bias, state, mask, use_kernel=use_kernel,
                         lower_bound=lower_bound, allow_neg_eigval=allow_neg_eigval)
    return gdngen_gated_delta_update(q, k, v, a, b, A_log, dt_bias, state, mask,
                                     use_kernel=use_kernel, lower_bound=lower_bound,
                                     allow_neg_eigval=allow_neg_eigval,
                                     chunk_size=active.chunk_size)
