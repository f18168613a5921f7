"""The Metal backend's sources: the template plan of a variant (`render_plan`) and its builds
(plain `render`, packed rows, per-step states, fused layer inputs), as `gdngen.sources.Rendered`
texts. Needs no framework."""

from __future__ import annotations

import functools

from gdngen import settings
from gdngen.backends.kernel_inputs import KernelInputs
from gdngen.backends.metal.config import CHANNEL_BLOCK, CHANNEL_KERNELS, adapt, intra_tile, parse
from gdngen.problem import Problem
from gdngen.variant import Variant


def _context(variant: Variant, problem: Problem) -> dict:
    p = variant.as_dict()
    return {
        "C": p["chunk_size"], "DK": problem.Dk, "DV": problem.Dv, "HK": problem.Hk,
        "HV": problem.Hv, "SG": p["simdgroups"], "DVT": p["dv_tile"],
        "DW": intra_tile(p["chunk_size"]), "policy": p["precision"], "mma": p["mma"],
        "per_channel": False, "packed": False,  # the packed build (`render_packed`) sets it
        # per-channel gates: the intra-chunk kernels' helpers in the header
        "channel_stages": problem.gate == "vector",
        **KernelInputs().context(),  # nothing fused: the fused build (`render_fused`) sets it
        # 16-bit operands: bfloat under precision bf16, else (tf32 rounding) half for float16
        "op_type": "bfloat" if p["precision"] == "bf16" or problem.dtype == "bfloat16"
        else "half",
    }


# kernel -> (template, extra context)
_KERNEL_TEMPLATES = {
    "fwd_intra": ("metal/fwd_intra.metal.j2", {"save_inverse": False}),
    "fwd_intra_tinv": ("metal/fwd_intra.metal.j2", {"save_inverse": True}),
    "fwd_scan": ("metal/fwd_scan.metal.j2", {"save": False, "write_y": True}),
    "fwd_scan_save": ("metal/fwd_scan.metal.j2", {"save": True, "write_y": True}),
    "fwd_scan_states": ("metal/fwd_scan.metal.j2", {"save": True, "write_y": False}),
    "bwd_scan": ("metal/bwd_scan.metal.j2", {}),
    "bwd_tri": ("metal/bwd_tri.metal.j2", {}),
    "bwd_qk": ("metal/bwd_qk.metal.j2", {}),
    # per-channel gates: the scan templates' per-channel build (the chunkwise_channel walks)
    "fwd_scan_channel": ("metal/fwd_scan.metal.j2",
                         {"save": True, "write_y": True, "per_channel": True}),
    "bwd_scan_channel": ("metal/bwd_scan.metal.j2", {"per_channel": True, "KB": CHANNEL_BLOCK}),
    # per-channel gates: the intra-chunk stages and their VJP
    "channel_intra": ("metal/channel_intra.metal.j2", {}),
    "channel_grads": ("metal/channel_grads.metal.j2", {}),
    "channel_keys": ("metal/channel_keys.metal.j2", {}),
}


def kernels_used(save: bool) -> tuple[str, ...]:
    if save:
        return ("fwd_intra_tinv", "fwd_scan_save", "bwd_scan", "bwd_tri", "bwd_qk")
    return ("fwd_intra", "fwd_scan", "fwd_intra_tinv", "fwd_scan_states", "bwd_scan", "bwd_tri",
            "bwd_qk")


def _recurrent_context(variant: Variant, problem: Problem) -> dict:
    """Context of ``recurrent.metal.j2``: head dims and heads, ``ROWS`` state rows per
    threadgroup (the variant's ``dv_tile``) over ``SG`` simdgroups (its ``simdgroups``), and the
    gate kind (``per_channel`` for a vector-gate problem). Nothing else of the variant (chunk,
    precision, ``recurrent_below``) reaches the recurrent source."""
    p = variant.as_dict()
    return {"DK": problem.Dk, "DV": problem.Dv, "HK": problem.Hk, "HV": problem.Hv,
            "ROWS": p["dv_tile"], "SG": p["simdgroups"], "per_channel": problem.gate == "vector",
            "steps": False, **KernelInputs().context()}


def render_plan(variant: Variant, problem: Problem) -> dict:
    """`gdngen.render` hook: ``{"common.metal": ..., "<kernel>.metal": ...}`` for the kernels
    this variant launches; each value is ``(template path, context)``. A scalar-gate problem
    runs the chunk kernels and the recurrent kernel (short calls); a vector-gate problem the
    per-channel build of the scan templates (`CHANNEL_KERNELS`, the walks of
    `gdngen.algebra.chunkwise_channel`) and the recurrent kernel."""
    variant = adapt(variant, problem)
    plan = {}
    ctx = _context(variant, problem)
    names = CHANNEL_KERNELS if problem.gate == "vector" else \
        kernels_used(variant["save_states"])
    plan["common.metal"] = ("metal/common.metal.j2", ctx)
    for name in names:
        template, extra = _KERNEL_TEMPLATES[name]
        plan[f"{name}.metal"] = (template, dict(ctx, **extra))
    plan["recurrent.metal"] = ("metal/recurrent.metal.j2", _recurrent_context(variant, problem))
    return plan


def render_packed(variant: Variant, problem: Problem, *, templates_dir=None):
    """The packed-row build of ``variant``'s chunk kernels (`gdngen.algebra.packed`), a
    `gdngen.sources.Rendered` with `render_plan`'s chunk-kernel names (no recurrent kernel):
    the same templates with ``packed`` set. Its forward scans take ``inject [N, B, Hv, Dv,
    Dk]`` (added to the state leaving each chunk) and always write the entering states
    ``states`` (S_in); its ``bwd_scan`` takes their cotangent ``dsin`` (same layout), so its
    ``dsout`` is the injection's cotangent. A per-channel problem's build is its walk kernels
    (`CHANNEL_KERNELS`) with the same two additions. With ``packed`` unset the templates render
    the dense kernels byte for byte: the dense sha256 (and tuned entries) do not depend on this
    build."""
    from gdngen.sources import render_planned

    variant = adapt(variant, problem)
    plan = {name: (template, dict(context, packed=True))
            for name, (template, context) in render_plan(variant, problem).items()
            if name != "recurrent.metal"}
    return render_planned(variant, problem, plan, templates_dir=templates_dir)


def render_steps(variant: Variant, problem: Problem, *, templates_dir=None):
    """The recurrent kernel of ``variant`` that writes the state after every step
    (``return_states="steps"``): ``recurrent.metal`` rendered with ``steps`` set, its output
    ``states [B, T, Hv, Dv, Dk]`` in place of ``final_state``. With ``steps`` unset the template
    renders the recurrent kernel byte for byte (the variant's sha256 does not depend on it)."""
    from gdngen.sources import render_planned

    variant = adapt(variant, problem)
    template, context = render_plan(variant, problem)["recurrent.metal"]
    return render_planned(variant, problem,
                          {"recurrent_steps.metal": (template, dict(context, steps=True))},
                          templates_dir=templates_dir)


def render_fused(variant: Variant, problem: Problem, inputs: KernelInputs, *,
                 templates_dir=None):
    """The fused build (`gdngen.backends.kernel_inputs`) of ``variant``'s forward kernels, a
    `gdngen.sources.Rendered`: the recurrent kernel and, scalar gates, the chunk forward's two
    kernels (`fused_kernels`) with their ``common.metal``, plus ``layer_inputs.metal`` (the
    helpers), each rendered with ``inputs.context()``. They take raw q, k and, with a gate form,
    ``a``, ``A_log``, ``dt_bias`` in place of the gate. ``inputs.conv``: the recurrent kernel
    alone (it takes raw q, k, v with ``conv_w``, ``conv_s`` and convolves in its loads; the
    chunk kernels take convolved inputs); ``inputs.norm`` too (it takes ``z``, ``norm_w``
    after them and stores the output's gated norm; rendered with ROWS = Dv whatever the
    variant's dv_tile: a threadgroup holds a head's every row). ``inputs`` must fuse something
    (the plain build is `render_plan`'s, whose sha256 does not depend on this one);
    ``templates_dir`` default ``GDNGEN_TEMPLATES``."""
    if not inputs.fused:
        raise ValueError(f"inputs must fuse a conv, a qk norm or a gate (the plain build is "
                         f"render_plan's), got {inputs!r}")
    templates = settings.templates_override() if templates_dir is None else templates_dir
    return render_fused_kernels(adapt(variant, problem), problem, fused_key(inputs), templates)


@functools.lru_cache(maxsize=64)
def render_fused_kernels(variant: Variant, problem: Problem, fused: tuple, templates_dir):
    from gdngen.sources import render_planned

    plan = render_plan(variant, problem)
    plan["layer_inputs.metal"] = ("metal/layer_inputs.metal.j2",
                                  _recurrent_context(variant, problem))
    names = {"recurrent.metal", "layer_inputs.metal"}
    context = dict(fused)
    if problem.gate == "scalar" and not (context.get("conv") or context.get("norm")):
        # a conv or norm build: the recurrent kernel only
        names |= {"common.metal", *(f"{n}.metal" for n in fused_kernels(variant))}
    whole = {"ROWS": problem.Dv} if context.get("norm") else {}  # a threadgroup per head
    return render_planned(variant, problem,
                          {name: (template, dict(context, **dict(fused),
                                                 **(whole if name == "recurrent.metal" else {})))
                           for name, (template, context) in plan.items() if name in names},
                          templates_dir=templates_dir)


def fused_kernels(variant: Variant) -> tuple[str, ...]:
    """The chunk kernels of a scalar-gate forward that have a fused build (`render_fused`): the
    forward's two launches (fwd_intra_tinv and fwd_scan_save when the variant saves states,
    fwd_intra and fwd_scan otherwise)."""
    if variant["save_states"]:
        return ("fwd_intra_tinv", "fwd_scan_save")
    return ("fwd_intra", "fwd_scan")


def fused_key(inputs: KernelInputs | None) -> tuple:
    """What of ``inputs`` reaches a rendering (`KernelInputs.context`), hashable; ``()`` when
    nothing is fused. ``lower_bound`` is a runtime scalar: one build serves every bound."""
    if inputs is None or not inputs.fused:
        return ()
    return tuple(sorted(inputs.context().items()))


def render(variant: Variant, problem: Problem, *, templates_dir=None):
    """`Metal.render` (`gdngen.sources.render_spec` on `render_plan`): the plain build of
    ``variant``, a `gdngen.sources.Rendered`; ``templates_dir`` a template override folder."""
    from gdngen.sources import render_planned

    parse(variant)  # ValueError naming a bad field, before anything is rendered
    return render_planned(variant, problem, render_plan(variant, problem),
                          templates_dir=templates_dir)
