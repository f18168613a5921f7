"""Packed sequences: many documents in one row, the state reset at each boundary (fla's
``cu_seqlens``), on the chunk algebra of `gdngen.algebra.chunkwise` /
`gdngen.algebra.chunkwise_channel`.

Convention (fla's): ``cu_seqlens`` int32 ``[N+1]``, ``cu_seqlens[0] == 0``, non-decreasing,
``cu_seqlens[-1] == T``; sequence n is the steps ``s_n = cu_seqlens[n] <= t < e_n =
cu_seqlens[n+1]`` of the single row (B = 1). ``initial_state`` and the returned final state are
``[N, Hv, Dv, Dk]``, one per sequence; an empty sequence returns its initial state.

How one row of chunks runs every sequence (no per-sequence loop, no re-padding), by linearity of
the recurrence in its state:

* **Main pass** over the whole row from a zero state, with the gate of each sequence's first
  step replaced by an exact zero (log g = -inf): every decay that straddles a boundary is an
  exact 0 (`gdngen.algebra.chunkwise.segment_sums`), so each sequence sees only its own steps, from
  a zero state. Its output is exact wherever the sequences' initial states are zero.
* **Initial states** (only when given), folded into the same walk (`_fold_initial_states`):
  sequence n's state is ``F_t S0_n + R_t`` with ``F_t`` the product of its gates since its
  first step. ``R`` is the walk's own state once each step of n's first partial chunk has
  ``v_t - S0_n F_t k_t`` for ``v_t`` (the walk resets the state at the sequence's start), y
  gains ``scale * S0_n F_t q_t`` there, and ``F S0_n`` at that chunk's end is injected into
  the state leaving it (`gdngen.algebra.chunkwise.forward`'s ``inject``), which carries it on
  through the sequence's later chunks. No extra chunk call and no extra triangular solve:
  two small products per step of a first partial chunk.
* **Final states**, scalar gates: taken inside the walk, each the chunk-end formula cut at the
  sequence's last step (`gdngen.algebra.chunkwise.extract_states`; the ffi_cpu packed kernels do the
  same), plus, for a sequence inside its first chunk, ``F S0_n`` there. Per-channel gates:
  a one-chunk call per sequence over its last partial chunk ``max(s_n, c_n) .. e_n`` (``c_n``
  the start of the chunk holding step e_n - 1) from the walk's state entering that chunk (the
  sequence's own state there, injection included) or, for a sequence that starts inside that
  chunk, from S0_n.

The one-chunk calls are the validated dense chunk path itself (masked beyond each sequence), so
their gradients and numerics are those of the dense path. Where the offsets are concrete (not
traced: MLX's eager calls), a window of at most `SHORT_WINDOW` steps runs the recurrence over its
own steps instead of a chunk, and the folded initial states' products span the longest first
window rather than a whole chunk. A whole sequence that short (a decode row, a verify window)
then runs only its recurrence, for y and its final state, from S0 (one step for a decode row):
the walk neither folds its initial state nor extracts its final state (each a product over a
chunk's width per sequence), where the walk takes ``last`` for a subset of the sequences.
"""

from __future__ import annotations

import numpy as np

from gdngen.algebra import chunkwise, layer_inputs, recurrent

__all__ = ["cu_seqlens_from_segment_ids", "packed_row"]


def cu_seqlens_from_segment_ids(segment_ids) -> np.ndarray:
    """MaxText-style ``segment_ids [T]`` (equal ids on each document's steps, documents
    contiguous) -> ``cu_seqlens`` int32 ``[N+1]``: a boundary wherever the id changes."""
    ids = np.asarray(segment_ids).reshape(-1)
    if ids.size == 0:
        raise ValueError("segment_ids is empty, expected [T] with T >= 1")
    cuts = np.flatnonzero(ids[1:] != ids[:-1]) + 1
    return np.concatenate([[0], cuts, [ids.size]]).astype(np.int32)


# ------------------------------------------------------------------------------ the row plan


class _Plan:
    """Index arrays of one packed row (framework arrays, from possibly traced offsets).

    For every step t: ``seq[t]`` its sequence, ``is_start[t]`` whether it is that sequence's
    first step. Per sequence n, its first partial chunk ``starts <= t < first_end`` and its
    last one ``last_begin <= t < ends``; `_window` gives a window's ``(index, valid)``.
    """

    def __init__(self, xp, offsets, T: int, C: int):
        m = xp.module
        i32 = m.int32
        starts, ends = offsets[:-1], offsets[1:]
        self.N = int(starts.shape[0])
        t = m.arange(T).astype(i32)
        self.seq = (ends[None, :] <= t[:, None]).astype(i32).sum(axis=1)  # [T]
        self.is_start = m.take(starts, self.seq, axis=0) == t
        self.starts, self.ends = starts, ends
        self.first_end = m.minimum(ends, (starts // C + 1) * C)  # first partial chunk's end
        self.nonempty = ends > starts
        self.last_chunk = m.maximum((ends - 1) // C, 0)
        chunk_start = self.last_chunk * C
        self.from_state = (starts < chunk_start) & self.nonempty
        self.last_begin = m.maximum(starts, chunk_start)
        self.C = C

    @staticmethod
    def _window(xp, begin, end, steps, T):
        """``(index [n, W], valid [n, W])`` of windows ``begin <= t < end`` over ``steps``
        ``[W]`` (steps clipped into range where not valid)."""
        index = begin[:, None] + steps
        return xp.module.minimum(index, T - 1), index < end[:, None]


def _gather(xp, x, index):
    """Row ``x [1, T, ...]`` at ``index [N, C]`` -> ``[N, C, ...]``."""
    flat = xp.module.take(x[0], index.reshape(-1), axis=0)
    return flat.reshape(index.shape + tuple(x.shape[2:]))


def _one_chunk(xp, dense, window, q, k, v, g, beta, mask, S0):
    """``dense`` on each sequence's ``window`` (B = N rows of one chunk), from S0
    ``[N, Hv, Dv, Dk]``; steps outside the window (or masked) are masked steps."""
    index, valid = window
    if mask is not None:
        valid = valid & _gather(xp, mask, index)
    return dense(*(_gather(xp, x, index) for x in (q, k, v, g, beta)), S0, valid)


#: a window of at most this many steps (a decode row, a verify window) runs the recurrence one
#: step at a time (`gdngen.algebra.recurrent.recurrent_forward`) in place of a padded chunk
SHORT_WINDOW = 16


def _concrete(x):
    """``x`` as a NumPy array, or None while a framework traces it (jit, mx.compile)."""
    try:
        return np.asarray(x)
    except (TypeError, ValueError, RuntimeError):  # traced (jit, mx.compile): not known here
        return None


def _sequence_order(m, groups):
    """int32 indices that put the concatenation of groups of sequences (NumPy indices, each
    sequence in one group) back in sequence order: ``take(concatenated, order, axis=0)``."""
    return m.array(np.argsort(np.concatenate(groups)).astype(np.int32))


def _short_windows(xp, window, q, k, v, g, beta, mask, S0, *, scale, gate):
    """The recurrence on each row's ``window`` ``(index [n, W], valid [n, W])`` from S0
    ``[n, Hv, Dv, Dk]``: ``(y [n, W, Hv, Dv] (0 outside the window), S [n, Hv, Dv, Dk])``."""
    index, valid = window
    if mask is not None:
        valid = valid & _gather(xp, mask, index)
    q, k, v, g, beta = (_gather(xp, x, index) for x in (q, k, v, g, beta))
    g, beta = layer_inputs.fold_mask(xp, g, beta, valid, gate)
    y, S = recurrent.recurrent_forward(xp, q, k, v, g, beta, S0, scale=scale, gate=gate)
    return xp.where(valid[..., None, None], y, 0.0), S


def _windows(xp, dense, scale, begin, end, T, C, q, k, v, g, beta, mask, S0, *, gate):
    """Each sequence's window ``begin <= t < end`` (at most C steps) from S0 ``[N, Hv, Dv,
    Dk]``: ``(y [N, W, Hv, Dv], S [N, Hv, Dv, Dk])``, W = C but where every window is short.

    A dense call of one chunk per sequence (`_one_chunk`), except where the lengths are known
    here (not traced) and the walk's ``scale`` is: rows of at most `SHORT_WINDOW` steps then
    run the recurrence over their longest window alone (a decode row is one step, not a
    padded chunk), the others a chunk each."""
    m = xp.module
    i32 = m.int32
    b, e = (None, None) if scale is None else (_concrete(begin), _concrete(end))
    if b is None or e is None:
        return _one_chunk(xp, dense, _Plan._window(xp, begin, end, m.arange(C).astype(i32), T),
                          q, k, v, g, beta, mask, S0)
    short = (e - b) <= SHORT_WINDOW
    groups = [(np.flatnonzero(short), int((e - b)[short].max(initial=1)), True),
              (np.flatnonzero(~short), C, False)]
    parts = []
    for rows, W, stepwise in groups:
        if not rows.size:
            continue
        at = m.array(rows.astype(np.int32))
        window = _Plan._window(xp, m.take(begin, at, axis=0), m.take(end, at, axis=0),
                               m.arange(W).astype(i32)[None, :], T)
        S0_rows = m.take(S0, at, axis=0)
        parts.append((rows, *(_short_windows(xp, window, q, k, v, g, beta, mask, S0_rows,
                                             scale=scale, gate=gate) if stepwise else
                              _one_chunk(xp, dense, window, q, k, v, g, beta, mask, S0_rows))))
    if len(parts) == 1:
        return parts[0][1:]
    W = max(y.shape[1] for _, y, _ in parts)
    ys = [y if y.shape[1] == W else m.concatenate(
        [y, xp.zeros((y.shape[0], W - y.shape[1]) + tuple(y.shape[2:]))], axis=1)
        for _, y, _ in parts]
    order = _sequence_order(m, [rows for rows, _, _ in parts])
    return (m.take(m.concatenate(ys, axis=0), order, axis=0),
            m.take(m.concatenate([S for _, _, S in parts], axis=0), order, axis=0))


def packed_row(xp, dense, walk, q, k, v, g, beta, initial_state, mask, cu_seqlens, *,
               gate, chunk_size, scale=None):
    """Packed-row gated delta (module docstring); q ``[1, T, Hk, Dk]`` etc. float32,
    ``initial_state [N, Hv, Dv, Dk]`` or None, ``cu_seqlens`` int32 ``[N+1]`` (checked by the
    caller). The backend provides, both scaling q themselves and differentiable in every input
    and output:

    * ``dense(q, k, v, g, beta, S0, mask) -> (y, S_final)``: its whole dense call (used on one
      chunk per sequence, B = N, masked y zeroed);
    * ``walk(q, k, v, g, beta, inject, last) -> (y, S_in, S_end)``: its chunk walk over the row
      from a zero state, gates already masked and reset; ``inject`` None or ``(states [N, Hv,
      Dv, Dk], at [N_chunks] int32)``: ``states[at[j]]`` added to the state leaving chunk j
      where ``at[j] >= 0`` (`chunk_injection`); then either ``S_end [N, Hv, Dv,
      Dk]``, the state after each sequence's last step (``last`` int32 ``[N]``, -1 for an
      empty sequence, whose S_end is not read; a subset of the sequences where the walk has
      ``short_rows_apart``), with S_in None; or S_end None and ``S_in
      [N_chunks, Hv, Dv, Dk]``, the states entering the chunks (each sequence's last chunk
      then runs through ``dense`` from them). A walk with ``resets_at_starts`` (ffi_cpu's
      packed kernels) gets the row's gates as they are (masks folded, no reset) and ``inject =
      (S0 [N, Hv, Dv, Dk] or None, starts [N] int32)``: it resets the state at each sequence's
      first step, folds each initial state (times that step's gate) into its first chunk and
      returns every S_end, an empty sequence's its S0 (no `_fold_initial_states` pass, no
      reset of the gates here).

    Returns ``(y [1, T, Hv, Dv], final_state [N, Hv, Dv, Dk])``."""
    m = xp.module
    _, T, _, Dk = q.shape
    Hv, Dv = v.shape[2], v.shape[3]
    plan = _Plan(xp, cu_seqlens.astype(m.int32), T, chunk_size)
    N, C = plan.N, plan.C
    scale = getattr(walk, "scale", None) if scale is None else scale
    if scale is None:
        raise ValueError("packed_row: scale is None and the walk has no .scale, expected the "
                         "call's scale")
    M = -(-T // C)
    g_row, beta_row = layer_inputs.fold_mask(xp, g, beta, mask, gate)
    last = xp.where(plan.nonempty, plan.ends - 1, -1).astype(m.int32)
    if getattr(walk, "resets_at_starts", False):  # the walk does the rest (ffi_cpu)
        y, _, S_end = walk(q, k, v, g_row, beta_row, (initial_state, plan.starts), last)
        return (y if mask is None else xp.where(mask[..., None, None], y, 0.0)), S_end
    S0 = xp.zeros((N, Hv, Dv, Dk)) if initial_state is None else initial_state
    # where the offsets are concrete, sequences of at most SHORT_WINDOW steps (decode rows)
    # run their own recurrence (y and final state) and the walk serves the others, for a walk
    # that takes ``last`` for any of the sequences (``walk.short_rows_apart``)
    short = _short_sequences(plan) if getattr(walk, "short_rows_apart", False) else None
    rows = None if short is None else np.setdiff1d(np.arange(N), short).astype(np.int32)

    def of(x):  # x [N, ...] on the sequences the walk serves
        return x if rows is None else m.take(x, m.array(rows), axis=0)

    inject = folded = None
    if initial_state is not None and (rows is None or rows.size):
        folded = _fold_initial_states(xp, plan, q, k, g_row, S0, mask, scale=scale, gate=gate,
                                      skip=short)
        # chunk j's leaving state gets the decayed S0 of the sequence holding the chunk's last
        # step when that sequence started in chunk j and goes on past its end
        j = m.arange(M).astype(m.int32)
        owner = m.take(plan.seq, m.minimum((j + 1) * C, T) - 1, axis=0)
        goes_on = ((m.take(plan.starts, owner, axis=0) >= j * C)
                   & (m.take(plan.ends, owner, axis=0) > (j + 1) * C))
        inject = (folded.S_first, xp.where(goes_on, owner, -1).astype(m.int32))
    reset = plan.is_start.reshape((1, T) + (1,) * (g.ndim - 2))
    g_reset = xp.where(reset, -float("inf") if gate == "log" else 0.0, g_row)
    y, S_in, S_end = walk(q, k, v if folded is None else v - folded.v_shift, g_reset, beta_row,
                          inject, of(last))
    if folded is not None:
        y = y + folded.y_shift
    if short is not None:
        at = m.array(short.astype(np.int32))
        y_short, S_short = _windows(xp, dense, scale, m.take(plan.starts, at, axis=0),
                                    m.take(plan.ends, at, axis=0), T, C, q, k, v, g, beta, mask,
                                    m.take(S0, at, axis=0), gate=gate)
        y = _with_windows(xp, plan, y, y_short, short)
    if mask is not None:
        y = xp.where(mask[..., None, None], y, 0.0)
    if S_end is None:  # each sequence's last partial chunk, from the state entering it
        entering = m.take(S_in, of(plan.last_chunk), axis=0)
        start = xp.where(of(plan.from_state)[:, None, None, None], entering, of(S0))
        S_end = _windows(xp, dense, scale, of(plan.last_begin), of(plan.ends), T, C, q, k, v,
                         g, beta, mask, start, gate=gate)[1]
    else:
        if folded is not None:  # a sequence ending in its first chunk: plus S0's decayed part
            S_end = S_end + xp.where(of(plan.ends <= plan.first_end)[:, None, None, None],
                                     of(folded.S_first), 0.0)
        S_end = xp.where(of(plan.nonempty)[:, None, None, None], S_end, of(S0))
    if short is None:
        return y, S_end
    order = _sequence_order(m, [rows, short])
    return y, m.take(m.concatenate([S_end, S_short], axis=0), order, axis=0)


def _with_windows(xp, plan, y, y_short, short):
    """The row ``y [1, T, Hv, Dv]`` with the steps of the sequences ``short`` (NumPy indices)
    taken from their windows ``y_short [n, W, Hv, Dv]`` (window i: sequence short[i] from its
    first step)."""
    m = xp.module
    W = y_short.shape[1]
    slot = np.full(plan.N, -1, np.int32)
    slot[short] = np.arange(short.size, dtype=np.int32)
    at, _, _ = _window_steps(xp, plan, m.array(np.maximum(slot, 0) * W),
                             m.full((plan.N,), W, m.int32))
    taken = m.take(y_short.reshape((-1,) + tuple(y_short.shape[2:])), at, axis=0)[None]
    inside = m.take(m.array(slot), plan.seq, axis=0) >= 0  # [T]: the step has a window
    return xp.where(inside[None, :, None, None], taken, y)


def _window_steps(xp, plan, base, width):
    """Each row step's place in windows laid end to end, sequence n's ``width[n]`` steps from
    its first step at ``base[n]`` (int32 ``[N]``): ``(at, offset, width_t)``, each ``[T]``:
    ``at`` clamped into the step's window (the caller masks the steps outside it), the step's
    offset into its sequence and its window's width."""
    m = xp.module
    offset = m.arange(plan.seq.shape[0]).astype(m.int32) - m.take(plan.starts, plan.seq, axis=0)
    width_t = m.take(width, plan.seq, axis=0)
    at = m.maximum(m.take(base, plan.seq, axis=0) + m.minimum(offset, width_t - 1), 0)
    return at, offset, width_t


def _short_sequences(plan):
    """NumPy indices of the sequences of at most `SHORT_WINDOW` steps (decode rows, verify
    windows), where the offsets are concrete (MLX's eager calls); None where they are traced
    or no sequence is that short. `packed_row` runs these by the recurrence over their own
    steps (`_windows`: one step for a decode row), not through the walk's chunk-wide products
    (the initial state's fold, the final state's extraction)."""
    b, e = _concrete(plan.starts), _concrete(plan.ends)
    if b is None or e is None:
        return None
    short = np.flatnonzero((e - b) <= SHORT_WINDOW)
    return short if short.size else None


class _Folded:
    """`_fold_initial_states`' result: ``v_shift``, ``y_shift`` (row layout, zero outside
    the sequences' first partial chunks) and ``S_first [N, Hv, Dv, Dk]``."""

    def __init__(self, v_shift, y_shift, S_first):
        self.v_shift, self.y_shift, self.S_first = v_shift, y_shift, S_first


def _fold_initial_states(xp, plan, q, k, g, S0, mask, *, scale, gate, skip=None):
    """Each sequence's initial state folded into the walk (no extra chunk call, no solve).

    Write sequence n's state as ``S_t = F_t S0_n + R_t`` with ``F_t`` the product of its gates
    from its first step s_n through t (per channel: ``S0_n diag(F_t)``). Then R follows the
    same recurrence from a zero state with ``v_t`` replaced by ``v_t - S0_n F_t k_t``, which is
    what the walk runs (the walk resets the state at s_n), and ``y_t`` gains
    ``scale * S0_n F_t q_t``. Both terms are formed on the sequence's first partial chunk
    only; where the sequence goes on past that chunk, ``F S0_n`` at its end (``S_first``) is
    injected into the state leaving the chunk, and the walk carries it on exactly.

    ``F_t`` is a cumulative product over at most C gates from s_n (a direct sum of log gates,
    never a difference of cumulative sums; a zero gate an exact 0). ``g`` the row's gates,
    masks folded; masked steps get no shift. ``skip``: NumPy indices of sequences left out
    (no shift, a zero ``S_first``: `packed_row` runs them on their own). Returns a
    `_Folded`."""
    m = xp.module
    T = q.shape[1]
    Hv, Dv = S0.shape[1], S0.shape[2]
    vector = g.ndim == 4
    flats_k, flats_q, firsts = [], [], []
    base, width = [], []  # per group: [n] where each sequence's window starts in the flat
    groups = _fold_groups(plan, skip)
    offset = 0  # steps of the windows formed so far
    for rows, W in groups:
        if W == 0:  # skipped sequences: no window
            n = int(rows.size)
            firsts.append(xp.zeros((n, Hv, Dv, S0.shape[3])))
            base.append(m.zeros((n,), m.int32))
            width.append(m.zeros((n,), m.int32))
            continue
        at = None if rows is None else m.array(rows.astype(np.int32))
        starts, first_end, S0_rows = (x if at is None else m.take(x, at, axis=0)
                                      for x in (plan.starts, plan.first_end, S0))
        n = int(starts.shape[0])
        index, valid = _Plan._window(xp, starts, first_end, m.arange(W).astype(m.int32)[None, :],
                                     T)  # [n, W]
        gw = _gather(xp, g, index)  # [n, W, Hv(, Dk)]
        valid_g = valid.reshape(valid.shape + (1,) * (gw.ndim - 2))
        if gate == "log":
            F = xp.exp(xp.cumsum(xp.where(valid_g, gw, 0.0), axis=1, reverse=False))
        else:
            F = xp.cumprod(xp.where(valid_g, gw, 1.0), axis=1, reverse=False)
        F = xp.where(valid_g, F, 0.0)  # [n, W, Hv(, Dk)]
        flats_k.append(_response(xp, S0_rows, F, _gather(xp, k, index)).reshape((n * W, Hv, Dv)))
        flats_q.append(_response(xp, S0_rows, F, _gather(xp, q, index)).reshape((n * W, Hv, Dv)))
        last = m.maximum(first_end - starts - 1, 0)  # [n] the window's last step
        F_last = m.take_along_axis(F, last.reshape((n, 1) + (1,) * (F.ndim - 2)), axis=1)[:, 0]
        firsts.append(S0_rows * (F_last[:, :, None, :] if vector else F_last[:, :, None, None]))
        base.append(offset + W * (m.arange(n).astype(m.int32)))
        width.append(m.full((n,), W, m.int32))
        offset += n * W
    if len(groups) == 1:
        flat_k, flat_q, S_first, base, width = flats_k[0], flats_q[0], firsts[0], base[0], width[0]
    else:  # back to sequence order
        order = _sequence_order(m, [rows for rows, _ in groups])
        flat_k, flat_q = m.concatenate(flats_k, axis=0), m.concatenate(flats_q, axis=0)
        S_first, base, width = (m.take(m.concatenate(x, axis=0), order, axis=0)
                                for x in (firsts, base, width))

    # windows -> row steps: each step of a first partial chunk belongs to exactly one window
    at, offset, W_t = _window_steps(xp, plan, base, width)
    inside = (offset < W_t) & (m.arange(T).astype(m.int32) <
                                m.take(plan.first_end, plan.seq, axis=0))
    if mask is not None:
        inside = inside & mask[0]

    def to_row(flat):  # [windows' steps, Hv, Dv] -> [1, T, Hv, Dv]
        return xp.where(inside[None, :, None, None], m.take(flat, at, axis=0)[None], 0.0)

    return _Folded(to_row(flat_k), to_row(flat_q) * scale, S_first)


def _fold_groups(plan, skip=None):
    """``[(rows, W)]``: the sequences whose first windows `_fold_initial_states` forms together,
    W steps each. Traced offsets: all of them (rows None), W = C. Concrete ones (MLX's eager
    calls): the windows of at most `SHORT_WINDOW` steps and the others, each group as wide as
    its longest window, and ``skip`` (NumPy indices, concrete offsets only) as ``(skip, 0)``."""
    b, e = _concrete(plan.starts), _concrete(plan.first_end)
    if b is None or e is None:
        return [(None, plan.C)]
    lengths = e - b
    kept = np.ones(plan.N, bool)
    if skip is not None:
        kept[skip] = False
    short = lengths <= SHORT_WINDOW
    groups = [(np.flatnonzero(sel), max(int(lengths[sel].max(initial=1)), 1))
              for sel in (short & kept, ~short & kept) if sel.any()]
    if skip is not None and skip.size:
        groups.append((np.asarray(skip), 0))
    return [(None, groups[0][1])] if len(groups) == 1 else groups


def _response(xp, S0, F, x):
    """``[n, W, Hv, Dv]``: ``S0_n (F_t * x_t)`` per value head, for ``S0 [n, Hv, Dv, Dk]``, the
    products of gates ``F [n, W, Hv(, Dk)]`` and key-head vectors ``x [n, W, Hk, Dk]``."""
    n, W, Hk, Dk = x.shape
    Hv, Dv = S0.shape[1], S0.shape[2]
    r = Hv // Hk
    S0g = S0.reshape((n, Hk, r, Dv, Dk))
    if F.ndim == 4:
        out = xp.einsum("ngrvk,nwgrk->nwgrv", S0g, F.reshape((n, W, Hk, r, Dk)) * x[:, :, :, None])
    else:
        out = xp.einsum("ngrvk,nwgk->nwgrv", S0g, x) * F.reshape((n, W, Hk, r))[..., None]
    return out.reshape((n, W, Hv, Dv))


def chunk_injection(xp, inject, shape):
    """The per-chunk ``[N_chunks, Hv, Dv, Dk]`` of `packed_row`'s ``inject`` pair (zeros where
    no state is injected; None: all zeros)."""
    if inject is None:
        return xp.zeros(shape)
    states, at = inject
    taken = xp.module.take(states, xp.module.maximum(at, 0), axis=0)
    return xp.where((at >= 0)[:, None, None, None], taken, 0.0)


def chunk_walk(xp, packed_core, *, scale, gate, chunk_size, extracts=False):
    """The ``walk`` of `packed_row` over a chunk-layout ``packed_core(q, k, v, gates, beta,
    inject) -> (Y, S_in)`` (`gdngen.algebra.chunkwise.forward` with ``inject`` from a zero state),
    or,
    ``extracts``, ``packed_core(q, k, v, gates, beta, inject, chunk, row) -> (Y, S_end)``
    (each sequence's state after its last step, `gdngen.algebra.chunkwise.extract_states`)."""

    def walk(q, k, v, g, beta, inject, last):
        _, T, Hk, Dk = q.shape
        Hv, Dv = v.shape[2], v.shape[3]
        r, C = Hv // Hk, chunk_size
        M = -(-T // C)
        pad = M * C - T
        if pad:  # identity steps
            q, k, v, beta = (xp.pad_time(x, pad, 0.0) for x in (q, k, v, beta))
            g = xp.pad_time(g, pad, 0.0 if gate == "log" else 1.0)
        gates = chunkwise.to_chunks(g, M, C, (Hk, r)) if g.ndim == 4 else \
            chunkwise.to_chunks(g[..., None], M, C, (Hk, r))[..., 0]
        inject = chunk_injection(xp, inject, (M, Hv, Dv, Dk))
        arrays = (chunkwise.to_chunks(q * scale, M, C, (Hk,)), chunkwise.to_chunks(k, M, C, (Hk,)),
                  chunkwise.to_chunks(v, M, C, (Hk, r)), gates,
                  chunkwise.to_chunks(beta[..., None], M, C, (Hk, r))[..., 0],
                  inject.reshape((M, 1, Hk, r, Dv, Dk)))
        if not extracts:
            Y, S_in = packed_core(*arrays)
            return chunkwise.from_chunks(Y, T), S_in.reshape((M, Hv, Dv, Dk)), None
        chunk = xp.module.maximum(last, 0) // C
        Y, S_end = packed_core(*arrays, chunk, xp.where(last >= 0, last - chunk * C, -1))
        return chunkwise.from_chunks(Y, T), None, S_end.reshape((last.shape[0], Hv, Dv, Dk))

    walk.scale = scale  # `packed_row` runs short first windows' recurrence at the same scale
    walk.short_rows_apart = True  # ``last`` may name any of the sequences (`packed_row`)
    return walk
