"""Checks of the generated backends' per-channel chunk kernels, shared by the pallas_tpu,
pallas_gpu and metal tests: the chunk walks (``chunk_walks``: the contracts of
`gdngen.algebra.chunkwise_channel.walk_forward` and
`gdngen.backends.pallas.core.channel_walk_backward`), the forward's intra-chunk stages
(``channel_intra``) and their VJP against the algebra's in float64."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from gdngen import settings, validate
from gdngen.algebra import chunkwise_channel
from gdngen.backends.portable.jax_chunkwise import XP


def _walk_inputs(seed, N, B, Hk, r, C, Dk, Dv):
    """Chunk-layout inputs of `gdngen.algebra.chunkwise_channel`'s walks (decays in [0, 1], an exact
    0 and an exact 1 column), with the cotangents of the reverse walk."""
    rng = np.random.default_rng(seed)

    def normal(*shape, size=1.0):
        return jnp.asarray(size * rng.standard_normal(shape), jnp.float32)

    head = (N, B, Hk, r)
    dcc = rng.uniform(0.0, 1.0, head + (Dk,))
    dcc[..., 0], dcc[..., 1] = 0.0, 1.0
    forward = (normal(B, Hk, r, Dv, Dk), normal(*head, C, Dv), normal(*head, C, Dk, size=0.1),
               normal(*head, C, Dk, size=0.1), normal(*head, C, Dk), normal(*head, C, C),
               jnp.asarray(dcc, jnp.float32))
    return forward, (normal(B, Hk, r, Dv, Dk), normal(*head, C, Dv), normal(*head, C, Dv))


def check_walks_match_the_portable_walks(walk_forward, walk_backward, shape, tol=1e-6):
    """The kernel walks against `gdngen.algebra.chunkwise_channel.walk_forward` (the same
    float32 algebra) and, by `check_walk_backward_matches_the_float64_walk`, the reverse walk
    on the chunk-layout ``shape`` (N, B, Hk, r, C, Dk, Dv)."""
    (S0, U, Wk, Kc, Qd, Pm, dCC), _ = _walk_inputs(len(shape), *shape)
    got = walk_forward(XP, S0, U, Wk, Kc, Qd, Pm, dCC)
    want = chunkwise_channel.walk_forward(XP, S0, U, Wk, Kc, Qd, Pm, dCC)
    for name, a, b in zip(("Y", "S_final", "S_in", "W"), got, want):
        assert a.shape == b.shape and validate.relative_error(a, b) <= tol, name
    check_walk_backward_matches_the_float64_walk(walk_backward, shape, tol)


def check_walk_backward_matches_the_float64_walk(walk_backward, shape, tol=1e-6, scale=0.7):
    """``walk_backward(dS_final, Pm, q, k, gates, Wk, W, S_in, dY, *, gate, scale)`` (float32
    arrays, q unscaled: `gdngen.backends.pallas.core.channel_walk_backward`'s contract, which
    forms G = Pm^T dY and the decayed keys from Pm, q, k and the gates) against that reference
    in float64, both conventions, gates with exact zeros and log g = -37, on the chunk-layout
    ``shape`` (N, B, Hk, r, C, Dk, Dv): dS0, dW, dWk, dQd, dKc, ddCC each finite and within
    ``tol`` (relative L2)."""
    from gdngen.backends.pallas.core import channel_walk_backward

    (S0, U, Wk, Kc, Qd, Pm, dCC), (dSf, _, dY) = _walk_inputs(len(shape), *shape)
    _, _, S_in, W = chunkwise_channel.walk_forward(XP, S0, U, Wk, Kc, Qd, Pm, dCC)
    for gate in ("log", "linear"):
        q, k, _, gates, _ = _intra_inputs(len(shape) + 1, *shape, gate)
        arrays = [np.asarray(x, np.float32) for x in (dSf, Pm, q, k, gates, Wk, W, S_in, dY)]
        got = walk_backward(*(jnp.asarray(x) for x in arrays), gate=gate, scale=scale)
        with jax.enable_x64(True):
            want = channel_walk_backward(*(jnp.asarray(x, jnp.float64) for x in arrays),
                                         gate=gate, scale=scale)
            want = [None if x is None else np.asarray(x) for x in want]
        assert got[-1] is None and want[-1] is None
        for name, a, b in zip(("dS0", "dW", "dWk", "dQd", "dKc", "ddCC"), got, want):
            a = np.asarray(a)
            assert a.shape == b.shape and np.isfinite(a).all(), (gate, name)
            assert validate.relative_error(a, b) <= tol, (gate, name,
                                                           validate.relative_error(a, b))


def _intra_inputs(seed, N, B, Hk, r, C, Dk, Dv, gate):
    """Chunk-layout inputs of the intra-chunk stages: gates in [0.3, 1] with strong decay (log
    g = -37) and exact zeros (log g = -inf / g = 0) on some channels of some steps, in the
    convention ``gate``; beta in [0, 2]."""
    rng = np.random.default_rng(seed)
    q, k = (rng.standard_normal((N, B, Hk, C, Dk)) / 4 for _ in range(2))
    v = rng.standard_normal((N, B, Hk, r, C, Dv))
    log_g = np.log(rng.uniform(0.3, 1.0, (N, B, Hk, r, C, Dk)))
    log_g[0, ..., 0, C // 3, : Dk // 2] = -np.inf  # an exact zero on half the channels
    log_g[-1, ..., -1, C // 2: C // 2 + 3, 1] = -37.0  # strong decay
    log_g[..., C - 1, Dk - 1] = -np.inf  # the chunks' last steps, one channel
    beta = rng.uniform(0.0, 2.0, (N, B, Hk, r, C))
    gates = log_g if gate == "log" else np.exp(log_g)
    return q, k, v, gates, beta


def check_intra_matches_the_float64_stages(intra, shape, gate, scale, tol=2e-6):
    """``intra(q, k, v, gates, beta)`` (a backend's ``channel_intra``, float32) against
    `gdngen.algebra.chunkwise_channel`'s stages before the walk (its decay factors, decayed
    products and WY form) in float64 on the chunk-layout ``shape`` (N, B, Hk, r, C, Dk, Dv):
    U, Wk, Kc, Qd, Pm, M_kk, T and dCC, each finite and within ``tol`` (relative L2)."""
    inputs = _intra_inputs(len(shape) + (gate == "log"), *shape, gate)
    got = intra(*(jnp.asarray(x, jnp.float32) for x in inputs))
    q, k, v, gates, beta = inputs
    C = shape[4]
    with jax.enable_x64(True):
        q, k, v, gates, beta = (jnp.asarray(x, jnp.float64) for x in inputs)
        blocks, (D0, DC, dCC) = chunkwise_channel._factors(XP, gates, gate, C)
        Tinv, U, Wk, Mkk = chunkwise_channel._wy(XP, k, v, beta, blocks, D0, 8)
        Pm = chunkwise_channel.decayed_products(XP, q * scale, k, blocks)
        want = (U, Wk, k[..., None, :, :] * DC, q[..., None, :, :] * scale * D0, Pm, Mkk, Tinv,
                dCC)
        want = [np.asarray(x) for x in want]
    for name, a, b in zip(("U", "Wk", "Kc", "Qd", "Pm", "Mkk", "Tinv", "dCC"), got, want):
        assert a.shape == b.shape, (name, a.shape, b.shape)
        assert np.isfinite(np.asarray(a)).all(), name
        assert validate.relative_error(a, b) <= tol, (name, validate.relative_error(a, b))


def check_grads_match_the_float64_stages(grads, shape, gate, scale, tol=2e-6):
    """``grads(q, k, v, gates, beta, W, Tinv, Mkk, dY, dW, dWk, dQd, dKc, ddCC)`` (a backend's
    ``channel_grads``, float32) against `gdngen.algebra.chunkwise_channel.backward_in_chunks`
    in float64 on the chunk-layout ``shape`` (N, B, Hk, r, C, Dk, Dv): the forward's T and
    M_kk of `_intra_inputs`' gates (exact zeros, two in one sub-chunk of a channel under
    ``gate="linear"``: the exact-zero rule), random W and walk cotangents; dq (of the unscaled
    q), dk, dv, dgates, dbeta each finite and within ``tol`` (relative L2)."""
    N, B, Hk, r, C, Dk, Dv = shape
    q, k, v, gates, beta = _intra_inputs(len(shape) + 3, *shape, gate)
    zero = 0.0 if gate == "linear" else -np.inf
    gates[-1, ..., 0, 1, 2] = gates[-1, ..., 0, 4, 2] = zero  # two zeros in one segment
    rng = np.random.default_rng(len(shape))
    W, dY, dW = (rng.standard_normal((N, B, Hk, r, C, Dv)) for _ in range(3))
    dWk, dQd, dKc = (rng.standard_normal((N, B, Hk, r, C, Dk)) for _ in range(3))
    ddCC = rng.standard_normal((N, B, Hk, r, Dk))
    with jax.enable_x64(True):
        q64, k64, v64, g64, beta64 = (jnp.asarray(x, jnp.float64) for x in
                                      (q, k, v, gates, beta))
        blocks, (D0, _, _) = chunkwise_channel._factors(XP, g64, gate, C)
        Tinv, _, _, Mkk = chunkwise_channel._wy(XP, k64, v64, beta64, blocks, D0, 8)
        rest = (jnp.asarray(x) for x in (W, Tinv, Mkk, dY, dW, dWk, dQd, dKc, ddCC))
        want = chunkwise_channel.backward_in_chunks(XP, q64 * scale, k64, v64, g64, beta64,
                                                    *rest, gate=gate)
        want = [np.asarray(x) for x in want]
        Tinv, Mkk = np.asarray(Tinv), np.asarray(Mkk)
    want[0] = want[0] * scale  # the cotangent of the unscaled q
    got = grads(*(jnp.asarray(x, jnp.float32) for x in (q, k, v, gates, beta, W, Tinv, Mkk,
                                                         dY, dW, dWk, dQd, dKc, ddCC)))
    for name, a, b in zip(("dq", "dk", "dv", "dgates", "dbeta"), got, want):
        assert a.shape == b.shape, (name, a.shape, b.shape)
        assert np.isfinite(np.asarray(a)).all(), name
        assert validate.relative_error(a, b) <= tol, (name, validate.relative_error(a, b))


def spy_chunk_walks(monkeypatch, backend):
    """Record every trace of ``backend``'s kernel walks (``backend`` its module; the
    ``chunk_walks`` hook of ``type(backend.SPEC)`` is replaced; new walk objects: jitted callers
    re-trace, whatever ran before), and every call of its per-channel chunk core (its
    ``channel_core`` hook, likewise): the list of "forward" / "backward" / "intra" entries."""
    ran = []
    cls = type(backend.SPEC)
    original = cls.chunk_walks

    @functools.cache
    def spied(key):
        walk_forward, walk_backward = original(key)

        def forward(*args, **kwargs):
            ran.append("forward")
            return walk_forward(*args, **kwargs)

        def backward(*args, **kwargs):
            ran.append("backward")
            return walk_backward(*args, **kwargs)

        return forward, backward

    monkeypatch.setattr(cls, "chunk_walks", staticmethod(spied))
    original_core = cls.channel_core

    @functools.cache
    def spied_core(*key):
        core = original_core(*key)

        def recorded(*arrays):
            ran.append("intra")  # the core runs the intra-chunk kernel, then the walk
            return core(*arrays)

        return recorded

    monkeypatch.setattr(cls, "channel_core", staticmethod(spied_core))
    return ran


def check_battery_case_through_the_walks(monkeypatch, backend, variant, check):
    """vector_exact_zero (two chunks; per-channel exact zeros and ones on channels and whole
    steps, across the chunk edge; an initial state) with poisoned outputs: y, the final state
    and every gradient, dg in both conventions, through ``backend``'s kernel walks;
    ``check(results, variant, dtype)`` is the backend tests' tolerance check."""
    monkeypatch.setenv(settings.ENV_POISON_OUTPUTS, "1")
    ran = spy_chunk_walks(monkeypatch, backend)
    results = validate.run_battery(None, variant=variant, cases=["vector_exact_zero"])
    assert {"dg", "dg_linear", "y_other_path"} <= set(results[0].errors)
    check(results, variant, "float32")
    assert ran.count("forward") >= 2 and ran.count("backward") == 2  # log and linear gates
    assert ran.count("intra") >= 2  # the forward's intra-chunk stages in the kernel
