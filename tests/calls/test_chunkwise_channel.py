"""The per-channel chunk algebra (`gdngen.algebra.chunkwise_channel`) piece by piece, against
float64 NumPy written from the definitions: the anchored factors are the gates' products over their
segments (bounded, exact zeros), the decayed products are sum_d x y d(t, j), the adjoint is the
transpose of the segment sums, and the whole chunk path matches the reference at strong decay
on both frameworks, with chunks smaller and larger than a sub-chunk. The battery cases run in
tests/calls/test_conformance.py."""

from __future__ import annotations

import numpy as np
import pytest
from slow import marked

from gdngen import validate
from gdngen.algebra import chunkwise_channel as cc
from gdngen.algebra import reference

jax = pytest.importorskip("jax")
jnp = jax.numpy
from gdngen.backends.portable.jax_chunkwise import XP

pytestmark = pytest.mark.usefixtures("unoptimized_xla")  # compile-bound: conftest


def _decays(a):
    """float64 d(t, j)[d] = prod_{j < m <= t} a_m[d] (0 above the diagonal), a [C, Dk]."""
    C = a.shape[0]
    out = np.zeros((C, C, a.shape[1]))
    for t in range(C):
        for j in range(t + 1):
            out[t, j] = np.prod(a[j + 1:t + 1], axis=0)
    return out


def _gates(rng, C, Dk):
    """Linear gates with strong decay on half the channels, exact zeros and exact ones."""
    log_a = -rng.uniform(0.0, 0.3, (C, Dk))
    log_a[:, ::2] = -rng.uniform(30.0, 40.0, (C, Dk // 2))
    log_a[rng.uniform(size=(C, Dk)) < 0.05] = -np.inf
    log_a[rng.uniform(size=(C, Dk)) < 0.1] = 0.0
    return np.exp(log_a)


@pytest.mark.parametrize("C, c", [(32, 8), (64, 16), (8, 8)])
def test_decayed_products_match_the_definition(C, c):
    rng = np.random.default_rng(C + c)
    Dk = 16
    a = _gates(rng, C, Dk)
    x, y = rng.standard_normal((2, C, Dk))
    blocks, (D0, DC, dCC) = cc.gate_factors(XP, jnp.asarray(a, jnp.float32), c)
    M = np.asarray(cc.decayed_products(XP, jnp.asarray(x, jnp.float32),
                                       jnp.asarray(y, jnp.float32), blocks))
    d = _decays(a)
    expected = np.einsum("td,jd,tjd->tj", x, y, d)
    assert np.abs(M[0] - expected).max() <= 1e-5 * np.abs(expected).max()
    assert np.all(np.triu(M[0], 1) == 0)
    start = np.cumprod(a, axis=0)
    np.testing.assert_allclose(np.asarray(D0), start, rtol=1e-5, atol=1e-30)
    np.testing.assert_allclose(np.asarray(DC), d[-1], rtol=1e-5, atol=1e-30)
    np.testing.assert_allclose(np.asarray(dCC), start[-1], rtol=1e-5, atol=1e-30)
    terms, diag = blocks
    bands = list(cc._pair_factors(XP, diag))
    for factor in (*terms[0], *bands, D0, DC, dCC):  # every factor a bounded product
        f = np.asarray(factor)
        assert np.all((f >= 0) & (f <= 1))
    for delta, band in enumerate(bands):  # band delta: d(t, t - delta) inside a sub-chunk
        for t in range(C):
            expected = d[t, t - delta] if t % c >= delta else np.zeros(Dk)
            np.testing.assert_allclose(np.asarray(band).reshape(C, Dk)[t], expected,
                                       rtol=1e-5, atol=1e-30)


def test_adjoint_is_the_transpose_of_the_segment_sums():
    """<adjoint(dF, dH, dL), b> = <(dF, dH, dL), segments(b)>, and the same for the
    in-sub-chunk bands, for random cotangents: the maps the gate gradient goes through (the
    straddle-sum rule) are exact."""
    rng = np.random.default_rng(0)
    C, c, Dk = 32, 8, 4
    b = jnp.asarray(rng.standard_normal((C, Dk)), jnp.float32)
    parts = cc.anchored_segments(XP, b, c)
    cotangents = [jnp.asarray(rng.standard_normal(p.shape), jnp.float32) for p in parts]
    n = C // c
    # only the meaningful entries: H below the block diagonal
    cotangents[1] = cotangents[1] * np.tri(n, n, -1)[:, :, None]
    lhs = float(jnp.sum(cc.anchored_sums_adjoint(XP, *cotangents) * b))
    rhs = sum(float(jnp.sum(d * p)) for d, p in zip(cotangents, parts))
    assert abs(lhs - rhs) <= 1e-4 * abs(rhs)
    bands = list(cc.pair_bands(XP, b.reshape(n, c, Dk), cc.SUM))[1:]
    d_bands = [jnp.asarray(rng.standard_normal(p.shape) * (np.arange(c) >= delta)[:, None],
                           jnp.float32) for delta, p in enumerate(bands, 1)]  # pairs in I
    lhs = float(jnp.sum(cc.pair_sums_adjoint(XP, d_bands) * b))
    rhs = sum(float(jnp.sum(d * p)) for d, p in zip(d_bands, bands))
    assert abs(lhs - rhs) <= 1e-4 * abs(rhs)
    c0, cc_, ccc = (jnp.asarray(rng.standard_normal(s), jnp.float32)
                    for s in ((C, Dk), (C, Dk), (Dk,)))
    s0, sc, scc = cc.chunk_segments(XP, b)
    lhs = float(jnp.sum(cc.chunk_sums_adjoint(XP, c0, cc_, ccc) * b))
    rhs = float(jnp.sum(c0 * s0) + jnp.sum(cc_ * sc) + jnp.sum(ccc * scc))
    assert abs(lhs - rhs) <= 1e-4 * abs(rhs)


@pytest.mark.parametrize("gate", marked(["log", "linear"], {"log"}))  # [linear] keeps it
def test_backward_by_chunk_groups_is_the_whole_backward(gate):
    """`cc.backward` with its chunk-local stages in groups of 2 of 3 chunks (a ragged last
    group) gives the cotangents of the ungrouped backward, for both gate conventions (the
    linear one with exact zero gates: the exact-zero rule runs per group). Each backward is
    compiled (one program instead of hundreds of eager ops, each compiled per shape)."""
    rng = np.random.default_rng(5)
    N, B, Hk, r, C, D = 3, 1, 2, 2, 4, 16
    f32 = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)
    q, k = f32(N, B, Hk, C, D) * 0.3, f32(N, B, Hk, C, D) * 0.3
    v, S0 = f32(N, B, Hk, r, C, D), f32(B, Hk, r, D, D)
    a = rng.uniform(0.2, 1.0, (N, B, Hk, r, C, D))
    a[rng.uniform(size=a.shape) < 0.03] = 0.0
    assert (a[:2] == 0).any() and (a[2:] == 0).any()  # exact zeros in both groups
    with np.errstate(divide="ignore"):
        gates = jnp.asarray(np.log(a) if gate == "log" else a, jnp.float32)
    beta = jnp.asarray(rng.uniform(0.1, 1.0, (N, B, Hk, r, C)), jnp.float32)
    _, _, residuals = jax.jit(lambda *x: cc.forward(XP, *x, gate=gate))(q, k, v, gates, beta, S0)
    dY, dS = f32(N, B, Hk, r, C, D), f32(B, Hk, r, D, D)
    args = (q, k, v, gates, beta, residuals, dY, dS)
    whole = jax.jit(lambda *x: cc.backward(XP, *x, gate=gate))(*args)
    grouped = jax.jit(lambda *x: cc.backward(XP, *x, gate=gate, chunk_group=2))(*args)
    assert len(grouped) == len(whole) == 6
    for name, x, y in zip(("dq", "dk", "dv", "dgates", "dbeta", "dS0"), grouped, whole):
        assert x.shape == y.shape, name
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-5,
                                   err_msg=name)


def _strong_problem(seed, T=45, Hk=1, Hv=2, D=16):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((1, T, Hk, D))
    k = rng.standard_normal((1, T, Hk, D))
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    v = rng.standard_normal((1, T, Hv, D))
    with np.errstate(divide="ignore"):  # log 0 = -inf: the exact zero gates
        g = np.log(np.stack([_gates(rng, T, D) for _ in range(Hv)], axis=1))[None]
    beta = rng.uniform(0.1, 1.0, (1, T, Hv))
    s0 = rng.standard_normal((1, Hv, D, D))
    return q, k, v, g, beta, s0, rng.standard_normal((1, T, Hv, D)), rng.standard_normal(s0.shape)


@pytest.mark.parametrize("framework, chunk_size", [("jax", 16), ("mlx", 16), ("mlx", 4)])
@pytest.mark.parametrize("gate", ["log", "linear"])
def test_chunk_path_matches_reference_at_strong_decay_with_zeros(framework, chunk_size, gate):
    """Chunk 16 over T = 45 (a ragged tail), half the channels at log g ~ -35, exact zero and
    exact one gates; every gradient, dg in the call's own convention. MLX at chunk 4 has 12
    chunks: its backward runs in groups (`mlx_chunkwise.CHUNK_GROUP`) of 8 and 4 chunks."""
    q, k, v, g, beta, s0, dy, dS = _strong_problem(1)
    gates = g if gate == "log" else np.exp(g)
    ref = reference.vjp(q, k, v, gates, beta, s0, dy, dS, scale=0.25, gate=gate)
    params = {"scale": 0.25, "gate": gate, "chunk_size": chunk_size}
    if framework == "jax":
        from gdngen.backends.portable.jax_chunkwise import chunkwise_gated_delta

        args = [jnp.asarray(x, jnp.float32) for x in (q, k, v, gates, beta, s0)]
        out, vjp = jax.vjp(lambda *a: chunkwise_gated_delta(*a, None, **params), *args)
        grads = vjp((jnp.asarray(dy, jnp.float32), jnp.asarray(dS, jnp.float32)))
    else:
        mx = pytest.importorskip("mlx.core")
        from gdngen.backends.portable.mlx_chunkwise import chunkwise_gated_delta

        args = [mx.array(x.astype(np.float32)) for x in (q, k, v, gates, beta, s0)]
        out, grads = mx.vjp(lambda *a: chunkwise_gated_delta(*a, None, **params), args,
                            [mx.array(dy.astype(np.float32)), mx.array(dS.astype(np.float32))])
    names = ("dq", "dk", "dv", "dg", "dbeta", "dinitial_state")
    errors = {"y": validate.relative_error(np.array(out[0]), ref["y"]),
              "final_state": validate.relative_error(np.array(out[1]), ref["final_state"])}
    errors.update({n: validate.relative_error(np.array(x), ref[n]) for n, x in zip(names, grads)})
    assert max(errors.values()) < 5e-6, errors
    if gate == "log":  # d/d log g is exactly 0 where the gate is an exact 0
        assert np.all(np.array(grads[3])[np.isneginf(g)] == 0)
