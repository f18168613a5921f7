"""Metal backend: generated chunkwise kernels for ``mx.fast.metal_kernel``, forward and backward.

The kernels port `gdngen.algebra.chunkwise` (exact unit-lower-triangular inverse by forward
substitution, decay factors only as exp of segment sums, the straddle-sum gate gradient) to Metal,
as Jinja bodies under ``templates/metal/`` rendered per `Problem` and `Variant`. A `Plan` lists the
launches (kernel, grid, threadgroup, template args, buffers, output shapes) of the forward and of
the backward; the same plan runs on an Apple GPU through MLX (`MLXLauncher`) or, anywhere, in
`gdngen.backends.metal.sim` (`SimLauncher`), so the simulated path is the shipped path.

Around the kernels everything is `gdngen.algebra.chunkwise`: ``chunkwise.gated_delta`` folds the
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
bwd_scan_channel  (Dv/dv_tile) x B*Hv   per-channel gates: `chunkwise_channel.walk_backward`, dW,
                                        dS_out per chunk, dS0, and per Dv tile its part of dWk,
                                        dQd, dKc, ddCC (summed in mx)
================  ====================  ==========================================================

Per-channel (vector) gates run `gdngen.algebra.chunkwise_channel` (the mlx backend's
``mx.custom_function``, `gdngen.backends.portable.mlx_chunkwise.chunk_core`) with its two chunk
walks on the ``*_channel`` kernels (`ChannelWalks`, `channel_plan`): the scan templates' per-channel
build (``per_channel`` set), whose decays d0 / dc / dcc come in as per-channel inputs (Qd = scale Q
* D0, Kc = K * DC, dCC) instead of being formed from scalar per-token gates. The intra-chunk stages
(factors, decayed products, WY, the backward's adjoints and straddle sums) stay
`gdngen.algebra.chunkwise_channel`'s shared code in mx ops; fusing them into kernels is a later
step. Validated as the scalar kernels: the battery's vector cases in the simulator with poisoned
outputs, worst relative error 1.1e-6 (vector_identical_keys, dbeta;
tests/backends/metal/test_metal_kernels.py).

Packed rows (`gdngen.algebra.packed`, ``cu_seqlens``), scalar gates: `packed_gated_delta` runs the
row's chunk walk on the templates' ``packed`` build (`render_packed`, `packed_launch_plan`):
the forward scans add ``inject[n]`` to the state leaving chunk n and always write the entering
states S_in (an output); ``bwd_scan`` adds their cotangent ``dsin[n]`` at chunk n's entry, so
its ``dsout`` is the injection's cotangent. Each sequence's initial-state response and its
final state (from its last chunk's S_in) are one-chunk calls of the dense chunk kernels. The
dense render does not change with the flag (tuned entries are keyed on its sha256).
Per-channel packed rows run the portable path (``packed_gates`` is scalar only).

Fused layer inputs (`gdngen.backends.kernel_inputs`; ``qk_norm``, ``gate="softplus"`` /
``"sigmoid_bound"``): the fused build (`render_fused`, the templates' ``qk_norm`` /
``gate_form`` blocks, helpers in ``layer_inputs.metal``) of the recurrent kernel and of the
scalar-gate chunk forward (`fused_kernels`) takes raw q, k and the raw gate projection ``a`` with
``A_log``, ``dt_bias``: the recurrent kernel normalises each loaded row in registers (its sum of
squares a ``simd_sum``), the chunk kernels apply each row's norm factor ``rsqrt(|x|^2 + 1e-6)``
to the products the row enters; both form log g from ``a`` in float32 (softplus as ``max(x, 0)
+ log1p(exp(-|x|))``, a = -inf an identity step) before their cumulative sums, the decay as
exp(log g). The chunk backward stays the plain build's, its inputs recomputed as mx ops in
`_core`; per-channel chunk calls compute them in `gdngen.algebra.chunkwise_channel`'s core. The
plain build renders byte for byte as before (its sha256 and tuned entries unchanged). Measured in
the simulator against float64, values and gradients: worst relative error 1.8e-6
(tests/backends/metal/test_metal_fused_inputs.py).

This module imports without mlx: the space, the renderer and the plan need no framework.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from gdngen import settings
from gdngen.backends.generated import l2_normalized, l2_normalized_vjp, refuse_injection
from gdngen.backends.kernel_inputs import KernelInputs, kernel_parameters
from gdngen.backends.metal.kernels import (
    BACKEND,
    CHANNEL_BLOCK,
    CHANNEL_KERNELS,
    CHUNK_SIZES,
    DV_TILES,
    MAX_ACC_FLOATS,
    POLICY_TOLERANCES,
    PRECISIONS,
    RECURRENT_BELOW,
    SIMDGROUPS,
    SPEC,
    THREADGROUP_MEMORY,
    Config,
    Metal,
    accumulator_floats,
    adapt,
    default_config,
    fused_kernels,
    fused_key,
    intra_tile,
    kernels_used,
    max_threadgroup_bytes,
    params_valid,
    render_fused,
    render_fused_kernels,
    render_packed,
    render_plan,
    render_steps,
    supports,
    threadgroup_bytes,
    variant_space,
)
from gdngen.backends.metal.plan import (
    KernelSpec,
    Launch,
    MLXLauncher,
    Plan,
    SimLauncher,
    build_launch_plan,
    channel_input_metas,
    channel_plan,
    compile_plan,
    from_numpy,
    launch_plan,
    lower_check,
    packed_launch_plan,
    plan_input_metas,
    recurrent_input_metas,
    recurrent_plan,
    steps_plan,
    to_numpy,
)
from gdngen.variant import Problem, Variant

#: this package's names: its own and those of the modules it is made of (`kernels`, `plan`)
__all__ = [
    'BACKEND', 'CHANNEL_BLOCK', 'CHANNEL_KERNELS', 'CHUNK_SIZES', 'DV_TILES', 'MAX_ACC_FLOATS',
    'POLICY_TOLERANCES', 'PRECISIONS', 'RECURRENT_BELOW', 'SIMDGROUPS', 'SPEC',
    'THREADGROUP_MEMORY', 'ChannelWalks', 'Config', 'KernelSpec', 'Launch', 'MLXLauncher',
    'Metal', 'Plan', 'SimLauncher', 'accumulator_floats', 'adapt', 'build_launch_plan',
    'channel_input_metas', 'channel_plan', 'chunks_call', 'compile_plan', 'default_config',
    'default_launcher', 'dense_call', 'from_numpy', 'fused_kernels', 'fused_key',
    'gated_delta', 'intra_tile', 'kernels_used', 'launch_plan', 'lower_check',
    'max_threadgroup_bytes', 'packed_call', 'packed_gated_delta', 'packed_launch_plan',
    'params_valid', 'plan_input_metas', 'problem_of_inputs', 'recurrent_forward',
    'recurrent_input_metas', 'recurrent_plan', 'recurrent_steps_forward', 'render_fused',
    'render_fused_kernels', 'render_packed', 'render_plan', 'render_steps', 'simulate',
    'steps_call', 'steps_plan', 'supports', 'threadgroup_bytes', 'to_numpy', 'variant_space',
]



@dataclass(frozen=True)
class ChannelWalks:
    """The chunk walks of `gdngen.algebra.chunkwise_channel` on the Metal walk kernels of
    ``variant`` (`channel_plan`), run by ``launcher``: ``forward`` has
    `chunkwise_channel.walk_forward`'s contract, ``backward`` `walk_backward`'s (mx arrays in chunk
    layout; float32 inside). The intra-chunk stages (factors, decayed products, WY, the backward's
    adjoints and straddle sums) stay `gdngen.algebra.chunkwise_channel`'s shared mx code; fusing
    them into kernels is a later step. Injected states (packed rows) are not taken: per-channel
    packed rows run the portable walk. Hashable, so
    `gdngen.backends.portable.mlx_chunkwise.chunk_core` caches one core per walks."""

    variant: Variant
    problem: Problem
    launcher: object
    templates: object = None

    def _plan(self, N: int, B: int) -> Plan:
        return channel_plan(self.variant, self.problem, N, B, self.templates)

    def _launch(self, plan: Plan, launches, env: dict) -> dict:
        import mlx.core as mx

        env = {n: x.astype(mx.float32) for n, x in env.items()}
        if hasattr(self.launcher, "prepare"):
            self.launcher.prepare(plan, env)
        return _run(plan, launches, env, self.launcher)

    def forward(self, xp, S0, U, Wk, Kc, Qd, Pm, dCC, inject=None):
        """``(Y, S_final, S_in, W)``: one launch of fwd_scan_channel (shapes as
        `gdngen.algebra.chunkwise_channel.walk_forward`)."""
        refuse_injection(BACKEND, inject)
        N, B = int(U.shape[0]), int(U.shape[1])
        plan = self._plan(N, B)
        env = self._launch(plan, plan.forward, {"s0": S0, "u": U, "wk": Wk, "kc": Kc, "qd": Qd,
                                                "pm": Pm, "dccv": dCC})
        return (env["y_out"].reshape(U.shape), env["final_state"].reshape(S0.shape),
                env["states"].reshape((N,) + tuple(S0.shape)), env["w_out"].reshape(U.shape))

    def backward(self, xp, dS_final, G, Kc, Wk, W, S_in, dY, Qd, dCC, dS_in=None):
        """``(dS0, dW, dWk, dQd, dKc, ddCC, None)``: one launch of bwd_scan_channel (shapes as
        `gdngen.algebra.chunkwise_channel.walk_backward`); the Dk-wide products come back one part
        per Dv tile and are summed here."""
        refuse_injection(BACKEND, dS_in)
        N, B = int(W.shape[0]), int(W.shape[1])
        plan = self._plan(N, B)
        env = self._launch(plan, plan.backward, {
            "dsf": dS_final, "ptdy": G, "kc": Kc, "wk": Wk, "w": W, "states": S_in, "dy": dY,
            "qd": Qd, "dccv": dCC})

        def summed(name, like):
            return env[name].sum(axis=0).reshape(like.shape)

        return (env["ds0"].reshape(dS_final.shape), env["dw"].reshape(W.shape),
                summed("dwk", Wk), summed("dqd", Qd), summed("dkc", Kc), summed("ddcc", dCC),
                None)


@functools.cache
def default_launcher():
    """MLX on a Metal GPU, the simulator otherwise (one shared instance)."""
    import mlx.core as mx

    return MLXLauncher() if mx.metal.is_available() else SimLauncher()


def _run(plan: Plan, launches, env: dict, launcher) -> dict:
    for launch in launches:
        outs = launcher(plan, launch, [env[n] for n in launch.inputs])
        env.update(zip(launch.outputs, outs))
    return env


def _input_grads(env: dict, primals, gate: str) -> tuple:
    """``(dq, dk, dv, dgates, dbeta)`` in the primals' chunk layout from a backward's
    environment: dq / dk summed over the r value heads of each key head, the gate cotangent
    the O(C^2) epilogue (`gdngen.algebra.chunkwise.decay_factors_log_vjp` or its linear twin)
    on ``dd``."""
    from gdngen.algebra import chunkwise
    from gdngen.backends.portable.mlx_chunkwise import XP

    q, k, v, gates, beta = primals[:5]
    N, B, Hk, r, C = v.shape[:5]
    Dk = q.shape[-1]
    dq = env["dq"].reshape(N, B, Hk, r, C, Dk).sum(axis=3).reshape(q.shape)
    dk = env["dk"].reshape(N, B, Hk, r, C, Dk).sum(axis=3).reshape(k.shape)
    dv = env["dv"].reshape(v.shape)
    dbeta = env["dbeta"].reshape(beta.shape)
    dD = env["dd"].reshape(gates.shape[:-1] + (C + 1, C + 1))
    if gate == "log":
        D = chunkwise.decay_factors(XP, gates)
        dgates = chunkwise.decay_factors_log_vjp(XP, gates, D, dD)
    else:
        D = chunkwise.decay_factors(XP, XP.log(gates))
        dgates = chunkwise.decay_factors_linear_vjp(XP, gates, D, dD)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), dgates, dbeta


@functools.lru_cache(maxsize=128)
def _core(variant: Variant, problem: Problem, gate, scale: float, launcher,
          templates=None, qk_norm=False):
    """``mx.custom_function`` over chunk-layout arrays (as `gdngen.algebra.chunkwise.gated_delta`
    passes them) -> (Y, S_final, *saved), with the Metal backward as its VJP. ``templates``:
    a template override folder (default: ``GDNGEN_TEMPLATES`` when the plan is made).

    Fused layer inputs (`gdngen.backends.kernel_inputs`): ``qk_norm``: q, k are raw;
    ``gate`` a `gdngen.algebra.chunkwise.ParameterGate`: ``gates`` is ``(a, A_log, dt_bias)`` (the
    parameters ``[Hk, r, 1]``). The forward hands them to the fused build of its two kernels
    (`launch_plan` with ``inputs``, `render_fused`), which normalise each loaded q, k row in
    float32 and form the log gate from ``a`` before the in-chunk cumulative sums: no normalised
    q, k and no log gate exist as arrays. The VJP recomputes them as mx ops (the normalised
    q, k in float32, back in their dtype: `gdngen.backends.generated.l2_normalized`; the log
    gate: `gdngen.algebra.chunkwise.log_gates`) for the plain backward kernels, and maps the
    kernels' dq, dk through the norm's VJP and the log gate's cotangent to the three arrays
    (`gdngen.algebra.chunkwise.gates_vjp`)."""
    import mlx.core as mx

    from gdngen.algebra import chunkwise
    from gdngen.backends.portable.mlx_chunkwise import XP

    parameter_gate, gate = gate, chunkwise.convention(gate)  # the kernels' gate convention

    def normalized(x):
        return l2_normalized(XP, x) if qk_norm else x

    def raw_cotangent(x, dx):
        return l2_normalized_vjp(XP, x, dx) if qk_norm else dx

    prm = mx.array([scale, 1.0 if gate == "linear" else 0.0], mx.float32)
    inputs = KernelInputs.of(qk_norm, parameter_gate)
    # the fused forward's: prm[2] the lower bound (sigmoid_bound; 0 otherwise)
    prm_fused = mx.array([scale, 1.0 if gate == "linear" else 0.0, inputs.lower_bound],
                         mx.float32)

    def plan_for(v):
        N, B = int(v.shape[0]), int(v.shape[1])
        if templates is None:
            return launch_plan(variant, problem, N, B, inputs)
        return build_launch_plan(adapt(variant, problem), problem, N, B, templates, False,
                            fused_key(inputs))

    def forward_inputs(q, k, gates):
        """The fused forward's q, k and gate operands: raw (the kernels compute the rest)."""
        if not inputs.fused:
            return {"q": q, "k": k, "g": gates}
        env = {"q": q, "k": k, "prm": prm_fused}
        if inputs.gate_form is None:
            env["g"] = gates
        else:
            a, A_log, dt_bias = gates
            env["a"] = a
            env["A_log"], env["dt_bias"] = kernel_parameters(mx, A_log, dt_bias, problem.Hv,
                                                             problem.Dk, False)
        return env

    # Chunk layout (gdngen.algebra.chunkwise.to_chunks): v [N, B, Hk, r, C, Dv], gates / beta
    # [N, B, Hk, r, C]; q and k hold N, B, Hk, C, Dk in that order (with or without a unit r
    # axis): the kernels only need their memory order.
    @mx.custom_function
    def core(q, k, v, gates, beta, s0):
        plan = plan_for(v)
        env = {"v": v, "beta": beta, "s0": s0, "prm": prm, **forward_inputs(q, k, gates)}
        if hasattr(launcher, "prepare"):
            launcher.prepare(plan, env)
        env = _run(plan, plan.forward, env, launcher)
        Y = env["y_out"].reshape(v.shape)
        S = env["final_state"].reshape(s0.shape)
        return (Y, S) + tuple(env[n] for n in plan.saved)

    @core.vjp
    def core_vjp(primals, cotangents, outputs):
        q, k, v, parameters, beta, s0 = primals
        gates = chunkwise.log_gates(XP, parameters, parameter_gate)[0]
        plan = plan_for(v)
        N, B, Hk, r, C, Dv = v.shape
        Dk = q.shape[-1]
        Hv = Hk * r
        dY = cotangents[0]
        dY = mx.zeros(outputs[0].shape, q.dtype) if dY is None else dY.astype(q.dtype)
        dS = cotangents[1]
        dS = mx.zeros(s0.shape, mx.float32) if dS is None else dS.astype(mx.float32)
        env = {"q": normalized(q), "k": normalized(k), "v": v, "g": gates, "beta": beta,
               "s0": s0, "prm": prm, "dy": dY.reshape(N, B, Hv, C, Dv),
               "dsf": dS.reshape(B, Hv, Dv, Dk)}
        env.update(zip(plan.saved, outputs[2:]))
        env = _run(plan, plan.backward, env, launcher)
        dq, dk, dv, dgates, dbeta = _input_grads(env, (q, k, v, gates, beta), gate)
        return (raw_cotangent(q, dq), raw_cotangent(k, dk), dv,
                chunkwise.gates_vjp(XP, parameters, parameter_gate, dgates), dbeta,
                env["ds0"].reshape(s0.shape))

    return core


@functools.lru_cache(maxsize=128)
def _packed_core(variant: Variant, problem: Problem, gate: str, launcher, templates):
    """The packed kernels' chunk walk (`packed_launch_plan`) as an ``mx.custom_function``
    ``(q, k, v, gates, beta, inject) -> (Y, S_in, *saved)``: the `gdngen.algebra.packed.chunk_walk`
    contract (`gdngen.algebra.chunkwise.forward` with ``inject``, from a zero state).

    Chunk layout (`gdngen.algebra.chunkwise.to_chunks`): q, k ``[N, 1, Hk, C, Dk]`` with q already
    scaled (the kernels run with scale 1), v ``[N, 1, Hk, r, C, Dv]``, gates / beta ``[N, 1,
    Hk, r, C]``, ``inject [N, 1, Hk, r, Dv, Dk]`` float32 added to the state leaving chunk n;
    Y like v, ``S_in`` like inject, the states entering the chunks. The VJP (the packed
    backward: ``dS_in`` enters at each chunk's entry) returns ``dinject`` = the cotangent of
    the state leaving each chunk, zero for the last (the walk's final state is not an
    output)."""
    import mlx.core as mx

    f32 = mx.float32
    prm = mx.array([1.0, 1.0 if gate == "linear" else 0.0], f32)

    def plan_for(v):
        return packed_launch_plan(variant, problem, int(v.shape[0]), int(v.shape[1]),
                                  templates)

    def state_shape(v, q):
        return (int(v.shape[1]), problem.Hv, int(v.shape[-1]), int(q.shape[-1]))

    @mx.custom_function
    def core(q, k, v, gates, beta, inject):
        plan = plan_for(v)
        env = {"q": q, "k": k, "v": v, "g": gates, "beta": beta,
               "s0": mx.zeros(state_shape(v, q), f32), "inject": inject.astype(f32), "prm": prm}
        if hasattr(launcher, "prepare"):
            launcher.prepare(plan, env)
        env = _run(plan, plan.forward, env, launcher)
        return (env["y_out"].reshape(v.shape), env["states"].reshape(inject.shape)) + \
            tuple(env[n] for n in plan.saved)

    @core.vjp
    def core_vjp(primals, cotangents, outputs):
        q, k, v, gates, beta, inject = primals
        plan = plan_for(v)
        N, B, Hk, r, C, Dv = v.shape
        dY, dS_in = cotangents[0], cotangents[1]
        dY = mx.zeros(v.shape, q.dtype) if dY is None else dY.astype(q.dtype)
        dS_in = mx.zeros(inject.shape, f32) if dS_in is None else dS_in.astype(f32)
        states = (N, B, Hk * r) + tuple(inject.shape[-2:])
        env = {"q": q, "k": k, "v": v, "g": gates, "beta": beta,
               "s0": mx.zeros(state_shape(v, q), f32), "inject": inject.astype(f32),
               "prm": prm, "dy": dY.reshape(N, B, Hk * r, C, Dv),
               "dsf": mx.zeros(state_shape(v, q), f32), "dsin": dS_in.reshape(states)}
        if plan.saved:
            env["states"] = outputs[1].reshape(states)
            env.update(zip(plan.saved, outputs[2:]))
        env = _run(plan, plan.backward, env, launcher)
        return _input_grads(env, primals, gate) + (env["dsout"].reshape(inject.shape),)

    return core


def recurrent_forward(q, k, v, decay, beta, S0, *, scale, variant, problem=None, launcher=None,
                      templates_dir=None, qk_norm=False, gate=None):
    """The recurrent kernel (``templates/metal/recurrent.metal.j2``): the forward of the gated
    delta rule one step at a time, for short calls (decode / short prefill).

    Contract: float32 mx arrays q, k ``[B,T,Hk,Dk]``; v ``[B,T,Hv,Dv]``; ``decay`` the LINEAR
    decay in [0, 1], ``[B,T,Hv]`` (scalar gate) or ``[B,T,Hv,Dk]`` (per-channel gate; the caller
    takes exp of log gates, exact 0 at log g = -inf); beta ``[B,T,Hv]``; S0 ``[B,Hv,Dv,Dk]``.
    Masked steps must already be folded in (decay 1, beta 0: `gdngen.algebra.chunkwise.fold_mask`).
    Returns ``(y [B,T,Hv,Dv], S_T [B,Hv,Dv,Dk])``, float32; value head h reads key head
    h // (Hv / Hk); y = scale * S_t q_t. Per step (`gdngen.algebra.chunkwise.recurrent_forward`):
    ``u = beta (v - S (a k))``, ``y = S (a q) + u (k.q)``, ``S <- S diag(a) + u k^T``.

    One launch (`recurrent_plan`): a threadgroup per (batch, value head, block of ``dv_tile``
    state rows), ``simdgroups`` simdgroups of 32 lanes, each lane holding Dk / 32 columns of
    its simdgroup's ``dv_tile / simdgroups`` rows in registers for the whole walk over T (a
    runtime size); the dot products are ``simd_sum``s. Nothing is saved for a backward (no
    VJP here: `gated_delta` differentiates the chunk path instead). Rendered, compiled and
    cached like the chunk kernels (kernel named by its source hash); ``problem`` (default: from
    the shapes, the gate kind from decay's rank) specialises the source, ``variant`` gives
    ``dv_tile`` / ``simdgroups``. Outputs are poisoned as the chunk kernels': always in the
    simulator (unwritten elements fail the launch), NaN-initialised on a GPU under
    ``GDNGEN_POISON_OUTPUTS=1``. ``launcher``: `MLXLauncher` / `SimLauncher` (default
    `default_launcher`); ``templates_dir``: a template override folder.

    Fused layer inputs (`render_fused`, `gdngen.backends.kernel_inputs`), computed by the kernel
    in its loads: ``qk_norm`` True: q, k are raw; each loaded row is L2-normalised in float32
    (``x rsqrt(sum x^2 + 1e-6)``, the sum a ``simd_sum``), q then scaled. ``gate`` a
    `gdngen.algebra.chunkwise.ParameterGate`: ``decay`` is the tuple ``(a, A_log, dt_bias)``, ``a``
    the raw projection ``[B,T,Hv]`` / ``[B,T,Hv,Dk]`` (masked steps a = -inf), the parameters in any
    form `kernel_parameters` takes (``[Hv]``; per channel also ``[Hv,1]``, ``[Hv,Dk]``); the
    kernel forms log g per step (and channel) and the decay exp(log g), the lower bound a
    runtime scalar (one build serves every bound).
    """
    import mlx.core as mx

    from gdngen.algebra import chunkwise

    B, T, Hk, Dk = (int(n) for n in q.shape)
    Hv, Dv = int(v.shape[2]), int(v.shape[3])
    parameter_gate = isinstance(gate, chunkwise.ParameterGate)
    if gate is not None and not parameter_gate:
        raise ValueError(f"gate must be None or a chunkwise.ParameterGate, got {gate!r}")
    if parameter_gate != isinstance(decay, tuple) or (parameter_gate and len(decay) != 3):
        raise ValueError("decay must be the tuple (a, A_log, dt_bias) exactly when gate is a "
                         f"ParameterGate, got {type(decay).__name__} with gate={gate!r}")
    inputs = KernelInputs.of(qk_norm, gate)
    gate_kind = "vector" if chunkwise.raw_gates(decay).ndim == 4 else "scalar"
    if problem is None:
        problem = Problem(Hk, Hv, Dk, Dv, "float32", gate_kind)
    got = (problem.Hk, problem.Hv, problem.Dk, problem.Dv, problem.gate)
    if got != (Hk, Hv, Dk, Dv, gate_kind):
        raise ValueError(f"arrays have shape class Hk={Hk}, Hv={Hv}, Dk={Dk}, Dv={Dv}, gate "
                         f"{gate_kind}, expected {problem.key()}")
    launcher = default_launcher() if launcher is None else launcher
    plan = recurrent_plan(variant, problem, T, B, templates_dir, inputs)
    f32 = mx.float32
    env = {"q": q.astype(f32), "k": k.astype(f32), "v": v.astype(f32),
           "a": chunkwise.raw_gates(decay).astype(f32), "beta": beta.astype(f32),
           "s0": S0.astype(f32), "prm": mx.array([float(scale)], f32)}
    if inputs.fused:
        env["prm"] = mx.array([float(scale), inputs.lower_bound], f32)
    if parameter_gate:
        env["A_log"], env["dt_bias"] = kernel_parameters(mx, *decay[1:], Hv, Dk,
                                                         gate_kind == "vector")
    if hasattr(launcher, "prepare"):
        launcher.prepare(plan, env)
    env = _run(plan, plan.forward, env, launcher)
    return env["y_out"], env["final_state"]


def recurrent_steps_forward(q, k, v, decay, beta, S0, *, scale, variant, problem=None,
                            launcher=None, templates_dir=None):
    """`recurrent_forward` (plain inputs) on the per-step-states build (`render_steps`,
    `steps_plan`): ``(y [B,T,Hv,Dv], states [B,T,Hv,Dv,Dk])``, float32, the state after every
    step, each lane writing its columns of its rows as it walks."""
    import mlx.core as mx

    B, T, Hk, Dk = (int(n) for n in q.shape)
    Hv, Dv = int(v.shape[2]), int(v.shape[3])
    if problem is None:
        problem = Problem(Hk, Hv, Dk, Dv, "float32", "vector" if decay.ndim == 4 else "scalar")
    launcher = default_launcher() if launcher is None else launcher
    plan = steps_plan(variant, problem, T, B, templates_dir)
    f32 = mx.float32
    env = {"q": q.astype(f32), "k": k.astype(f32), "v": v.astype(f32), "a": decay.astype(f32),
           "beta": beta.astype(f32), "s0": S0.astype(f32), "prm": mx.array([float(scale)], f32)}
    if hasattr(launcher, "prepare"):
        launcher.prepare(plan, env)
    env = _run(plan, plan.forward, env, launcher)
    return env["y_out"], env["states"]


def steps_call(call, operands, variant, launcher=None):
    """A ``return_states="steps"`` `gdngen.call.Call` (layer inputs computed) on the
    `render_steps` kernel (`gdngen.backends.generated.kernel_steps`): ``(y in q's dtype, states
    [B,T,Hv,Dv,Dk] float32)``; its VJP is the portable MLX step loop's, run under ``mx.vjp``
    only."""
    from gdngen.backends import generated

    variant = adapt(variant, call.problem)
    launcher = default_launcher() if launcher is None else launcher

    def recurrent(q, k, v, decay, beta, S0):
        return recurrent_steps_forward(q, k, v, decay, beta, S0, scale=call.scale,
                                       variant=variant, problem=call.problem, launcher=launcher)

    return generated.kernel_steps(call, operands, recurrent)


def chunks_call(call, operands, variant, launcher=None):
    """A ``return_states="chunks"`` `gdngen.call.Call` (layer inputs computed) on the chunk
    kernels of ``variant`` (`gdngen.backends.generated.kernel_chunks`): the checkpoints are the
    per-chunk states the forward's scan writes (scalar gates: the ``save_states`` build's
    ``states``, the backward's residual; per-channel gates: the walk kernel's, `ChannelWalks`),
    read, not recomputed. Returns ``(y in q's dtype, states [B, ceil(T/N), Hv, Dv, Dk]
    float32)``; the VJP is the portable MLX chunk path's."""
    from gdngen.backends import generated

    variant = adapt(variant, call.problem)
    launcher = default_launcher() if launcher is None else launcher
    C = variant["chunk_size"]
    if call.shape.vector_gate:
        walks = ChannelWalks(variant, call.problem, launcher, settings.templates_override())
        chunk_forward = generated.walk_chunk_forward(call, C, walks.forward)
    else:
        saving = variant.replace(save_states=True)
        core = _core(saving, call.problem, "log", call.scale, launcher)

        def states_core(q, k, v, gates, beta, s0):
            Y, S, per_chunk = core(q, k, v, gates, beta, s0)[:3]  # per_chunk [N,B,Hv,Dv,Dk]
            return Y, S, per_chunk.reshape(v.shape[:4] + s0.shape[-2:])

        chunk_forward = generated.entering_forward(call, C, states_core, core_scales=True)
    return generated.kernel_chunks(call, operands, C, chunk_forward)


def _chunk_call(variant: Variant, problem: Problem, gate, scale: float, launcher,
                templates=None, qk_norm=False):
    """``f(q, k, v, g, beta, s0, mask=None) -> (y, S_final)`` on the chunk kernels at any T
    (API layout, inputs cast as `gated_delta` casts them; y in q's dtype); ``qk_norm``: q, k
    raw, ``gate`` a `gdngen.algebra.chunkwise.ParameterGate` (``g`` then ``(a, A_log, dt_bias)``):
    both computed by the fused forward kernels and recomputed for the backward (`_core`)."""
    from gdngen.algebra import chunkwise
    from gdngen.backends.portable.mlx_chunkwise import XP

    core = _core(variant, problem, gate, scale, launcher, templates, qk_norm)

    def core_outputs(*arrays):
        outs = core(*arrays)
        return outs[0], outs[1]

    def chunkwise_call(q, k, v, g, beta, s0, mask=None):
        # The scale is applied inside the kernels (in float32), so the layout glue runs with 1.
        y, state = chunkwise.gated_delta(XP, core_outputs, q, k, v, g, beta, s0, mask,
                                         scale=1.0, gate=gate, chunk_size=variant["chunk_size"])
        return y.astype(q.dtype), state

    return chunkwise_call


def gated_delta(q, k, v, g, beta, initial_state=None, *, mask=None, scale=1.0, gate="log",
                variant=None, launcher=None, qk_norm=False):
    """Run a Metal ``variant`` (differentiable, through ``mx.custom_function``).

    Shapes and semantics as `gdngen.mlx.gated_delta`; y has q's dtype, the final state is
    float32. k and v are cast to q's dtype, gates / beta / state to float32.
    ``launcher``: `MLXLauncher` (default on a Metal GPU) or `SimLauncher` (default elsewhere).

    Scalar gates with T >= the variant's ``recurrent_below``: the chunk kernels, forward and
    backward. T < recurrent_below: the forward is the recurrent kernel (`recurrent_forward`)
    and the VJP the chunk path's (`gdngen.backends.portable.mlx_chunkwise.recurrent_or_chunkwise`).
    Per-channel (vector) gates ``[B,T,Hv,Dk]``, likewise switched at recurrent_below: the chunk
    path is `gdngen.algebra.chunkwise_channel` at the variant's chunk (the mlx backend's
    ``mx.custom_function``, `gdngen.backends.portable.mlx_chunkwise.chunkwise_gated_delta`) with its
    two chunk walks on the walk kernels (`ChannelWalks`), forward and backward; its intra-chunk
    stages run in mx ops (float32).

    ``qk_norm``: q, k are raw (`BackendSpec.fused_inputs`); ``gate`` a
    `gdngen.algebra.chunkwise.ParameterGate`: ``g`` is ``(a, A_log, dt_bias)``
    (`gdngen.algebra.layer_inputs`). The kernels compute both in their loads (`render_fused`): the
    recurrent kernel (`recurrent_forward`'s fused build) and, scalar gates, the chunk forward's two
    kernels (`_core`), so no normalised q, k and no log gate are formed as arrays in a forward; the
    chunk VJP recomputes them as mx ops for the plain backward kernels (per-channel gates:
    `gdngen.backends.portable.mlx_chunkwise.chunk_core` computes them in its core, forward and VJP).
    """
    from gdngen import call as calls

    if variant is None or variant.backend != BACKEND:
        raise ValueError(f"variant must be a metal Variant, got {variant!r}")
    checked, operands = calls.of_kernel_args("mlx", q, k, v, g, beta, initial_state, mask,
                                             scale=scale, gate=gate, qk_norm=qk_norm)
    return SPEC.run(checked, operands, variant, launcher=launcher)


def dense_call(call, operands, variant, launcher=None):
    """`gated_delta`'s body on a checked dense `gdngen.call.Call`."""
    import mlx.core as mx

    from gdngen.algebra import chunkwise
    from gdngen.backends.portable import mlx_chunkwise
    from gdngen.backends.portable.mlx_chunkwise import XP

    shape, problem, gate, scale, qk_norm = (call.shape, call.problem, call.kernel_gate,
                                            call.scale, call.qk_norm)
    q, k, v, _, beta, initial_state, mask = operands[:7]
    g = operands.kernel_gates()
    variant = adapt(variant, problem)
    launcher = default_launcher() if launcher is None else launcher
    f32 = mx.float32
    if initial_state is None:
        initial_state = mx.zeros((shape.B, shape.Hv, shape.Dv, shape.Dk), f32)
    args = (q, k.astype(q.dtype), v.astype(q.dtype), chunkwise.cast_gates(g, f32),
            beta.astype(f32), initial_state.astype(f32))

    if shape.vector_gate:
        walks = ChannelWalks(variant, problem, launcher, settings.templates_override())

        def chunkwise_call(q, k, v, g, beta, s0, mask=None):
            y, state = mlx_chunkwise.chunkwise_gated_delta(
                q.astype(f32), k.astype(f32), v.astype(f32), g, beta, s0, mask, scale=scale,
                gate=gate, chunk_size=variant["chunk_size"], save_states=variant["save_states"],
                walks=(walks.forward, walks.backward), qk_norm=qk_norm)
            return y.astype(q.dtype), state
    else:
        chunkwise_call = _chunk_call(variant, problem, gate, scale, launcher, qk_norm=qk_norm)
    if SPEC.chunked(call, variant):
        return chunkwise_call(*args, mask)

    parameter_gate = gate if isinstance(gate, chunkwise.ParameterGate) else None

    def recurrent(q, k, v, g, beta, s0):
        # the kernel normalises q, k and forms a ParameterGate's decay in its loads
        decay = g if parameter_gate else chunkwise.linear_decay(XP, g, gate)  # exp(-inf) = 0
        y, state = recurrent_forward(q, k, v, decay, beta, s0, scale=scale, variant=variant,
                                     problem=problem, launcher=launcher, qk_norm=qk_norm,
                                     gate=parameter_gate)
        return y.astype(q.dtype), state

    g, beta = chunkwise.fold_mask(XP, args[3], args[4], mask, gate)
    y, state = mlx_chunkwise.recurrent_or_chunkwise(recurrent, chunkwise_call)(
        *args[:3], g, beta, args[5])
    if mask is not None:
        y = mx.where(mask[..., None, None], y, mx.zeros((), y.dtype))
    return y.astype(q.dtype), state


def packed_gated_delta(q, k, v, g, beta, initial_state=None, *, mask=None, scale=1.0,
                       gate="log", variant, cu_seqlens, launcher=None, templates_dir=None):
    """A packed row (`gdngen.algebra.packed`, fla's ``cu_seqlens``) on ``variant``'s kernels, scalar
    gates: the row's chunk walk on the packed build (`render_packed`, `_packed_core`: resets,
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
    from gdngen import call as calls

    if variant is None or variant.backend != BACKEND:
        raise ValueError(f"variant must be a metal Variant, got {variant!r}")
    checked, operands = calls.of_kernel_args("mlx", q, k, v, g, beta, initial_state, mask,
                                             scale=scale, gate=gate, cu_seqlens=cu_seqlens)
    return SPEC.run_packed_kernels(checked, operands, variant, launcher=launcher,
                                   templates_dir=templates_dir)


def packed_call(call, operands, variant, launcher=None, templates_dir=None):
    """`packed_gated_delta`'s body on a checked packed `gdngen.call.Call`."""
    import mlx.core as mx

    from gdngen.algebra import packed
    from gdngen.backends.portable.mlx_chunkwise import XP

    gate, scale = call.gate, call.scale
    q, k, v, g, beta, initial_state, mask, _, _, cu_seqlens = operands
    problem = call.replace(dtype="float32").problem
    variant = adapt(variant, problem)
    launcher = default_launcher() if launcher is None else launcher
    templates = settings.templates_override() if templates_dir is None else templates_dir
    chunk_call = _chunk_call(variant, problem, gate, scale, launcher, templates)
    walk_core = _packed_core(variant, problem, gate, launcher, templates)

    def dense(q, k, v, g, beta, S0, mask):
        y, S = chunk_call(q, k, v, g, beta, S0, mask)
        return mx.where(mask[..., None, None], y, mx.zeros((), y.dtype)), S

    walk = packed.chunk_walk(XP, lambda *a: walk_core(*a)[:2], scale=scale, gate=gate,
                             chunk_size=variant["chunk_size"])
    f32 = mx.float32
    y, state = packed.gated_delta(
        XP, dense, walk, *(x.astype(f32) for x in (q, k, v, g, beta)),
        None if initial_state is None else initial_state.astype(f32), mask, cu_seqlens,
        gate=gate, chunk_size=variant["chunk_size"])
    return y.astype(q.dtype), state


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


