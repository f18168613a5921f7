"""pallas_gpu's kernels: the render plan of a variant (`GPUKernels.render_plan`), the
interpret-mode default, and lowering them through Triton without a GPU
(`GPUKernels.lower_check`)."""

from __future__ import annotations

import functools
import warnings

from gdngen import jaxcompat, settings
from gdngen.backends.pallas.backend import SCALED
from gdngen.backends.pallas.core import fused_gate_specs, jit_pair
from gdngen.backends.pallas.gpu.config import BACKEND, ENV_INTERPRET, GPUPlanning
from gdngen.problem import Problem
from gdngen.variant import Variant

#: the loaded builds (`gdngen.backends.pallas.backend.PallasBackend.load_kernels`), by (sha256,
#: interpret mode)
LOADED: dict = {}
#: the template context of a plain build: nothing computed in the loads (the fused build sets
#: these, `gdngen.backends.kernel_inputs.KernelInputs.context`)
PLAIN_INPUTS = {"qk_norm": False, "gate_form": None}


@functools.cache
def _default_interpret_mode() -> bool:
    import jax

    if settings.flag(ENV_INTERPRET):
        return True
    if jax.default_backend() == "gpu":
        return False
    warnings.warn(f"gdngen {BACKEND}: no GPU attached; the generated kernels run in Pallas "
                  "interpret mode (slow; for validation)", RuntimeWarning,
                  stacklevel=settings.caller_stacklevel())
    return True


_INTERPRET_OVERRIDE: list = []


class GPUKernels(GPUPlanning):
    """pallas_gpu's kernels (the base of `gdngen.backends.pallas.gpu.PallasGPU`)."""

    loaded = LOADED

    def render_plan(self, variant: Variant, problem: Problem) -> dict:
        """``{"forward.py" | "backward.py" | "recurrent.py": (template, context)}``; the
        contexts hold the parameters resolved for ``problem`` (`kernel_params`). Per-channel
        gates: forward and backward are the chunk walks (``per_channel``; ``save_states`` and
        the dtype do not reach them). The recurrent kernel's: head dims, heads, ``bk`` / ``bv``,
        launch parameters, ``per_channel``; ``recurrent_below`` reaches no source."""
        p = self.kernel_params(variant, problem)
        context = {
            "problem_key": problem.key(),
            "chunk": p["chunk_size"],
            "dk": p["dk"],
            "dv": p["dv"],
            "bk": p["bk"],
            "bv": p["bv"],
            "n_dk": p["dk"] // p["bk"],
            "n_dv": p["dv"] // p["bv"],
            "hk": problem.Hk,
            "hv": problem.Hv,
            "group": problem.group,
            "dtype": problem.dtype,
            "precision": p["precision"],
            "num_warps": p["num_warps"],
            "num_stages": p["num_stages"],
            "save_states": p["save_states"],
            "packed": False,  # `render_packed` sets it; off, the dense kernels render unchanged
            "per_channel": problem.gate == "vector",  # the chunk walks of chunkwise_channel
            "log_gate_floor": repr(self.log_gate_floor),  # per channel: a zero gate's log
            **PLAIN_INPUTS,
        }
        recurrent = {key: context[key] for key in ("problem_key", "dk", "dv", "bk", "bv", "n_dk",
                                                   "n_dv", "hk", "hv", "group", "num_warps",
                                                   "num_stages", *PLAIN_INPUTS)}
        recurrent["per_channel"] = problem.gate == "vector"
        recurrent["steps"] = False  # `render_steps` sets it; off, the kernel renders unchanged
        return {"forward.py": ("pallas_gpu/forward.py.j2", context),
                "backward.py": ("pallas_gpu/backward.py.j2", context),
                "recurrent.py": ("pallas_gpu/recurrent.py.j2", recurrent)}



    def lower_check(self, variant: Variant, problem: Problem, *, batch: int = 1, chunks: int = 2,
                    steps: int = 5, inputs=None) -> dict:
        """Lower the variant's kernels (forward, residual recomputation, backward, and the
        recurrent forward over ``steps`` steps) through the Pallas Triton lowering for the CUDA
        platform, which needs no GPU; returns ``{function name: StableHLO text}``. For a
        vector-gate problem: ``channel_walk`` and ``channel_walk_backward`` (the per-channel chunk
        walks), ``channel_intra`` (the forward's intra-chunk stages) and ``channel_grads``
        (``channel_grads_linear``: linear gates; their VJP) instead of forward, residuals and
        backward. ``inputs`` (a
        `gdngen.backends.kernel_inputs.KernelInputs` that fuses something): the kernels of its
        fused build instead (`render_fused`: ``recurrent`` and, for scalar gates, ``forward``).
        Raises what the lowering raises (non-power-of-two shapes, unsupported ops, scratch memory,
        ...). Triton's own compilation to PTX runs only on a GPU."""
        import jax
        import jax.numpy as jnp

        if inputs is not None:
            return self.lower_fused(variant, problem, inputs, batch=batch, chunks=chunks,
                                    steps=steps)
        kernels = self.load_kernels(variant, problem)
        p = kernels.params
        C, Dk, Dv, Hk, Hv = p["chunk_size"], p["dk"], p["dv"], problem.Hk, problem.Hv
        B, T, N = batch, chunks * C, chunks
        spec, f32, dtype = jax.ShapeDtypeStruct, jnp.float32, jnp.dtype(problem.dtype)
        q = spec((B, T, Hk, Dk), dtype)
        v = spec((B, T, Hv, Dv), dtype)
        gates, state = spec((B, Hv, T), f32), spec((B, Hv, Dv, Dk), f32)
        residuals = (spec((B, Hv, T, Dv), f32), spec((B, Hv, T, Dk), f32), spec((B, Hv, T, C), f32),
                     spec((B, Hv, T, C), f32), spec((B, Hv, N, Dv, Dk), f32))

        def lower(fn, *args, scaled=True):  # the per-channel forward walk takes no scale
            static = {"interpret": False} | ({"scale": Dk ** -0.5} if scaled else {})
            with jaxcompat.abstract_gpu():
                return (jax.jit(fn, static_argnames=tuple(static)).trace(*args, **static)
                        .lower(lowering_platforms=("cuda",)).as_text())

        vector = problem.gate == "vector"
        keys, values = spec((B, Hv, T, Dk), f32), spec((B, Hv, T, Dv), f32)
        dcc, pm = spec((B, Hv, N, Dk), f32), spec((B, Hv, T, C), f32)
        lowered = {
            "channel_walk": lower(kernels.forward.forward, values, keys, keys, keys, pm, dcc, state,
                                  scaled=False),
            "channel_walk_backward": lower(kernels.backward.backward, pm,
                                           spec((B, T, Hk, Dk), f32), spec((B, T, Hk, Dk), f32),
                                           keys, keys, values, residuals[-1], values, state),
            "channel_intra": lower(kernels.forward.intra, spec((B, T, Hk, Dk), f32),
                                   spec((B, T, Hk, Dk), f32), spec((B, T, Hv, Dv), f32), keys,
                                   gates),
            **{name: lower(functools.partial(kernels.backward.grads, linear=linear),
                           spec((B, T, Hk, Dk), f32), spec((B, T, Hk, Dk), f32), values, keys,
                           gates, values, pm, pm, values, values, keys, keys, keys, dcc)
               for name, linear in (("channel_grads", False), ("channel_grads_linear", True))},
        } if vector else {
            "forward": lower(kernels.forward.forward, q, q, v, gates, gates, state),
            "residuals": lower(kernels.forward.residuals, q, q, v, gates, gates, state),
            "backward": lower(kernels.backward.backward, q, q, v, gates, gates, *residuals, v,
                              state),
        }
        per_step = spec((B, steps, Hv), f32)
        decay = spec((B, steps, Hv, Dk), f32) if vector else per_step
        q_rec = spec((B, steps, Hk, Dk), f32)
        lowered["recurrent"] = lower(kernels.recurrent.recurrent, q_rec, q_rec,
                                     spec((B, steps, Hv, Dv), f32), decay, per_step, state)
        for name, text in lowered.items():
            if "triton" not in text:
                raise RuntimeError(f"the {name} kernels did not lower to a Triton custom call")
        return lowered

    def lower_fused(self, variant: Variant, problem: Problem, inputs, *, batch: int, chunks: int,
                     steps: int) -> dict:
        """`lower_check` of the fused build of ``inputs`` (a norm build's kernels with their z,
        norm_weight and ``norm_eps``; a conv build's recurrent kernel with 4 taps and their
        states)."""
        import jax
        import jax.numpy as jnp

        kernels = self.load_fused_kernels(variant, problem, inputs)
        p = kernels.params
        C, Dk, Dv, Hk, Hv = p["chunk_size"], p["dk"], p["dv"], problem.Hk, problem.Hv
        spec, f32, dtype = jax.ShapeDtypeStruct, jnp.float32, jnp.dtype(problem.dtype)
        vector = problem.gate == "vector"
        gate = fused_gate_specs(inputs, Hv, Dk, vector)

        def lower(fn, *args):
            static = {"interpret": False, "scale": Dk ** -0.5,
                      **({"norm_eps": 1e-6} if inputs.norm else {}),
                      **({"conv_k": 4} if inputs.conv and fn.__name__ == "recurrent" else {})}
            with jaxcompat.abstract_gpu():
                return (jax.jit(fn, static_argnames=tuple(static)).trace(*args, **static)
                        .lower(lowering_platforms=("cuda",)).as_text())

        B, state = batch, spec((batch, Hv, Dv, Dk), f32)
        per_step = spec((B, steps, Hv), f32)
        q_rec = spec((B, steps, Hk, Dk), f32)

        def norm(T):  # a norm build's z [B, T, Hv, Dv] and norm_weight [Dv]
            return (spec((B, T, Hv, Dv), f32), spec((Dv,), f32)) if inputs.norm else ()

        # a conv build's taps [H, 4, D] and states [B, H, 4, D] of q, k, v (3 rows padded to 4)
        conv = ((spec((Hk, 4, Dk), f32),) * 2 + (spec((Hv, 4, Dv), f32),)
                + (spec((B, Hk, 4, Dk), f32),) * 2 + (spec((B, Hv, 4, Dv), f32),)
                if inputs.conv else ())
        lowered = {"recurrent": lower(kernels.recurrent.recurrent, q_rec, q_rec,
                                      spec((B, steps, Hv, Dv), f32),
                                      spec((B, steps, Hv, Dk), f32) if vector else per_step,
                                      per_step, state, *gate, *conv, *norm(steps))}
        if hasattr(kernels, "forward"):
            T = chunks * C
            q, gates = spec((B, T, Hk, Dk), dtype), spec((B, Hv, T), f32)
            lowered["forward"] = lower(kernels.forward.forward, q, q, spec((B, T, Hv, Dv), dtype),
                                       gates, gates, state, *gate, *norm(T))
        for name, text in lowered.items():
            if "triton" not in text:
                raise RuntimeError(f"the fused {name} kernels did not lower to a Triton custom "
                                   "call")
        return lowered

    def default_interpret_mode(self) -> bool:
        """False on a GPU (Triton lowering); True elsewhere or with ``GDNGEN_INTERPRET=1``,
        with a warning once per process when no GPU is attached."""
        return _default_interpret_mode()

    def compiling_for_gpu(self):
        """A context in which the kernels take the Triton lowering whatever device is
        attached (`interpreting` False): for lowering a program for CUDA off-GPU."""
        return self.interpreting(False)

    def add_recompute(self, kernels) -> None:
        """``run_residuals`` (the residual recomputation) of a scalar-gate build."""
        if kernels.problem.gate != "vector":
            kernels.run_residuals = jit_pair(kernels.forward.residuals, SCALED,
                                             kernels.interpret)
