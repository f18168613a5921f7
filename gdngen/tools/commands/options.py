"""What several commands share: option types and the parsing of their values (click errors
naming the option)."""

from __future__ import annotations

import json

import click

from gdngen.problem import GATE_KINDS

DTYPE_CHOICE = click.Choice(["float32", "bfloat16", "float16"])


def gate_option(help_text: str):
    """``--gate scalar|vector`` (default scalar), shared by bench and tune."""
    return click.option("--gate", type=click.Choice(GATE_KINDS), default="scalar",
                        show_default=True, help=help_text)


def backend_names(names) -> list[str]:
    """``names`` plus their dashed spellings (``pallas-tpu`` for ``pallas_tpu``)."""
    return sorted(set(names) | {name.replace("_", "-") for name in names})


def parse_variant(backend: str, variant_json: str | None, problem: str | None):
    """The `Variant` named by ``--variant`` (a JSON params object) or, failing that, the default
    variant of ``--problem`` (default Hk=2,Hv=4,Dk=128,Dv=128)."""
    from gdngen.problem import Problem
    from gdngen.registry import check_variant, default_variant
    from gdngen.variant import Variant

    try:
        if variant_json is not None:
            params = json.loads(variant_json)
            if not isinstance(params, dict):
                raise ValueError("expected a JSON object of variant params")
            variant = Variant(backend, params)
            check_variant(variant)
            return variant
        return default_variant(backend, Problem.parse(problem or "Hk=2,Hv=4,Dk=128,Dv=128"))
    except ValueError as e:
        hint = "--variant" if variant_json is not None else "--problem"
        raise click.BadParameter(str(e), param_hint=hint) from None


def parse_seq_lens(ctx, param, value: str) -> tuple[int, ...]:
    """click callback: ``T[,T...]`` as positive ints."""
    try:
        lens = tuple(int(s) for s in value.split(",") if s.strip())
    except ValueError:
        raise click.BadParameter(
            f"expected comma-separated integers, got {value!r}") from None
    if not lens or min(lens) < 1:
        raise click.BadParameter(f"expected positive lengths, got {value!r}")
    return lens


def pair(value, option):
    """``A,B`` as two ints (``--heads``, ``--dim``); BadParameter naming ``option`` else."""
    try:
        a, b = (int(x) for x in value.split(","))
    except ValueError:
        raise click.BadParameter(f"expected two comma-separated integers, got {value!r}",
                                 param_hint=option) from None
    return a, b
