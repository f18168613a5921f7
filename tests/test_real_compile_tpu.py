"""pallas_tpu compiled for real TPUs without one: Mosaic + XLA TPU through libtpu's compile-only
topologies (`gdngen.compilers`), for every TPU generation gdngen knows; the footprint model
against the compiler's VMEM; sharded and context-parallel programs over a 4-chip topology.

Skips (with the reason) when libtpu is not installed (``pip install 'gdngen[tpu]'``).
"""

from __future__ import annotations

import json

import pytest

from gdngen import compilers, devices, registry
from gdngen.variant import Problem

pytestmark = pytest.mark.skipif(compilers.missing_reason("mosaic") is not None,
                                reason=str(compilers.missing_reason("mosaic")))

TPUS = [name for name, d in devices.DEVICES.items() if d.kind == "tpu"]
# small heads that still run every kernel path: a GVA group of 2 (scalar; head tile 2) and
# Hk = Hv (per-channel, as Kimi-Linear)
SMALL = {"scalar": Problem(1, 2, 128, 128, "bfloat16", "scalar"),
         "vector": Problem(2, 2, 128, 128, "bfloat16", "vector")}


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
    assert set(TPUS) == {"tpu-v4", "tpu-v5e", "tpu-v5p", "tpu-v6e"}
    kinds = {name: compilers.target_device(name).device_kind for name in TPUS}
    assert {devices.device_from_jax("tpu", kind) for kind in kinds.values()} == set(TPUS), kinds


@pytest.mark.parametrize("gate", ["scalar", "vector"])
@pytest.mark.parametrize("device", TPUS)
def test_default_variant_compiles_fwd_bwd(device, gate):
    """The default variant's chunk forward + backward and its recurrent forward, compiled."""
    problem = SMALL[gate]
    variant = registry.default_variant("pallas_tpu", problem, device)
    report = compilers.compile_variant(variant, problem, device, T=64,
                                       only=("chunk_fwd_bwd", "recurrent_forward"))
    _check_report(report, device)
    names = {p.name: [k["name"].split(".")[0] for k in p.kernels] for p in report.programs}
    assert set(names) == {"chunk_fwd_bwd", "recurrent_forward"}
    assert set(names["recurrent_forward"]) == {"gdn_recurrent"}
    assert len(names["chunk_fwd_bwd"]) >= 2  # the forward and the backward walk(s)


@pytest.mark.parametrize("gate", ["scalar", "vector"])
def test_every_program_of_a_call_compiles(gate):
    """Chunk fwd+bwd, recurrent, packed row (scalar) and the fused-input build (qk_norm,
    softplus gate; fwd+bwd and recurrent) of the default variant, for TPU v5e."""
    problem = SMALL[gate]
    variant = registry.default_variant("pallas_tpu", problem, "tpu-v5e")
    report = compilers.compile_variant(variant, problem, "tpu-v5e", T=64)
    _check_report(report, "tpu-v5e")
    expected = {"chunk_fwd_bwd", "recurrent_forward", "fused_fwd_bwd", "fused_recurrent_forward",
                "steps_forward"}
    assert {p.name for p in report.programs} == expected | (
        {"packed_fwd_bwd"} if gate == "scalar" else set())
    assert json.loads(json.dumps(report.to_json()))["ok"] is True


def test_qwen3_next_heads_compile():
    """The real Qwen3-Next shape (Hk=16, Hv=32, D=128, bf16), default variant, fwd+bwd."""
    problem = Problem(16, 32, 128, 128, "bfloat16", "scalar")
    variant = registry.default_variant("pallas_tpu", problem, "tpu-v5e")
    report = compilers.compile_variant(variant, problem, "tpu-v5e", T=256,
                                       only=("chunk_fwd_bwd",))
    _check_report(report, "tpu-v5e")


@pytest.mark.parametrize("device", TPUS)
def test_footprint_model_admits_what_fits(device):
    """The variant the footprint model admits with the largest estimate (closest to the
    device's VMEM budget) compiles for the device, and the VMEM the compiler used is within
    the 25% margin the render adds to the estimate for Mosaic's limit (`_vmem_limit`), so the
    model never admits a variant the compiler rejects for size."""
    from gdngen.backends.pallas import tpu as pallas_tpu

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


def test_sharded_jit_over_auto_axes_takes_the_partitioned_path():
    """Auto mesh axes of a 4-chip topology traced on this one-device host: the call is the
    custom-partitioned op (`gdngen.sharding.partitioned`), not one Mosaic call the
    partitioner cannot split ("Mosaic kernels cannot be automatically partitioned")."""
    import jax
    from jax.sharding import PartitionSpec as P

    from gdngen.backends.pallas import tpu as pallas_tpu

    problem = Problem(2, 4, 128, 128, "bfloat16", "scalar")
    variant = registry.default_variant("pallas_tpu", problem, "tpu-v5e")
    mesh = _mesh((2, 2), ("data", "heads"), explicit=False)
    args = _specs(mesh, 2, 128, problem, P("data", None, "heads"), P("data", "heads"))
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


def _build(tmp_path, *extra):
    from click.testing import CliRunner

    from gdngen.tools.cli import main

    return CliRunner().invoke(main, [
        "build", "--backend", "pallas_tpu", "--problem", "Hk=1,Hv=2,Dk=128,Dv=128,dtype=bfloat16",
        "--device", "tpu-v5e", "--compile", "--compile-seq", "64", "--no-validate",
        "--variant", SMALL_VARIANT, "--out", str(tmp_path / "out"), "--json", *extra])


def test_build_compile_records_the_compile(tmp_path):
    result = _build(tmp_path)
    assert result.exit_code == 0, result.output
    printed = json.loads(result.output[result.output.index("["):])
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    entry = manifest["variants"][0]["compile"]
    assert printed[0]["compile"] == entry
    assert entry["compiler"] == "mosaic" and entry["target"] == "TPU v5 lite"
    assert entry["ok"] is True and entry["error"] is None
    assert entry["code_bytes"] > 0 and entry["temp_bytes"] >= 0
    assert [p["name"] for p in entry["programs"]] == [
        "chunk_fwd_bwd", "recurrent_forward", "packed_fwd_bwd", "fused_fwd_bwd",
        "fused_recurrent_forward", "steps_forward"]


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
