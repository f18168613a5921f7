"""JAX entry point: ``gdngen.jax.gated_delta`` (differentiable, jit-able). Never imports mlx."""

from __future__ import annotations

from gdngen import entry, jaxcompat, mixer
from gdngen.entry import Options

jaxcompat.require()  # the installed jax is in the supported range, else UnsupportedJax here

__all__ = ["gated_delta", "gated_delta_mixer"]


def gated_delta(q, k, v, g, beta, initial_state=None, *, mask=None, scale=1.0, gate="log",
                chunk_size=None, variant=None, context_axis=None, qk_norm=False, A_log=None,
                dt_bias=None, lower_bound=None, beta_activation=None, cu_seqlens=None,
                state_indices=None, output_state_indices=None, state_dtype="float32",
                return_states="final", checkpoint_every=None, conv_weight=None,
                conv_state=None, norm_weight=None, output_gate=None, norm_eps=1e-6,
                norm_gate="silu"):
    """Gated delta rule over a sequence; returns ``(y, final_state)``.

    q, k ``[B,T,Hk,Dk]``; v ``[B,T,Hv,Dv]`` (Hv a multiple of Hk; value head h reads key head
    h // (Hv/Hk)); g ``[B,T,Hv]`` (scalar gate) or ``[B,T,Hv,Dk]`` (vector gate); beta
    ``[B,T,Hv]``; initial_state ``[B,Hv,Dv,Dk]`` or None (zeros); mask ``[B,T]`` bool or None.
    ``gate="log"``: g is log-decay (<= 0, -inf = full reset); ``"linear"``: g in [0, 1].
    Recurrence ``S_t = g_t S_{t-1} + beta_t (v_t - g_t S_{t-1} k_t) k_t^T``,
    ``y_t = scale * S_t q_t``. y has q's dtype; final_state is float32; accumulation is float32.
    Scalar and vector gates run chunkwise (`chunk_size` steps per chunk).

    ``variant`` (a `gdngen.Variant`) runs exactly that variant; without it the tuned variant for
    this device and shape class runs, else the default variant of the device's generated
    backend when it implements the call, else the portable ``xla`` path. ``chunk_size``
    overrides the default variant's chunk.

    Many chips (`gdngen.sharding`): inside ``jax.shard_map`` each shard runs its own batch rows
    and GVA groups (q, k sharded over Hk; v, g, beta, initial_state over Hv, in contiguous
    blocks); under a ``jax.jit`` with inputs sharded over batch and/or heads the kernels run per
    shard. ``context_axis="seq"``, inside ``jax.shard_map`` with the time axis of q, k, v, g, beta
    and mask split in order over mesh axis ``"seq"``: ``initial_state`` enters shard 0 and the
    returned ``final_state`` (both replicated over that axis) leaves the last shard; ``y`` is
    the shard's own tokens.

    Layer inputs (`gdngen.algebra.layer_inputs`; the q/k norm and the gate are computed inside the
    chunk core, which keeps only the raw arrays, also per shard under ``jax.shard_map`` and a
    sharded ``jax.jit`` (A_log and dt_bias then operands sharded like v's heads); the generated
    backends' kernels compute them in their loads; a packed row and a context-parallel call
    get them computed first; gradients reach the
    raw arrays): ``qk_norm=True`` L2-normalises q and k per head over Dk
    (``x * rsqrt(sum(x^2) + 1e-6)``); ``gate="softplus"`` takes g as the raw projection ``a``
    with ``A_log``, ``dt_bias`` ``[Hv]`` (per-channel g: ``[Hv]``, ``[Hv,1]`` or ``[Hv,Dk]``),
    ``log g = -exp(A_log) * softplus(a + dt_bias)``; ``gate="sigmoid_bound"``
    with ``lower_bound < 0``: ``log g = lower_bound * sigmoid(exp(A_log) * (a + dt_bias))``;
    ``beta_activation="sigmoid"``: beta given as logits. Inside ``jax.shard_map`` A_log and
    dt_bias are the shard's value heads, like v.

    Causal short convolution (the mixer's, `gdngen.mixer`): with ``conv_weight`` ``[C, K]``
    (``C = 2 Hk Dk + Hv Dv``, the channels of q, k, v in that order) q, k, v arrive raw and
    each goes through its channels' depthwise causal conv + SiLU first, its window starting
    with ``conv_state`` ``[B, C, K-1]`` (``[N, C, K-1]`` with ``cu_seqlens``, each sequence's
    window restarting with its own; zeros when None); masked steps' inputs are zeros.
    ffi_cpu's chunk forward computes it in its loads and its chunk core keeps only the raw q,
    k, v (the other backends, a packed row and the sharded paths get them convolved first).
    The new conv state is not returned: it is the last K-1 raw inputs
    (`gdngen.algebra.mixer.conv_new_state`). No ``context_axis``.

    Gated RMSNorm on the output (the mixer's, `gdngen.mixer`): with ``norm_weight`` ``[Dv]``
    and ``output_gate`` ``[B, T, Hv, Dv]`` the first output is ``rmsnorm(y) * norm_weight *
    act(output_gate)`` per value head (``norm_eps``; ``norm_gate`` "silu" or "sigmoid"), in
    q's dtype. A backend listing "norm" in its ``fused_inputs`` computes it in its forward
    kernels' stores when the call is not differentiated (the recurrent kernels of ffi_cpu and
    of pallas_tpu, the latter where a program holds a head's whole Dv); under
    differentiation y is kept for the norm's VJP, which keeps y, output_gate and norm_weight.

    Packed sequences (`gdngen.algebra.packed`): ``cu_seqlens`` int32 ``[N+1]`` (fla's offsets:
    ``cu_seqlens[0] == 0``, non-decreasing, ``cu_seqlens[-1] == T``; may be traced under
    ``jax.jit``, N static) splits the single row (B = 1) into N sequences, the state reset at
    each boundary; ``initial_state`` and the returned final state are then ``[N,Hv,Dv,Dk]``.
    Masks still apply; ``jax.vmap`` over a leading axis of rows (and of their offsets) works.

    Serving (`gdngen.state_pool`): ``state_indices`` int32 ``[B]`` (``[N]`` with
    ``cu_seqlens``) makes ``initial_state`` a pool ``[P,Hv,Dv,Dk]``: row b starts from
    ``pool[state_indices[b]]`` (a zero state for a negative index, a padding row that writes
    nothing) and the returned state is the pool with those rows replaced (in place under
    ``jax.jit`` with the pool donated); ``output_state_indices`` int32 ``[B]`` (``[N]``) writes
    row b's final state to ``pool[output_state_indices[b]]`` instead (nothing for a negative
    index), the rows read kept. ``state_dtype="bfloat16"`` stores the states (pool or
    ``initial_state``, and the returned one) in bfloat16; compute stays float32.
    ``return_states="steps"`` (speculative verify, `gdngen.algebra.states`): the state after
    every step, ``[B,T,Hv,Dv,Dk]``, in place of the final state; ``"chunks"`` with
    ``checkpoint_every=N`` (prefix caching; N a multiple of the chunk size): the states at
    t = N, 2N, ... before T and the final one, ``[B,ceil(T/N),Hv,Dv,Dk]``. Dense rows, no pool.

    Called eagerly (no argument traced, no ``context_axis``), the call runs as one compiled step
    (`gdngen.eager`): checked and dispatched in Python as always, then one cached ``jax.jit``.
    The body is `gdngen.entry.body`, as for ``load_tuned()``'s callable.
    """
    arrays, options = Options.split(locals())
    return entry.body("jax", arrays, options)


def gated_delta_mixer(mixed_qkv, conv_weight, a, b, z, *, Hk, Hv, Dk, Dv, A_log, dt_bias,
                      norm_weight, conv_state=None, initial_state=None, mask=None,
                      cu_seqlens=None, norm_eps=1e-6, scale=None, gate="softplus",
                      lower_bound=None, norm_gate="silu", chunk_size=None, variant=None,
                      return_states="final", allow_neg_eigval=False):
    """The whole gated-delta mixer (`gdngen.mixer`): causal short conv + SiLU, q/k L2 norm,
    gates, the recurrence, gated RMSNorm; returns ``(out [B,T,Hv,Dv], final_state,
    conv_state [B,C,K-1])`` (``return_states="steps"``: every step's state
    ``[B,T,Hv,Dv,Dk]`` in place of the final one). ``allow_neg_eigval``: beta = 2 sigmoid(b),
    in [0, 2] (OLMo hybrid). Differentiable in every array argument."""
    return mixer.gated_delta_mixer("jax", gated_delta, **locals())
