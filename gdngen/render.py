"""Render stage: a `Variant` for a `Problem` -> its source text(s) and their sha256.

`render` looks the variant's backend up in `gdngen.registry` and renders it with
`gdngen.sources` (templates from ``templates/<backend>/``, a user override folder first, strict
Jinja; portable backends: the Python that implements them). Backends render their own variants
through their spec (`gdngen.spec.BackendSpec.render`), which needs no registry.
"""

from __future__ import annotations

import os

from gdngen import registry
from gdngen.problem import Problem
from gdngen.sources import Rendered, environment, sources_sha256
from gdngen.variant import Variant

__all__ = ["Rendered", "environment", "render", "sources_sha256"]


def render(variant: Variant, problem: Problem, *,
           templates_dir: str | os.PathLike | None = None) -> Rendered:
    """Render ``variant`` specialised for ``problem`` (see `gdngen.sources`)."""
    return registry.get(variant.backend).render(variant, problem, templates_dir=templates_dir)
