"""Checks shared by the backend tests (the conformance suite and the per-backend files)."""

from __future__ import annotations

import numpy as np

from gdngen import validate
from gdngen.algebra import reference
from gdngen.cases import Case


def small_call_inputs(B=1, T=20, Hk=1, Hv=2, D=16, seed=None):
    """q, k, v, log g, beta, initial state of a small call, drawn as the battery draws a case."""
    x = Case("entry_point", "small call", B, T, Hk, Hv, D, D, has_initial_state=True).inputs(seed)
    return x["q"], x["k"], x["v"], x["g_log"], x["beta"], x["initial_state"]


def check_entry_point_under_jit(variant, seed=None, D=16):
    """``gdngen.jax.gated_delta(variant=...)`` inside ``jax.jit`` (kernels inlined, padding to
    the chunk, a mask) against the float64 reference: y, the final state, dv and dg."""
    import jax
    import jax.numpy as jnp

    from gdngen.jax import gated_delta

    q, k, v, g, beta, s0 = small_call_inputs(D=D, seed=seed)
    mask = np.ones((1, 20), bool)
    mask[0, 3:6] = False
    scale = 0.25

    def loss(q, k, v, g, beta, s0):
        y, state = gated_delta(q, k, v, g, beta, s0, mask=jnp.asarray(mask), scale=scale,
                               variant=variant)
        return jnp.sum(y ** 2) + jnp.sum(state), (y, state)

    args = [jnp.asarray(x, jnp.float32) for x in (q, k, v, g, beta, s0)]
    grad = jax.jit(jax.value_and_grad(loss, argnums=(2, 3), has_aux=True))
    (_, (y, state)), (dv, dg) = grad(*args)
    ref_y, ref_state = reference.forward(q, k, v, g, beta, s0, mask=mask, scale=scale)
    assert validate.relative_error(y, ref_y) < 1e-5
    assert validate.relative_error(state, ref_state) < 1e-5
    ref = reference.vjp(q, k, v, g, beta, s0, 2 * ref_y, np.ones_like(ref_state), mask=mask,
                        scale=scale)
    assert validate.relative_error(dv, ref["dv"]) < 1e-5
    assert validate.relative_error(dg, ref["dg"]) < 1e-5
