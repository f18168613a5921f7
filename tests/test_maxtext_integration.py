"""gdngen.integrations.maxtext on MaxText's own ``Qwen3NextGatedDeltaNet`` (tiny config built
with MaxText's ``pyconfig`` as its own Qwen3-Next tests do; no downloads).

Patched (gdngen's tuned variant, here the CPU's) against unpatched (MaxText's
``jax_chunk_gated_delta_rule``), as the relative L2 error per array, the worst one asserted:
float32 ``compute_dtype`` to 1e-4, bfloat16 (MaxText's default, whose own path rounds its
intermediates to bfloat16 while gdngen keeps them float32) to 1e-1. Needs MaxText (Python >=
3.12, ``pip install 'gdngen[maxtext]'``); skipped where it is not importable.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

qwen3 = pytest.importorskip(
    "maxtext.models.qwen3",
    reason="MaxText is not importable here (it needs Python >= 3.12: pip install "
           "'gdngen[maxtext]')")

import jax
import jax.numpy as jnp
from flax import nnx

from gdngen.algebra import reference
from gdngen.integrations import maxtext as integration
from gdngen.integrations.maxtext import rule

ORIGINAL = qwen3.jax_chunk_gated_delta_rule
F32_RTOL, BF16_RTOL = 1e-4, 1e-1
B, T = 2, 200  # several of MaxText's 64-step chunks and a padded tail


@pytest.fixture(autouse=True)
def always_unpatch():
    yield
    integration.unpatch()


def config(dtype="float32", **overrides):
    """A tiny Qwen3-Next config: Hk=2, Hv=4 (MaxText repeats q, k to 4 heads), Dk=16, Dv=32."""
    from maxtext.configs import pyconfig
    from maxtext.utils.globals import MAXTEXT_PKG_DIR

    settings = {"run_name": "gdngen_maxtext_test", "dtype": dtype, "weight_dtype": "float32",
                "matmul_precision": "highest", "decoder_block": "qwen3_next",
                "base_emb_dim": 64, "base_num_query_heads": 4, "base_num_kv_heads": 4,
                "head_dim": 16, "gdn_num_value_heads": 4, "gdn_num_key_heads": 2,
                "gdn_key_head_dim": 16, "gdn_value_head_dim": 32, "gdn_conv_kernel_dim": 4,
                "gdn_chunk_size": 64, "use_qk_norm_in_gdn": True,
                "normalization_layer_epsilon": 1e-6, "skip_jax_distributed_system": True,
                "enable_checkpointing": False}
    settings.update(overrides)
    return pyconfig.initialize([None, os.path.join(MAXTEXT_PKG_DIR, "configs", "base.yml"),
                                *(f"{k}={v}" for k, v in settings.items())])


def mesh_for(cfg, devices=None, **sizes):
    """MaxText's mesh axes, all of size 1 but ``data`` (every device, as MaxText's own tests
    build it) or the sizes given. The layer needs a mesh: without one MaxText 0.2.5 fails in
    train mode (its unsharded path returns no state and then casts it)."""
    from jax.sharding import Mesh

    devices = np.array(jax.devices() if devices is None else devices)
    shape = [1] * len(cfg.mesh_axes)
    for name, size in (sizes or {"data": devices.size}).items():
        shape[cfg.mesh_axes.index(name)] = size
    return Mesh(devices.reshape(shape), cfg.mesh_axes)


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def loss_and_grads(layer, x, weights):
    """The layer's output and the gradient of <output, weights> to every parameter and to x,
    traced now (so under whatever patch is active)."""
    graphdef, params, rest = nnx.split(layer, nnx.Param, ...)

    def loss(params, x):
        out, _ = nnx.merge(graphdef, params, rest)(x)
        return jnp.sum(out.astype(jnp.float32) * weights), out

    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(params, x)
    flat = {"x": grads[1], **{"/".join(map(str, path)): leaf for path, leaf in
                              jax.tree_util.tree_leaves_with_path(grads[0])}}
    return out, flat


def layer_run(dtype, patched, x, weights):
    """Output and gradients of MaxText's layer (seed 0; float32 parameters) at ``dtype``."""
    cfg = config(dtype)
    layer = qwen3.Qwen3NextGatedDeltaNet(config=cfg, mesh=mesh_for(cfg), dtype=jnp.dtype(dtype),
                                         rngs=nnx.Rngs(0))
    if not patched:
        return loss_and_grads(layer, x.astype(dtype), weights)
    with integration.patched():
        result = loss_and_grads(layer, x.astype(dtype), weights)
        assert rule._ACTIVE.calls >= 1  # the traced layer went through gdngen
    return result


def errors_against(result, want) -> dict:
    (out, got), (want_out, want) = result, want
    assert len(want) == 8  # x, in_proj_qkvz, in_proj_ba, conv1d, A_log, dt_bias, norm, out_proj
    return {"output": rel(out, want_out), **{n: rel(got[n], want[n]) for n in want}}


def layer_inputs():
    kx, kw = jax.random.split(jax.random.key(1))
    x = jax.random.normal(kx, (B, T, 64), jnp.float32).astype(jnp.bfloat16).astype(jnp.float32)
    return x, jax.random.normal(kw, (B, T, 64), jnp.float32)


@pytest.mark.parametrize("dtype, rtol", [("float32", F32_RTOL), ("bfloat16", BF16_RTOL)])
def test_layer_outputs_and_every_gradient_match(dtype, rtol):
    """Patched against unpatched at ``compute_dtype`` float32 (to 1e-4) and bfloat16, MaxText's
    default, where the whole layer runs in bfloat16 (to 1e-1; worst seen 6e-2, the conv
    kernel's gradient; the output 6e-3). Both bfloat16 paths are about 2e-1 from the float32
    layer on the input's and conv kernel's gradients, so bfloat16 outside the recurrence
    dominates; benchmarks/bench_maxtext.py compares the recurrence alone against float64."""
    x, weights = layer_inputs()
    errors = errors_against(layer_run(dtype, True, x, weights),
                            layer_run(dtype, False, x, weights))
    worst = max(errors, key=errors.get)
    assert errors[worst] < rtol, f"{worst}: relative L2 error {errors[worst]:.2e} ({errors})"


def test_patch_replaces_and_unpatch_restores():
    assert not integration.is_patched()
    assert integration.patch() == ("maxtext.models.qwen3",)
    assert qwen3.jax_chunk_gated_delta_rule is integration.gdngen_chunk_gated_delta_rule
    assert integration.patch(chunk_size=32) == ("maxtext.models.qwen3",)  # idempotent
    with integration.patched():
        assert rule._ACTIVE.chunk_size is None
    assert rule._ACTIVE.chunk_size == 32  # the outer patch's options come back
    integration.unpatch()
    assert qwen3.jax_chunk_gated_delta_rule is ORIGINAL and not integration.is_patched()
    with pytest.raises(RuntimeError, match="supports maxtext>=0.2.5,<0.3"):
        integration.check_maxtext_version("0.3.0")
    with pytest.raises(ValueError, match="chunk_size"):
        integration.patch(chunk_size=0)


def strong_decay_inputs(seed=0, Bn=1, Tn=256, H=4, Dk=32, Dv=32):
    keys = jax.random.split(jax.random.key(seed), 6)
    q = jax.random.normal(keys[0], (Bn, Tn, H, Dk))
    k = jax.random.normal(keys[1], (Bn, Tn, H, Dk))
    v = jax.random.normal(keys[2], (Bn, Tn, H, Dv))
    g = -jax.random.uniform(keys[3], (Bn, Tn, H), minval=2.0, maxval=12.0)  # strong decay
    beta = jax.nn.sigmoid(jax.random.normal(keys[4], (Bn, Tn, H)))
    h0 = jax.random.normal(keys[5], (Bn, H, Dk, Dv)) * 0.1  # MaxText's [B,H,Dk,Dv]
    return q, k, v, g, beta, h0


def float64_reference(q, k, v, g, beta, h0):
    """MaxText's computation in float64: l2-normalised q, k, scale Dk**-0.5, [B,H,Dk,Dv] state."""
    qn, kn = (reference.l2_normalize(np.asarray(x, np.float64))[0] for x in (q, k))
    state = np.swapaxes(np.asarray(h0, np.float64), -1, -2)
    y, final = reference.forward(qn, kn, v, g, beta, state, scale=q.shape[-1] ** -0.5)
    return y, np.swapaxes(final, -1, -2)


def test_strong_decay_against_float64_reference():
    """gdngen's error against float64 is at most MaxText's own (float32 compute_dtype), and the
    conventions (state layout, scale, qk norm, returned state) agree."""
    args = strong_decay_inputs()
    y64, h64 = float64_reference(*args)
    run = jax.jit(lambda *a: qwen3.jax_chunk_gated_delta_rule(
        *a[:5], initial_state=a[5], use_qk_norm_in_gdn=True, compute_dtype=jnp.float32))
    y_mt, h_mt = run(*args)
    with integration.patched():
        run = jax.jit(lambda *a: qwen3.jax_chunk_gated_delta_rule(
            *a[:5], initial_state=a[5], use_qk_norm_in_gdn=True, compute_dtype=jnp.float32))
        y_gd, h_gd = run(*args)
    assert h_gd.shape == h_mt.shape == args[5].shape and h_gd.dtype == h_mt.dtype
    err_mt, err_gd = rel(y_mt, y64), rel(y_gd, y64)
    assert err_gd < 1e-5 and err_gd <= 2 * err_mt + 1e-6, (err_gd, err_mt)
    assert rel(h_gd, h64) < 1e-5, rel(h_gd, h64)
    assert np.isfinite(np.asarray(y_mt)).all()


def test_no_initial_state_returns_none_and_refused_calls_run_maxtext():
    q, k, v, g, beta, _ = strong_decay_inputs(Tn=64)
    with integration.patched():
        y, final = qwen3.jax_chunk_gated_delta_rule(q, k, v, g, beta, compute_dtype=jnp.float32)
        assert final is None and y.dtype == q.dtype and rule._ACTIVE.calls == 1
        small = [x[..., :8] for x in (q, k, v)]  # Dk = 8: outside gdngen's head dims
        qwen3.jax_chunk_gated_delta_rule(*small, g, beta, compute_dtype=jnp.float32)
        assert rule._ACTIVE.calls == 1
        assert rule.context_axis(("context", "context_usp_ulysses")) is rule._UNSUPPORTED
        assert rule.context_axis(("context",)) == "context"


SHARDED = textwrap.dedent(r'''
    import collections, json, re, sys
    sys.path.insert(0, sys.argv[2])
    import jax, jax.numpy as jnp
    from flax import nnx
    from flax.linen import partitioning as nn_partitioning
    import test_maxtext_integration as t
    from gdngen.integrations import maxtext as integration

    cp = sys.argv[1] == "cp"
    COLLECTIVE = re.compile(r"\b(all-reduce|all-gather|reduce-scatter|collective-permute|"
                            r"all-to-all)(-start)?\(")
    cfg = t.config("float32", ici_fsdp_parallelism=1, ici_data_parallelism=2 if cp else 8,
                   ici_context_parallelism=4 if cp else 1, context_parallel_load_balance=not cp)
    mesh = t.mesh_for(cfg, **({"data": 2, "context": 4} if cp else {"data": 8}))
    x, w = (jnp.concatenate([a] * 4)[:, :128] for a in t.layer_inputs())  # B = 8, T = 128

    def run(patched):
        layer = t.qwen3.Qwen3NextGatedDeltaNet(config=cfg, mesh=mesh, dtype=jnp.float32,
                                               rngs=nnx.Rngs(0))
        graphdef, params, rest = nnx.split(layer, nnx.Param, ...)

        def loss(params, x):
            out, _ = nnx.merge(graphdef, params, rest)(x)
            return jnp.sum(out * w), out

        step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))
        with jax.set_mesh(mesh), nn_partitioning.axis_rules(cfg.logical_axis_rules):
            if patched:
                integration.patch()
            hlo = step.lower(params, x).compile().as_text()
            result = step(params, x)
            integration.unpatch()
        return jax.tree.leaves(result), collections.Counter(
            m.group(1) for m in COLLECTIVE.finditer(hlo))

    (want, theirs), (got, ours) = run(False), run(True)
    print(json.dumps({"worst": max(t.rel(a, b) for a, b in zip(got, want)),
                      "maxtext": theirs, "gdngen": ours}))
''')


def sharded(form):
    env = dict(os.environ)
    env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=8"
    tests = os.path.dirname(os.path.abspath(__file__))
    done = subprocess.run([sys.executable, "-c", SHARDED, form, tests], check=False, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    import json

    return json.loads(done.stdout.strip().splitlines()[-1])


def test_sharded_layer_data_parallel_adds_no_collective():
    """8 host devices, MaxText's mesh (data=8) and its shard_map'd layer: patched fwd+bwd
    matches, and its compiled step has exactly unpatched MaxText's collectives (the gradients'
    all-reduces): gdngen runs per shard."""
    found = sharded("dp")
    assert found["worst"] < F32_RTOL, found
    assert found["gdngen"] == found["maxtext"], found


def test_sharded_layer_context_parallel():
    """8 host devices, data=2 x context=4 (MaxText's ici_context_parallelism: the sequence split
    over ``context``, cp_axis inside its shard_map): gdngen's context_axis path matches
    unpatched fwd+bwd and compiles to no more collectives than MaxText's own cp scan."""
    found = sharded("cp")
    assert found["worst"] < F32_RTOL, found
    assert sum(found["gdngen"].values()) <= sum(found["maxtext"].values()), found


def compiled_for_v5e(patched: bool) -> str:
    """The compiled HLO of MaxText's layer fwd+bwd (float32, B = 4, T = 128), data-parallel
    over the v5e 2x2 topology's 4 chips, traced within `gdngen.compilers.targeting`."""
    from flax.linen import partitioning as nn_partitioning
    from jax.sharding import NamedSharding, PartitionSpec

    from gdngen import compilers

    with compilers.targeting("tpu-v5e") as chips:
        cfg = config("float32", ici_fsdp_parallelism=1, ici_data_parallelism=len(chips))
        mesh = mesh_for(cfg, chips, data=len(chips))
        abstract = nnx.eval_shape(lambda: qwen3.Qwen3NextGatedDeltaNet(
            config=cfg, mesh=mesh, dtype=jnp.float32, rngs=nnx.Rngs(0)))
        graphdef, params, rest = nnx.split(abstract, nnx.Param, ...)

        def placed(a, spec=None):
            return jax.ShapeDtypeStruct(a.shape, a.dtype,
                                        sharding=NamedSharding(mesh, spec or PartitionSpec()))

        def loss(params, rest, x):
            out, _ = nnx.merge(graphdef, params, rest)(x)
            return jnp.sum(out ** 2)

        x = placed(jax.ShapeDtypeStruct((len(chips), 128, 64), jnp.float32),
                   PartitionSpec("data"))
        step = jax.jit(jax.value_and_grad(loss, argnums=(0, 2)))
        with jax.set_mesh(mesh), nn_partitioning.axis_rules(cfg.logical_axis_rules):
            if patched:
                integration.patch(device="tpu-v5e")
            try:
                lowered = step.trace(jax.tree.map(placed, params), jax.tree.map(placed, rest),
                                     x).lower(lowering_platforms=("tpu",))
            finally:
                integration.unpatch()
    return lowered.compile().as_text()


def test_layer_compiles_for_a_v5e_topology_with_the_pallas_kernels():
    """MaxText's layer fwd+bwd compiled for a v5e 2x2 topology from this CPU host ahead of time
    (`compiled_for_v5e`, as MaxText's ``train_compile``): patched, the program holds gdngen's
    Mosaic kernels (pallas_tpu, the v5e's variant), where unpatched MaxText's has none, and the
    same collectives (the gradients' all-reduce over the data axis)."""
    import collections
    import re

    from gdngen import compilers

    reason = compilers.topology_missing("tpu-v5e")
    if reason is not None:
        pytest.skip(f"no tpu-v5e topology here: {reason}")
    collective = re.compile(r"\b(all-reduce|all-gather|reduce-scatter|collective-permute|"
                            r"all-to-all)(-start)?\(")
    found = {}
    for patched in (False, True):
        text = compiled_for_v5e(patched)
        found[patched] = (compilers.mosaic_kernels(text), collections.Counter(
            m.group(1) for m in collective.finditer(text)))
    assert found[False][0] == [] and found[True][0], found
    assert found[True][1] == found[False][1], found
