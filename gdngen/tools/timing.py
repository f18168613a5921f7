"""Time stage for the tuner: forward+backward wall time of variants at one target shape, and
the forward alone (`time_forward`, for the recurrent/chunkwise crossover).

`time_fwd_bwd` measures the gradient of ``sum(y * dy) + sum(final_state * dfinal_state)`` with
respect to q, k, v, g, beta and initial_state (log gate, ``scale = Dk ** -0.5``) for several
callables on the same inputs: each is warmed up first (the first run compiles), then the timed
runs are interleaved round-robin so that a load change on the machine hits every callable alike.
Every run is synchronised (``jax.block_until_ready`` / ``mx.eval``); the median is reported.

Precision policies are `gdngen.precision`'s; `time_fwd_bwd` runs under one.
"""

from __future__ import annotations

import functools
import gc
import statistics
import time
from dataclasses import dataclass, field

import numpy as np

from gdngen.precision import PRECISIONS, check_precision, precision_context  # noqa: F401
from gdngen.problem import Problem
from gdngen.shape import FRAMEWORKS, check_framework
from gdngen.variant import Variant


def make_inputs(problem: Problem, batch: int, seq_len: int, seed: int = 0) -> dict:
    """Float32 NumPy inputs of ``problem`` at ``[batch, seq_len]``: q, k (unit-norm per head), v,
    g (log-decay; ``[B,T,Hv]`` or ``[B,T,Hv,Dk]`` for a vector gate), beta, initial_state and
    the cotangents dy, dfinal_state."""
    if batch < 1 or seq_len < 1:
        raise ValueError(f"batch and seq_len must be >= 1, got {batch}, {seq_len}")
    rng = np.random.default_rng(seed)
    B, T, Hk, Hv, Dk, Dv = batch, seq_len, problem.Hk, problem.Hv, problem.Dk, problem.Dv

    def unit(shape):
        x = rng.standard_normal(shape)
        return x / np.linalg.norm(x, axis=-1, keepdims=True)

    gate_shape = (B, T, Hv, Dk) if problem.gate == "vector" else (B, T, Hv)
    arrays = {
        "q": unit((B, T, Hk, Dk)),
        "k": unit((B, T, Hk, Dk)),
        "v": rng.standard_normal((B, T, Hv, Dv)),
        "g": np.log(rng.uniform(0.9, 0.999, gate_shape)),
        "beta": rng.uniform(0.1, 0.9, (B, T, Hv)),
        "initial_state": 0.1 * rng.standard_normal((B, Hv, Dv, Dk)),
        "dy": rng.standard_normal((B, T, Hv, Dv)),
        "dfinal_state": rng.standard_normal((B, Hv, Dv, Dk)),
    }
    return {name: a.astype(np.float32) for name, a in arrays.items()}


def variant_fn(framework: str, variant: Variant):
    """``fn(q, k, v, g, beta, initial_state, *, scale, gate)`` running exactly ``variant`` through
    the framework's public ``gated_delta``."""
    check_framework(framework)
    if framework == "jax":
        from gdngen.jax import gated_delta
    else:
        from gdngen.mlx import gated_delta
    return functools.partial(gated_delta, variant=variant)


def sequential_fn(framework: str):
    """The sequential baseline of ``gdngen bench``: a float32 ``lax.scan`` for JAX, mlx_lm's
    per-step ``gated_delta_ops`` for MLX (given ``exp(g)`` and ``q * scale``)."""
    if framework == "jax":
        from gdngen.backends.portable.jax_chunkwise import sequential_gated_delta

        def baseline(q, k, v, g, beta, initial_state, *, scale, gate):
            f32 = [x.astype("float32") for x in (q, k, v, g, beta)]
            return sequential_gated_delta(*f32, initial_state, scale=scale, gate=gate)

        return baseline
    if framework == "mlx":
        import mlx.core as mx
        from mlx_lm.models.gated_delta import gated_delta_ops

        def baseline(q, k, v, g, beta, initial_state, *, scale, gate):
            linear = mx.exp(g) if gate == "log" else g
            return gated_delta_ops(q * scale, k, v, linear, beta, initial_state)

        return baseline
    raise ValueError(f"framework must be one of {FRAMEWORKS}, got {framework!r}")


@dataclass
class Timing:
    """Wall times of one callable: ``first_s`` the first (compiling) run, ``times_s`` the timed
    runs; ``median_s`` their median."""

    first_s: float
    times_s: list = field(default_factory=list)

    @property
    def median_s(self) -> float:
        return statistics.median(self.times_s)

    def to_json(self) -> dict:
        return {"first_s": self.first_s, "times_s": list(self.times_s),
                "median_s": self.median_s}


def _jax_grad_fns(fns, problem, inputs):
    import jax
    import jax.numpy as jnp

    dtype = jnp.dtype(problem.dtype)
    args = tuple(jnp.asarray(inputs[n], dtype) for n in ("q", "k", "v", "g", "beta"))
    args += tuple(jnp.asarray(inputs[n]) for n in ("initial_state", "dy", "dfinal_state"))
    scale = problem.Dk ** -0.5
    calls = {}
    for name, fn in fns.items():
        def loss(q, k, v, g, beta, s0, dy, ds, fn=fn):
            y, s = fn(q, k, v, g, beta, s0, scale=scale, gate="log")
            return jnp.sum(y.astype(jnp.float32) * dy) + jnp.sum(s.astype(jnp.float32) * ds)

        grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4, 5)))
        calls[name] = functools.partial(grad, *args)
    return calls, jax.block_until_ready


def _mlx_grad_fns(fns, problem, inputs):
    import mlx.core as mx

    dtype = getattr(mx, problem.dtype)
    args = tuple(mx.array(inputs[n]).astype(dtype) for n in ("q", "k", "v", "g", "beta"))
    args += (mx.array(inputs["initial_state"]),)
    dy, ds = mx.array(inputs["dy"]), mx.array(inputs["dfinal_state"])
    mx.eval(args, dy, ds)
    scale = problem.Dk ** -0.5
    calls = {}
    for name, fn in fns.items():
        def loss(q, k, v, g, beta, s0, fn=fn):
            y, s = fn(q, k, v, g, beta, s0, scale=scale, gate="log")
            return mx.sum(y.astype(mx.float32) * dy) + mx.sum(s.astype(mx.float32) * ds)

        grad = mx.grad(loss, argnums=[0, 1, 2, 3, 4, 5])
        calls[name] = functools.partial(grad, *args)
    return calls, mx.eval


def time_fwd_bwd(framework: str, fns: dict, problem: Problem, *, batch: int, seq_len: int,
                 precision: str = "ieee", repeats: int = 3, warmup: int = 1,
                 seed: int = 0, settle: bool = False, inputs: dict | None = None,
                 call_inputs: dict | None = None) -> dict[str, Timing]:
    """Time forward+backward of each ``fns[name]`` (signature of `variant_fn`'s result) on the
    same inputs of ``problem`` at ``[batch, seq_len]``; returns ``{name: Timing}``.
    ``inputs``: the arrays of `make_inputs` made elsewhere (e.g. drawn on the accelerator,
    which is faster for large shapes than NumPy's generator), used instead of drawing them.
    ``call_inputs``: ``{name: {array name: array}}``, arrays that replace the shared ones for
    that callable alone (a packed row's per-sequence initial states and their cotangents).

    ``settle``: run each callable once, untimed, right before each of its timed runs, so it does
    not pay for what the callable before it left behind (a sequential baseline's gigabytes of
    buffers are released after it returns: measured here, the call after a 3 GB ``lax.scan``
    ran 3.5x slower than the one after that)."""
    builders = {"jax": _jax_grad_fns, "mlx": _mlx_grad_fns}
    build = builders[framework]
    if call_inputs:
        unknown = sorted(set(call_inputs) - set(fns))
        if unknown:
            raise ValueError(f"call_inputs names {unknown}, not among fns {sorted(fns)}")
        shared = build

        def per_call(fns, problem, inputs):  # the shared inputs, then each call's own
            calls, sync = shared({n: f for n, f in fns.items() if n not in call_inputs},
                                 problem, inputs)
            for name, own in call_inputs.items():
                calls.update(shared({name: fns[name]}, problem, {**inputs, **own})[0])
            return {n: calls[n] for n in fns}, sync
        build = per_call
    return _timed(build, framework, fns, problem, batch, seq_len, precision,
                  repeats, warmup, seed, settle, inputs)


def _jax_forward_fns(fns, problem, inputs):
    import jax
    import jax.numpy as jnp

    dtype = jnp.dtype(problem.dtype)
    args = tuple(jnp.asarray(inputs[n], dtype) for n in ("q", "k", "v", "g", "beta"))
    args += (jnp.asarray(inputs["initial_state"]),)
    scale = problem.Dk ** -0.5
    return {name: functools.partial(jax.jit(functools.partial(fn, scale=scale, gate="log")),
                                    *args) for name, fn in fns.items()}, jax.block_until_ready


def _mlx_forward_fns(fns, problem, inputs):
    import mlx.core as mx

    dtype = getattr(mx, problem.dtype)
    args = tuple(mx.array(inputs[n]).astype(dtype) for n in ("q", "k", "v", "g", "beta"))
    args += (mx.array(inputs["initial_state"]),)
    mx.eval(args)
    scale = problem.Dk ** -0.5
    return {name: functools.partial(fn, *args, scale=scale, gate="log")
            for name, fn in fns.items()}, mx.eval


def time_forward(framework: str, fns: dict, problem: Problem, *, batch: int, seq_len: int,
                 precision: str = "ieee", repeats: int = 3, warmup: int = 1,
                 seed: int = 0, inputs: dict | None = None) -> dict[str, Timing]:
    """Time the forward alone (no gradient: what generating text runs) of each ``fns[name]``
    with an incoming state, on the same inputs of ``problem`` at ``[batch, seq_len]``, jitted
    for JAX, eager for MLX (as models call it); interleaved like `time_fwd_bwd` (``inputs``
    likewise)."""
    builders = {"jax": _jax_forward_fns, "mlx": _mlx_forward_fns}
    return _timed(builders[framework], framework, fns, problem, batch, seq_len, precision,
                  repeats, warmup, seed, False, inputs)


def _timed(build, framework, fns, problem, batch, seq_len, precision, repeats, warmup, seed,
           settle, inputs=None):
    """`_interleaved` timings of the callables ``build(fns, problem, inputs)`` makes of
    ``fns`` on one set of inputs (``inputs``, else `make_inputs`'), under the framework's
    matmul ``precision``."""
    _check_timing(fns, repeats, warmup)
    if inputs is None:
        inputs = make_inputs(problem, batch, seq_len, seed)
    with precision_context(framework, precision):
        calls, sync = build(fns, problem, inputs)
        return _interleaved(calls, sync, repeats, warmup, settle)


def _check_timing(fns: dict, repeats: int, warmup: int) -> None:
    if repeats < 1 or warmup < 1:
        raise ValueError(f"repeats and warmup must be >= 1, got {repeats}, {warmup}")
    if not fns:
        raise ValueError("fns must name at least one callable")


def _interleaved(calls: dict, sync, repeats: int, warmup: int, settle: bool) -> dict:
    """``{name: Timing}`` of the zero-argument ``calls``: each warmed up (its first run timed as
    ``first_s``), then ``repeats`` rounds in a rotating order, every run synchronised."""
    timings = {}
    for name, call in calls.items():
        t0 = time.perf_counter()
        sync(call())
        timings[name] = Timing(first_s=time.perf_counter() - t0)
        for _ in range(warmup - 1):
            sync(call())
    names = list(calls)
    for r in range(repeats):
        for name in names[r % len(names):] + names[:r % len(names)]:  # rotate the order
            if settle:
                sync(calls[name]())
            t0 = time.perf_counter()
            sync(calls[name]())
            timings[name].times_s.append(time.perf_counter() - t0)
    return timings


def mlx_peak_memory(calls: dict) -> dict:
    """Per zero-argument MLX call (already warmed up): ``{"peak_bytes", "resident_bytes"}`` of
    one run after the caches are cleared and the peak reset."""
    import mlx.core as mx

    out = {}
    for name, call in calls.items():
        gc.collect()
        mx.clear_cache()
        resident = mx.get_active_memory()
        mx.reset_peak_memory()
        result = call()
        mx.eval(result)
        out[name] = {"peak_bytes": int(mx.get_peak_memory()), "resident_bytes": int(resident)}
        del result
    return out
