"""One tolerance: `gdngen validate`, `gdngen build` and `gdngen tune` accept and reject the same
variants, by `gdngen.tolerance.allowed_error`."""

from __future__ import annotations

import dataclasses
import sys
import types

import pytest

from gdngen import registry, tolerance, validate
from gdngen.backends import portable
from gdngen.config import VariantConfig
from gdngen.problem import Problem
from gdngen.spec import BackendSpec
from gdngen.tools import build
from gdngen.variant import Variant

NAME = "planted_error"
#: the planted backend's own tolerance per precision (looser than float32's 5e-5 from tf32 on)
TOLERANCES = {"ieee": 5e-5, "tf32": 1e-3, "bf16": 1e-2}
#: (precision, relative error planted in y, accepted?) on either side of each threshold
PLANTED = [("ieee", 2e-5, True), ("ieee", 2e-4, False), ("tf32", 5e-4, True),
           ("tf32", 3e-3, False), ("bf16", 5e-3, True), ("bf16", 4e-2, False)]


@dataclasses.dataclass(frozen=True)
class Config(VariantConfig):
    backend = NAME
    chunk_size: int = 32
    error: float = 0.0
    precision: str = "ieee"


def _gated_delta(q, k, v, g, beta, initial_state=None, *, mask, scale, gate, variant):
    """The xla path with y scaled by (1 + error): y's relative error is exactly ``error`` (the
    gradients are left exact)."""
    import jax

    from gdngen.jax import gated_delta

    y, state = gated_delta(q, k, v, g, beta, initial_state, mask=mask, scale=scale, gate=gate,
                           variant=Variant("xla", {"chunk_size": variant["chunk_size"],
                                                   "solve_block": 8, "save_states": True}))
    return y + variant["error"] * jax.lax.stop_gradient(y), state


@pytest.fixture
def planted(monkeypatch):
    module = types.ModuleType("planted_error_backend")
    module.__file__ = __file__
    module.SPEC = BackendSpec(
        name=NAME, framework="jax", config=Config,
        space=lambda problem, device=None: [Config(32, e, p) for p, e, _ in PLANTED],
        default=lambda problem, device=None: Config(), entry=_gated_delta,
        tolerances=TOLERANCES, device_kinds=("cpu",), source_modules=(__name__,))
    monkeypatch.setitem(sys.modules, module.__name__, module)
    registry.register(NAME, module.__name__)
    yield [Variant(NAME, {"chunk_size": 32, "error": e, "precision": p}) for p, e, _ in PLANTED]
    registry.unregister(NAME)


def test_allowed_error_is_the_looser_of_dtype_and_precision():
    xla = Variant("xla", {"chunk_size": 64, "solve_block": 8, "save_states": True})
    assert tolerance.allowed_error(xla, "float32") == 5e-5
    assert tolerance.allowed_error(xla, "float32", "tf32") == portable.TOLERANCES["tf32"]
    assert tolerance.allowed_error(xla, "bfloat16") == 2e-2
    tpu = registry.default_variant("pallas_tpu", Problem(1, 2, 128, 128))
    assert tolerance.allowed_error(tpu, "float32", "bf16") == 5e-5  # its own precision: ieee
    tpu = Variant("pallas_tpu", dict(tpu.as_dict(), precision="tf32"))
    assert tolerance.allowed_error(tpu, "float32") == 2e-4
    with pytest.raises(ValueError, match="dtype must be one of"):
        tolerance.allowed_error(tpu, "int8")
    with pytest.raises(ValueError, match="precision must be one of"):
        tolerance.allowed_error(tpu, "float32", "fp8")
    rows = tolerance.table()
    assert ("metal", "bf16", "float32", 5e-2) in rows and ("ffi_cpu", "tf32", "float32", 5e-5) \
        in rows


def test_build_and_tune_accept_and_reject_the_same_planted_variants(planted, tmp_path):
    from gdngen import tune
    from gdngen.tune.search import _spec
    from gdngen.tune.worker import _worker

    problem = Problem(1, 2, 16, 16)
    cases = ["short"]
    built = build.build(NAME, problem, tmp_path, cases=cases, variant_list=planted)
    build_verdict = {r.variant: r.status == "passed" for r in built}
    target = tune.Target("cpu", "jax", NAME, problem, precision="bf16", seq_len=64)
    settings = tune.Settings(cases=tuple(cases))
    tune_verdict = {}
    for variant in planted:
        out = _worker(_spec(target, settings, variant, validate=True, time=None))
        assert out["status"] == "ok", out
        tune_verdict[variant] = out["validation"]["passed"]
    validate_verdict = {v: all(r.passed for r in validate.run_battery(None, variant=v,
                                                                      cases=cases))
                        for v in planted}
    expected = {v: ok for v, (_, _, ok) in zip(planted, PLANTED)}
    assert build_verdict == tune_verdict == validate_verdict == expected
    for r, variant in zip(built, planted):
        assert r.tolerance == tolerance.allowed_error(variant, "float32")
