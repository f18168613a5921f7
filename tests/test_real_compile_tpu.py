"""pallas_tpu compiled for real TPUs without one: Mosaic + XLA TPU through libtpu's compile-only
topologies (`gdngen.compilers`), for every TPU generation gdngen knows; the footprint model
against the compiler's VMEM; sharded and context-parallel programs over a 4-chip topology.

Skips (with the reason) when libtpu is not installed (``pip install 'gdngen[tpu]'``); a device's
tests skip (with libtpu's reason) where the installed libtpu does not know its topology
(`compilers.topology_missing`: TPU7x's ``tpu7x:2x2x1`` is known only to some releases).
"""

from __future__ import annotations

import json

import pytest

from gdngen import compilers, devices, registry
from gdngen.problem import Problem

pytestmark = pytest.mark.skipif(compilers.missing_reason("mosaic") is not None,
                                reason=str(compilers.missing_reason("mosaic")))

TPUS = [name for name, d in devices.DEVICES.items() if d.kind == "tpu"]
#: the generations every compile test runs on in `make test` (v5e, the reference of the footprint
#: model, and the newest); the others' per-channel compiles and footprint checks (~30-45 s each
#: here) in make test-all: their scalar compiles stay, and they share v5e's VMEM budget
EVERY_TEST = {"tpu-v5e", "tpu-v7x"}
# small heads that still run every kernel path: a GVA group of 2 (scalar; head tile 2) and
# Hk = Hv (per-channel, as Kimi-Linear)
SMALL = {"scalar": Problem(1, 2, 128, 128, "bfloat16", "scalar"),
         "vector": Problem(2, 2, 128, 128, "bfloat16", "vector")}


def _available(device):
    """Skip, with the reason, where no compile-only device of ``device`` can be made here."""
    reason = compilers.topology_missing(device)
    if reason is not None:
        pytest.skip(f"no {device} topology here: {reason}")


def _check_report(report, device):
    assert report.ok, report.first_error()
    assert report.compiler == "mosaic" and report.device == device
    assert report.target.startswith("TPU")
    for program in report.programs:
        assert program.kernels, program.name
        assert program.temp_bytes >= 0 and program.code_bytes > 0, program.name
        for kernel in program.kernels:
            assert 0 < kernel["vmem_used"] <= kernel["vmem_limit"], (program.name, kernel)


def test_every_tpu_device_has_a_topology():
    assert set(TPUS) == {"tpu-v4", "tpu-v5e", "tpu-v5p", "tpu-v6e", "tpu-v7x"}
    known = [name for name in TPUS if compilers.topology_missing(name) is None]
    assert set(TPUS) - set(known) <= {"tpu-v7x"}  # v4 to v6e: every supported libtpu knows them
    kinds = {name: compilers.target_device(name).device_kind for name in known}
    assert {devices.device_from_jax("tpu", kind) for kind in kinds.values()} == set(known), kinds


@pytest.mark.parametrize(("device", "gate"), [
    pytest.param(d, g, marks=() if d in EVERY_TEST or g == "scalar" else pytest.mark.slow)
    for d in TPUS for g in ("scalar", "vector")])
def test_default_variant_compiles_fwd_bwd(device, gate):
    """The default variant's chunk forward + backward and its recurrent forward, compiled."""
    _available(device)
    problem = SMALL[gate]
    variant = registry.default_variant("pallas_tpu", problem, device)
    report = compilers.compile_variant(variant, problem, device, T=64,
                                       only=("chunk_fwd_bwd", "recurrent_forward"))
    _check_report(report, device)
    names = {p.name: [k["name"].split(".")[0] for k in p.kernels] for p in report.programs}
    assert set(names) == {"chunk_fwd_bwd", "recurrent_forward"}
    assert set(names["recurrent_forward"]) == {"gdn_recurrent"}
    assert len(names["chunk_fwd_bwd"]) >= 2  # the forward and the backward walk(s)
    if gate == "vector":  # and the forward's intra-chunk stages
        assert "gdn_channel_intra" in names["chunk_fwd_bwd"], names


@pytest.mark.parametrize("gate", ["scalar", "vector"])
@pytest.mark.parametrize("device", ["tpu-v5e", pytest.param("tpu-v7x", marks=pytest.mark.slow)])
def test_every_program_of_a_call_compiles(device, gate):
    """Chunk fwd+bwd, recurrent, packed row (both gate kinds: the packed build's per-channel
    walks too) and the fused-input build (qk_norm, softplus gate, the output's gated norm;
    fwd+bwd, recurrent and the chunk forward's norm build) of the default variant, for TPU
    v5e and (slow: 45-85 s on a busy 2-core host; `test_build_compile_records_the_compile`
    compiles every scalar program for it) TPU7x."""
    _available(device)
    problem = SMALL[gate]
    variant = registry.default_variant("pallas_tpu", problem, device)
    report = compilers.compile_variant(variant, problem, device, T=64)
    _check_report(report, device)
    # a variant holding its heads' Dv: the chunk forward's norm build too
    assert {p.name for p in report.programs} == {
        "chunk_fwd_bwd", "recurrent_forward", "packed_fwd_bwd", "fused_fwd_bwd",
        "fused_recurrent_forward", "fused_chunk_forward", "steps_forward"}
    assert json.loads(json.dumps(report.to_json()))["ok"] is True


def test_qwen3_next_heads_compile():
    """The real Qwen3-Next shape (Hk=16, Hv=32, D=128, bf16), default variant, fwd+bwd."""
    problem = Problem(16, 32, 128, 128, "bfloat16", "scalar")
    variant = registry.default_variant("pallas_tpu", problem, "tpu-v5e")
    report = compilers.compile_variant(variant, problem, "tpu-v5e", T=256,
                                       only=("chunk_fwd_bwd",))
    _check_report(report, "tpu-v5e")


@pytest.mark.parametrize("device", [pytest.param(d, marks=() if d in EVERY_TEST else
                                                  pytest.mark.slow) for d in TPUS])
def test_footprint_model_admits_what_fits(device):
    """The variant the footprint model admits with the largest estimate (closest to the
    device's VMEM budget) compiles for the device, and the VMEM the compiler used is within
    the 25% margin the render adds to the estimate for Mosaic's limit (`_vmem_limit`), so the
    model never admits a variant the compiler rejects for size."""
    from gdngen.backends.pallas import tpu as pallas_tpu

    _available(device)
    problem = Problem(16, 32, 128, 128, "float32", "scalar")
    space = registry.variants("pallas_tpu", problem, device)
    budget = devices.get_device(device).limits["vmem_budget"]
    largest = max(space, key=lambda v: pallas_tpu.vmem_bytes(v, problem))
    predicted = pallas_tpu.vmem_bytes(largest, problem)
    assert predicted <= budget
    report = compilers.compile_variant(largest, problem, device, T=256,
                                       only=("chunk_fwd_bwd",))
    _check_report(report, device)
    assert report.vmem_used <= 1.25 * predicted, (largest, report.vmem_used, predicted)


def test_per_channel_footprint_model_admits_what_fits():
    """Per-channel gates: the largest admitted variant (its intra-chunk kernel and that
    kernel's VJP the largest, `channel_stage_vmem_bytes`) compiles for v5e within the model's
    25% margin."""
    from gdngen.backends.pallas import tpu as pallas_tpu

    _available("tpu-v5e")
    problem = Problem(32, 32, 128, 128, "float32", "vector")
    space = registry.variants("pallas_tpu", problem, "tpu-v5e")
    largest = max(space, key=lambda v: pallas_tpu.vmem_bytes(v, problem))
    predicted = pallas_tpu.vmem_bytes(largest, problem)
    assert predicted == pallas_tpu.SPEC.channel_stage_vmem_bytes(largest, problem)
    report = compilers.compile_variant(largest, problem, "tpu-v5e", T=256,
                                       only=("chunk_fwd_bwd",))
    _check_report(report, "tpu-v5e")
    assert report.vmem_used <= 1.25 * predicted, (largest, report.vmem_used, predicted)


def test_tpu7x_topology_is_four_dual_core_chips():
    """``tpu7x:2x2x1``: 4 TPU7x chips of two TensorCores, each TensorCore its own jax device
    (Ironwood's dual-chiplet layout); the registry's VMEM and MXU are jax's for "TPU7x"."""
    from gdngen import jaxcompat

    _available("tpu-v7x")
    found = compilers.topology_devices("tpu-v7x")
    assert len(found) == 8 and {d.device_kind for d in found} == {"TPU7x"}
    assert {d.core_on_chip for d in found} == {0, 1}
    assert len({tuple(d.coords) for d in found}) == 4
    assert devices.device_from_jax("tpu", "TPU7x") == "tpu-v7x"
    device = devices.get_device("tpu-v7x")
    hardware = jaxcompat.tpu_hardware("TPU7x")
    assert device.limits["vmem"] == hardware.vmem_capacity_bytes == 64 * devices.MiB
    assert device.mxu == (hardware.mxu_column_size,) * 2 == (256, 256)
    assert device.limits["vmem_budget"] <= device.limits["vmem"]
    for name in TPUS:  # the MXU of every generation, as jax's table has it
        kind = {"tpu-v4": "TPU v4", "tpu-v5e": "TPU v5 lite", "tpu-v5p": "TPU v5p",
                "tpu-v6e": "TPU v6 lite", "tpu-v7x": "TPU7x"}[name]
        assert devices.get_device(name).mxu[1] == jaxcompat.tpu_hardware(kind).mxu_column_size


def test_a_topology_libtpu_does_not_know_is_refused_with_its_reason():
    """A device whose topology the installed libtpu does not know (as TPU7x's to a release
    without it): `topology_missing` says why, in libtpu's words, and a compile for it is a
    RuntimeError saying so, before anything is traced."""
    import dataclasses

    from gdngen import jaxcompat

    reason = jaxcompat.tpu_topology_missing("tpu9z:2x2x1")
    assert reason is not None and "does not know the topology 'tpu9z:2x2x1'" in reason
    assert jaxcompat.tpu_topology_missing("v5e:2x2") is None
    unknown = dataclasses.replace(devices.get_device("tpu-v7x"), topology="tpu9z:2x2x1")
    assert compilers.topology_missing(unknown) == reason
    with pytest.raises(RuntimeError, match="cannot compile for tpu-v7x with mosaic: .*tpu9z"):
        compilers.target_device(unknown)
    variant = registry.default_variant("pallas_tpu", SMALL["scalar"], "tpu-v7x")
    with pytest.raises(RuntimeError, match="does not know the topology"):
        compilers.compile_variant(variant, SMALL["scalar"], unknown)


@pytest.mark.slow
@pytest.mark.parametrize("gate", ["scalar", "vector"])
def test_tpu7x_admitted_space_compiles_every_program(gate):
    """Every variant admitted for TPU7x (small heads of each gate kind), every program of a
    call compiled (what ``gdngen build --compile --device tpu-v7x`` does), the chunk
    fwd+bwd's largest kernel within the model's estimate plus the margin of its Mosaic limit, as
    on v5e (docs/COMPILE.md, "TPU7x")."""
    from gdngen.backends.pallas import tpu as pallas_tpu

    _available("tpu-v7x")
    problem = SMALL[gate]
    failed, over = [], []
    for variant in registry.variants("pallas_tpu", problem, "tpu-v7x"):
        report = compilers.compile_variant(variant, problem, "tpu-v7x", T=128)
        if not report.ok:
            failed.append((variant.name(), report.first_error()))
            continue
        chunk = max(k["vmem_used"] for p in report.programs if p.name == "chunk_fwd_bwd"
                    for k in p.kernels)
        if chunk > 1.25 * pallas_tpu.vmem_bytes(variant, problem):
            over.append((variant.name(), chunk))
    assert not failed and not over, (failed, over)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_whole_space_compiles(dtype):
    """Every variant of the Qwen3-Next shape class admitted for TPU v5e compiles (fwd+bwd),
    each within the model's estimate plus the margin of its Mosaic limit."""
    from gdngen.backends.pallas import tpu as pallas_tpu

    problem = Problem(16, 32, 128, 128, dtype, "scalar")
    failed, over = [], []
    for variant in registry.variants("pallas_tpu", problem, "tpu-v5e"):
        report = compilers.compile_variant(variant, problem, "tpu-v5e", T=256,
                                           only=("chunk_fwd_bwd",))
        if not report.ok:
            failed.append((variant.name(), report.first_error()))
        elif report.vmem_used > 1.25 * pallas_tpu.vmem_bytes(variant, problem):
            over.append((variant.name(), report.vmem_used))
    assert not failed and not over, (failed, over)


# ------------------------------------------------------------------------------ SPMD


def _mesh(shape, names, explicit=True):
    import numpy as np
    from jax.sharding import AxisType, Mesh

    types = (AxisType.Explicit if explicit else AxisType.Auto,) * len(names)
    return Mesh(np.array(compilers.topology_devices("tpu-v5e")).reshape(shape), names,
                axis_types=types)


def _fwd_bwd(variant, call=None, **kwargs):
    """``(y, final_state, grads)`` of gated_delta (or ``call``, which picks its own variant) and
    its VJP at given cotangents (nothing summed over devices, so any collective is the
    call's own)."""
    import jax

    from gdngen.jax import gated_delta

    if call is None:
        call, kwargs = gated_delta, dict(kwargs, variant=variant)

    def step(q, k, v, g, beta, dy, ds):
        out, vjp = jax.vjp(lambda *a: call(*a, scale=128 ** -0.5, **kwargs), q, k, v, g, beta)
        return out, vjp((dy, ds))

    return step


def _specs(mesh, B, T, problem, token, state):
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding

    def s(shape, dtype, spec):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))

    dt, f32 = jnp.dtype(problem.dtype), jnp.float32
    Hk, Hv, D = problem.Hk, problem.Hv, problem.Dk
    return (s((B, T, Hk, D), dt, token), s((B, T, Hk, D), dt, token), s((B, T, Hv, D), dt, token),
            s((B, T, Hv), f32, token), s((B, T, Hv), f32, token), s((B, T, Hv, D), dt, token),
            s((B, Hv, D, D), f32, state))


def test_sharded_jit_over_a_topology_mesh_compiles_without_collectives():
    """A jit of fwd+bwd with inputs sharded over a v5e:2x2 mesh (data x heads, explicit axes)
    compiles for the 4 chips with the kernels run per shard: no collective in the HLO."""
    import jax
    from jax.sharding import PartitionSpec as P

    from gdngen.backends.pallas import tpu as pallas_tpu

    problem = Problem(2, 4, 128, 128, "bfloat16", "scalar")
    variant = registry.default_variant("pallas_tpu", problem, "tpu-v5e")
    mesh = _mesh((2, 2), ("data", "heads"))
    args = _specs(mesh, 2, 128, problem, P("data", None, "heads"), P("data", "heads"))
    with pallas_tpu.interpreting(False), jax.set_mesh(mesh):
        lowered = jax.jit(_fwd_bwd(variant)).trace(*args).lower(lowering_platforms=("tpu",))
    text = lowered.compile().as_text()
    assert "tpu_custom_call" in text
    assert compilers.collective_bytes(text, per_channel=True) == {}


def test_load_tuned_callable_over_a_topology_mesh_compiles_without_collectives():
    """``load_tuned()``'s callable, as a v5e host gets it, in the same sharded jit: the same
    entry body as gated_delta, so its pallas_tpu kernels run per shard too."""
    import jax
    from jax.sharding import PartitionSpec as P

    from gdngen.backends.pallas import tpu as pallas_tpu
    from gdngen.entry import TunedGatedDelta

    tuned = TunedGatedDelta("jax", "tpu-v5e", "ieee")  # load_tuned("jax") on a v5e host
    problem = Problem(2, 4, 128, 128, "bfloat16", "scalar")
    mesh = _mesh((2, 2), ("data", "heads"))
    args = _specs(mesh, 2, 128, problem, P("data", None, "heads"), P("data", "heads"))
    with pallas_tpu.interpreting(False), jax.set_mesh(mesh):
        lowered = jax.jit(_fwd_bwd(None, tuned)).trace(*args).lower(lowering_platforms=("tpu",))
    text = lowered.compile().as_text()
    assert "tpu_custom_call" in text
    assert compilers.collective_bytes(text, per_channel=True) == {}


@pytest.mark.parametrize("Hk, Hv", [(2, 4), (1, 2)])
def test_sharded_jit_over_auto_axes_takes_the_partitioned_path(Hk, Hv):
    """Auto mesh axes of a 4-chip topology traced on this one-device host: the call is the
    custom-partitioned op (`gdngen.sharding.partitioned`), not one Mosaic call the
    partitioner cannot split ("Mosaic kernels cannot be automatically partitioned"). One key
    head too: its sharding rule has no compound head factor with a factor of size 1, which
    Shardy's verifier refuses."""
    import jax
    from jax.sharding import PartitionSpec as P

    from gdngen.backends.pallas import tpu as pallas_tpu

    problem = Problem(Hk, Hv, 128, 128, "bfloat16", "scalar")
    variant = registry.default_variant("pallas_tpu", problem, "tpu-v5e")
    mesh = _mesh((2, 2), ("data", "heads"), explicit=False)
    heads = "heads" if Hk > 1 else None  # one key head: the batch sharded only
    args = _specs(mesh, 2, 128, problem, P("data", None, heads), P("data", heads))
    with pallas_tpu.interpreting(False):
        text = jax.jit(_fwd_bwd(variant)).trace(*args).lower(
            lowering_platforms=("tpu",)).as_text()
    assert "CustomSPMDPartitioning" in text


def test_context_parallel_over_four_chips_communicates_only_the_transitions():
    """Context parallelism over a 4-chip topology (time split over "seq"), fwd+bwd compiled:
    only README's collectives, the all-gather of the transitions (M, N) (P·B·Hv·Dk·(Dk+Dv)
    float32 words) and the all-reduce of the entering states' cotangents (P·B·Hv·Dv·Dk)."""
    import jax
    from jax.sharding import PartitionSpec as P

    from gdngen.backends.pallas import tpu as pallas_tpu

    problem = Problem(1, 2, 128, 128, "float32", "scalar")
    variant = registry.default_variant("pallas_tpu", problem, "tpu-v5e")
    mesh = _mesh((4,), ("seq",))
    token, state = P(None, "seq"), P()
    step = jax.shard_map(_fwd_bwd(variant, context_axis="seq"), mesh=mesh,
                         in_specs=(token,) * 6 + (state,),
                         out_specs=((token, state), (token,) * 5))
    args = _specs(mesh, 1, 4 * 64, problem, token, state)
    with pallas_tpu.interpreting(False), jax.set_mesh(mesh):
        lowered = jax.jit(step).trace(*args).lower(lowering_platforms=("tpu",))
    text = lowered.compile().as_text()
    n, B, Hv, D = 4, 1, problem.Hv, problem.Dk
    assert "tpu_custom_call" in text
    assert compilers.collective_bytes(text, per_channel=True) == {
        "all-gather": n * B * Hv * D * (D + D) * 4, "all-reduce": n * B * Hv * D * D * 4}


# ------------------------------------------------------------------------------ build, tune

SMALL_VARIANT = ('{"chunk_size": 64, "dv_tile": 128, "head_tile": 2, "precision": "ieee", '
                 '"save_states": true, "recurrent_below": 64}')


def _build(tmp_path, *extra, device="tpu-v5e"):
    from click.testing import CliRunner

    from gdngen.tools.cli import main

    return CliRunner().invoke(main, [
        "build", "--backend", "pallas_tpu", "--problem", "Hk=1,Hv=2,Dk=128,Dv=128,dtype=bfloat16",
        "--device", device, "--compile", "--compile-seq", "64", "--no-validate",
        "--variant", SMALL_VARIANT, "--out", str(tmp_path / "out"), "--json", *extra])


@pytest.mark.parametrize("device, target", [("tpu-v5e", "TPU v5 lite"), ("tpu-v7x", "TPU7x")])
def test_build_compile_records_the_compile(tmp_path, monkeypatch, device, target):
    # with the first-use check on (a user's default): the compile traces the kernels, not the
    # portable fallback the check of this CPU host would choose
    monkeypatch.setenv("GDNGEN_VALIDATE", "first-use")
    monkeypatch.setenv("GDNGEN_CACHE_DIR", str(tmp_path / "cache"))
    _available(device)
    result = _build(tmp_path, device=device)
    assert result.exit_code == 0, result.output
    printed = json.loads(result.output[result.output.index("["):])
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    entry = manifest["variants"][0]["compile"]
    assert printed[0]["compile"] == entry
    assert entry["compiler"] == "mosaic" and entry["target"] == target
    assert entry["ok"] is True and entry["error"] is None
    assert entry["code_bytes"] > 0 and entry["temp_bytes"] >= 0
    assert [p["name"] for p in entry["programs"]] == [
        "chunk_fwd_bwd", "recurrent_forward", "packed_fwd_bwd", "fused_fwd_bwd",
        "fused_recurrent_forward", "fused_chunk_forward", "steps_forward"]


def test_build_compile_fails_when_mosaic_rejects_a_kernel(tmp_path):
    """A template override giving the recurrent kernel a 4 KiB scoped-VMEM limit: Mosaic
    rejects it, the variant fails with the compiler's message, the command exits 1."""
    from gdngen import resources

    source = resources.templates_dir("pallas_tpu") / "recurrent.py.j2"
    override = tmp_path / "templates" / "pallas_tpu"
    override.mkdir(parents=True)
    text = source.read_text()
    assert "VMEM_LIMIT_BYTES = {{ vmem_limit_bytes }}" in text
    (override / "recurrent.py.j2").write_text(
        text.replace("VMEM_LIMIT_BYTES = {{ vmem_limit_bytes }}", "VMEM_LIMIT_BYTES = 4096"))
    result = _build(tmp_path, "--templates", str(tmp_path / "templates"))
    assert result.exit_code == 1, result.output
    entry = json.loads((tmp_path / "out" / "manifest.json").read_text())["variants"][0]
    assert entry["status"] == "failed" and entry["compile"]["ok"] is False
    failed = {p["name"] for p in entry["compile"]["programs"] if not p["ok"]}
    assert failed == {"recurrent_forward", "fused_recurrent_forward", "steps_forward"}
    assert entry["compile"]["error"].startswith("recurrent_forward: ")


def test_build_compile_needs_a_tpu_device(tmp_path):
    from click.testing import CliRunner

    from gdngen.tools.cli import main

    args = ["build", "--backend", "pallas_tpu", "--compile", "--out", str(tmp_path)]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2 and "--device" in result.output
    result = CliRunner().invoke(main, args + ["--device", "h100"])
    assert result.exit_code == 2 and "--device" in result.output and "tpu" in result.output


def test_tune_space_drops_what_does_not_compile(tmp_path, monkeypatch):
    """`check_targets` leaves the variants the compiler rejects out of the target's space and
    remembers each verdict (a second check compiles nothing)."""
    from gdngen.tune.target import targets

    monkeypatch.setenv("GDNGEN_CACHE_DIR", str(tmp_path))
    problem = Problem(1, 2, 128, 128, "bfloat16", "scalar")
    (target,) = targets("tpu-v5e", ("jax",), [problem], backends=("pallas_tpu",))
    space = target.space()
    rejected = space[1].name()
    compiled = []

    def compile_variant(variant, problem, device, **kwargs):
        compiled.append(variant.name())
        if variant.name() != rejected:
            return compilers.CompileReport("mosaic", "TPU v5 lite", "tpu-v5e")
        return compilers.CompileReport("mosaic", "TPU v5 lite", "tpu-v5e",
                                       error="Mosaic: scoped VMEM exceeded")

    monkeypatch.setattr(compilers.verdicts, "compile_variant", compile_variant)
    ((checked, dropped),) = compilers.check_targets([target])
    assert dropped == {rejected: "Mosaic: scoped VMEM exceeded"}
    assert [v.name() for v in checked.space()] == [v.name() for v in space if v.name() != rejected]
    assert sorted(compiled) == sorted(v.name() for v in space)
    compiled.clear()
    ((again, dropped_again),) = compilers.check_targets([target])
    assert compiled == [] and dropped_again == dropped and again.space() == checked.space()


def test_load_tuned_traces_ahead_of_time_for_a_topology():
    """The public route of the test above (MaxText's ``train_compile`` from a CPU host): within
    `compilers.targeting`, ``load_tuned("jax", "tpu-v5e")`` (refused outside it: not attached)
    takes the v5e's variant, and its sharded jit compiles for the 4 chips with Mosaic kernels
    and no collective; the interpret mode and the first-use gate come back after it."""
    import jax
    from jax.sharding import PartitionSpec as P

    import gdngen
    from gdngen import dispatch
    from gdngen.backends.pallas import tpu as pallas_tpu

    with pytest.raises(ValueError, match="'tpu-v5e' is not attached"):
        gdngen.load_tuned("jax", device="tpu-v5e")
    interpret = pallas_tpu.interpret_mode()
    problem = Problem(2, 4, 128, 128, "bfloat16", "scalar")
    with compilers.targeting("tpu-v5e") as chips:
        assert [c.device_kind for c in chips] == ["TPU v5 lite"] * 4
        assert pallas_tpu.interpret_mode() is False and dispatch._LOCAL.ungated
        tuned = gdngen.load_tuned("jax", device="tpu-v5e")
        mesh = _mesh((2, 2), ("data", "heads"))
        args = _specs(mesh, 2, 128, problem, P("data", None, "heads"), P("data", "heads"))
        assert tuned.explain(*args[:5]).variant.backend == "pallas_tpu"
        with jax.set_mesh(mesh):
            lowered = jax.jit(_fwd_bwd(None, tuned)).trace(*args).lower(
                lowering_platforms=("tpu",))
    text = lowered.compile().as_text()
    assert compilers.mosaic_kernels(text), "no Mosaic kernel in the compiled program"
    assert compilers.collective_bytes(text, per_channel=True) == {}
    assert pallas_tpu.interpret_mode() == interpret and not dispatch._LOCAL.ungated
    with pytest.raises(ValueError, match="'tpu-v5e' is not attached"):
        gdngen.load_tuned("jax", device="tpu-v5e")
