"""Render stage with the pallas_tpu templates: strict rendering, override precedence, no escape
from the override folder, hashes that follow the params, specialised (dead-branch-free) code."""

from __future__ import annotations

import shutil

import jinja2
import pytest

from gdngen import Problem, Variant, default_variant, render, variants
from gdngen.resources import templates_dir

pytest.importorskip("jax")  # the tf32 policy probes the installed jax's Mosaic lowering

PROBLEM = Problem(2, 4, 128, 128)
GVA3 = Problem(1, 3, 128, 128)
SHIPPED = templates_dir("pallas_tpu")


def _override(tmp_path, name="forward.py.j2", edit=None):
    """An override folder holding a copy of the shipped ``name``, edited by ``edit(text)``."""
    folder = tmp_path / "templates"
    (folder / "pallas_tpu").mkdir(parents=True)
    text = (SHIPPED / name).read_text()
    (folder / "pallas_tpu" / name).write_text(edit(text) if edit else text)
    return folder


def test_every_variant_renders_to_valid_distinct_python():
    for problem in (PROBLEM, GVA3):
        space = variants("pallas_tpu", problem)
        shas = set()
        for variant in space:
            rendered = render(variant, problem)
            assert set(rendered.sources) == {"forward.py", "backward.py", "recurrent.py"}
            for name, source in rendered.sources.items():
                compile(source, f"{variant}:{name}", "exec")  # SyntaxError fails the test
            shas.add(rendered.sha256)
        assert len(shas) == len(space) == 36  # the hash follows every parameter


def test_sha_is_deterministic_and_follows_params_and_problem():
    base = default_variant("pallas_tpu", PROBLEM)
    first = render(base, PROBLEM)
    assert render(base, PROBLEM).sha256 == first.sha256
    for change in ({"chunk_size": 32}, {"precision": "tf32"}, {"head_tile": 1},
                   {"save_states": False}):
        other = Variant("pallas_tpu", dict(base.as_dict(), **change))
        assert render(other, PROBLEM).sha256 != first.sha256, change
    assert render(base, Problem(2, 4, 128, 128, dtype="bfloat16")).sha256 != first.sha256
    assert render(base, Problem(2, 4, 64, 128)).sha256 != first.sha256


def test_values_are_baked_in_and_dead_branches_removed():
    params = {"chunk_size": 32, "precision": "ieee", "head_tile": 2, "dv_tile": 256,
              "save_states": True}
    plain = render(Variant("pallas_tpu", params), Problem(2, 4, 64, 256)).sources
    assert "CHUNK = 32" in plain["forward.py"] and "DV_TILE = 256" in plain["forward.py"]
    assert "N_DV = 1" in plain["backward.py"]
    for source in plain.values():
        assert "pl.when(j ==" not in source  # one Dv tile: no per-tile phases
        assert "_split_bf16" not in source and "Precision.HIGH," not in source
    assert "def chunk_states" not in plain["forward.py"]  # states are saved, not recomputed
    tiled = dict(params, dv_tile=128, save_states=False, precision="tf32")
    sources = render(Variant("pallas_tpu", tiled), Problem(2, 4, 64, 256)).sources
    assert "N_DV = 2" in sources["forward.py"]
    assert "pl.when(j == 0)" in sources["forward.py"]
    assert "pl.when(j == N_DV - 1)" in sources["backward.py"]
    assert "def chunk_states" in sources["forward.py"]
    assert "tinv_ref" not in sources["backward.py"]  # recomputed, not read
    # tf32: Precision.HIGH where this jax lowers it for Mosaic (0.10 does not), else 3 passes
    from gdngen.backends.pallas.tpu import mosaic_lowers_precision_high

    native = mosaic_lowers_precision_high()
    assert ("_split_bf16" in sources["forward.py"]) is not native
    assert ("Precision.HIGH," in sources["forward.py"]) is native


def test_override_directory_takes_precedence(tmp_path, monkeypatch):
    variant = default_variant("pallas_tpu", PROBLEM)
    shipped = render(variant, PROBLEM)
    folder = _override(tmp_path, edit=lambda t: t.replace("Do not edit", "OVERRIDDEN copy"))
    explicit = render(variant, PROBLEM, templates_dir=folder)
    assert "OVERRIDDEN copy" in explicit.sources["forward.py"]
    assert explicit.sources["backward.py"] == shipped.sources["backward.py"]  # not overridden
    assert explicit.sha256 != shipped.sha256
    monkeypatch.setenv("GDNGEN_TEMPLATES", str(folder))
    assert render(variant, PROBLEM).sha256 == explicit.sha256
    # an explicit folder wins over the environment variable
    empty = tmp_path / "empty"
    empty.mkdir()
    assert render(variant, PROBLEM, templates_dir=empty).sha256 == shipped.sha256


def test_rendering_is_strict(tmp_path):
    folder = _override(tmp_path, edit=lambda t: t.replace("{{ problem_key }}",
                                                          "{{ problem_keyy }}"))
    with pytest.raises(jinja2.UndefinedError, match="problem_keyy"):
        render(default_variant("pallas_tpu", PROBLEM), PROBLEM, templates_dir=folder)


@pytest.mark.parametrize("target", ["../secret.py.j2", "../../secret.py.j2", "/etc/hostname"])
def test_override_cannot_reach_outside_itself(tmp_path, target):
    (tmp_path / "secret.py.j2").write_text("SECRET = 1\n")
    folder = _override(tmp_path, edit=lambda t: t.replace(
        '{% include "pallas_tpu/common.py.j2" %}', f'{{% include "{target}" %}}'))
    with pytest.raises(jinja2.TemplateNotFound):
        render(default_variant("pallas_tpu", PROBLEM), PROBLEM, templates_dir=folder)


def test_override_of_an_included_template(tmp_path):
    """The shared matmul/decay helpers are overridable on their own (an include resolves
    through the same search path)."""
    folder = tmp_path / "templates"
    (folder / "pallas_tpu").mkdir(parents=True)
    shutil.copy(SHIPPED / "common.py.j2", folder / "pallas_tpu" / "common.py.j2")
    text = (folder / "pallas_tpu" / "common.py.j2").read_text()
    (folder / "pallas_tpu" / "common.py.j2").write_text(text + "\nOVERRIDE_MARK = 1\n")
    rendered = render(default_variant("pallas_tpu", PROBLEM), PROBLEM, templates_dir=folder)
    # the chunk kernels include it; the recurrent kernel is self-contained
    assert all("OVERRIDE_MARK = 1" in rendered.sources[n] for n in ("forward.py", "backward.py"))
    assert "OVERRIDE_MARK" not in rendered.sources["recurrent.py"]


def test_bad_variant_params_are_rejected():
    base = default_variant("pallas_tpu", PROBLEM).as_dict()
    for bad, match in (({"chunk_size": 48}, "chunk_size"), ({"precision": "fp8"}, "precision"),
                       ({"head_tile": 0}, "head_tile"), ({"save_states": 1}, "save_states")):
        with pytest.raises(ValueError, match=match):
            render(Variant("pallas_tpu", dict(base, **bad)), PROBLEM)
    with pytest.raises(ValueError, match="params"):
        render(Variant("pallas_tpu", {"chunk_size": 64}), PROBLEM)
    # per-channel gates render the chunk walks (``per_channel`` set) and the recurrent kernel
    per_channel = render(Variant("pallas_tpu", base), Problem(2, 4, 128, 128, gate="vector"))
    assert set(per_channel.sources) == {"forward.py", "backward.py", "recurrent.py"}
