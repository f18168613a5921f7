"""The Metal backend's launch plans: which kernels run in which order on which buffers, for a
chunk call (`launch_plan`), a packed row, the recurrent kernel (final state or per step) and the
per-channel walks, with the ``(dtype, ndim, size)`` of their inputs. Needs no framework."""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass

from gdngen import settings
from gdngen.backends.kernel_inputs import KernelInputs, context_tag
from gdngen.backends.metal.config import (
    CHANNEL_KERNELS,
    KEYS_KERNEL,
    STAGE_KERNELS,
    adapt,
    threadgroup_bytes,
)
from gdngen.backends.metal.kernels import (
    fused_kernels,
    fused_key,
    kernels_used,
    render,
    render_fused_kernels,
    render_packed,
    render_steps,
)
from gdngen.problem import Problem
from gdngen.variant import Variant


@dataclass(frozen=True)
class KernelSpec:
    """One ``mx.fast.metal_kernel``: its unique name, parameter names, body and header."""

    name: str
    input_names: tuple
    output_names: tuple
    source: str
    header: str


@dataclass(frozen=True)
class Launch:
    """One kernel call. ``inputs`` / ``outputs`` name arrays of the plan's environment, in the
    kernel's parameter order; ``template`` values are ints, bools or dtype names."""

    kernel: str
    inputs: tuple
    outputs: tuple
    output_shapes: tuple
    output_dtypes: tuple
    grid: tuple
    threadgroup: tuple
    template: tuple


@dataclass(frozen=True)
class Plan:
    """Everything a forward + backward of one variant runs, for N chunks of batch B.

    Environment names: inputs q, k, v, g, beta, s0, prm (and dy, dsf in the backward); the
    forward returns ``y`` / ``final_state`` and hands ``saved`` to the backward.

    ``packed`` (`packed_launch_plan`): the packed build; the forward also takes ``inject`` and
    returns ``states`` (S_in, never in ``saved``: it is an output), the backward also takes
    ``dsin`` and its ``dsout`` is the injection's cotangent.

    A walk plan (`channel_plan`, per-channel gates) has one launch in each: the forward walk's
    and the backward walk's, and the intra-chunk kernels' in ``stages``, each run on its own
    inputs by `ChannelWalks` (nothing ``saved``).

    ``fused`` (`fused_key`: ``(("gate_form", ...), ("qk_norm", ...))``, empty for the plain
    build): the forward's kernels are `render_fused`'s, taking raw q, k and, with a gate form,
    ``a``, ``A_log``, ``dt_bias`` in place of ``g`` (``prm`` then also holds the lower bound);
    a backward is the plain build's, on the recomputed inputs.
    """

    variant: Variant
    problem: Problem
    N: int
    B: int
    kernels: dict
    forward: tuple
    backward: tuple
    saved: tuple
    threadgroup_bytes: dict
    packed: bool = False
    fused: tuple = ()
    #: a walk plan's intra-chunk launches: (channel_intra, channel_grads), each run by
    #: `ChannelWalks` on its own inputs
    stages: tuple = ()


_KERNEL_IO = {
    "fwd_intra": (("k", "v", "g", "beta", "prm"), ("u", "wk")),
    "fwd_intra_tinv": (("k", "v", "g", "beta", "prm"), ("u", "wk", "tinv")),
    "fwd_scan": (("q", "k", "g", "s0", "u", "wk", "prm"), ("y_out", "final_state")),
    "fwd_scan_save": (("q", "k", "g", "s0", "u", "wk", "prm"),
                      ("y_out", "final_state", "states", "w_out")),
    "fwd_scan_states": (("k", "g", "s0", "u", "wk", "prm"), ("final_state", "states", "w_out")),
    "bwd_scan": (("q", "k", "g", "dy", "dsf", "wk", "prm"), ("dw", "dsout", "ds0")),
    "bwd_tri": (("k", "v", "g", "beta", "dw", "states", "tinv", "prm"),
                ("da", "dv", "dkt", "vec_out")),
    "bwd_qk": (("q", "k", "g", "beta", "dy", "w", "states", "dsout", "da", "dkt", "vec_in",
                "prm"), ("dq", "dk", "dbeta", "dd")),
    "recurrent": (("q", "k", "v", "a", "beta", "s0", "prm"), ("y_out", "final_state")),
    "recurrent_steps": (("q", "k", "v", "a", "beta", "s0", "prm"), ("y_out", "states")),
    "fwd_scan_channel": (("s0", "u", "wk", "kc", "qd", "pm", "dcc"),
                         ("y_out", "final_state", "states", "w_out")),
    "bwd_scan_channel": (("dsf", "pm", "kc", "wk", "w", "states", "dy", "qd", "dcc"),
                         ("dw", "dsout", "ds0", "dwk", "dqd", "dkc", "ddcc")),
    "channel_keys": (("q", "k", "g", "prm"), ("kc", "qd", "dcc")),
    "channel_intra": (("q", "k", "v", "g", "beta", "prm"),
                      ("u", "wk", "kc", "qd", "pm", "mkk", "tinv", "dcc")),
    "channel_grads": (("q", "k", "v", "g", "beta", "w", "tinv", "mkk", "dy", "dw", "dwk_sum",
                       "dqd_sum", "dkc_sum", "ddcc_sum", "prm"),
                      ("dq", "dk", "dv", "dg", "dbeta", "d0s", "dpm", "dmk")),
}
# Kernel parameter -> environment name, where they differ.
_ENV_NAME = {"w": "w_out", "vec_in": "vec_out"}


def _kernel_io(name: str, packed: bool, fused: tuple = ()) -> tuple:
    """``(inputs, outputs)`` of kernel ``name``; the packed build's scans take ``inject`` /
    ``dsin`` (before ``prm``) and every packed forward scan writes ``states``; a fused build
    (`fused_key`) with a gate form takes ``a`` in place of ``g`` and ``A_log``, ``dt_bias``
    before ``prm``."""
    ins, outs = _KERNEL_IO[name]
    if dict(fused).get("gate_form"):
        ins = tuple("a" if n == "g" else n for n in ins[:-1]) + ("A_log", "dt_bias", "prm")
    if packed and name.startswith("fwd_scan"):
        ins = ins[:-1] + ("inject", "prm")
        outs = outs if "states" in outs else outs + ("states",)
    elif packed and name == "bwd_scan":
        ins = ins[:-1] + ("dsin", "prm")
    return ins, outs


def launch_plan(variant: Variant, problem: Problem, N: int, B: int,
                inputs: KernelInputs | None = None) -> Plan:
    """The launches of ``variant`` (adapted to ``problem``) for N chunks and batch B, rendered
    from the shipped templates or the ``GDNGEN_TEMPLATES`` override folder. ``inputs``
    (`KernelInputs`, default none): the forward's kernels are the fused build's
    (`render_fused`, `fused_kernels`): raw q, k and, with a gate form, ``a``, ``A_log``,
    ``dt_bias`` (``prm = (scale, 0, lower_bound)``); the backward's stay the plain build's, on
    the recomputed inputs (environment names ``q``, ``k``, ``g`` as before)."""
    if problem.gate != "scalar":
        raise ValueError(f"the metal chunk kernels take scalar gates only, got {problem.key()} "
                         f"(vector gates run the walk kernels, `channel_plan`)")
    return build_launch_plan(adapt(variant, problem), problem, N, B,
                        settings.templates_override(), False, fused_key(inputs))


def packed_launch_plan(variant: Variant, problem: Problem, N: int, B: int,
                       templates_dir=None) -> Plan:
    """`launch_plan` of the packed build (`render_packed`): the same launches, grids and
    threadgroup memory; ``templates_dir`` default the ``GDNGEN_TEMPLATES`` override."""
    if problem.gate != "scalar":
        raise ValueError(f"the metal packed kernels take scalar gates only, got {problem.key()}")
    templates = settings.templates_override() if templates_dir is None else templates_dir
    return build_launch_plan(adapt(variant, problem), problem, N, B, templates, True)


def _recurrent_io(fused: tuple) -> tuple:
    """``(inputs, outputs)`` of the recurrent kernel; a fused gate adds ``A_log``, ``dt_bias``,
    a fused conv ``conv_w``, ``conv_s``, a norm build ``z``, ``norm_w`` (in that order)."""
    ins, outs = _KERNEL_IO["recurrent"]
    context = dict(fused)
    return (ins + (("A_log", "dt_bias") if context.get("gate_form") else ())
            + (("conv_w", "conv_s") if context.get("conv") else ())
            + (("z", "norm_w") if context.get("norm") else ())), outs


@functools.lru_cache(maxsize=64)
def _recurrent_kernel(variant: Variant, problem: Problem, templates, fused: tuple = ()
                      ) -> KernelSpec:
    if not fused:
        rendered = render(variant, problem, templates_dir=templates)
        body = rendered.sources["recurrent.metal"]
        tag = hashlib.sha256(body.encode()).hexdigest()[:12]  # self-contained: no header
        return KernelSpec(f"gdngen_recurrent_{tag}", *_KERNEL_IO["recurrent"], body, "")
    rendered = render_fused_kernels(variant, problem, fused, templates)
    body, header = rendered.sources["recurrent.metal"], rendered.sources["layer_inputs.metal"]
    tag = hashlib.sha256((header + "\0" + body).encode()).hexdigest()[:12]
    return KernelSpec(f"gdngen_recurrent{context_tag(dict(fused))}_{tag}",
                      *_recurrent_io(fused), body, header)


def recurrent_plan(variant: Variant, problem: Problem, T: int, B: int,
                   templates_dir=None, inputs: KernelInputs | None = None) -> Plan:
    """The one launch of the recurrent kernel of ``variant`` (adapted to ``problem``) for T steps
    and batch B: grid (32 * simdgroups, Dv / dv_tile, B * Hv) (a norm build: Dv / Dv, one
    threadgroup per head). In this `Plan`, ``N`` is T (the
    kernel reads T from q's shape at run time; the source does not depend on it) and there is no
    backward. ``templates_dir``: default the ``GDNGEN_TEMPLATES`` override, else the shipped
    templates. ``inputs`` (`KernelInputs`, default none): the fused build (`render_fused`),
    which takes raw q, k and, with a gate form, ``a``, ``A_log``, ``dt_bias`` (inputs in that
    order after the plain ones; ``prm = (scale, lower_bound)``); the kernel is keyed on what
    reaches its source (`fused_key`), not on the lower bound."""
    variant = adapt(variant, problem)
    templates = settings.templates_override() if templates_dir is None else templates_dir
    fused = fused_key(inputs)
    spec = _recurrent_kernel(variant, problem, templates, fused)
    p = variant.as_dict()
    nt = 32 * p["simdgroups"]
    Hv, Dk, Dv = problem.Hv, problem.Dk, problem.Dv
    f32 = "float32"
    ins, outs = _recurrent_io(fused)
    rows = Dv if dict(fused).get("norm") else p["dv_tile"]  # a norm build: a threadgroup a head
    launch = Launch(kernel="recurrent", inputs=ins, outputs=outs,
                    output_shapes=((B, T, Hv, Dv), (B, Hv, Dv, Dk)), output_dtypes=(f32, f32),
                    grid=(nt, Dv // rows, B * Hv), threadgroup=(nt, 1, 1), template=())
    return Plan(variant, problem, T, B, {"recurrent": spec}, (launch,), (), (),
                {"recurrent": 0}, fused=fused)


@functools.lru_cache(maxsize=64)
def _steps_kernel(variant: Variant, problem: Problem, templates) -> KernelSpec:
    body = render_steps(variant, problem, templates_dir=templates).sources["recurrent_steps.metal"]
    tag = hashlib.sha256(body.encode()).hexdigest()[:12]
    return KernelSpec(f"gdngen_recurrent_steps_{tag}", *_KERNEL_IO["recurrent_steps"], body, "")


def steps_plan(variant: Variant, problem: Problem, T: int, B: int, templates_dir=None) -> Plan:
    """`recurrent_plan` of the per-step-states build (`render_steps`, plain inputs): the same
    launch, its second output ``states [B, T, Hv, Dv, Dk]``, the state after every step."""
    variant = adapt(variant, problem)
    templates = settings.templates_override() if templates_dir is None else templates_dir
    p = variant.as_dict()
    nt = 32 * p["simdgroups"]
    Hv, Dk, Dv = problem.Hv, problem.Dk, problem.Dv
    ins, outs = _KERNEL_IO["recurrent_steps"]
    launch = Launch(kernel="recurrent", inputs=ins, outputs=outs,
                    output_shapes=((B, T, Hv, Dv), (B, T, Hv, Dv, Dk)),
                    output_dtypes=("float32", "float32"),
                    grid=(nt, Dv // p["dv_tile"], B * Hv), threadgroup=(nt, 1, 1), template=())
    return Plan(variant, problem, T, B, {"recurrent": _steps_kernel(variant, problem, templates)},
                (launch,), (), (), {"recurrent": 0})


def recurrent_input_metas(plan: Plan) -> dict:
    """``(dtype, ndim, size)`` of the recurrent kernel's inputs for ``plan`` (`recurrent_plan`)."""
    pb, T, B = plan.problem, plan.N, plan.B
    f32 = "float32"
    gate = T * B * pb.Hv * (pb.Dk if pb.gate == "vector" else 1)
    metas = {"q": (f32, 4, B * T * pb.Hk * pb.Dk), "k": (f32, 4, B * T * pb.Hk * pb.Dk),
             "v": (f32, 4, B * T * pb.Hv * pb.Dv),
             "a": (f32, 4 if pb.gate == "vector" else 3, gate), "beta": (f32, 3, B * T * pb.Hv),
             "s0": (f32, 4, B * pb.Hv * pb.Dv * pb.Dk),
             "prm": (f32, 1, (3 if dict(plan.fused).get("norm") else 2) if plan.fused else 1)}
    if dict(plan.fused).get("gate_form"):
        vector = pb.gate == "vector"
        metas["A_log"] = metas["dt_bias"] = (f32, 2 if vector else 1,
                                             pb.Hv * (pb.Dk if vector else 1))
    if dict(plan.fused).get("conv"):  # K is the kernel's runtime conv_w_shape[1]: 4 here
        channels = 2 * pb.Hk * pb.Dk + pb.Hv * pb.Dv
        metas["conv_w"], metas["conv_s"] = (f32, 2, channels * 4), (f32, 3, B * channels * 3)
    if dict(plan.fused).get("norm"):
        metas["z"], metas["norm_w"] = (f32, 4, B * T * pb.Hv * pb.Dv), (f32, 1, pb.Dv)
    return metas


@functools.lru_cache(maxsize=64)
def channel_plan(variant: Variant, problem: Problem, N: int, B: int, templates=None,
                 packed: bool = False) -> Plan:
    """The walk kernels of per-channel gates (`CHANNEL_KERNELS`) for N chunks and batch B:
    ``forward`` is the one launch of `ChannelWalks.forward` (fwd_scan_channel), ``backward``
    the two of `ChannelWalks.backward` (channel_keys, then bwd_scan_channel); the walks on grid
    (32 * simdgroups, Dv / dv_tile, B * Hv); ``stages`` those of `ChannelWalks.intra` and
    ``grads`` (channel_intra, channel_grads) and channel_keys on grid (32 * simdgroups, 1,
    N * B * Hv); every buffer float32 (names and shapes in the templates' headers).
    ``variant`` must be adapted to ``problem`` (a vector-gate `Problem`); ``templates``: a
    template override folder (None: the shipped templates). ``packed``: the packed build's
    walks (`render_packed`), the forward also taking ``inject``, the backward ``dsin``."""
    if problem.gate != "vector":
        raise ValueError(f"the metal walk kernels take vector gates, got {problem.key()}")
    rendered = (render_packed if packed else render)(variant, problem, templates_dir=templates)
    p = variant.as_dict()
    C, nt, dvt = p["chunk_size"], 32 * p["simdgroups"], p["dv_tile"]
    Hv, Dk, Dv = problem.Hv, problem.Dk, problem.Dv
    header = rendered.sources["common.metal"]
    chunks, tiles = (N, B, Hv), (Dv // dvt, N, B, Hv)
    shapes = {"y_out": chunks + (C, Dv), "final_state": (B, Hv, Dv, Dk),
              "states": chunks + (Dv, Dk), "w_out": chunks + (C, Dv), "dw": chunks + (C, Dv),
              "dsout": chunks + (Dv, Dk), "ds0": (B, Hv, Dv, Dk), "dwk": tiles + (C, Dk),
              "dqd": tiles + (C, Dk), "dkc": tiles + (C, Dk), "ddcc": tiles + (Dk,)}
    stage_shapes = {**dict.fromkeys(("u", "dv"), chunks + (C, Dv)),
                    **dict.fromkeys(("wk", "kc", "qd", "dq", "dk", "dg", "d0s"), chunks + (C, Dk)),
                    **dict.fromkeys(("pm", "mkk", "tinv", "dpm", "dmk"), chunks + (C, C)),
                    "dcc": chunks + (Dk,), "dbeta": chunks + (C,)}
    chunk_parallel = STAGE_KERNELS + (KEYS_KERNEL,)
    kernels, launches = {}, {}
    for name in CHANNEL_KERNELS:
        body = rendered.sources[f"{name}.metal"]
        tag = hashlib.sha256((header + "\0" + body).encode()).hexdigest()[:12]
        ins, outs = _KERNEL_IO[name]
        stage = name in chunk_parallel
        if packed and not stage:  # the walks take the injected states
            ins = ins + ("inject" if name == "fwd_scan_channel" else "dsin",)
        kernels[name] = KernelSpec(f"gdngen_{name}_{tag}", ins, outs, body, header)
        launches[name] = Launch(kernel=name, inputs=ins, outputs=outs,
                                output_shapes=tuple((stage_shapes if stage else shapes)[o]
                                                    for o in outs),
                                output_dtypes=("float32",) * len(outs),
                                grid=(nt, 1, N * B * Hv) if stage else (nt, Dv // dvt, B * Hv),
                                threadgroup=(nt, 1, 1), template=(("InT", "float32"),))
    tg = threadgroup_bytes(p, problem)
    return Plan(variant, problem, N, B, kernels, (launches["fwd_scan_channel"],),
                (launches[KEYS_KERNEL], launches["bwd_scan_channel"]), (),
                {name: tg[name] for name in kernels}, packed,
                stages=tuple(launches[name] for name in STAGE_KERNELS))


def channel_input_metas(plan: Plan) -> dict:
    """``(dtype, ndim, size)`` of the per-channel kernels' inputs for ``plan`` (`channel_plan`), in
    the chunk layout `gdngen.algebra.chunkwise_channel` passes ([N, B, Hk, r, ...], states [B, Hk,
    r, Dv, Dk])."""
    pb, N, B, C = plan.problem, plan.N, plan.B, plan.variant["chunk_size"]
    f32, heads = "float32", N * B * pb.Hv
    state, rows_v, rows_k = (f32, 5, B * pb.Hv * pb.Dv * pb.Dk), (f32, 6, heads * C * pb.Dv), \
        (f32, 6, heads * C * pb.Dk)
    keys, per_step = (f32, 5, N * B * pb.Hk * C * pb.Dk), (f32, 5, heads * C)
    stages = {"q": keys, "k": keys, "v": rows_v, "g": rows_k, "beta": per_step,
              "prm": (f32, 1, 2), "tinv": (f32, 6, heads * C * C), "mkk": (f32, 6, heads * C * C),
              "dwk_sum": rows_k, "dqd_sum": rows_k, "dkc_sum": rows_k,
              "ddcc_sum": (f32, 5, heads * pb.Dk)}
    return {**stages, "s0": state, "dsf": state, "u": rows_v, "w": rows_v,
            "dy": rows_v, "wk": rows_k, "kc": rows_k, "qd": rows_k, "pm": (f32, 6, heads * C * C),
            "dcc": (f32, 5, heads * pb.Dk), "states": (f32, 6, heads * pb.Dv * pb.Dk),
            "inject": (f32, 6, heads * pb.Dv * pb.Dk), "dsin": (f32, 6, heads * pb.Dv * pb.Dk)}


@functools.lru_cache(maxsize=64)
def build_launch_plan(variant: Variant, problem: Problem, N: int, B: int, templates,
                 packed: bool = False, fused: tuple = ()) -> Plan:
    if packed and fused:
        raise ValueError("a packed row takes its layer inputs computed (no fused build)")
    if dict(fused).get("conv"):
        raise ValueError("the metal chunk kernels take q, k, v convolved (the conv is the "
                         "recurrent kernel's: recurrent_plan)")
    rendered = render_packed(variant, problem, templates_dir=templates) if packed else \
        render(variant, problem, templates_dir=templates)
    forward_fused = fused_kernels(variant) if fused else ()
    fused_sources = (render_fused_kernels(variant, problem, fused, templates).sources if fused
                     else {})
    p = variant.as_dict()
    C, sg, dvt = p["chunk_size"], p["simdgroups"], p["dv_tile"]
    Hv, Dk, Dv = problem.Hv, problem.Dk, problem.Dv
    nt = 32 * sg
    in_t = problem.dtype
    header = rendered.sources["common.metal"]
    kernels = {}
    for name in kernels_used(p["save_states"]):
        if name in forward_fused:  # the fused build: its own header (the helpers) and body
            head, body, suffix = fused_sources["common.metal"], \
                fused_sources[f"{name}.metal"], context_tag(dict(fused))
            io = _kernel_io(name, packed, fused)
        else:
            head, body, suffix = header, rendered.sources[f"{name}.metal"], ""
            io = _kernel_io(name, packed)
        # Named by its own text: variants that share a kernel share its compiled pipeline.
        tag = hashlib.sha256((head + "\0" + body).encode()).hexdigest()[:12]
        kernels[name] = KernelSpec(f"gdngen_{name}{suffix}_{tag}", *io, body, head)
    per_chunk = (N, B, Hv)
    f32 = "float32"
    shapes = {
        "u": per_chunk + (C, Dv), "wk": per_chunk + (C, Dk), "tinv": per_chunk + (C, C),
        "y_out": per_chunk + (C, Dv), "final_state": (B, Hv, Dv, Dk),
        "states": per_chunk + (Dv, Dk), "w_out": per_chunk + (C, Dv),
        "dw": per_chunk + (C, Dv), "dsout": per_chunk + (Dv, Dk), "ds0": (B, Hv, Dv, Dk),
        "da": per_chunk + (C, C), "dv": per_chunk + (C, Dv), "dkt": per_chunk + (C, Dk),
        "vec_out": per_chunk + (2, C), "dq": per_chunk + (C, Dk), "dk": per_chunk + (C, Dk),
        "dbeta": per_chunk + (C,), "dd": per_chunk + (C + 1, C + 1),
    }
    chunk_grid = (nt, 1, N * B * Hv)
    scan_grid = (nt, Dv // dvt, B * Hv)
    grids = {"fwd_intra": chunk_grid, "fwd_intra_tinv": chunk_grid, "fwd_scan": scan_grid,
             "fwd_scan_save": scan_grid, "fwd_scan_states": scan_grid, "bwd_scan": scan_grid,
             "bwd_tri": chunk_grid, "bwd_qk": chunk_grid}

    def launch(name):
        ins, outs = _kernel_io(name, packed, fused if name in forward_fused else ())
        return Launch(
            kernel=name, inputs=tuple(_ENV_NAME.get(n, n) for n in ins), outputs=outs,
            output_shapes=tuple(shapes[o] for o in outs),
            output_dtypes=tuple(in_t if o == "y_out" else f32 for o in outs),
            grid=grids[name], threadgroup=(nt, 1, 1), template=(("InT", in_t),))

    bwd = ("bwd_scan", "bwd_tri", "bwd_qk")
    if p["save_states"]:
        forward = (launch("fwd_intra_tinv"), launch("fwd_scan_save"))
        backward = tuple(launch(n) for n in bwd)
        saved = ("w_out", "tinv", "wk") if packed else ("states", "w_out", "tinv", "wk")
    else:
        forward = (launch("fwd_intra"), launch("fwd_scan"))
        backward = tuple(launch(n) for n in ("fwd_intra_tinv", "fwd_scan_states") + bwd)
        saved = ()
    tg, tg_fused = threadgroup_bytes(p, problem), \
        threadgroup_bytes(p, problem, dict(fused).get("qk_norm", False))
    return Plan(variant, problem, N, B, kernels, forward, backward, saved,
                {name: (tg_fused if name in forward_fused else tg)[name] for name in kernels},
                packed, fused)


def plan_input_metas(plan: Plan) -> dict:
    """``(dtype, ndim, size)`` of the forward's inputs in chunk layout, as MLX passes them."""
    pb, C = plan.problem, plan.variant["chunk_size"]
    steps = plan.N * plan.B * C  # time steps of all chunks and batch rows
    f32 = "float32"
    metas = {"q": (pb.dtype, 5, steps * pb.Hk * pb.Dk), "k": (pb.dtype, 5, steps * pb.Hk * pb.Dk),
             "v": (pb.dtype, 6, steps * pb.Hv * pb.Dv), "g": (f32, 5, steps * pb.Hv),
             "beta": (f32, 5, steps * pb.Hv), "s0": (f32, 5, plan.B * pb.Hv * pb.Dv * pb.Dk),
             "prm": (f32, 1, 2)}
    if plan.packed:  # [N, B, Hk, r, Dv, Dk], as `packed_gated_delta`'s walk passes it
        metas["inject"] = (f32, 6, plan.N * plan.B * pb.Hv * pb.Dv * pb.Dk)
    if plan.fused:  # the fused forward's: raw q, k (as above), prm with the lower bound
        metas["prm"] = (f32, 1, 3)
        if dict(plan.fused).get("gate_form"):
            metas["a"] = metas["g"]
            metas["A_log"] = metas["dt_bias"] = (f32, 1, pb.Hv)
    return metas
