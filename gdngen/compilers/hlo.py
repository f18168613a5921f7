"""What a compiled program's text says: each Mosaic kernel's scoped VMEM (`mosaic_kernels`),
each Triton launch's shared memory (`triton_kernels`) and the bytes its collectives move
(`collective_bytes`)."""

from __future__ import annotations

import re

_CUSTOM_CALL = re.compile(r"%([\w.\-]+) = .*?custom_call_target=\"tpu_custom_call\"(.*)")


def mosaic_kernels(hlo_text: str) -> list[dict]:
    """Each Mosaic kernel of a compiled program's HLO: ``{"name", "vmem_used", "vmem_limit"}``
    from its backend config (``used_scoped_memory_configs`` / ``scoped_memory_configs``, VMEM
    is memory space 1). XLA may place the kernel's scoped window at an offset (other buffers
    below it) and then states the used range from 0: ``vmem_used`` is what the kernel itself
    uses, the used range's end less the window's start."""
    kernels = []
    for line in hlo_text.splitlines():
        match = _CUSTOM_CALL.search(line)
        if not match:
            continue
        rest = match.group(2)

        def ranges(field, rest=rest):  # [(offset, size)] in VMEM
            found = re.search(r'"' + field + r'":\[(.*?)\]', rest)
            entries = re.findall(r'"memory_space":"1","offset":"(\d+)","size":"(\d+)"',
                                 found.group(1)) if found else []
            return [(int(offset), int(size)) for offset, size in entries]

        window, used = ranges("scoped_memory_configs"), ranges("used_scoped_memory_configs")
        start = min((offset for offset, _ in window), default=0)
        end = max((offset + size for offset, size in used), default=start)
        kernels.append({"name": match.group(1), "vmem_used": max(end - start, 0),
                        "vmem_limit": sum(size for _, size in window)})
    return kernels


#: an HLO instruction that communicates between devices (its result types before the name)
COLLECTIVES = r"\b(all-gather|all-reduce|all-to-all|collective-permute|reduce-scatter)(-start)?\("


def collective_bytes(hlo_text: str, *, per_channel: bool = False) -> dict:
    """``{collective kind: bytes its results hold, per device}`` in compiled HLO ``hlo_text``
    (empty: the program communicates nothing). ``per_channel``: one collective counts once per
    ``(kind, channel_id)``, for XLA TPU, which repeats a collective in each fusion it puts it
    in (XLA CPU gives one channel to several collectives it schedules together)."""
    import numpy as np

    sizes = {"bf16": 2, "f16": 2, "f32": 4, "f64": 8, "s32": 4, "pred": 1}
    out, seen = {}, set()
    for i, line in enumerate(hlo_text.splitlines()):
        found = re.search(r"= (.*?) " + COLLECTIVES, line)
        channel = re.search(r"\bchannel_id=(\d+)", line)
        key = (found.group(2), channel.group(1)) if found and channel and per_channel else i
        if found and key not in seen:
            seen.add(key)
            total = sum(sizes[t] * int(np.prod([int(d) for d in dims.split(",") if d]))
                        for t, dims in re.findall(r"(\w+)\[([\d,]*)\]", found.group(1)))
            out[found.group(2)] = out.get(found.group(2), 0) + total
    return out


_TRITON_CALL = re.compile(r'custom_call_target="__gpu\$xla\.gpu\.triton".*?\bname = "([^"]+)"')
_THUNK = re.compile(r"\s(\S+) grid: \[([\d, ]+)\] threads: \[([\d, ]+)\]\s+"
                    r"shared_memory: (\d+) bytes")


def triton_kernels(hlo_text: str, thunks_text: str, limit: int) -> list[dict]:
    """Each launch of a Triton kernel (a Pallas ``pallas_call``) in a program XLA GPU compiled:
    ``{"name", "shared_memory", "shared_memory_limit", "grid", "threads"}``, the kernels named
    by the compiled HLO's ``__gpu$xla.gpu.triton`` custom calls, their launches read from the
    thunk sequence XLA dumps (``*thunk_sequence.txt``); ``limit``: the device's opt-in shared
    memory per block."""
    names = set(_TRITON_CALL.findall(hlo_text))
    return [{"name": m.group(1), "shared_memory": int(m.group(4)), "shared_memory_limit": limit,
             "grid": [int(x) for x in m.group(2).split(",")],
             "threads": [int(x) for x in m.group(3).split(",")]}
            for m in _THUNK.finditer(thunks_text) if m.group(1) in names]
