"""Metal backend: generated chunkwise kernels for ``mx.fast.metal_kernel``, forward and backward.

The kernels port `gdngen.algebra.chunkwise` (exact unit-lower-triangular inverse by forward
substitution, decay factors only as exp of segment sums, the straddle-sum gate gradient) to Metal,
as Jinja bodies under ``templates/metal/`` rendered per `Problem` and `Variant`. A `Plan` lists the
launches (kernel, grid, threadgroup, template args, buffers, output shapes) of the forward and of
the backward; the same plan runs on an Apple GPU through MLX (`MLXLauncher`) or, anywhere, in
`gdngen.backends.metal.sim` (`SimLauncher`), so the simulated path is the shipped path.

Around the kernels everything is `gdngen.algebra.chunkwise`: ``chunkwise.whole_sequence`` folds the
mask, pads T and lays the sequence out in chunks, and the O(C^2) gate epilogue is
``chunkwise.decay_factors_{log,linear}_vjp`` in mx ops on the dD the kernels produce.

Kernels, per chunk n, batch b, value head h (C = chunk, r = Hv / Hk):

================  ====================  ==========================================================
kernel            threadgroups          computes
================  ====================  ==========================================================
fwd_intra[_tinv]  N*B*Hv                T = (I+A)^-1, U = T diag(beta) V, Wk = T diag(beta D0) K
fwd_scan[_save]   (Dv/dv_tile) x B*Hv   W, y and the state over the chunks (saving S_in, W)
fwd_scan_states   (Dv/dv_tile) x B*Hv   S_in and W only (the backward's recomputation)
bwd_scan          (Dv/dv_tile) x B*Hv   dW, dS_out per chunk, dS0 (chunks in reverse)
bwd_tri           N*B*Hv                dv, dA = -T^T dT T^T and the T-dependent dk, dbeta
bwd_qk            N*B*Hv                dq, dk, dbeta and the decay cotangent dD
recurrent         (Dv/dv_tile) x B*Hv   forward only, step by step: y and S_T, the state's rows
                                        in registers (calls with T < recurrent_below)
fwd_scan_channel  (Dv/dv_tile) x B*Hv   per-channel gates: `chunkwise_channel.walk_forward`, W, y,
                                        S_in and the state over the chunks
channel_keys      N*B*Hv                per-channel gates: the reverse walk's decayed keys (Kc,
                                        Qd, dCC) from q, k and the raw gates
bwd_scan_channel  (Dv/dv_tile) x B*Hv   per-channel gates: `chunkwise_channel.walk_backward` with
                                        G = Pm^T dY formed per chunk: dW, dS_out per chunk, dS0,
                                        and per Dv tile its part of dWk, dQd, dKc, ddCC (summed
                                        in mx)
channel_intra     N*B*Hv                per-channel gates: the intra-chunk stages (Qd, Kc, dCC,
                                        Pm, M_kk, T, U, Wk) from the raw gates
channel_grads     N*B*Hv                per-channel gates: their VJP after the reverse walk (dq,
                                        dk, dv, dbeta, the gates' straddle sums)
================  ====================  ==========================================================

Per-channel (vector) gates run `channel_core` (an ``mx.custom_function`` with the contract of
`gdngen.backends.portable.mlx_chunkwise.chunk_core`): channel_intra, then the forward walk on
the scan templates' per-channel build (``per_channel`` set, `ChannelWalks`, `channel_plan`),
whose decays come in as per-channel inputs (Qd = scale Q * D0, Kc = K * DC, dCC); its VJP the
reverse walk (channel_keys, then bwd_scan_channel, which forms G = Pm^T dY) and channel_grads
(docs/VECTOR_GATES.md, "How the Metal kernels form the decays"). Validated as the scalar
kernels: the battery's vector cases in the simulator with poisoned outputs, worst relative
error 8.6e-7 (vector_identical_keys, dbeta; tests/backends/metal/test_metal_kernels.py).
Chunk-boundary states run channel_intra and the forward walk.

Packed rows (`gdngen.algebra.packed`, ``cu_seqlens``), scalar gates: `packed_gated_delta` runs the
row's chunk walk on the templates' ``packed`` build (`render_packed`, `packed_launch_plan`):
the forward scans add ``inject[n]`` to the state leaving chunk n and always write the entering
states S_in (an output); ``bwd_scan`` adds their cotangent ``dsin[n]`` at chunk n's entry, so
its ``dsout`` is the injection's cotangent. Each sequence's initial-state response and its
final state (from its last chunk's S_in) are one-chunk calls of the dense chunk kernels. The
dense render does not change with the flag (tuned entries are keyed on its sha256).
Per-channel packed rows run the packed algebra on `channel_walk_core` (channel_intra, the
packed build's walks taking ``inject`` / ``dsin``, channel_grads) and `channel_core` on the
packed build for the sequences' one-chunk calls.

Fused layer inputs (`gdngen.backends.kernel_inputs`; ``qk_norm``, ``gate="softplus"`` /
``"sigmoid_bound"``): the fused build (`render_fused`, the templates' ``qk_norm`` /
``gate_form`` blocks, helpers in ``layer_inputs.metal``) of the recurrent kernel and of the
scalar-gate chunk forward (`fused_kernels`) takes raw q, k and the raw gate projection ``a`` with
``A_log``, ``dt_bias``: the recurrent kernel normalises each loaded row in registers (its sum of
squares a ``simd_sum``), the chunk kernels apply each row's norm factor ``rsqrt(|x|^2 + 1e-6)``
to the products the row enters; both form log g from ``a`` in float32 (softplus as ``max(x, 0)
+ log1p(exp(-|x|))``, a = -inf an identity step) before their cumulative sums, the decay as
exp(log g). The chunk backward stays the plain build's, its inputs recomputed as mx ops in
`dense_core`; per-channel chunk calls compute them in `gdngen.algebra.chunkwise_channel`'s core.
The conv (``conv_weight``, the mixer's causal conv + SiLU): the recurrent kernel's conv build
(``conv`` set, recurrent only) takes the raw q, k, v with ``conv_w [C, K]`` and ``conv_s [B, C,
K-1]`` and convolves each loaded element (``gdn_conv``, K a runtime value) before the norm, so a
decode step of the mixer is one kernel for the conv, the norm, the gate and the recurrence; its
VJP is the chunk path's on q, k, v convolved first (`calls._conv_switch`). The chunk kernels get
q, k, v convolved first (`gdngen.prepare.convolved`). The
plain build renders byte for byte as before (its sha256 and tuned entries unchanged). Measured in
the simulator against float64, values and gradients: worst relative error 1.8e-6
(tests/backends/metal/test_metal_fused_inputs.py).


The package by role (each imports only those above it; this ``__init__`` declares `Metal`, whose
hooks are its methods over them, and re-exports their public names):

* `gdngen.backends.metal.config`: constants, `Config`, the space, the default, footprints, `adapt`;
* `gdngen.backends.metal.kernels`: the template plan (`render_plan`) and every build's render;
* `gdngen.backends.metal.plan`: the launch plans (`Plan`, `Launch`, `KernelSpec`);
* `gdngen.backends.metal.launch`: `MLXLauncher`, `SimLauncher`, `default_launcher`,
  `run_launches`, `compile_plan`, `lower_check`;
* `gdngen.backends.metal.vjp`: the differentiable cores (`dense_core`, `packed_core`) and
  `ChannelWalks`;
* `gdngen.backends.metal.calls`: `recurrent_forward`, `recurrent_steps_forward` and the hooks'
  bodies (`dense_call`, `packed_call`, `steps_call`, `chunks_call`);
* ``templates/`` the Jinja sources, `gdngen.backends.metal.sim` the MSL simulator.

This package imports without mlx: the space, the renderer and the plans need no framework.
"""

from __future__ import annotations

from gdngen.backend import Backend
from gdngen.backends.metal.calls import (
    chunks_call,
    dense_call,
    packed_call,
    recurrent_forward,
    recurrent_steps_forward,
    steps_call,
)
from gdngen.backends.metal.config import (
    BACKEND,
    CHANNEL_BLOCK,
    CHANNEL_KERNELS,
    CHUNK_SIZES,
    DV_TILES,
    KEYS_KERNEL,
    MAX_ACC_FLOATS,
    POLICY_TOLERANCES,
    PRECISIONS,
    RECURRENT_BELOW,
    SIMDGROUPS,
    STAGE_KERNELS,
    THREADGROUP_MEMORY,
    WALK_KERNELS,
    Config,
    accumulator_floats,
    adapt,
    default_config,
    intra_tile,
    max_threadgroup_bytes,
    params_valid,
    supports,
    threadgroup_bytes,
    variant_space,
)
from gdngen.backends.metal.kernels import (
    fused_kernels,
    fused_key,
    kernels_used,
    render_fused,
    render_fused_kernels,
    render_packed,
    render_plan,
    render_steps,
)
from gdngen.backends.metal.launch import (
    MLXLauncher,
    SimLauncher,
    compile_plan,
    default_launcher,
    from_numpy,
    lower_check,
    to_numpy,
)
from gdngen.backends.metal.plan import (
    KernelSpec,
    Launch,
    Plan,
    build_launch_plan,
    channel_input_metas,
    channel_plan,
    launch_plan,
    packed_launch_plan,
    plan_input_metas,
    recurrent_input_metas,
    recurrent_plan,
    steps_plan,
)
from gdngen.backends.metal.vjp import ChannelWalks, channel_core, channel_walk_core
from gdngen.problem import Problem

#: this package's names: its own and those of its role modules re-exported (`default_launcher`
#: is read from `gdngen.backends.metal.launch` when called: patch it there)
__all__ = [
    'BACKEND', 'CHANNEL_BLOCK', 'CHANNEL_KERNELS', 'CHUNK_SIZES', 'DV_TILES', 'KEYS_KERNEL',
    'MAX_ACC_FLOATS', 'POLICY_TOLERANCES', 'PRECISIONS', 'RECURRENT_BELOW', 'SIMDGROUPS', 'SPEC',
    'STAGE_KERNELS',
    'THREADGROUP_MEMORY', 'WALK_KERNELS', 'ChannelWalks', 'Config', 'KernelSpec', 'Launch',
    'MLXLauncher', 'Metal', 'Plan', 'SimLauncher', 'accumulator_floats', 'adapt',
    'build_launch_plan', 'channel_core', 'channel_input_metas', 'channel_plan',
    'channel_walk_core', 'chunks_call', 'compile_plan', 'default_config', 'default_launcher',
    'dense_call', 'from_numpy', 'fused_kernels', 'fused_key', 'gated_delta', 'intra_tile',
    'kernels_used', 'launch_plan', 'lower_check', 'max_threadgroup_bytes', 'packed_call',
    'packed_gated_delta', 'packed_launch_plan', 'params_valid', 'plan_input_metas',
    'problem_of_inputs', 'recurrent_forward', 'recurrent_input_metas', 'recurrent_plan',
    'recurrent_steps_forward', 'render_fused', 'render_fused_kernels', 'render_packed',
    'render_plan', 'render_steps', 'simulate', 'steps_call', 'steps_plan', 'supports',
    'threadgroup_bytes', 'to_numpy', 'variant_space',
]


class Metal(Backend):
    """The generated Metal kernels (Apple GPUs; `gdngen.backends.metal.sim` off-device). Each
    hook is a method calling this package's role modules (see the package docstring)."""

    name, framework, config, tolerances = BACKEND, "mlx", Config, POLICY_TOLERANCES
    device_kinds, device_limit, reference_device = ("apple",), "threadgroup_memory", "apple-m1"
    gates = tuned_gates = ("scalar", "vector")
    fused_inputs, packed_gates = ("qk_norm", "gate", "conv", "norm"), ("scalar", "vector")
    step_states = chunk_states = ("scalar", "vector")

    def space(self, problem, device=None):
        return variant_space(problem, device)

    def default(self, problem, device=None):
        return default_config(problem, device)

    def supports(self, problem):
        return supports(problem)

    def footprint(self, variant, problem):
        return max_threadgroup_bytes(variant, problem)

    def render_plan(self, variant, problem):
        return render_plan(variant, problem)

    def lower_check(self, variant, problem):
        return lower_check(variant, problem)

    def norm_in_stores(self, call, variant) -> bool:
        """The recurrent kernel's norm build (a threadgroup per head): short calls."""
        return (call.norm_gate is not None and self.normalises(call)
                and not self.chunked(call, variant))

    def conv_path(self, call, variant) -> str:
        """The recurrent kernel's conv build (short calls, not differentiated)."""
        if not self.takes_raw_conv(call) or self.chunked(call, variant):
            return super().conv_path(call, variant)
        return ("in the recurrent kernel's loads when not differentiated; differentiated, "
                "before the chunk kernels")

    def forward(self, call, operands, variant, launcher=None):
        return dense_call(call, operands, variant, launcher, chunked=self.chunked(call, variant))

    def packed(self, call, operands, variant, launcher=None, templates_dir=None):
        return packed_call(call, operands, variant, launcher, templates_dir)

    def steps(self, call, operands, variant, launcher=None):
        return steps_call(call, operands, variant, launcher)

    def chunks(self, call, operands, variant, launcher=None):
        return chunks_call(call, operands, variant, launcher)


SPEC = Metal()


def gated_delta(q, k, v, g, beta, initial_state=None, *, mask=None, scale=1.0, gate="log",
                variant=None, launcher=None, qk_norm=False):
    """Run a Metal ``variant`` (differentiable, through ``mx.custom_function``).

    Shapes and semantics as `gdngen.mlx.gated_delta`; y has q's dtype, the final state is float32.
    ``launcher``: `MLXLauncher` (default on a Metal GPU) or `SimLauncher` (default elsewhere).
    T >= the variant's ``recurrent_below``: the chunk kernels (per-channel gates:
    `gdngen.algebra.chunkwise_channel` with its walks on the walk kernels, `ChannelWalks`); below
    it the forward is `recurrent_forward` and the VJP the chunk path's. ``qk_norm`` / ``gate`` a
    `gdngen.algebra.layer_inputs.ParameterGate` (``g`` then ``(a, A_log, dt_bias)``): computed in
    the
    forward kernels' loads (`render_fused`; the package docstring), recomputed for the backward."""
    if variant is None or variant.backend != BACKEND:
        raise ValueError(f"variant must be a metal Variant, got {variant!r}")
    checked, operands = SPEC.checked_args(q, k, v, g, beta, initial_state, mask,
                                           scale=scale, gate=gate, qk_norm=qk_norm)
    return SPEC.run(checked, operands, variant, launcher=launcher)


def packed_gated_delta(q, k, v, g, beta, initial_state=None, *, mask=None, scale=1.0,
                       gate="log", variant, cu_seqlens, launcher=None, templates_dir=None):
    """A packed row (`gdngen.algebra.packed`, fla's ``cu_seqlens``) on ``variant``'s kernels, scalar
    gates: the row's chunk walk on the packed build (`render_packed`, `packed_core`: resets,
    injected initial states, entering states S_in out), each sequence's one-chunk calls (the
    initial states' free response, the final state from its last chunk's S_in) on the dense
    chunk kernels (B = N rows of one chunk, masked y zeroed). Differentiable in every input.

    Arguments as `gated_delta` with ``cu_seqlens`` int32 ``[N+1]`` (checked here): q, k
    ``[1,T,Hk,Dk]``, v ``[1,T,Hv,Dv]``, g / beta ``[1,T,Hv]``, ``initial_state [N,Hv,Dv,Dk]``
    or None, mask ``[1,T]``. Float32 inside (the variant's ``precision`` still applies to the
    matmul operands); returns ``(y [1,T,Hv,Dv] in q's dtype, final_state [N,Hv,Dv,Dk]
    float32)``. ``recurrent_below`` does not apply (a packed row always walks chunks).
    ``templates_dir``: a template override folder for both builds (default
    ``GDNGEN_TEMPLATES``)."""
    if variant is None or variant.backend != BACKEND:
        raise ValueError(f"variant must be a metal Variant, got {variant!r}")
    checked, operands = SPEC.checked_args(q, k, v, g, beta, initial_state, mask,
                                           scale=scale, gate=gate, cu_seqlens=cu_seqlens)
    return SPEC.run_packed_kernels(checked, operands, variant, launcher=launcher,
                                   templates_dir=templates_dir)


# ---------------------------------------------------------------------------- validation


def problem_of_inputs(inputs: dict, dtype: str) -> Problem:
    """The `Problem` of battery-style inputs (q [B,T,Hk,Dk], v [B,T,Hv,Dv])."""
    _, _, Hk, Dk = inputs["q"].shape
    Hv, Dv = inputs["v"].shape[2], inputs["v"].shape[3]
    return Problem(int(Hk), int(Hv), int(Dk), int(Dv), dtype, "scalar")


def simulate(variant, problem, inputs, cotangents, *, gate="log", scale=None, schedule="forward",
             seed=0):
    """Forward + VJP of ``variant`` in `gdngen.backends.metal.sim`, through the shipped MLX path.

    ``inputs``: NumPy q, k, v, g, beta and optionally initial_state, mask (shapes as the API);
    ``cotangents``: ``{"y": dy, "final_state": dS}``. ``scale`` defaults to Dk ** -0.5.
    Returns ``(outputs, grads)``: ``{"y", "final_state"}`` and ``{"q", "k", "v", "g", "beta",
    "initial_state"}``, float32 NumPy arrays.
    """
    import mlx.core as mx
    import numpy as np

    got = problem_of_inputs(inputs, problem.dtype)
    if (got.Hk, got.Hv, got.Dk, got.Dv) != (problem.Hk, problem.Hv, problem.Dk, problem.Dv):
        raise ValueError(f"inputs have shape class {got.key()}, expected {problem.key()}")
    mdt = getattr(mx, problem.dtype)
    scale = float(problem.Dk) ** -0.5 if scale is None else float(scale)
    names = ("q", "k", "v", "g", "beta")
    args = [mx.array(np.asarray(inputs[n], np.float32)).astype(mdt if n in names[:3] else
                                                               mx.float32) for n in names]
    B = args[0].shape[0]
    s0 = inputs.get("initial_state")
    s0 = (mx.zeros((B, problem.Hv, problem.Dv, problem.Dk)) if s0 is None
          else mx.array(np.asarray(s0, np.float32)))
    mask = inputs.get("mask")
    mask = None if mask is None else mx.array(np.asarray(mask, bool))
    launcher = SimLauncher(schedule=schedule, seed=seed)

    def f(q, k, v, g, beta, s0):
        return gated_delta(q, k, v, g, beta, s0, mask=mask, scale=scale, gate=gate,
                           variant=variant, launcher=launcher)

    cot = [mx.array(np.asarray(cotangents["y"], np.float32)).astype(mdt),
           mx.array(np.asarray(cotangents["final_state"], np.float32))]
    (y, S), grads = mx.vjp(f, args + [s0], cot)
    out = {"y": y, "final_state": S}
    named = dict(zip(names + ("initial_state",), grads))
    as_np = {n: np.array(x.astype(mx.float32)) for n, x in {**out, **named}.items()}
    return ({n: as_np[n] for n in out}, {n: as_np[n] for n in named})

