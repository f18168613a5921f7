"""``gdngen tune``: its options, the off-device compile check of ``--dry-run`` and the
progress bars of one or several tuner processes (`gdngen.tune`)."""

from __future__ import annotations

import json

import click

from gdngen.tools.commands.options import DTYPE_CHOICE, gate_option, pair, parse_seq_lens


@click.command()
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
@click.option("--seq", default="2048", show_default=True, callback=parse_seq_lens,
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
@click.option("--crossover/--no-crossover", default=True, show_default=True,
              help="Measure the chosen variant's recurrent/chunkwise crossover T after the "
                   "search (--no-crossover keeps the backend's default recurrent_below).")
@click.option("--dry-run", is_flag=True, help="Render and validate every candidate off-device "
              "(interpret mode / simulator), without timing.")
@click.option("--json", "as_json", is_flag=True, help="Print the summaries as JSON.")
def tune(device, models, heads, dim, gate, dtype, seq, batch, precision, framework, backends,
         trials, timeout, trial_timeout, repeats, cases, storage, workers, heartbeat,
         heartbeat_grace, cache_dir, seed, crossover, dry_run, as_json):
    """Autotune variants for a device: validate each on the battery, time fwd+bwd, cache the
    best."""
    from gdngen import devices, presets
    from gdngen import tune as tune_mod
    from gdngen.cases import BATTERY
    from gdngen.problem import Problem

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
            problems.append(Problem(*pair(heads, "--heads"), *pair(dim, "--dim"), dtype, gate))
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
                                     crossover=crossover,
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
