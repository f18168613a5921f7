"""``gdngen build``: enumerate, render, write, validate and (``--compile``) compile a
backend's variants (`gdngen.tools.build`)."""

from __future__ import annotations

import json
import sys

import click

from gdngen import registry
from gdngen.tools.commands.options import parse_variant


@click.command()
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
    from gdngen.problem import Problem
    from gdngen.tools import build as build_mod

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
    variant_list = [parse_variant(backend, text, None) for text in variant_jsons] or None
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
    reason = compilers.topology_missing(dev)
    if reason:
        raise click.UsageError(f"--compile for {device}: {reason}")
