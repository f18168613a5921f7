"""Generated Metal kernels: the variant space, the launch plan, and the battery in the simulator.

Everything here runs the shipped MLX path (`gdngen.mlx.gated_delta` with a metal variant) with
`gdngen.backends.metal.sim` standing in for the GPU; the `metal`-marked tests run the same plan on
an Apple GPU and compare it with the simulator. Per-channel gates: the walk kernels (the scan
templates' per-channel build) under `gdngen.algebra.chunkwise_channel`, on the battery's vector
cases.
"""

from __future__ import annotations

import itertools
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from gdngen import Problem, Variant, default_variant, registry, render, validate, variants
from gdngen.algebra import chunkwise_channel
from gdngen.backends import metal
from gdngen.backends.metal import sim as metal_sim
from gdngen.cases import BATTERY, get_case
from gdngen.resources import templates_dir
from gdngen.tolerance import allowed_error

mx = pytest.importorskip("mlx.core", reason="the Metal backend runs through MLX")
pytestmark = pytest.mark.skipif(not metal_sim.available(), reason="no C++ compiler (g++)")

ROOT = Path(__file__).resolve().parents[3]
PROBLEM = Problem(2, 4, 64, 64)
GVA3 = Problem(2, 6, 32, 64)
ADVERSARIAL = ("hard_decay", "gates_exact_one_and_zero", "identical_keys", "padding_mask")
PARAMS = ("chunk_size", "precision", "mma", "simdgroups", "dv_tile", "save_states")
# Every value of every parameter at least once (each checked to be in the enumerated space).
SAMPLED = tuple(dict(zip(PARAMS, values)) for values in (
    (16, "ieee", "fma", 1, 16, False),
    (32, "tf32", "simdgroup", 2, 16, True),
    (64, "bf16", "simdgroup", 4, 16, False),
    (32, "ieee", "simdgroup", 1, 64, False),  # dv_tile > chunk
    (64, "ieee", "fma", 4, 32, True),
))


def _threshold(variant: Variant, dtype: str) -> float:
    return allowed_error(variant, dtype)


def _check(results, variant, dtype="float32"):
    limit = _threshold(variant, dtype)
    bad = [(r.case, *r.worst) for r in results if r.worst[1] > limit]
    assert not bad, f"{variant} over {limit:g}: {bad}"


# ------------------------------------------------------------------------ space and plan


def test_registered_once():
    spec = registry.get("metal")
    assert registry.BACKENDS["metal"] == "gdngen.backends.metal" and spec is metal.SPEC
    problem = Problem(2, 4, 64, 64)
    variant = default_variant("metal", problem)
    assert spec.framework == "mlx"
    assert spec.render_plan(variant, problem) == metal.render_plan(variant, problem)
    assert registry.backends_for("apple-m3", "mlx") == ("metal", "mlx")


def test_space_respects_threadgroup_memory_and_holds_the_default():
    for problem in (PROBLEM, GVA3, Problem(1, 1, 256, 256), Problem(4, 8, 128, 32)):
        space = variants("metal", problem)
        assert space and default_variant("metal", problem) in space
        for v in space:
            assert max(metal.threadgroup_bytes(v.as_dict(), problem).values()) <= 32 * 1024
            assert metal.accumulator_floats(v.as_dict(), problem) <= metal.MAX_ACC_FLOATS
    assert len(variants("metal", PROBLEM)) == 160
    with pytest.raises(ValueError, match="multiple of 32"):
        variants("metal", Problem(2, 4, 48, 64))


def test_render_and_plan_structure():
    for save in (True, False):
        v = Variant("metal", dict(default_variant("metal", PROBLEM).as_dict(), save_states=save))
        rendered = render(v, PROBLEM)
        assert "common.metal" in rendered.sources
        assert "[[kernel]]" not in rendered.sources["bwd_qk.metal"]  # a body: MLX adds it
        plan = metal.launch_plan(v, PROBLEM, 3, 2)
        assert [launch.kernel for launch in plan.forward] == (
            ["fwd_intra_tinv", "fwd_scan_save"] if save else ["fwd_intra", "fwd_scan"])
        assert [launch.kernel for launch in plan.backward][-3:] == ["bwd_scan", "bwd_tri",
                                                                     "bwd_qk"]
        assert plan.saved == (("states", "w_out", "tinv", "wk") if save else ())
        scan = plan.forward[1]
        assert scan.grid == (128, 64 // 32, 2 * 4) and scan.threadgroup == (128, 1, 1)
        assert dict(zip(scan.outputs, scan.output_shapes))["final_state"] == (2, 4, 64, 64)
        produced = {"q", "k", "v", "g", "beta", "s0", "prm", "dy", "dsf", *plan.saved}
        for launch in plan.forward + plan.backward:
            assert set(launch.inputs) <= produced, launch.kernel
            produced |= set(launch.outputs)


def test_adapt_shrinks_dv_tile_and_rejects_other_backends():
    v = Variant("metal", dict(SAMPLED[3]))
    assert metal.adapt(v, Problem(2, 4, 32, 32))["dv_tile"] == 32
    with pytest.raises(ValueError, match="variant backend must be 'metal'"):
        metal.adapt(Variant("mlx", {"chunk_size": 64}), PROBLEM)


def test_role_modules_check_and_parse_as_the_backend_does():
    """`config.check` / `config.parse` (the role modules hold no backend instance) agree with
    `Metal.check` / `Metal.parse`, messages included; `kernels.render` with `Metal.render`."""
    from gdngen.backends.metal import config, kernels

    bad = Problem(2, 4, 48, 64)
    for check in (config.check, metal.SPEC.check):
        with pytest.raises(ValueError, match="the metal backend cannot run .*multiple of 32"):
            check(bad)
    v = Variant("metal", dict(SAMPLED[3]))
    assert config.parse(v) == metal.SPEC.parse(v)
    with pytest.raises(ValueError, match="variant backend must be 'metal'"):
        config.parse(Variant("mlx", {"chunk_size": 64}))
    assert kernels.render(v, PROBLEM).sha256 == metal.SPEC.render(v, PROBLEM).sha256


def test_space_render_and_plan_import_without_mlx():
    code = ("import sys; sys.modules['mlx'] = None\n"
            "from gdngen import Problem, variants, render\n"
            "from gdngen.backends import metal\n"
            "p = Problem(2, 4, 64, 64); v = variants('metal', p)[0]\n"
            "render(v, p); metal.launch_plan(v, p, 2, 1); print('ok')")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=ROOT, check=False)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr


# ------------------------------------------------------------------------ battery in the simulator


@pytest.mark.parametrize("params", SAMPLED, ids=lambda p: Variant("metal", p).name())
def test_sampled_variants_pass_adversarial_cases(params):
    v = Variant("metal", dict(params, recurrent_below=metal.RECURRENT_BELOW))
    assert v in variants("metal", PROBLEM)
    _check(validate.run_battery(None, variant=v, cases=ADVERSARIAL), v)


def test_gva3_problem_variants():
    space = variants("metal", GVA3)
    picks = [default_variant("metal", GVA3), space[0], space[len(space) // 2], space[-1]]
    for v in picks:
        _check(validate.run_battery(None, variant=v, cases=["gva3"]), v)


@pytest.mark.parametrize("dtype, params", [
    ("bfloat16", None), ("bfloat16", SAMPLED[2]), ("float16", None)])
def test_low_precision_inputs(dtype, params):
    problem = Problem(2, 4, 64, 64, dtype)
    v = default_variant("metal", problem) if params is None else Variant("metal", params)
    _check(validate.run_battery(None, variant=v, dtype=dtype, cases=["hard_decay", "gva3"]), v,
           dtype)


@pytest.mark.parametrize("Hk, Hv, Dk, Dv, T, params", [
    (1, 2, 256, 128, 40, None),
    (1, 1, 128, 256, 33, SAMPLED[0]),
])
def test_large_head_dims_against_the_reference(Hk, Hv, Dk, Dv, T, params):
    """Head dims beyond the battery's (up to 256): every Dk / Dv tile loop, float64 reference."""
    from gdngen.algebra import reference

    problem = Problem(Hk, Hv, Dk, Dv)
    v = default_variant("metal", problem) if params is None else Variant("metal", params)
    rng = np.random.default_rng()
    k = rng.standard_normal((1, T, Hk, Dk))
    arrays = {"q": rng.standard_normal((1, T, Hk, Dk)), "k": k / np.linalg.norm(k, axis=-1,
                                                                                keepdims=True),
              "v": rng.standard_normal((1, T, Hv, Dv)), "g": -rng.uniform(0.01, 0.3, (1, T, Hv)),
              "beta": rng.uniform(0, 1, (1, T, Hv)),
              "initial_state": rng.standard_normal((1, Hv, Dv, Dk))}
    cot = {"y": rng.standard_normal((1, T, Hv, Dv)),
           "final_state": rng.standard_normal((1, Hv, Dv, Dk))}
    arrays, cot = ({n: x.astype(np.float32).astype(np.float64) for n, x in d.items()}
                   for d in (arrays, cot))
    out, grads = metal.simulate(v, problem, arrays, cot, scale=Dk ** -0.5)
    ref = reference.vjp(*(arrays[n] for n in ("q", "k", "v", "g", "beta", "initial_state")),
                        cot["y"], cot["final_state"], scale=Dk ** -0.5, gate="log")
    errors = {n: validate.relative_error(out[n], ref[n]) for n in out}
    errors.update({n: validate.relative_error(grads[n], ref["d" + n]) for n in grads})
    assert max(errors.values()) < 5e-5, errors


# ------------------------------------------------------------------------ simulator checks


def _simulate(v, case_name, schedule="forward", seed=0):
    case = get_case(case_name)
    raw = case.inputs(seed=1)
    inputs = {"q": raw["q"], "k": raw["k"], "v": raw["v"], "g": raw["g_log"],
              "beta": raw["beta"], "initial_state": raw["initial_state"], "mask": raw["mask"]}
    problem = metal.problem_of_inputs(raw, "float32")
    return metal.simulate(v, problem, inputs, {"y": raw["dy"], "final_state": raw["dfinal_state"]},
                          scale=case.scale, schedule=schedule, seed=seed)


SCHEDULES = (("reverse", 0), ("random", 7), ("low_first", 0), ("high_first", 0))


@pytest.mark.parametrize("params", [SAMPLED[1], SAMPLED[4]],
                         ids=lambda p: Variant("metal", p).name())
def test_results_do_not_depend_on_thread_order(params):
    """Other thread orders (LIFO, random, one simdgroup running ahead of the others) give
    bit-identical outputs: no missing barriers."""
    v = Variant("metal", params)
    out, grads = _simulate(v, "padding_mask")
    for schedule, seed in SCHEDULES:
        out2, grads2 = _simulate(v, "padding_mask", schedule, seed)
        for name in out:
            np.testing.assert_array_equal(out[name], out2[name], err_msg=f"{schedule} {name}")
        for name in grads:
            np.testing.assert_array_equal(grads[name], grads2[name],
                                          err_msg=f"{schedule} d{name}")


def test_a_barrier_removed_from_a_generated_kernel_is_caught(tmp_path, monkeypatch):
    """The race check above can fail: bwd_tri without the barrier between writing a tile and
    reading its rows (the simdgroup running ahead reads rows the other has not written; the
    default round-robin order, with simdgroups in near lockstep, happens to hide it)."""
    shipped = templates_dir("metal") / "bwd_tri.metal.j2"
    text = shipped.read_text()
    barrier = ("acc_mma(dT, ln, rows(dwp + c0, DV), cols(vp + c0, DV), DW);  // dW V^T\n"
               "  threadgroup_barrier(mem_flags::mem_threadgroup);\n")
    assert barrier in text
    (tmp_path / "metal").mkdir()
    (tmp_path / "metal" / "bwd_tri.metal.j2").write_text(text.replace(barrier, barrier.split(
        "\n")[0] + "\n"))
    monkeypatch.setenv("GDNGEN_TEMPLATES", str(tmp_path))
    v = Variant("metal", SAMPLED[1])
    with pytest.raises(metal_sim.SimulatorError, match="bwd_tri.*poison"):
        _simulate(v, "short", "low_first")


def test_threadgroup_memory_matches_the_static_plan():
    case = get_case("hard_decay")
    problem = Problem(case.Hk, case.Hv, case.Dk, case.Dv)
    scale = case.scale
    for params in SAMPLED[:3]:
        v = Variant("metal", params)
        launcher = metal.SimLauncher()
        raw = case.inputs(seed=2)
        q, k, vv = (mx.array(raw[n].astype(np.float32)) for n in ("q", "k", "v"))
        g, beta = mx.array(raw["g_log"].astype(np.float32)), mx.array(
            raw["beta"].astype(np.float32))

        def loss(q, k, vv, g, beta, v=v, launcher=launcher):
            y, s = metal.gated_delta(q, k, vv, g, beta, scale=scale, variant=v,
                                     launcher=launcher)
            return (y * y).sum() + s.sum()

        mx.eval(mx.grad(loss, argnums=(0, 1, 2, 3, 4))(q, k, vv, g, beta))
        n_chunks = -(-case.T // v["chunk_size"])
        plan = metal.launch_plan(metal.adapt(v, problem), problem, n_chunks, case.B)
        assert launcher.threadgroup_bytes == plan.threadgroup_bytes


@pytest.mark.metal
@pytest.mark.skipif(not mx.metal.is_available(), reason="needs an Apple GPU (MLX Metal backend)")
def test_gpu_matches_simulator():
    check_gpu_matches_simulator(get_case("hard_decay"), default_variant("metal", PROBLEM))


def check_gpu_matches_simulator(case, variant):
    """The loss and the five input gradients of ``variant`` on ``case`` agree on the Apple GPU
    (`metal.MLXLauncher`) and in the MSL simulator."""
    raw = case.inputs(seed=3)
    args = [mx.array(raw[n].astype(np.float32)) for n in ("q", "k", "v", "g_log", "beta")]
    results = {}
    for launcher in (metal.MLXLauncher(), metal.SimLauncher()):
        def loss(*a, launcher=launcher):
            y, s = metal.gated_delta(*a, scale=case.scale, variant=variant, launcher=launcher)
            return (y * y).sum() + (s * s).sum()

        value, grads = mx.value_and_grad(loss, argnums=tuple(range(5)))(*args)
        results[launcher.name] = [np.array(value)] + [np.array(g) for g in grads]
    for gpu, sim in zip(results["metal"], results["simulator"]):
        np.testing.assert_allclose(gpu, sim, rtol=1e-4, atol=1e-5)


# ------------------------------------------------------------------------ per-channel gates

VECTOR = Problem(2, 4, 32, 32, gate="vector")
VECTOR_CASES = tuple(c.name for c in BATTERY if c.name.startswith("vector_"))
# Every chunk, simdgroups and dv_tile value at least once, and the scalar-FMA tiles.
VECTOR_SAMPLED = (
    {"chunk_size": 16, "simdgroups": 1, "dv_tile": 16, "mma": "fma"},
    {"chunk_size": 32, "simdgroups": 2, "dv_tile": 64},
    {"chunk_size": 64, "simdgroups": 4, "dv_tile": 16},
    {"chunk_size": 64, "simdgroups": 1, "dv_tile": 32, "mma": "fma"},
)


def _vector_variant(problem: Problem, **params) -> Variant:
    base = default_variant("metal", problem).as_dict()
    return metal.adapt(Variant("metal", dict(base, **params)), problem)


@pytest.fixture
def _poisoned(monkeypatch):
    """GDNGEN_POISON_OUTPUTS=1 as in the conformance suite (the simulator poisons every output
    buffer and fails on anything left unwritten whatever the flag)."""
    monkeypatch.setenv("GDNGEN_POISON_OUTPUTS", "1")


def test_vector_space_render_and_plan():
    space = variants("metal", VECTOR)
    assert {(v["chunk_size"], v["simdgroups"], v["dv_tile"]) for v in space} == set(
        itertools.product(metal.CHUNK_SIZES, metal.SIMDGROUPS, (16, 32)))  # dv_tile <= Dv
    assert {(v["precision"], v["mma"], v["save_states"]) for v in space} == {
        ("ieee", "simdgroup", True)}
    assert "vector" in metal.SPEC.tuned_gates
    v = _vector_variant(VECTOR, dv_tile=16)
    sources = render(v, VECTOR).sources
    assert set(sources) == {"common.metal", "fwd_scan_channel.metal", "bwd_scan_channel.metal",
                            "channel_intra.metal", "channel_grads.metal", "channel_keys.metal",
                            "recurrent.metal"}
    for name in metal.WALK_KERNELS:  # decays come in per channel: no gate work in the walk
        body = sources[f"{name}.metal"]
        assert "x *= dccp[j];" in body and "load_gates" not in body
        assert "channel_log_gate" not in body
    assert "channel_log_gate" in sources["channel_keys.metal"]  # the reverse walk's decays
    plan = metal.channel_plan(v, VECTOR, 3, 2)
    (fwd,), (keys, bwd) = plan.forward, plan.backward
    assert fwd.grid == bwd.grid == (128, 32 // 16, 2 * 4)
    assert keys.kernel == "channel_keys" and keys.grid == (128, 1, 3 * 2 * 4)
    shapes = dict(zip(bwd.outputs, bwd.output_shapes))
    assert shapes["dwk"] == (2, 3, 2, 4, v["chunk_size"], 32) and shapes["ddcc"] == (2, 3, 2, 4, 32)
    intra, grads = plan.stages  # one threadgroup per chunk and value head
    assert intra.grid == grads.grid == (128, 1, 3 * 2 * 4)
    C = v["chunk_size"]
    assert dict(zip(grads.outputs, grads.output_shapes))["dg"] == (3, 2, 4, C, 32)
    assert plan.threadgroup_bytes == {**dict.fromkeys(metal.WALK_KERNELS, 4 * C * 16),
                                      **dict.fromkeys(metal.STAGE_KERNELS, 4 * (C * C + C)),
                                      metal.KEYS_KERNEL: 0}


def test_vector_gate_walk_kernels_pass_a_multi_chunk_case(_poisoned, monkeypatch):
    """vector_exact_zero (exact per-channel zeros and ones, both sides of chunk edges) at chunk
    32 (four chunks) with two Dv tiles, poisoned outputs: forward and backward walks are the
    Metal kernels (the default walks are disabled), every quantity within the float32 target,
    and the simulator measures the threadgroup memory the plan declares."""
    def default_walk(*args, **kwargs):
        raise AssertionError("the portable chunk walk ran")

    monkeypatch.setattr(chunkwise_channel, "walk_forward", default_walk)
    monkeypatch.setattr(chunkwise_channel, "walk_backward", default_walk)
    v = _vector_variant(VECTOR, chunk_size=32, dv_tile=16, simdgroups=2)
    launcher = metal.default_launcher()
    launcher.threadgroup_bytes.clear()
    results = validate.run_battery(None, variant=v, cases=["vector_exact_zero"])
    _check(results, v)
    plan = metal.channel_plan(v, VECTOR, 4, 2)
    assert {n: launcher.threadgroup_bytes[n] for n in metal.CHANNEL_KERNELS} == \
        plan.threadgroup_bytes


@pytest.mark.parametrize("gate", ["linear", "log"])
def test_channel_intra_and_grads_match_the_float64_stages(gate, _poisoned):
    """channel_intra and channel_grads in the simulator (poisoned outputs) against
    `gdngen.algebra.chunkwise_channel`'s stages in float64 (`tests/channel_walks.py`, the checks
    the Pallas kernels pass): exact zeros, two in one segment, log g = -37; two chunks of 16,
    two value heads per key head, Dv = 64."""
    from channel_walks import (
        check_grads_match_the_float64_stages,
        check_intra_matches_the_float64_stages,
    )

    problem = Problem(1, 2, 32, 64, gate="vector")
    walks = metal.ChannelWalks(_vector_variant(problem, chunk_size=16, dv_tile=16,
                                               simdgroups=2), problem, metal.default_launcher())
    scale, linear = 0.25, gate == "linear"

    def arrays(*xs):
        return [mx.array(np.asarray(x, np.float32)) for x in xs]

    def intra(q, k, v, gates, beta):  # the kernel takes q scaled
        q, *rest = arrays(q, k, v, gates, beta)
        return [np.asarray(x) for x in walks.intra(q * scale, *rest, linear)]

    def grads(q, *rest):
        q, *rest = arrays(q, *rest)
        dq, *others = (np.asarray(x) for x in walks.grads(q * scale, *rest, linear))
        return [dq * scale, *others]  # the cotangent of the unscaled q

    shape = (2, 1, 1, 2, 16, 32, 64)
    check_intra_matches_the_float64_stages(intra, shape, gate, scale)
    check_grads_match_the_float64_stages(grads, shape, gate, scale)


def test_channel_reverse_walk_matches_the_float64_walk(_poisoned):
    """channel_keys and bwd_scan_channel in the simulator (poisoned outputs): G = Pm^T dY and
    the decayed keys formed in the kernels, against `gdngen.backends.pallas.core.
    channel_walk_backward` in float64 (`tests/channel_walks.py`, the check the Pallas walks
    pass): both conventions, exact zeros, log g = -37; three chunks of 16, two value heads per
    key head, Dv = 32 in two Dv tiles (the products' parts summed over them)."""
    from channel_walks import check_walk_backward_matches_the_float64_walk

    problem = Problem(1, 2, 32, 32, gate="vector")
    walks = metal.ChannelWalks(_vector_variant(problem, chunk_size=16, dv_tile=16,
                                               simdgroups=2), problem, metal.default_launcher())

    def walk_backward(dS_final, Pm, q, k, gates, *rest, gate, scale):
        dS_final, Pm, q, k, gates, *rest = (mx.array(np.asarray(x))
                                            for x in (dS_final, Pm, q, k, gates, *rest))
        out = walks.backward(dS_final, Pm, q * scale, k, gates, *rest,  # the kernel: q scaled
                             linear=gate == "linear")
        return [None if x is None else np.asarray(x) for x in out]

    check_walk_backward_matches_the_float64_walk(walk_backward, (3, 1, 1, 2, 16, 32, 32))


@pytest.mark.slow
@pytest.mark.parametrize("params", VECTOR_SAMPLED, ids=lambda p: "-".join(map(str, p.values())))
def test_vector_variants_pass_every_vector_case(params, _poisoned):
    v = Variant("metal", dict(default_variant("metal", VECTOR).as_dict(), **params))
    results = validate.run_battery(None, variant=v, cases=VECTOR_CASES)
    assert [r.case for r in results] == list(VECTOR_CASES)
    _check(results, v)


def _simulate_vector(v, case_name, schedule="forward", seed=0):
    case = get_case(case_name)
    raw = case.inputs(seed=1)
    inputs = {"q": raw["q"], "k": raw["k"], "v": raw["v"], "g": raw["g_log"],
              "beta": raw["beta"], "initial_state": raw["initial_state"], "mask": raw["mask"]}
    problem = Problem(case.Hk, case.Hv, case.Dk, case.Dv, gate="vector")
    return metal.simulate(v, problem, inputs, {"y": raw["dy"], "final_state": raw["dfinal_state"]},
                          scale=case.scale, schedule=schedule, seed=seed)


def test_vector_walk_results_do_not_depend_on_thread_order():
    """The per-channel kernels (the walks, channel_intra and channel_grads, whose phases hand
    their scratch to each other through device memory behind barriers) give bit-identical
    values and gradients under every simulator schedule (about 7 s here)."""
    v = _vector_variant(VECTOR, chunk_size=32, dv_tile=16, simdgroups=4)
    out, grads = _simulate_vector(v, "vector_masked_gva3")
    for schedule, seed in SCHEDULES:
        out2, grads2 = _simulate_vector(v, "vector_masked_gva3", schedule, seed)
        for name, x in {**out, **grads}.items():
            np.testing.assert_array_equal(x, {**out2, **grads2}[name],
                                          err_msg=f"{schedule} {name}")


@pytest.mark.metal
@pytest.mark.skipif(not mx.metal.is_available(), reason="needs an Apple GPU (MLX Metal backend)")
def test_vector_gpu_matches_simulator():
    case = get_case("vector_strong_half")
    problem = Problem(case.Hk, case.Hv, case.Dk, case.Dv, gate="vector")
    check_gpu_matches_simulator(case, _vector_variant(problem, chunk_size=32, dv_tile=16))
