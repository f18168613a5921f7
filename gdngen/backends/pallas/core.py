"""Helpers of the two Pallas backends (`gdngen.backends.pallas.backend.PallasBackend`): exec of a
rendered source as a module, jitting its entry points for top-level and nested calls, the gate
cotangent and the fused builds' gate operands."""

from __future__ import annotations

import linecache
import types

from gdngen.algebra import chunkwise

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


def call_sequential_under_vmap(fns, *args, **static):
    """`call_jitted`, with ``jax.vmap`` of the call run as a loop over the mapped axis
    (``jax.custom_batching.sequential_vmap``: Mosaic's grid carries its own dimension
    semantics, which batching a ``pallas_call`` does not extend)."""
    import jax

    @jax.custom_batching.sequential_vmap
    def run(*arrays):
        return call_jitted(fns, *arrays, **static)

    return run(*args)


def call_jitted(fns, *args, **kwargs):
    """Call the right one of a `jit_pair` for ``args`` (inside a trace: the nested one)."""
    import jax

    traced = any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(args))
    return fns[traced](*args, **kwargs)


def gate_cotangent(gates, gate, dD):
    """d(gates) ``[..., C]`` (convention ``gate``: "log" or "linear") from the decay-factor
    cotangent ``dD [..., C+1, C+1]`` by the straddle-sum rule of `gdngen.algebra.chunkwise`
    (exact at g = 0)."""
    import jax.numpy as jnp

    from gdngen.backends.portable.jax_chunkwise import FLOAT32_MATMULS, XP

    with FLOAT32_MATMULS:  # the straddle sums are einsums
        if gate == "log":
            return chunkwise.decay_factors_log_vjp(XP, gates,
                                                   chunkwise.decay_factors(XP, gates), dD)
        D = chunkwise.decay_factors(XP, jnp.log(gates))
        return chunkwise.decay_factors_linear_vjp(XP, gates, D, dD)


def fused_gate_operands(inputs, A_log, dt_bias, Hv: int, Dk: int, vector_gate: bool) -> tuple:
    """The operands a fused kernel takes after ``a`` (`gdngen.backends.kernel_inputs`):
    ``(A_log, dt_bias)`` float32 ``[Hv]`` (``[Hv, Dk]`` per channel), then for
    "sigmoid_bound" ``lower_bound`` as a float32 scalar array. Empty without a gate form."""
    import jax.numpy as jnp

    from gdngen.backends.kernel_inputs import kernel_parameters

    if inputs.gate_form is None:
        return ()
    parameters = kernel_parameters(jnp, A_log, dt_bias, Hv, Dk, vector_gate)
    if inputs.gate_form == "sigmoid_bound":
        return (*parameters, jnp.asarray(inputs.lower_bound, jnp.float32))
    return parameters


def fused_gate_specs(inputs, Hv: int, Dk: int, vector_gate: bool) -> tuple:
    """``jax.ShapeDtypeStruct`` s of `fused_gate_operands` (for lowering a fused build)."""
    import jax
    import jax.numpy as jnp

    if not inputs.gate_form:
        return ()
    parameter = jax.ShapeDtypeStruct((Hv, Dk) if vector_gate else (Hv,), jnp.float32)
    bound = (jax.ShapeDtypeStruct((), jnp.float32),) if inputs.gate_form == "sigmoid_bound" else ()
    return (parameter, parameter, *bound)
