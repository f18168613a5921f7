"""Sources of a variant: its backend's templates rendered for a `Problem`, or (portable
backends) the Python that implements it; and their sha256.

Templated backends keep Jinja sources in their own folder (``gdngen/backends/<path>/templates/``,
named ``<backend>/<file>``, `gdngen.resources.template_folders`); their
`gdngen.spec.BackendSpec.render_plan` maps ``(variant, problem)`` to ``{output_name:
(template_path, context)}``. Templates load first from a user directory (``templates_dir`` argument
or the ``GDNGEN_TEMPLATES`` environment variable), which overrides shipped files by that name
(``<backend>/<file>``) and cannot reach outside itself, then from the shipped folders. Rendering is
strict: an undefined name is an error, never an empty string.

Portable backends (xla, mlx) are not templated; their "source" is the Python that implements
them (their spec's ``source_modules``, read, not imported), so the hash still changes whenever
their code does.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

import jinja2

from gdngen import settings
from gdngen.problem import Problem
from gdngen.resources import template_folders
from gdngen.variant import Variant


@dataclass(frozen=True)
class Rendered:
    """Rendered sources of one variant: ``sources`` maps output name -> text."""

    variant: Variant
    problem: Problem
    sources: dict
    sha256: str


def environment(templates_dir: str | os.PathLike | None = None) -> jinja2.Environment:
    """Jinja environment: user directory first (if any), then the shipped templates."""
    user = templates_dir if templates_dir is not None else settings.templates_override()
    loaders = [jinja2.FileSystemLoader(str(Path(user).resolve()))] if user else []
    loaders.append(jinja2.PrefixLoader({name: jinja2.FileSystemLoader(str(folder)) for name, folder
                                        in template_folders().items()}))
    # FileSystemLoader refuses paths that escape its search roots ("../x"), so an override
    # directory cannot read or shadow anything outside itself.
    return jinja2.Environment(loader=jinja2.ChoiceLoader(loaders),
                              undefined=jinja2.StrictUndefined, keep_trailing_newline=True,
                              trim_blocks=True, lstrip_blocks=True)


def sources_sha256(sources: dict) -> str:
    """sha256 over output names and texts, in name order."""
    digest = hashlib.sha256()
    for name in sorted(sources):
        digest.update(name.encode() + b"\0" + sources[name].encode() + b"\0")
    return digest.hexdigest()


def render_spec(spec, variant: Variant, problem: Problem, *,
                templates_dir: str | os.PathLike | None = None) -> Rendered:
    """Render ``variant`` of the backend declared by ``spec`` (a `gdngen.spec.BackendSpec`)."""
    spec.parse(variant)  # ValueError naming a bad field, before anything is rendered
    if spec.render_plan is None:
        texts = {name: Path(importlib.util.find_spec(name).origin).read_text()
                 for name in spec.source_modules}  # read, not imported
        return Rendered(variant, problem, texts, sources_sha256(texts))
    return render_planned(variant, problem, spec.render_plan(variant, problem),
                          templates_dir=templates_dir)


def render_planned(variant: Variant, problem: Problem, plan: dict, *,
                   templates_dir: str | os.PathLike | None = None) -> Rendered:
    """`Rendered` of a render plan ``{output name: (template path, context)}``."""
    env = environment(templates_dir)
    texts = {name: env.get_template(path).render(**context)
             for name, (path, context) in plan.items()}
    return Rendered(variant, problem, texts, sources_sha256(texts))
