"""A process's first gated-delta call (tests/test_firstuse.py runs it as a script): a jitted
fwd+bwd through ``gdngen.jax.gated_delta`` on the attached CPU (its default generated backend,
ffi_cpu), compared with the float64 reference. Prints one JSON line: the first-use checks this
process ran, its warnings, and the relative errors of y, the final state and the gradients.
``argv[1]``: seconds to sleep before the call (lines processes up for a race)."""

from __future__ import annotations

import json
import sys
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np

import gdngen.jax
from gdngen import firstuse
from gdngen.algebra import reference
from gdngen.validate import relative_error

B, T, Hk, Hv, Dk, Dv = 1, 40, 1, 2, 16, 16


def main() -> None:
    checks = []
    real = firstuse.check
    firstuse.check = lambda *a, **k: checks.append(a[2]) or real(*a, **k)
    rng = np.random.default_rng(7)
    k = rng.standard_normal((B, T, Hk, Dk))
    x = {"q": rng.standard_normal((B, T, Hk, Dk)), "k": k / np.linalg.norm(k, axis=-1,
                                                                            keepdims=True),
         "v": rng.standard_normal((B, T, Hv, Dv)), "g": -rng.uniform(0.01, 0.5, (B, T, Hv)),
         "beta": rng.uniform(0.1, 0.9, (B, T, Hv)), "s0": rng.standard_normal((B, Hv, Dv, Dk))}
    dy, ds = rng.standard_normal((B, T, Hv, Dv)), rng.standard_normal((B, Hv, Dv, Dk))

    def loss(q, k, v, g, beta, s0):
        y, s = gdngen.jax.gated_delta(q, k, v, g, beta, s0, scale=Dk ** -0.5)
        return jnp.sum(y * dy) + jnp.sum(s * ds), (y, s)

    time.sleep(float(sys.argv[1]) if len(sys.argv) > 1 else 0.0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        args = [jnp.asarray(x[n], jnp.float32) for n in ("q", "k", "v", "g", "beta", "s0")]
        (_, (y, s)), grads = jax.jit(jax.value_and_grad(loss, argnums=range(6),
                                                        has_aux=True))(*args)
    ref = reference.vjp(*(x[n] for n in ("q", "k", "v", "g", "beta", "s0")), dy, ds,
                        scale=Dk ** -0.5, gate="log")
    names = ("dq", "dk", "dv", "dg", "dbeta", "dinitial_state")
    errors = {"y": relative_error(y, ref["y"]), "final_state": relative_error(s, ref[
        "final_state"]), **{n: relative_error(gr, ref[n]) for n, gr in zip(names, grads)}}
    print(json.dumps({"checks": checks, "errors": errors,
                      "warnings": [str(w.message) for w in caught
                                   if w.category is firstuse.FirstUseWarning]}))


if __name__ == "__main__":
    main()
