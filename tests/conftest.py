"""Fixtures shared by several test files."""

from __future__ import annotations

import gc
import os
import sys

import pytest

# XLA:CPU's YNNPACK fusions (jaxlib 0.10.2, and the flag is still there in 0.12) segfault on
# this project's AMD EPYC hosts in a fused transpose (slinky::can_fuse, a YnnFusionThunk on an
# XLA worker thread): every run of test_returned_states.py's
# test_gradients_through_kernel_chunk_states[ffi_cpu-vector] crashed, at a different Python line
# each time. An empty fusion-type list turns them off; XLA's own fusions run instead. Set before
# jax is imported (here, and inherited by the tests' subprocesses that keep XLA_FLAGS).
_NO_YNN = "--xla_cpu_experimental_ynn_fusion_type="
if _NO_YNN not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_NO_YNN}".strip()
# The suite runs the generated kernels with explicit variants through the battery (its own
# check); the first-use check of every other call (`gdngen.firstuse`) is on in
# tests/test_firstuse.py, which sets GDNGEN_VALIDATE itself. Inherited by subprocesses.
os.environ.setdefault("GDNGEN_VALIDATE", "off")


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_executables():
    """Releases each test module's compiled XLA executables when the module ends.

    An XLA:CPU executable holds ~18 memory maps; one suite process compiles thousands, and past
    the kernel's ``vm.max_map_count`` (65530) the next compile segfaults inside XLA.
    """
    yield
    jax = sys.modules.get("jax")
    if jax is not None:
        jax.clear_caches()
        gc.collect()


@pytest.fixture(scope="module")
def unoptimized_xla():
    """XLA on a CPU host without its backend optimizations (``jax_disable_most_optimizations``:
    LLVM at -O0) for a module that asks for it (``pytestmark =
    pytest.mark.usefixtures("unoptimized_xla")``): modules whose tests are compile-bound (about
    half their time) and whose checks (values against float64 within tolerance, shapes,
    residuals) do not depend on LLVM's optimizations. Every other module keeps them on."""
    try:
        import jax
    except ImportError:
        yield
        return
    flag = "jax_disable_most_optimizations"
    previous = jax.config.values.get(flag, False)
    jax.config.update(flag, previous or jax.default_backend() == "cpu")
    yield
    jax.config.update(flag, previous)


@pytest.fixture
def calls(monkeypatch):
    """Counts calls of gdngen.mlx.gated_delta and of mlx-lm's per-token gated_delta_ops (the
    mlx-lm integration tests: which path a patched model took)."""
    from mlx_lm.models import gated_delta as mlx_gated_delta

    import gdngen.mlx

    counts = {"gdngen": 0, "ops": 0}
    real_gdngen, real_ops = gdngen.mlx.gated_delta, mlx_gated_delta.gated_delta_ops

    def gdngen_spy(*args, **kwargs):
        counts["gdngen"] += 1
        return real_gdngen(*args, **kwargs)

    def ops_spy(*args, **kwargs):
        counts["ops"] += 1
        return real_ops(*args, **kwargs)

    monkeypatch.setattr(gdngen.mlx, "gated_delta", gdngen_spy)
    monkeypatch.setattr(mlx_gated_delta, "gated_delta_ops", ops_spy)
    return counts
