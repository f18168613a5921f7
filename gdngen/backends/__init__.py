"""Backends: one module per execution target, each declaring its `gdngen.registry.BackendSpec`
as ``SPEC`` (portable: ``xla``, ``mlx``, whose framework code is ``jax_chunkwise`` /
``mlx_chunkwise``; generated: ``ffi_cpu``, ``pallas_tpu``, ``pallas_gpu``, ``metal``). The
registry (`gdngen.registry.BACKENDS`) lists them."""
