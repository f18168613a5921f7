"""ffi_cpu's calls of loaded kernels (by sha256 of their rendered sources): the custom-VJP
chunk core, the packed-row walk, the recurrent kernel and the chunk forward that returns the
states entering each chunk; their FFI result layouts and the cotangents fed to the backward
kernels. Float32 arrays in the API layout; each is made once per process per its arguments."""

from __future__ import annotations

import functools

from gdngen import jaxcompat
from gdngen.algebra import layer_inputs
from gdngen.backends import generated
from gdngen.backends.ffi_cpu import kernels
from gdngen.backends.ffi_cpu.config import padded
from gdngen.backends.ffi_cpu.kernels import head_splits, recurrent_rows
from gdngen.backends.kernel_inputs import KernelInputs, kernel_parameters

#: nothing computed in the loads (the plain kernels)
PLAIN_INPUTS = KernelInputs()


def call_context(sha256: str, gate: str, scale: float, poison: bool):
    """What every FFI call of the loaded kernels ``sha256`` shares: ``(loaded, workers,
    attrs, f32(shape, like) -> result type, log_gates(g) -> log g)``."""
    import jax.numpy as jnp
    import numpy as np

    workers = kernels.threads()

    def f32(shape, like):
        return generated.result_type(shape, jnp.float32, like)

    def log_gates(g):
        return g if gate == "log" else jnp.log(g)

    return (kernels.LOADED[sha256], workers,
            {"scale": np.float32(scale), "threads": np.int64(workers), "poison": poison},
            f32, log_gates)


def forward_call(context, forward_loaded, inputs: KernelInputs, primals, norm=(),
                 norm_eps=None):
    """``((y, S_final), entering)``: the chunk forward kernel of ``forward_loaded`` (the plain
    build, ``inputs`` `PLAIN_INPUTS`, or `render_fused`'s for ``inputs`` with `SOURCE_NAME`)
    on ``primals`` (`core`'s; the raw ones its loads take: conv tuples with ``inputs.conv``,
    ``(a, A_log, dt_bias)`` with ``inputs.gate_form``), ``context`` a `call_context`;
    ``entering`` ``[B, Hv, N, DK, DV]`` the states entering each chunk, transposed and padded.
    A norm build takes ``norm = (z, norm_weight)`` and ``norm_eps`` and returns the norm of y."""
    import jax.numpy as jnp
    import numpy as np

    loaded, workers, attrs, f32, log_gates = context
    C = loaded.params["chunk_size"]
    q, k, v, g, beta, S0 = primals
    (q, k, v), conv_operands = conv_operands_of(q, k, v) if inputs.conv else ((q, k, v), ())
    B, T, Hk, Dk = q.shape
    Hv, Dv = v.shape[2], v.shape[3]
    if inputs.gate_form:  # the kernel forms log g from a, A_log, dt_bias
        a, A_log, dt_bias = g
        gate_operands = (a, beta, S0, *kernel_parameters(
            jnp, A_log, dt_bias, Hv, Dk, loaded.problem.gate == "vector"))
        extra = {"lower_bound": np.float32(inputs.lower_bound)}
    else:
        gate_operands, extra = (log_gates(g), beta, S0), {}
    if (norm_eps is None) != (inputs.norm is None) or len(norm) != (2 if inputs.norm else 0):
        raise ValueError(f"norm (z, norm_weight) and norm_eps go with a norm build, got "
                         f"{len(norm)} arrays and {norm_eps!r} for {inputs!r}")
    if norm_eps is not None:
        extra["norm_eps"] = np.float32(norm_eps)
    y, s_final, states = jaxcompat.ffi().ffi_call(forward_loaded.target_forward, (
        f32((B, T, Hv, Dv), q), f32((B, Hv, Dv, Dk), q),
        f32((B, Hv, -(-T // C), padded(Dk), padded(Dv)), q)),
        vmap_method="sequential")(q, k, v, *gate_operands, *conv_operands, *norm, **attrs,
                                  **extra, splits=np.int64(head_splits(B, Hk, Hv // Hk, workers)))
    return (y, s_final), states


def conv_operands_of(q, k, v):
    """``((q, k, v) raw, (conv_w [K, C], conv_state [B, K-1, C]))`` of conv tuples ``(x, w,
    conv_state or None)`` (`gdngen.prepare.conv_parts`), as a conv build's kernel takes them:
    the whole weight and state over the mixer's channels (zeros for a None state), channels
    last."""
    import jax.numpy as jnp

    (q, wq, sq), (k, wk, sk), (v, wv, sv) = q, k, v
    weight = jnp.concatenate([wq, wk, wv], axis=0).T  # [K, C]
    K, C = weight.shape
    state = (jnp.zeros((q.shape[0], K - 1, C), jnp.float32) if sq is None else
             jnp.concatenate([sq, sk, sv], axis=1).transpose(0, 2, 1))
    return (q, k, v), (weight, state)


@functools.cache
def core(sha256: str, gate, scale: float, poison: bool, qk_norm: bool = False,
         forward_sha256: str | None = None, conv: bool = False,
         forward_convolves: bool = False):
    """``core(q, k, v, gates, beta, S0) -> (y, S_final)`` on float32 arrays in the API layout
    (gates ``[B,T,Hv]`` or, on per-channel kernels, ``[B,T,Hv,Dk]``, in their own convention,
    already masked; for a `gdngen.algebra.layer_inputs.ParameterGate` ``(a, A_log, dt_bias)``), with
    the generated backward as its ``jax.custom_vjp`` (`gdngen.backends.generated.custom_vjp_core`).

    ``forward_sha256`` None: the core normalises q, k (``qk_norm``) and computes the log gate
    as array ops before the forward kernel. Otherwise the loaded fused chunk forward of that
    sha256 (`render_fused` with `SOURCE_NAME`, for ``KernelInputs.of(qk_norm, gate)``) takes
    the raw q, k and ``a`` with A_log, dt_bias (`kernel_parameters`) and computes both in its
    loads (``forward_fuses``); the backward kernel of ``sha256`` still gets them recomputed
    as arrays, and the core maps its dq, dk, dlog g through their VJPs. ``conv``: q, k, v are
    conv tuples ``(x, w, conv_state or None)`` (`gdngen.backends.generated.custom_vjp_core`):
    with ``forward_convolves`` the fused chunk forward (built with ``KernelInputs.conv``) takes
    the raw x and the whole ``conv_w [K, C]`` and ``conv_state [B, K-1, C]`` (zeros for None)
    and convolves in its loads, else the core convolves before the kernels."""
    import jax.numpy as jnp
    import numpy as np

    parameter_gate, gate = gate, layer_inputs.convention(gate)
    context = call_context(sha256, gate, scale, poison)
    loaded, workers, attrs, f32, log_gates = context
    inputs = KernelInputs.of(qk_norm, parameter_gate, forward_convolves)
    fuses = forward_sha256 is not None
    if fuses and not inputs.fused:
        raise ValueError("forward_sha256 needs qk_norm, a ParameterGate or the conv to fuse")
    if forward_convolves and not (conv and fuses):
        raise ValueError("forward_convolves needs conv and forward_sha256")
    forward_loaded = kernels.LOADED[forward_sha256] if fuses else loaded

    def forward(primals):
        return forward_call(context, forward_loaded, inputs if fuses else PLAIN_INPUTS,
                            primals)

    def backward(primals, states, cotangents):
        q, k, v, g, beta, _ = primals
        dy, dS_final = cotangents
        B, T, Hk, Dk = q.shape
        Hv, Dv = v.shape[2], v.shape[3]
        P = head_splits(B, Hk, Hv // Hk, workers)
        dq, dk, dv, dbeta, dg, dS0 = jaxcompat.ffi().ffi_call(loaded.target_backward, (
            f32((B, T, Hk * P, Dk), q), f32((B, T, Hk * P, Dk), q), f32((B, T, Hv, Dv), q),
            f32((B, T, Hv), q), f32(g.shape, q), f32((B, Hv, Dv, Dk), q)),
            vmap_method="sequential")(q, k, v, log_gates(g), beta, states,
                                      dy.astype(jnp.float32), dS_final.astype(jnp.float32),
                                      linear=gate == "linear", splits=np.int64(P), **attrs)
        if P > 1:
            dq, dk = (x.reshape(B, T, Hk, P, Dk).sum(3) for x in (dq, dk))
        return dq, dk, dv, dg, dbeta, dS0

    return generated.custom_vjp_core(forward, backward, qk_norm, parameter_gate,
                                     forward_fuses=fuses, conv=conv,
                                     forward_convolves=forward_convolves)


@functools.cache
def normed_chunk(sha256: str, forward_sha256: str, gate, scale: float, poison: bool,
                 norm: str, qk_norm: bool = False, conv: bool = False):
    """``call(q, k, v, gates, beta, S0, z, norm_weight, *, norm_eps) -> (out, S_final)``,
    forward only: the chunk forward's norm build ``forward_sha256`` (`render_fused` with
    `SOURCE_NAME` for ``KernelInputs.of(qk_norm, gate, conv, norm)``), which computes the
    layer inputs in its loads and the output's gated norm in each chunk's stores. The primals
    as `core`'s with its fused forward (raw q, k; conv tuples with ``conv``; ``(a, A_log,
    dt_bias)`` for a ParameterGate); z ``[B, T, Hv, Dv]``, norm_weight ``[Dv]`` float32."""
    context = call_context(sha256, layer_inputs.convention(gate), scale, poison)
    inputs = KernelInputs.of(qk_norm, gate, conv, norm)

    def call(q, k, v, g, beta, S0, z, norm_weight, *, norm_eps):
        (y, s_final), _ = forward_call(context, kernels.LOADED[forward_sha256], inputs,
                                       (q, k, v, g, beta, S0), (z, norm_weight), norm_eps)
        return y, s_final

    return call


@functools.cache
def packed_walk(sha256: str, gate: str, scale: float, poison: bool):
    """``walk(q, k, v, g, beta, inject, last) -> (y, None, S_end)`` of
    `gdngen.algebra.packed.packed_row` on the packed kernels ``sha256`` (B = 1, API layout,
    float32; gates ``[1, T, Hv]`` or, on per-channel kernels, ``[1, T, Hv, Dk]``), a walk
    that resets the state at each sequence's first step and folds the initial states in itself
    (``resets_at_starts``): ``g`` the row's gates as given (masks folded), ``inject`` ``(S0
    [n_seq, Hv, Dv, Dk] or None, starts [n_seq] int32)``, each sequence's initial state and
    first step; ``last`` int32 ``[n_seq]`` each sequence's last step, -1 for an empty one;
    ``S_end [n_seq, Hv, Dv, Dk]`` the state after it (an empty sequence's: its initial state,
    zero without one). A ``jax.custom_vjp`` per presence of S0, its backward the packed
    kernel's (the first steps' gate cotangents through S0 g_first included)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    loaded, workers, attrs, f32, log_gates = call_context(sha256, gate, scale, poison)

    def initial_states(S0):  # [1, n_seq, Hv, Dv, Dk], or empty (made per trace: no leak)
        return jnp.zeros((0,), jnp.float32) if S0 is None else S0[None]

    def forward(q, k, v, g, beta, S0, starts, last):
        _, T, Hk, Dk = q.shape
        Hv, Dv = v.shape[2], v.shape[3]
        N, n_seq = -(-T // loaded.params["chunk_size"]), last.shape[0]
        y, _, states, ends = jaxcompat.ffi().ffi_call(loaded.target_forward, (
            f32((1, T, Hv, Dv), q), f32((1, Hv, Dv, Dk), q),
            f32((1, Hv, N, padded(Dk), padded(Dv)), q), f32((1, n_seq, Hv, Dv, Dk), q)),
            vmap_method="sequential")(
                q, k, v, log_gates(g), beta, jnp.zeros((1, Hv, Dv, Dk), jnp.float32),
                initial_states(S0), starts, last, **attrs,
                splits=np.int64(head_splits(1, Hk, Hv // Hk, workers)))
        return (y, ends[0]), states

    def backward(primals, S0, states, cotangents):
        q, k, v, g, beta, starts, last = primals
        dy, dS_end = cotangents
        _, T, Hk, Dk = q.shape
        Hv, Dv = v.shape[2], v.shape[3]
        P = head_splits(1, Hk, Hv // Hk, workers)
        initial = initial_states(S0)
        dq, dk, dv, dbeta, dg, _, dinitial = jaxcompat.ffi().ffi_call(loaded.target_backward, (
            f32((1, T, Hk * P, Dk), q), f32((1, T, Hk * P, Dk), q), f32((1, T, Hv, Dv), q),
            f32((1, T, Hv), q), f32(g.shape, q), f32((1, Hv, Dv, Dk), q),
            f32(initial.shape, q)), vmap_method="sequential")(
                q, k, v, log_gates(g), beta, states, dy.astype(jnp.float32),
                jnp.zeros((1, Hv, Dv, Dk), jnp.float32), initial, starts, last,
                dS_end.astype(jnp.float32)[None], linear=gate == "linear",
                splits=np.int64(P), **attrs)
        if P > 1:
            dq, dk = (x.reshape(1, T, Hk, P, Dk).sum(3) for x in (dq, dk))
        return (dq, dk, dv, dg, dbeta), dinitial

    @jax.custom_vjp
    def folding(q, k, v, g, beta, S0, starts, last):
        return forward(q, k, v, g, beta, S0, starts, last)[0]

    def folding_fwd(q, k, v, g, beta, S0, starts, last):
        outputs, chunk_states = forward(q, k, v, g, beta, S0, starts, last)
        return outputs, ((q, k, v, g, beta, starts, last), S0, chunk_states)

    def folding_bwd(saved, cotangents):
        primals, S0, chunk_states = saved
        grads, dinitial = backward(primals, S0, chunk_states, cotangents)
        return (*grads, dinitial[0], None, None)

    folding.defvjp(folding_fwd, folding_bwd)

    @jax.custom_vjp
    def plain(q, k, v, g, beta, starts, last):
        return forward(q, k, v, g, beta, None, starts, last)[0]

    def plain_fwd(q, k, v, g, beta, starts, last):
        outputs, states = forward(q, k, v, g, beta, None, starts, last)
        return outputs, ((q, k, v, g, beta, starts, last), states)

    def plain_bwd(saved, cotangents):
        primals, states = saved
        return (*backward(primals, None, states, cotangents)[0], None, None)

    plain.defvjp(plain_fwd, plain_bwd)

    def walk(q, k, v, g, beta, inject, last):
        S0, starts = inject
        if S0 is None:
            y, S_end = plain(q, k, v, g, beta, starts, last)
        else:
            y, S_end = folding(q, k, v, g, beta, S0, starts, last)
        return y, None, S_end

    walk.resets_at_starts = True  # `packed_row` hands it the row's gates and (S0, starts)
    return walk


@functools.cache
def recurrent(sha256: str, scale: float, poison: bool, inputs: KernelInputs = PLAIN_INPUTS,
              steps: bool = False):
    """``call(q, k, v, decay, beta, S0, *parameters) -> (y, S_T)`` running the loaded recurrent
    kernel of ``sha256`` (float32, API layout; ``steps``: a `render_steps` build, every step's
    state ``[B, T, Hv, Dv, Dk]`` in place of S_T): the plain one (``inputs`` off) takes the linear
    decay; a fused one (`render_fused` for ``inputs``) the raw q, k when ``inputs.qk_norm`` and,
    with ``inputs.gate_form``, the raw projection ``a`` as ``decay`` and ``parameters`` =
    ``(A_log, dt_bias)`` as `kernel_parameters` gives them (``lower_bound`` from ``inputs``);
    with ``inputs.norm`` the kernel returns the gated norm of y: ``parameters`` end with ``z``
    ``[B, T, Hv, Dv]``, ``norm_weight`` ``[Dv]`` (float32) and the call takes ``norm_eps=``;
    with ``inputs.conv`` q, k, v are conv tuples (`conv_operands_of`): the kernel convolves
    the raw rows in its loads."""
    import jax.numpy as jnp
    import numpy as np

    loaded = kernels.LOADED[sha256]
    workers = kernels.threads()
    extra = {"lower_bound": np.float32(inputs.lower_bound)} if inputs.gate_form else {}
    n_parameters = (2 if inputs.gate_form else 0) + (2 if inputs.norm else 0)

    def call(q, k, v, decay, beta, S0, *parameters, norm_eps=None):
        if len(parameters) != n_parameters:
            raise ValueError(f"the recurrent kernel of {inputs!r} takes {n_parameters} "
                             f"parameters (A_log, dt_bias; z, norm_weight), got "
                             f"{len(parameters)}")
        if (norm_eps is None) != (inputs.norm is None):
            raise ValueError(f"norm_eps goes with a norm build, got {norm_eps!r} for {inputs!r}")
        norm = {} if norm_eps is None else {"norm_eps": np.float32(norm_eps)}
        conv = ()
        if inputs.conv:  # the gate's parameters, then the conv's operands, then the norm's
            (q, k, v), conv = conv_operands_of(q, k, v)
            split = 2 if inputs.gate_form else 0
            parameters = (*parameters[:split], *conv, *parameters[split:])
        B, T, _, Dk = q.shape
        Hv, Dv = v.shape[2], v.shape[3]
        states = (B, T, Hv, Dv, Dk) if steps else (B, Hv, Dv, Dk)
        return jaxcompat.ffi().ffi_call(loaded.target_recurrent, (
            generated.result_type((B, T, Hv, Dv), jnp.float32, q),
            generated.result_type(states, jnp.float32, q)),
            vmap_method="sequential")(q, k, v, decay, beta, S0, *parameters,
                                      scale=np.float32(scale), threads=np.int64(workers),
                                      poison=poison, **extra, **norm,
                                      rows=np.int64(recurrent_rows(B, Hv, Dv, workers)))

    return call


def chunk_forward(sha256: str, scale: float, poison: bool):
    """``forward(q, k, v, log_g, beta, S0) -> (y, S_T, entering [B, N, Hv, Dv, Dk])`` on the
    loaded chunk forward kernel ``sha256`` (float32, API layout, log gates): ``entering`` the
    states its walk writes entering each chunk (the backward's residual), unpadded."""
    import jax.numpy as jnp
    import numpy as np

    loaded, workers, attrs, f32, _ = call_context(sha256, "log", scale, poison)
    C = loaded.params["chunk_size"]

    def forward(q, k, v, log_g, beta, S0):
        B, T, Hk, Dk = q.shape
        Hv, Dv = v.shape[2], v.shape[3]
        y, final, entering = jaxcompat.ffi().ffi_call(loaded.target_forward, (
            f32((B, T, Hv, Dv), q), f32((B, Hv, Dv, Dk), q),
            f32((B, Hv, -(-T // C), padded(Dk), padded(Dv)), q)),
            vmap_method="sequential")(q, k, v, log_g, beta, S0, **attrs,
                                      splits=np.int64(head_splits(B, Hk, Hv // Hk, workers)))
        # [B, Hv, N, DK, DV] transposed and padded -> [B, N, Hv, Dv, Dk]
        entering = jnp.swapaxes(entering[..., :Dk, :Dv], -1, -2)
        return y, final, jnp.swapaxes(entering, 1, 2)

    return forward
