"""``gdngen devices``, ``show``, ``merge`` and ``report``: the device table, the tuned cache
and its plots."""

from __future__ import annotations

import json

import click

from gdngen import registry


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Print the registry and detection as JSON.")
def devices(as_json):
    """List the registered devices and their compile-only topologies (those that cannot be
    compiled for here marked, with the reason), marking the attached one(s)."""
    import dataclasses

    from gdngen import compilers
    from gdngen import devices as devices_mod

    detected = devices_mod.detect_all()
    unavailable = {d.name: reason for d in devices_mod.DEVICES.values() if d.topology
                   for reason in [compilers.topology_missing(d)] if reason}
    if as_json:
        click.echo(json.dumps({
            "devices": [dict(dataclasses.asdict(d), backends=list(registry.backends_for(d)),
                             topology_unavailable=unavailable.get(d.name))
                        for d in devices_mod.DEVICES.values()],
            "detected": {fw: dataclasses.asdict(d) for fw, d in detected.items()}}, indent=2))
    else:
        backends = {name: registry.backends_for(name) for name in devices_mod.DEVICES}
        click.echo(devices_mod.format_table(detected, backends, unavailable).rstrip("\n"))


@click.command()
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


@click.command()
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


@click.command()
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
