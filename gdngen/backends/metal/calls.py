"""The Metal backend's calls: the recurrent kernel (`recurrent_forward`, per-step states
`recurrent_steps_forward`) and the bodies of the backend's hooks on a checked
`gdngen.call.Call`: `dense_call` (the recurrent switch), `packed_call`, `steps_call`,
`chunks_call`. The launcher defaults to `gdngen.backends.metal.launch.default_launcher`, read
when called."""

from __future__ import annotations

from gdngen import settings
from gdngen.algebra import layer_inputs
from gdngen.backends.kernel_inputs import KernelInputs, kernel_parameters
from gdngen.backends.metal import launch
from gdngen.backends.metal.config import adapt
from gdngen.backends.metal.plan import recurrent_plan, steps_plan
from gdngen.backends.metal.vjp import (
    ChannelWalks,
    channel_chunkwise,
    channel_core,
    channel_walk_core,
    dense_core,
    packed_core,
)
from gdngen.problem import Problem
from gdngen.variant import Variant


def recurrent_forward(q, k, v, decay, beta, S0, *, scale, variant, problem=None, launcher=None,
                      templates_dir=None, qk_norm=False, gate=None, conv=None, norm_gate=None,
                      norm=None):
    """The recurrent kernel (``recurrent.metal.j2``, `recurrent_plan`): the forward one step at a
    time, for short calls (decode / short prefill); no VJP (`gated_delta` differentiates the chunk
    path).

    float32 mx arrays q, k ``[B,T,Hk,Dk]``, v ``[B,T,Hv,Dv]``, ``decay`` the LINEAR decay in [0, 1]
    ``[B,T,Hv]`` (scalar gate) or ``[B,T,Hv,Dk]`` (per channel), beta ``[B,T,Hv]``, S0
    ``[B,Hv,Dv,Dk]``, masked steps folded in (`gdngen.algebra.layer_inputs.fold_mask`). Returns ``(y
    [B,T,Hv,Dv], S_T [B,Hv,Dv,Dk])`` float32; value head h reads key head h // (Hv / Hk); per
    step (`gdngen.algebra.recurrent.recurrent_forward`) ``u = beta (v - S (a k))``,
    ``y = S (a q) + u (k.q)``, ``S <- S diag(a) + u k^T``, y scaled by ``scale``. ``problem``
    defaults from the shapes; ``launcher`` to `gdngen.backends.metal.launch.default_launcher`;
    ``templates_dir``: a template override folder.

    Fused inputs (`render_fused`): ``qk_norm``: q, k raw, normalised in the kernel's loads; ``gate``
    a `gdngen.algebra.layer_inputs.ParameterGate`: ``decay`` is ``(a, A_log, dt_bias)`` (parameters
    in
    any form `kernel_parameters` takes), log g and the decay formed per step in the kernel.
    ``conv``: ``(conv_weight [C, K], conv_state [B, C, K-1] or None)`` (C = 2 Hk Dk + Hv Dv,
    the mixer's layout): q, k, v are raw, each element convolved + SiLU in the kernel's loads
    (`gdngen.algebra.mixer.conv`), before the norm. ``norm_gate`` (the activation) with ``norm
    = (z [B,T,Hv,Dv], norm_weight [Dv], norm_eps)``: the norm build, whose y is the output's
    gated RMSNorm (its threadgroups each hold a head's every row, whatever the dv_tile)."""
    import mlx.core as mx


    B, T, Hk, Dk = (int(n) for n in q.shape)
    Hv, Dv = int(v.shape[2]), int(v.shape[3])
    parameter_gate = isinstance(gate, layer_inputs.ParameterGate)
    if gate is not None and not parameter_gate:
        raise ValueError(f"gate must be None or a layer_inputs.ParameterGate, got {gate!r}")
    if parameter_gate != isinstance(decay, tuple) or (parameter_gate and len(decay) != 3):
        raise ValueError("decay must be the tuple (a, A_log, dt_bias) exactly when gate is a "
                         f"ParameterGate, got {type(decay).__name__} with gate={gate!r}")
    if (norm_gate is None) != (norm is None):
        raise ValueError(f"norm (z, norm_weight, norm_eps) goes with norm_gate, got "
                         f"{'None' if norm is None else 'arrays'} for norm_gate={norm_gate!r}")
    inputs = KernelInputs.of(qk_norm, gate, conv is not None, norm_gate)
    gate_kind = "vector" if layer_inputs.raw_gates(decay).ndim == 4 else "scalar"
    if problem is None:
        problem = Problem(Hk, Hv, Dk, Dv, "float32", gate_kind)
    got = (problem.Hk, problem.Hv, problem.Dk, problem.Dv, problem.gate)
    if got != (Hk, Hv, Dk, Dv, gate_kind):
        raise ValueError(f"arrays have shape class Hk={Hk}, Hv={Hv}, Dk={Dk}, Dv={Dv}, gate "
                         f"{gate_kind}, expected {problem.key()}")
    launcher = launch.default_launcher() if launcher is None else launcher
    plan = recurrent_plan(variant, problem, T, B, templates_dir, inputs)
    f32 = mx.float32
    env = {"q": q.astype(f32), "k": k.astype(f32), "v": v.astype(f32),
           "a": layer_inputs.raw_gates(decay).astype(f32), "beta": beta.astype(f32),
           "s0": S0.astype(f32), "prm": mx.array([float(scale)], f32)}
    if inputs.fused:
        env["prm"] = mx.array([float(scale), inputs.lower_bound]
                              + ([float(norm[2])] if norm is not None else []), f32)
    if parameter_gate:
        env["A_log"], env["dt_bias"] = kernel_parameters(mx, *decay[1:], Hv, Dk,
                                                         gate_kind == "vector")
    if conv is not None:
        env["conv_w"], env["conv_s"] = _conv_operands(conv, B, 2 * Hk * Dk + Hv * Dv)
    if norm is not None:
        env["z"], env["norm_w"] = norm[0].astype(f32), norm[1].astype(f32)
    if hasattr(launcher, "prepare"):
        launcher.prepare(plan, env)
    env = launch.run_launches(plan, plan.forward, env, launcher)
    return env["y_out"], env["final_state"]


def _conv_operands(conv, B: int, channels: int):
    """``(conv_w [C, K], conv_s [B, C, K-1])`` float32 as the recurrent kernel takes them from
    ``conv = (weight, state or None)``: a None state is zeros (the window before the row), and
    K = 1's empty state one zero (never read) so that no buffer is empty."""
    import mlx.core as mx

    weight, state = conv
    if getattr(weight, "ndim", None) != 2 or int(weight.shape[0]) != channels:
        raise ValueError(f"conv weight must be [C, K] with C = 2 Hk Dk + Hv Dv = {channels}, got "
                         f"shape {tuple(getattr(weight, 'shape', ()))}")
    K = int(weight.shape[1])
    if K == 1:
        state = mx.zeros((1,), mx.float32)
    elif state is None:
        state = mx.zeros((B, channels, K - 1), mx.float32)
    elif tuple(state.shape) != (B, channels, K - 1):
        raise ValueError(f"conv state must be [B, C, K-1] = {(B, channels, K - 1)}, got shape "
                         f"{tuple(state.shape)}")
    return weight.astype(mx.float32), state.astype(mx.float32)


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
    launcher = launch.default_launcher() if launcher is None else launcher
    plan = steps_plan(variant, problem, T, B, templates_dir)
    f32 = mx.float32
    env = {"q": q.astype(f32), "k": k.astype(f32), "v": v.astype(f32), "a": decay.astype(f32),
           "beta": beta.astype(f32), "s0": S0.astype(f32), "prm": mx.array([float(scale)], f32)}
    if hasattr(launcher, "prepare"):
        launcher.prepare(plan, env)
    env = launch.run_launches(plan, plan.forward, env, launcher)
    return env["y_out"], env["states"]


def steps_call(call, operands, variant, launcher=None):
    """A ``return_states="steps"`` `gdngen.call.Call` (layer inputs computed) on the
    `render_steps` kernel (`gdngen.backends.generated.kernel_steps`): ``(y in q's dtype, states
    [B,T,Hv,Dv,Dk] float32)``; its VJP is the portable MLX step loop's, run under ``mx.vjp``
    only."""
    from gdngen.backends import generated

    variant = adapt(variant, call.problem)
    launcher = launch.default_launcher() if launcher is None else launcher

    def recurrent(q, k, v, decay, beta, S0):
        return recurrent_steps_forward(q, k, v, decay, beta, S0, scale=call.scale,
                                       variant=variant, problem=call.problem, launcher=launcher)

    return generated.kernel_steps(call, operands, recurrent)


def chunks_call(call, operands, variant, launcher=None):
    """A ``return_states="chunks"`` `gdngen.call.Call` (layer inputs computed) on the chunk
    kernels of ``variant`` (`gdngen.backends.generated.kernel_chunks`): the checkpoints are the
    per-chunk states the forward's scan writes (scalar gates: the ``save_states`` build's
    ``states``, the backward's residual; per-channel gates: the walk kernel's after
    channel_intra, `ChannelWalks`),
    read, not recomputed. Returns ``(y in q's dtype, states [B, ceil(T/N), Hv, Dv, Dk]
    float32)``; the VJP is the portable MLX chunk path's."""
    from gdngen.backends import generated

    variant = adapt(variant, call.problem)
    launcher = launch.default_launcher() if launcher is None else launcher
    C = variant["chunk_size"]
    if call.shape.vector_gate:
        walks = ChannelWalks(variant, call.problem, launcher, settings.templates_override())

        def intra(q, k, v, log_g, beta):  # q scaled before it
            return walks.intra(q, k, v, log_g, beta, linear=False)

        chunk_forward = generated.walk_chunk_forward(call, C, walks.forward, intra=intra)
    else:
        saving = variant.replace(save_states=True)
        core = dense_core(saving, call.problem, "log", call.scale, launcher)

        def states_core(q, k, v, gates, beta, s0):
            Y, S, per_chunk = core(q, k, v, gates, beta, s0)[:3]  # per_chunk [N,B,Hv,Dv,Dk]
            return Y, S, per_chunk.reshape(v.shape[:4] + s0.shape[-2:])

        chunk_forward = generated.entering_forward(call, C, states_core, core_scales=True)
    return generated.kernel_chunks(call, operands, C, chunk_forward)


def _chunk_call(variant: Variant, problem: Problem, gate, scale: float, launcher,
                templates=None, qk_norm=False):
    """``f(q, k, v, g, beta, s0, mask=None) -> (y, S_final)`` on the chunk kernels at any T
    (API layout, inputs cast as `gated_delta` casts them; y in q's dtype); ``qk_norm``: q, k
    raw, ``gate`` a `gdngen.algebra.layer_inputs.ParameterGate` (``g`` then ``(a, A_log,
    dt_bias)``):
    both computed by the fused forward kernels and recomputed for the backward (`dense_core`)."""
    from gdngen.algebra import chunkwise
    from gdngen.backends.portable.mlx_chunkwise import XP

    core = dense_core(variant, problem, gate, scale, launcher, templates, qk_norm)

    def core_outputs(*arrays):
        outs = core(*arrays)
        return outs[0], outs[1]

    def chunkwise_call(q, k, v, g, beta, s0, mask=None):
        # The scale is applied inside the kernels (in float32), so the layout glue runs with 1.
        y, state = chunkwise.whole_sequence(XP, core_outputs, q, k, v, g, beta, s0, mask,
                                         scale=1.0, gate=gate, chunk_size=variant["chunk_size"])
        return y.astype(q.dtype), state

    return chunkwise_call


def dense_call(call, operands, variant, launcher=None, *, chunked: bool,
               norm_build: bool = False):
    """`gated_delta`'s body on a checked dense `gdngen.call.Call`: ``(y in q's dtype,
    final_state float32)``. ``chunked``: the recurrent switch for this call
    (`gdngen.backend.Backend.chunked`): the chunk kernels, else the recurrent kernel forward.
    A conv call (``call.conv_size``, raw q, k, v): the recurrent kernel convolves in its loads
    (`_conv_switch`); the chunk kernels get q, k, v convolved first
    (`gdngen.prepare.convolved`). A ``norm_gate`` call: `_normed_call` (``norm_build``: the
    recurrent kernel's norm build runs it, undifferentiated)."""
    import mlx.core as mx

    from gdngen import prepare
    from gdngen.backends.portable import mlx_chunkwise
    from gdngen.backends.portable.mlx_chunkwise import XP

    if call.norm_gate is not None and not norm_build:
        return _normed_call(call, operands, variant, launcher, chunked)

    if call.conv_size is not None and chunked:
        call, operands = prepare.convolved(call, operands)

    shape, problem, gate, scale, qk_norm = (call.shape, call.problem, call.core_gate,
                                            call.scale, call.qk_norm)
    q, k, v, _, beta, initial_state, mask = operands[:7]
    g = operands.kernel_gates()
    variant = adapt(variant, problem)
    launcher = launch.default_launcher() if launcher is None else launcher
    f32 = mx.float32
    if initial_state is None:
        initial_state = mx.zeros((shape.B, shape.Hv, shape.Dv, shape.Dk), f32)
    args = (q, k.astype(q.dtype), v.astype(q.dtype), layer_inputs.cast_gates(g, f32),
            beta.astype(f32), initial_state.astype(f32))

    if shape.vector_gate:
        def chunkwise_call(q, k, v, g, beta, s0, mask=None):
            y, state = channel_chunkwise(
                q.astype(f32), k.astype(f32), v.astype(f32), g, beta, s0, mask,
                variant=variant, problem=problem, scale=scale, gate=gate, launcher=launcher,
                templates=settings.templates_override(), qk_norm=qk_norm)
            return y.astype(q.dtype), state
    else:
        chunkwise_call = _chunk_call(variant, problem, gate, scale, launcher, qk_norm=qk_norm)
    if chunked:
        return chunkwise_call(*args, mask)

    parameter_gate = gate if isinstance(gate, layer_inputs.ParameterGate) else None
    norm = None if call.norm_gate is None else (operands.output_gate, operands.norm_weight,
                                                 call.norm_eps)

    def recurrent(q, k, v, g, beta, s0, conv=None):
        # the kernel normalises q, k and forms a ParameterGate's decay in its loads
        decay = g if parameter_gate else layer_inputs.linear_decay(XP, g, gate)  # exp(-inf) = 0
        y, state = recurrent_forward(q, k, v, decay, beta, s0, scale=scale, variant=variant,
                                     problem=problem, launcher=launcher, qk_norm=qk_norm,
                                     gate=parameter_gate, conv=conv, norm_gate=call.norm_gate,
                                     norm=norm)
        return y.astype(q.dtype), state

    g, beta = layer_inputs.fold_mask(XP, args[3], args[4], mask, gate)
    if call.conv_size is not None:  # q, k, v raw: the kernel convolves them
        y, state = _conv_switch((call, operands), recurrent, chunkwise_call, g, beta, args[5])
    else:
        y, state = mlx_chunkwise.recurrent_or_chunkwise(recurrent, chunkwise_call)(
            *args[:3], g, beta, args[5])
    if mask is not None:
        y = mx.where(mask[..., None, None], y, mx.zeros((), y.dtype))
    return y.astype(q.dtype), state


def _normed_call(call, operands, variant, launcher, chunked: bool):
    """A ``norm_gate`` call (`dense_call`): a short one runs the recurrent kernel's norm build
    when not differentiated, an ``mx.custom_function`` over the call's arrays whose VJP is the
    plain call's then the norm's (`gdngen.prepare.normed`); a chunked one runs the plain call
    and the norm after it."""
    import mlx.core as mx

    from gdngen import prepare

    plain = prepare.without_norm(call, operands)
    if chunked:
        y, state = dense_call(*plain, variant, launcher, chunked=chunked)
        return prepare.normed(call, operands, y), state
    names = [n for n in operands._fields
             if n != "mask" and isinstance(getattr(operands, n), mx.array)]

    def arrays(flat):
        return operands._replace(**dict(zip(names, flat)))

    @mx.custom_function
    def normed(*flat):
        return dense_call(call, arrays(flat), variant, launcher, chunked=False, norm_build=True)

    @normed.vjp
    def normed_vjp(primals, cotangents, outputs):
        def unfused(*flat):
            y, state = dense_call(*prepare.without_norm(call, arrays(flat)), variant, launcher,
                                  chunked=False)
            return prepare.normed(call, arrays(flat), y), state

        return mx.vjp(unfused, list(primals), list(cotangents))[1]

    return normed(*(getattr(operands, n) for n in names))


def _conv_switch(raw, recurrent, chunkwise_call, g, beta, S0):
    """A conv call's recurrent forward (`dense_call`): ``recurrent(q, k, v, g, beta, S0,
    conv=(conv_weight, conv_state))`` on the raw q, k, v of ``raw = (call, operands)`` (the
    kernel convolves in its loads), whose VJP is the chunk path's on q, k, v convolved first
    (`gdngen.prepare.convolved`, the conv's own VJP; ``chunkwise_call(q, k, v, g, beta, S0)``,
    masks folded into g and beta); an ``mx.custom_function`` over the raw arrays, ``g`` a
    ParameterGate's tuple or one array. Returns ``(y, final_state)``."""
    import mlx.core as mx

    from gdngen import prepare

    call, operands = raw
    dtype = operands.q.dtype
    gates = g if isinstance(g, tuple) else (g,)
    with_state = operands.conv_state is not None
    n_conv = 2 if with_state else 1

    def split(flat):  # -> (q, k, v), (weight, state or None), gates, beta, S0
        q, k, v, *rest = flat
        weight, state = rest[0], (rest[1] if with_state else None)
        rest = rest[n_conv:]
        gates_ = tuple(rest[:len(gates)])
        return (q, k, v), (weight, state), (gates_ if isinstance(g, tuple) else gates_[0],
                                            *rest[len(gates):])

    def chunk_path(*flat):
        (q, k, v), (weight, state), (gates_, beta_, S0_) = split(flat)
        conv_ops = operands._replace(q=q, k=k, v=v, conv_weight=weight, conv_state=state)
        convolved = prepare.convolved(call, conv_ops)[1]
        return chunkwise_call(convolved.q, convolved.k.astype(dtype), convolved.v.astype(dtype),
                              gates_, beta_, S0_)

    @mx.custom_function
    def switched(*flat):
        (q, k, v), conv, (gates_, beta_, S0_) = split(flat)
        return recurrent(q, k.astype(dtype), v.astype(dtype), gates_, beta_, S0_, conv=conv)

    @switched.vjp
    def switched_vjp(primals, cotangents, outputs):
        return mx.vjp(chunk_path, list(primals), list(cotangents))[1]

    conv_arrays = (operands.conv_weight,) + ((operands.conv_state,) if with_state else ())
    return switched(operands.q, operands.k, operands.v, *conv_arrays, *gates, beta, S0)


def packed_call(call, operands, variant, launcher=None, templates_dir=None):
    """`packed_gated_delta`'s body on a checked packed `gdngen.call.Call`: scalar gates on the
    packed build's chunk kernels; per-channel gates the same packed algebra on `channel_core`
    and `channel_walk_core` (channel_intra, the packed build's walks, channel_grads)."""
    import mlx.core as mx

    from gdngen.algebra import chunkwise, packed
    from gdngen.backends.portable.mlx_chunkwise import XP

    gate, scale = call.decay, call.scale
    q, k, v, g, beta, initial_state, mask, _, _, cu_seqlens = operands[:10]
    problem = call.replace(dtype="float32").problem
    variant = adapt(variant, problem)
    launcher = launch.default_launcher() if launcher is None else launcher
    templates = settings.templates_override() if templates_dir is None else templates_dir
    f32 = mx.float32
    if call.vector_gate:
        channel = channel_core(variant, problem, gate, launcher, templates, packed=True)
        channel_walk = channel_walk_core(variant, problem, gate, launcher, templates)

        def dense(q, k, v, g, beta, S0, mask):
            return chunkwise.whole_sequence(XP, lambda *a: channel(*a)[:2], q, k, v, g, beta,
                                            S0, mask, scale=scale, gate=gate,
                                            chunk_size=variant["chunk_size"])

        walk = packed.chunk_walk(XP, lambda *a: channel_walk(*a)[:2], scale=scale, gate=gate,
                                 chunk_size=variant["chunk_size"])
        y, state = packed.packed_row(
            XP, dense, walk, *(x.astype(f32) for x in (q, k, v, g, beta)),
            None if initial_state is None else initial_state.astype(f32), mask, cu_seqlens,
            gate=gate, chunk_size=variant["chunk_size"])
        return y.astype(q.dtype), state
    chunk_call = _chunk_call(variant, problem, gate, scale, launcher, templates)
    walk_core = packed_core(variant, problem, gate, launcher, templates)

    def dense(q, k, v, g, beta, S0, mask):
        y, S = chunk_call(q, k, v, g, beta, S0, mask)
        return mx.where(mask[..., None, None], y, mx.zeros((), y.dtype)), S

    walk = packed.chunk_walk(XP, lambda *a: walk_core(*a)[:2], scale=scale, gate=gate,
                             chunk_size=variant["chunk_size"])
    y, state = packed.packed_row(
        XP, dense, walk, *(x.astype(f32) for x in (q, k, v, g, beta)),
        None if initial_state is None else initial_state.astype(f32), mask, cu_seqlens,
        gate=gate, chunk_size=variant["chunk_size"])
    return y.astype(q.dtype), state
