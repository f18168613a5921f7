"""``RewindableCache``: mlx-lm's ``ArraysCache`` for a gated-delta layer that speculative
decoding can trim (built on first patch, `_rewindable_cache_class`), and the ``make_cache``
that hands it out while a ``patch(inference=True)`` is active."""

from __future__ import annotations

import mlx.core as mx

from gdngen.integrations.mlx_lm import route

_REWINDABLE: type | None = None  # RewindableCache, built on first patch (it subclasses mlx-lm's)
#: how many of the latest steps a rewindable cache can take back (`RewindableCache.max_steps`)
MAX_REWIND = 16


class _Segment:
    """One recorded call of T steps: the state and conv window ``[B, K-1, C]`` before it (None:
    zeros, as mlx-lm's layers take a missing entry), the state after each step ``[B, T, Hv, Dv,
    Dk]`` and the conv window's timeline ``[B, K-1+T, C]`` (the window before, then the call's
    masked inputs: the window after p steps is ``timeline[:, p:p+K-1]``)."""

    __slots__ = ("start_conv", "start_state", "states", "timeline")

    def __init__(self, start_state, start_conv, states, timeline):
        self.start_state, self.start_conv = start_state, start_conv
        self.states, self.timeline = states, timeline

    @property
    def steps(self) -> int:
        return int(self.states.shape[1])


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
        T <= `max_steps` tokens returns every step's state (``return_states="steps"``, the
        verify window's states written as the recurrence walks) and the conv window's
        timeline; a longer call (a prefill) is a barrier. ``trim(n)`` puts back the state and
        conv window of n steps ago, across calls, up to `max_steps` steps; past what is recorded
        (a prefill, a call that did not go through the mixer) it trims what it can and returns
        the count, as mlx-lm's caches do (``KVCache.trim``), never a state it did not record.
        Memory: up to `max_steps` states of the layer
        (``max_steps * B * Hv * Dv * Dk * 4`` bytes) beyond mlx-lm's cache.
        """

        max_steps = MAX_REWIND

        def is_trimmable(self):
            return True

        def forget(self):
            """Drop the recorded steps: the cache cannot rewind past its current state."""
            self._segments = []

        def record(self, family, start_state, start_conv, states, timeline):
            """A mixer call of ``family`` from ``start_state`` / ``start_conv`` (``[B, C,
            K-1]``, as the mixer takes it) with the conv timeline ``[B, K-1+T, C]`` (the
            mixer's `_conv_timeline`): ``states`` ``[B, T, Hv, Dv, Dk]``, None for a barrier."""
            segments = getattr(self, "_segments", [])
            self._family = family
            if states is None or start_state is not getattr(self, "_head", None):
                segments = []  # a barrier, or the state changed since the latest record
            if states is not None:
                segments.append(_Segment(start_state, start_conv, states, timeline))
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
                keep = last.steps - left
                K1 = last.timeline.shape[1] - last.steps
                last.states = last.states[:, :keep]
                last.timeline = last.timeline[:, :keep + K1]
                state, windows = last.states[:, -1], last.timeline[:, keep:keep + K1]
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
