"""The crossover stage: up to which T a tuned variant evaluates through its recurrent kernel.

Every backend's config has ``recurrent_below`` (`gdngen.config.recurrent_switch`): a call of
T < recurrent_below runs its forward through the recurrent kernel (the state held on-chip,
one step at a time), longer calls through the chunk kernels. After the search picks a variant,
the tuner times the forward alone (with an incoming state, as a generating model calls it) of
both paths of that variant at each T of `SEQ_LENS`, interleaved in one trial subprocess
(`gdngen.tools.timing.time_forward`), and records the measured curve and the crossover in the cache
entry; `crossover_from` turns the curve into ``recurrent_below``. The cache lets a call shorter
than every tuned T bucket use the smallest tuned bucket's entry (`gdngen.cache.lookup`), so the
tuned crossover decides decode-length calls.
"""

from __future__ import annotations

from gdngen.config import RECURRENT_ALWAYS
from gdngen.variant import Variant

#: the T at which both paths are timed
SEQ_LENS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def has_switch(variant: Variant) -> bool:
    """Whether ``variant``'s backend has a recurrent kernel (a ``recurrent_below`` param)."""
    return "recurrent_below" in variant.as_dict()


def paths(variant: Variant) -> dict:
    """``{"recurrent": variant that always takes the recurrent kernel, "chunkwise": one that
    never does}``."""
    return {"recurrent": variant.replace(recurrent_below=RECURRENT_ALWAYS),
            "chunkwise": variant.replace(recurrent_below=0)}


def crossover_from(curve: list[dict]) -> int:
    """``recurrent_below`` from a measured ``curve`` of ``{"T", "recurrent_s", "chunkwise_s"}``
    rows: the T after the longest measured T at which the recurrent kernel was faster (so no
    longer measured T favours it; a noisy win below a loss does not move the switch past the
    loss), twice the longest T when it won there, 1 (never) when it won nowhere."""
    rows = sorted(curve, key=lambda r: r["T"])
    if not rows:
        raise ValueError("curve must have at least one row")
    wins = [i for i, r in enumerate(rows) if r["recurrent_s"] < r["chunkwise_s"]]
    if not wins:
        return 1
    last = wins[-1]
    return rows[last + 1]["T"] if last + 1 < len(rows) else 2 * rows[last]["T"]


def describe(entry: dict) -> str:
    """One line on a cache entry's crossover: the tuned ``recurrent_below`` and the curve."""
    measured = entry.get("crossover")
    recurrent_below = Variant.from_json(entry["variant"]).get("recurrent_below")
    if not measured:
        return f"recurrent below T={recurrent_below} (not measured)"
    points = ", ".join(f"T={r['T']}: {r['recurrent_s'] * 1e3:.2f}/{r['chunkwise_s'] * 1e3:.2f}"
                       for r in measured["curve"])
    return (f"recurrent below T={recurrent_below} (tuned; forward ms recurrent/chunkwise "
            f"{points})")
