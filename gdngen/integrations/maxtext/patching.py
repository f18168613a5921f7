"""`patch` / `unpatch` / `patched`: the version check, and the replacement of
``jax_chunk_gated_delta_rule`` in every loaded MaxText module that binds it (aliases too); the
state they change is `gdngen.integrations.maxtext.rule`'s."""

from __future__ import annotations

import contextlib
import importlib.metadata
import inspect
import re
import sys
from collections.abc import Iterator
from types import ModuleType

from gdngen.integrations._rebind import rebind, restore
from gdngen.integrations.maxtext import rule

SUPPORTED_MAXTEXT = ">=0.2.5,<0.3"
_SUPPORTED_LOW, _SUPPORTED_HIGH = (0, 2, 5), (0, 3, 0)  # tested: maxtext 0.2.5
_MODULE, _FUNCTION_NAME = "maxtext.models.qwen3", "jax_chunk_gated_delta_rule"
_EXPECTED_PARAMETERS = ("query", "key", "value", "g", "beta", "chunk_size", "initial_state",
                        "use_qk_norm_in_gdn", "cp_axis", "compute_dtype")


def _parse_version(version: str) -> tuple[int, int, int]:
    found = re.match(r"\s*(\d+)\.(\d+)(?:\.(\d+))?", version)
    if not found:
        raise RuntimeError(f"cannot parse the installed MaxText version {version!r}; gdngen's "
                           f"MaxText integration supports maxtext{SUPPORTED_MAXTEXT}")
    return int(found.group(1)), int(found.group(2)), int(found.group(3) or 0)


def check_maxtext_version(version: str | None = None) -> str:
    """Return MaxText's version (the installed one by default) if it is in `SUPPORTED_MAXTEXT`.

    Raises ``RuntimeError`` naming the installed and the supported versions otherwise.
    """
    if version is None:
        try:
            version = importlib.metadata.version("maxtext")
        except importlib.metadata.PackageNotFoundError:
            raise RuntimeError("gdngen's MaxText integration needs MaxText (pip install "
                               "'gdngen[maxtext]', Python >= 3.12); it is not installed") from None
    if not _SUPPORTED_LOW <= _parse_version(version) < _SUPPORTED_HIGH:
        raise RuntimeError(f"gdngen's MaxText integration supports maxtext{SUPPORTED_MAXTEXT}, "
                           f"but maxtext {version} is installed; install a supported MaxText or "
                           f"run without gdngen.integrations.maxtext.patch()")
    return version


def _check_signature(fn) -> None:
    names = tuple(inspect.signature(fn).parameters)
    if names != _EXPECTED_PARAMETERS:
        raise RuntimeError(f"{_MODULE}.{_FUNCTION_NAME} has parameters {names}, expected "
                           f"{_EXPECTED_PARAMETERS}; this MaxText is not supported")


def _maxtext_modules() -> list[ModuleType]:
    return [module for name, module in sorted(sys.modules.items())
            if isinstance(module, ModuleType)
            and (name == "maxtext" or name.startswith("maxtext."))]


def patch(*, chunk_size: int | None = None, device: str | None = None,
          precision: str = "ieee") -> tuple[str, ...]:
    """Send MaxText's ``jax_chunk_gated_delta_rule`` to gdngen; return the patched modules.

    Every global of a loaded MaxText module bound to MaxText's function is replaced
    (``maxtext.models.qwen3``'s own, which the ``Qwen3NextGatedDeltaNet`` layer calls, with and
    without its ``shard_map``; aliases too). The calls run ``gdngen.load_tuned("jax", device,
    precision)``: the tuned variant for the device and each call's shape class (else the default
    variant), MaxText's ``cp_axis`` as gdngen's ``context_axis``, float32 accumulation whatever
    MaxText's ``compute_dtype`` (`gdngen.integrations.maxtext.rule`). ``chunk_size`` None: the
    variant's chunk (MaxText's ``gdn_chunk_size`` is ignored); an int forces that chunk.
    ``precision`` "ieee" (default) matches MaxText's ``Precision.HIGHEST`` matmuls.
    Idempotent: calling it again takes the new options. Patch before tracing: a ``jax.jit``
    function already traced keeps the path it was traced with. Raises ``RuntimeError`` for an
    unsupported MaxText (before changing anything).
    """
    if chunk_size is not None and (not isinstance(chunk_size, int) or isinstance(chunk_size, bool)
                                   or chunk_size < 1):
        raise ValueError(f"chunk_size must be None or a positive int, got {chunk_size!r}")
    check_maxtext_version()
    from gdngen.entry import load_tuned

    tuned = load_tuned("jax", device=device, precision=precision)
    qwen3 = importlib.import_module(_MODULE)
    current = getattr(qwen3, _FUNCTION_NAME)
    if rule._ACTIVE is not None:
        original = rule._ACTIVE.original
    elif current is rule.gdngen_chunk_gated_delta_rule:  # installed by hand, not by patch()
        if rule._ORIGINAL is None:
            raise RuntimeError(f"{_MODULE}.{_FUNCTION_NAME} was replaced by hand before any "
                               "patch(); MaxText's original is unknown")
        original = rule._ORIGINAL
    else:
        original = current
    _check_signature(original)
    rule._ORIGINAL = original
    if rule._ACTIVE is None:
        rule._ACTIVE = rule._Patch(original, tuned, chunk_size)
    rule._ACTIVE.tuned, rule._ACTIVE.chunk_size = tuned, chunk_size
    rule._ACTIVE.replaced += rebind(_maxtext_modules(), original,
                                    rule.gdngen_chunk_gated_delta_rule)
    return patched_modules()


def unpatch() -> None:
    """Put MaxText's original function back wherever `patch` replaced it; no-op if unpatched."""
    if rule._ACTIVE is None:
        return
    restore(rule._ACTIVE.replaced, rule._ACTIVE.original)
    rule._ACTIVE = None


@contextlib.contextmanager
def patched(*, chunk_size: int | None = None, device: str | None = None,
            precision: str = "ieee") -> Iterator[tuple[str, ...]]:
    """`patch` for the duration of a ``with`` block, yielding the patched module names.

    On exit the previous state returns: unpatched if it was, else the outer patch's options.
    """
    active = rule._ACTIVE
    outer = None if active is None else (active.tuned, active.chunk_size)
    modules = patch(chunk_size=chunk_size, device=device, precision=precision)
    try:
        yield modules
    finally:
        if outer is None:
            unpatch()
        elif rule._ACTIVE is not None:
            rule._ACTIVE.tuned, rule._ACTIVE.chunk_size = outer


def is_patched() -> bool:
    """Whether a `patch` is active."""
    return rule._ACTIVE is not None


def patched_modules() -> tuple[str, ...]:
    """Sorted names of the modules whose ``jax_chunk_gated_delta_rule`` the active patch
    replaced."""
    if rule._ACTIVE is None:
        return ()
    return tuple(sorted({module.__name__ for module, _ in rule._ACTIVE.replaced}))
