"""The Metal simulator on small hand-written MSL kernels: results, and the bugs it must expose."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from gdngen.backends.metal import sim as metal_sim
from gdngen.backends.metal.sim import source

pytestmark = pytest.mark.skipif(not metal_sim.available(), reason="no C++ compiler (g++)")

F32 = np.float32

REDUCE = """
    uint tid = thread_position_in_threadgroup.x;
    uint group = threadgroup_position_in_grid.x;
    threadgroup float partial[64];
    partial[tid] = inp[group * 64 + tid];
    threadgroup_barrier(mem_flags::mem_threadgroup);
    for (uint s = 32; s > 0; s >>= 1) {
        if (tid < s) {
            partial[tid] += partial[tid + s];
        }
        threadgroup_barrier(mem_flags::mem_threadgroup);
    }
    if (tid == 0) {
        out[group] = partial[0] * scale;
    }
"""


def _reduce(kernel, x, **kw):
    groups = x.size // 64
    return kernel(inputs=[x, np.array(2.0, F32)], grid=(x.size, 1, 1), threadgroup=(64, 1, 1),
                  output_shapes=[(groups,)], output_dtypes=[F32], **kw)[0]


@pytest.mark.parametrize("schedule", ["forward", "reverse", "random"])
def test_threadgroup_reduction_with_barriers(schedule):
    rng = np.random.default_rng()
    x = rng.standard_normal(8 * 64).astype(F32)
    kernel = metal_sim.metal_kernel("reduce", ["inp", "scale"], ["out"], REDUCE)
    out = _reduce(kernel, x, schedule=schedule, seed=int(rng.integers(1 << 30)))
    # float32 tree sums: error relative to sum |x| (the sum itself may nearly cancel)
    np.testing.assert_allclose(out, 2 * x.reshape(8, 64).sum(1, dtype=np.float64), rtol=0,
                               atol=1e-6 * np.abs(x).sum())
    assert kernel.last_threadgroup_bytes == 64 * 4


def test_missing_barrier_fails_detectably():
    """Without the barrier before the tree, thread 0 reads partials nobody wrote yet."""
    first_barrier = "    threadgroup_barrier(mem_flags::mem_threadgroup);\n    for"
    broken = REDUCE.replace(first_barrier, "    for")
    assert broken != REDUCE
    kernel = metal_sim.metal_kernel("reduce_no_barrier", ["inp", "scale"], ["out"], broken)
    x = np.random.default_rng().standard_normal(2 * 64).astype(F32)
    with pytest.raises(metal_sim.SimulatorError, match="poison"):
        _reduce(kernel, x)


def test_barrier_not_reached_by_every_thread_is_an_error_not_a_hang():
    body = """
        if (thread_position_in_threadgroup.x < 5) {
            threadgroup_barrier(mem_flags::mem_threadgroup);
        }
        out[thread_position_in_grid.x] = inp[thread_position_in_grid.x];
    """
    kernel = metal_sim.metal_kernel("divergent_barrier", ["inp"], ["out"], body)
    with pytest.raises(metal_sim.SimulatorError, match="barrier not reached by every thread"):
        kernel(inputs=[np.ones(64, F32)], grid=(64, 1, 1), threadgroup=(32, 1, 1),
               output_shapes=[(64,)], output_dtypes=[F32])


def test_divergent_simd_function_is_an_error():
    body = """
        float x = inp[thread_position_in_grid.x];
        if (thread_index_in_simdgroup < 16) {
            x = simd_sum(x);
        }
        out[thread_position_in_grid.x] = x;
    """
    kernel = metal_sim.metal_kernel("divergent_simd", ["inp"], ["out"], body)
    with pytest.raises(metal_sim.SimulatorError, match="simd_sum"):
        kernel(inputs=[np.ones(32, F32)], grid=(32, 1, 1), threadgroup=(32, 1, 1),
               output_shapes=[(32,)], output_dtypes=[F32])


def test_simdgroup_matmul_matches_numpy():
    """A 16 x 16 product from 8x8 simdgroup fragments, one output fragment per simdgroup."""
    body = """
        uint sg = simdgroup_index_in_threadgroup;
        uint bi = sg / 2, bj = sg % 2;
        simdgroup_float8x8 a, b;
        simdgroup_float8x8 c = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
        for (uint k = 0; k < 16; k += 8) {
            simdgroup_load(a, A + bi * 8 * 16 + k, 16);
            simdgroup_load(b, B + k * 16 + bj * 8, 16);
            simdgroup_multiply_accumulate(c, a, b, c);
        }
        simdgroup_store(c, C + bi * 8 * 16 + bj * 8, 16);
    """
    rng = np.random.default_rng()
    A, B = (rng.standard_normal((16, 16)).astype(F32) for _ in range(2))
    kernel = metal_sim.metal_kernel("mm16", ["A", "B"], ["C"], body)
    (C,) = kernel(inputs=[A, B], grid=(128, 1, 1), threadgroup=(128, 1, 1),
                  output_shapes=[(16, 16)], output_dtypes=[F32])
    np.testing.assert_allclose(C, A.astype(np.float64) @ B, rtol=1e-5, atol=1e-5)


def test_thread_elements_follow_apples_fragment_layout():
    """Lane l holds row (l/4 & 4) + (l/2 % 4), columns (l/4 & 2) * 2 + (l % 2) * 2 (+1)."""
    body = """
        simdgroup_float8x8 m;
        simdgroup_load(m, A, 8);
        uint l = thread_index_in_simdgroup;
        out[2 * l] = m.thread_elements()[0];
        out[2 * l + 1] = m.thread_elements()[1];
    """
    A = np.arange(64, dtype=F32).reshape(8, 8)
    kernel = metal_sim.metal_kernel("frag_layout", ["A"], ["out"], body)
    (out,) = kernel(inputs=[A], grid=(32, 1, 1), threadgroup=(32, 1, 1), output_shapes=[(64,)],
                    output_dtypes=[F32])
    for lane in range(32):
        row = ((lane // 4) & 4) + (lane // 2) % 4
        col = ((lane // 4) & 2) * 2 + (lane % 2) * 2
        assert out[2 * lane] == A[row, col] and out[2 * lane + 1] == A[row, col + 1]


def test_simd_functions_match_numpy():
    body = """
        uint l = thread_index_in_simdgroup;
        float x = inp[thread_position_in_grid.x];
        uint base = thread_position_in_grid.x * 7;
        out[base + 0] = simd_sum(x);
        out[base + 1] = simd_max(x);
        out[base + 2] = simd_shuffle(x, (l + 5) % 32);
        out[base + 3] = simd_shuffle_xor(x, 6);
        out[base + 4] = simd_broadcast(x, 3);
        out[base + 5] = simd_prefix_inclusive_sum(x);
        out[base + 6] = simd_prefix_exclusive_sum(x);
    """
    rng = np.random.default_rng()
    x = rng.integers(-50, 50, 64).astype(F32)  # integers: every summation order is exact
    kernel = metal_sim.metal_kernel("simd_ops", ["inp"], ["out"], body)
    (out,) = kernel(inputs=[x], grid=(64, 1, 1), threadgroup=(64, 1, 1),
                    output_shapes=[(64 * 7,)], output_dtypes=[F32])
    out = out.reshape(2, 32, 7)
    for s in range(2):
        v = x[32 * s: 32 * (s + 1)]
        lanes = np.arange(32)
        expected = np.stack([np.full(32, v.sum()), np.full(32, v.max()), v[(lanes + 5) % 32],
                             v[lanes ^ 6], np.full(32, v[3]), np.cumsum(v),
                             np.cumsum(v) - v], axis=1)
        np.testing.assert_array_equal(out[s], expected)


def test_out_of_bounds_write_names_kernel_and_buffer():
    body = "out[thread_position_in_grid.x + 1] = inp[thread_position_in_grid.x];"
    kernel = metal_sim.metal_kernel("oob_write", ["inp"], ["out"], body)
    with pytest.raises(metal_sim.SimulatorError,
                       match=r"custom_kernel_oob_write.*'out' out of bounds"):
        kernel(inputs=[np.ones(256, F32)], grid=(256, 1, 1), threadgroup=(32, 1, 1),
               output_shapes=[(256,)], output_dtypes=[F32])


def test_far_out_of_bounds_read_and_write_to_input_are_caught():
    read = "out[thread_position_in_grid.x] = inp[thread_position_in_grid.x + 5000];"
    kernel = metal_sim.metal_kernel("oob_read", ["inp"], ["out"], read)
    with pytest.raises(metal_sim.SimulatorError, match="'inp' out of bounds"):
        kernel(inputs=[np.ones(64, F32)], grid=(64, 1, 1), threadgroup=(32, 1, 1),
               output_shapes=[(64,)], output_dtypes=[F32])
    write = """((device float*)inp)[3] = 1.0f;
               out[thread_position_in_grid.x] = 0.0f;"""
    kernel = metal_sim.metal_kernel("input_write", ["inp"], ["out"], write)
    with pytest.raises(metal_sim.SimulatorError, match="wrote to input buffer 'inp'"):
        kernel(inputs=[np.ones(64, F32)], grid=(64, 1, 1), threadgroup=(32, 1, 1),
               output_shapes=[(64,)], output_dtypes=[F32])


def test_threadgroup_overflow_is_caught():
    body = """
        threadgroup float a[32];
        threadgroup float b[32];
        uint t = thread_position_in_threadgroup.x;
        a[t + 1] = inp[t];
        b[t] = 1.0f;
        threadgroup_barrier(mem_flags::mem_threadgroup);
        out[t] = a[t] + b[t];
    """
    kernel = metal_sim.metal_kernel("tg_overflow", ["inp"], ["out"], body)
    with pytest.raises(metal_sim.SimulatorError, match="past the end of threadgroup variable 'a'"):
        kernel(inputs=[np.ones(32, F32)], grid=(32, 1, 1), threadgroup=(32, 1, 1),
               output_shapes=[(32,)], output_dtypes=[F32])


def test_threadgroup_memory_over_the_limit_is_an_error():
    body = """
        threadgroup float big[9000];
        big[thread_position_in_threadgroup.x] = 1.0f;
        out[thread_position_in_grid.x] = big[thread_position_in_threadgroup.x];
    """
    kernel = metal_sim.metal_kernel("tg_too_big", ["inp"], ["out"], body)
    with pytest.raises(metal_sim.SimulatorError, match="36000 bytes of threadgroup memory"):
        kernel(inputs=[np.ones(32, F32)], grid=(32, 1, 1), threadgroup=(32, 1, 1),
               output_shapes=[(32,)], output_dtypes=[F32])


def test_unwritten_output_is_an_error():
    body = """
        if (thread_position_in_grid.x != 7) {
            out[thread_position_in_grid.x] = inp[thread_position_in_grid.x];
        }
    """
    kernel = metal_sim.metal_kernel("partial_write", ["inp"], ["out"], body)
    with pytest.raises(metal_sim.SimulatorError, match=r"1 of 64 elements of output 'out'.*\(7,\)"):
        kernel(inputs=[np.ones(64, F32)], grid=(64, 1, 1), threadgroup=(32, 1, 1),
               output_shapes=[(64,)], output_dtypes=[F32])
    out = kernel(inputs=[np.ones(64, F32)], grid=(64, 1, 1), threadgroup=(32, 1, 1),
                 output_shapes=[(64,)], output_dtypes=[F32], init_value=-3.0)[0]
    assert out[7] == -3.0 and out[6] == 1.0


def test_half_and_bfloat_round_to_nearest_even():
    """Conversions and arithmetic (a + b rounded once) against NumPy float16 and ml_dtypes."""
    body = """
        uint i = thread_position_in_grid.x;
        float x = inp[i], y = inp2[i];
        oh[i] = half(x);
        ob[i] = bfloat(x);
        sh[i] = float(half(x) + half(y));
        sb[i] = float(bfloat(x) * bfloat(y));
    """
    rng = np.random.default_rng()
    special = np.array([0.0, -0.0, 65504.0, 65519.99, 65520.0, 1e6, 6.1e-5, 5.96e-8, 2.98e-8,
                        3.0e-8, 1e-10, np.inf, -np.inf, np.nan, 1 + 2 ** -11, 1 + 3 * 2 ** -11,
                        1 + 2 ** -8, 1 + 3 * 2 ** -8, 3.3895314e38], F32)
    x = np.concatenate([special, rng.standard_normal(4096 - special.size).astype(F32)
                        * np.exp2(rng.integers(-30, 20, 4096 - special.size)).astype(F32)])
    y = rng.standard_normal(x.size).astype(F32)
    kernel = metal_sim.metal_kernel("lowp", ["inp", "inp2"], ["oh", "ob", "sh", "sb"], body)
    oh, ob, sh, sb = kernel(inputs=[x, y], grid=(x.size, 1, 1), threadgroup=(256, 1, 1),
                            output_shapes=[x.shape] * 4,
                            output_dtypes=[np.float16, ml_dtypes.bfloat16, F32, F32])
    bf16 = ml_dtypes.bfloat16
    with np.errstate(over="ignore", invalid="ignore"):
        np.testing.assert_array_equal(oh.view(np.uint16)[~np.isnan(x)],
                                      x.astype(np.float16).view(np.uint16)[~np.isnan(x)])
        np.testing.assert_array_equal(ob.astype(F32), x.astype(bf16).astype(F32))
        assert np.isnan(oh[np.isnan(x)]).all() and np.isnan(ob.astype(F32)[np.isnan(x)]).all()
        np.testing.assert_array_equal(
            sh, (x.astype(np.float16) + y.astype(np.float16)).astype(F32))
        np.testing.assert_array_equal(
            sb, (x.astype(bf16).astype(F32) * y.astype(bf16).astype(F32)).astype(bf16)
            .astype(F32))


def test_signature_follows_mlx():
    text = source.kernel_source(
        "k", ["a", "s", "small"], ["out"],
        "out[thread_position_in_grid.x] = a[a_strides[0]] + s + small[0];", "// header\n",
        [("float16", 2, 64), ("float32", 0, 1), ("int32", 1, 3)], ["float32"],
        template=[("T", "bfloat16"), ("N", 4), ("B", True)])
    assert text.kernel_name == "custom_kernel_k__bfloat16_t_4_1_float16_t_floats_int32_tc_float"
    assert text.source == (
        "// header\n"
        "template <typename T, int N, bool B>\n"
        f"[[kernel]] void {text.kernel_name}(\n"
        "  const device float16_t* a [[buffer(0)]],\n"
        "  const constant int64_t* a_strides [[buffer(1)]],\n"
        "  const constant float& s [[buffer(2)]],\n"
        "  const constant int32_t* small [[buffer(3)]],\n"
        "  device float* out [[buffer(4)]],\n"
        "  uint3 thread_position_in_grid [[thread_position_in_grid]]) {\n"
        "out[thread_position_in_grid.x] = a[a_strides[0]] + s + small[0];\n"
        "}\n\n"
        f'template [[host_name("{text.kernel_name}")]] [[kernel]] '
        f"decltype({text.kernel_name}<bfloat16_t, 4, 1>) {text.kernel_name}<bfloat16_t, 4, 1>;\n")


def test_shape_companions_and_template_args_reach_the_kernel():
    body = """
        uint i = thread_position_in_grid.x;
        out[i] = T(a[i] * float(N) + float(a_shape[1]) + float(a_ndim));
    """
    a = np.arange(12, dtype=F32).reshape(3, 4)
    kernel = metal_sim.metal_kernel("companions", ["a"], ["out"], body)
    (out,) = kernel(inputs=[a], template=[("T", np.float16), ("N", 3)], grid=(12, 1, 1),
                    threadgroup=(12, 1, 1), output_shapes=[(12,)], output_dtypes=[np.float16])
    np.testing.assert_array_equal(out, (a.ravel() * 3 + 4 + 2).astype(np.float16))


def test_threadgroup_declarations_are_rewritten_pointers_are_not():
    text = """threadgroup float tile[C * 8];
threadgroup float* row = tile + 8;
void f(threadgroup float* p, int n);
threadgroup_barrier(mem_flags::mem_threadgroup);
// threadgroup float in_a_comment[4];
"""
    out = source.rewrite_threadgroup_variables(text)
    assert out.splitlines()[0].startswith("float (&tile)[C * 8] = *reinterpret_cast")
    assert out.splitlines()[1:] == text.splitlines()[1:]
    with pytest.raises(ValueError, match="one threadgroup variable per declaration"):
        source.rewrite_threadgroup_variables("threadgroup float a, b;")


def test_compiled_kernels_are_cached_by_source_hash(tmp_path, monkeypatch):
    from gdngen.backends.metal.sim import compiler

    monkeypatch.setenv("GDNGEN_METAL_SIM_CACHE", str(tmp_path))
    text = "// cache probe\n" + source.simulator_source(source.kernel_source(
        "probe", ["a"], ["o"], "o[thread_position_in_grid.x] = a[thread_position_in_grid.x];",
        "", [("float32", 1, 4)], ["float32"]))
    first = compiler.kernel_library(text, "probe")
    mtime = first.stat().st_mtime_ns
    assert compiler.kernel_library(text, "probe") == first
    assert first.stat().st_mtime_ns == mtime
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp files left


def test_wheel_ships_the_simulator_sources():
    """pyproject's package data covers every C/C++ file the simulator compiles at run time."""
    tomllib = pytest.importorskip("tomllib", reason="tomllib needs Python 3.11")
    from pathlib import Path

    from gdngen.backends.metal.sim import compiler

    root = Path(__file__).resolve().parents[3]
    config = tomllib.loads((root / "pyproject.toml").read_text())
    patterns = config["tool"]["setuptools"]["package-data"]["gdngen.backends.metal.sim"]
    for path in (compiler.SHIM_HEADER, compiler.RUNTIME_HEADER, compiler.RUNTIME_SOURCE):
        assert path.parent == root / "gdngen" / "backends" / "metal" / "sim"
        assert any(path.match(p) for p in patterns), path.name


def test_threadgroup_underflow_is_caught():
    body = """
        threadgroup float a[32];
        uint t = thread_position_in_threadgroup.x;
        a[int(t) - 1] = inp[t];
        threadgroup_barrier(mem_flags::mem_threadgroup);
        out[t] = 0.0f;
    """
    kernel = metal_sim.metal_kernel("tg_underflow", ["inp"], ["out"], body)
    with pytest.raises(metal_sim.SimulatorError, match="before the start of threadgroup variable"):
        kernel(inputs=[np.ones(32, F32)], grid=(32, 1, 1), threadgroup=(32, 1, 1),
               output_shapes=[(32,)], output_dtypes=[F32])


@pytest.mark.metal
def test_generated_source_matches_mlx(capfd):
    """On a Mac, MLX prints the source it compiles (verbose=True): it must be ours, verbatim."""
    mx = pytest.importorskip("mlx.core", reason="needs MLX")
    if not mx.metal.is_available():
        pytest.skip("needs an Apple GPU (MLX Metal backend)")
    body = "out[thread_position_in_grid.x] = T(a[a_strides[0] * thread_position_in_grid.x]);"
    kernel = mx.fast.metal_kernel(name="sig_check", input_names=["a"], output_names=["out"],
                                  source=body, header="// header\n")
    a = mx.arange(16, dtype=mx.float16)
    out = kernel(inputs=[a], template=[("T", mx.float32)], grid=(16, 1, 1),
                 threadgroup=(16, 1, 1), output_shapes=[(16,)], output_dtypes=[mx.float32],
                 verbose=True)[0]
    mx.eval(out)
    printed = capfd.readouterr().out
    ours = source.kernel_source("sig_check", ["a"], ["out"], body, "// header\n",
                                [("float16", 1, 16)], ["float32"], template=[("T", "float32")])
    assert ours.source.strip() in printed
