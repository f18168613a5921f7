"""pallas_tpu's kernels: the render plan of a variant (`TPUKernels.render_plan`; the packed
and per-step builds' VMEM limits), the interpret-mode default, and lowering them through Mosaic
without a TPU (`TPUKernels.lower_check`)."""

from __future__ import annotations

import functools
import warnings

from gdngen import jaxcompat, settings
from gdngen.backends.pallas.core import fused_gate_specs, jit_pair
from gdngen.backends.pallas.tpu.config import (
    BACKEND,
    RECURRENT_TIME_BLOCK,
    TPUPlanning,
    _padded_bytes,
    _vmem_limit,
)
from gdngen.problem import Problem
from gdngen.variant import Variant

#: the loaded builds (`gdngen.backends.pallas.backend.PallasBackend.load_kernels`), by (sha256,
#: interpret parameters)
LOADED: dict = {}
#: the template context of a plain build: nothing computed in the loads (the fused build sets
#: these, `gdngen.backends.kernel_inputs.KernelInputs.context`)
PLAIN_INPUTS = {"qk_norm": False, "gate_form": None}


@functools.cache
def mosaic_lowers_precision_high() -> bool:
    """Whether the installed jax lowers ``Precision.HIGH`` matmuls for Mosaic (probed by
    lowering a tiny kernel for the TPU platform; no TPU needed)."""
    import jax
    import jax.numpy as jnp

    pl = jaxcompat.pallas()

    def kernel(x_ref, o_ref):
        o_ref[...] = jnp.dot(x_ref[...], x_ref[...], precision=jax.lax.Precision.HIGH,
                             preferred_element_type=jnp.float32)

    def f(x):
        return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape, jnp.float32))(x)

    try:
        jax.jit(f).trace(jnp.zeros((128, 128), jnp.float32)).lower(lowering_platforms=("tpu",))
    except Exception:  # noqa: BLE001 - NotImplementedError from the lowering rule, or no Mosaic
        return False
    return True


@functools.cache
def _default_interpret_mode():
    import jax

    pltpu = jaxcompat.pallas_tpu()

    if jax.default_backend() == "tpu":
        return False
    warnings.warn(f"gdngen {BACKEND}: no TPU attached; the generated kernels run in TPU "
                  "interpret mode (slow; for validation)", RuntimeWarning,
                  stacklevel=settings.caller_stacklevel())
    return pltpu.InterpretParams(detect_races=True)


def _check_lowered(lowered: dict) -> dict:
    for name, text in lowered.items():
        if "tpu_custom_call" not in text:
            raise RuntimeError(f"the {name} kernel did not lower to a Mosaic custom call")
    return lowered


class TPUKernels(TPUPlanning):
    """pallas_tpu's kernels (the base of `gdngen.backends.pallas.tpu.PallasTPU`)."""

    loaded = LOADED

    def render_plan(self, variant: Variant, problem: Problem) -> dict:
        """``{"forward.py" | "backward.py" | "recurrent.py": (template, context)}``; per-channel
        gates: forward and backward are the chunk walks (``per_channel``). The contexts hold the
        parameters resolved for ``problem`` (`kernel_params`: variants resolving alike render
        alike); the recurrent kernel's the head dims, ``dv_tile``, ``per_channel`` and
        ``time_block`` (`RECURRENT_TIME_BLOCK`), not the dtype nor ``recurrent_below``."""
        p = self.kernel_params(variant, problem)
        heads = {"dk": problem.Dk, "dv": problem.Dv, "dv_tile": p["dv_tile"],
                 "n_dv": problem.Dv // p["dv_tile"], "hk": problem.Hk, "hv": problem.Hv,
                 "group": problem.group}
        recurrent = ("pallas_tpu/recurrent.py.j2", {
            **heads,
            "per_channel": problem.gate == "vector",
            "time_block": RECURRENT_TIME_BLOCK,
            "vmem_limit_bytes": _vmem_limit(self.recurrent_vmem_bytes(variant, problem)),
            "steps": False,  # `render_steps` sets it; off, the recurrent kernel renders unchanged
            **PLAIN_INPUTS,
        })
        context = {
            "problem_key": problem.key(),
            "chunk": p["chunk_size"],
            **heads,
            "head_tile": p["head_tile"],
            "n_head_tiles": problem.group // p["head_tile"],
            "dtype": problem.dtype,
            "precision": p["precision"],
            "tf32_native": p["precision"] == "tf32" and mosaic_lowers_precision_high(),
            "save_states": p["save_states"],
            "vmem_limit_bytes": _vmem_limit(self.footprint(variant, problem)),
            "packed": False,  # `render_packed` sets it; off, the dense kernels render unchanged
            "per_channel": problem.gate == "vector",  # the chunk walks of chunkwise_channel
            "log_gate_floor": repr(self.log_gate_floor),  # per channel: a zero gate's log
            **PLAIN_INPUTS,
        }
        return {"forward.py": ("pallas_tpu/forward.py.j2", context),
                "backward.py": ("pallas_tpu/backward.py.j2", context),
                "recurrent.py": recurrent}

    def lower_check(self, variant: Variant, problem: Problem, *, batch: int = 1,
                    chunks: int = 2, inputs=None) -> dict:
        """``{kernel name: StableHLO text}`` of the variant's kernels lowered through Mosaic
        for the TPU platform (no TPU needed): ``forward``, ``backward``, ``chunk_states`` (if
        it recomputes), ``recurrent`` (one short block), ``recurrent_blocks`` (two blocks and a
        tail); per-channel gates ``channel_walk`` and ``channel_walk_backward`` for forward and
        backward. ``inputs`` (a `gdngen.backends.kernel_inputs.KernelInputs` that fuses
        something): its fused build's instead (`lower_fused`). Raises what Mosaic raises."""
        import jax
        import jax.numpy as jnp

        if inputs is not None:
            return self.lower_fused(variant, problem, inputs, batch=batch, chunks=chunks)
        kernels = self.load_kernels(variant, problem)
        C, Dk, Dv, Hk, Hv = (kernels.params["chunk_size"], problem.Dk, problem.Dv, problem.Hk,
                             problem.Hv)
        spec = jax.ShapeDtypeStruct
        f32, dtype = jnp.float32, jnp.dtype(problem.dtype)
        B, N = batch, chunks
        key, values = spec((B, Hk, N, C, Dk), dtype), spec((B, Hv, N, C, Dv), dtype)
        g_col, g_row = spec((B, Hv, N, C, 1), f32), spec((B, Hv, N, 1, C), f32)
        state, states = spec((B, Hv, Dv, Dk), f32), spec((B, Hv, N, Dv, Dk), f32)
        tinv = (spec((B, Hv, N, C, C), f32),) if kernels.params["save_states"] else ()

        def lower(fn, *args, **static):
            return (jax.jit(fn, static_argnames=tuple(static)).trace(*args, **static)
                    .lower(lowering_platforms=("tpu",)).as_text())

        static = {"scale": Dk ** -0.5, "interpret": False}
        lowered = {}
        decay_tail = (Dk,) if problem.gate == "vector" else ()
        for name, T in (("recurrent", 5), ("recurrent_blocks", 2 * RECURRENT_TIME_BLOCK + 3)):
            lowered[name] = lower(kernels.recurrent.recurrent, spec((B, T, Hk, Dk), f32),
                                  spec((B, T, Hk, Dk), f32), spec((B, T, Hv, Dv), f32),
                                  spec((B, T, Hv) + decay_tail, f32), spec((B, T, Hv), f32),
                                  state, **static)
        if problem.gate == "vector":
            chunk_values = spec((N, B, Hv, C, Dv), f32)
            chunk_keys = spec((N, B, Hv, C, Dk), f32)
            dcc, chunk_states = spec((N, B, Hv, 1, Dk), f32), spec((N, B, Hv, Dv, Dk), f32)
            lowered["channel_walk"] = lower(kernels.forward.forward, chunk_values, chunk_keys,
                                            chunk_keys, chunk_keys, spec((N, B, Hv, C, C), f32),
                                            dcc, state, interpret=False)
            key_heads, column = spec((N, B, Hk, C, Dk), f32), spec((N, B, Hv, C, 1), f32)
            square = spec((N, B, Hv, C, C), f32)
            lowered["channel_walk_backward"] = lower(
                kernels.backward.backward, square, key_heads, key_heads, chunk_keys, chunk_keys,
                chunk_values, chunk_states, chunk_values, state, **static)
            lowered["channel_intra"] = lower(kernels.forward.intra, key_heads, key_heads,
                                             chunk_values, chunk_keys, column, **static)
            for name, linear in (("channel_grads", False), ("channel_grads_linear", True)):
                lowered[name] = lower(
                    kernels.backward.grads, key_heads, key_heads, chunk_values, chunk_keys,
                    column, chunk_values, square, square, chunk_values, chunk_values,
                    chunk_keys, chunk_keys, chunk_keys, dcc, linear=linear, **static)
            return _check_lowered(lowered)
        lowered |= {
            "forward": lower(kernels.forward.forward, key, key, values, g_col, g_row, g_col,
                             state, **static),
            "backward": lower(kernels.backward.backward, key, key, values, g_col, g_row, g_col,
                              states, *tinv, values, state, **static),
        }
        if not kernels.params["save_states"]:
            lowered["chunk_states"] = lower(kernels.forward.chunk_states, key, values, g_col,
                                            g_row, g_col, state, interpret=False)
        return _check_lowered(lowered)

    def lower_fused(self, variant: Variant, problem: Problem, inputs, *, batch: int = 1,
                    chunks: int = 2) -> dict:
        """`lower_check` of the fused build of ``inputs`` (`render_fused`): ``recurrent``,
        ``recurrent_blocks`` and, for scalar gates, ``forward``."""
        import jax
        import jax.numpy as jnp

        kernels = self.load_fused_kernels(variant, problem, inputs)
        C, Dk, Dv, Hk, Hv = (kernels.params["chunk_size"], problem.Dk, problem.Dv, problem.Hk,
                             problem.Hv)
        spec, f32, dtype = jax.ShapeDtypeStruct, jnp.float32, jnp.dtype(problem.dtype)
        B, N = batch, chunks
        vector = problem.gate == "vector"
        gate = fused_gate_specs(inputs, Hv, Dk, vector)

        def lower(fn, *args):
            static = {"scale": Dk ** -0.5, "interpret": False}
            return (jax.jit(fn, static_argnames=tuple(static)).trace(*args, **static)
                    .lower(lowering_platforms=("tpu",)).as_text())

        state = spec((B, Hv, Dv, Dk), f32)
        lowered = {}
        for name, T in (("recurrent", 5), ("recurrent_blocks", 2 * RECURRENT_TIME_BLOCK + 3)):
            keys = spec((B, T, Hk, Dk), f32)
            lowered[name] = lower(kernels.recurrent.recurrent, keys, keys,
                                  spec((B, T, Hv, Dv), f32),
                                  spec((B, T, Hv) + ((Dk,) if vector else ()), f32),
                                  spec((B, T, Hv), f32), state, *gate)
        if not vector:
            key, g_col = spec((B, Hk, N, C, Dk), dtype), spec((B, Hv, N, C, 1), f32)
            lowered["forward"] = lower(kernels.forward.forward, key, key,
                                       spec((B, Hv, N, C, Dv), dtype), g_col,
                                       spec((B, Hv, N, 1, C), f32), g_col, state, *gate)
        return _check_lowered(lowered)

    def default_interpret_mode(self):
        """False on a TPU (a real Mosaic compile); else the TPU interpret-mode parameters (race
        detection on, uninitialised memory NaN, one simulated core), with a warning once per
        process."""
        return _default_interpret_mode()

    def packed_context(self, variant: Variant, problem: Problem) -> dict:
        p = self.kernel_params(variant, problem)
        extra = 4 * _padded_bytes((p["head_tile"], p["dv_tile"], problem.Dk))  # inject, S_in
        return {"vmem_limit_bytes": _vmem_limit(self.footprint(variant, problem) + extra)}

    def steps_context(self, variant: Variant, problem: Problem) -> dict:
        tv = self.kernel_params(variant, problem)["dv_tile"]
        blocks = 2 * RECURRENT_TIME_BLOCK * _padded_bytes((tv, problem.Dk))  # every step's state
        return {"vmem_limit_bytes": _vmem_limit(self.recurrent_vmem_bytes(variant, problem)
                                                + blocks)}

    def add_recompute(self, kernels) -> None:
        """``run_chunk_states`` (the entering-state walk) of a build that recomputes."""
        if hasattr(kernels.forward, "chunk_states"):
            kernels.run_chunk_states = jit_pair(kernels.forward.chunk_states, ("interpret",),
                                                kernels.interpret)
