"""Running the Metal backend's plans: the two launchers (MLX's ``mx.fast.metal_kernel`` on an
Apple GPU, the MSL simulator `gdngen.backends.metal.sim` anywhere), the shared default one,
`run_launches`, the simulator's compile of a plan and the build's `lower_check`. The code that
runs kernels reads `default_launcher` and `run_launches` from this module when called (a test
may patch them here)."""

from __future__ import annotations

import functools
import math

from gdngen import settings
from gdngen.backends.kernel_inputs import KernelInputs
from gdngen.backends.metal.config import CHANNEL_KERNELS, adapt
from gdngen.backends.metal.plan import (
    KernelSpec,
    Launch,
    Plan,
    channel_input_metas,
    channel_plan,
    launch_plan,
    plan_input_metas,
    recurrent_input_metas,
    recurrent_plan,
    steps_plan,
)
from gdngen.problem import Problem
from gdngen.shape import dtype_name
from gdngen.variant import Variant


class MLXLauncher:
    """Runs launches with ``mx.fast.metal_kernel`` on the Metal GPU."""

    name = "metal"

    @staticmethod
    @functools.cache
    def _kernel(spec: KernelSpec):
        import mlx.core as mx

        return mx.fast.metal_kernel(name=spec.name, input_names=list(spec.input_names),
                                    output_names=list(spec.output_names), source=spec.source,
                                    header=spec.header)

    def __call__(self, plan: Plan, launch: Launch, arrays):
        import mlx.core as mx

        kernel = self._kernel(plan.kernels[launch.kernel])
        template = [(n, getattr(mx, v) if isinstance(v, str) else v) for n, v in launch.template]
        # GDNGEN_POISON_OUTPUTS=1: every output starts as NaN, so anything a kernel leaves
        # unwritten shows (the simulator always poisons outputs and fails on what is left).
        poison = float("nan") if settings.flag(settings.ENV_POISON_OUTPUTS) else None
        return kernel(inputs=list(arrays), template=template or None, grid=launch.grid,
                      threadgroup=launch.threadgroup, output_shapes=list(launch.output_shapes),
                      output_dtypes=[getattr(mx, d) for d in launch.output_dtypes],
                      init_value=poison)


class SimLauncher:
    """Runs launches in `gdngen.backends.metal.sim` (NumPy in and out of the simulated GPU)."""

    name = "simulator"

    def __init__(self, schedule: str = "forward", seed: int = 0):
        self.schedule, self.seed = schedule, seed
        self.threadgroup_bytes = {}  # kernel -> bytes the simulator measured

    @staticmethod
    @functools.cache
    def _kernel(spec: KernelSpec):
        from gdngen.backends.metal import sim as metal_sim

        return metal_sim.metal_kernel(spec.name, spec.input_names, spec.output_names,
                                      spec.source, spec.header)

    def prepare(self, plan: Plan, env: dict) -> None:
        """Compile every kernel of ``plan`` before the first launch (see `compile_plan`);
        ``env`` holds the forward's input arrays."""
        compile_plan(plan, {n: (dtype_name(a), a.ndim, int(a.size)) for n, a in env.items()})

    def __call__(self, plan: Plan, launch: Launch, arrays):
        kernel = self._kernel(plan.kernels[launch.kernel])
        outs = kernel(inputs=[to_numpy(a) for a in arrays], template=list(launch.template),
                      grid=launch.grid, threadgroup=launch.threadgroup,
                      output_shapes=list(launch.output_shapes),
                      output_dtypes=list(launch.output_dtypes), schedule=self.schedule,
                      seed=self.seed)
        self.threadgroup_bytes[launch.kernel] = kernel.last_threadgroup_bytes
        return [from_numpy(o) for o in outs]


def compile_plan(plan: Plan, metas: dict | None = None) -> list:
    """Compile, in parallel, the simulator build of every kernel ``plan`` launches (the full
    source MLX would compile, g++ against the MSL shim); returns the shared-object paths.

    ``metas`` gives ``(dtype, ndim, size)`` of the forward's inputs (default: as MLX passes
    them, `plan_input_metas`; for a walk plan, `channel_input_metas`, which also completes the
    given ones: the backward walk's inputs are not the forward's outputs); every other buffer
    is declared by the plan.
    """
    from concurrent.futures import ThreadPoolExecutor

    from gdngen.backends.metal import sim as metal_sim
    from gdngen.backends.metal.sim import compiler, source
    from gdngen.backends.metal.sim.launch import default_workers

    if set(plan.kernels) == set(CHANNEL_KERNELS):
        metas = {**channel_input_metas(plan), **(metas or {})}
    metas = dict(plan_input_metas(plan) if metas is None else metas)
    if plan.fused and "a" in metas and "g" not in metas:  # its backward: the recomputed log g
        metas["g"] = metas["a"]
    texts = {}
    for launch in plan.forward + plan.backward + plan.stages:
        spec = plan.kernels[launch.kernel]
        kernel = metal_sim.metal_kernel(spec.name, spec.input_names, spec.output_names,
                                        spec.source, spec.header)
        text = kernel.kernel_text([metas[n] for n in launch.inputs], launch.output_dtypes,
                                  launch.template, metas_given=True)
        texts[source.simulator_source(text)] = f"kernel {text.kernel_name}"
        for name, shape, dt in zip(launch.outputs, launch.output_shapes, launch.output_dtypes):
            metas[name] = (dt, len(shape), math.prod(shape))
        if "y_out" in metas and "final_state" in metas:  # the backward's cotangents are
            metas.setdefault("dy", metas["y_out"])  # shaped like the outputs
            metas.setdefault("dsf", metas["final_state"])
        if plan.packed and "states" in metas:
            metas.setdefault("dsin", metas["states"])
    with ThreadPoolExecutor(max_workers=default_workers()) as pool:
        return list(pool.map(lambda item: compiler.kernel_library(*item), texts.items()))


def lower_check(variant: Variant, problem: Problem) -> None:
    """`gdngen.tools.build` hook: every kernel of ``variant`` compiles as MLX would build it (with
    g++ against the simulator's MSL shim; no Metal device needed), the fused builds of both
    gate forms with the qk norm (`render_fused`), the recurrent kernel's conv build and the
    per-step-states build (`steps_plan`) included. Raises on failure."""
    fused = (KernelInputs(True, "softplus"), KernelInputs(True, "sigmoid_bound", -1.0))
    if problem.gate == "scalar":
        for inputs in (None, *fused):
            compile_plan(launch_plan(variant, problem, 2, 1, inputs))
    else:
        compile_plan(channel_plan(adapt(variant, problem), problem, 2, 1,
                                  settings.templates_override()))
    for inputs in (None, *fused, KernelInputs(True, "softplus", conv=True),
                   KernelInputs(True, "softplus", conv=True, norm="silu")):
        plan = recurrent_plan(variant, problem, 2, 1, inputs=inputs)
        compile_plan(plan, recurrent_input_metas(plan))
    plan = steps_plan(variant, problem, 2, 1)
    compile_plan(plan, recurrent_input_metas(plan))


def to_numpy(x):
    """mx array -> NumPy (bfloat16 through ml_dtypes, bit for bit)."""
    import mlx.core as mx
    import numpy as np

    if x.dtype == mx.bfloat16:
        import ml_dtypes

        return np.array(x.view(mx.uint16)).view(ml_dtypes.bfloat16)
    return np.array(x)


def from_numpy(x):
    """NumPy -> mx array (bfloat16 bit for bit)."""
    import mlx.core as mx

    if x.dtype.name == "bfloat16":
        return mx.array(x.view("uint16")).view(mx.bfloat16)
    return mx.array(x)


@functools.cache
def default_launcher():
    """MLX on a Metal GPU, the simulator otherwise (one shared instance)."""
    import mlx.core as mx

    return MLXLauncher() if mx.metal.is_available() else SimLauncher()


def run_launches(plan: Plan, launches, env: dict, launcher) -> dict:
    """Run ``launches`` (of ``plan``) in order on ``launcher``, each reading its inputs from
    ``env`` by name and adding its outputs; returns ``env``."""
    for launch in launches:
        outs = launcher(plan, launch, [env[n] for n in launch.inputs])
        env.update(zip(launch.outputs, outs))
    return env
