"""The Metal backend's differentiable cores: the chunk kernels' forward with the backward
kernels as its VJP (`dense_core`, `packed_core`, as ``mx.custom_function`` over chunk-layout
arrays) and the per-channel ones (`channel_core`, `channel_walk_core`: the intra-chunk
kernels around the walks, `ChannelWalks`). Each core is cached per variant, problem, gate and
launcher."""

from __future__ import annotations

import functools
from dataclasses import dataclass

from gdngen.algebra import layer_inputs
from gdngen.backends.generated import (
    l2_normalized,
    l2_normalized_vjp,
    refuse_injection,
    walk_states,
)
from gdngen.backends.kernel_inputs import KernelInputs, kernel_parameters
from gdngen.backends.metal import launch
from gdngen.backends.metal.config import BACKEND, adapt
from gdngen.backends.metal.kernels import fused_key
from gdngen.backends.metal.plan import (
    Plan,
    build_launch_plan,
    channel_plan,
    launch_plan,
    packed_launch_plan,
)
from gdngen.problem import Problem
from gdngen.variant import Variant


@dataclass(frozen=True)
class ChannelWalks:
    """The chunk walks of `gdngen.algebra.chunkwise_channel` on the Metal walk kernels of
    ``variant`` (`channel_plan`), run by ``launcher``: ``forward`` has
    `chunkwise_channel.walk_forward`'s contract, ``backward`` `walk_backward`'s (mx arrays in chunk
    layout; float32 inside); ``intra`` and ``grads`` the intra-chunk stages' kernels
    (channel_intra, channel_grads: factors, decayed products, WY, the backward's adjoints and
    straddle sums) that `channel_core` runs around them. ``packed``: the packed build's walks
    (`render_packed`), which take ``inject`` / ``dS_in`` (zeros where None; a packed row's walk
    and its sequences' one-chunk calls); the dense build's refuse them. Hashable, so
    `gdngen.backends.portable.mlx_chunkwise.chunk_core` caches one core per walks."""

    variant: Variant
    problem: Problem
    launcher: object
    templates: object = None
    packed: bool = False

    def _plan(self, N: int, B: int) -> Plan:
        return channel_plan(self.variant, self.problem, N, B, self.templates, self.packed)

    def _states(self, states, like, state):
        """A packed walk's ``inject`` / ``dS_in`` (`walk_states`: zeros where None)."""
        import mlx.core as mx

        return walk_states(states, like, state, lambda shape: mx.zeros(shape, mx.float32))

    def _launch(self, plan: Plan, launches, env: dict) -> dict:
        import mlx.core as mx

        env = {n: x.astype(mx.float32) for n, x in env.items()}
        if hasattr(self.launcher, "prepare"):
            self.launcher.prepare(plan, env)
        return launch.run_launches(plan, launches, env, self.launcher)

    def forward(self, xp, S0, U, Wk, Kc, Qd, Pm, dCC, inject=None):
        """``(Y, S_final, S_in, W)``: one launch of fwd_scan_channel (shapes as
        `gdngen.algebra.chunkwise_channel.walk_forward`)."""
        if not self.packed:
            refuse_injection(BACKEND, inject)
        N, B = int(U.shape[0]), int(U.shape[1])
        plan = self._plan(N, B)
        inputs = {"s0": S0, "u": U, "wk": Wk, "kc": Kc, "qd": Qd, "pm": Pm, "dcc": dCC}
        if self.packed:
            inputs["inject"] = self._states(inject, U, S0)
        env = self._launch(plan, plan.forward, inputs)
        return (env["y_out"].reshape(U.shape), env["final_state"].reshape(S0.shape),
                env["states"].reshape((N,) + tuple(S0.shape)), env["w_out"].reshape(U.shape))

    def backward(self, dS_final, Pm, q, k, gates, Wk, W, S_in, dY, dS_in=None, *,
                 linear: bool):
        """``(dS0, dW, dWk, dQd, dKc, ddCC, dinject)``: channel_keys (Kc, Qd, dCC from q, k
        and the gates, chunk-parallel), then bwd_scan_channel, which forms G = Pm^T dY per
        chunk: `gdngen.algebra.chunkwise_channel.walk_backward` with those inputs formed in the
        kernels (chunk layout: Pm [N, B, Hk, r, C, C]; q (scaled), k [N, B, Hk, C, Dk];
        gates, Wk [N, B, Hk, r, C, Dk], linear where ``linear``; W, dY [.., C, Dv]; S_in [..,
        Dv, Dk]; ``dinject`` the packed walk's ``dsout`` where ``dS_in`` is given, else None).
        The Dk-wide products come back one part per Dv tile and are summed here."""
        if not self.packed:
            refuse_injection(BACKEND, dS_in)
        N, B = int(W.shape[0]), int(W.shape[1])
        plan = self._plan(N, B)
        inputs = {"dsf": dS_final, "pm": Pm, "q": q, "k": k, "g": gates, "prm": _stage_prm(linear),
                  "wk": Wk, "w": W, "states": S_in, "dy": dY}
        if self.packed:
            inputs["dsin"] = self._states(dS_in, W, dS_final)
        env = self._launch(plan, plan.backward, inputs)

        def summed(name, like):
            return env[name].sum(axis=0).reshape(like.shape)

        return (env["ds0"].reshape(dS_final.shape), env["dw"].reshape(W.shape),
                summed("dwk", Wk), summed("dqd", Wk), summed("dkc", Wk),
                env["ddcc"].sum(axis=0).reshape(Wk.shape[:4] + Wk.shape[-1:]),
                env["dsout"].reshape(S_in.shape) if self.packed and dS_in is not None else None)

    def intra(self, q, k, v, gates, beta, linear: bool):
        """``(U, Wk, Kc, Qd, Pm, Mkk, Tinv, dCC)``: one launch of channel_intra (chunk layout:
        q, k [N, B, Hk, C, Dk], q scaled; v, gates, beta [N, B, Hk, r, C, ...]; results shaped as
        `gdngen.algebra.chunkwise_channel.forward`'s). ``linear``: ``gates`` are linear."""
        plan = self._plan(int(v.shape[0]), int(v.shape[1]))
        env = self._launch(plan, plan.stages[:1], {
            "q": q, "k": k, "v": v, "g": gates, "beta": beta, "prm": _stage_prm(linear)})
        rows, square = gates.shape, v.shape[:-1] + (v.shape[-2],)
        return (env["u"].reshape(v.shape), env["wk"].reshape(rows), env["kc"].reshape(rows),
                env["qd"].reshape(rows), env["pm"].reshape(square), env["mkk"].reshape(square),
                env["tinv"].reshape(square), env["dcc"].reshape(rows[:-2] + rows[-1:]))

    def grads(self, q, k, v, gates, beta, W, Tinv, Mkk, dY, dW, dWk, dQd, dKc, ddCC,
              linear: bool):
        """``(dq, dk, dv, dgates, dbeta)``: one launch of channel_grads, the VJP of `intra`
        after the reverse walk (`gdngen.algebra.chunkwise_channel.backward_in_chunks`'
        contract; dq, dk summed over the value heads of each key head)."""
        plan = self._plan(int(v.shape[0]), int(v.shape[1]))
        env = self._launch(plan, plan.stages[1:], {
            "q": q, "k": k, "v": v, "g": gates, "beta": beta, "w": W, "tinv": Tinv, "mkk": Mkk,
            "dy": dY, "dw": dW, "dwk_sum": dWk, "dqd_sum": dQd, "dkc_sum": dKc, "ddcc_sum": ddCC,
            "prm": _stage_prm(linear)})
        rows = gates.shape
        dq, dk = (env[n].reshape(rows).sum(axis=3) for n in ("dq", "dk"))
        return (dq, dk, env["dv"].reshape(v.shape), env["dg"].reshape(rows),
                env["dbeta"].reshape(beta.shape))


def _stage_prm(linear: bool):
    """The intra-chunk kernels' ``prm``: (scale, linear gates): q comes in scaled."""
    import mlx.core as mx

    return mx.array([1.0, 1.0 if linear else 0.0], mx.float32)


@functools.lru_cache(maxsize=64)
def channel_core(variant: Variant, problem: Problem, gate, launcher, templates=None,
                 qk_scale=None, packed=False):
    """The per-channel chunk core on the Metal kernels: ``core(q, k, v, gates, beta, S0) ->
    (Y, S_final, *residuals)`` in the chunk layout of `gdngen.algebra.chunkwise_channel` (q
    scaled, or raw with ``qk_scale`` as `gdngen.backends.portable.mlx_chunkwise.chunk_core`'s,
    whose contract it has: ``gate`` a convention or a `gdngen.algebra.layer_inputs.ParameterGate`),
    an ``mx.custom_function``. Forward: channel_intra, then the walk (two launches). Backward:
    the reverse walk (channel_keys, bwd_scan_channel), then channel_grads.
    Residuals ``(S_in, W, Tinv, Wk, Pm, Mkk)`` (recomputed when the variant does not save
    states). ``packed``: on the packed build's walks (a packed row's one-chunk calls)."""
    import mlx.core as mx

    from gdngen.backends.portable.mlx_chunkwise import XP

    walks = ChannelWalks(variant, problem, launcher, templates, packed)
    save = variant["save_states"]

    @mx.custom_function
    def core(*primals):
        arrays, convention = layer_inputs.core_inputs(XP, primals, qk_scale, gate)
        Y, S_final, residuals = _channel_forward(walks, *arrays, convention)
        return (Y, S_final, *residuals) if save else (Y, S_final)

    @core.vjp
    def core_vjp(primals, cotangents, outputs):
        arrays, convention = layer_inputs.core_inputs(XP, primals, qk_scale, gate)
        q, k, v, gates, beta, _ = arrays
        residuals = (tuple(outputs[2:]) if save
                     else _channel_forward(walks, *arrays, convention)[2])
        grads = _channel_backward(walks, q, k, v, gates, beta, residuals, cotangents[0],
                                  cotangents[1], convention)
        return layer_inputs.core_inputs_vjp(XP, primals, grads[:6], qk_scale, gate)

    return core


def _channel_forward(walks, q, k, v, gates, beta, S0, convention, inject=None):
    """`gdngen.algebra.chunkwise_channel.forward` on the kernels: channel_intra, then the walk
    (``inject`` as the packed build's walk takes it). ``(Y, S_final, (S_in, W, Tinv, Wk, Pm,
    Mkk))``."""
    from gdngen.backends.portable.mlx_chunkwise import XP

    U, Wk, Kc, Qd, Pm, Mkk, Tinv, dCC = walks.intra(q, k, v, gates, beta,
                                                    convention == "linear")
    Y, S_final, S_in, W = walks.forward(XP, S0, U, Wk, Kc, Qd, Pm, dCC, inject)
    return Y, S_final, (S_in, W, Tinv, Wk, Pm, Mkk)


def _channel_backward(walks, q, k, v, gates, beta, residuals, dY, dS_final, convention,
                      dS_in=None):
    """`gdngen.algebra.chunkwise_channel.backward` on the kernels: the reverse walk (channel_keys
    and bwd_scan_channel: G = Pm^T dY and the walk's decayed Q, K formed in them), then
    channel_grads. ``(dq, dk, dv, dgates, dbeta, dS0, dinject)`` (``dinject`` None without
    ``dS_in``)."""
    S_in, W, Tinv, Wk, Pm, Mkk = residuals
    dS0, dW, dWk, dQd, dKc, ddCC, dinject = walks.backward(
        dS_final, Pm, q, k, gates, Wk, W, S_in, dY, dS_in, linear=convention == "linear")
    grads = walks.grads(q, k, v, gates, beta, W, Tinv, Mkk, dY, dW, dWk, dQd, dKc, ddCC,
                        convention == "linear")
    return (*grads, dS0, dinject)


@functools.lru_cache(maxsize=64)
def channel_walk_core(variant: Variant, problem: Problem, gate: str, launcher, templates=None):
    """``core(q, k, v, gates, beta, inject) -> (Y, S_in, *other residuals)``: the chunk walk of
    a packed row of per-channel gates (`gdngen.algebra.packed.chunk_walk`'s ``packed_core``;
    chunk layout, q scaled, gates in the convention ``gate``) as `channel_core` on the packed
    build's walks: from a zero state, ``inject`` added to the state leaving each chunk, the
    entering states S_in an output whose cotangent the reverse walk takes (``dS_in``), giving
    ``inject``'s."""
    import mlx.core as mx

    walks = ChannelWalks(variant, problem, launcher, templates, packed=True)
    save = variant["save_states"]

    def run(q, k, v, gates, beta, inject):
        Y, _, residuals = _channel_forward(walks, q, k, v, gates, beta,
                                           mx.zeros(inject.shape[1:]), gate, inject)
        return Y, residuals

    @mx.custom_function
    def core(q, k, v, gates, beta, inject):
        Y, residuals = run(q, k, v, gates, beta, inject)
        return (Y, *residuals) if save else (Y, residuals[0])

    @core.vjp
    def core_vjp(primals, cotangents, outputs):
        q, k, v, gates, beta, inject = primals
        residuals = tuple(outputs[1:]) if save else run(*primals)[1]
        dq, dk, dv, dgates, dbeta, _, dinject = _channel_backward(
            walks, q, k, v, gates, beta, residuals, cotangents[0],
            mx.zeros(inject.shape[1:]), gate, dS_in=cotangents[1])
        return dq, dk, dv, dgates, dbeta, dinject

    return core


def channel_chunkwise(q, k, v, g, beta, initial_state, mask, *, variant: Variant,
                      problem: Problem, scale: float, gate, launcher, templates=None,
                      qk_norm=False):
    """`gdngen.backends.portable.mlx_chunkwise.chunkwise_gated_delta`'s contract (float32
    arrays in the API layout, per-channel gates) on `channel_core`: ``(y, S_final)``."""
    from gdngen.algebra import chunkwise
    from gdngen.backends.portable.mlx_chunkwise import XP

    core = channel_core(variant, problem, gate, launcher, templates,
                        float(scale) if qk_norm else None)

    def core_outputs(*arrays):
        Y, S_final, *_ = core(*arrays)
        return Y, S_final

    return chunkwise.whole_sequence(XP, core_outputs, q, k, v, g, beta, initial_state, mask,
                                    scale=1.0 if qk_norm else scale, gate=gate,
                                    chunk_size=variant["chunk_size"])


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
def dense_core(variant: Variant, problem: Problem, gate, scale: float, launcher,
          templates=None, qk_norm=False):
    """``mx.custom_function`` over chunk-layout arrays (as `gdngen.algebra.chunkwise.whole_sequence`
    passes them) -> ``(Y, S_final, *saved)``, the Metal backward kernels as its VJP. ``templates``:
    a template override folder (default ``GDNGEN_TEMPLATES`` when the plan is made).

    ``qk_norm`` (q, k raw) / ``gate`` a `gdngen.algebra.layer_inputs.ParameterGate` (``gates`` is
    ``(a, A_log, dt_bias)``, parameters ``[Hk, r, 1]``): the forward runs the fused build
    (`render_fused`); the VJP recomputes normalised q, k (`gdngen.backends.generated.l2_normalized`)
    and log g (`gdngen.algebra.layer_inputs.log_gates`) for the plain backward and maps the
    cotangents
    back (`gdngen.algebra.layer_inputs.gates_vjp`)."""
    import mlx.core as mx

    from gdngen.backends.portable.mlx_chunkwise import XP

    parameter_gate, gate = gate, layer_inputs.convention(gate)  # the kernels' gate convention

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
        env = launch.run_launches(plan, plan.forward, env, launcher)
        Y = env["y_out"].reshape(v.shape)
        S = env["final_state"].reshape(s0.shape)
        return (Y, S) + tuple(env[n] for n in plan.saved)

    @core.vjp
    def core_vjp(primals, cotangents, outputs):
        q, k, v, parameters, beta, s0 = primals
        gates = layer_inputs.log_gates(XP, parameters, parameter_gate)[0]
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
        env = launch.run_launches(plan, plan.backward, env, launcher)
        dq, dk, dv, dgates, dbeta = _input_grads(env, (q, k, v, gates, beta), gate)
        return (raw_cotangent(q, dq), raw_cotangent(k, dk), dv,
                layer_inputs.gates_vjp(XP, parameters, parameter_gate, dgates), dbeta,
                env["ds0"].reshape(s0.shape))

    return core


@functools.lru_cache(maxsize=128)
def packed_core(variant: Variant, problem: Problem, gate: str, launcher, templates):
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
        env = launch.run_launches(plan, plan.forward, env, launcher)
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
        env = launch.run_launches(plan, plan.backward, env, launcher)
        return _input_grads(env, primals, gate) + (env["dsout"].reshape(inject.shape),)

    return core
