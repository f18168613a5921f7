"""`patch` / `unpatch` / `patched`: the version check, the scan of mlx-lm's modules for
``gated_delta_update`` (aliases too) and the classes whose ``__call__`` and ``make_cache`` are
replaced; the state they change is `gdngen.integrations.mlx_lm.route`'s."""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import inspect
import pkgutil
import re
import sys
import warnings
from collections.abc import Iterator
from types import ModuleType

from gdngen.integrations._rebind import rebind, restore
from gdngen.integrations.mlx_lm import mixers, rewind, route

SUPPORTED_MLX_LM = ">=0.32,<0.33"
_SUPPORTED_LOW, _SUPPORTED_HIGH = (0, 32), (0, 33)  # tested: mlx-lm 0.32.2
_FUNCTION_NAME = "gated_delta_update"
_EXPECTED_PARAMETERS = ("q", "k", "v", "a", "b", "A_log", "dt_bias", "state", "mask",
                        "use_kernel", "lower_bound", "allow_neg_eigval")


def _patch_layers(active) -> None:
    """Install `_routed_mixer_call` on every `MIXER_LAYERS` class (once)."""
    for (module_name, class_name), family in mixers.MIXER_LAYERS.items():
        cls = getattr(importlib.import_module(module_name), class_name)
        if hasattr(cls.__call__, "__gdngen_original__"):
            continue
        original = cls.__call__
        cls.__call__ = mixers._routed_mixer_call(family, original)
        active.layers.append((cls, original))
    rewind._rewindable_cache_class()
    for module_name in sorted({m for m, _ in mixers.MIXER_LAYERS}):
        for cls in list(vars(importlib.import_module(module_name)).values()):
            method = vars(cls).get("make_cache") if isinstance(cls, type) else None
            if method is None or hasattr(method, "__gdngen_original__"):
                continue
            cls.make_cache = rewind._rewindable_make_cache(method)
            active.caches.append((cls, method))


# --------------------------------------------------------------------------- version / discovery


def _parse_version(version: str) -> tuple[int, int]:
    found = re.match(r"\s*(\d+)\.(\d+)", version)
    if not found:
        raise RuntimeError(f"cannot parse the installed mlx-lm version {version!r}; gdngen's "
                           f"mlx-lm integration supports mlx-lm{SUPPORTED_MLX_LM}")
    return int(found.group(1)), int(found.group(2))


def check_mlx_lm_version(version: str | None = None) -> str:
    """Return mlx-lm's version (the installed one by default) if it is in `SUPPORTED_MLX_LM`.

    Raises ``RuntimeError`` naming the installed and the supported versions otherwise.
    """
    if version is None:
        import mlx_lm

        version = str(mlx_lm.__version__)
    if not _SUPPORTED_LOW <= _parse_version(version) < _SUPPORTED_HIGH:
        raise RuntimeError(f"gdngen's mlx-lm integration supports mlx-lm{SUPPORTED_MLX_LM}, but "
                           f"mlx-lm {version} is installed; install a supported mlx-lm or "
                           f"run without gdngen.integrations.mlx_lm.patch()")
    return version


def _check_signature(fn) -> None:
    names = tuple(inspect.signature(fn).parameters)
    if names != _EXPECTED_PARAMETERS:
        raise RuntimeError(f"mlx_lm.models.gated_delta.{_FUNCTION_NAME} has parameters {names}, "
                           f"expected {_EXPECTED_PARAMETERS}; this mlx-lm is not supported")


def _source_mentions(module_name: str, word: str) -> bool:
    spec = importlib.util.find_spec(module_name)
    origin = getattr(spec, "origin", None)
    if not origin or not origin.endswith(".py"):
        return True  # no readable source: import it and look at its namespace
    with open(origin, encoding="utf-8") as source:
        return word in source.read()


def _modules_to_scan() -> list[ModuleType]:
    """mlx_lm.models submodules whose source names ``gated_delta_update`` (imported here; one
    that fails to import is skipped with a warning) plus every mlx_lm module already imported."""
    import mlx_lm.models

    for info in pkgutil.iter_modules(mlx_lm.models.__path__, "mlx_lm.models."):
        if info.name not in sys.modules and _source_mentions(info.name, _FUNCTION_NAME):
            try:
                importlib.import_module(info.name)
            except ImportError as err:  # a missing optional dependency: the model is unusable
                warnings.warn(f"gdngen: not patching {info.name}, which fails to import: {err}",
                              stacklevel=3)
    return [module for name, module in sorted(sys.modules.items())
            if isinstance(module, ModuleType) and (name == "mlx_lm" or name.startswith("mlx_lm."))]


# --------------------------------------------------------------------------- public API


def patch(*, inference: bool = False, chunk_size: int | None = None,
          mixer: bool = True) -> tuple[str, ...]:
    """Route mlx-lm's ``gated_delta_update`` training calls to gdngen; return the patched modules.

    Every global of an mlx_lm module bound to mlx-lm's original function is replaced (aliases
    too). ``inference=True`` also routes ``use_kernel=True`` calls. Idempotent: calling it again
    re-scans and takes the new options; `unpatch` restores the originals. Patch before building
    or compiling a train step: an ``mx.compile``d function keeps the path it was traced with.
    ``chunk_size`` None: each call runs the tuned variant of its shape class and length, else
    the default (`gdngen.dispatch`; decode-length calls take the recurrent kernel below the
    crossover); an int forces that chunk on the default variant.
    ``mixer`` (default): the whole linear-attention layer of the `MIXER_LAYERS` families
    (Qwen3-Next, Qwen3.5, Kimi Linear, Kimi K3, Bailing V3, OLMo hybrid) runs
    `gdngen.mlx.gated_delta_mixer` between its projections (the short convolution, norms, gates,
    recurrence and gated RMSNorm in one call; the conv and recurrent states carried in the
    layer's cache); ``mixer=False`` routes only
    ``gated_delta_update``.
    Raises ``RuntimeError`` for an unsupported mlx-lm (before changing anything).
    """
    if chunk_size is not None and (not isinstance(chunk_size, int) or isinstance(chunk_size, bool)
                                   or chunk_size < 1):
        raise ValueError(f"chunk_size must be None or a positive int, got {chunk_size!r}")
    check_mlx_lm_version()
    from mlx_lm.models import gated_delta as mlx_gated_delta

    original = route._ACTIVE.original if route._ACTIVE else getattr(mlx_gated_delta, _FUNCTION_NAME)
    if original is route._routed_gated_delta_update:  # installed by hand, not by patch()
        if route._ORIGINAL is None:
            raise RuntimeError("mlx_lm.models.gated_delta.gated_delta_update was replaced by "
                               "hand before any patch(); mlx-lm's original is unknown")
        original = route._ORIGINAL
    _check_signature(original)
    route._ORIGINAL = original
    if route._ACTIVE is None:
        route._ACTIVE = route._Patch(original, inference, chunk_size)
    route._ACTIVE.inference, route._ACTIVE.chunk_size = bool(inference), chunk_size
    route._ACTIVE.mixer = bool(mixer)
    _patch_layers(route._ACTIVE)
    route._ACTIVE.replaced += rebind(_modules_to_scan(), original,
                                     route._routed_gated_delta_update)
    return patched_modules()


def unpatch() -> None:
    """Put mlx-lm's original function back wherever `patch` replaced it; no-op if unpatched."""
    if route._ACTIVE is None:
        return
    restore(route._ACTIVE.replaced, route._ACTIVE.original)
    for cls, original in route._ACTIVE.layers:
        cls.__call__ = original
    for cls, original in route._ACTIVE.caches:
        cls.make_cache = original
    route._ACTIVE = None


@contextlib.contextmanager
def patched(*, inference: bool = False, chunk_size: int | None = None,
            mixer: bool = True) -> Iterator[tuple[str, ...]]:
    """`patch` for the duration of a ``with`` block, yielding the patched module names.

    On exit the previous state returns: unpatched if it was, else the outer patch's options.
    """
    active = route._ACTIVE
    outer = None if active is None else (active.inference, active.chunk_size, active.mixer)
    modules = patch(inference=inference, chunk_size=chunk_size, mixer=mixer)
    try:
        yield modules
    finally:
        if outer is None:
            unpatch()
        elif route._ACTIVE is not None:
            route._ACTIVE.inference, route._ACTIVE.chunk_size, route._ACTIVE.mixer = outer


def is_patched() -> bool:
    """Whether a `patch` is active."""
    return route._ACTIVE is not None


def patched_modules() -> tuple[str, ...]:
    """Sorted names of the modules whose ``gated_delta_update`` the active patch replaced."""
    if route._ACTIVE is None:
        return ()
    return tuple(sorted({module.__name__ for module, _ in route._ACTIVE.replaced}))
