"""XLA backend: the portable chunkwise gated delta rule in jax.numpy (any JAX device).

Scalar gates (and masks) take the chunkwise path of `gdngen.chunkwise`, whose hand-derived
backward (recomputation, straddle-sum gate rule) is wired in with ``jax.custom_vjp``. Vector gates take `sequential_gated_delta`, a float32
``lax.scan`` recurrence (also the benchmark baseline).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from gdngen import chunkwise


class XP:
    """The array namespace `gdngen.chunkwise` expects, over jax.numpy (float32)."""

    exp, log, where, sum, stack, swapaxes = jnp.exp, jnp.log, jnp.where, jnp.sum, jnp.stack, jnp.swapaxes
    concatenate = jnp.concatenate

    @staticmethod
    def cumsum(x, axis, reverse=False):
        if reverse:
            return jnp.flip(jnp.cumsum(jnp.flip(x, axis), axis), axis)
        return jnp.cumsum(x, axis)

    @staticmethod
    def scan(f, carry, xs, reverse):
        return jax.lax.scan(f, carry, xs, reverse=reverse)

    @staticmethod
    def zeros(shape):
        return jnp.zeros(shape, jnp.float32)

    @staticmethod
    def eye(n):
        return jnp.eye(n, dtype=jnp.float32)

    @staticmethod
    def tril_mask(n, k):
        return np.tri(n, n, k, dtype=bool)


# ------------------------------------------------------------------ differentiable chunk core


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def chunk_core(q, k, v, gates, beta, S0, gate):
    """`gdngen.chunkwise.forward` in chunk layout -> (Y, S_final), with its hand-derived VJP."""
    Y, S_final, _ = chunkwise.forward(XP, q, k, v, gates, beta, S0, gate=gate)
    return Y, S_final


def _core_fwd(q, k, v, gates, beta, S0, gate):
    Y, S_final, S_in = chunkwise.forward(XP, q, k, v, gates, beta, S0, gate=gate)
    return (Y, S_final), (q, k, v, gates, beta, S_in)


def _core_bwd(gate, res, cotangents):
    dY, dS_final = cotangents
    return chunkwise.backward(XP, *res, dY, dS_final, gate=gate)


chunk_core.defvjp(_core_fwd, _core_bwd)


# ------------------------------------------------------------------------------ paths


def _to_chunks(x, N, C, heads_shape):
    """[B, T, H, ...] (T = N*C) -> [N, B, *heads_shape, C, ...]."""
    B, _, _, *rest = x.shape
    x = x.reshape((B, N, C) + tuple(heads_shape) + tuple(rest))
    nh = len(heads_shape)
    order = (1, 0) + tuple(range(3, 3 + nh)) + (2,) + tuple(range(3 + nh, x.ndim))
    return x.transpose(order)


def _from_chunks(y, T):
    """[N, B, Hk, r, C, Dv] -> [B, T, Hk*r, Dv]."""
    N, B, Hk, r, C, Dv = y.shape
    return y.transpose(1, 0, 4, 2, 3, 5).reshape(B, N * C, Hk * r, Dv)[:, :T]


@functools.partial(jax.jit, static_argnames=("scale", "gate", "chunk_size"))
def chunkwise_gated_delta(q, k, v, g, beta, initial_state, mask, *, scale, gate, chunk_size):
    """Chunkwise path for scalar gates. float32 in, float32 out; shapes as `gdngen.jax`.

    ``mask`` is None or bool [B, T]; a masked step folds into the gates (log g = 0, beta = 0) and
    its output is zeroed. T is padded to a multiple of the chunk with identity steps.
    """
    B, T, Hk, Dk = q.shape
    Hv, Dv = v.shape[2], v.shape[3]
    r = Hv // Hk
    C = chunk_size
    N = -(-T // C)
    identity_gate = 0.0 if gate == "log" else 1.0
    if mask is not None:
        g = jnp.where(mask[..., None], g, identity_gate)
        beta = jnp.where(mask[..., None], beta, 0.0)
    pad = N * C - T
    if pad:
        widths = lambda x: [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2)  # noqa: E731
        q, k, v, beta = (jnp.pad(x, widths(x)) for x in (q, k, v, beta))
        g = jnp.pad(g, widths(g), constant_values=identity_gate)
    qc = _to_chunks(q * scale, N, C, (Hk, 1))
    kc = _to_chunks(k, N, C, (Hk, 1))
    vc = _to_chunks(v, N, C, (Hk, r))
    gc = _to_chunks(g[..., None], N, C, (Hk, r))[..., 0]
    bc = _to_chunks(beta[..., None], N, C, (Hk, r))[..., 0]
    Y, S_final = chunk_core(qc, kc, vc, gc, bc, initial_state.reshape(B, Hk, r, Dv, Dk), gate)
    y = _from_chunks(Y, T)
    if mask is not None:
        y = jnp.where(mask[..., None, None], y, 0.0)
    return y, S_final.reshape(B, Hv, Dv, Dk)


@functools.partial(jax.jit, static_argnames=("scale", "gate"))
def sequential_gated_delta(q, k, v, g, beta, initial_state, mask=None, *, scale=1.0, gate="log"):
    """Per-step float32 ``lax.scan`` recurrence (vector gates; benchmark baseline). Shapes as API.

    Differentiated by JAX autodiff through the scan, so the backward stores one state per step.
    """
    B, T, Hk, Dk = q.shape
    Hv = v.shape[2]
    r = Hv // Hk
    a = jnp.exp(g) if gate == "log" else g
    if mask is not None:
        shape = (B, T) + (1,) * (a.ndim - 2)
        a = jnp.where(mask.reshape(shape), a, 1.0)
        beta = jnp.where(mask[..., None], beta, 0.0)
    q, k = (jnp.repeat(x, r, axis=2) for x in (q * scale, k))
    a = a[..., None, :] if a.ndim == 4 else a[..., None, None]  # broadcast over [Dv, Dk]

    def step(S, xs):
        q_t, k_t, v_t, a_t, beta_t = xs  # [B, Hv, ...]
        S = a_t * S
        delta = beta_t[..., None] * (v_t - jnp.einsum("bhvk,bhk->bhv", S, k_t))
        S = S + delta[..., None] * k_t[..., None, :]
        return S, jnp.einsum("bhvk,bhk->bhv", S, q_t)

    xs = tuple(jnp.moveaxis(x, 1, 0) for x in (q, k, v, a, beta))
    S, y = jax.lax.scan(step, initial_state, xs)
    y = jnp.moveaxis(y, 0, 1)
    if mask is not None:
        y = jnp.where(mask[..., None, None], y, 0.0)
    return y, S


# ------------------------------------------------------------------------------ battery


def runner(inputs, *, gate, dtype, chunk_size, scale):
    """Battery runner (docs/CONTRACT.md): forward + VJP through `gdngen.jax.gated_delta`."""
    from gdngen.jax import gated_delta

    jdt = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}[dtype]
    names = ("q", "k", "v", "g", "beta")
    args = [jnp.asarray(inputs[n], jdt) for n in names]
    S0 = inputs.get("initial_state")
    S0 = jnp.zeros((args[0].shape[0], args[2].shape[2], args[2].shape[3], args[0].shape[3]),
                   jnp.float32) if S0 is None else jnp.asarray(S0, jnp.float32)
    mask = inputs.get("mask")
    mask = None if mask is None else jnp.asarray(mask)

    def f(q, k, v, g, beta, s0):
        return gated_delta(q, k, v, g, beta, s0, mask=mask, scale=scale, gate=gate,
                           chunk_size=chunk_size)

    (y, S), vjp = jax.vjp(f, *args, S0)
    cot = (jnp.asarray(inputs["dy"], jdt), jnp.asarray(inputs["dfinal_state"], jnp.float32))
    grads = vjp(cot)
    out = {"y": y, "final_state": S}
    out.update(zip(("dq", "dk", "dv", "dg", "dbeta", "dinitial_state"), grads))
    return {n: np.asarray(x, np.float64) for n, x in out.items()}
