"""The gated-delta mixer as one call (``gdngen.jax.gated_delta_mixer``,
``gdngen.mlx.gated_delta_mixer``): causal short convolution + SiLU, q/k L2 norm, gates from
their parameters, the recurrence, gated RMSNorm.

    out, final_state, conv_state = gated_delta_mixer(
        mixed_qkv,    # [B, T, C], C = 2 Hk Dk + Hv Dv: q, k, v concatenated in that order
        conv_weight,  # [C, K]: depthwise, causal (mlx-lm's conv1d.weight[..., 0])
        a,            # [B, T, Hv] (per-head gate) or [B, T, Hv, Dk] (per-channel, KDA)
        b,            # [B, T, Hv]: beta logits, beta = sigmoid(b)
        z,            # [B, T, Hv, Dv]: the output gate
        Hk=, Hv=, Dk=, Dv=, A_log=, dt_bias=, norm_weight=[Dv],
        conv_state=None,     # [B, C, K-1]: the last K-1 inputs ([N, C, K-1] with cu_seqlens)
        initial_state=None,  # [B, Hv, Dv, Dk] ([N, ...] with cu_seqlens)
        mask=None, cu_seqlens=None, norm_eps=1e-6, scale=Dk**-0.5,
        gate="softplus",     # or "sigmoid_bound" with lower_bound (Kimi K3, Bailing V3)
        norm_gate="silu",    # or "sigmoid" (Kimi Linear: o_norm(y) * sigmoid(g))
        allow_neg_eigval=False)  # True: beta = 2 sigmoid(b), in [0, 2] (OLMo hybrid)

Stages (`gdngen.algebra.mixer`): ``h = silu(causal_conv(mixed_qkv))`` with the conv state in
front of the row (masked steps' inputs are zeros, as in mlx-lm); q, k, v split from h; then
``gated_delta(q, k, v, a, b, initial_state, qk_norm=True, gate=gate, A_log, dt_bias,
beta_activation="sigmoid", scale)`` (the core computes the norm and the gate in its loads; it
takes the raw slices of mixed_qkv with ``conv_weight`` and ``conv_state`` and convolves them
itself);
``out = rmsnorm(y) * norm_weight * act(z)``, in y's dtype (``gated_delta``'s ``norm_weight``,
``output_gate=z``: the recurrent kernels of ffi_cpu and pallas_tpu compute it in their stores
when the call is not differentiated). ``scale`` defaults to Dk**-0.5
(mlx-lm's ``normalize_qk`` puts it on q). Returns ``out [B, T, Hv, Dv]``, the final state (as
``gated_delta``: float32) and the new conv state ``[B, C, K-1]`` (mixed_qkv's dtype).

Kimi Linear's three convolutions (``q_conv``, ``k_conv``, ``v_conv``, each depthwise) are one
depthwise convolution over the concatenation: pass ``[q_proj; k_proj; v_proj]`` as mixed_qkv,
the three weights concatenated along channels, and the three conv states likewise.

Speculative verify (``return_states="steps"``, dense rows): the second output is the state after
every step, ``[B, T, Hv, Dv, Dk]``, as ``gated_delta`` returns it; the conv state returned stays
the final one (the window after step t is the last K-1 of ``[conv_state; mixed_qkv]`` up to t,
which the caller has: `gdngen.integrations.mlx_lm`'s rewindable cache keeps it).

Packed rows (``cu_seqlens``, B = 1) restart the convolution window at every sequence start as
the state: a sequence's first K-1 steps read its own conv state (zeros when None), and each
sequence returns its own.

Memory: the convolution and the gated norm are custom VJPs of their own (``jax.custom_vjp``,
``mx.custom_function``) with hand-derived backward passes (`gdngen.algebra.mixer.
conv_dense_vjp`, ``conv_packed_vjp``, ``gated_norm_vjp``): they keep only their raw inputs
and recompute their activations (the pre-activation, SiLU's derivative, rsqrt, the gates) in
the backward, without an autodiff graph of a recomputation (a packed row's windows: every
transpose a gather, no scatter). The conv runs inside the recurrence's call
(``gated_delta(..., conv_weight=)``): ffi_cpu's forwards (chunk and recurrent) and the
recurrent kernels of metal, pallas_tpu and pallas_gpu convolve in their loads, and the chunk
cores of ffi_cpu and Pallas keep only the raw q, k, v slices and recompute the conv once in
their backward; elsewhere the conv's custom VJP runs first and the recurrence keeps the
convolved q, k, v it gets (`gdngen.entry.TunedGatedDelta.explain` says which, per call).
"""

from __future__ import annotations

from gdngen import prepare
from gdngen.algebra import mixer as stages
from gdngen.call import PARAMETER_GATES
from gdngen.shape import FLOAT_DTYPES, dtype_name

__all__ = ["gated_delta_mixer"]

#: gates the mixer takes: both parameterised gates (`gdngen.call.PARAMETER_GATES`)
MIXER_GATES = PARAMETER_GATES


def _shape(x):
    return tuple(int(n) for n in x.shape)


def _expect(name, x, shape, what):
    if x is None:
        raise ValueError(f"{name} is required, expected {what}")
    if _shape(x) != tuple(shape):
        raise ValueError(f"{name} has shape {_shape(x)}, expected {what} = {tuple(shape)}")
    if dtype_name(x) not in FLOAT_DTYPES:
        raise ValueError(f"{name} has dtype {dtype_name(x)}, expected one of {FLOAT_DTYPES}")


def check(mixed_qkv, conv_weight, a, b, z, *, Hk, Hv, Dk, Dv, norm_weight, conv_state,
          cu_seqlens, norm_eps, gate, norm_gate) -> int:
    """The mixer's own argument checks (the recurrence's arguments are checked by
    ``gated_delta``). Returns the kernel size K."""
    for name, n in (("Hk", Hk), ("Hv", Hv), ("Dk", Dk), ("Dv", Dv)):
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"{name} must be a positive int, got {n!r}")
    if gate not in MIXER_GATES:
        raise ValueError(f"gate must be one of {MIXER_GATES} (the mixer takes the raw gate "
                         f"projection a), got {gate!r}")
    if norm_gate not in stages.NORM_GATES:
        raise ValueError(f"norm_gate must be one of {stages.NORM_GATES}, got {norm_gate!r}")
    if not isinstance(norm_eps, (int, float)) or isinstance(norm_eps, bool) or not norm_eps > 0:
        raise ValueError(f"norm_eps must be a positive float, got {norm_eps!r}")
    C = 2 * Hk * Dk + Hv * Dv
    if getattr(mixed_qkv, "ndim", None) != 3:
        raise ValueError(f"mixed_qkv must be [B, T, 2*Hk*Dk + Hv*Dv] = [B, T, {C}], got shape "
                         f"{_shape(mixed_qkv) if hasattr(mixed_qkv, 'shape') else mixed_qkv!r}")
    B, T, _ = _shape(mixed_qkv)
    _expect("mixed_qkv", mixed_qkv, (B, T, C), "[B, T, 2*Hk*Dk + Hv*Dv]")
    if getattr(conv_weight, "ndim", None) != 2 or _shape(conv_weight)[0] != C:
        raise ValueError(f"conv_weight must be [C, K] = [{C}, K] (one causal filter per channel;"
                         f" mlx-lm's conv1d.weight[..., 0]), got shape "
                         f"{_shape(conv_weight) if hasattr(conv_weight, 'shape') else None}")
    K = _shape(conv_weight)[1]
    if K < 1:
        raise ValueError(f"conv_weight's kernel size must be >= 1, got {K}")
    _expect("conv_weight", conv_weight, (C, K), "[2*Hk*Dk + Hv*Dv, K]")
    _expect("z", z, (B, T, Hv, Dv), "[B, T, Hv, Dv]")
    _expect("norm_weight", norm_weight, (Dv,), "[Dv]")
    _expect("b", b, (B, T, Hv), "[B, T, Hv]")
    if a is None or _shape(a) not in ((B, T, Hv), (B, T, Hv, Dk)):
        raise ValueError(f"a has shape {None if a is None else _shape(a)}, expected [B, T, Hv] "
                         f"= {(B, T, Hv)} (per-head gate) or [B, T, Hv, Dk] = {(B, T, Hv, Dk)}")
    if conv_state is not None:
        rows = B if cu_seqlens is None else int(cu_seqlens.shape[0]) - 1
        what = "[B, C, K-1]" if cu_seqlens is None else "[N, C, K-1] (one per sequence)"
        _expect("conv_state", conv_state, (rows, C, K - 1), what)
    return K


def gated_delta_mixer(framework, gated_delta, mixed_qkv, conv_weight, a, b, z, *, Hk, Hv, Dk,
                      Dv, A_log, dt_bias, norm_weight, conv_state=None, initial_state=None,
                      mask=None, cu_seqlens=None, norm_eps=1e-6, scale=None, gate="softplus",
                      lower_bound=None, norm_gate="silu", chunk_size=None, variant=None,
                      return_states="final", allow_neg_eigval=False):
    """The mixer on ``framework``'s arrays (module docstring), its recurrence the framework's
    ``gated_delta`` (``return_states`` "final" or "steps"; ``allow_neg_eigval``: beta = 2
    sigmoid(b), computed in float32 before the recurrence, which takes it as beta)."""
    K = check(mixed_qkv, conv_weight, a, b, z, Hk=Hk, Hv=Hv, Dk=Dk, Dv=Dv,
              norm_weight=norm_weight, conv_state=conv_state, cu_seqlens=cu_seqlens,
              norm_eps=norm_eps, gate=gate, norm_gate=norm_gate)
    if not isinstance(allow_neg_eigval, bool):
        raise ValueError(f"allow_neg_eigval must be a bool, got {allow_neg_eigval!r}")  # noqa: TRY004
    if return_states not in ("final", "steps"):
        raise ValueError(f"return_states must be 'final' or 'steps' for the mixer, got "
                         f"{return_states!r}")
    xp = prepare.namespace(framework)
    m = xp.module
    B, T, _ = _shape(mixed_qkv)
    if mask is not None and _shape(mask) != (B, T):
        raise ValueError(f"mask has shape {_shape(mask)}, expected [B, T] = {(B, T)}")
    # the new conv state: the last K-1 inputs of each window (masked steps' are zeros)
    new_conv_state = stages.conv_new_state(xp, mixed_qkv, conv_state, K, cu_seqlens, mask)
    kd = Hk * Dk  # q, k, v raw: the recurrence's call convolves them (conv_weight)
    q = mixed_qkv[..., :kd].reshape((B, T, Hk, Dk))
    k = mixed_qkv[..., kd:2 * kd].reshape((B, T, Hk, Dk))
    v = mixed_qkv[..., 2 * kd:].reshape((B, T, Hv, Dv))
    beta_activation = "sigmoid"
    if allow_neg_eigval:  # beta in [0, 2]: the recurrence takes beta itself
        b, beta_activation = (2.0 * xp.sigmoid(b.astype(m.float32))).astype(b.dtype), None
    y, final_state = gated_delta(
        q, k, v, a, b, initial_state, mask=mask, scale=Dk ** -0.5 if scale is None else scale,
        gate=gate, qk_norm=True, A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound,
        beta_activation=beta_activation, cu_seqlens=cu_seqlens, chunk_size=chunk_size,
        variant=variant, return_states=return_states, conv_weight=conv_weight,
        conv_state=conv_state, norm_weight=norm_weight, output_gate=z,
        norm_eps=float(norm_eps), norm_gate=norm_gate)
    return y, final_state, new_conv_state
