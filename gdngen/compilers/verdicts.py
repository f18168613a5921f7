"""Compile verdicts per variant for a search space (`check_space`) and for tuning targets
(`check_targets`), remembered in ``<cache root>/compile.json`` per render sha256, variant,
problem, target and compiler versions (`verdict_key`)."""

from __future__ import annotations

import dataclasses
import json

from gdngen import settings
from gdngen.compilers.compiling import DEFAULT_T, compile_variant, programs
from gdngen.compilers.targets import (
    COMPILERS,
    PLATFORMS,
    compiler_of,
    compiler_versions,
    gpu_target_config,
)
from gdngen.devices import Device, get_device
from gdngen.problem import Problem
from gdngen.variant import Variant, dumps


def _memo_path():
    return settings.cache_root() / "compile.json"


def verdict_key(variant: Variant, problem: Problem, device: Device, T: int) -> str:
    """The memo key of a compile verdict: the variant's render sha256 (its templates), params,
    problem, target (for a GPU, its `gpu_target_config` text's sha256), T, the programs
    compiled (`programs`) and the compiler's versions."""
    import hashlib

    from gdngen import cache

    compiler, _ = compiler_of(variant.backend)
    target = device.topology
    if PLATFORMS[compiler] == "cuda":
        config = gpu_target_config(device).encode()
        target += ":" + hashlib.sha256(config).hexdigest()[:16]
    return "|".join([cache.variant_sha256(variant, problem), dumps(variant), dumps(problem),
                     device.name, target, f"T{T}",
                     ",".join(name for name, _ in programs(variant, problem, T)),
                     json.dumps(compiler_versions(compiler), sort_keys=True)])


def _memo_load() -> dict:
    try:
        data = json.loads(_memo_path().read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _memo_store(records: dict) -> None:
    from filelock import FileLock

    from gdngen.fileio import atomic_write_text

    path = _memo_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(path) + ".lock"):
        data = _memo_load()
        data.update(records)
        atomic_write_text(path, json.dumps(data, sort_keys=True) + "\n")


def check_space(variant_list, problem: Problem, device: str | Device, *, T: int = DEFAULT_T,
                on_variant=None) -> dict:
    """``{variant name: None | reason}``: the compile verdict of each variant (None: every
    program compiled), from the memo or compiled now (and remembered). ``on_variant(done,
    total, name)`` is called before each."""
    device = get_device(device) if isinstance(device, str) else device
    memo = _memo_load()
    verdicts, new = {}, {}
    for i, variant in enumerate(variant_list):
        if on_variant is not None:
            on_variant(i, len(variant_list), variant.name())
        key = verdict_key(variant, problem, device, T)
        if key in memo:
            verdicts[variant.name()] = memo[key]["error"]
            continue
        report = compile_variant(variant, problem, device, T=T)
        verdicts[variant.name()] = new.setdefault(key, {"error": report.first_error()})["error"]
    if new:
        _memo_store(new)
    return verdicts


def check_targets(targets, *, T: int = DEFAULT_T, on_variant=None) -> list[tuple]:
    """``[(target, {dropped variant name: reason})]``: each tuning target (`gdngen.tune.Target`)
    with the variants of its space that do not compile for its device `excluded`
    (`check_space`); targets whose backend has no real compiler for the device pass unchanged.
    RuntimeError when the compiler they need is not installed."""
    out = []
    for target in targets:
        device = get_device(target.device)
        if COMPILERS.get(target.backend, (None, None))[1] != device.kind or not device.topology:
            out.append((target, {}))
            continue
        space = target.space()
        verdicts = check_space(space, target.problem, device, T=T, on_variant=on_variant)
        dropped = {name: why for name, why in verdicts.items() if why is not None}
        out.append((dataclasses.replace(target, excluded=target.excluded + tuple(dropped)),
                    dropped))
    return out
