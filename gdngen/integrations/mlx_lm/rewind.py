"""``RewindableCache``: mlx-lm's ``ArraysCache`` for a gated-delta layer that speculative
decoding can trim (built on first patch, `_rewindable_cache_class`), and the ``make_cache``
that hands it out while a ``patch(inference=True)`` is active."""

from __future__ import annotations

import mlx.core as mx

from gdngen.integrations.mlx_lm import route

_REWINDABLE: type | None = None  # RewindableCache, built on first patch (it subclasses mlx-lm's)
#: how many of the latest steps a rewindable cache can take back (`RewindableCache.max_steps`)
MAX_REWIND = 16
#: `RewindableCache.replay`'s default
REPLAY = True


class _Segment:
    """One recorded call of T steps: the state and conv window ``[B, C, K-1]`` before it (None:
    zeros, as mlx-lm's layers take a missing entry), the conv window's timeline ``[B, K-1+T,
    C]`` (the window before, then the call's masked inputs: the window after p steps is
    ``timeline[:, p:p+K-1]``), and either the state after each step ``states [B, T, Hv, Dv,
    Dk]`` or what replays its first p steps (``replay``: the gate and beta projections ``a``,
    ``b``, the ``mask`` and the layer's mixer parameters; `_replayed`)."""

    __slots__ = ("replay", "start_conv", "start_state", "states", "steps", "timeline")

    def __init__(self, start_state, start_conv, states, timeline, steps, replay=None):
        self.start_state, self.start_conv = start_state, start_conv
        self.states, self.timeline, self.steps, self.replay = states, timeline, steps, replay

    def arrays(self) -> list:
        """The arrays this record holds (for its memory)."""
        held = [self.start_state, self.start_conv, self.states, self.timeline]
        if self.replay is not None:
            held += [self.replay[n] for n in ("a", "b", "mask")]
        return [x for x in held if x is not None]

    def keep(self, keep: int):
        """Keep the first ``keep`` steps; the state and conv window ``[B, K-1, C]`` after
        them."""
        K1 = self.timeline.shape[1] - self.steps
        self.timeline, self.steps = self.timeline[:, :keep + K1], keep
        if self.states is not None:
            self.states = self.states[:, :keep]
            state = self.states[:, -1]
        else:
            self.replay = {n: (x[:, :keep] if n in ("a", "b", "mask") and x is not None else x)
                           for n, x in self.replay.items()}
            state = _replayed(self)
        return state, self.timeline[:, keep:keep + K1]


def _replayed(segment: _Segment):
    """The state after the segment's (kept) steps: one `gdngen.mlx.gated_delta_mixer` call over
    them from its start state and conv window (the output gate ``z`` zeros: only the state is
    read)."""
    from gdngen import mlx as gdngen_mlx

    r = dict(segment.replay)
    K1 = segment.timeline.shape[1] - segment.steps
    x = segment.timeline[:, K1:]
    B, T = x.shape[:2]
    z = mx.zeros((B, T, r["Hv"], r["Dv"]), x.dtype)
    _, state, _ = gdngen_mlx.gated_delta_mixer(mixed_qkv=x, z=z, conv_state=segment.start_conv,
                                               initial_state=segment.start_state, **r)
    return state


def _rewindable_cache_class() -> type:
    """`RewindableCache` (built once: it subclasses mlx-lm's ``ArraysCache``, and is put in
    ``mlx_lm.models.cache``'s namespace so ``load_prompt_cache`` finds it by name)."""
    global _REWINDABLE
    if _REWINDABLE is not None:
        return _REWINDABLE
    from mlx_lm.models import cache as cache_module

    class RewindableCache(cache_module.ArraysCache):
        """mlx-lm's ``ArraysCache`` for a gated-delta layer, trimmable: speculative decoding
        (``mlx_lm.generate.speculative_generate_step``) rewinds it after a verify window.

        The layer's calls through `gdngen.mlx.gated_delta_mixer` record their steps: a call of
        T <= `max_steps` tokens, its start state and the conv window's timeline; a longer call
        (a prefill) is a barrier. ``trim(n)`` puts back the state and
        conv window of n steps ago, across calls, up to `max_steps` steps; past what is recorded
        (a prefill, a call that did not go through the mixer) it trims what it can and returns
        the count, as mlx-lm's caches do (``KVCache.trim``), never a state it did not record.
        A verify window is recorded as its start state and inputs (`replay`: a trim replays the
        kept steps, one mixer call) or as every step's state (``replay = False``: a trim is a
        slice, up to ``max_steps * B * Hv * Dv * Dk * 4`` bytes more); `recorded_bytes`.
        """

        max_steps = MAX_REWIND
        #: how a verify window is recorded: True, the state at its start and its inputs
        #: (a trim replays the kept steps: one mixer call); False, the state after every step
        #: (a trim is a slice). docs/SERVING.md has the measurement behind the default.
        replay = REPLAY

        def is_trimmable(self):
            return True

        def recorded_bytes(self) -> int:
            """Bytes of the arrays the record holds beyond mlx-lm's cache entries."""
            seen, total = set(), 0
            for segment in getattr(self, "_segments", []):
                for x in segment.arrays():
                    if id(x) not in seen:
                        seen.add(id(x))
                        total += x.nbytes
            return total

        def forget(self):
            """Drop the recorded steps: the cache cannot rewind past its current state."""
            self._segments = []

        def record(self, family, start_state, start_conv, states, timeline, steps,
                   replay=None):
            """A mixer call of ``family`` from ``start_state`` / ``start_conv`` (``[B, C,
            K-1]``, as the mixer takes it) with the conv timeline ``[B, K-1+T, C]`` (the
            mixer's `_conv_timeline`) of its ``steps`` tokens: ``states`` ``[B, T, Hv, Dv,
            Dk]``, or ``replay`` (the mixer's keywords but mixed_qkv, z and the states:
            `_Segment`), None both for a barrier."""
            segments = getattr(self, "_segments", [])
            self._family = family
            recorded = states is not None or replay is not None
            if not recorded or start_state is not getattr(self, "_head", None):
                segments = []  # a barrier, or the state changed since the latest record
            if recorded:
                segments.append(_Segment(start_state, start_conv, states, timeline, steps,
                                         replay))
                while len(segments) > 1 and sum(g.steps for g in segments[1:]) >= self.max_steps:
                    segments.pop(0)
            self._segments = segments
            self._head = self.cache[family.state_slot]

        def trim(self, n):
            n = int(n)
            if n <= 0:
                return 0
            segments = getattr(self, "_segments", [])
            family = getattr(self, "_family", None)
            recorded = sum(g.steps for g in segments)
            if family is None or self.cache[family.state_slot] is not self._head:
                recorded = 0
            n = min(n, recorded)  # mlx-lm's contract: trim what it can, return the count
            if n == 0:
                return 0
            left = n
            while left:
                last = segments[-1]
                if left >= last.steps:
                    segments.pop()
                    left -= last.steps
                    if not left:
                        state, windows = last.start_state, last.start_conv
                        if windows is not None:
                            windows = mx.swapaxes(windows, 1, 2)
                    continue
                state, windows = last.keep(last.steps - left)
                left = 0
            self.cache[family.state_slot] = state
            slots = family.conv_slots
            parts = ([None] * len(slots) if windows is None
                     else mx.split(windows, len(slots), axis=-1))
            for slot, part in zip(slots, parts):
                self.cache[slot] = part
            self._head = state
            self._segments = segments
            if self.lengths is not None:
                self.lengths = self.lengths + n
            if self.left_padding is not None:
                self.left_padding = self.left_padding + n
            return n

        @property
        def state(self):
            return self.cache, self.left_padding, self.lengths

        @state.setter
        def state(self, v):
            self.cache, self.left_padding, self.lengths = v
            self.forget()

        def filter(self, batch_indices):
            self.forget()
            super().filter(batch_indices)

        def extend(self, other):
            self.forget()
            super().extend(other)

    RewindableCache.__module__ = cache_module.__name__
    cache_module.RewindableCache = RewindableCache
    _REWINDABLE = RewindableCache
    return RewindableCache


def _rewindable_make_cache(original):
    """A model class's ``make_cache`` whose ``ArraysCache`` entries are rewindable
    while a ``patch(inference=True)`` is active."""

    def make_cache(self):
        caches = original(self)
        active = route._ACTIVE
        if active is None or not active.inference or not active.mixer:
            return caches
        rewindable = _rewindable_cache_class()
        base = rewindable.__mro__[1]
        out = []
        for c in caches:
            if type(c) is base:
                r = rewindable(len(c.cache))
                r.cache, r.left_padding, r.lengths = c.cache, c.left_padding, c.lengths
                c = r
            out.append(c)
        return out

    make_cache.__gdngen_original__ = original
    return make_cache
