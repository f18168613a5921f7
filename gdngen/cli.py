"""Command line: ``gdngen validate`` and ``gdngen bench``.

Framework packages (jax, mlx) are imported lazily inside the commands, so importing this module
or running ``gdngen --help`` never imports them.
"""

from __future__ import annotations

import json
import sys

import click

from gdngen import __version__

DTYPE_CHOICE = click.Choice(["float32", "bfloat16", "float16"])


@click.group()
@click.version_option(version=__version__, prog_name="gdngen")
def main():
    """gdngen: kernel generator and autotuner for the gated delta rule."""


@main.command()
@click.option("--backend", type=click.Choice(["xla", "mlx"]), required=True,
              help="Backend whose runner is checked against the float64 reference.")
@click.option("--dtype", type=DTYPE_CHOICE, default="float32", show_default=True)
@click.option("--case", "case_names", multiple=True, metavar="NAME",
              help="Run only this battery case (repeatable). Default: the whole battery.")
@click.option("--seed", type=int, default=None, help="Input seed (default: each case's own).")
@click.option("--chunk-size", type=click.IntRange(min=1), default=None,
              help="Chunk size for every case (default: each case's own).")
@click.option("--json", "as_json", is_flag=True, help="Print results as JSON instead of a table.")
def validate(backend, dtype, case_names, seed, chunk_size, as_json):
    """Run the validation battery on a backend; exit 1 if any case fails."""
    from gdngen import cases as cases_mod
    from gdngen import validate as validate_mod

    selected = None
    if case_names:
        selected = []
        for name in case_names:
            try:
                selected.append(cases_mod.get_case(name))
            except (KeyError, ValueError) as e:
                raise click.BadParameter(str(e), param_hint="--case") from None
    results = validate_mod.run_battery(backend, dtype=dtype, cases=selected, seed=seed,
                                       chunk_size=chunk_size)
    if as_json:
        out = validate_mod.results_to_json(results)
        click.echo(out if isinstance(out, str) else json.dumps(out, indent=2))
    else:
        click.echo(str(validate_mod.format_table(results)).rstrip("\n"))
    failed = [_case_name(r) for r in results if not r.passed]
    if failed:
        click.echo(f"FAILED ({len(failed)}/{len(results)}): {', '.join(failed)}", err=True)
        sys.exit(1)


def _case_name(result) -> str:
    case = result.case
    return case if isinstance(case, str) else getattr(case, "name", str(case))


def _parse_seq_lens(ctx, param, value: str) -> tuple[int, ...]:
    try:
        lens = tuple(int(s) for s in value.split(",") if s.strip())
    except ValueError:
        raise click.BadParameter(f"expected comma-separated integers, got {value!r}")
    if not lens or min(lens) < 1:
        raise click.BadParameter(f"expected positive lengths, got {value!r}")
    return lens


@main.command()
@click.option("--framework", type=click.Choice(["jax", "mlx", "all"]), default="all",
              show_default=True, help="'all' runs every installed framework.")
@click.option("--seq-lens", default="1024,2048,4096", show_default=True,
              callback=_parse_seq_lens, help="Comma-separated sequence lengths T.")
@click.option("--batch", type=int, default=1, show_default=True)
@click.option("--hk", type=int, default=4, show_default=True, help="Key heads.")
@click.option("--hv", type=int, default=8, show_default=True, help="Value heads.")
@click.option("--dk", type=int, default=128, show_default=True)
@click.option("--dv", type=int, default=128, show_default=True)
@click.option("--chunk-size", type=int, default=64, show_default=True)
@click.option("--dtype", type=DTYPE_CHOICE, default="float32", show_default=True)
@click.option("--repeats", type=int, default=5, show_default=True,
              help="Timed runs after one warm-up; the median is reported.")
@click.option("--baseline-max-T", "baseline_max_t", type=int, default=2048, show_default=True,
              help="Skip the sequential baseline above this T (shown as —).")
@click.option("--matmul-n", type=int, default=2048, show_default=True,
              help="Size of the square float32 matmul reference (0 skips it).")
@click.option("--json", "as_json", is_flag=True, help="Print the rows as JSON, not a table.")
@click.option("--out", type=click.Path(dir_okay=False), default=None,
              help="Also write the rows as JSON to this file (atomically).")
def bench(framework, seq_lens, batch, hk, hv, dk, dv, chunk_size, dtype, repeats,
          baseline_max_t, matmul_n, as_json, out):
    """Time forward+backward of the chunkwise path against the sequential baseline."""
    from gdngen import bench as bench_mod

    try:
        cfg = bench_mod.BenchConfig(
            seq_lens=seq_lens, batch=batch, hk=hk, hv=hv, dk=dk, dv=dv, chunk_size=chunk_size,
            dtype=dtype, repeats=repeats, baseline_max_T=baseline_max_t, matmul_n=matmul_n,
        )
    except ValueError as e:
        raise click.UsageError(str(e))
    installed = bench_mod.available_frameworks()
    if framework == "all":
        frameworks = installed
        for missing in sorted(set(bench_mod.FRAMEWORKS) - set(installed)):
            click.echo(f"note: {missing} is not installed; skipping it", err=True)
        if not frameworks:
            raise click.UsageError("neither jax nor mlx is installed")
    elif framework not in installed:
        raise click.UsageError(f"{framework} is not installed (pip install 'gdngen[{framework}]')")
    else:
        frameworks = (framework,)
    rows, failed = [], []
    for fw in frameworks:  # one failing framework does not discard the others' figures
        try:
            rows.extend(bench_mod.run(cfg, (fw,)))
        except RuntimeError as e:
            click.echo(f"error: {e}", err=True)
            failed.append(fw)
    if out:
        bench_mod.write_json(rows, out)
    if as_json:
        click.echo(json.dumps(rows, indent=2))
    elif rows:
        bench_mod.print_table(rows)
    if failed:
        raise click.ClickException(f"bench failed for: {', '.join(failed)}")


if __name__ == "__main__":
    main()
