"""`PallasBackend`: the base of `gdngen.backends.pallas.tpu.PallasTPU` and
`gdngen.backends.pallas.gpu.PallasGPU`. It holds what the two share: the interpret-mode switch,
rendering and loading (plain, fused, packed and per-step builds, cached per backend by sha256
and interpret mode), the dense call with its recurrent switch, the packed row, the per-step and
chunk-boundary states, and the entry points. A subclass declares its layouts and kernels through
the hooks listed on the class."""

from __future__ import annotations

import contextlib
import inspect
import types

from gdngen.algebra import chunkwise, layer_inputs
from gdngen.backend import Backend
from gdngen.backends.kernel_inputs import QK_NORM_EPS, KernelInputs
from gdngen.backends.pallas.core import exec_module, fused_gate_operands, jit_pair
from gdngen.problem import Problem

#: ``jit_pair`` statics of a kernel taking a scale
SCALED = ("scale", "interpret")
#: the taps of a chunk forward's conv build (`PallasBackend.chunk_conv`): convs of up to this
#: many taps, zero taps first
CHUNK_CONV_TAPS = 4


class PallasBackend(Backend):
    """A generated Pallas backend. A subclass declares ``loaded`` (its process-wide dict of
    loaded builds), ``caches`` (its ``functools.cache`` cores, dropped by `clear_cache`),
    ``log_gate_floor`` and the hooks ``kernel_params``, ``render_plan``, ``lower_check``,
    ``default_interpret_mode()``, ``add_recompute(kernels)`` (the recomputing walk's entry
    point), ``chunk_core``, ``packed_core``, ``chunk_walks``, ``entering_core``,
    ``channel_core`` (per-channel gates: the intra-chunk kernel, then the walks) and
    ``run_recurrent``; ``packed_context`` / ``steps_context`` where its builds need more;
    ``holds_whole_head`` where its recurrent kernel has an output norm build ("norm" in
    ``fused_inputs``), ``chunk_norm`` where its chunk forward has one too (its walk's stores;
    ``chunk_conv`` where that build also convolves in its loads) and ``normed_chunk`` runs it;
    ``recurrent_conv`` where its recurrent kernel has a conv build."""

    framework = "jax"
    gates = tuned_gates = ("scalar", "vector")
    fused_inputs, packed_gates = ("qk_norm", "gate", "conv"), ("scalar", "vector")
    step_states = chunk_states = ("scalar", "vector")
    loaded: dict
    caches: tuple = ()
    log_gate_floor: float
    #: the recurrent kernel has a conv build (the causal conv + SiLU in its loads; "conv" in a
    #: `render_fused` of ``KernelInputs.conv``): short conv calls run it undifferentiated
    recurrent_conv: bool = False

    def __init__(self):
        self._interpret_override: list = []
        super().__init__()

    def holds_whole_head(self, variant, problem) -> bool:
        """Whether the recurrent kernel's programs each hold a value head's whole Dv (what its
        output norm build needs: the norm's mean is over Dv)."""
        return False

    def chunk_conv(self, variant, problem) -> bool:
        """Whether the chunk forward's norm build also has the causal conv in its loads
        (`render_fused` of a conv norm build renders it into forward.py; convs of up to
        `CHUNK_CONV_TAPS` taps)."""
        return False

    def differentiated_conv(self, variant, problem) -> bool:
        """Whether the scalar chunk core's forward (the one a differentiated conv call runs)
        convolves in its loads: the fused build of a conv call renders ``forward.py`` with the
        conv (`render_fused`), `chunk_forward` hands it the conv tuples (`chunk_core` with
        ``forward_convolves``), convs of up to `CHUNK_CONV_TAPS` taps."""
        return False

    def convolves_in_core_loads(self, call, variant) -> bool:
        """Whether a conv call's chunk core convolves in its forward kernel's loads:
        `differentiated_conv`, for convs of up to `CHUNK_CONV_TAPS` taps (what
        `chunk_forward` runs and `conv_path` says)."""
        return (call.conv_size is not None and call.conv_size <= CHUNK_CONV_TAPS
                and self.differentiated_conv(variant, call.problem))

    def convolves_in_chunk_loads(self, call, variant) -> bool:
        """Whether a conv call's chunk forward norm build convolves in its loads: `chunk_conv`,
        for convs of up to `CHUNK_CONV_TAPS` taps (what `normed_chunk_forward` runs and
        `conv_path` says)."""
        return (call.conv_size is not None and call.conv_size <= CHUNK_CONV_TAPS
                and self.chunk_conv(variant, call.problem))

    def chunk_norm(self, variant, problem) -> bool:
        """Whether the chunk forward has an output norm build for ``problem`` (`render_fused`
        renders forward.py with the norm; `normed_chunk` runs it)."""
        return False

    def norm_in_stores(self, call, variant) -> bool:
        """A norm build (`normalises`: "norm" in `fused_inputs`) for a variant whose programs
        hold a head's whole Dv: the recurrent kernel's for a short call; for a chunked call
        the chunk forward's where the backend has one (`chunk_norm`)."""
        return (call.norm_gate is not None and self.normalises(call)
                and self.holds_whole_head(variant, call.problem)
                and (not self.chunked(call, variant)
                     or self.chunk_norm(variant, call.problem)))

    def conv_path(self, call, variant) -> str:
        """The recurrent kernel's conv build (`recurrent_conv`, short calls of a conv over more
        than one tap), the chunk forward's norm build where it convolves (`chunk_conv`), and
        the chunk core's conv inside its custom VJP: in its forward kernel's loads where
        `convolves_in_core_loads`, else before its kernels."""
        if not self.takes_raw_conv(call):
            return super().conv_path(call, variant)
        if not self.chunked(call, variant):
            if self.recurrent_conv and call.conv_size > 1:
                return ("in the recurrent kernel's loads when not differentiated; "
                        "differentiated, before the kernels")
            return super().conv_path(call, variant)
        core = ("in the chunk core's forward kernel's loads (it keeps the raw q, k, v; its "
                "backward recomputes the conv)" if self.convolves_in_core_loads(call, variant)
                else "in the chunk core before its kernels (it keeps the raw q, k, v)")
        if self.norm_in_stores(call, variant) and self.convolves_in_chunk_loads(call, variant):
            return (f"in the chunk forward's loads when not differentiated (its norm build); "
                    f"differentiated, {core}")
        return core

    # ------------------------------------------------------------------ interpret mode

    def interpret_mode(self):
        """What the kernels run with: `default_interpret_mode`, or inside `interpreting` the
        value given there."""
        if self._interpret_override:
            return self._interpret_override[-1]
        return self.default_interpret_mode()

    @contextlib.contextmanager
    def interpreting(self, params):
        """Run the kernels with interpret mode ``params`` inside the block, whatever device is
        attached (False: the real lowering)."""
        self._interpret_override.append(params)
        try:
            yield params
        finally:
            self._interpret_override.pop()

    def clear_cache(self) -> None:
        """Drop every loaded build, the cores built on them and jax's compiled executables (a
        build calls this between variants)."""
        import jax

        self.loaded.clear()
        for cached in self.caches:
            cached.cache_clear()
        jax.clear_caches()

    # ------------------------------------------------------------------ rendering

    def packed_context(self, variant, problem) -> dict | None:
        """Template context overrides of the packed build (`render_packed`)."""
        return None

    def steps_context(self, variant, problem) -> dict | None:
        """Template context overrides of the per-step build (`render_steps`)."""
        return None

    def render_fused(self, variant, problem, inputs, *, templates_dir=None):
        """The fused build of ``inputs`` (a `gdngen.backends.kernel_inputs.KernelInputs` that
        fuses something): ``recurrent<tag>.py`` and, for scalar gates, ``forward<tag>.py``
        rendered with ``inputs.context()``; raw q, k and the raw gate projection with its
        parameters are taken, normalised / formed in the loads (scalar gates). A norm build
        renders the forward only where the backend's chunk forward has one (`chunk_norm`, a
        per-channel one too), without saved residuals (forward only). The plain render plan
        is not touched (a variant's sha256 does not depend on this build)."""
        from gdngen.sources import Rendered, environment, sources_sha256

        if not inputs.fused:
            raise ValueError(f"inputs must fuse a qk norm or a gate, got {inputs!r}")
        if inputs.conv and not self.recurrent_conv:
            raise ValueError(f"{self.name}'s recurrent kernel has no conv build")
        if inputs.norm and "norm" not in self.fused_inputs:
            raise ValueError(f"{self.name}'s recurrent kernel has no output norm build")
        # the forward: a scalar chunk forward's fused loads (a conv build's where the chunk
        # core's forward convolves, `differentiated_conv`), or a chunk norm build (with the
        # conv where `chunk_conv` holds)
        if inputs.norm:
            forward = self.chunk_norm(variant, problem) and (
                not inputs.conv or self.chunk_conv(variant, problem))
        else:
            forward = problem.gate != "vector" and (
                not inputs.conv or self.differentiated_conv(variant, problem))
        names = ("recurrent.py", "forward.py") if forward else ("recurrent.py",)
        self.parse(variant)
        plan = self.render_plan(variant, problem)
        env = environment(templates_dir)
        extra = {"qk_norm_eps": repr(QK_NORM_EPS), "log_gate_floor": repr(self.log_gate_floor),
                 **inputs.context(), **({"norm_dv": problem.Dv} if inputs.norm else {})}
        # a norm build's chunk forward runs undifferentiated: it keeps no residuals
        only_forward = {"save_states": False} if inputs.norm else {}
        if inputs.conv:
            only_forward["conv_taps"] = CHUNK_CONV_TAPS
        texts = {f"{name.removesuffix('.py')}{inputs.tag()}.py": env.get_template(
            plan[name][0]).render(**dict(plan[name][1], **extra,
                                         **(only_forward if name == "forward.py" else {})))
            for name in names}
        return Rendered(variant, problem, texts, sources_sha256(texts))

    def render_packed(self, variant, problem, *, templates_dir=None):
        """The packed build (`gdngen.algebra.packed`): ``forward.py`` and ``backward.py``
        rendered with ``packed`` set (and `packed_context`) as ``packed_<name>``: the chunk
        kernels' walks (per-channel gates: the chunk walks of `chunk_walks`) also take the
        states injected at chunk ends and the entering states' cotangent. Unset, the templates
        render the dense kernels byte for byte."""
        from gdngen.sources import Rendered, environment, sources_sha256

        self.parse(variant)
        context = self.packed_context(variant, problem)
        plan = self.render_plan(variant, problem)
        env = environment(templates_dir)
        texts = {f"packed_{name}": env.get_template(plan[name][0]).render(
            **dict(plan[name][1], packed=True, **(context or {})))
            for name in ("forward.py", "backward.py")}
        return Rendered(variant, problem, texts, sources_sha256(texts))

    def render_steps(self, variant, problem, *, templates_dir=None):
        """The per-step build (``return_states="steps"``): ``recurrent.py`` rendered with
        ``steps`` set (and `steps_context`) as ``recurrent_steps.py``; its second result is the
        state after every step ``[B, T, Hv, Dv, Dk]``."""
        from gdngen.sources import Rendered, environment, sources_sha256

        self.parse(variant)
        context = self.steps_context(variant, problem)
        template, plan_context = self.render_plan(variant, problem)["recurrent.py"]
        texts = {"recurrent_steps.py": environment(templates_dir).get_template(template).render(
            **dict(plan_context, steps=True, **(context or {})))}
        return Rendered(variant, problem, texts, sources_sha256(texts))

    # ------------------------------------------------------------------ loading

    def _namespace(self, rendered, modules: dict, interpret, **entries):
        return types.SimpleNamespace(
            **modules, sha256=rendered.sha256, variant=rendered.variant,
            problem=rendered.problem, params=self.kernel_params(rendered.variant,
                                                                rendered.problem),
            interpret=interpret, **entries)

    def _exec(self, rendered, name):
        return exec_module(self.name, name, rendered.sources[name], rendered.sha256)

    def load_kernels(self, variant, problem, *, templates_dir=None):
        """``variant`` rendered for ``problem`` and loaded (cached by sha256 and interpret
        mode): ``forward``/``backward``/``recurrent`` (the modules), ``run_forward``,
        ``run_backward``, ``run_recurrent`` (`jit_pair` s with ``scale``/``interpret`` static;
        vector gates: the chunk walks, the forward's with ``interpret`` only, ``run_intra`` and
        ``run_grads``, the intra-chunk stages and their VJP), the recomputing walk of
        `add_recompute`, ``sha256``, ``variant``, ``problem``, ``params``, ``interpret``."""
        rendered = self.render(variant, problem, templates_dir=templates_dir)
        interpret = self.interpret_mode()
        key = (rendered.sha256, interpret)
        if key not in self.loaded:
            fwd, bwd, rec = (self._exec(rendered, name)
                             for name in ("forward.py", "backward.py", "recurrent.py"))
            walk = ("interpret",) if problem.gate == "vector" else SCALED
            kernels = self._namespace(
                rendered, {"forward": fwd, "backward": bwd, "recurrent": rec}, interpret,
                run_recurrent=jit_pair(rec.recurrent, SCALED, interpret),
                run_forward=jit_pair(fwd.forward, walk, interpret),
                run_backward=jit_pair(bwd.backward, SCALED, interpret))
            if problem.gate == "vector":
                kernels.run_intra = jit_pair(fwd.intra, SCALED, interpret)
                kernels.run_grads = jit_pair(bwd.grads, SCALED + ("linear",), interpret)
            self.add_recompute(kernels)
            self.loaded[key] = kernels
        return self.loaded[key]

    def load_fused_kernels(self, variant, problem, inputs, *, templates_dir=None):
        """`render_fused`, loaded (cached as `load_kernels`): ``recurrent``, ``run_recurrent``
        and, for scalar gates, ``forward``, ``run_forward``; ``context``
        (``inputs.context()``) and the fields of `load_kernels`."""
        rendered = self.render_fused(variant, problem, inputs, templates_dir=templates_dir)
        interpret = self.interpret_mode()
        key = (rendered.sha256, interpret)
        if key not in self.loaded:
            modules = {name.removesuffix(inputs.tag() + ".py"): self._exec(rendered, name)
                       for name in rendered.sources}
            static = (SCALED + (("norm_eps",) if inputs.norm else ())
                      + (("conv_k",) if inputs.conv and "conv_k" in inspect.signature(
                          modules["recurrent"].recurrent).parameters else ()))
            kernels = self._namespace(rendered, modules, interpret, context=inputs.context(),
                                      run_recurrent=jit_pair(modules["recurrent"].recurrent,
                                                             static, interpret))
            if "forward" in modules and problem.gate == "vector":  # a per-channel norm build
                kernels.run_intra = jit_pair(modules["forward"].intra, SCALED, interpret)
                kernels.run_forward = jit_pair(modules["forward"].forward,
                                               ("interpret", "norm_eps"), interpret)
            elif "forward" in modules:
                kernels.run_forward = jit_pair(
                    modules["forward"].forward, SCALED + (("norm_eps",) if inputs.norm else ()),
                    interpret)
            self.loaded[key] = kernels
        return self.loaded[key]

    def load_packed_kernels(self, variant, problem, *, templates_dir=None):
        """`render_packed`, loaded (cached as `load_kernels`): ``forward``, ``backward``,
        ``run_forward``, ``run_backward`` (vector gates: the chunk walks, ``run_intra`` and
        ``run_grads`` as `load_kernels`'), the recomputing walk of
        `add_recompute`, ``packed`` True."""
        rendered = self.render_packed(variant, problem, templates_dir=templates_dir)
        interpret = self.interpret_mode()
        key = (rendered.sha256, interpret)
        if key not in self.loaded:
            fwd, bwd = (self._exec(rendered, name)
                        for name in ("packed_forward.py", "packed_backward.py"))
            walk = ("interpret",) if problem.gate == "vector" else SCALED
            kernels = self._namespace(rendered, {"forward": fwd, "backward": bwd}, interpret,
                                      run_forward=jit_pair(fwd.forward, walk, interpret),
                                      run_backward=jit_pair(bwd.backward, SCALED, interpret),
                                      packed=True)
            if problem.gate == "vector":
                kernels.run_intra = jit_pair(fwd.intra, SCALED, interpret)
                kernels.run_grads = jit_pair(bwd.grads, SCALED + ("linear",), interpret)
            self.add_recompute(kernels)
            self.loaded[key] = kernels
        return self.loaded[key]

    def load_steps_kernels(self, variant, problem, *, templates_dir=None):
        """`render_steps`, loaded (cached as `load_kernels`): ``recurrent``,
        ``run_recurrent``."""
        rendered = self.render_steps(variant, problem, templates_dir=templates_dir)
        interpret = self.interpret_mode()
        key = (rendered.sha256, interpret)
        if key not in self.loaded:
            module = self._exec(rendered, "recurrent_steps.py")
            self.loaded[key] = self._namespace(
                rendered, {"recurrent": module}, interpret,
                run_recurrent=jit_pair(module.recurrent, SCALED, interpret))
        return self.loaded[key]

    # ------------------------------------------------------------------ recurrent kernel

    def recurrent_forward(self, q, k, v, decay, beta, S0, *, scale, variant, problem=None,
                          templates_dir=None, inputs=None, norm=None, conv=None):
        """The recurrent kernel of ``variant``: forward only, nothing saved.

        float32, masks folded (decay 1, beta 0): q, k ``[B, T, Hk, Dk]`` (q unscaled), v
        ``[B, T, Hv, Dv]``, ``decay`` the linear decay ``[B, T, Hv]`` (``[B, T, Hv, Dk]`` per
        channel), beta ``[B, T, Hv]``, S0 ``[B, Hv, Dv, Dk]``; any T >= 1. Returns ``(y [B, T,
        Hv, Dv], S_T [B, Hv, Dv, Dk])`` of `gdngen.algebra.recurrent.recurrent_forward`.
        ``problem``: default the float32 one of these shapes. ``inputs`` (a
        `gdngen.backends.kernel_inputs.KernelInputs`) selects the fused build: raw q, k with
        ``qk_norm``; with ``gate_form`` ``decay`` is ``(a, A_log, dt_bias)``; with ``norm``
        (the activation) ``norm = (z [B, T, Hv, Dv], norm_weight [Dv], norm_eps)`` and y is the
        gated norm of the recurrence's output; with ``conv`` (a backend with `recurrent_conv`)
        q, k, v are raw and ``conv = (conv_weight [C, K], conv_state [B, C, K-1] or None)``
        (C = 2 Hk Dk + Hv Dv, the mixer's channels): the kernel convolves them in its loads."""
        inputs = KernelInputs() if inputs is None else inputs
        parameters = ()
        if inputs.gate_form is not None:
            if not (isinstance(decay, tuple) and len(decay) == 3):
                raise ValueError(f"decay must be the tuple (a, A_log, dt_bias) for gate_form="
                                 f"{inputs.gate_form!r}, got {type(decay).__name__}")
            decay, *parameters = decay
        per_channel = decay.ndim == 4
        if problem is None:
            problem = Problem(q.shape[2], v.shape[2], q.shape[3], v.shape[3], "float32",
                              "vector" if per_channel else "scalar")
        if per_channel != (problem.gate == "vector"):
            raise ValueError(f"decay has shape {tuple(decay.shape)}, which does not match the "
                             f"{problem.gate} gates of {problem.key()}")
        self.interpret_mode()  # decided (and warned about) before the kernels load
        if inputs.fused:
            kernels = self.load_fused_kernels(variant, problem, inputs,
                                              templates_dir=templates_dir)
        else:
            kernels = self.load_kernels(variant, problem, templates_dir=templates_dir)
        if parameters:
            parameters = fused_gate_operands(inputs, *parameters, problem.Hv, problem.Dk,
                                             per_channel)
        if (norm is None) != (inputs.norm is None):
            raise ValueError(f"norm (z, norm_weight, norm_eps) goes with inputs.norm, got "
                             f"{'None' if norm is None else 'arrays'} for {inputs!r}")
        if (conv is None) == inputs.conv:
            raise ValueError(f"conv (conv_weight, conv_state) goes with inputs.conv, got "
                             f"{'None' if conv is None else 'arrays'} for {inputs!r}")
        extra = {} if conv is None else {"conv": conv}
        if norm is not None:
            *arrays, eps = norm
            parameters, extra = (*parameters, *arrays), {**extra, "norm_eps": float(eps)}
        return self.run_recurrent(kernels, q, k, v, decay, beta, S0, parameters,
                                  scale=float(scale), what="recurrent", **extra)

    def recurrent_steps_forward(self, q, k, v, decay, beta, S0, *, scale, variant, problem,
                                templates_dir=None):
        """`recurrent_forward` (plain inputs) on the `render_steps` build: ``(y [B, T, Hv,
        Dv], states [B, T, Hv, Dv, Dk])``, float32."""
        self.interpret_mode()
        kernels = self.load_steps_kernels(variant, problem, templates_dir=templates_dir)
        return self.run_recurrent(kernels, q, k, v, decay, beta, S0, (), scale=float(scale),
                                  what="recurrent steps")

    # ------------------------------------------------------------------ calls

    def chunk_forward(self, call, operands, variant, templates_dir=None):
        """A dense `gdngen.call.Call` on the scalar chunk kernels through
        `gdngen.algebra.chunkwise.whole_sequence` with `chunk_core` (the fused build's forward where
        ``call`` has layer inputs): ``(y [B, T, Hv, Dv] in q's dtype, final_state float32)``.
        A conv call (``call.conv_size``): the core takes the raw q, k, v and convolves them
        itself (`conv_core`): in its forward kernel's loads where `differentiated_conv` holds,
        else before its kernels."""
        import jax.numpy as jnp

        from gdngen.backends.portable.jax_chunkwise import XP

        shape, problem, gate = call.shape, call.problem, call.core_gate
        q, k, v, _, beta, initial_state, mask = operands[:7]
        self.interpret_mode()  # decided (and warned about) at the caller's frame
        kernels = self.load_kernels(variant, problem, templates_dir=templates_dir)
        convolves = self.convolves_in_core_loads(call, variant)
        inputs = KernelInputs.of(call.qk_norm, gate, convolves)
        fused_key = None
        if inputs.fused:
            fused = self.load_fused_kernels(variant, problem, inputs,
                                            templates_dir=templates_dir)
            fused_key = (fused.sha256, fused.interpret)
        f32 = jnp.float32
        if initial_state is None:
            initial_state = jnp.zeros((shape.B, shape.Hv, shape.Dv, shape.Dk), f32)
        if call.conv_size is not None:
            core = self.chunk_core((kernels.sha256, kernels.interpret), gate, call.scale,
                                   call.qk_norm, fused_key, kernels.params["chunk_size"],
                                   *((True,) if convolves else ()))
            return self.conv_core(call, operands, core, initial_state)
        core = self.chunk_core((kernels.sha256, kernels.interpret), gate, call.scale,
                               call.qk_norm, fused_key)
        y, state = chunkwise.whole_sequence(
            XP, core, q, k.astype(q.dtype), v.astype(q.dtype),
            layer_inputs.cast_gates(operands.kernel_gates(), f32), beta.astype(f32),
            initial_state.astype(f32), mask, scale=1.0, gate=gate,
            chunk_size=kernels.params["chunk_size"])
        return y.astype(q.dtype), state

    def convolving_recurrent(self, call, operands, variant, templates_dir=None):
        """A short conv call (below ``recurrent_below``) on a backend with `recurrent_conv`:
        not differentiated, the recurrent kernel's conv build on the raw q, k, v (the conv,
        the q/k norm, the gate in its loads; where `norm_in_stores` holds, the gated norm in
        its stores: decode and short prefill in one launch); differentiated, `forward` of the
        call with q, k, v convolved first (`gdngen.prepare.convolved`), its value and VJP
        (`gdngen.backends.generated.undifferentiated`). Returns ``(y in q's dtype,
        final_state float32)``."""
        import jax.numpy as jnp

        from gdngen import prepare
        from gdngen.backends import generated
        from gdngen.backends.portable.jax_chunkwise import XP

        f32, dtype, gate, shape = jnp.float32, operands.q.dtype, call.core_gate, call.shape
        norm = call.norm_gate if call.norm_gate is not None and self.norm_in_stores(
            call, variant) else None
        inputs = KernelInputs.of(call.qk_norm, gate, True, norm)

        def plain(ops):
            return self.forward(*prepare.convolved(call, ops), variant, templates_dir)

        def fused(ops):
            g, beta = layer_inputs.fold_mask(XP, layer_inputs.cast_gates(ops.kernel_gates(), f32),
                                             ops.beta.astype(f32), ops.mask, gate)
            if inputs.gate_form is None:
                g = layer_inputs.linear_decay(XP, g, gate)
            S0 = (jnp.zeros((shape.B, shape.Hv, shape.Dv, shape.Dk), f32)
                  if ops.initial_state is None else ops.initial_state.astype(f32))
            y, state = self.recurrent_forward(
                *(x.astype(f32) for x in (ops.q, ops.k, ops.v)), g, beta, S0, scale=call.scale,
                variant=variant, problem=call.problem, templates_dir=templates_dir,
                inputs=inputs, conv=(ops.conv_weight, ops.conv_state),
                norm=None if norm is None else (ops.output_gate.astype(f32),
                                                ops.norm_weight.astype(f32), call.norm_eps))
            if norm is None and call.norm_gate is not None:  # the norm after the kernel
                y = prepare.normed(call, ops, y.astype(dtype))
            if ops.mask is not None:
                y = jnp.where(ops.mask[..., None, None], y, 0.0)
            return y.astype(dtype), state

        self.interpret_mode()  # decided (and warned about) at the caller's frame
        return generated.undifferentiated(plain, fused)(operands)

    def normed_chunk_forward(self, call, operands, variant, templates_dir=None):
        """A chunked ``norm_gate`` call where `norm_in_stores` holds: `forward` of the call
        without its norm, then the norm (`gdngen.backends.generated.norm_switch`, its VJP the
        two VJPs); not differentiated, the norm build's chunk forward (`normed_chunk`: the
        norm in the walk's stores, written in the call's layout; a conv call convolved in its
        loads where `chunk_conv` holds, else before it). Returns ``(out in q's dtype,
        final_state float32)``."""
        import jax.numpy as jnp

        from gdngen import prepare
        from gdngen.backends import generated
        from gdngen.backends.portable.jax_chunkwise import XP

        f32, dtype, gate = jnp.float32, operands.q.dtype, call.core_gate
        self.interpret_mode()  # decided (and warned about) at the caller's frame
        conv = self.convolves_in_chunk_loads(call, variant)
        built = self.load_fused_kernels(
            variant, call.problem, KernelInputs.of(call.qk_norm, gate, conv, call.norm_gate),
            templates_dir=templates_dir)
        run = self.normed_chunk((built.sha256, built.interpret), gate, call.scale, call.qk_norm)
        plain_call, plain = prepare.without_norm(call, operands)
        if plain.initial_state is None:
            shape = call.shape
            plain = plain._replace(initial_state=jnp.zeros((shape.B, shape.Hv, shape.Dv,
                                                            shape.Dk), f32))
        # masks folded here (identity steps; masked outputs zeroed below)
        g, beta = layer_inputs.fold_mask(XP, layer_inputs.cast_gates(plain.kernel_gates(), f32),
                                         plain.beta.astype(f32), plain.mask, gate)
        a, *parameters = g if isinstance(g, tuple) else (g,)
        plain = plain._replace(g=a, beta=beta, mask=None, initial_state=plain.initial_state.astype(
            f32), **dict(zip(("A_log", "dt_bias"), parameters)))

        def unfused(ops):
            return self.forward(plain_call, ops, variant, templates_dir)

        def fused(ops, z, w, *, norm_eps):
            if call.conv_size is not None and not conv:
                ops = prepare.convolved(plain_call, ops)[1]
            return run(*(x.astype(dtype) for x in (ops.q, ops.k, ops.v)), ops.kernel_gates(),
                       ops.beta, ops.initial_state, z, w, norm_eps=norm_eps,
                       **({"conv": (ops.conv_weight, ops.conv_state)} if conv else {}))

        y, state = generated.norm_switch(unfused, fused, call.norm_eps, call.norm_gate)(
            (plain,), operands.output_gate.astype(f32), operands.norm_weight.astype(f32))
        if operands.mask is not None:
            y = jnp.where(operands.mask[..., None, None], y, 0.0)
        return y.astype(dtype), state

    def conv_core(self, call, operands, core, initial_state):
        """A conv call (raw q, k, v) through ``core``, a chunk core over the call's layout that
        convolves (``conv_chunk`` set: `gdngen.backends.generated.custom_vjp_core` with
        ``chunk_size``): the conv tuples of `gdngen.prepare.conv_parts` (x in q's dtype; float32
        for per-channel gates, whose kernels read float32), masks
        folded into the gates and beta, masked steps' y zeroed. Returns ``(y in q's dtype,
        final_state float32)``."""
        import jax.numpy as jnp

        from gdngen import prepare
        from gdngen.backends.portable.jax_chunkwise import XP

        f32, dtype, mask = jnp.float32, operands.q.dtype, operands.mask
        # the per-channel kernels read q, k, v as float32 (the scalar ones in the call's dtype)
        x_dtype = f32 if call.shape.vector_gate else dtype
        qkv = tuple((x.astype(x_dtype), w, state)
                    for x, w, state in prepare.conv_parts(call, operands))
        g, beta = layer_inputs.fold_mask(
            XP, layer_inputs.cast_gates(operands.kernel_gates(), f32),
            operands.beta.astype(f32), mask, call.core_gate)
        y, state = core(*qkv, g, beta, initial_state.astype(f32))
        if mask is not None:
            y = jnp.where(mask[..., None, None], y, 0.0)
        return y.astype(dtype), state

    def forward(self, call, operands, variant, templates_dir=None):
        """A dense call with the recurrent switch (`gdngen.backend.Backend.chunked`): scalar
        gates at T >= ``recurrent_below`` run `chunk_forward`; per-channel gates the
        per-channel chunk core (``channel_core``: the intra-chunk kernel and the kernel walk of
        `chunk_walks`; its VJP the reverse walk and the grads kernel); shorter calls
        `recurrent_forward` inside
        `gdngen.backends.portable.jax_chunkwise.recurrent_or_chunkwise` (the chunk path's VJP).
        A ``norm_gate`` call where `norm_in_stores` holds runs the recurrent kernel's norm build
        (a chunked call: `normed_chunk_forward`) when not differentiated
        (`gdngen.backends.generated.norm_switch`); other calls get the norm after them."""
        import jax.numpy as jnp

        from gdngen import prepare
        from gdngen.backends import generated
        from gdngen.backends.portable import jax_chunkwise

        shape, problem, gate, qk_norm = call.shape, call.problem, call.core_gate, call.qk_norm
        chunked = self.chunked(call, variant)
        normed = call.norm_gate is not None
        if call.conv_size is not None and call.conv_size > 1 and not chunked and \
                self.recurrent_conv:
            return self.convolving_recurrent(call, operands, variant, templates_dir)
        if normed and not self.norm_in_stores(call, variant):
            # no norm build runs this call: the norm after it
            y, state = self.forward(*prepare.without_norm(call, operands), variant,
                                    templates_dir)
            return prepare.normed(call, operands, y), state
        if chunked and normed:  # the chunk forward's norm build when not differentiated
            return self.normed_chunk_forward(call, operands, variant, templates_dir)
        if not shape.vector_gate and chunked:
            return self.chunk_forward(call, operands, variant, templates_dir)
        if call.conv_size is not None and not (chunked and shape.vector_gate):
            call, operands = prepare.convolved(call, operands)  # short calls: the conv first
        self.interpret_mode()  # decided (and warned about) at the caller's frame
        q, k, v, _, beta, initial_state, mask = operands[:7]
        f32 = jnp.float32
        if initial_state is None:
            initial_state = jnp.zeros((shape.B, shape.Hv, shape.Dv, shape.Dk), f32)
        q32, k32, v32, beta32, s0 = (x.astype(f32) for x in (q, k, v, beta, initial_state))
        g32 = layer_inputs.cast_gates(operands.kernel_gates(), f32)
        g32, beta32 = layer_inputs.fold_mask(jax_chunkwise.XP, g32, beta32, mask, gate)

        if shape.vector_gate:
            kernels = self.load_kernels(variant, problem, templates_dir=templates_dir)
            walks = self.chunk_walks((kernels.sha256, kernels.interpret))
            if call.conv_size is not None:  # chunked: the core convolves
                return self.conv_core(call, operands, self.channel_core(
                    (kernels.sha256, kernels.interpret), gate, call.scale, qk_norm, walks,
                    kernels.params["chunk_size"]), initial_state)
            channel_core = self.channel_core((kernels.sha256, kernels.interpret), gate,
                                             call.scale, qk_norm, walks)

        def recurrent_build(inputs):
            def recurrent(q, k, v, g, beta, S0, *norm, norm_eps=None):
                # the fused kernel: raw q, k and (a, A_log, dt_bias); a norm build's z, weight
                if inputs.gate_form is None:
                    g = layer_inputs.linear_decay(jax_chunkwise.XP, g, gate)
                return self.recurrent_forward(
                    q, k, v, g, beta, S0, scale=call.scale, variant=variant, problem=problem,
                    templates_dir=templates_dir, inputs=inputs,
                    norm=None if norm_eps is None else (*norm, norm_eps))

            return recurrent

        def chunkwise_call(q, k, v, g, beta, S0):  # float32 in and out, masks folded
            if shape.vector_gate:  # the core scales q itself (after the q/k norm)
                return chunkwise.whole_sequence(
                    jax_chunkwise.XP, channel_core, q, k, v, g, beta, S0, None, scale=1.0,
                    gate=gate, chunk_size=kernels.params["chunk_size"])
            a, *parameters = g if isinstance(g, tuple) else (g,)
            chunk_operands = operands._replace(q=q.astype(call.dtype), k=k.astype(call.dtype),
                                               v=v.astype(call.dtype), g=a, beta=beta,
                                               initial_state=S0, mask=None)
            if parameters:
                chunk_operands = chunk_operands._replace(A_log=parameters[0],
                                                         dt_bias=parameters[1])
            y, state = self.chunk_forward(call, chunk_operands, variant, templates_dir)
            return y.astype(f32), state

        run = (chunkwise_call if chunked  # per-channel gates: evaluated on the chunk path too
               else jax_chunkwise.recurrent_or_chunkwise(
                   recurrent_build(KernelInputs.of(qk_norm, gate)), chunkwise_call))
        args = (q32, k32, v32, g32, beta32, s0)
        if normed:  # the recurrent kernel's norm build when not differentiated
            y, state = generated.norm_switch(
                run, recurrent_build(KernelInputs.of(qk_norm, gate, norm=call.norm_gate)),
                call.norm_eps, call.norm_gate)(
                args, operands.output_gate.astype(f32), operands.norm_weight.astype(f32))
        else:
            y, state = run(*args)
        if mask is not None:
            y = jnp.where(mask[..., None, None], y, 0.0)
        return y.astype(q.dtype), state

    def packed(self, call, operands, variant, templates_dir=None):
        """A packed row (`gdngen.algebra.packed`), float32 inside: scalar gates, the row's chunk
        walk on the packed build (`packed_core`), each sequence's one-chunk calls on
        `chunk_forward`; per-channel gates, the packed build's per-channel cores (the row's
        walk `channel_walk_core`, the sequences' calls `channel_core`: its intra-chunk kernels
        and `chunk_walks`). Returns
        ``(y [1, T, Hv, Dv] in q's dtype, final_state [N, Hv, Dv, Dk] float32)``."""
        import jax.numpy as jnp

        from gdngen.algebra import packed
        from gdngen.backends.portable.jax_chunkwise import XP

        gate = call.decay
        self.interpret_mode()  # decided (and warned about) at the caller's frame
        kernels = self.load_packed_kernels(variant, call.replace(dtype="float32").problem,
                                           templates_dir=templates_dir)
        chunk = kernels.params["chunk_size"]
        f32 = jnp.float32
        q, k, v, g, beta, initial_state, mask, _, _, cu_seqlens = operands[:10]
        key = (kernels.sha256, kernels.interpret)
        if call.vector_gate:  # the packed build's intra-chunk kernels and walks
            walks = self.chunk_walks(key)
            dense_core = self.channel_core(key, gate, call.scale, False, walks)

            def dense(q, k, v, g, beta, S0, mask):
                return chunkwise.whole_sequence(XP, dense_core, q, k, v, g, beta, S0, mask,
                                                scale=1.0, gate=gate, chunk_size=chunk)

            walk_core = self.channel_walk_core(key, gate, walks)
        else:
            def dense(q, k, v, g, beta, S0, mask):
                return self.chunk_forward(
                    call.for_arrays(q, v, packed=False),
                    operands._replace(q=q, k=k, v=v, g=g, beta=beta, initial_state=S0,
                                      mask=mask, cu_seqlens=None), variant, templates_dir)

            walk_core = self.packed_core(key, gate)
        walk = packed.chunk_walk(XP, walk_core, scale=call.scale, gate=gate, chunk_size=chunk)
        y, state = packed.packed_row(
            XP, dense, walk, *(x.astype(f32) for x in (q, k, v, g, beta)),
            None if initial_state is None else initial_state.astype(f32), mask, cu_seqlens,
            gate=gate, chunk_size=chunk)
        return y.astype(q.dtype), state

    def steps(self, call, operands, variant, templates_dir=None):
        """Per-step states from `recurrent_steps_forward` through
        `gdngen.backends.generated.kernel_steps`."""
        from gdngen.backends import generated

        self.interpret_mode()  # decided (and warned about) at the caller's frame

        def recurrent(q, k, v, decay, beta, S0):
            return self.recurrent_steps_forward(q, k, v, decay, beta, S0, scale=call.scale,
                                                variant=variant, problem=call.problem,
                                                templates_dir=templates_dir)

        return generated.kernel_steps(call, operands, recurrent)

    def chunks(self, call, operands, variant, templates_dir=None):
        """Chunk-boundary states from the chunk kernels' walk
        (`gdngen.backends.generated.kernel_chunks`): scalar gates the ``save_states`` forward's
        entering states (`entering_core`), per-channel gates the intra-chunk kernel
        (`channel_intra`) and the walk kernel (`chunk_walks`)."""
        from gdngen.backends import generated

        self.interpret_mode()  # decided (and warned about) at the caller's frame
        problem = call.problem
        if call.shape.vector_gate:
            kernels = self.load_kernels(variant, problem, templates_dir=templates_dir)
            C = kernels.params["chunk_size"]
            key = (kernels.sha256, kernels.interpret)
            chunk_forward = generated.walk_chunk_forward(
                call, C, self.chunk_walks(key)[0], intra=self.channel_intra(key, "log", 1.0))
        else:
            kernels = self.load_kernels(variant.replace(save_states=True), problem,
                                        templates_dir=templates_dir)
            C = kernels.params["chunk_size"]
            core = self.entering_core((kernels.sha256, kernels.interpret), call.scale)
            chunk_forward = generated.entering_forward(call, C, core, core_scales=True)
        return generated.kernel_chunks(call, operands, C, chunk_forward)

    def entry(self, q, k, v, g, beta, initial_state=None, *, mask=None, scale=1.0, gate="log",
              variant, templates_dir=None, qk_norm=False, cu_seqlens=None):
        """The backend's ``gated_delta`` / ``packed_gated_delta``: arguments as
        `gdngen.call.of_kernel_args` takes them (checked: `checked_args`), run through `run`."""
        checked, operands = self.checked_args(q, k, v, g, beta, initial_state, mask, scale=scale,
                                              gate=gate, qk_norm=qk_norm, cu_seqlens=cu_seqlens)
        run = self.run if cu_seqlens is None else self.run_packed_kernels
        return run(checked, operands, variant, templates_dir=templates_dir)

    def packed_entry(self, q, k, v, g, beta, initial_state=None, *, mask=None, scale=1.0,
                     gate="log", variant, cu_seqlens, templates_dir=None):
        """The backend's ``packed_gated_delta``: `entry` of a packed row."""
        return self.entry(q, k, v, g, beta, initial_state, mask=mask, scale=scale, gate=gate,
                          variant=variant, templates_dir=templates_dir, cu_seqlens=cu_seqlens)
