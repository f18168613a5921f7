"""``gdngen doctor``: the host's devices, versions, backends, first-use verdicts, tuned entries,
off-device compilers and settings (`gdngen.tools.doctor`)."""

from __future__ import annotations

import json

import click


@click.command()
@click.option("--device", default=None,
              help="Whose verdicts and tuned entries to show (default: the attached device).")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def doctor(device, as_json):
    """One screen to paste into a bug report: what gdngen runs with on this host."""
    from gdngen import devices
    from gdngen.tools import doctor as doctor_mod

    if device is not None:
        try:
            devices.get_device(device)
        except ValueError as e:
            raise click.UsageError(str(e)) from None
    report = doctor_mod.collect(device)
    if as_json:
        click.echo(json.dumps(report, indent=2, default=str))
    else:
        click.echo(doctor_mod.format_report(report).rstrip("\n"))
