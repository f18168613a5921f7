"""Loading of generated Python kernel modules (the Pallas backends): exec a rendered source as a
module, and jit its entry points for top-level and nested calls."""

from __future__ import annotations

import linecache
import types

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
