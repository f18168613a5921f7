"""Packed rows (``cu_seqlens``, `gdngen.algebra.packed`) on the metal backend's own packed kernels
(`gdngen.backends.metal.render_packed`), validated in `gdngen.backends.metal.sim` as the dense
kernels are: the packed battery cases against the float64 reference (a sequence at a time), and the
dense render unchanged by the packed build."""

from __future__ import annotations

import pytest

from gdngen import Problem, registry, settings, validate
from gdngen.backends import metal
from gdngen.backends.metal import launch as metal_launch
from gdngen.backends.metal import sim as metal_sim
from gdngen.cases import get_case

pytest.importorskip("mlx.core", reason="the Metal backend runs through MLX")
pytestmark = pytest.mark.skipif(not metal_sim.available(), reason="no C++ compiler (g++)")

#: sha256 of the dense render of the default variant (save_states True / False), recorded
#: before the packed build existed (re-recorded when issue 45 corrected the templates'
#: comments): tuned cache entries are keyed on it, so the ``packed``
#: flag must leave the dense sources byte for byte as they were. (Changing the dense kernels
#: on purpose changes these, and invalidates the tuned metal entries.)
DENSE_SHA256 = {
    (Problem(2, 4, 64, 64), True):
        "0e25399f5a2022d86c263d81ec88007aef0e6465bc6d6edf4655dadecf7b6bfe",
    (Problem(2, 4, 64, 64), False):
        "ca90ae1a81aec7b2a304e8b3141f423aa882bdce7bffa47ab43a9efa3be5df0a",
    (Problem(2, 6, 32, 64), True):
        "edeb4e852a769d97bb9101250705c0eb9473c9a938483ed943b2ca49bd9c342c",
    (Problem(2, 6, 32, 64), False):
        "9812c3c7fbf8199cc8388f5753e46affa1e1c0298977828d42480ea998582b16",
}
#: the kernels the packed build changes (the state scans); every other source is the dense one
PACKED_KERNELS = {"fwd_scan.metal", "fwd_scan_save.metal", "fwd_scan_states.metal",
                  "bwd_scan.metal"}


@pytest.mark.parametrize("problem, save", list(DENSE_SHA256),
                         ids=[f"{p.key()}-save{s}" for p, s in DENSE_SHA256])
def test_dense_render_is_unchanged_by_the_packed_build(problem, save):
    v = registry.default_variant("metal", problem).replace(save_states=save)
    dense = metal.SPEC.render(v, problem)
    assert dense.sha256 == DENSE_SHA256[problem, save]
    build = metal.render_packed(v, problem)
    assert build.sha256 != dense.sha256
    assert set(build.sources) == set(dense.sources) - {"recurrent.metal"}
    changed = {n for n in build.sources if build.sources[n] != dense.sources[n]}
    assert changed == PACKED_KERNELS & set(build.sources)


def _check_packed_case(name, monkeypatch, params=None):
    """``name`` on the default variant (with ``params`` changed) with outputs poisoned,
    asserting that the walk ran the packed kernels (not the portable path) and every quantity
    passed."""
    assert registry.get("metal").native_packed(vector_gate=False)
    monkeypatch.setenv(settings.ENV_POISON_OUTPUTS, "1")
    ran = []
    run = metal_launch.run_launches

    def spy(plan, launches, env, launcher):
        ran.extend((plan.packed, launch.kernel) for launch in launches)
        return run(plan, launches, env, launcher)

    monkeypatch.setattr(metal_launch, "run_launches", spy)
    case = get_case(name)
    variant = None
    if params is not None:
        problem = Problem(case.Hk, case.Hv, case.Dk, case.Dv)
        variant = registry.default_variant("metal", problem).replace(**params)
    result = validate.check_case("metal", case, variant=variant)
    assert result.passed, result.errors
    assert set(result.errors) >= {"y", "final_state", "dinitial_state", "dq", "dk", "dv",
                                  "dbeta", "dg", "dg_linear"}
    # forward and backward of the packed walk, and the dense one-chunk calls
    scan = "fwd_scan" if params and not params.get("save_states", True) else "fwd_scan_save"
    assert {(True, scan), (True, "bwd_scan"), (False, scan)} <= set(ran)
    return result


@pytest.mark.slow
@pytest.mark.parametrize("params", [None, {"chunk_size": 32, "save_states": False}],
                         ids=["default", "chunk32-recompute"])
def test_packed_long_masked_passes(params, monkeypatch):
    """packed_long_masked: an initial state carried through two chunk ends (the forward's
    injection and the backward's dinject), with a padding mask; also on a variant whose
    backward recomputes the states (the injection in fwd_scan_states)."""
    _check_packed_case("packed_long_masked", monkeypatch, params)


@pytest.mark.parametrize("name", ["packed_vector", "packed_vector_long_masked"])
def test_per_channel_packed_rows_run_the_packed_walks(name, monkeypatch):
    """Per-channel packed battery cases (outputs poisoned, both gate conventions) on the packed
    build's kernels: fwd_scan_channel / channel_keys and bwd_scan_channel with ``inject`` /
    ``dsin`` (`ChannelWalks` with ``packed``) between channel_intra and channel_grads, the
    row's walk and each sequence's one-chunk calls."""
    assert registry.get("metal").native_packed(vector_gate=True)
    monkeypatch.setenv(settings.ENV_POISON_OUTPUTS, "1")
    ran = []
    run = metal_launch.run_launches

    def spy(plan, launches, env, launcher):
        ran.extend((plan.packed, launch.kernel, "inject" in env or "dsin" in env)
                   for launch in launches)
        return run(plan, launches, env, launcher)

    monkeypatch.setattr(metal_launch, "run_launches", spy)
    result = validate.check_case("metal", name)
    assert result.passed, result.errors
    assert set(result.errors) >= {"y", "final_state", "dinitial_state", "dq", "dk", "dv",
                                  "dbeta", "dg", "dg_linear"}
    assert set(ran) == {(True, "fwd_scan_channel", True), (True, "bwd_scan_channel", True),
                        (True, "channel_keys", True),  # launched with the reverse walk
                        (True, "channel_intra", False), (True, "channel_grads", False)}


def test_per_channel_packed_build_changes_only_the_walks():
    problem = Problem(1, 2, 32, 32, "float32", "vector")
    variant = registry.default_variant("metal", problem)
    dense, build = metal.SPEC.render(variant, problem), metal.render_packed(variant, problem)
    assert build.sha256 != dense.sha256
    assert set(build.sources) == set(dense.sources) - {"recurrent.metal"}
    changed = {n for n in build.sources if build.sources[n] != dense.sources[n]}
    assert changed == {"fwd_scan_channel.metal", "bwd_scan_channel.metal"}
    assert "inject" in build.sources["fwd_scan_channel.metal"]
    assert "inject" not in dense.sources["fwd_scan_channel.metal"]


def test_packed_entry_checks_its_call():
    """A metal variant only; the offsets are checked (`check_call`)."""
    import mlx.core as mx

    variant = registry.default_variant("metal", Problem(1, 2, 32, 32))
    arrays = {"q": mx.zeros((1, 8, 1, 32)), "k": mx.zeros((1, 8, 1, 32)),
              "v": mx.zeros((1, 8, 2, 32)), "beta": mx.ones((1, 8, 2))}
    cu = mx.array([0, 3, 8], mx.int32)
    with pytest.raises(ValueError, match="metal Variant"):
        metal.packed_gated_delta(**arrays, g=mx.zeros((1, 8, 2)),
                                 variant=registry.default_variant("mlx", Problem(1, 2, 32, 32)),
                                 cu_seqlens=cu)
    for g in (mx.zeros((1, 8, 2)), mx.zeros((1, 8, 2, 32))):  # both gate kinds
        with pytest.raises(ValueError, match="cu_seqlens"):
            metal.packed_gated_delta(**arrays, g=g, variant=variant,
                                     cu_seqlens=mx.array([0, 3, 7], mx.int32))
