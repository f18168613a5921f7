"""Real compiles without the chip: every program a user's call runs, compiled for a device's own
compiler on this host (``gdngen build --compile``, ``gdngen tune --dry-run``'s space check).

TPU (``compiler="mosaic"``): with libtpu installed (``gdngen[tpu]``),
``jax.experimental.topologies.get_topology_desc`` gives compile-only devices of the chip
(`gdngen.devices.Device.topology`, e.g. ``v5e:2x2``). A program is ``jax.jit`` traced on
``ShapeDtypeStruct`` s placed on one of them, lowered for the TPU platform and compiled: Mosaic
compiles each Pallas kernel and XLA TPU the program around it. The kernels are built with
`gdngen.backends.pallas.tpu.interpreting` (False), as on a TPU.

The programs of a variant (`programs`; the problem's gate kind and dtype, batch 1):

* ``chunk_fwd_bwd``: `gdngen.jax.gated_delta` and its gradient at ``T`` steps (the chunk kernels);
* ``recurrent_forward``: the forward of the longest call the recurrent kernel runs
  (``recurrent_below - 1`` steps; absent when ``recurrent_below <= 1``);
* ``packed_fwd_bwd`` (the gate kinds of the backend's ``packed_gates``): a packed row of two
  sequences (``cu_seqlens``) and its gradient (the packed build);
* ``fused_fwd_bwd`` / ``fused_recurrent_forward``: ``qk_norm=True``, ``gate="softplus"`` with
  ``A_log``, ``dt_bias``, the output's gated norm (``norm_weight``, ``output_gate``) and the
  causal conv (``conv_weight`` of 4 taps, ``conv_state``) (the fused-input builds; the
  recurrent norm builds of pallas_tpu and pallas_gpu, pallas_gpu's recurrent conv build) at
  ``T`` and at the recurrent length;
* ``fused_chunk_forward`` (a backend whose chunk forward has a norm build, for a variant
  whose programs hold a head's whole Dv: pallas_gpu with ``bv`` the padded Dv, pallas_tpu with
  ``dv_tile`` = Dv and Dv a multiple of 128 or one head tile): the same call's forward at ``T``
  (the chunk forward's norm build);
* ``steps_forward`` (backends whose recurrent kernels write the per-step states,
  `gdngen.backend.Backend.step_states`): a ``return_states="steps"`` verify window of
  `STEPS_T` steps (the per-step-states build).

NVIDIA (``compiler="xla-gpu"``): with jax's CUDA plugin and ptxas/libdevice installed
(``gdngen[cuda]``; no GPU or driver needed), ``get_topology_desc(platform="cuda",
target_config=...)`` gives a compile-only device of the chip from its ``GpuTargetConfigProto``
text (`gpu_target_config`, from `GPU_SPECS`): XLA GPU compiles the program deviceless, its
Triton for each Pallas kernel (`gdngen.backends.pallas.gpu.compiling_for_gpu`) down to PTX and
ptxas (no autotuning: nothing to time on). Shared memory beyond the chip's opt-in per block is
XLA's rejection ("Shared memory size limit exceeded").

Each compiled program reports XLA's memory analysis (``temp_bytes``, ``code_bytes``; 0 on
GPU) and, per kernel: for Mosaic the scoped VMEM the compiler used and the limit it was given
(read from the compiled HLO's ``tpu_custom_call`` backend configs; `CompileReport.vmem_used` is
the largest); for Triton the shared memory its launch takes, with grid and threads (the thunk
sequence XLA dumps; `CompileReport.shared_memory_used` is the largest).

`check_space` is the verdict per variant for a search space, remembered in
``<cache root>/compile.json`` per render sha256, variant, problem, target and compiler versions.

Modules: `gdngen.compilers.targets` (compilers, availability, compile-only devices),
`gdngen.compilers.compiling` (programs, `compile_variant`), `gdngen.compilers.hlo` (reading
compiled HLO and thunks), `gdngen.compilers.verdicts` (`check_space`, `check_targets`, the memo);
their names are re-exported here.
"""

from __future__ import annotations

from gdngen.compilers.compiling import (
                                        DEFAULT_T,
                                        STEPS_T,
                                        CompileReport,
                                        Program,
                                        compile_variant,
                                        programs,
                                        recurrent_length,
                                        targeting,
)
from gdngen.compilers.hlo import COLLECTIVES, collective_bytes, mosaic_kernels, triton_kernels
from gdngen.compilers.targets import (
                                        COMPILER_PACKAGES,
                                        COMPILERS,
                                        CUDNN_VERSION,
                                        ENV_LIBTPU_SHARED,
                                        GPU_SPECS,
                                        PLATFORMS,
                                        compiler_available,
                                        compiler_of,
                                        compiler_versions,
                                        gpu_target_config,
                                        missing_reason,
                                        target_device,
                                        topology_devices,
                                        topology_missing,
)
from gdngen.compilers.verdicts import check_space, check_targets, verdict_key

__all__ = ["COLLECTIVES", "COMPILERS", "COMPILER_PACKAGES", "CUDNN_VERSION", "DEFAULT_T",
           "ENV_LIBTPU_SHARED", "GPU_SPECS", "PLATFORMS", "STEPS_T", "CompileReport", "Program",
           "check_space", "check_targets", "collective_bytes", "compile_variant",
           "compiler_available", "compiler_of", "compiler_versions", "gpu_target_config",
           "missing_reason", "mosaic_kernels", "programs", "recurrent_length", "target_device",
           "targeting", "topology_devices", "topology_missing", "triton_kernels", "verdict_key"]
