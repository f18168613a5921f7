"""States in a pool (``state_indices``, ``output_state_indices``) and their storage dtype
(``state_dtype``), `gdngen.state_pool`: both frameworks, every registered backend, dense and
packed rows (a server's mixed decode and prefill batch), the float64 reference per row;
untouched rows bit for bit; JAX's donated pool aliased in the compiled program; MLX's pool
updated without a copy; the argument errors."""

from __future__ import annotations

import numpy as np
import pytest
from framework_arrays import dtype, entry

from gdngen import registry
from gdngen.algebra import reference
from gdngen.problem import Problem
from gdngen.validate import relative_error

HK, HV, DK, DV, P = 1, 2, 32, 32, 6
TOL = 5e-5


def _inputs(seed, B, T):
    rng = np.random.default_rng(seed)
    k = rng.standard_normal((B, T, HK, DK))
    return {"q": rng.standard_normal((B, T, HK, DK)).astype(np.float32),
            "k": (k / np.linalg.norm(k, axis=-1, keepdims=True)).astype(np.float32),
            "v": rng.standard_normal((B, T, HV, DV)).astype(np.float32),
            "g": -rng.uniform(0.05, 0.5, (B, T, HV)).astype(np.float32),
            "beta": rng.uniform(0.1, 1.0, (B, T, HV)).astype(np.float32),
            "pool": rng.standard_normal((P, HV, DV, DK)).astype(np.float32)}


def _expected(x, idx, scale, cu_seqlens=None, out=None):
    """float64 y and pool': each row from pool[i] (zeros for i < 0), written back where i >= 0
    (``out``: written to pool[out[b]] where out[b] >= 0 instead)."""
    starts = np.stack([x["pool"][i] if i >= 0 else np.zeros_like(x["pool"][0]) for i in idx])
    if cu_seqlens is None:
        y, final = reference.forward(x["q"], x["k"], x["v"], x["g"], x["beta"], starts,
                                     scale=scale)
    else:
        ref = reference.packed_vjp(x["q"], x["k"], x["v"], x["g"], x["beta"], starts, None,
                                   None, cu_seqlens, scale=scale)
        y, final = ref["y"], ref["final_state"]
    pool = x["pool"].astype(np.float64).copy()
    for b, i in enumerate(idx if out is None else out):
        if i >= 0:
            pool[i] = final[b]
    return y, pool


def _check_pool_call(framework, x, idx, variant=None, cu_seqlens=None, out=None):
    """One pooled call against `_expected`: y, the written rows, every other row bit for bit
    (``out``: ``output_state_indices``, so the rows read stay as they were)."""
    gated_delta, array, numpy = entry(framework)
    written = idx if out is None else out
    untouched = [i for i in range(P) if i not in set(written.tolist())]
    kwargs = {} if cu_seqlens is None else {"cu_seqlens": array(cu_seqlens)}
    if out is not None:
        kwargs["output_state_indices"] = array(out)
    y, pool = gated_delta(*(array(x[n]) for n in ("q", "k", "v", "g", "beta", "pool")),
                          state_indices=array(idx), scale=DK ** -0.5, variant=variant,
                          **kwargs)
    y_ref, pool_ref = _expected(x, idx, DK ** -0.5, cu_seqlens, out)
    pool = numpy(pool)
    assert pool.shape == (P, HV, DV, DK) and pool.dtype == np.float32
    np.testing.assert_array_equal(pool[untouched], x["pool"][untouched])
    assert relative_error(numpy(y), y_ref) <= TOL
    live = written[written >= 0]
    assert relative_error(pool[live], pool_ref[live]) <= TOL
    return relative_error(numpy(y), y_ref), relative_error(pool[live], pool_ref[live])


def _runnable(backend):
    """``(spec, default variant)`` of ``backend`` at the test's heads; skips where it cannot
    run here."""
    spec = registry.get(backend)
    ok, why = spec.capability(Problem(HK, HV, DK, DV))
    if not ok:
        pytest.skip(f"{backend} cannot run here: {why}")
    return spec, registry.default_variant(backend, Problem(HK, HV, DK, DV))


@pytest.mark.parametrize("backend", registry.names())
def test_decode_rows_read_and_write_their_pool_rows(backend):
    """B = 4 decode rows (T = 2: the recurrent kernels) on every registered backend, one a
    padding row (-1: a zero state, nothing written); the other pool rows unchanged."""
    spec, variant = _runnable(backend)
    _check_pool_call(spec.framework, _inputs(1, 4, 2), np.array([4, -1, 0, 2], np.int32),
                     variant)


@pytest.mark.parametrize("backend", registry.names())
def test_output_state_indices_write_other_rows_and_keep_the_rows_read(backend):
    """Rows read pool[4], a zero state, pool[0], pool[2] and write pool[1], pool[3], nothing,
    pool[4] (FlashInfer's output_state_indices: the state before a verify window stays in its
    row): rows 0 and 2 keep their values, row 4 is read before it is written."""
    spec, variant = _runnable(backend)
    _check_pool_call(spec.framework, _inputs(7, 4, 2), np.array([4, -1, 0, 2], np.int32),
                     variant, out=np.array([1, 3, -1, 4], np.int32))


#: a server step's rows, decode (one token) and prefill mixed, as one packed row
MIXED_LENGTHS = (1, 1, 40, 1, 17)


@pytest.mark.parametrize("backend", [
    # xla's and pallas_tpu's (~40 s each here) in make test-all: ffi_cpu and pallas_gpu run the
    # same packed algebra and Pallas packed core
    pytest.param(b, marks=pytest.mark.slow) if b in ("xla", "pallas_tpu") else b
    for b in registry.names()])
def test_a_servers_mixed_batch_runs_as_one_packed_call_over_the_pool(backend):
    """Decode and prefill rows of one server step (lengths `MIXED_LENGTHS`) in one packed call
    (cu_seqlens), every row reading and writing its pool row (one padding row reads a zero
    state and writes nothing, one writes elsewhere), against float64 per sequence."""
    spec, variant = _runnable(backend)
    cu = np.concatenate([[0], np.cumsum(MIXED_LENGTHS)]).astype(np.int32)
    x = _inputs(8, 1, int(cu[-1]))
    idx, out = np.array([3, 0, -1, 5, 2], np.int32), np.array([3, 1, 4, 5, -1], np.int32)
    _check_pool_call(spec.framework, x, idx, variant, cu_seqlens=cu, out=out)


@pytest.mark.parametrize("framework", ["jax", "mlx"])
def test_prefill_and_packed_rows_through_the_chunk_path(framework):
    """A prefill of T = 70 (chunk kernels) and a packed row of three requests (cu_seqlens,
    state_indices [N]) from and into the pool."""
    _check_pool_call(framework, _inputs(2, 2, 70), np.array([5, 1], np.int32))
    _check_pool_call(framework, _inputs(3, 1, 70), np.array([3, -1, 0], np.int32),
                     cu_seqlens=np.array([0, 20, 41, 70], np.int32))


@pytest.mark.parametrize("framework", ["jax", "mlx"])
def test_all_padding_rows_leave_the_pool_as_it_was(framework):
    gated_delta, array, numpy = entry(framework)
    x = _inputs(4, 2, 1)
    y, pool = gated_delta(*(array(x[n]) for n in ("q", "k", "v", "g", "beta", "pool")),
                          state_indices=array(np.array([-1, -3], np.int32)))
    np.testing.assert_array_equal(numpy(pool), x["pool"])
    y_ref, _ = reference.forward(x["q"], x["k"], x["v"], x["g"], x["beta"], None)
    assert relative_error(numpy(y), y_ref) <= TOL


def test_jax_donated_pool_is_aliased_and_traced_indices_are_not_read():
    import jax
    import jax.numpy as jnp

    from gdngen.jax import gated_delta

    x = _inputs(5, 3, 1)
    rest = [jnp.asarray(x[n]) for n in ("k", "v", "g", "beta")]

    def step(pool, q, idx):
        return gated_delta(q, *rest, pool, state_indices=idx)

    args = (jnp.asarray(x["pool"]), jnp.asarray(x["q"]), jnp.asarray(np.array([1, 1, 2],
                                                                               np.int32)))
    compiled = jax.jit(step, donate_argnums=0).lower(*args).compile().as_text()
    header = compiled.splitlines()[0]
    assert "input_output_alias={ {1}: (0, {}, may-alias) }" in header, header
    # traced indices cannot be checked for repeats (the caller's contract): it runs
    y, pool = jax.jit(step)(*args)
    assert y.shape == (3, 1, HV, DV) and pool.shape == (P, HV, DV, DK)


def test_mlx_pool_is_updated_in_place_without_a_copy():
    """The returned pool is the array passed; a 64 MiB pool updated for two rows peaks at a
    few MiB over what is resident (a copy would add 64 MiB)."""
    import mlx.core as mx

    from gdngen.mlx import gated_delta

    pool = mx.zeros((256, 4, 128, 128))
    x = _inputs(6, 2, 1)
    q = mx.array(np.repeat(x["q"], 4, axis=-1))
    k = mx.array(np.repeat(x["k"], 4, axis=-1) / 2)
    v = mx.array(np.repeat(np.repeat(x["v"], 4, axis=-1), 2, axis=2))
    g, beta = mx.full((2, 1, 4), -0.1), mx.full((2, 1, 4), 0.5)
    idx = mx.array(np.array([7, -1], np.int32))
    mx.eval(pool, q, k, v, g, beta, idx)
    _, out = gated_delta(q, k, v, g, beta, pool, state_indices=idx)
    assert out is pool
    mx.eval(out)
    mx.reset_peak_memory()
    resident = mx.get_active_memory()
    for _ in range(2):
        y, pool = gated_delta(q, k, v, g, beta, pool, state_indices=idx)
        mx.eval(y, pool)
    assert mx.get_peak_memory() - resident < 16 * 2 ** 20
    assert float(mx.abs(pool[7]).sum()) > 0 and float(mx.abs(pool[0]).sum()) == 0


@pytest.mark.parametrize("framework", ["jax", "mlx"])
def test_bfloat16_state_storage(framework):
    """state_dtype="bfloat16": initial_state and the returned state (pool or not) in
    bfloat16, the recurrence in float32 (the result is the float32 one rounded)."""
    gated_delta, array, numpy = entry(framework)
    bf16, f32 = dtype(framework, "bfloat16"), dtype(framework, "float32")
    x = _inputs(7, 2, 5)
    args = [array(x[n]) for n in ("q", "k", "v", "g", "beta")]
    stored = array(x["pool"][:2]).astype(bf16)
    y, state = gated_delta(*args, stored, state_dtype="bfloat16")
    assert str(state.dtype).endswith("bfloat16")
    y32, state32 = gated_delta(*args, stored.astype(f32))
    np.testing.assert_array_equal(numpy(y), numpy(y32))
    np.testing.assert_array_equal(numpy(state.astype(f32)),
                                  numpy(state32.astype(bf16).astype(f32)))
    pool = array(x["pool"]).astype(bf16)
    _, pool2 = gated_delta(*args, pool, state_indices=array(np.array([3, 0], np.int32)),
                           state_dtype="bfloat16")
    assert str(pool2.dtype).endswith("bfloat16")


BAD = [
    ({"state_indices": np.array([1, 1], np.int32)}, "state_indices repeats \\[1\\]"),
    ({"state_indices": np.array([0, 6], np.int32)}, "state_indices has 6, past the pool of 6"),
    ({"state_indices": np.array([0, 1], np.float32)}, "state_indices has dtype float32"),
    ({"state_indices": np.array([0, 1, 2], np.int32)}, "state_indices has shape \\(3,\\)"),
    ({"state_indices": np.array([0, 1], np.int32), "pool": None}, "state_indices needs"),
    ({"state_indices": np.array([0, 1], np.int32), "pool": np.zeros((6, 2, 32, 16))},
     "expected a pool \\(P, 2, 32, 32\\)"),
    ({"state_dtype": "float16"}, "state_dtype must be one of"),
    ({"state_dtype": "bfloat16"}, "initial_state has dtype float32, expected bfloat16"),
    ({"output_state_indices": np.array([0, 1], np.int32)},
     "output_state_indices needs state_indices and a pool"),
    ({"state_indices": np.array([0, 1], np.int32),
      "output_state_indices": np.array([2, 2], np.int32)}, "output_state_indices repeats \\[2\\]"),
    ({"state_indices": np.array([0, 1], np.int32),
      "output_state_indices": np.array([-1, 9], np.int32)},
     "output_state_indices has 9, past the pool of 6"),
    ({"state_indices": np.array([0, 1], np.int32),
      "output_state_indices": np.array([3], np.int32)},
     "output_state_indices has shape \\(1,\\), expected \\(2,\\)"),
]


@pytest.mark.parametrize("framework", ["jax", "mlx"])
@pytest.mark.parametrize("bad, message", BAD, ids=[f"bad{i}" for i in range(len(BAD))])
def test_bad_pool_arguments_name_the_argument(framework, bad, message):
    gated_delta, array, _ = entry(framework)
    x = _inputs(8, 2, 1)
    pool = bad.get("pool", x["pool"][:2] if "state_indices" not in bad else x["pool"])
    kwargs = {n: array(a) for n, a in bad.items()
              if n in ("state_indices", "output_state_indices")}
    if "state_dtype" in bad:
        kwargs["state_dtype"] = bad["state_dtype"]
    with pytest.raises(ValueError, match=message):
        gated_delta(*(array(x[n]) for n in ("q", "k", "v", "g", "beta")),
                    None if pool is None else array(np.asarray(pool, np.float32)), **kwargs)


@pytest.mark.parametrize("framework", ["jax", "mlx"])
def test_load_tuned_callable_takes_a_pool(framework):
    import gdngen

    _, array, numpy = entry(framework)
    x = _inputs(9, 2, 3)
    idx = np.array([2, 5], np.int32)
    tuned = gdngen.load_tuned(framework)
    y, pool = tuned(*(array(x[n]) for n in ("q", "k", "v", "g", "beta", "pool")),
                    state_indices=array(idx), scale=DK ** -0.5)
    y_ref, pool_ref = _expected(x, idx, DK ** -0.5)
    assert relative_error(numpy(y), y_ref) <= TOL
    assert relative_error(numpy(pool), pool_ref) <= TOL
