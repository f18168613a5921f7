"""Loading of generated Python kernel modules (the Pallas backends): exec a rendered source as a
module, and jit its entry points for top-level and nested calls."""

from __future__ import annotations

import linecache
import types

from gdngen import chunkwise
from gdngen.problem import check_call, dtype_name

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

    shape = check_call(q, k, v, g, beta, initial_state, mask, gate=gate, chunk_size=64,
                       scale=scale)
    if shape.vector_gate:
        raise ValueError(f"g has shape {tuple(g.shape)}, expected ({shape.B}, {shape.T}, "
                         f"{shape.Hv}): the {backend.BACKEND} backend implements scalar gates "
                         "only")
    dtype = dtype_name(q)
    if dtype not in backend.INPUT_DTYPES:
        raise ValueError(f"q has dtype {dtype}, expected one of {backend.INPUT_DTYPES} for the "
                         f"{backend.BACKEND} backend")
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
