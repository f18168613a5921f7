"""What the two Pallas backends (`gdngen.backends.pallas.tpu`, `gdngen.backends.pallas.gpu`)
share: exec of a rendered source as a module, jitting its entry points for top-level and nested
calls, the gate epilogue, the dense call with its recurrent switch, the fused-input builds
(`render_fused`: the recurrent kernel and the scalar chunk forward kernels rendered to normalise
q, k and compute a parameterised gate in their loads, `gdngen.backends.kernel_inputs`), the
packed-row call (`render_packed`, `packed_gated_delta`: `gdngen.algebra.packed` on their packed
kernel builds), and `PallasBackend`, the base of both, whose hooks carry each one's layouts and
cotangent conventions."""

from __future__ import annotations

import linecache
import types

from gdngen.algebra import chunkwise
from gdngen.backend import Backend

# ------------------------------------------------------------------------------ loading



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


def load_fused(backend: str, rendered, inputs, params: dict, interpret, loaded: dict):
    """The fused build ``rendered`` (a Pallas backend's ``render_fused`` for ``inputs``, a
    `gdngen.backends.kernel_inputs.KernelInputs`) as modules, cached in ``loaded`` by (sha256,
    interpret): a namespace with ``recurrent``, ``run_recurrent`` and, where rendered,
    ``forward``, ``run_forward`` (a `jit_pair` with ``scale``/``interpret`` static), ``sha256``,
    ``variant``, ``problem``, ``params``, ``interpret``, ``context``."""
    key = (rendered.sha256, interpret)
    if key not in loaded:
        modules = {name.removesuffix(inputs.tag() + ".py"): exec_module(
            backend, name, source, rendered.sha256) for name, source in rendered.sources.items()}
        static = ("scale", "interpret")
        kernels = types.SimpleNamespace(
            recurrent=modules["recurrent"], sha256=rendered.sha256, variant=rendered.variant,
            problem=rendered.problem, params=params, interpret=interpret,
            context=inputs.context(),
            run_recurrent=jit_pair(modules["recurrent"].recurrent, static, interpret))
        if "forward" in modules:
            kernels.forward = modules["forward"]
            kernels.run_forward = jit_pair(modules["forward"].forward, static, interpret)
        loaded[key] = kernels
    return loaded[key]


def jit_pair(fn, static, interpret):
    """``(top-level jit, nested jit)`` of ``fn``: the first with `INTERPRET_COMPILER_OPTIONS`
    in interpret mode (jax accepts compiler options on top-level jits only)."""
    import jax

    options = INTERPRET_COMPILER_OPTIONS if interpret else None
    return (jax.jit(fn, static_argnames=static, compiler_options=options),
            jax.jit(fn, static_argnames=static))


def call_sequential_under_vmap(fns, *args, **static):
    """`call_jitted`, with ``jax.vmap`` of the call run as a loop over the mapped axis
    (``jax.custom_batching.sequential_vmap``): Mosaic's grid carries its own dimension
    semantics, which batching a ``pallas_call`` does not extend. Only the kernels' own calls
    go through this (inside the custom VJP, so nothing here is differentiated)."""
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
    """d(gates) from the kernels' decay-factor cotangent ``dD [..., C+1, C+1]`` by the
    straddle-sum rule of `gdngen.algebra.chunkwise` (exact at g = 0); gates ``[..., C]`` in their
    own convention (``gate`` "log" or "linear")."""
    import jax.numpy as jnp

    from gdngen.backends.portable.jax_chunkwise import FLOAT32_MATMULS, XP

    with FLOAT32_MATMULS:  # the straddle sums are einsums
        if gate == "log":
            return chunkwise.decay_factors_log_vjp(XP, gates,
                                                   chunkwise.decay_factors(XP, gates), dD)
        D = chunkwise.decay_factors(XP, jnp.log(gates))
        return chunkwise.decay_factors_linear_vjp(XP, gates, D, dD)


def gated_delta(backend, call, operands, variant, templates_dir=None):
    """A dense `gdngen.call.Call` on the chunk kernels of a Pallas ``backend`` (a
    `PallasBackend`): loads ``variant``'s kernels and runs them through
    `gdngen.algebra.chunkwise.gated_delta` (masks, padding to the chunk, layouts) with the backend's
    custom-VJP core (`PallasBackend.chunk_core`). Returns ``(y [B,T,Hv,Dv] in q's dtype,
    final_state float32)``.

    ``call.qk_norm``: q, k are raw; a parameterised gate: ``g`` is ``a`` with A_log and
    dt_bias (`gdngen.call.Operands.kernel_gates`). Either way the forward kernels of the fused
    build (`gdngen.backends.kernel_inputs.KernelInputs.of` the two; its ``fused_key``)
    normalise q, k and compute the log gate in their loads, and the backward recomputes both
    for the plain kernels (`custom_vjp_core` with ``forward_fuses``).
    """
    import jax.numpy as jnp

    from gdngen.backends.kernel_inputs import KernelInputs
    from gdngen.backends.portable.jax_chunkwise import XP

    shape, problem, gate = call.shape, call.problem, call.kernel_gate
    q, k, v, _, beta, initial_state, mask = operands[:7]
    backend.interpret_mode()  # decided (and warned about) at the caller's frame
    kernels = backend.load_kernels(variant, problem, templates_dir=templates_dir)
    inputs = KernelInputs.of(call.qk_norm, gate)
    fused_key = None
    if inputs.fused:
        fused = backend.load_fused_kernels(variant, problem, inputs, templates_dir=templates_dir)
        fused_key = (fused.sha256, fused.interpret)
    f32 = jnp.float32
    if initial_state is None:
        initial_state = jnp.zeros((shape.B, shape.Hv, shape.Dv, shape.Dk), f32)
    core = backend.chunk_core((kernels.sha256, kernels.interpret), gate, call.scale,
                              call.qk_norm, fused_key)
    y, state = chunkwise.gated_delta(
        XP, core, q, k.astype(q.dtype), v.astype(q.dtype),
        chunkwise.cast_gates(operands.kernel_gates(), f32), beta.astype(f32),
        initial_state.astype(f32), mask, scale=1.0, gate=gate,
        chunk_size=kernels.params["chunk_size"])
    return y.astype(q.dtype), state


def switched_gated_delta(backend, call, operands, variant, templates_dir=None):
    """A dense `gdngen.call.Call` on a Pallas ``backend`` (a `PallasBackend`) with its
    recurrent switch (`gdngen.config.recurrent_switch`): a scalar-gate call of T >= the
    variant's ``recurrent_below`` runs `gated_delta` (the chunk kernels). A shorter one
    evaluates through ``backend.recurrent(problem, q, k, v, decay, beta, S0, inputs, ...)``
    (``problem`` the call's `Problem`, ``inputs`` its
    `gdngen.backends.kernel_inputs.KernelInputs`; float32, masks folded) inside
    `gdngen.backends.portable.jax_chunkwise.recurrent_or_chunkwise`, whose VJP is the chunk path's
    on the same call. ``decay`` is the gate made a linear decay (exp(-inf) = 0, an exact reset),
    or with ``inputs.gate_form`` the `gdngen.algebra.chunkwise.ParameterGate`'s ``(a, A_log,
    dt_bias)`` (a = -inf on masked steps), which the fused recurrent kernel turns into the
    decay in its loads; with ``inputs.qk_norm`` q, k are raw, normalised there.

    Per-channel gates: the chunk path is `gdngen.algebra.chunkwise_channel` (through
    `gdngen.backends.portable.jax_chunkwise.chunkwise_gated_delta`, float32, the variant's chunk
    size and ``save_states``) with its chunk walks run by the variant's kernels,
    ``backend.chunk_walks((sha256, interpret))`` -> ``(walk_forward, walk_backward)`` of
    `gdngen.algebra.chunkwise_channel`'s contract; a call of T >= ``recurrent_below`` evaluates
    through it too, a shorter one through the recurrent kernel, and every differentiated call takes
    its VJP (`gdngen.algebra.chunkwise_channel.backward` with the kernel walks).

    ``call.qk_norm``: q, k are raw. The chunk path keeps only the raw ones: the scalar chunk
    kernels normalise them in their loads (`gated_delta`), the per-channel path inside its
    custom VJP (`gdngen.backends.portable.jax_chunkwise.chunk_core`); the recurrent kernel in its
    loads. A parameterised gate likewise: computed in the recurrent kernel's and the scalar chunk
    forward kernels' loads."""
    import jax.numpy as jnp

    from gdngen.backends.kernel_inputs import KernelInputs
    from gdngen.backends.portable import jax_chunkwise

    shape, problem, gate, qk_norm = call.shape, call.problem, call.kernel_gate, call.qk_norm
    chunked = backend.chunked(call, variant)
    if not shape.vector_gate and chunked:
        return gated_delta(backend, call, operands, variant, templates_dir)
    backend.interpret_mode()  # decided (and warned about) at the caller's frame
    q, k, v, _, beta, initial_state, mask = operands[:7]
    f32 = jnp.float32
    if initial_state is None:
        initial_state = jnp.zeros((shape.B, shape.Hv, shape.Dv, shape.Dk), f32)
    q32, k32, v32, beta32, s0 = (x.astype(f32) for x in (q, k, v, beta, initial_state))
    g32 = chunkwise.cast_gates(operands.kernel_gates(), f32)
    g32, beta32 = chunkwise.fold_mask(jax_chunkwise.XP, g32, beta32, mask, gate)

    if shape.vector_gate:
        kernels = backend.load_kernels(variant, problem, templates_dir=templates_dir)
        walks = backend.chunk_walks((kernels.sha256, kernels.interpret))

    inputs = KernelInputs.of(qk_norm, gate)

    def recurrent(q, k, v, g, beta, S0):  # the fused kernel: raw q, k and (a, A_log, dt_bias)
        if inputs.gate_form is None:
            g = chunkwise.linear_decay(jax_chunkwise.XP, g, gate)
        return backend.recurrent(problem, q, k, v, g, beta, S0, inputs, scale=call.scale,
                                 variant=variant, templates_dir=templates_dir)

    def chunkwise_call(q, k, v, g, beta, S0):  # float32 in and out, masks folded
        if shape.vector_gate:
            return jax_chunkwise.chunkwise_gated_delta(
                q, k, v, g, beta, S0, None, scale=call.scale, gate=gate,
                chunk_size=kernels.params["chunk_size"],
                save_states=kernels.params["save_states"], walks=walks, qk_norm=qk_norm)
        a, *parameters = g if isinstance(g, tuple) else (g,)
        chunk_operands = operands._replace(q=q.astype(call.dtype), k=k.astype(call.dtype),
                                           v=v.astype(call.dtype), g=a, beta=beta,
                                           initial_state=S0, mask=None)
        if parameters:
            chunk_operands = chunk_operands._replace(A_log=parameters[0],
                                                     dt_bias=parameters[1])
        y, state = gated_delta(backend, call, chunk_operands, variant, templates_dir)
        return y.astype(f32), state

    run = (chunkwise_call if chunked  # per-channel gates: evaluated on the chunk path too
           else jax_chunkwise.recurrent_or_chunkwise(recurrent, chunkwise_call))
    y, state = run(q32, k32, v32, g32, beta32, s0)
    if mask is not None:
        y = jnp.where(mask[..., None, None], y, 0.0)
    return y.astype(q.dtype), state


# ------------------------------------------------------------------------------ fused inputs


def render_fused(spec, variant, problem, names, inputs, *, templates_dir=None, context=None):
    """The fused build of a generated backend's kernels ``names`` (of ``spec``'s
    `render_plan`): each rendered with ``inputs.context()`` (a `gdngen.backends.kernel_inputs.
    KernelInputs` that fuses something) and ``context``'s additions (the constants its fused
    loads use), named ``<name><inputs.tag()>.py``. The runtime ``lower_bound`` reaches no
    source, so one build serves every bound; the plain render plan (nothing fused) is not
    touched, so a variant's sha256 and its tuned entries do not depend on the fused builds."""
    from gdngen.sources import Rendered, environment, sources_sha256

    if not inputs.fused:
        raise ValueError(f"inputs must fuse a qk norm or a gate, got {inputs!r}")
    spec.parse(variant)
    plan = spec.render_plan(variant, problem)
    env = environment(templates_dir)
    extra = dict(context or {}, **inputs.context())
    texts = {f"{name.removesuffix('.py')}{inputs.tag()}.py": env.get_template(plan[name][0]).render(
        **dict(plan[name][1], **extra)) for name in names}
    return Rendered(variant, problem, texts, sources_sha256(texts))


def fused_gate_operands(inputs, A_log, dt_bias, Hv: int, Dk: int, vector_gate: bool) -> tuple:
    """The gate operands a fused kernel takes after ``a`` (`gdngen.backends.kernel_inputs`):
    ``(A_log, dt_bias)`` float32 ``[Hv]`` (per head) or ``[Hv, Dk]`` (per channel), then for
    "sigmoid_bound" the runtime ``lower_bound`` as a float32 scalar array (an operand, so one
    compiled kernel serves every bound). Empty without a gate form."""
    import jax.numpy as jnp

    from gdngen.backends.kernel_inputs import kernel_parameters

    if inputs.gate_form is None:
        return ()
    parameters = kernel_parameters(jnp, A_log, dt_bias, Hv, Dk, vector_gate)
    if inputs.gate_form == "sigmoid_bound":
        return (*parameters, jnp.asarray(inputs.lower_bound, jnp.float32))
    return parameters


# ------------------------------------------------------------------------------ packed rows


def render_packed(spec, variant, problem, names, *, templates_dir=None, context=None):
    """The packed build (`gdngen.algebra.packed`) of a generated backend's chunk kernels: the
    sources
    ``names`` of ``spec``'s `render_plan` rendered with ``packed`` set (and ``context``'s
    overrides), as a `gdngen.sources.Rendered` under the names ``packed_<name>``. With
    ``packed`` unset the templates render the dense kernels byte for byte, so a dense variant's
    sha256 (and its tuned entries) do not depend on the packed build."""
    from gdngen.sources import Rendered, environment, sources_sha256

    spec.parse(variant)
    if problem.gate != "scalar":
        raise ValueError(f"{spec.name} has packed kernels for scalar gates only, got "
                         f"{problem.key()}")
    plan = spec.render_plan(variant, problem)
    env = environment(templates_dir)
    texts = {f"packed_{name}": env.get_template(plan[name][0]).render(
        **dict(plan[name][1], packed=True, **(context or {}))) for name in names}
    return Rendered(variant, problem, texts, sources_sha256(texts))


def render_steps(spec, variant, problem, *, templates_dir=None, context=None):
    """The per-step-states build (``return_states="steps"``) of a Pallas backend's recurrent
    kernel: ``recurrent.py`` of ``spec``'s `render_plan` rendered with ``steps`` set (and
    ``context``'s overrides) as ``recurrent_steps.py``; its second result is the state after
    every step ``[B, T, Hv, Dv, Dk]`` in place of the final state. With ``steps`` unset the
    template renders the recurrent kernel byte for byte (a variant's sha256 does not depend
    on this build)."""
    from gdngen.sources import Rendered, environment, sources_sha256

    spec.parse(variant)
    template, plan_context = spec.render_plan(variant, problem)["recurrent.py"]
    texts = {"recurrent_steps.py": environment(templates_dir).get_template(template).render(
        **dict(plan_context, steps=True, **(context or {})))}
    return Rendered(variant, problem, texts, sources_sha256(texts))


def load_steps(backend: str, rendered, params: dict, interpret, loaded: dict):
    """The build ``rendered`` (`render_steps`) as a module, cached in ``loaded`` by (sha256,
    interpret): a namespace with ``recurrent``, ``run_recurrent`` (a `jit_pair` with
    ``scale``/``interpret`` static), ``sha256``, ``variant``, ``problem``, ``params``,
    ``interpret``."""
    key = (rendered.sha256, interpret)
    if key not in loaded:
        module = exec_module(backend, "recurrent_steps.py",
                             rendered.sources["recurrent_steps.py"], rendered.sha256)
        loaded[key] = types.SimpleNamespace(
            recurrent=module, sha256=rendered.sha256, variant=rendered.variant,
            problem=rendered.problem, params=params, interpret=interpret,
            run_recurrent=jit_pair(module.recurrent, ("scale", "interpret"), interpret))
    return loaded[key]


def load_packed(backend: str, rendered, params: dict, interpret):
    """The packed build ``rendered`` (`render_packed`) of the Pallas backend ``backend`` as
    modules: a namespace with ``forward``, ``backward``, ``run_forward``, ``run_backward``
    (jitted with ``scale``/``interpret`` static, as `jit_pair`), ``sha256``, ``variant``,
    ``problem``, ``params``, ``interpret``; the backend adds its own further entry points."""
    fwd, bwd = (exec_module(backend, name, rendered.sources[name], rendered.sha256)
                for name in ("packed_forward.py", "packed_backward.py"))
    static = ("scale", "interpret")
    return types.SimpleNamespace(
        forward=fwd, backward=bwd, sha256=rendered.sha256, variant=rendered.variant,
        problem=rendered.problem, params=params, interpret=interpret,
        run_forward=jit_pair(fwd.forward, static, interpret),
        run_backward=jit_pair(bwd.backward, static, interpret))


def packed_gated_delta(backend, call, operands, variant, templates_dir=None):
    """A packed `gdngen.call.Call` (`gdngen.algebra.packed`, scalar gates) of a Pallas ``backend``
    (a `PallasBackend`): the row's chunk walk on its packed kernels, each sequence's one-chunk
    calls on its dense chunk path (`gated_delta`), float32 inside. Returns ``(y [1, T, Hv, Dv]
    in q's dtype, final_state [N, Hv, Dv, Dk] float32)``.

    ``backend.packed_core((sha256, interpret), gate)`` is a ``jax.custom_vjp`` ``(q, k, v,
    gates, beta, inject) -> (Y, S_in)`` in `gdngen.algebra.chunkwise`'s chunk layout (q already
    scaled, from a zero state, ``inject [M, 1, Hk, r, Dv, Dk]`` added to the state leaving each
    chunk, ``S_in`` the states entering the chunks), the `walk` core of
    `gdngen.algebra.packed.chunk_walk`."""
    import jax.numpy as jnp

    from gdngen.algebra import packed
    from gdngen.backends.portable.jax_chunkwise import XP

    gate = call.gate
    backend.interpret_mode()  # decided (and warned about) at the caller's frame
    # float32 throughout (as `packed.run_portable`): the packed and one-chunk kernels of the
    # float32 problem
    kernels = backend.load_packed_kernels(variant, call.replace(dtype="float32").problem,
                                          templates_dir=templates_dir)
    chunk = kernels.params["chunk_size"]

    def dense(q, k, v, g, beta, S0, mask):
        return gated_delta(backend, call.for_arrays(q, v, packed=False),
                           operands._replace(q=q, k=k, v=v, g=g, beta=beta, initial_state=S0,
                                             mask=mask, cu_seqlens=None),
                           variant, templates_dir)

    walk = packed.chunk_walk(XP, backend.packed_core((kernels.sha256, kernels.interpret), gate),
                             scale=call.scale, gate=gate, chunk_size=chunk)
    f32 = jnp.float32
    q, k, v, g, beta, initial_state, mask, _, _, cu_seqlens = operands
    y, state = packed.gated_delta(
        XP, dense, walk, *(x.astype(f32) for x in (q, k, v, g, beta)),
        None if initial_state is None else initial_state.astype(f32), mask, cu_seqlens,
        gate=gate, chunk_size=chunk)
    return y.astype(q.dtype), state


class PallasBackend(Backend):
    """What the two Pallas backends share: the dense call with its recurrent switch
    (`switched_gated_delta`) and the packed row (`packed_gated_delta`) written once over the
    hooks each backend module declares as public functions (looked up in the module when called,
    so a test may replace one): ``variant_space``, ``default_config``, the footprint named by
    ``footprint_function``, ``render_plan``, ``lower_check``, ``clear_cache``,
    ``interpret_mode()``, ``load_kernels`` / ``load_fused_kernels`` / ``load_packed_kernels``,
    ``chunk_core(key, gate, scale, qk_norm, fused_key)`` and ``packed_core(key, gate)`` (the
    custom-VJP cores in that backend's chunk layouts and cotangent conventions),
    ``chunk_walks(key)`` (the per-channel walks), ``entering_core(key, scale)`` (the chunk
    forward returning its entering states), ``recurrent_forward`` and
    ``recurrent_steps_forward`` (the per-step-states build, `render_steps`)."""

    framework = "jax"
    gates = tuned_gates = ("scalar", "vector")
    fused_inputs, packed_gates = ("qk_norm", "gate"), ("scalar",)
    step_states = chunk_states = ("scalar", "vector")
    footprint_function: str

    def __init__(self, module: str):
        self.module = module
        super().__init__()

    def _hook(self, name: str):
        import sys

        return getattr(sys.modules[self.module], name)

    def space(self, problem, device=None):
        return self._hook("variant_space")(problem, device)

    def default(self, problem, device=None):
        return self._hook("default_config")(problem, device)

    def footprint(self, variant, problem):
        return self._hook(self.footprint_function)(variant, problem)

    def render_plan(self, variant, problem):
        return self._hook("render_plan")(variant, problem)

    def lower_check(self, variant, problem, **options):
        return self._hook("lower_check")(variant, problem, **options)

    def clear_cache(self):
        self._hook("clear_cache")()

    def interpret_mode(self):
        return self._hook("interpret_mode")()

    def load_kernels(self, variant, problem, *, templates_dir=None):
        return self._hook("load_kernels")(variant, problem, templates_dir=templates_dir)

    def load_fused_kernels(self, variant, problem, inputs, *, templates_dir=None):
        return self._hook("load_fused_kernels")(variant, problem, inputs,
                                                templates_dir=templates_dir)

    def load_packed_kernels(self, variant, problem, *, templates_dir=None):
        return self._hook("load_packed_kernels")(variant, problem, templates_dir=templates_dir)

    def chunk_core(self, key, gate, scale, qk_norm=False, fused_key=None):
        return self._hook("chunk_core")(key, gate, scale, qk_norm, fused_key)

    def packed_core(self, key, gate):
        return self._hook("packed_core")(key, gate)

    def chunk_walks(self, key):
        return self._hook("chunk_walks")(key)

    def recurrent(self, problem, q, k, v, decay, beta, S0, inputs, *, scale, variant,
                  templates_dir=None):
        return self._hook("recurrent_forward")(q, k, v, decay, beta, S0, scale=scale,
                                               variant=variant, problem=problem,
                                               templates_dir=templates_dir, inputs=inputs)

    def forward(self, call, operands, variant, templates_dir=None):
        return switched_gated_delta(self, call, operands, variant, templates_dir)

    def steps(self, call, operands, variant, templates_dir=None):
        """Per-step states from the backend's `render_steps` build (its
        ``recurrent_steps_forward`` hook) through `gdngen.backends.generated.kernel_steps`."""
        from gdngen.backends import generated

        self.interpret_mode()  # decided (and warned about) at the caller's frame

        def recurrent(q, k, v, decay, beta, S0):
            return self._hook("recurrent_steps_forward")(
                q, k, v, decay, beta, S0, scale=call.scale, variant=variant,
                problem=call.problem, templates_dir=templates_dir)

        return generated.kernel_steps(call, operands, recurrent)

    def chunks(self, call, operands, variant, templates_dir=None):
        """Chunk-boundary states read from the chunk kernels' walk
        (`gdngen.backends.generated.kernel_chunks`): scalar gates the forward kernel of the
        variant's ``save_states`` build (its saved entering states, the ``entering_core``
        hook); per-channel gates the walk kernel (``chunk_walks``)."""
        from gdngen.backends import generated

        self.interpret_mode()  # decided (and warned about) at the caller's frame
        problem = call.problem
        if call.shape.vector_gate:
            kernels = self.load_kernels(variant, problem, templates_dir=templates_dir)
            C = kernels.params["chunk_size"]
            walk = self.chunk_walks((kernels.sha256, kernels.interpret))[0]
            chunk_forward = generated.walk_chunk_forward(call, C, walk)
        else:
            kernels = self.load_kernels(variant.replace(save_states=True), problem,
                                        templates_dir=templates_dir)
            C = kernels.params["chunk_size"]
            core = self._hook("entering_core")((kernels.sha256, kernels.interpret), call.scale)
            chunk_forward = generated.entering_forward(call, C, core, core_scales=True)
        return generated.kernel_chunks(call, operands, C, chunk_forward)

    def packed(self, call, operands, variant, templates_dir=None):
        return packed_gated_delta(self, call, operands, variant, templates_dir)

    def entry(self, q, k, v, g, beta, initial_state=None, *, mask=None, scale=1.0, gate="log",
              variant, templates_dir=None, qk_norm=False, cu_seqlens=None):
        """The module's ``gated_delta`` / ``packed_gated_delta``: arguments as
        `gdngen.call.of_kernel_args` takes them, run through `run`."""
        from gdngen import call as calls

        checked, operands = calls.of_kernel_args(
            "jax", q, k, v, g, beta, initial_state, mask, scale=scale, gate=gate,
            qk_norm=qk_norm, cu_seqlens=cu_seqlens)
        run = self.run if cu_seqlens is None else self.run_packed_kernels
        return run(checked, operands, variant, templates_dir=templates_dir)

    def packed_entry(self, q, k, v, g, beta, initial_state=None, *, mask=None, scale=1.0,
                     gate="log", variant, cu_seqlens, templates_dir=None):
        """The module's ``packed_gated_delta``: `entry` of a packed row."""
        return self.entry(q, k, v, g, beta, initial_state, mask=mask, scale=scale, gate=gate,
                          variant=variant, templates_dir=templates_dir, cu_seqlens=cu_seqlens)
