"""Validation on first use (`gdngen.firstuse`): a generated kernel runs only after it passed on
the device; a wrong one is caught, stored, reused by later processes, and its calls fall back
to the portable backend with correct results."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gdngen import firstuse, registry
from gdngen.backends.ffi_cpu import kernels as ffi_kernels
from gdngen.problem import Problem
from gdngen.resources import templates_dir
from gdngen.variant import Variant

SCRIPT = Path(__file__).parent / "firstuse_call.py"
PROBLEM = Problem(1, 2, 16, 16, "float32", "scalar")
#: the ffi_cpu backward's dbeta with the wrong sign (forward untouched)
WRONG = ("dbeta[step * s.Hv + h] = db[t];", "dbeta[step * s.Hv + h] = -db[t];")
needs_ffi = pytest.mark.skipif(not ffi_kernels.available(), reason="ffi_cpu needs a C++ compiler")


@pytest.fixture(scope="module")
def ffi_cpu_builds(tmp_path_factory) -> Path:
    """The module's compiled ffi_cpu libraries (`gdngen.backends.ffi_cpu.kernels.library_path`,
    keyed by the rendered sources' sha256 and the toolchain): each cache root below links its
    ffi_cpu folder here, so a process that needs the shipped kernels (or a planted template's,
    a key of its own) finds them compiled once per module (~20 s of g++ each) instead of
    once per process. Verdicts stay in each test's own cache root."""
    return tmp_path_factory.mktemp("ffi_cpu_builds")


def _cache_root(root: Path, builds: Path) -> Path:
    """``root`` with no verdicts, its ffi_cpu folder linked to ``builds``."""
    root.mkdir(parents=True)
    (root / ffi_kernels.BACKEND).symlink_to(builds, target_is_directory=True)
    return root


def plant(fresh, monkeypatch, backend: str, template: str, old: str, new: str) -> None:
    """Serve ``backend``'s ``template`` with its one ``old`` replaced by ``new`` (a planted bug)
    from an override folder under ``fresh`` (``GDNGEN_TEMPLATES``)."""
    text = (templates_dir(backend) / template).read_text()
    assert text.count(old) == 1
    folder = fresh / "override" / backend
    folder.mkdir(parents=True)
    (folder / template).write_text(text.replace(old, new))
    monkeypatch.setenv("GDNGEN_TEMPLATES", str(folder.parent))


@pytest.fixture
def fresh(tmp_path, monkeypatch, ffi_cpu_builds):
    """A checking process of its own: a cache root with no verdicts (compiled ffi_cpu libraries
    shared, `ffi_cpu_builds`), GDNGEN_VALIDATE=first-use, no memo."""
    monkeypatch.setenv("GDNGEN_CACHE_DIR", str(_cache_root(tmp_path / "cache", ffi_cpu_builds)))
    monkeypatch.setenv("GDNGEN_VALIDATE", "first-use")
    monkeypatch.setenv("GDNGEN_NO_TUNED", "1")
    firstuse.clear_memo()
    yield tmp_path
    firstuse.clear_memo()


def _planted(tmp_path) -> Path:
    text = (templates_dir("ffi_cpu") / "gated_delta.cc.j2").read_text()
    assert text.count(WRONG[0]) == 1
    folder = tmp_path / "override" / "ffi_cpu"
    folder.mkdir(parents=True)
    (folder / "gated_delta.cc.j2").write_text(text.replace(*WRONG))
    return folder.parent


def _process(env: dict, delay: float = 0.0) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(SCRIPT), str(delay)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _result(proc: subprocess.Popen) -> dict:
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


def _env(tmp_path, **extra) -> dict:
    return {**os.environ, "GDNGEN_CACHE_DIR": str(tmp_path / "cache"), "JAX_PLATFORMS": "cpu",
            "GDNGEN_VALIDATE": "first-use", "GDNGEN_NO_TUNED": "1", **extra}


def test_mode_and_call_kind(monkeypatch):
    monkeypatch.setenv("GDNGEN_VALIDATE", "sometimes")
    with pytest.raises(ValueError, match="GDNGEN_VALIDATE must be one of"):
        firstuse.mode()
    monkeypatch.delenv("GDNGEN_VALIDATE")
    assert firstuse.mode() == "first-use"
    cases = firstuse.probe_cases(Problem(2, 6, 64, 32, "bfloat16", "vector"), 32, "vector log")
    assert [c.name for c in cases] == ["vector_strong_half", "vector_masked_gva3", "vector_t1"]
    assert {(c.Hk, c.Hv, c.Dk, c.Dv, c.chunk_size) for c in cases} == {(2, 6, 64, 32, 32)}
    assert [c.T for c in cases] == [51, 51, 1] and not any(c.states for c in cases)
    (packed,) = firstuse.probe_cases(PROBLEM, 64, "scalar linear packed")
    assert packed.cu_seqlens is not None and (packed.Hv, packed.Dk) == (2, 16)
    assert firstuse.probe_cases(PROBLEM, 16, "scalar log steps")[0].states


@needs_ffi
def test_a_passing_kernel_is_checked_once_and_its_verdict_reused(fresh, ffi_cpu_builds):
    """The first call (under jit and grad) checks the default ffi_cpu variant and stores a
    passed verdict; a new process (the memo cleared) reads it and checks nothing."""
    result = _result(_process(_env(fresh)))
    assert result["checks"] == ["scalar log"] and result["warnings"] == []
    assert max(result["errors"].values()) < 5e-5
    (stored,) = firstuse.stored("cpu")
    assert stored["passed"] and stored["backend"] == "ffi_cpu" and stored["kind"] == "scalar log"
    assert stored["worst_error"] < stored["tolerance"] == 5e-5
    assert set(stored["cases"]) == {"hard_decay", "short_masked", "identical_keys", "t1"}
    again = _result(_process(_env(fresh)))
    assert again["checks"] == [] and again["errors"] == pytest.approx(result["errors"])
    always = _result(_process(_env(fresh, GDNGEN_VALIDATE="always")))
    assert always["checks"] == ["scalar log"]
    other = _cache_root(fresh / "other", ffi_cpu_builds)
    off = _result(_process(_env(fresh, GDNGEN_VALIDATE="off", GDNGEN_CACHE_DIR=str(other))))
    assert off["checks"] == [] and not (fresh / "other" / "verdicts").exists()


@needs_ffi
def test_a_planted_wrong_kernel_never_runs(fresh):
    """A template override with dbeta's sign flipped: the first call's check fails it, the call
    runs the portable xla path (correct values and gradients) with one warning naming the
    backend, case, quantity and verdict; a second process reuses the failed verdict."""
    env = _env(fresh, GDNGEN_TEMPLATES=str(_planted(fresh)))
    first = _result(_process(env))
    assert first["checks"] == ["scalar log"]
    assert max(first["errors"].values()) < 5e-5, first["errors"]
    (warning,) = first["warnings"]
    (stored,) = firstuse.stored("cpu")
    assert not stored["passed"] and stored["worst_quantity"] == "dbeta"
    assert stored["worst_error"] > 0.5 and stored["worst_case"] in stored["cases"]
    for text in ("ffi_cpu", "failed its first-use check on cpu", stored["worst_case"],
                 "dbeta relative error", "portable xla backend", stored["path"]):
        assert text in warning
    second = _result(_process(env))
    assert second["checks"] == [] and second["warnings"] == [warning]
    assert max(second["errors"].values()) < 5e-5


@needs_ffi
def test_concurrent_first_calls_leave_one_verdict(fresh):
    """Three processes' first calls at once: one checks (under the verdict's file lock), the
    others wait and read its verdict; one complete verdict file."""
    procs = [_process(_env(fresh), delay=0.5) for _ in range(3)]
    results = [_result(p) for p in procs]
    assert sum(len(r["checks"]) for r in results) == 1
    assert all(max(r["errors"].values()) < 5e-5 and not r["warnings"] for r in results)
    (stored,) = firstuse.stored("cpu")
    assert stored["passed"] and "unreadable" not in stored
    assert [p.name for p in (fresh / "cache" / "verdicts" / "cpu").glob("*.json")] == \
        [Path(stored["path"]).name]


@needs_ffi
def test_an_active_tuned_entry_counts_as_passed(fresh, monkeypatch):
    """The variant of an active tuned entry on this device is admitted without a check."""
    from gdngen import cache
    from gdngen.call import Call
    from gdngen.shape import CallShape

    monkeypatch.delenv("GDNGEN_NO_TUNED")
    entries = [e for e in cache.load("cpu").entries.values() if e["backend"] == "ffi_cpu"]
    if not entries:
        pytest.skip("no active ffi_cpu entry in the shipped tuned file for this host")
    entry = entries[0]
    problem, variant = Problem.from_json(entry["problem"]), Variant.from_json(entry["variant"])
    monkeypatch.setattr(firstuse, "check", lambda *a, **k: pytest.fail("checked again"))
    shape = CallShape(1, 8, problem.Hk, problem.Hv, problem.Dk, problem.Dv,
                      problem.gate == "vector")
    call = Call("jax", shape, problem.dtype)
    assert firstuse.admitted(call, variant, "cpu", entry["precision"]) == variant
    assert firstuse.stored("cpu") == []


def test_a_packed_build_is_checked_on_its_own_sources(fresh, monkeypatch):
    """A packed call of ffi_cpu runs its packed build (sources of their own): its verdict is
    keyed by that build's sha256 as well, a tuned entry of the variant does not vouch for it,
    and a changed packed build is checked again."""
    from gdngen import cache
    from gdngen.call import Call
    from gdngen.shape import CallShape

    checked = []
    monkeypatch.setattr(firstuse, "check", lambda *a, **k: checked.append(a[2]) or {
        "passed": True, "worst_error": 0.0, "worst_case": "packed_boundaries",
        "worst_quantity": "y", "tolerance": 5e-5, "cases": {}, "seconds": 0.0})
    tuned = []
    monkeypatch.setattr(firstuse, "_tuned", lambda *a: tuned.append(a) or firstuse.Verdict(
        True, {"passed": True, "source": "tuned"}, None))
    spec = registry.get("ffi_cpu")
    variant = registry.default_variant("ffi_cpu", PROBLEM)
    packed = Call("jax", CallShape(1, 8, 1, 2, 16, 16, False, sequences=3), "float32")
    dense = packed.replace(shape=CallShape(1, 8, 1, 2, 16, 16, False))
    assert firstuse.admitted(dense, variant, "cpu", "ieee") == variant
    assert (checked, len(tuned)) == ([], 1)  # the dense kernels: the tuned entry vouches
    assert firstuse.admitted(packed, variant, "cpu", "ieee") == variant
    assert (checked, len(tuned)) == (["scalar log packed"], 1)
    (record,) = firstuse.stored("cpu")
    assert record["packed_sha256"] == spec.render_packed(variant, PROBLEM).sha256
    assert record["sha256"] == cache.variant_sha256(variant, PROBLEM)

    class Changed:  # another packed build of the same variant
        sha256 = "0" * 64

    monkeypatch.setattr(spec, "render_packed", lambda *a, **k: Changed())
    firstuse.clear_memo()
    assert firstuse.admitted(packed, variant, "cpu", "ieee") == variant
    assert checked == ["scalar log packed"] * 2
    assert sorted(r["packed_sha256"] for r in firstuse.stored("cpu")) == sorted(
        [record["packed_sha256"], Changed.sha256])


@needs_ffi
def test_portable_backends_and_ungated_calls_are_not_checked(fresh, monkeypatch):
    """xla is never checked; the battery's runners (`gdngen.dispatch.ungated`) run an explicit
    ffi_cpu variant as given; the same call outside is checked first."""
    import jax.numpy as jnp

    import gdngen.jax
    from gdngen import dispatch

    checked = []
    monkeypatch.setattr(firstuse, "check", lambda *a, **k: checked.append(a[2]) or {
        "passed": True, "worst_error": 0.0, "worst_case": "t1", "worst_quantity": "y",
        "tolerance": 5e-5, "cases": {}, "seconds": 0.0})
    ones = [jnp.ones(s, jnp.float32) for s in ((1, 4, 1, 16), (1, 4, 1, 16), (1, 4, 2, 16))]
    g, beta = -0.1 * jnp.ones((1, 4, 2)), 0.5 * jnp.ones((1, 4, 2))
    for backend in ("xla", "ffi_cpu"):
        variant = registry.default_variant(backend, PROBLEM)
        with dispatch.ungated():
            gdngen.jax.gated_delta(*ones, g, beta, variant=variant)
        assert checked == []
    # inside jax.shard_map (another T: the eager call's trace of those shapes was ungated)
    import jax
    from jax.sharding import Mesh, PartitionSpec

    mesh = Mesh(jax.devices()[:1], ("data",))
    spec = PartitionSpec("data")
    jax.shard_map(lambda *a: gdngen.jax.gated_delta(*a, variant=variant), mesh=mesh,
                  in_specs=spec, out_specs=spec)(*(x[:, :3] for x in (*ones, g, beta)))
    assert checked == ["scalar log"]
    (stored,) = firstuse.stored("cpu")
    assert stored["passed"] and stored["variant"] == variant.to_json()


@pytest.mark.parametrize("backend", ["metal", "pallas_gpu",
                                     pytest.param("pallas_tpu", marks=pytest.mark.slow)])
def test_every_generated_backend_goes_through_the_same_check(fresh, backend):
    """metal under the MSL simulator, pallas_gpu / pallas_tpu in interpret mode: the gate
    checks the variant on its first call and stores a passed verdict (metal's gate called
    while ``mx.compile`` traces: the check runs on a thread of its own)."""
    from gdngen.call import Call
    from gdngen.shape import CallShape

    D = 16 if backend == "pallas_gpu" else 32  # metal's kernels: head dims multiples of 32
    problem = Problem(1, 2, D, D, "float32", "scalar")
    variant = registry.default_variant(backend, problem)
    if backend != "pallas_tpu":  # probes of 16 + 8 + 3 steps: two chunks, the second ragged
        variant = variant.replace(chunk_size=16)
    spec = registry.get(backend)
    call = Call(spec.framework, CallShape(1, 8, 1, 2, D, D, False), "float32")
    if backend == "metal":
        import mlx.core as mx

        chosen = []
        mx.compile(lambda x: chosen.append(firstuse.admitted(call, variant)) or x)(mx.ones(2))
    else:
        chosen = [firstuse.admitted(call, variant)]
    assert chosen == [variant]
    (stored,) = firstuse.stored("cpu")
    assert stored["passed"] and stored["backend"] == backend, stored
    assert max(stored["cases"].values()) <= stored["tolerance"]
    assert stored["sha256"] and stored["kind"] == "scalar log"


@needs_ffi
def test_validate_device_attached_checks_what_would_run(fresh, monkeypatch):
    """``gdngen validate --device attached`` checks every planned generated variant now (the
    default of --problem here), stores the verdicts and exits 1 when one fails."""
    from click.testing import CliRunner

    from gdngen.tools.cli import main

    monkeypatch.setattr(firstuse, "planned", lambda fw, device, problems=(): [
        (registry.default_variant("ffi_cpu", p), p) for p in problems if fw == "jax"])
    args = ["validate", "--device", "attached", "--problem", "Hk=1,Hv=2,Dk=16,Dv=16", "--json"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    (row,) = json.loads(result.output)
    assert row["passed"] and row["backend"] == "ffi_cpu" and row["problem"] == PROBLEM.key()
    assert Path(row["path"]).exists() and row["worst_error"] <= row["tolerance"]
    failing = {"passed": False, "worst_error": 0.9, "worst_case": "t1", "worst_quantity": "dq",
               "tolerance": 5e-5, "cases": {"t1": 0.9}, "seconds": 0.1}
    monkeypatch.setattr(firstuse, "check", lambda *a, **k: dict(failing))
    Path(row["path"]).unlink()  # else this process's own verdict (as a new process: checked)
    result = CliRunner().invoke(main, args[:-1])
    assert result.exit_code == 1 and "FAIL" in result.output and "t1 dq 9.0e-01" in result.output
    assert not firstuse.stored("cpu")[0]["passed"]


def test_the_call_kind_names_the_inputs_the_kernels_compute():
    from gdngen.call import Call
    from gdngen.shape import CallShape

    call = Call("jax", CallShape(1, 8, 1, 2, 16, 16, True), "float32", qk_norm=True,
                gate_form="softplus", return_states="steps")
    assert firstuse.call_kind(call, "ffi_cpu") == "vector log steps qk_norm softplus"
    assert firstuse.call_kind(call) == "vector log steps"  # no backend: nothing fused
    packed = call.replace(shape=CallShape(1, 8, 1, 2, 16, 16, False, sequences=3),
                          return_states="final")
    assert firstuse.call_kind(packed, "ffi_cpu") == "scalar log packed"


def test_the_call_kind_names_the_conv_where_the_kernels_take_it():
    from gdngen.call import Call
    from gdngen.shape import CallShape

    call = Call("mlx", CallShape(1, 8, 1, 2, 32, 32, False), "float32", qk_norm=True,
                gate_form="softplus", conv_size=4)
    assert firstuse.call_kind(call, "metal") == "scalar log qk_norm softplus conv"
    assert firstuse.call_kind(call, "mlx") == "scalar log qk_norm softplus"  # no conv
    steps = call.replace(return_states="steps")  # the conv is computed before such calls
    assert firstuse.call_kind(steps, "metal") == "scalar log steps qk_norm softplus"
    normed = Call("jax", CallShape(1, 8, 1, 2, 32, 32, False), "float32", qk_norm=True,
                  gate_form="softplus", conv_size=4, norm_gate="sigmoid")
    assert firstuse.call_kind(normed, "ffi_cpu") == \
        "scalar log qk_norm softplus conv norm_sigmoid"
    assert firstuse.call_kind(normed, "xla") == "scalar log qk_norm softplus"  # norm after
    assert firstuse.call_kind(normed.replace(return_states="steps"), "ffi_cpu") == \
        "scalar log steps qk_norm softplus"


@pytest.mark.parametrize("planted", [False, True])
def test_a_conv_build_is_checked_from_the_raw_inputs(fresh, monkeypatch, planted):
    """A metal call whose recurrent kernel convolves in its loads is checked through that
    kernel (the T = 1 case, and the others' forward through the switch's other side) against
    the float64 conv + norm + gate + recurrence, every gradient included (dconv_weight,
    dconv_state): a planted conv that drops the oldest tap fails, the shipped one passes."""
    from gdngen.backends.metal import sim

    if not sim.available():
        pytest.skip("the MSL simulator needs a C++ compiler")
    problem = Problem(1, 2, 32, 32, "float32", "scalar")
    if planted:
        old = "  for (int i = 0; i < K; ++i) {\n    const int u = t - (K - 1) + i;"
        plant(fresh, monkeypatch, "metal", "layer_inputs.metal.j2", old,
              old.replace("i = 0;", "i = 1;"))
    variant = registry.default_variant("metal", problem)
    record = firstuse.check(variant, problem, "scalar log qk_norm softplus conv")
    assert record["passed"] is not planted, record
    assert set(record["cases"]) == {"hard_decay", "short_masked", "identical_keys", "t1"}
    if planted:  # T = 1, or a longer probe's forward through the other side of the switch
        assert record["worst_case"] == "t1" or record["worst_quantity"].endswith(
            "_other_path"), record
        assert record["worst_error"] > 1e-2, record


@needs_ffi
@pytest.mark.parametrize("planted", [None, "mean", "chunk_rows"])
def test_a_norm_build_is_checked_through_its_stores(fresh, monkeypatch, planted):
    """An ffi_cpu call whose kernels compute the output's gated norm in their stores is checked
    through them (the undifferentiated call's output: the recurrent kernel's at the probes' T,
    the chunk forward's through the switch's other side; the gradients through the norm's VJP)
    against the float64 recurrence + norm, dnorm_weight and doutput_gate included: a planted
    norm dividing by Dv - 1 (both kernels) fails in y, one that reads the chunk's first z row
    for every row (the chunk forward only) in y_other_path; the shipped ones pass."""
    # a problem each: the eager calls' compiled steps are cached per call in the process
    problem = Problem(1, 2, 32, {None: 48, "mean": 32, "chunk_rows": 64}[planted], "float32",
                      "scalar")
    if planted == "mean":
        old = "squares / static_cast<float>(Dv) + eps"
        plant(fresh, monkeypatch, "ffi_cpu", "layer_inputs.cc.j2", old,
              old.replace("Dv)", "Dv - 1)"))
    elif planted == "chunk_rows":
        old = "nm.z + ((b * s.T + n * C + t)"
        plant(fresh, monkeypatch, "ffi_cpu", "gated_delta.cc.j2", old, old.replace(" + t)", ")"))
    variant = registry.default_variant("ffi_cpu", problem)
    record = firstuse.check(variant, problem, "scalar log qk_norm softplus norm_silu")
    assert record["passed"] is (planted is None), record
    assert set(record["cases"]) == {"hard_decay", "short_masked", "identical_keys", "t1"}
    if planted:  # a wrong mean: both kernels
        quantities = {"y", "y_other_path"} if planted == "mean" else {"y_other_path"}
        assert record["worst_quantity"] in quantities and record["worst_error"] > 1e-3, record


@pytest.mark.parametrize("planted", [pytest.param(None, marks=pytest.mark.slow), "recurrent",
                                     "chunk"])
def test_a_padded_norm_build_is_checked_through_its_stores(fresh, monkeypatch, planted):
    """pallas_gpu's norm builds with Dv = 24 (rows zero-padded to 32, one program per head):
    their mean is over the real Dv; a planted mean over the padded DV, in the recurrent
    kernel or in the chunk forward's walk, fails the first-use check (in y or y_other_path:
    each probe runs both sides of the switch), the shipped ones pass."""
    problem = Problem(1, 2, {None: 32, "recurrent": 16, "chunk": 64}[planted], 24, "float32",
                      "scalar")
    mean = "jnp.sum(y * y) / NORM_DV + eps", "jnp.sum(y * y, axis=1) / NORM_DV + eps"
    check_gpu_plant(fresh, monkeypatch, planted, problem, "scalar log qk_norm softplus norm_silu",
                    {"recurrent": ("recurrent.py.j2", mean[0], mean[0].replace("NORM_DV", "DV")),
                     "chunk": ("forward.py.j2", mean[1], mean[1].replace("NORM_DV", "DV"))})


def check_gpu_plant(fresh, monkeypatch, planted, problem, key, plants, quantities=("y",)):
    """First use of pallas_gpu's default variant for ``problem`` (a problem per case: the eager
    calls' compiled steps are cached per call in the process) and the build ``key``, with
    ``plants[planted]`` = (template, old, new) planted (None: the shipped templates): the check
    passes unplanted, and fails planted in one of ``quantities`` or its ``_other_path`` twin (the
    probes run both sides of the switch)."""
    if planted:
        plant(fresh, monkeypatch, "pallas_gpu", *plants[planted])
    variant = registry.default_variant("pallas_gpu", problem)
    assert registry.get("pallas_gpu").holds_whole_head(variant, problem)
    record = firstuse.check(variant, problem, key)
    assert record["passed"] is (planted is None), record
    if planted:
        expected = {q + side for q in quantities for side in ("", "_other_path")}
        assert record["worst_quantity"] in expected, record
        assert record["worst_error"] > 1e-2, record


@pytest.mark.parametrize("planted", [pytest.param(None, marks=pytest.mark.slow), "recurrent",
                                     "chunk", pytest.param("chunk_vector",
                                                           marks=pytest.mark.slow)])
def test_the_gpu_conv_builds_are_checked_through_their_loads(fresh, monkeypatch, planted):
    """pallas_gpu's conv builds (the raw q, k, v convolved in the kernels' loads, then the q/k
    norm and the gate; the gated norm in the stores): the recurrent kernel's and the chunk
    forward's (per-channel gates: its intra-chunk kernel's), which first use checks at the
    probes (each through the switch's other side too): a planted conv that weighs each step's
    own row with the tap before its own, in either, fails in y or the final state (a misplaced
    k or v row reaches the state too; fresh inputs decide which is worst), on either side of
    the switch; the shipped ones pass."""
    gate = "vector" if planted == "chunk_vector" else "scalar"
    problem = Problem(1, 2, {None: 32, "recurrent": 16, "chunk": 64, "chunk_vector": 64}[planted],
                      32, "float32", gate)
    tap, row = "+ [taps(conv_k - 1) * row]", "x_ref[pl.ds(start + j, CHUNK), cols]"
    chunk = ("forward.py.j2", row,
             row.replace("start + j", "start + j - (j == w_ref.shape[0] - 1)"))
    check_gpu_plant(
        fresh, monkeypatch, planted, problem, f"{gate} log qk_norm softplus conv norm_silu",
        {"recurrent": ("recurrent.py.j2", tap, tap.replace("conv_k - 1", "conv_k - 2")),
         "chunk": chunk, "chunk_vector": chunk},
        quantities=("y", "final_state"))


@pytest.mark.parametrize("planted", [pytest.param(False, marks=pytest.mark.slow), True])
def test_the_tpu_chunk_norm_build_is_checked_through_its_stores(fresh, monkeypatch, planted):
    """pallas_tpu's chunk forward norm build (every head of the tile in one output block of
    the call's layout, Dv = 64 lanes each) is checked through its stores: a planted norm that
    doubles the mean of y^2 fails the first-use check (the chunk forward runs y_other_path at
    the short probes, y at the long one), the shipped one passes."""
    # a problem each: the eager calls' compiled steps are cached per call in the process
    problem = Problem(1, 2, 32 if planted else 16, 64, "float32", "scalar")
    if planted:
        old = "jnp.mean(y * y, axis=1, keepdims=True) + eps"
        plant(fresh, monkeypatch, "pallas_tpu", "forward.py.j2", old,
              old.replace("keepdims=True)", "keepdims=True) * 2"))
    spec = registry.get("pallas_tpu")
    variant = registry.default_variant("pallas_tpu", problem)
    assert spec.chunk_norm(variant, problem) and spec.holds_whole_head(variant, problem)
    record = firstuse.check(variant, problem, "scalar log qk_norm softplus norm_silu")
    assert record["passed"] is not planted, record
    if planted:
        assert record["worst_quantity"] in {"y", "y_other_path"}, record
        assert record["worst_error"] > 1e-2, record


@pytest.mark.parametrize("planted, gate, norm", [
    pytest.param(False, "scalar", True, marks=pytest.mark.slow), (True, "scalar", True),
    pytest.param(True, "vector", True, marks=pytest.mark.slow), (True, "scalar", False)])
def test_the_tpu_chunk_conv_builds_are_checked_through_their_loads(fresh, monkeypatch, planted,
                                                                   gate, norm):
    """pallas_tpu's chunk forward conv builds (each raw q, k, v block staged behind the rows
    before it and convolved in the loads of the forward kernel, per-channel gates the
    intra-chunk kernel; the gated norm in the walk's stores), which first use checks at the
    long probe: a planted conv whose last tap reads the row before its own fails first use,
    the shipped one passes. Scalar gates: the differentiated chunk core's forward kernel (the
    chunk states it saves too) convolves with the same code, so the plant reaches y, the state
    and the gradients, with or without the norm; per-channel gates: the norm build's y or
    state (either side of the switch)."""
    # a problem each: the eager calls' compiled steps are cached per call in the process
    problem = (Problem(1, 1, 32, 64, "float32", gate) if not planted else
               Problem(1, 2, 64, 64, "float32", gate) if norm else
               Problem(2, 2, 32, 64, "float32", gate))
    if planted:
        old = "y = y + taps[j:j + 1, :] * pad_ref[lo:lo + CHUNK, :]"
        plant(fresh, monkeypatch, "pallas_tpu", "forward.py.j2", old,
              old.replace("[lo:lo + CHUNK, :]", "[lo - (j == CONV_TAPS - 1):lo - (j == "
                          "CONV_TAPS - 1) + CHUNK, :]"))
    spec = registry.get("pallas_tpu")
    variant = registry.default_variant("pallas_tpu", problem)
    if norm:
        assert spec.chunk_conv(variant, problem) and spec.holds_whole_head(variant, problem)
    else:
        assert spec.differentiated_conv(variant, problem)
    record = firstuse.check(variant, problem, f"{gate} log qk_norm softplus conv"
                            + (" norm_silu" if norm else ""))
    assert record["passed"] is not planted, record
    if planted:
        if gate == "vector":  # only the norm build convolves in its loads: y or the state
            expected = {q + side for q in ("y", "final_state") for side in ("", "_other_path")}
            assert record["worst_quantity"] in expected, record
        assert record["worst_error"] > 1e-2, record


@needs_ffi
@pytest.mark.parametrize("planted", [pytest.param(False, marks=pytest.mark.slow), True])
def test_the_ffi_recurrent_conv_build_is_checked_through_its_loads(fresh, monkeypatch, planted):
    """ffi_cpu's recurrent conv build (the raw q, k rows convolved once per call in its
    ``prepare`` pass, then their norm factors, and v in each task's loads; the gate; the gated
    norm after the walks), which every probe's undifferentiated output runs (T <
    ``recurrent_below``): a planted q conv that reads k's weights and state fails in y; the
    shipped one passes (a problem each: a process caches its eager calls' compiled steps per
    call)."""
    problem = Problem(1, 2, 32 if planted else 16, 32, "float32", "scalar")
    if planted:
        old = "conv_row(cv, q + from, qk_channels, b, kh * s.Dk, t, s.Dk, qc + at);"
        plant(fresh, monkeypatch, "ffi_cpu", "recurrent.cc.j2", old,
              old.replace("b, kh * s.Dk,", "b, qk_channels + kh * s.Dk,"))
    variant = registry.default_variant("ffi_cpu", problem)
    assert variant.get("recurrent_below") > firstuse.probe_cases(problem, 64, "scalar")[0].T
    record = firstuse.check(variant, problem, "scalar log qk_norm softplus conv norm_silu")
    assert record["passed"] is not planted, record
    if planted:
        assert record["worst_quantity"] == "y" and record["worst_error"] > 1e-2, record


@needs_ffi
@pytest.mark.parametrize("planted", [pytest.param(False, marks=pytest.mark.slow), True])
def test_fused_layer_inputs_are_checked_from_the_raw_inputs(fresh, monkeypatch, planted):
    """A call whose kernels compute qk_norm and the softplus gate is checked through those
    kernels against the float64 layer composition: a planted half-rate gate in ffi_cpu's
    layer-input loads fails, the shipped one passes."""
    # planted: PROBLEM, whose plain library (the gradients' kernels) the module's first calls
    # left in `ffi_cpu_builds`; only the planted fused build is compiled here
    problem = PROBLEM if planted else Problem(1, 2, 16, 32, "float32", "scalar")
    if planted:
        old = "return -rate * (std::max(x, 0.f) + std::log1p(std::exp(-std::fabs(x))));"
        plant(fresh, monkeypatch, "ffi_cpu", "layer_inputs.cc.j2", old,
              "return -0.5f" + old[6:])
    variant = registry.default_variant("ffi_cpu", problem)
    record = firstuse.check(variant, problem, "scalar log qk_norm softplus")
    assert record["passed"] is not planted, record
    assert set(record["cases"]) == {"hard_decay", "short_masked", "identical_keys", "t1"}
    if planted:
        assert record["worst_error"] > 1e-2 and record["worst_quantity"] in (
            "y", "final_state", "dq", "dk", "dv", "dg", "dbeta", "dinitial_state", "dA_log",
            "ddt_bias")
