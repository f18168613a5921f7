"""Load stage: choose the variant that runs a call (explicit, else tuned, else default).

`run` is the last stage of ``gated_delta``'s body (`gdngen.entry`). Without an
explicit variant or chunk size it consults the tuned cache (`gdngen.cache`) for the attached
device, the call's shape class (`Problem`), precision "ieee" and the call's sequence-length
bucket. With nothing usable there it runs the default variant of the device's preferred backend
that implements the call (`default_choice`: the generated kernels of the device — ffi_cpu on a
CPU host with a compiler, pallas_tpu on a TPU, pallas_gpu on an NVIDIA GPU, metal on an Apple
GPU — else the framework's portable path). Setting ``GDNGEN_NO_TUNED=1`` skips the cache.

The decision is memoised per (framework, shape class, T bucket, device, precision) and dropped
when a tuned file of the device changes: at once when this process wrote it
(`gdngen.cache.writes`), else at the next stat of the files' stamps, at most `RESTAT_S` after
the last; so at decode length it costs a dictionary lookup. `gdngen.entry.load_tuned` returns a
callable doing the same per call for a chosen device and precision policy;
`gdngen.entry.TunedGatedDelta.explain` says what it picked and why.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from dataclasses import dataclass
from typing import NamedTuple

from gdngen import registry, settings
from gdngen.problem import Problem, problem_of
from gdngen.shape import CallShape
from gdngen.variant import Variant

ENV_NO_TUNED = settings.ENV_NO_TUNED


@dataclass(frozen=True)
class Choice:
    """The variant chosen for a call: ``source`` is "explicit", "tuned" or "default";
    ``reason`` says why; ``entry`` / ``path`` name the tuned entry used, if any;
    ``kernel_path`` which kernels run (`for_length`), ``norm_path`` where the output's gated
    norm runs (a ``norm_gate`` call's, `gdngen.backend.Backend.norm_in_stores`),
    ``conv_path`` where the causal conv runs (a ``conv_weight`` call's,
    `gdngen.backend.Backend.conv_path`)."""

    variant: Variant
    source: str
    reason: str
    device: str | None = None
    precision: str = "ieee"
    entry: dict | None = None
    path: str | None = None
    kernel_path: str | None = None
    norm_path: str | None = None
    conv_path: str | None = None

    def __str__(self) -> str:
        where = f" on {self.device}" if self.device else ""
        text = f"{self.variant} ({self.source}{where}, precision {self.precision}): {self.reason}"
        return text + "".join(f"; {part}" for part in (
            self.kernel_path, self.conv_path, self.norm_path) if part)

    def for_length(self, T: int, vector_gate: bool = False, sequences: int | None = None
                   ) -> Choice:
        """This choice with ``kernel_path`` saying which kernels a call of ``T`` steps runs:
        the recurrent kernel below the variant's ``recurrent_below`` (the tuned crossover when
        the entry measured one, `gdngen.tune.crossover`), else the chunk kernels; a packed row
        of ``sequences`` sequences: `gdngen.backend.Backend.describe_packed`."""
        below = self.variant.get("recurrent_below")
        if sequences is not None:
            text = registry.get(self.variant.backend).describe_packed(self.variant, vector_gate,
                                                                      sequences)
            return dataclasses.replace(self, kernel_path=text)
        if below is None:
            return dataclasses.replace(self, kernel_path="chunk kernels")
        origin = "tuned crossover" if self.entry and self.entry.get("crossover") else \
            "untuned default crossover"
        if vector_gate and "vector" not in registry.get(self.variant.backend).tuned_gates:
            text = ("recurrent kernel forward (per-channel gates: no chunk kernels yet); the "
                    "gradient runs the portable chunkwise path")
        elif T < below:
            text = (f"recurrent kernel forward, T={T} < recurrent_below={below} ({origin}); "
                    "the gradient runs the chunk kernels")
        else:
            text = f"chunk kernels, T={T} >= recurrent_below={below} ({origin})"
        return dataclasses.replace(self, kernel_path=text)


def default_choice(framework: str, problem: Problem, device: str | None,
                   chunk_size: int | None = None) -> tuple[Variant, str]:
    """``(variant, reason)``: the default variant of the first backend ``device`` prefers
    (`gdngen.registry.backends_for`) that implements ``problem`` and, if given, runs
    ``chunk_size``; else the framework's portable backend."""
    passed = []
    for name in (registry.backends_for(device, framework) if device else ()):
        spec = registry.get(name)
        if spec.portable:
            continue
        ok, why = spec.capability(problem)
        if ok:
            variant = registry.default_variant(name, problem, device)
            try:
                variant = _with_chunk(variant, chunk_size)
            except ValueError as e:
                passed.append(f"{name}: {e}")
                continue
            return variant, f"default of {name}, {device}'s generated backend"
        passed.append(why)
    name = registry.portable(framework)
    variant = _with_chunk(registry.default_variant(name, problem), chunk_size)
    where = "" if device else " (the attached device is not in the device registry)"
    return variant, f"default of the portable {name} backend{where}" + \
        (f"; passed over: {'; '.join(passed)}" if passed else "")


def _with_chunk(variant: Variant, chunk_size: int | None) -> Variant:
    if chunk_size is None:
        return variant
    changed = variant.replace(chunk_size=chunk_size)
    registry.check_variant(changed)
    return changed


#: seconds a memoised decision is trusted before the tuned files are stat'ed again (a file
#: written by this process is seen at once: `gdngen.cache.writes`)
RESTAT_S = 0.25


class _Memo(NamedTuple):
    choice: Choice
    stamps: tuple  # the tuned files' stat stamps it was made from
    at: float  # time.monotonic() of the last stat
    writes: int  # gdngen.cache.writes() then


_CHOICES: dict = {}  # memo key -> _Memo


def clear_memo() -> None:
    """Forget memoised dispatch decisions (the next call looks again)."""
    _CHOICES.clear()


def _attached(framework: str) -> tuple[str | None, str]:
    from gdngen import devices

    found = devices.detect_framework(framework)
    return found.name, found.description


def choose(framework: str, shape: CallShape, dtype: str, *, device: str | None = None,
           precision: str = "ieee") -> Choice:
    """Tuned variant for this call's shape class and T bucket on ``device`` (default: the
    attached one), else `default_choice`. Memoised (see the module docstring)."""
    from gdngen import cache

    problem = problem_of(shape, dtype)
    disabled = settings.flag(ENV_NO_TUNED)
    described = None
    if device is None:
        device, described = _attached(framework)
    bucket = cache.seq_bucket(shape.T)
    dirs = tuple(cache.tuned_dirs())
    key = (framework, problem, bucket, device, precision, disabled, dirs)
    memo = _CHOICES.get(key)
    now = time.monotonic()
    if memo is not None and memo.writes == cache.writes() and now - memo.at < RESTAT_S:
        return memo.choice
    stamps = cache.file_stamps(device, dirs) if device is not None and not disabled else ()
    if memo is not None and memo.stamps == stamps:
        _CHOICES[key] = memo._replace(at=now, writes=cache.writes())
        return memo.choice
    fallback, why = default_choice(framework, problem, device)
    if disabled:
        choice = Choice(fallback, "default", f"tuned lookup disabled by {ENV_NO_TUNED}; {why}",
                        device, precision)
    elif device is None:
        choice = Choice(fallback, "default", f"attached device ({described}) is not in the "
                        f"device registry; {why}", None, precision)
    else:
        result = cache.lookup(device, registry.runnable(framework, problem, device), problem,
                              precision, shape.T)
        if result.entry is None:
            choice = Choice(fallback, "default", f"{result.reason}; {why}", device, precision)
        else:
            choice = Choice(Variant.from_json(result.entry["variant"]), "tuned", result.reason,
                            device, precision, result.entry, str(result.path))
    _CHOICES[key] = _Memo(choice, stamps, now, cache.writes())
    return choice


def check_variant(framework: str, variant, chunk_size: int | None = None) -> None:
    """ValueError unless ``variant`` is a `Variant` of a backend of ``framework``, valid for it
    (`gdngen.registry.check_variant`), and agreeing with an explicit ``chunk_size``."""
    if not isinstance(variant, Variant):
        raise ValueError(  # noqa: TRY004 - an option's bad value: ValueError, as every check
            f"variant must be a gdngen.Variant, got {type(variant).__name__}")
    backends = registry.names(framework)
    if variant.backend not in backends:
        raise ValueError(f"variant backend {variant.backend!r} does not run on {framework}; "
                         f"expected one of {backends}")
    registry.check_variant(variant)
    if chunk_size is not None and chunk_size != variant.get("chunk_size", chunk_size):
        raise ValueError(f"chunk_size={chunk_size} conflicts with the variant's chunk_size="
                         f"{variant['chunk_size']}")


def decide(framework: str, shape: CallShape, dtype: str, variant: Variant | None = None,
           chunk_size: int | None = None, *, device: str | None = None,
           precision: str = "ieee") -> Choice:
    """The `Choice` for one call: an explicit ``variant`` (`check_variant`ed by
    `gdngen.entry.bind`); else with ``chunk_size`` the default variant at that chunk; else the
    tuned variant for ``device`` (default: the attached one) and ``precision`` over the default
    (see `choose`)."""
    if variant is None and chunk_size is None:
        return choose(framework, shape, dtype, device=device, precision=precision)
    if variant is None:
        variant = default_choice(framework, problem_of(shape, dtype), _attached(framework)[0],
                                 chunk_size)[0]
    return Choice(variant, "explicit", "variant or chunk_size given", device, precision)


def resolve(framework: str, shape: CallShape, dtype: str, variant: Variant | None = None,
            chunk_size: int | None = None, *, device: str | None = None,
            precision: str = "ieee") -> Variant:
    """The variant of `decide`'s choice (an explicit one returned as given)."""
    if variant is not None:
        return variant
    return decide(framework, shape, dtype, None, chunk_size, device=device,
                  precision=precision).variant


_GATES: list = []
_LOCAL = threading.local()


def install_gate(gate) -> None:
    """Make ``gate(call, variant, device, precision) -> variant`` pass on (or replace) every
    chosen variant before it runs: `gdngen.firstuse.admitted`, installed when gdngen is
    imported (the check runs calls itself, so this module does not import it)."""
    if gate not in _GATES:
        _GATES.append(gate)


@contextlib.contextmanager
def ungated():
    """Within it, this thread's calls skip the installed gates (the battery's runners: their
    calls are the check)."""
    before = getattr(_LOCAL, "ungated", False)
    _LOCAL.ungated = True
    try:
        yield
    finally:
        _LOCAL.ungated = before


def run(call, operands, *, variant=None, device=None, precision="ieee"):
    """Choose the variant of the checked `gdngen.call.Call` (`resolve`; then the installed
    gates: a generated one only once it passed on the device, `gdngen.firstuse`) and run it on
    ``operands`` (`gdngen.prepare.prepared`) through its backend
    (`gdngen.backend.Backend.run`)."""
    chosen = resolve(call.framework, call.shape, call.dtype, variant, call.chunk_size,
                     device=device, precision=precision)
    if not getattr(_LOCAL, "ungated", False):
        for gate in _GATES:
            chosen = gate(call, chosen, device, precision)
    return registry.get(chosen.backend).run(call, operands, chosen)
