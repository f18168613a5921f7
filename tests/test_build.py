"""gdngen build: enumerate, render, write, validate, manifest; a template override that drops a
term (or uses an op Mosaic cannot lower) is caught and the variant is reported as failed."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from gdngen import Problem, Variant, render, variants
from gdngen.resources import templates_dir
from gdngen.tools import build as build_mod
from gdngen.tools.cli import main
from gdngen.validate import QUANTITIES, STATE_QUANTITIES

pytest.importorskip("jax")

DEFAULT = {"chunk_size": 64, "precision": "ieee", "head_tile": 2, "dv_tile": 128,
           "save_states": True}
PROBLEM = Problem(2, 4, 128, 128)


def _plant(tmp_path, name, old, new):
    """An override folder whose ``pallas_tpu/<name>`` is the shipped one with ``old`` -> ``new``."""
    text = (templates_dir("pallas_tpu") / name).read_text()
    assert text.count(old) == 1, old
    folder = tmp_path / "override"
    (folder / "pallas_tpu").mkdir(parents=True)
    (folder / "pallas_tpu" / name).write_text(text.replace(old, new))
    return folder


def test_normalize_backend():
    assert build_mod.normalize_backend("pallas-tpu") == "pallas_tpu"
    assert build_mod.normalize_backend("xla") == "xla"
    with pytest.raises(ValueError, match="backend must be one of"):
        build_mod.normalize_backend("cuda-magic")


def test_validated_build_writes_sources_and_manifest(tmp_path):
    variant = Variant("pallas_tpu", DEFAULT)
    seen = []
    (result,) = build_mod.build("pallas-tpu", PROBLEM, tmp_path, cases=["t1"],
                                variant_list=[variant], progress=seen.append)
    assert seen == [result] and result.status == "passed" and result.lowering == "ok"
    assert set(result.worst) == set(QUANTITIES) | set(STATE_QUANTITIES)
    assert max(result.worst.values()) < 5e-5
    rendered = render(variant, PROBLEM)
    assert result.sha256 == rendered.sha256
    for relative in result.files:
        name = relative.split("/")[-1]
        assert relative.startswith(rendered.sha256[:16] + "/")
        assert (tmp_path / relative).read_text() == rendered.sources[name]
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert manifest["backend"] == "pallas_tpu" and manifest["problem"]["Hv"] == 4
    assert manifest["cases"] == ["t1"] and manifest["summary"] == {"total": 1, "ok": 1,
                                                                   "failed": 0}
    (entry,) = manifest["variants"]
    assert entry["name"] == variant.name() and entry["params"] == DEFAULT
    assert entry["status"] == "passed" and entry["tolerance"] == 5e-5
    assert not list(tmp_path.rglob("*.tmp"))  # atomic writes leave no temporaries


def test_cli_build_with_templates_dropping_a_term_fails(tmp_path):
    """The state update without its decay (S_C = S + W^T Kc) is wrong math: validation marks
    the variant failed and the command exits non-zero naming it."""
    folder = _plant(tmp_path, "forward.py.j2", "s_new = dcc * s + ", "s_new = s + ")
    out = tmp_path / "out"
    result = CliRunner().invoke(main, [
        "build", "--backend", "pallas-tpu", "--problem", "Hk=2,Hv=4,Dk=128,Dv=128",
        "--out", str(out), "--templates", str(folder), "--variant", json.dumps(DEFAULT),
        "--case", "t1"])
    name = Variant("pallas_tpu", DEFAULT).name()
    assert result.exit_code == 1, result.output
    assert f"FAILED (1/1): {name}" in result.output
    (entry,) = json.loads((out / "manifest.json").read_text())["variants"]
    assert entry["status"] == "failed" and entry["failed_cases"] == ["t1"]
    assert entry["worst"]["final_state"] > 1e-2
    (forward,) = [f for f in entry["files"] if f.endswith("forward.py")]
    assert "s_new = s + " in (out / forward).read_text()


def test_env_override_of_the_backward_is_caught(tmp_path, monkeypatch):
    """GDNGEN_TEMPLATES reaches the kernels that validation runs: dk without its beta-key term
    fails (dk only)."""
    folder = _plant(tmp_path, "backward.py.j2", "dk = dk + (beta * d0) * dbk\n", "")
    monkeypatch.setenv("GDNGEN_TEMPLATES", str(folder))
    (result,) = build_mod.build("pallas_tpu", PROBLEM, tmp_path / "out", cases=["t1"],
                                variant_list=[Variant("pallas_tpu", DEFAULT)])
    assert result.status == "failed" and result.failed_cases == ["t1"]
    assert result.worst["dk"] > 1e-2 and result.worst["y"] < 5e-5


def test_override_mosaic_cannot_lower_fails_without_running(tmp_path):
    """Segment sums by cumsum are the same math (interpret mode would pass them) but Mosaic has
    no cumsum: the lowering check fails the variant."""
    folder = _plant(tmp_path, "common.py.j2", "jnp.exp(_mm_exact(lower, terms))",
                    "jnp.exp(jnp.cumsum(terms, axis=0))")
    (result,) = build_mod.build("pallas_tpu", PROBLEM, tmp_path / "out", templates_dir=folder,
                                variant_list=[Variant("pallas_tpu", DEFAULT)], validate=False)
    assert result.status == "failed" and "cumsum" in result.lowering


def test_resume_keeps_matching_entries_only(tmp_path, monkeypatch):
    space = [Variant("pallas_tpu", DEFAULT), Variant("pallas_tpu", dict(DEFAULT, head_tile=1))]
    first = build_mod.build("pallas_tpu", PROBLEM, tmp_path, variant_list=space, validate=False)
    assert [r.status for r in first] == ["rendered", "rendered"]
    built = []
    real = build_mod._build_one
    monkeypatch.setattr(build_mod, "_build_one", lambda v, *a, **k: built.append(v) or real(
        v, *a, **k))
    again = build_mod.build("pallas_tpu", PROBLEM, tmp_path, variant_list=space,
                            validate=False, resume=True)
    assert built == [] and [r.to_json() for r in again] == [r.to_json() for r in first]
    folder = _plant(tmp_path, "backward.py.j2", "backward kernel of the chunkwise",
                    "edited backward kernel of the chunkwise")  # other sources
    build_mod.build("pallas_tpu", PROBLEM, tmp_path, variant_list=space, validate=False,
                    resume=True, templates_dir=folder)
    assert built == space  # a different override folder: nothing is reused


def test_render_only_build_is_generic(tmp_path):
    """A backend without hooks (xla: sources are its Python modules) builds the same way."""
    results = build_mod.build("xla", PROBLEM, tmp_path, validate=False)
    total = len(variants("xla", PROBLEM))
    assert len(results) == total and all(r.status == "rendered" for r in results)
    assert all(r.lowering is None for r in results)
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert manifest["summary"] == {"total": total, "ok": total, "failed": 0}
    assert (tmp_path / results[0].files[0]).exists()


def test_cli_validate_uses_the_variant_and_its_policy_tolerance():
    params = dict(DEFAULT, precision="bf16")
    result = CliRunner().invoke(main, ["validate", "--backend", "pallas-tpu", "--variant",
                                       json.dumps(params), "--case", "t1", "--json"])
    assert result.exit_code == 0, result.output
    (row,) = json.loads(result.output[result.output.index("["):])
    assert row["tolerance"] == 2e-2 and row["passed"]
    assert row["errors"]["y"] > 1e-5  # bfloat16 matmuls really ran
    bad = CliRunner().invoke(main, ["validate", "--backend", "pallas-tpu", "--variant", "[1]"])
    assert bad.exit_code == 2 and "--variant" in bad.output
