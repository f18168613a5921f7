"""Benchmark machinery, exercised in-process with small stand-in kernels.

The stand-ins (a plain sequential recurrence) exist only here, so these tests check the timing,
memory and row plumbing of gdngen.tools.bench independently of the real chunkwise kernels.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

from gdngen.flops import chunkwise_flops
from gdngen.tools import bench

CFG = bench.BenchConfig(seq_lens=(8, 16), batch=1, hk=1, hv=2, dk=16, dv=16, chunk_size=8,
                        repeats=1, baseline_max_T=8, matmul_n=64)


def test_flops_model_by_hand():
    B, T, Hk, Hv, Dk, Dv, C = 2, 100, 1, 2, 16, 8, 32
    n = 4  # ceil(100 / 32)
    key = 2 * 2 * C * C * Dk
    value = (2 * C**3) / 3 + 2 * C * C * Dv + 2 * C * C * Dk + 3 * 2 * C * Dk * Dv \
        + 2 * C * C * Dv
    assert chunkwise_flops(B, T, Hk, Hv, Dk, Dv, C) == round(3 * B * n * (Hk * key + Hv * value))
    with pytest.raises(ValueError):
        chunkwise_flops(1, 0, 1, 1, 16, 16, 64)


def _jax_stand_in(q, k, v, g, beta, s0, *, scale, gate, variant=None):
    import jax
    import jax.numpy as jnp

    assert gate == "log"
    r = v.shape[2] // q.shape[2]
    f32 = jnp.float32
    q, k = (jnp.repeat(x.astype(f32), r, axis=2) for x in (q, k))
    xs = tuple(jnp.moveaxis(x.astype(f32), 1, 0) for x in (q, k, v, g, beta))

    def step(S, x):
        qt, kt, vt, gt, bt = x
        # scalar gate [B,Hv]: the whole state; vector gate [B,Hv,Dk]: column-wise over Dk
        S = (jnp.exp(gt)[..., None, :] if gt.ndim == 3 else jnp.exp(gt)[..., None, None]) * S
        delta = bt[..., None] * (vt - jnp.einsum("bhvk,bhk->bhv", S, kt))
        S = S + delta[..., :, None] * kt[..., None, :]
        return S, scale * jnp.einsum("bhvk,bhk->bhv", S, qt)

    S, ys = jax.lax.scan(step, s0, xs)
    return jnp.moveaxis(ys, 0, 1), S


def test_measure_jax_with_stand_in(monkeypatch):
    pytest.importorskip("jax")
    monkeypatch.setattr(bench, "_jax_kernels", lambda: (_jax_stand_in, _jax_stand_in))
    rows = bench.measure("jax", CFG)
    assert [r["T"] for r in rows] == [8, 16]
    for r in rows:
        assert tuple(r) == bench.ROW_KEYS
        assert r["chunk_ms"] > 0 and r["chunk_peak_bytes"] > 0 and r["matmul_gflops"] > 0
    assert rows[0]["baseline_ms"] > 0 and rows[0]["speedup"] > 0
    assert rows[1]["baseline_ms"] is None and rows[1]["speedup"] is None  # T > baseline_max_T
    assert "memory_analysis" in rows[0]["memory_measure"]
    assert {r["backend"] for r in rows} == {bench.chunk_backend("jax", CFG)}
    json.dumps(rows)


def test_measure_jax_vector_gate(monkeypatch):
    """gate="vector": the kernels get per-channel g [B,T,Hv,Dk] and the rows say so."""
    pytest.importorskip("jax")
    seen = []

    def stand_in(q, k, v, g, beta, s0, **kwargs):
        seen.append(g.shape)
        return _jax_stand_in(q, k, v, g, beta, s0, **kwargs)

    monkeypatch.setattr(bench, "_jax_kernels", lambda: (stand_in, stand_in))
    cfg = bench.BenchConfig(seq_lens=(8,), batch=1, hk=1, hv=2, dk=16, dv=16, chunk_size=8,
                            repeats=1, baseline_max_T=8, matmul_n=0, gate="vector")
    assert cfg.problem().gate == "vector"
    (row,) = bench.measure("jax", cfg)
    assert row["gate"] == "vector" and row["speedup"] > 0
    assert set(seen) == {(1, 8, 2, 16)}  # traced once per kernel, each with a vector gate
    assert bench.make_inputs(cfg, 8)["g"].shape == (1, 8, 2, 16)
    with pytest.raises(ValueError, match="gate must be one of"):
        bench.BenchConfig(gate="channel")


def test_chunk_backend_auto_and_explicit(monkeypatch):
    pytest.importorskip("jax")
    from gdngen.backends import ffi_cpu

    if ffi_cpu.available():
        assert bench.chunk_backend("jax", CFG) == "ffi_cpu"
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    ffi_cpu.available.cache_clear()
    try:
        assert bench.chunk_backend("jax", CFG) == "xla"  # no compiler: the portable path
    finally:
        monkeypatch.delenv("CXX")
        ffi_cpu.available.cache_clear()
    assert bench.chunk_backend("mlx", CFG) == "mlx"
    xla = bench.BenchConfig(seq_lens=(8,), chunk_size=32, backend="xla")
    variant = bench.chunk_variant("jax", xla)
    assert variant.backend == "xla" and variant["chunk_size"] == 32
    with pytest.raises(ValueError, match="does not run on mlx"):
        bench.chunk_backend("mlx", xla)
    with pytest.raises(ValueError, match="backend must be 'auto' or one of"):
        bench.BenchConfig(backend="cuda")
    assert bench.frameworks_for(CFG, ("jax", "mlx")) == ("jax", "mlx")
    assert bench.frameworks_for(xla, ("jax", "mlx")) == ("jax",)
    with pytest.raises(ValueError, match="backend xla runs on jax, not on mlx"):
        bench.frameworks_for(xla, ("mlx",))


def test_measure_mlx_with_stand_in(monkeypatch):
    mx = pytest.importorskip("mlx.core")
    gated_delta_ops = pytest.importorskip("mlx_lm.models.gated_delta").gated_delta_ops

    def stand_in(q, k, v, g, beta, s0, *, scale, gate, variant=None):
        return gated_delta_ops(q * scale, k, v, mx.exp(g), beta, s0)

    monkeypatch.setattr(bench, "_mlx_kernels", lambda: (stand_in, stand_in))
    rows = bench.measure("mlx", CFG)
    assert [r["T"] for r in rows] == [8, 16]
    for r in rows:
        assert tuple(r) == bench.ROW_KEYS
        assert r["chunk_ms"] > 0 and r["chunk_peak_bytes"] > 0 and r["matmul_gflops"] > 0
    assert rows[0]["speedup"] > 0 and rows[1]["baseline_ms"] is None
    assert "get_peak_memory" in rows[0]["memory_measure"]


def _fake_row(**over):
    row = dict.fromkeys(bench.ROW_KEYS, 1)
    row.update(framework="jax", backend="xla", device="cpu", dtype="float32", memory_measure="m",
               matmul_shape="64x64x64", baseline_ms=None, speedup=None, baseline_peak_bytes=None)
    row.update(over)
    return row


def test_format_table_and_write_json(tmp_path):
    from rich.console import Console

    rows = [_fake_row(), _fake_row(T=2, baseline_ms=3.0, speedup=3.0, baseline_peak_bytes=2**20)]
    console = Console(width=200, record=True, color_system=None)
    console.print(bench.format_table(rows))
    text = console.export_text()
    assert "—" in text and "3.00" in text and "64x64x64" in text
    path = tmp_path / "sub" / "rows.json"
    bench.write_json(rows, path)
    assert json.loads(path.read_text()) == rows
    assert [p.name for p in path.parent.iterdir()] == ["rows.json"]  # no temp file left


def test_config_validation():
    with pytest.raises(ValueError, match="multiple"):
        bench.BenchConfig(hk=3, hv=8)
    with pytest.raises(ValueError, match="dtype"):
        bench.BenchConfig(dtype="float64")
    with pytest.raises(ValueError, match="seq_lens"):
        bench.BenchConfig(seq_lens=())


@pytest.mark.parametrize("settle", [False, True])
def test_time_fwd_bwd_interleaves_and_settles(settle, monkeypatch):
    """Each callable: one compile run, then ``repeats`` timed runs in rotating order; with
    ``settle`` an untimed run of the same callable right before each timed one."""
    from gdngen.problem import Problem
    from gdngen.tools import timing

    runs = []

    def fake_grad_fns(fns, problem, inputs):
        return {name: (lambda name=name: runs.append(name)) for name in fns}, lambda x: x

    monkeypatch.setattr(timing, "_jax_grad_fns", fake_grad_fns)
    res = timing.time_fwd_bwd("jax", {"a": None, "b": None}, Problem(1, 2, 16, 16), batch=1,
                              seq_len=8, repeats=3, settle=settle)
    assert all(len(t.times_s) == 3 for t in res.values())
    timed = [["a", "b"], ["b", "a"], ["a", "b"]]  # the order rotates each repeat
    expected = ["a", "b"] + [n for rep in timed for n in rep for _ in range(2 if settle else 1)]
    assert runs == expected



def test_time_fwd_bwd_call_inputs_replace_arrays_for_one_callable(monkeypatch):
    """``call_inputs`` gives one callable arrays of its own (a packed row's per-sequence
    initial states); the others keep the shared ones; a name not in ``fns`` is refused."""
    import numpy as np

    from gdngen.problem import Problem
    from gdngen.tools import timing

    seen = {}

    def fake_grad_fns(fns, problem, inputs):
        for name in fns:
            seen[name] = inputs["initial_state"].shape
        return {name: (lambda: None) for name in fns}, lambda x: x

    monkeypatch.setattr(timing, "_jax_grad_fns", fake_grad_fns)
    own = {"initial_state": np.zeros((3, 2, 16, 16), np.float32)}
    res = timing.time_fwd_bwd("jax", {"a": None, "b": None}, Problem(1, 2, 16, 16), batch=1,
                              seq_len=8, repeats=2, call_inputs={"b": own})
    assert seen == {"a": (1, 2, 16, 16), "b": (3, 2, 16, 16)} and list(res) == ["a", "b"]
    with pytest.raises(ValueError, match=r"call_inputs names \['c'\]"):
        timing.time_fwd_bwd("jax", {"a": None}, Problem(1, 2, 16, 16), batch=1, seq_len=8,
                            call_inputs={"c": own})

def _benchmark(name):
    path = Path(__file__).resolve().parent.parent / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _vector_gate_bench():
    return _benchmark("bench_vector_gate")


def test_layer_inputs_bench_smoke(capsys):
    """benchmarks/bench_layer_inputs.py runs end to end at a toy size on every installed
    framework, for the q/k norm and the gate: fused and computed-before both timed, with their
    memory (JAX: residuals kept by jax.vjp, the fused smaller by at least the normalised q and
    k, or by the log gate and one more gate-sized array; MLX: peaks)."""
    frameworks = [f for f in ("jax", "mlx") if importlib.util.find_spec(f)]
    if not frameworks:
        pytest.skip("neither jax nor mlx is installed")
    _benchmark("bench_layer_inputs").main(
        ["--frameworks", ",".join(frameworks), "--seq-len", "64", "--heads", "1,2", "--dim",
         "16", "--repeats", "1", "--json"])
    rows = json.loads(capsys.readouterr().out)
    assert {(r["inputs"], r["framework"], r["gate"]) for r in rows} == {
        (kind, f, gate) for kind in ("qk_norm", "gate") for f in frameworks
        for gate in ("scalar", "vector")}
    for r in rows:
        assert set(r["ms"]) == {"fused", "outside"} and min(r["ms"].values()) > 0
        if r["framework"] == "jax":
            if r["inputs"] == "qk_norm":  # the normalised q and k, [1, 64, 1, 16] float32 each
                least = 2 * 64 * 16 * 4
            else:  # the log gate and a softplus factor, [1, 64, 2(, 16)] float32 each
                least = 2 * 64 * 2 * (16 if r["gate"] == "vector" else 1) * 4
            saved = (r["memory"]["outside"]["residual_bytes"]
                     - r["memory"]["fused"]["residual_bytes"])
            assert saved >= least, r["memory"]
        else:
            assert min(m["peak_bytes"] for m in r["memory"].values()) > 0


def test_decode_inputs_bench_smoke(capsys):
    """benchmarks/bench_decode_inputs.py runs end to end at a toy size on every installed
    framework and gate kind, and its two callables (norm and gate inside the op, and before
    it) return the same outputs from the same raw inputs."""
    frameworks = [f for f in ("jax", "mlx") if importlib.util.find_spec(f)]
    if not frameworks:
        pytest.skip("neither jax nor mlx is installed")
    bench = _benchmark("bench_decode_inputs")
    for framework in frameworks:
        for vector in (False, True):
            raw = bench.make_inputs(1, 3, 1, 2, 16, vector, seed=5)
            if framework == "jax":
                import jax.numpy as ops
            else:
                import mlx.core as ops
            args = [ops.array(raw[n]) for n in ("q", "k", "v", "a", "beta", "A_log", "dt_bias",
                                                "state")]
            out = {n: [np.asarray(x) for x in f(*args)]
                   for n, f in bench.callables(framework, 16, None).items()}
            for fused, outside in zip(out["fused"], out["outside"]):
                np.testing.assert_allclose(fused, outside, rtol=2e-5, atol=2e-6)
    bench.main(["--frameworks", ",".join(frameworks), "--seq-lens", "1,3", "--heads", "1,2",
                "--dim", "16", "--repeats", "1", "--json"])
    rows = json.loads(capsys.readouterr().out)
    assert {(r["framework"], r["gate"], r["T"]) for r in rows} == {
        (f, gate, T) for f in frameworks for gate in ("scalar", "vector") for T in (1, 3)}
    assert all(set(r["ms"]) == {"fused", "outside"} and min(r["ms"].values()) > 0
               for r in rows)


@pytest.mark.parametrize("name", [pytest.param("textbook_chunked", marks=pytest.mark.slow),
                                  "textbook_scan"])
def test_vector_gate_baselines_match_reference(name):
    """benchmarks/bench_vector_gate.py's JAX baselines (the textbook chunked WY form, T=100
    padded to two chunks of 64, and the per-step scan) agree with the float64 reference on a
    small per-channel problem, forward and all six gradients."""
    pytest.importorskip("jax")
    module = _vector_gate_bench()
    errors = module.check_baseline(getattr(module, name), B=1, T=100, Hk=2, Hv=4, D=32)
    assert set(errors) == {"y", "final_state", "dq", "dk", "dv", "dg", "dbeta",
                           "dinitial_state"}
    assert max(errors.values()) < 1e-4, errors


@pytest.mark.slow  # benchmark scripts: the other smokes
def test_vector_gate_bench_smoke():
    """The vector-gate benchmark runs end to end at a toy size, as a user runs it (its own
    process), and reports ratios (and MLX peak memory where MLX and mlx-lm are installed)."""
    import subprocess
    import sys

    pytest.importorskip("jax")
    frameworks = ["jax"]
    if importlib.util.find_spec("mlx") and importlib.util.find_spec("mlx_lm"):
        frameworks.append("mlx")
    script = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_vector_gate.py"
    proc = subprocess.run([sys.executable, str(script), "--frameworks", ",".join(frameworks),
                           "--seq-lens", "16", "--heads", "1,2", "--dim", "16", "--repeats",
                           "1", "--skip-check", "--json"], capture_output=True, text=True,
                          timeout=900, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout)
    rows = {r["framework"]: r for r in out["rows"]}
    assert set(rows) == set(frameworks)
    assert set(rows["jax"]["over_gdngen"]) == {"scan", "chunked"}
    assert all(r["gate"] == "vector" and r["T"] == 16 for r in rows.values())
    if "mlx" in rows:
        assert set(rows["mlx"]["memory"]) == {"gdngen", "mlx-lm"}
        assert rows["mlx"]["memory"]["gdngen"]["peak_bytes"] > 0
        assert rows["mlx"]["memory_over_gdngen"]["mlx-lm"] > 0
    assert [t["ratio"] for t in out["targets"]] == [None] * 4  # none at T=16


def test_mixer_decode_bench_smoke(capsys):
    """benchmarks/bench_mixer.py's JAX decode runs end to end at a toy size: the jitted mixer
    step, the unfused one and the conv-first one each carry their states over the tokens and
    agree (the benchmark checks it before timing), every time positive."""
    pytest.importorskip("jax")
    _benchmark("bench_mixer").main(["--modes", "decode", "--frameworks", "jax", "--heads",
                                    "1,2", "--dim", "32", "--tokens", "3", "--repeats", "1",
                                    "--json"])
    (row,) = json.loads(capsys.readouterr().out)
    assert row["framework"] == "jax" and row["tokens"] == 3
    assert set(row["ms_per_token"]) == {"mixer", "unfused", "conv_first"}
    assert min(row["ms_per_token"].values()) > 0
