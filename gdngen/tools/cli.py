"""Command line: ``gdngen validate``, ``gdngen bench`` and ``gdngen build``.

Framework packages (jax, mlx) are imported lazily inside the commands, so importing this module
or running ``gdngen --help`` never imports them.
"""

from __future__ import annotations

import json
import sys

import click

from gdngen import registry
from gdngen._version import __version__
from gdngen.variant import GATE_KINDS

DTYPE_CHOICE = click.Choice(["float32", "bfloat16", "float16"])


def gate_option(help_text: str):
    """``--gate scalar|vector`` (default scalar), shared by bench and tune."""
    return click.option("--gate", type=click.Choice(GATE_KINDS), default="scalar",
                        show_default=True, help=help_text)


@click.group()
@click.version_option(version=__version__, prog_name="gdngen")
def main():
    """gdngen: kernel generator and autotuner for the gated delta rule."""
    from gdngen import jaxcompat

    # on a host without a TPU, jax's TPU platform stays off (libtpu's start-up errors otherwise);
    # without a GPU, the CUDA plugin registers its compile-only topologies
    jaxcompat.host_settings()


def _backend_names(names) -> list[str]:
    """``names`` plus their dashed spellings (``pallas-tpu`` for ``pallas_tpu``)."""
    return sorted(set(names) | {name.replace("_", "-") for name in names})


def _parse_variant(backend: str, variant_json: str | None, problem: str | None):
    """The `Variant` named by ``--variant`` (a JSON params object) or, failing that, the default
    variant of ``--problem`` (default Hk=2,Hv=4,Dk=128,Dv=128)."""
    from gdngen.registry import check_variant, default_variant
    from gdngen.variant import Problem, Variant

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


@main.command()
@click.option("--backend", type=click.Choice(_backend_names(registry.BACKENDS)), required=True,
              help="Backend checked against the float64 reference.")
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
def validate(backend, variant_json, problem, dtype, case_names, seed, chunk_size, as_json):
    """Run the validation battery on a backend; exit 1 if any case fails."""
    from gdngen import cases as cases_mod
    from gdngen import validate as validate_mod

    backend = backend.replace("-", "_")
    variant = None  # a portable backend runs its default at each case's own chunk size
    if variant_json is not None or problem is not None or not registry.get(backend).portable:
        variant = _parse_variant(backend, variant_json, problem)

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


def _case_name(result) -> str:
    case = result.case
    return case if isinstance(case, str) else getattr(case, "name", str(case))


def _parse_seq_lens(ctx, param, value: str) -> tuple[int, ...]:
    try:
        lens = tuple(int(s) for s in value.split(",") if s.strip())
    except ValueError:
        raise click.BadParameter(
            f"expected comma-separated integers, got {value!r}") from None
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


@main.command()
@click.option("--backend", required=True, metavar="NAME",
              help="Backend whose variants are built (e.g. pallas-tpu; dashes or underscores).")
@click.option("--problem", default="Hk=2,Hv=4,Dk=128,Dv=128", show_default=True, metavar="SPEC",
              help="Shape class the variants are rendered for, e.g. "
                   '"Hk=1,Hv=3,Dk=128,Dv=128,dtype=bfloat16".')
@click.option("--out", "out_dir", required=True, type=click.Path(file_okay=False),
              help="Folder for the rendered sources and manifest.json.")
@click.option("--templates", "templates_dir", default=None,
              type=click.Path(exists=True, file_okay=False),
              help="Template override folder (files shadow the shipped ones by relative path).")
@click.option("--variant", "variant_jsons", multiple=True, metavar="JSON",
              help="Build only this variant (JSON params; repeatable). Default: all of them.")
@click.option("--case", "case_names", multiple=True, metavar="NAME",
              help="Validate on this battery case only (repeatable). Default: the battery.")
@click.option("--seed", type=int, default=None, help="Input seed (default: each case's own).")
@click.option("--no-validate", is_flag=True, help="Render and write only.")
@click.option("--resume", is_flag=True,
              help="Keep the passing variants of an existing manifest in --out (same settings, "
                   "same sources); build the rest.")
@click.option("--device", default=None, metavar="NAME",
              help="Build only the variants that fit this device (`gdngen devices`); default: "
                   "the backend's reference device.")
@click.option("--compile", "compile_", is_flag=True,
              help="Also compile each variant's programs (chunk fwd+bwd, recurrent, packed, "
                   "fused inputs) for --device with its real compiler, attached or not "
                   "(TPU: Mosaic through libtpu, gdngen[tpu]; NVIDIA: XLA GPU and Triton "
                   "through jax's CUDA plugin, gdngen[cuda]); recorded as `compile` in the "
                   "manifest.")
@click.option("--compile-seq", type=click.IntRange(min=1), default=None, metavar="T",
              help="Steps of the compiled chunk programs (default 256).")
@click.option("--json", "as_json", is_flag=True,
              help="Print each variant's manifest entry as JSON (instead of a line each).")
def build(backend, problem, out_dir, templates_dir, variant_jsons, case_names, seed,
          no_validate, resume, device, compile_, compile_seq, as_json):
    """Enumerate, render, write and validate a backend's variants (with --compile, also
    compile them for --device); exit 1 if any fails."""
    from gdngen import cases as cases_mod
    from gdngen.tools import build as build_mod
    from gdngen.variant import Problem

    try:
        backend = build_mod.normalize_backend(backend)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--backend") from None
    try:
        problem = Problem.parse(problem)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--problem") from None
    if compile_:
        _check_compile(backend, device)
    elif compile_seq is not None:
        raise click.BadParameter("--compile-seq is for --compile", param_hint="--compile-seq")
    variant_list = [_parse_variant(backend, text, None) for text in variant_jsons] or None
    if variant_list is None:
        try:
            variant_list = registry.variants(backend, problem, device)
        except ValueError as e:
            raise click.BadParameter(str(e), param_hint="--device") from None
    try:
        cases = [cases_mod.get_case(name) for name in case_names] or None
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--case") from None

    def progress(result):
        if as_json:
            return
        worst = max(result.worst.items(), key=lambda item: item[1], default=("-", 0.0))
        click.echo(f"{result.status.upper():6} {result.variant.name()}  worst {worst[0]} "
                   f"{worst[1]:.1e}  ({result.seconds:.0f}s)")
        if result.compile is not None:
            c = result.compile
            onchip = (f"shared {c['shared_memory_used'] / 2**10:.0f} KiB"
                      if "shared_memory_used" in c else f"vmem {c['vmem_used'] / 2**20:.1f} MiB")
            click.echo(f"       compile {c['compiler']} {c['target']}: "
                       f"{'ok' if c['ok'] else 'FAILED'}  {onchip}"
                       f"  temp {c['temp_bytes'] / 2**20:.1f} MiB  ({c['seconds']:.0f}s)")
            if c["error"]:
                click.echo(c["error"].rstrip(), err=True)
        if result.error:
            click.echo(result.error.rstrip(), err=True)

    results = build_mod.build(backend, problem, out_dir, templates_dir=templates_dir,
                              cases=cases, seed=seed, variant_list=variant_list,
                              validate=not no_validate, progress=progress, resume=resume,
                              compile_for=device if compile_ else None, compile_T=compile_seq)
    failed = [r.variant.name() for r in results if not r.ok]
    if as_json:
        click.echo(json.dumps([r.to_json() for r in results], indent=2))
    else:
        click.echo(f"{len(results) - len(failed)}/{len(results)} variants "
                   f"{'rendered' if no_validate else 'passed'}"
                   f"{' and compiled' if compile_ else ''}; manifest: {out_dir}/manifest.json")
    if failed:
        click.echo(f"FAILED ({len(failed)}/{len(results)}): {', '.join(failed)}", err=True)
        sys.exit(1)


def _check_compile(backend: str, device: str | None) -> None:
    """``build --compile``'s checks, before anything is built: a backend with a real compiler,
    a --device it compiles for, the compiler installed here."""
    from gdngen import compilers, devices

    try:
        compiler, kind = compilers.compiler_of(backend)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--backend") from None
    if device is None:
        raise click.BadParameter(f"--compile needs the {kind} device to compile for",
                                 param_hint="--device")
    try:
        dev = devices.get_device(device)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--device") from None
    if dev.kind != kind or not dev.topology:
        raise click.BadParameter(f"{backend} compiles with {compiler} for {kind} devices, got "
                                 f"{device!r} ({dev.kind})", param_hint="--device")
    reason = compilers.missing_reason(compiler)
    if reason:
        raise click.UsageError(f"--compile for {device}: {reason}")


# ------------------------------------------------------------------ tune, devices, show, report


def _pair(value, option):
    try:
        a, b = (int(x) for x in value.split(","))
    except ValueError:
        raise click.BadParameter(f"expected two comma-separated integers, got {value!r}",
                                 param_hint=option) from None
    return a, b


@main.command()
@click.option("--device", default=None, help="Registry name (`gdngen devices`); default: "
              "the attached device.")
@click.option("--model", "models", multiple=True, metavar="NAME",
              help="Model preset (repeatable): qwen3-next, qwen3.5, kimi-linear. Default: all, "
                   "unless --heads is given.")
@click.option("--heads", default=None, metavar="HK,HV", help="Custom key,value heads.")
@click.option("--dim", default="128,128", show_default=True, metavar="DK,DV",
              help="Head dims for --heads.")
@gate_option("Gate kind for --heads.")
@click.option("--dtype", type=DTYPE_CHOICE, default="float32", show_default=True)
@click.option("--seq", default="2048", show_default=True, callback=_parse_seq_lens,
              metavar="T[,T...]", help="Sequence length(s) to tune at.")
@click.option("--batch", type=click.IntRange(min=1), default=1, show_default=True)
@click.option("--precision", type=click.Choice(["ieee", "tf32", "bf16"]), default="ieee",
              show_default=True, help="Matmul precision policy.")
@click.option("--framework", type=click.Choice(["jax", "mlx", "all"]), default=None,
              help="Default: mlx on Apple GPUs, jax on TPU/GPU, every installed one on cpu.")
@click.option("--backend", "backends", multiple=True, help="Only these backends (repeatable).")
@click.option("--trials", type=click.IntRange(min=1), default=8, show_default=True,
              help="Variants evaluated per study (all processes together).")
@click.option("--timeout", type=click.FloatRange(min=0, min_open=True), default=None,
              help="Wall seconds this process searches each study.")
@click.option("--trial-timeout", type=click.FloatRange(min=0, min_open=True), default=900.0,
              show_default=True, help="Seconds one trial (validate + time) may take.")
@click.option("--repeats", type=click.IntRange(min=1), default=3, show_default=True,
              help="Timed runs per trial after a warm-up (median).")
@click.option("--cases", default=None, metavar="NAME[,NAME...]|all",
              help="Battery cases each trial validates on (default: ragged,identical_keys).")
@click.option("--storage", default=None, help="Optuna storage URL (sqlite:///tune.db, "
              "postgresql://user@host:5432/db with gdngen[postgres]) or journal file, shared "
              "by every tuner of a study; default: a journal in the user cache dir.")
@click.option("--workers", type=click.IntRange(min=1), default=1, show_default=True,
              help="Local tuner processes sharing the storage (one progress bar).")
@click.option("--heartbeat", type=click.IntRange(min=1), default=10, show_default=True,
              metavar="SECONDS", help="A trial in flight says it is alive this often.")
@click.option("--heartbeat-grace", type=click.IntRange(min=2), default=60, show_default=True,
              metavar="SECONDS", help="A trial silent this long (its tuner killed, on any "
              "host) is failed and its variant re-queued.")
@click.option("--cache-dir", default=None, type=click.Path(file_okay=False),
              help="Folder of the tuned <device>.json to write (default: the user cache dir).")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--dry-run", is_flag=True, help="Render and validate every candidate off-device "
              "(interpret mode / simulator), without timing.")
@click.option("--json", "as_json", is_flag=True, help="Print the summaries as JSON.")
def tune(device, models, heads, dim, gate, dtype, seq, batch, precision, framework, backends,
         trials, timeout, trial_timeout, repeats, cases, storage, workers, heartbeat,
         heartbeat_grace, cache_dir, seed, dry_run, as_json):
    """Autotune variants for a device: validate each on the battery, time fwd+bwd, cache the
    best."""
    from gdngen import devices, presets
    from gdngen import tune as tune_mod
    from gdngen.cases import BATTERY
    from gdngen.variant import Problem

    tune_mod.load_plugins()
    try:
        if device is None:
            device = devices.detect()
        devices.get_device(device)
        frameworks = (devices.installed_frameworks() if framework == "all" else
                      (framework,) if framework else tune_mod.default_frameworks(device))
        if not frameworks:
            raise ValueError(f"no framework installed that runs on {device}")
        if not dry_run:
            for fw in frameworks:
                devices.require_attached(device, fw)
        problems = [presets.get_preset(m).problem(dtype) for m in models]
        if heads:
            problems.append(Problem(*_pair(heads, "--heads"), *_pair(dim, "--dim"), dtype, gate))
        if not problems:
            problems = [p.problem(dtype) for p in presets.PRESETS.values()]
        case_names = (tuple(c.name for c in BATTERY) if cases == "all" else
                      tuple(c.strip() for c in cases.split(",")) if cases else
                      tune_mod.DEFAULT_CASES)
        if heartbeat_grace <= heartbeat:
            raise click.BadParameter(f"{heartbeat_grace} is not above --heartbeat "
                                     f"({heartbeat})", param_hint="--heartbeat-grace")
        if workers > 1 and dry_run:
            raise click.BadParameter("--dry-run validates without a study; it takes no "
                                     "workers", param_hint="--workers")
        settings = tune_mod.Settings(trials=trials, timeout=timeout, trial_timeout=trial_timeout,
                                     repeats=repeats, cases=case_names, seed=seed,
                                     heartbeat=tune_mod.Heartbeat(heartbeat, heartbeat_grace))
        if tune_mod.is_url(storage):
            tune_mod.check_storage_url(storage)
        targets = tune_mod.targets(device, frameworks, problems, precision=precision,
                                   seq_lens=seq, batch=batch, backends=backends)
    except (ValueError, KeyError) as e:
        raise click.UsageError(str(e).strip("'\"")) from None
    skipped = [(t, tune_mod.skip_reason(t)) for t in targets]
    for t, why in skipped:
        if why:
            click.echo(f"skipping {t.label()}: {why}", err=True)
    targets = [t for t, why in skipped if not why]
    if not targets:
        raise click.UsageError(f"nothing to tune on {device} for frameworks {frameworks}")
    if dry_run:
        targets = _compile_checked(targets, device)
    if not dry_run and workers == 1:
        try:  # fail fast, before any target starts
            storage = tune_mod.open_storage(storage, device, settings.heartbeat)
        except RuntimeError as e:
            raise click.ClickException(str(e)) from None
    _run_tune(tune_mod, targets, settings, storage, cache_dir, dry_run, as_json, workers)


def _compile_checked(targets, device: str) -> list:
    """Off-device tuning (``--dry-run``) for a device with a real compiler here
    (`gdngen.compilers`): each target's space without the variants that do not compile for
    it, saying how many were dropped and why (verdicts cached per source and compiler)."""
    from gdngen import compilers, devices

    dev = devices.get_device(device)
    wanted = {c for c, kind in compilers.COMPILERS.values() if kind == dev.kind}
    if not wanted or not dev.topology:
        return targets
    missing = [compilers.missing_reason(c) for c in sorted(wanted) if compilers.missing_reason(c)]
    if missing:
        click.echo(f"note: no compile check for {device}: {'; '.join(missing)}", err=True)
        return targets
    out = []
    for target, dropped in compilers.check_targets(targets):
        if dropped:
            click.echo(f"{target.label()}: dropped {len(dropped)} of "
                       f"{len(target.space()) + len(dropped)} variants, which do not compile "
                       f"for {device}:", err=True)
            for name, why in dropped.items():
                click.echo(f"  {name}: {why.splitlines()[0][:300]}", err=True)
        elif compilers.COMPILERS.get(target.backend, (None, None))[1] == dev.kind:
            click.echo(f"{target.label()}: all {len(target.space())} variants compile for "
                       f"{device}", err=True)
        if target.space():
            out.append(target)
        else:
            click.echo(f"skipping {target.label()}: no variant compiles for {device}", err=True)
    if not out:
        raise click.ClickException(f"no variant of any target compiles for {device}")
    return out


def _run_tune(tune_mod, targets, settings, storage, cache_dir, dry_run, as_json, workers=1):
    from rich import progress as rp
    from rich.console import Console

    columns = (rp.TextColumn("{task.description}"), rp.BarColumn(), rp.MofNCompleteColumn(),
               rp.TimeElapsedColumn(), rp.TextColumn("{task.fields[last]}", markup=False))
    results = []
    with rp.Progress(*columns, console=Console(stderr=True), transient=False) as progress:
        if workers > 1:
            results = _run_workers(tune_mod, progress, targets, settings, storage, cache_dir,
                                   workers)
        for target in targets if workers == 1 else ():
            total = len(target.space()) if dry_run else min(settings.trials,
                                                             len(target.space()))
            task = progress.add_task(target.label(), total=total, last="")

            def update(done, total, name, task=task):
                progress.update(task, completed=done, total=total, last=name)

            if dry_run:
                results.append((target, tune_mod.dry_run(target, settings, on_variant=update)))
            else:
                results.append(tune_mod.tune(target, settings, storage=storage,
                                             cache_dir=cache_dir, on_trial=update))
            progress.update(task, completed=total)
    if dry_run:
        if as_json:
            click.echo(json.dumps([{"target": t.label(), "device": t.device, "rows": rows}
                                   for t, rows in results], indent=2))
        else:
            for target, rows in results:
                click.echo(tune_mod.format_dry_run(target, rows).rstrip("\n"))
        return
    if as_json:
        click.echo(json.dumps([s.to_json() for s in results], indent=2))
    else:
        click.echo(tune_mod.format_summaries(results).rstrip("\n"))


def _run_workers(tune_mod, progress, targets, settings, storage, cache_dir, workers):
    """``--workers N``: one bar per target fed by every worker (`gdngen.tune.pool`)."""
    tasks = [progress.add_task(f"{workers} workers: {t.label()}",
                               total=min(settings.trials, len(t.space())), last="")
             for t in targets]

    def update(i, done, total, name):
        progress.update(tasks[i], completed=done, total=total, last=name)

    try:
        results = tune_mod.run_workers(targets, settings, workers, storage=storage,
                                       cache_dir=cache_dir, on_progress=update)
    except RuntimeError as e:
        raise click.ClickException(str(e)) from None
    for task in tasks:
        progress.update(task, completed=progress.tasks[task].total)
    return results


@main.command()
@click.option("--json", "as_json", is_flag=True, help="Print the registry and detection as JSON.")
def devices(as_json):
    """List the registered devices, marking the attached one(s)."""
    import dataclasses

    from gdngen import devices as devices_mod

    detected = devices_mod.detect_all()
    if as_json:
        click.echo(json.dumps({
            "devices": [dict(dataclasses.asdict(d), backends=list(registry.backends_for(d)))
                        for d in devices_mod.DEVICES.values()],
            "detected": {fw: dataclasses.asdict(d) for fw, d in detected.items()}}, indent=2))
    else:
        backends = {name: registry.backends_for(name) for name in devices_mod.DEVICES}
        click.echo(devices_mod.format_table(detected, backends).rstrip("\n"))


@main.command()
@click.option("--device", default=None, help="Default: the attached device.")
@click.option("--json", "as_json", is_flag=True)
def show(device, as_json):
    """Print the tuned cache (shipped and user files) for a device (``GDNGEN_PLUGINS``
    backends included)."""
    from gdngen import cache, devices
    from gdngen.tune.worker import load_plugins

    load_plugins()

    try:
        device = device or devices.detect()
        devices.get_device(device)
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    rows = cache.describe(device)
    if as_json:
        click.echo(json.dumps(rows, indent=2))
    elif not rows:
        click.echo(f"no tuned entries for {device} in {[str(d) for d in cache.tuned_dirs()]}")
    else:
        click.echo(cache.format_rows(rows).rstrip("\n"))


@main.command()
@click.argument("files", nargs=-1, required=True, type=click.Path(exists=True, dir_okay=False))
@click.option("--cache-dir", default=None, type=click.Path(file_okay=False),
              help="Folder of the tuned <device>.json to merge into (default: the user cache "
                   "dir, which `gdngen show` lists).")
@click.option("--json", "as_json", is_flag=True, help="Print the taken/kept keys as JSON.")
def merge(files, cache_dir, as_json):
    """Merge tuned files of other hosts (their <cache>/tuned/<device>.json) into this one: per
    key, the entry that saw more of its study (more trials run, then newer) wins."""
    from gdngen import cache

    try:
        result = cache.merge_files(files, cache_dir)
    except cache.CorruptCacheFile as e:
        raise click.UsageError(f"FILES: {e}") from None
    if as_json:
        click.echo(json.dumps(result, indent=2))
        return
    for key in result["taken"]:
        click.echo(f"merged {key}")
    for key in result["kept"]:
        click.echo(f"kept   {key} (the present entry saw as much of its study)")


@main.command()
@click.option("--device", default=None, help="Default: the attached device.")
@click.option("--storage", default=None, help="Optuna storage of the studies (as for tune).")
@click.option("--out", "out_dir", default="gdngen-report", show_default=True,
              type=click.Path(file_okay=False), help="Folder for the PNGs and report.json.")
@click.option("--json", "as_json", is_flag=True, help="Print the plotted numbers as JSON.")
def report(device, storage, out_dir, as_json):
    """Write PNG plots: tuning history per study and speedup vs sequence length."""
    from gdngen import devices
    from gdngen.tools import report as report_mod

    try:
        device = device or devices.detect()
        devices.get_device(device)
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    data = report_mod.report(device, out_dir, storage=storage)
    if as_json:
        click.echo(json.dumps(data, indent=2))
        return
    for series in data["speedup"]:
        points = ", ".join(f"T{p['seq_bucket']}: {p['speedup']:.2f}x" for p in series["points"])
        click.echo(f"{series['label']}: {points}")
    for path in data["files"]:
        click.echo(f"wrote {path}")


if __name__ == "__main__":
    main()
