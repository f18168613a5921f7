"""ffi_cpu backend: generated C++ kernels of the chunkwise gated delta rule on the host CPU,
called from JAX as XLA FFI custom calls, scalar and per-channel gates (`FfiCpu`, ``SPEC``).

Modules: `gdngen.backends.ffi_cpu.config` (the variant parameters),
`gdngen.backends.ffi_cpu.kernels` (render plan, compile, load), `gdngen.backends.ffi_cpu.vjp`
(the kernel calls and their custom VJPs); templates under ``templates/ffi_cpu/``. How the
kernels work: gdngen/backends/README.md.
"""

from __future__ import annotations

import itertools

from gdngen import prepare, settings
from gdngen.algebra import layer_inputs
from gdngen.backend import Backend
from gdngen.backends import generated
from gdngen.backends.ffi_cpu import kernels, vjp
from gdngen.backends.ffi_cpu.config import (
    BACKEND,
    CHUNK_SIZES,
    INPUT_DTYPES,
    PANELS,
    RECURRENT_BELOW,
    ROW_BLOCKS,
    TOLERANCES,
    VECTOR_CHUNK_SIZE,
    VECTOR_FLOATS,
    VECTOR_RECURRENT_BELOW,
    Config,
    host_vector_bits,
    host_vector_floats,
    padded,
    untuned_recurrent_below,
)
from gdngen.backends.ffi_cpu.kernels import (
    COMPILE_FLAGS,
    ENV_POISON,
    FUSED_KINDS,
    PACKED_SOURCE_NAME,
    RECURRENT_SOURCE_NAME,
    RECURRENT_TEMPLATE,
    SOURCE_NAME,
    STEPS_SOURCE_NAME,
    SYMBOL,
    TEMPLATE,
    Kernels,
    available,
    compile_library,
    compiler,
    head_splits,
    library_path,
    recurrent_rows,
)
from gdngen.backends.kernel_inputs import QK_NORM_EPS, KernelInputs, kernel_parameters
from gdngen.problem import Problem
from gdngen.variant import Variant

#: this package's names: its own and those of the modules it is made of
__all__ = [
    'BACKEND', 'CHUNK_SIZES', 'COMPILE_FLAGS', 'ENV_POISON', 'FUSED_KINDS', 'INPUT_DTYPES',
    'PACKED_SOURCE_NAME', 'PANELS', 'RECURRENT_BELOW', 'RECURRENT_SOURCE_NAME',
    'RECURRENT_TEMPLATE', 'ROW_BLOCKS', 'SOURCE_NAME', 'SPEC', 'STEPS_SOURCE_NAME', 'SYMBOL',
    'TEMPLATE', 'TOLERANCES', 'VECTOR_CHUNK_SIZE', 'VECTOR_FLOATS', 'VECTOR_RECURRENT_BELOW',
    'Config', 'FfiCpu', 'Kernels', 'available', 'compile_library', 'compiler',
    'default_config', 'gated_delta', 'head_splits', 'host_vector_bits', 'host_vector_floats',
    'kernel_params', 'library_path', 'load_fused_kernels', 'load_kernels',
    'load_packed_kernels', 'load_steps_kernels', 'lower_check', 'packed_gated_delta', 'padded',
    'recurrent_forward', 'recurrent_rows', 'render_fused', 'render_packed', 'render_plan',
    'render_steps', 'variant_space',
]


class FfiCpu(Backend):
    """The generated C++ kernels of `gdngen.backends.ffi_cpu` (JAX FFI, CPU hosts)."""

    name, framework, config = BACKEND, "jax", Config
    tolerances, device_kinds, dtypes = TOLERANCES, ("cpu",), INPUT_DTYPES
    gates = tuned_gates = ("scalar", "vector")
    fused_inputs = ("qk_norm", "gate", "conv", "norm")
    packed_gates = ("scalar", "vector")
    step_states = chunk_states = ("scalar", "vector")

    # ------------------------------------------------------------------ variants

    def space(self, problem: Problem, device=None) -> list[Config]:
        """Every chunk size, panel and row block at this host's vector width
        (`host_vector_floats`; no on-chip limit to prune with), at the gate kind's untuned
        ``recurrent_below``."""
        self.check(problem)
        width, below = host_vector_floats(), untuned_recurrent_below(problem)
        return [Config(c, p, r, width, recurrent_below=below) for c, p, r in
                itertools.product(CHUNK_SIZES, PANELS, ROW_BLOCKS)]

    def default(self, problem: Problem, device=None) -> Config:
        """Chunk 64 (per-channel gates: `VECTOR_CHUNK_SIZE`), row block 6, at this host's
        vector width, with the panel its registers hold: 64 columns of 16-float vectors with
        AVX-512 (24 of 32 registers), else 16 columns (12 of AVX2's 16 registers);
        ``recurrent_below`` `RECURRENT_BELOW` (per-channel gates: `VECTOR_RECURRENT_BELOW`)."""
        width = host_vector_floats()
        chunk = VECTOR_CHUNK_SIZE if problem.gate == "vector" else 64
        return Config(chunk, 64 if width == 16 else 16, 6, width,
                      recurrent_below=untuned_recurrent_below(problem))

    def kernel_params(self, variant: Variant, problem: Problem) -> dict:
        """The parameters of ``variant`` (`Config` fields) for ``problem``; ValueError for a
        variant of another backend, unknown or missing parameters, bad values, or a problem
        the backend does not implement."""
        config = self.parse(variant)
        self.check(problem)
        return config.params()

    def available(self) -> bool:
        """A C++ compiler and jax's CPU backend (`gdngen.backends.ffi_cpu.kernels.available`)."""
        return available()

    def toolchain(self) -> str:
        """The compiler's version, flags, host CPU and jaxlib (what its libraries are keyed by)."""
        return kernels._toolchain_id()

    # ------------------------------------------------------------------ renders

    def render_plan(self, variant: Variant, problem: Problem) -> dict:
        """``{"gated_delta.cc": (template, context), "recurrent.cc": (template, context)}`` for
        `gdngen.render`: the plain chunk and recurrent kernels
        (`gdngen.backends.ffi_cpu.kernels.plan`)."""
        return kernels.plan(self.kernel_params(variant, problem), problem)

    def render_packed(self, variant: Variant, problem: Problem, *, templates_dir=None):
        """The packed-row chunk kernels (`gdngen.algebra.packed`, scalar and per-channel
        gates): the chunk template with ``packed`` set. The forward also takes each sequence's
        initial state times its first step's gate, transposed, ``[B, n_seq, Hv, Dk, Dv]`` (or
        empty), its first and its last step (int32 ``[n_seq]``), folds the initial states into
        the walk and returns each sequence's state after its last step ``[B, n_seq, Hv, Dv,
        Dk]``; the backward takes that state's cotangent and returns the initial states'
        (`gdngen.backends.ffi_cpu.vjp.packed_walk`). The dense renders do not depend on it."""
        self.parse(variant)
        template, context = self.render_plan(variant, problem)[SOURCE_NAME]
        return kernels.render_source(variant, problem, PACKED_SOURCE_NAME, template,
                                     dict(context, packed=True), templates_dir)

    def render_steps(self, variant: Variant, problem: Problem, *, templates_dir=None):
        """The recurrent kernel with ``steps`` set (``return_states="steps"``): its second
        result ``[B, T, Hv, Dv, Dk]``, the state after every step, in place of the final
        state. The plain recurrent render does not depend on it."""
        self.parse(variant)
        template, context = self.render_plan(variant, problem)[RECURRENT_SOURCE_NAME]
        return kernels.render_source(variant, problem, STEPS_SOURCE_NAME, template,
                                     dict(context, steps=True), templates_dir)

    def render_fused(self, variant: Variant, problem: Problem, inputs: KernelInputs,
                     source: str = RECURRENT_SOURCE_NAME, *, templates_dir=None):
        """The build of ``source`` (`RECURRENT_SOURCE_NAME`: the recurrent kernel;
        `SOURCE_NAME`: the chunk forward alone) that computes ``inputs`` (``inputs.fused``) in
        its loads, into ``<stem><inputs.tag()>.cc``. Its kernel takes q, k raw when
        ``inputs.qk_norm`` and, with ``inputs.gate_form``, the raw projection ``a`` where the
        decay (recurrent) or log gate (chunk forward) was, plus ``A_log``, ``dt_bias`` float32
        ``[Hv]`` (``[Hv, Dk]`` per channel) after S0 and a ``lower_bound`` float attribute
        (`gdngen.backends.kernel_inputs`); with ``inputs.conv`` the raw q, k, v with ``conv_w
        [K, C]`` and ``conv_state [B, K-1, C]`` (channels last) after those, each loaded row
        convolved + SiLU before its norm; with ``inputs.norm`` it also takes ``z``,
        ``norm_weight`` (after the conv's operands) and a ``norm_eps`` attribute and returns the
        gated norm of y (the recurrent kernel after its walks, the chunk forward in each
        chunk's stores). The plain renders do not depend on it."""
        self.parse(variant)
        if not inputs.fused:
            raise ValueError(f"inputs must fuse a conv, a qk norm, a gate or the output's norm, "
                             f"got {inputs!r}")
        if source not in FUSED_KINDS:
            raise ValueError(f"source must be one of {tuple(FUSED_KINDS)}, got {source!r}")
        template, context = self.render_plan(variant, problem)[source]
        context = dict(context, **inputs.context(), qk_norm_eps=repr(QK_NORM_EPS))
        name = f"{source.removesuffix('.cc')}{inputs.tag()}.cc"
        return kernels.render_source(variant, problem, name, template, context, templates_dir)

    # ------------------------------------------------------------------ loads

    def _load(self, rendered, kinds=("forward", "backward", "recurrent")) -> Kernels:
        return kernels.load(rendered, self.kernel_params(rendered.variant, rendered.problem),
                            kinds)

    def load_kernels(self, variant: Variant, problem: Problem, *, templates_dir=None) -> Kernels:
        """`render_plan`'s kernels compiled unless cached, loaded and registered."""
        return self._load(self.render(variant, problem, templates_dir=templates_dir))

    def load_packed_kernels(self, variant: Variant, problem: Problem, *,
                            templates_dir=None) -> Kernels:
        """`render_packed`, compiled unless cached, loaded and registered (forward, backward)."""
        return self._load(self.render_packed(variant, problem, templates_dir=templates_dir),
                          ("forward", "backward"))

    def load_steps_kernels(self, variant: Variant, problem: Problem, *,
                           templates_dir=None) -> Kernels:
        """`render_steps`, compiled unless cached, loaded and registered (recurrent)."""
        return self._load(self.render_steps(variant, problem, templates_dir=templates_dir),
                          ("recurrent",))

    def load_fused_kernels(self, variant: Variant, problem: Problem, inputs: KernelInputs,
                           source: str = RECURRENT_SOURCE_NAME, *, templates_dir=None) -> Kernels:
        """`render_fused`, compiled unless cached, loaded and registered: ``target_recurrent``
        (`RECURRENT_SOURCE_NAME`) or ``target_forward`` (`SOURCE_NAME`)."""
        return self._load(self.render_fused(variant, problem, inputs, source,
                                            templates_dir=templates_dir), FUSED_KINDS[source])

    def lower_check(self, variant: Variant, problem: Problem) -> dict:
        """Render and compile ``variant`` for ``problem`` (raises on a compile error)."""
        return {"library": str(self.load_kernels(variant, problem).library)}

    # ------------------------------------------------------------------ calls

    def norm_in_stores(self, call, variant) -> bool:
        """Both kernels have a norm build: the recurrent kernel's and the chunk forward's."""
        return call.norm_gate is not None and self.normalises(call)

    def conv_path(self, call, variant) -> str:
        """Both forwards have conv builds; the chunk backward recomputes the conv as arrays."""
        if not self.takes_raw_conv(call):
            return super().conv_path(call, variant)
        where = ("the chunk forward's loads" if self.chunked(call, variant) else
                 "the recurrent kernel's loads when not differentiated, the chunk forward's "
                 "when differentiated")
        return f"in {where} (raw q, k, v); the backward recomputes it as array ops"

    def forward(self, call, operands, variant, templates_dir=None):
        """A dense call: the recurrent kernel below the variant's ``recurrent_below`` (its
        VJP the chunk kernels'), else the chunk kernels; ``qk_norm`` and a parameter gate in
        the kernels' loads (the chunk backward gets them as arrays: `vjp.core`); the causal
        conv (``call.conv_size``) in the loads of both forwards, which take the raw q, k, v
        (the chunk core keeps them; its backward gets q, k, v convolved as arrays). The
        output's gated norm (``call.norm_gate``): undifferentiated, the recurrent kernel's or
        the chunk forward's norm build computes it in its stores
        (`gdngen.backends.generated.norm_switch`)."""
        import jax.numpy as jnp

        from gdngen.backends.portable import jax_chunkwise

        conv = call.conv_size is not None
        shape, problem, gate, scale = call.shape, call.problem, call.core_gate, call.scale
        q, k, v, g, beta, initial_state, mask = operands[:7]
        loaded = self.load_kernels(variant, problem, templates_dir=templates_dir)
        f32 = jnp.float32
        if initial_state is None:
            initial_state = jnp.zeros((shape.B, shape.Hv, shape.Dv, shape.Dk), f32)
        # a masked step is an identity step; its output is zeroed below
        g, beta = layer_inputs.fold_mask(jax_chunkwise.XP,
                                      layer_inputs.cast_gates(operands.kernel_gates(), f32),
                                      beta.astype(f32), mask, gate)
        poison = settings.flag(ENV_POISON)
        qkv = (q.astype(f32), k.astype(f32), v.astype(f32))
        if conv:  # (x, w, conv_state) each, float32
            qkv = tuple(tuple(None if a is None else a.astype(f32) for a in part)
                        for part in prepare.conv_parts(call, operands))
        args = (*qkv, g, beta, initial_state.astype(f32))

        # the recurrent kernel's loads and the chunk forward's: the conv, the q/k norm, the gate
        inputs = KernelInputs.of(call.qk_norm, gate, conv)
        forward_sha256 = (self.load_fused_kernels(variant, problem, inputs, SOURCE_NAME,
                                                  templates_dir=templates_dir).sha256
                          if inputs.fused else None)
        chunkwise_call = vjp.core(loaded.sha256, gate, scale, poison, call.qk_norm,
                                  forward_sha256, conv, inputs.conv)
        chunked = self.chunked(call, variant)
        if not chunked:
            def recurrent_build(inputs):
                built = (self.load_fused_kernels(variant, problem, inputs,
                                                 templates_dir=templates_dir)
                         if inputs.fused else loaded)
                run = vjp.recurrent(built.sha256, scale, poison, inputs)

                def recurrent(q, k, v, g, beta, S0, *norm, norm_eps=None):
                    # conv tuples (inputs.conv): the kernel convolves the raw rows
                    if inputs.gate_form:  # the kernel forms the decay from a, A_log, dt_bias
                        a, A_log, dt_bias = g
                        return run(q, k, v, a, beta, S0, *kernel_parameters(
                            jnp, A_log, dt_bias, shape.Hv, shape.Dk,
                            shape.vector_gate), *norm, norm_eps=norm_eps)
                    # raw q, k when the kernel normalises them (inputs.qk_norm)
                    return run(q, k, v, layer_inputs.linear_decay(jax_chunkwise.XP, g, gate),
                               beta, S0, *norm, norm_eps=norm_eps)

                return recurrent

            plain = jax_chunkwise.recurrent_or_chunkwise(recurrent_build(inputs), chunkwise_call)
        else:
            plain = chunkwise_call
        if call.norm_gate is None:
            y, state = plain(*args)
        else:  # the gated norm: the kernels' stores when not differentiated
            z, w = operands.output_gate.astype(f32), operands.norm_weight.astype(f32)
            if not self.norm_in_stores(call, variant):
                normed = None  # the norm after the kernels
            elif chunked:  # the chunk forward's norm build
                normed = vjp.normed_chunk(loaded.sha256, self.load_fused_kernels(
                    variant, problem, KernelInputs.of(call.qk_norm, gate, conv, call.norm_gate),
                    SOURCE_NAME, templates_dir=templates_dir).sha256, gate, scale, poison,
                    call.norm_gate, call.qk_norm, conv)
            else:
                normed = recurrent_build(KernelInputs.of(call.qk_norm, gate, conv,
                                                         call.norm_gate))
            y, state = generated.norm_switch(plain, normed, call.norm_eps, call.norm_gate)(
                args, z, w)
        if mask is not None:
            y = jnp.where(mask[..., None, None], y, 0.0)
        return y.astype(q.dtype), state

    def packed(self, call, operands, variant, templates_dir=None):
        """A packed row, scalar or per-channel gates: its chunk walk on the packed kernels
        (`render_packed`), each sequence's one-chunk calls on the dense chunk kernels."""
        import jax.numpy as jnp

        from gdngen.algebra import packed
        from gdngen.backends.portable import jax_chunkwise

        gate, scale = call.decay, call.scale
        problem = call.problem
        loaded = self.load_kernels(variant, problem, templates_dir=templates_dir)
        walk_kernels = self.load_packed_kernels(variant, problem, templates_dir=templates_dir)
        poison = settings.flag(ENV_POISON)
        core = vjp.core(loaded.sha256, gate, scale, poison)
        XP = jax_chunkwise.XP

        def dense(q, k, v, g, beta, S0, mask):
            g, beta = layer_inputs.fold_mask(XP, g, beta, mask, gate)
            y, S = core(q, k, v, g, beta, S0)
            return jnp.where(mask[..., None, None], y, 0.0), S

        f32 = jnp.float32
        q, k, v, g, beta, initial_state, mask, _, _, cu_seqlens = operands[:10]
        y, state = packed.packed_row(
            XP, dense, vjp.packed_walk(walk_kernels.sha256, gate, scale, poison),
            *(x.astype(f32) for x in (q, k, v, g, beta)),
            None if initial_state is None else initial_state.astype(f32), mask, cu_seqlens,
            gate=gate, chunk_size=loaded.params["chunk_size"], scale=scale)
        return y.astype(q.dtype), state

    def steps(self, call, operands, variant, templates_dir=None):
        """A ``return_states="steps"`` call (layer inputs computed) on the `render_steps`
        recurrent kernel (`gdngen.backends.generated.kernel_steps`)."""
        loaded = self.load_steps_kernels(variant, call.problem, templates_dir=templates_dir)
        run = vjp.recurrent(loaded.sha256, call.scale, settings.flag(ENV_POISON), steps=True)
        return generated.kernel_steps(call, operands, run)

    def chunks(self, call, operands, variant, templates_dir=None):
        """A ``return_states="chunks"`` call (layer inputs computed): the states the chunk
        forward kernel writes entering each chunk, read, not recomputed
        (`gdngen.backends.generated.kernel_chunks`)."""
        loaded = self.load_kernels(variant, call.problem, templates_dir=templates_dir)
        forward = vjp.chunk_forward(loaded.sha256, call.scale, settings.flag(ENV_POISON))
        return generated.kernel_chunks(call, operands, loaded.params["chunk_size"], forward)


SPEC = FfiCpu()

kernel_params, variant_space, default_config = SPEC.kernel_params, SPEC.space, SPEC.default
render_plan, render_packed, render_steps, render_fused = (
    SPEC.render_plan, SPEC.render_packed, SPEC.render_steps, SPEC.render_fused)
load_kernels, load_packed_kernels, load_steps_kernels, load_fused_kernels, lower_check = (
    SPEC.load_kernels, SPEC.load_packed_kernels, SPEC.load_steps_kernels,
    SPEC.load_fused_kernels, SPEC.lower_check)

# ----------------------------------------------------------------------------- entries


def gated_delta(q, k, v, g, beta, initial_state=None, *, mask=None, scale=1.0, gate="log",
                variant, templates_dir=None, qk_norm=False):
    """Gated delta rule on the kernels of ``variant``; returns ``(y, final_state)``. Arguments
    as `gdngen.jax.gated_delta`; computes in float32 whatever the input dtype.
    Differentiable (custom VJP) and jit-able. T < the variant's ``recurrent_below``: the
    recurrent kernel forward (`recurrent_forward`), the chunk kernels' VJP; ``qk_norm`` and a
    `gdngen.algebra.layer_inputs.ParameterGate` computed in the kernels' loads (`render_fused`)."""
    checked, operands = SPEC.checked_args(q, k, v, g, beta, initial_state, mask,
                                           scale=scale, gate=gate, qk_norm=qk_norm)
    return SPEC.run(checked, operands, variant, templates_dir=templates_dir)


def packed_gated_delta(q, k, v, g, beta, initial_state=None, *, mask=None, scale=1.0,
                       gate="log", variant, cu_seqlens, templates_dir=None):
    """A packed row (`gdngen.algebra.packed`) on ``variant``'s kernels, scalar or per-channel
    gates.
    Arguments as `gdngen.jax.gated_delta` with ``cu_seqlens``; float32 throughout; returns
    ``(y in q's dtype, final_state [N, Hv, Dv, Dk])``."""
    checked, operands = SPEC.checked_args(q, k, v, g, beta, initial_state, mask,
                                           scale=scale, gate=gate, cu_seqlens=cu_seqlens)
    return SPEC.run_packed_kernels(checked, operands, variant, templates_dir=templates_dir)


def recurrent_forward(q, k, v, decay, beta, S0, *, scale, variant, problem=None,
                      templates_dir=None, inputs: KernelInputs | None = None, A_log=None,
                      dt_bias=None):
    """Forward of the gated delta rule one step at a time on the recurrent kernel of
    ``variant``; returns ``(y [B,T,Hv,Dv], S_T [B,Hv,Dv,Dk])``, float32. No VJP of its own.

    Float32 q, k ``[B,T,Hk,Dk]``; v ``[B,T,Hv,Dv]``; ``decay`` the LINEAR decay, ``[B,T,Hv]``
    or ``[B,T,Hv,Dk]`` (per-channel; the problem's gate then "vector"); beta ``[B,T,Hv]``; S0
    ``[B,Hv,Dv,Dk]``; any T >= 1, Hv a multiple of Hk, any Dk, Dv; masked steps already
    folded (decay 1, beta 0). Per step (`gdngen.algebra.recurrent.recurrent_forward`), q
    scaled by ``scale``. ``problem`` defaults to the arrays' (gate kind from ``decay``'s
    rank). jit-able; ``jax.vmap`` runs it once per mapped element.

    ``inputs`` (`gdngen.backends.kernel_inputs.KernelInputs`, fusing something): computed in
    the kernel's loads (`render_fused`): with ``inputs.qk_norm`` q, k are raw; with
    ``inputs.gate_form`` ``decay`` is the raw projection ``a`` (same shape) and ``A_log``,
    ``dt_bias`` (``[Hv]``; per-channel also ``[Hv, 1]`` / ``[Hv, Dk]``) are required."""
    import jax.numpy as jnp

    if problem is None:
        problem = Problem(q.shape[2], v.shape[2], q.shape[3], v.shape[3], "float32",
                          "vector" if decay.ndim == 4 else "scalar")
    poison = settings.flag(ENV_POISON)
    gate_form = None if inputs is None else inputs.gate_form
    if gate_form is None and (A_log is not None or dt_bias is not None):
        raise ValueError("A_log and dt_bias are taken only with inputs fusing a gate")
    if inputs is None or not inputs.fused:
        loaded = SPEC.load_kernels(variant, problem, templates_dir=templates_dir)
        return vjp.recurrent(loaded.sha256, float(scale), poison)(q, k, v, decay, beta, S0)
    parameters = ()
    if gate_form:
        if A_log is None or dt_bias is None:
            raise ValueError(f"A_log and dt_bias are required with gate_form={gate_form!r}")
        parameters = kernel_parameters(jnp, jnp.asarray(A_log), jnp.asarray(dt_bias),
                                       problem.Hv, problem.Dk, problem.gate == "vector")
    loaded = SPEC.load_fused_kernels(variant, problem, inputs, templates_dir=templates_dir)
    return vjp.recurrent(loaded.sha256, float(scale), poison, inputs)(
        q, k, v, decay, beta, S0, *parameters)
