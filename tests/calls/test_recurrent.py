"""The recurrent call kind: a decode-length call (T below the variant's ``recurrent_below``) on
every registered backend, scalar and per-channel gates, against the float64 reference.

Each backend's forward of such a call runs its recurrent kernel and its VJP the chunk path
(`gdngen.config.recurrent_switch`). `gdngen.validate.check_case` runs the differentiated call
through the recurrent forward (``recurrent_below`` at `RECURRENT_ALWAYS`) and a forward-only call
through the chunk kernels (``y_other_path``, ``final_state_other_path``): both sides of the
switch, every gradient, a padding mask, exact gates, an initial state, GVA 3x and Dk != Dv
(battery cases ``short_masked``, ``vector_short_masked``), outputs poisoned. A backend's own
folder keeps what is particular: which kernel ran (spies), its sources, its lowering.
"""

from __future__ import annotations

import importlib.util

import pytest

from gdngen import registry, settings, validate
from gdngen.cases import get_case
from gdngen.config import RECURRENT_ALWAYS
from gdngen.problem import Problem

CASES = {"scalar": "short_masked", "vector": "vector_short_masked"}
#: (backend, gate) pairs behind the slow marker: each compiles the per-channel chunk VJP on JAX
#: (~40-90 s). `make test` runs their per-channel switch elsewhere: pallas_tpu / pallas_gpu in
#: tests/backends/pallas/test_recurrent_pallas_*.py (the recurrent kernel's forward and the
#: chunk-walk VJP against float64), xla's algebra as mlx's (the same framework-neutral code).
SLOW = {("xla", "vector"), ("pallas_tpu", "vector"), ("pallas_gpu", "vector")}
QUANTITIES = {"y", "final_state", "dq", "dk", "dv", "dbeta", "dinitial_state", "dg",
              "dg_linear", "y_other_path", "final_state_other_path"}


@pytest.fixture(autouse=True)
def _poisoned_outputs(monkeypatch):
    monkeypatch.setenv(settings.ENV_POISON_OUTPUTS, "1")


pytestmark = pytest.mark.usefixtures("unoptimized_xla")  # compile-bound: conftest


def _runnable(backend: str, problem: Problem):
    spec = registry.get(backend)
    if importlib.util.find_spec(spec.framework) is None:
        pytest.skip(f"{spec.framework} is not installed")
    ok, why = spec.capability(problem)
    if not ok:
        pytest.skip(f"{backend} cannot run here: {why}")
    return spec


@pytest.mark.parametrize("backend, gate", [
    pytest.param(b, g, marks=[pytest.mark.slow] if (b, g) in SLOW else [])
    for b in registry.names() for g in sorted(CASES)])
def test_short_call_on_both_sides_of_the_recurrent_switch(backend, gate):
    case = get_case(CASES[gate])
    problem = Problem(case.Hk, case.Hv, case.Dk, case.Dv, gate=gate)
    _runnable(backend, problem)
    variant = registry.default_variant(backend, problem).replace(
        chunk_size=case.chunk_size, recurrent_below=RECURRENT_ALWAYS)
    result = validate.check_case(backend, case, variant=variant)
    assert set(result.errors) >= QUANTITIES, sorted(result.errors)
    assert result.passed, result.errors


def test_the_battery_checks_the_chunk_path_of_a_call_above_the_switch():
    """The other side: a variant whose switch sends the case to the chunk kernels gets its
    forward-only check through the recurrent kernel (`gdngen.validate._other_path`)."""
    case = get_case("short_masked")
    problem = Problem(case.Hk, case.Hv, case.Dk, case.Dv)
    variant = registry.default_variant("mlx", problem).replace(chunk_size=case.chunk_size,
                                                               recurrent_below=0)
    assert validate._other_path(variant, case.T).get("recurrent_below") == RECURRENT_ALWAYS
    result = validate.check_case("mlx", case, variant=variant)
    assert set(result.errors) >= QUANTITIES and result.passed, result.errors
