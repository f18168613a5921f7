"""``gdngen validate`` (the battery on a backend) and ``gdngen bench`` (chunkwise against the
sequential baseline)."""

from __future__ import annotations

import json
import sys

import click

from gdngen import registry
from gdngen.tools.commands.options import (
    DTYPE_CHOICE,
    backend_names,
    gate_option,
    parse_seq_lens,
    parse_variant,
)


@click.command()
@click.option("--backend", type=click.Choice(backend_names(registry.BACKENDS)), default=None,
              help="Backend checked against the float64 reference (or --device).")
@click.option("--device", "device", default=None, metavar="attached",
              help="'attached': the first-use check (gdngen.firstuse) of every generated "
                   "variant the tuned file and defaults would run on the attached device (and "
                   "the default of --problem), verdicts stored; instead of --backend.")
@click.option("--variant", "variant_json", default=None, metavar="JSON",
              help='Validate this variant, e.g. \'{"chunk_size": 32, ...}\' (generated-kernel '
                   "backends default to the default variant of --problem).")
@click.option("--problem", default=None, metavar="SPEC",
              help="Shape class whose default variant is validated, e.g. "
                   '"Hk=2,Hv=4,Dk=128,Dv=128".')
@click.option("--dtype", type=DTYPE_CHOICE, default="float32", show_default=True)
@click.option("--case", "case_names", multiple=True, metavar="NAME",
              help="Run only this battery case (repeatable). Default: the whole battery.")
@click.option("--seed", type=int, default=None, help="Input seed (default: each case's own).")
@click.option("--chunk-size", type=click.IntRange(min=1), default=None,
              help="Chunk size for every case (default: each case's own).")
@click.option("--json", "as_json", is_flag=True, help="Print results as JSON instead of a table.")
def validate(backend, device, variant_json, problem, dtype, case_names, seed, chunk_size,
             as_json):
    """Run the validation battery on a backend, or the first-use checks on the attached
    device (--device attached); exit 1 if any fails."""
    from gdngen import cases as cases_mod
    from gdngen import validate as validate_mod

    if (backend is None) == (device is None):
        raise click.UsageError("pass one of --backend and --device attached")
    if device is not None:
        _validate_attached(device, problem, dtype, as_json)
        return

    backend = backend.replace("-", "_")
    variant = None  # a portable backend runs its default at each case's own chunk size
    if variant_json is not None or problem is not None or not registry.get(backend).portable:
        variant = parse_variant(backend, variant_json, problem)

    selected = None
    if case_names:
        selected = []
        for name in case_names:
            try:
                selected.append(cases_mod.get_case(name))
            except (KeyError, ValueError) as e:
                raise click.BadParameter(str(e), param_hint="--case") from None
    extra = {} if variant is None else {"variant": variant}
    # with a variant, each case's tolerance is gdngen.tolerance.allowed_error of it
    results = validate_mod.run_battery(None if variant else backend, dtype=dtype, cases=selected,
                                       seed=seed, chunk_size=chunk_size, **extra)
    if as_json:
        out = validate_mod.results_to_json(results)
        click.echo(out if isinstance(out, str) else json.dumps(out, indent=2))
    else:
        click.echo(str(validate_mod.format_table(results)).rstrip("\n"))
    failed = [_case_name(r) for r in results if not r.passed]
    if failed:
        click.echo(f"FAILED ({len(failed)}/{len(results)}): {', '.join(failed)}", err=True)
        sys.exit(1)


def _validate_attached(device: str, problem_spec: str | None, dtype: str, as_json: bool):
    from gdngen import devices, firstuse
    from gdngen.problem import Problem
    from gdngen.tables import render_table

    if device != "attached":
        raise click.BadParameter(f"expected 'attached', got {device!r}", param_hint="--device")
    try:
        spec = None if problem_spec is None else f"{problem_spec},dtype={dtype}" \
            if "dtype=" not in problem_spec else problem_spec
        extra = () if spec is None else (Problem.parse(spec),)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--problem") from None
    rows = []
    for framework in devices.installed_frameworks():
        name = devices.detect_framework(framework).name
        if name is None:
            continue
        for variant, prob in firstuse.planned(framework, name, extra):
            verdict = firstuse.verify(framework, variant, prob, name)
            r = verdict.record
            rows.append({"framework": framework, "device": name, "backend": variant.backend,
                         "variant": str(variant), "problem": prob.key(), "kind": r["kind"],
                         "passed": verdict.passed, "worst_error": r["worst_error"],
                         "worst_case": r["worst_case"], "worst_quantity": r["worst_quantity"],
                         "tolerance": r["tolerance"], "seconds": r["seconds"],
                         "reason": r.get("reason"), "path": str(verdict.path)})
    if as_json:
        click.echo(json.dumps(rows, indent=2))
    else:
        table = [(r["device"], r["variant"], r["problem"], r["kind"],
                  "PASS" if r["passed"] else "FAIL",
                  r["reason"] or f"{r['worst_case']} {r['worst_quantity']} "
                  f"{float(r['worst_error']):.1e}", f"{r['seconds']:.1f}") for r in rows]
        click.echo(render_table("first-use checks on the attached device",
                                ("device", "variant", "problem", "kind", "result", "worst",
                                 "s"), table).rstrip("\n"))
    if not rows:
        click.echo("no generated variant would run on the attached device(s)", err=True)
    failed = [r["variant"] for r in rows if not r["passed"]]
    if failed:
        click.echo(f"FAILED ({len(failed)}/{len(rows)}): {', '.join(failed)}", err=True)
        sys.exit(1)


def _case_name(result) -> str:
    case = result.case
    return case if isinstance(case, str) else getattr(case, "name", str(case))



@click.command()
@click.option("--framework", type=click.Choice(["jax", "mlx", "all"]), default="all",
              show_default=True, help="'all' runs every installed framework.")
@click.option("--seq-lens", default="1024,2048,4096", show_default=True,
              callback=parse_seq_lens, help="Comma-separated sequence lengths T.")
@click.option("--batch", type=int, default=1, show_default=True)
@click.option("--hk", type=int, default=4, show_default=True, help="Key heads.")
@click.option("--hv", type=int, default=8, show_default=True, help="Value heads.")
@click.option("--dk", type=int, default=128, show_default=True)
@click.option("--dv", type=int, default=128, show_default=True)
@click.option("--chunk-size", type=int, default=64, show_default=True)
@click.option("--backend", default="auto", show_default=True,
              help="Backend of the chunkwise rows (its default variant at --chunk-size): 'auto' "
                   "takes ffi_cpu for JAX on a CPU host with a C++ compiler (else xla) and mlx "
                   "for MLX; or xla, ffi_cpu, pallas_tpu, pallas_gpu, mlx, metal.")
@click.option("--dtype", type=DTYPE_CHOICE, default="float32", show_default=True)
@gate_option("Gate kind: scalar (g [B,T,Hv]) or vector (per-channel g [B,T,Hv,Dk]).")
@click.option("--repeats", type=int, default=5, show_default=True,
              help="Timed runs after one warm-up; the median is reported.")
@click.option("--baseline-max-T", "baseline_max_t", type=int, default=2048, show_default=True,
              help="Skip the sequential baseline above this T (shown as —).")
@click.option("--matmul-n", type=int, default=2048, show_default=True,
              help="Size of the square float32 matmul reference (0 skips it).")
@click.option("--json", "as_json", is_flag=True, help="Print the rows as JSON, not a table.")
@click.option("--out", type=click.Path(dir_okay=False), default=None,
              help="Also write the rows as JSON to this file (atomically).")
def bench(framework, seq_lens, batch, hk, hv, dk, dv, chunk_size, backend, dtype, gate, repeats,
          baseline_max_t, matmul_n, as_json, out):
    """Time forward+backward of the chunkwise path against the sequential baseline."""
    from gdngen.tools import bench as bench_mod

    try:
        cfg = bench_mod.BenchConfig(
            seq_lens=seq_lens, batch=batch, hk=hk, hv=hv, dk=dk, dv=dv, chunk_size=chunk_size,
            backend=backend, dtype=dtype, repeats=repeats, baseline_max_T=baseline_max_t,
            matmul_n=matmul_n, gate=gate,
        )
    except ValueError as e:
        raise click.UsageError(str(e)) from e
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
    try:
        frameworks = bench_mod.frameworks_for(cfg, frameworks)
    except ValueError as e:
        raise click.UsageError(str(e)) from e
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
