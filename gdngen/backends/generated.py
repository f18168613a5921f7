"""What the generated-kernel backends written in Python (`pallas_tpu`, `pallas_gpu`) share:
variant and problem checks, exec of a rendered source as a module, jitting its entry points for
top-level and nested calls, the custom-VJP core, the gate epilogue and the whole-sequence
entry."""

from __future__ import annotations

import linecache
import types

from gdngen import chunkwise
from gdngen.problem import check_call, dtype_name

# ------------------------------------------------------------------------------ checks


def check_scalar_problem(backend: str, input_dtypes: tuple, problem) -> None:
    """ValueError unless ``problem`` has scalar gates and one of ``input_dtypes``."""
    if problem.gate != "scalar":
        raise ValueError(f"Problem.gate must be 'scalar' for the {backend} backend (vector gates "
                         f"run on xla), got {problem.gate!r}")
    if problem.dtype not in input_dtypes:
        raise ValueError(f"Problem.dtype must be one of {input_dtypes} for the {backend} "
                         f"backend, got {problem.dtype!r}")


def variant_params(backend: str, names: tuple, variant) -> dict:
    """The params of ``variant``; ValueError for another backend or other parameter names."""
    if variant.backend != backend:
        raise ValueError(f"variant backend must be {backend!r}, got {variant.backend!r}")
    params = variant.as_dict()
    if sorted(params) != sorted(names):
        raise ValueError(f"{backend} variant params must be {names}, got {sorted(params)}")
    return params


def policy_tolerance(policy_tolerances: dict, variant, dtype: str) -> float:
    """Relative L2 error ``variant`` is validated at: its precision policy's tolerance, or the
    battery's tolerance for ``dtype`` when that is larger."""
    from gdngen.validate import tolerance as dtype_tolerance

    return max(dtype_tolerance(dtype), policy_tolerances[variant["precision"]])


def check_scalar_call(backend: str, input_dtypes: tuple, q, k, v, g, beta, initial_state, mask,
                      *, gate, scale):
    """`check_call` for a scalar-gate generated backend: ``(CallShape, input dtype name)``;
    ValueError for vector gates or a dtype outside ``input_dtypes``."""
    shape = check_call(q, k, v, g, beta, initial_state, mask, gate=gate, chunk_size=64,
                       scale=scale)
    if shape.vector_gate:
        raise ValueError(f"g has shape {tuple(g.shape)}, expected ({shape.B}, {shape.T}, "
                         f"{shape.Hv}): the {backend} backend implements scalar gates only")
    dtype = dtype_name(q)
    if dtype not in input_dtypes:
        raise ValueError(f"q has dtype {dtype}, expected one of {input_dtypes} for the "
                         f"{backend} backend")
    return shape, dtype


# ------------------------------------------------------------------------------ loading

#: XLA options for the interpret-mode executables on the host (compile time dominates there).
INTERPRET_COMPILER_OPTIONS = {"xla_backend_optimization_level": 0}


def exec_module(backend: str, name: str, source: str, sha: str) -> types.ModuleType:
    """A fresh module object holding the rendered ``source`` of file ``name`` (registered in
    linecache, so tracebacks show the generated lines)."""
    filename = f"<gdngen {backend} {sha[:16]} {name}>"
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    module = types.ModuleType(f"gdngen_{backend}_{sha[:16]}_{name.removesuffix('.py')}")
    module.__file__ = filename
    exec(compile(source, filename, "exec"), module.__dict__)  # noqa: S102 - our own rendering
    return module


def jit_pair(fn, static, interpret):
    """``(top-level jit, nested jit)`` of ``fn``: the first with `INTERPRET_COMPILER_OPTIONS`
    in interpret mode (jax accepts compiler options on top-level jits only)."""
    import jax

    options = INTERPRET_COMPILER_OPTIONS if interpret else None
    return (jax.jit(fn, static_argnames=static, compiler_options=options),
            jax.jit(fn, static_argnames=static))


def call_jitted(fns, *args, **kwargs):
    """Call the right one of a `jit_pair` for ``args`` (inside a trace: the nested one)."""
    import jax

    traced = any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(args))
    return fns[traced](*args, **kwargs)


# ------------------------------------------------------------------------------ calling


def custom_vjp_core(forward, backward):
    """``core(q, k, v, gates, beta, S0)`` (chunk layout) as a ``jax.custom_vjp`` from
    ``forward(primals) -> (outputs, saved)`` and ``backward(primals, saved, cotangents) ->
    cotangents of the primals``."""
    import jax

    @jax.custom_vjp
    def core(q, k, v, gates, beta, S0):
        return forward((q, k, v, gates, beta, S0))[0]

    def core_fwd(*primals):
        outputs, saved = forward(primals)
        return outputs, (primals, saved)

    def core_bwd(residuals, cotangents):
        primals, saved = residuals
        return backward(primals, saved, cotangents)

    core.defvjp(core_fwd, core_bwd)
    return core


def gate_cotangent(gates, gate, dD):
    """d(gates) from the kernels' decay-factor cotangent ``dD [..., C+1, C+1]`` by the
    straddle-sum rule of `gdngen.chunkwise` (exact at g = 0); gates ``[..., C]`` in their own
    convention (``gate`` "log" or "linear")."""
    import jax.numpy as jnp

    from gdngen.backends.xla import FLOAT32_MATMULS, XP

    with FLOAT32_MATMULS:  # the straddle sums are einsums
        if gate == "log":
            return chunkwise.decay_factors_log_vjp(XP, gates,
                                                   chunkwise.decay_factors(XP, gates), dD)
        D = chunkwise.decay_factors(XP, jnp.log(gates))
        return chunkwise.decay_factors_linear_vjp(XP, gates, D, dD)


def gated_delta(backend, q, k, v, g, beta, initial_state, *, mask, scale, gate, variant,
                templates_dir):
    """Whole-sequence call of a generated-kernel ``backend`` module (`pallas_tpu`,
    `pallas_gpu`): checks the call, loads ``variant``'s kernels and runs them through
    `gdngen.chunkwise.gated_delta` (masks, padding to the chunk, layouts) with the backend's
    custom-VJP core. Returns ``(y [B,T,Hv,Dv] in q's dtype, final_state float32)``.

    ``backend`` provides ``BACKEND``, ``INPUT_DTYPES``, ``interpret_mode()``,
    ``load_kernels(variant, problem, templates_dir=)`` and ``_core((sha256, interpret), gate,
    scale)``.
    """
    import jax.numpy as jnp

    from gdngen.backends.xla import XP
    from gdngen.dispatch import problem_of

    shape, dtype = check_scalar_call(backend.BACKEND, backend.INPUT_DTYPES, q, k, v, g, beta,
                                     initial_state, mask, gate=gate, scale=scale)
    backend.interpret_mode()  # decided (and warned about) at the caller's frame
    kernels = backend.load_kernels(variant, problem_of(shape, dtype), templates_dir=templates_dir)
    f32 = jnp.float32
    if initial_state is None:
        initial_state = jnp.zeros((shape.B, shape.Hv, shape.Dv, shape.Dk), f32)
    core = backend._core((kernels.sha256, kernels.interpret), gate, float(scale))
    y, state = chunkwise.gated_delta(
        XP, core, q, k.astype(q.dtype), v.astype(q.dtype), g.astype(f32), beta.astype(f32),
        initial_state.astype(f32), mask, scale=1.0, gate=gate,
        chunk_size=kernels.params["chunk"])
    return y.astype(q.dtype), state
