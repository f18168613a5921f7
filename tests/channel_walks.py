"""Checks of the generated backends' per-channel chunk walks (``chunk_walks``: kernels with the
contracts of `gdngen.algebra.chunkwise_channel.walk_forward` / ``walk_backward``), shared by the
pallas_tpu and pallas_gpu tests."""

from __future__ import annotations

import functools

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
    """The kernel walks against `gdngen.algebra.chunkwise_channel.walk_forward` / ``walk_backward``
    (the same float32 algebra) on the chunk-layout ``shape`` (N, B, Hk, r, C, Dk, Dv)."""
    (S0, U, Wk, Kc, Qd, Pm, dCC), (dSf, G, dY) = _walk_inputs(len(shape), *shape)
    got = walk_forward(XP, S0, U, Wk, Kc, Qd, Pm, dCC)
    want = chunkwise_channel.walk_forward(XP, S0, U, Wk, Kc, Qd, Pm, dCC)
    for name, a, b in zip(("Y", "S_final", "S_in", "W"), got, want):
        assert a.shape == b.shape and validate.relative_error(a, b) <= tol, name
    S_in, W = want[2:]
    got = walk_backward(XP, dSf, G, Kc, Wk, W, S_in, dY, Qd, dCC)
    want = chunkwise_channel.walk_backward(XP, dSf, G, Kc, Wk, W, S_in, dY, Qd, dCC)
    assert got[-1] is None and want[-1] is None
    for name, a, b in zip(("dS0", "dW", "dWk", "dQd", "dKc", "ddCC"), got, want):
        assert a.shape == b.shape and validate.relative_error(a, b) <= tol, name


def spy_chunk_walks(monkeypatch, backend):
    """Record every trace of ``backend``'s kernel walks (``backend`` its module; the
    ``chunk_walks`` hook of ``type(backend.SPEC)`` is replaced; new walk objects: jitted callers
    re-trace, whatever ran before): the list of "forward" / "backward" entries."""
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
