"""Time stage: forward+backward wall time and peak memory of the chunkwise path vs a baseline.

For each framework and sequence length T this measures the gradient of
``sum(y * dy) + sum(final_state * dfinal_state)`` with respect to all six inputs (q, k, v, g,
beta, initial_state), with g a log-decay gate and ``scale = Dk ** -0.5``. ``gate`` picks its
kind: "scalar" (g ``[B,T,Hv]``) or "vector" (per-channel, g ``[B,T,Hv,Dk]``; the problem, its
inputs and the chunkwise variant are then the vector-gate ones, and both baselines take the
per-channel g as it is):

* chunkwise: ``gdngen.jax.gated_delta`` / ``gdngen.mlx.gated_delta`` running the default
  variant of ``backend`` with chunk size C. ``backend="auto"`` takes, for JAX, the generated
  C++ kernels (``ffi_cpu``) on a CPU host that can build them and the portable ``xla`` path
  elsewhere, and for MLX its portable ``mlx`` path; each row names the backend it ran;
* baseline (sequential): ``gdngen.backends.portable.jax_chunkwise.sequential_gated_delta`` (a
float32
  ``lax.scan``) for JAX, ``mlx_lm.models.gated_delta.gated_delta_ops`` (a per-step loop; it takes
  a linear gate and no scale, so it gets ``exp(g)`` and ``q * scale``) for MLX. Lengths above
  ``baseline_max_T`` skip it.

Times are the median of ``repeats`` runs after one warm-up run (which also compiles), each run
synchronised (``jax.block_until_ready`` / ``mx.eval``). Peak memory is framework-specific and
named in each row's ``memory_measure``: JAX reports the compiled executable's
``memory_analysis()`` (argument + output + temp bytes), MLX reports ``mx.get_peak_memory()``
over the timed runs (inputs included). Achieved GFLOP/s uses `gdngen.flops.chunkwise_flops` (its
matmul count, the same for either gate: a vector gate's decay factors are elementwise work it
does not count); it is compared with two float32 matmul references measured by the same
framework in the same run: a square ``matmul_n`` cube (the framework's peak; ``matmul_*`` keys)
and one batched product with the kernel's own operand shape, ``B*Hv*ceil(T/C)`` products of
``[C,Dk] @ [Dk,Dv]`` at the largest T (``chunk_matmul_*`` keys), which is what the chunkwise
path is made of.

Each framework runs in a fresh subprocess by default (``run(..., isolate=True)``, speaking
`gdngen.worker_protocol` as tune's trials do) so that one framework's thread pools and allocator
do not disturb the other's figures.

Every result row is a dict with exactly the keys in `ROW_KEYS`; ``baseline_*`` and ``speedup``
are ``None`` where the baseline was skipped.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import statistics
import sys
import time
from dataclasses import dataclass

import numpy as np

from gdngen import worker_protocol
from gdngen.fileio import atomic_write_text
from gdngen.flops import chunkwise_flops
from gdngen.shape import FRAMEWORKS

DTYPES = ("float32", "bfloat16", "float16")
ROW_KEYS = (
    "framework", "backend", "device", "T", "B", "Hk", "Hv", "Dk", "Dv", "chunk_size", "dtype",
    "gate", "repeats",
    "chunk_ms", "baseline_ms", "speedup", "chunk_peak_bytes", "baseline_peak_bytes",
    "memory_measure", "flops", "chunk_gflops", "matmul_gflops", "matmul_shape", "matmul_ratio",
    "chunk_matmul_gflops", "chunk_matmul_shape", "chunk_matmul_ratio",
)
MEMORY_MEASURES = {
    "jax": "XLA memory_analysis(): argument + output + temp bytes of the compiled fwd+bwd",
    "mlx": "mx.get_peak_memory() over the timed fwd+bwd runs (inputs included)",
}
_ROWS_TAG = "GDNGEN_BENCH_ROWS "


@dataclass(frozen=True)
class BenchConfig:
    """Problem sizes and measurement settings of one benchmark run."""

    seq_lens: tuple[int, ...] = (1024, 2048, 4096)
    batch: int = 1
    hk: int = 4
    hv: int = 8
    dk: int = 128
    dv: int = 128
    chunk_size: int = 64
    backend: str = "auto"
    dtype: str = "float32"
    repeats: int = 5
    baseline_max_T: int = 2048
    matmul_n: int = 2048
    seed: int = 0
    gate: str = "scalar"

    def __post_init__(self):
        object.__setattr__(self, "seq_lens", tuple(int(t) for t in self.seq_lens))
        if not self.seq_lens or min(self.seq_lens) < 1:
            raise ValueError(f"seq_lens must be positive, got {self.seq_lens}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        for name in ("batch", "hk", "hv", "dk", "dv", "chunk_size", "repeats"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.hv % self.hk:
            raise ValueError(f"hv ({self.hv}) must be a multiple of hk ({self.hk})")
        from gdngen.registry import names

        known = sorted(names())
        if self.backend != "auto" and self.backend not in known:
            raise ValueError(f"backend must be 'auto' or one of {known}, got {self.backend!r}")
        if self.matmul_n < 0:
            raise ValueError(f"matmul_n must be >= 0 (0 skips it), got {self.matmul_n}")
        from gdngen.problem import GATE_KINDS

        if self.gate not in GATE_KINDS:
            raise ValueError(f"gate must be one of {GATE_KINDS}, got {self.gate!r}")

    def problem(self):
        """The `gdngen.problem.Problem` benchmarked: heads, head dims, dtype and gate kind."""
        from gdngen.problem import Problem

        return Problem(self.hk, self.hv, self.dk, self.dv, self.dtype, self.gate)


def available_frameworks() -> tuple[str, ...]:
    """Frameworks whose package is importable here (without importing it)."""
    return tuple(fw for fw in FRAMEWORKS if importlib.util.find_spec(fw) is not None)


def make_inputs(cfg: BenchConfig, T: int) -> dict[str, np.ndarray]:
    """Deterministic float32 inputs of length T (`gdngen.tools.timing.make_inputs`, seed
    ``cfg.seed + T``): q, k (unit-norm), v, g (log-decay, ``[B,T,Hv,Dk]`` for a vector gate),
    beta, initial_state, and the cotangents dy, dfinal_state."""
    from gdngen.tools.timing import make_inputs as problem_inputs

    return problem_inputs(cfg.problem(), cfg.batch, T, cfg.seed + T)


def _median_seconds(call, sync, repeats: int, before_timing=None) -> float:
    sync(call())  # warm-up (compiles on first use)
    if before_timing is not None:
        before_timing()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        sync(call())
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _progress(msg: str) -> None:
    print(f"[gdngen bench] {msg}", file=sys.stderr, flush=True)


# --- JAX -----------------------------------------------------------------------------------


def chunk_backend(framework: str, cfg: BenchConfig) -> str:
    """The backend the chunkwise rows of ``framework`` run: the explicit ``cfg.backend``, or
    for "auto" the backend an untuned call runs on the attached device
    (`gdngen.dispatch.default_choice`); ValueError for an explicit backend of another
    framework."""
    from gdngen import registry

    if cfg.backend != "auto":
        if cfg.backend not in registry.names(framework):
            raise ValueError(f"backend {cfg.backend!r} does not run on {framework}; expected one "
                             f"of {registry.names(framework)}")
        return cfg.backend
    from gdngen.devices import detect_framework
    from gdngen.dispatch import default_choice

    return default_choice(framework, cfg.problem(), detect_framework(framework).name)[0].backend


def frameworks_for(cfg: BenchConfig, frameworks) -> tuple[str, ...]:
    """The frameworks to measure: ``frameworks``, or only the one running ``cfg.backend`` when it
    is explicit (ValueError when that framework is not among them)."""
    if cfg.backend == "auto":
        return tuple(frameworks)
    from gdngen.registry import framework_of

    owner = framework_of(cfg.backend)
    if owner not in frameworks:
        raise ValueError(f"backend {cfg.backend} runs on {owner}, not on "
                         f"{', '.join(frameworks)}")
    return (owner,)


def chunk_variant(framework: str, cfg: BenchConfig):
    """The default variant of `chunk_backend` for the configured shape, with chunk size C."""
    from gdngen.registry import default_variant

    variant = default_variant(chunk_backend(framework, cfg), cfg.problem())
    return variant.replace(chunk_size=cfg.chunk_size)


def _jax_kernels():
    """(chunkwise, sequential baseline) JAX callables; both ``(q,k,v,g,beta,s0,*,scale,gate)``."""
    from gdngen.backends.portable.jax_chunkwise import sequential_gated_delta
    from gdngen.jax import gated_delta

    return gated_delta, sequential_gated_delta


def _jax_grad(fn, scale: float, **kwargs):
    import jax
    import jax.numpy as jnp

    def loss(q, k, v, g, beta, s0, dy, ds):
        y, s = fn(q, k, v, g, beta, s0, scale=scale, gate="log", **kwargs)
        return jnp.sum(y.astype(jnp.float32) * dy) + jnp.sum(s.astype(jnp.float32) * ds)

    return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4, 5)))


def _jax_time(fn, args, repeats: int) -> tuple[float, int]:
    import jax

    compiled = fn.lower(*args).compile()
    mem = compiled.memory_analysis()
    peak = None
    if mem is not None:
        peak = int(mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes)
    seconds = _median_seconds(lambda: compiled(*args), jax.block_until_ready, repeats)
    return seconds, peak


def _jax_matmul(cfg: BenchConfig) -> dict:
    import jax
    import jax.numpy as jnp

    return _matmul_rates(cfg, lambda x: jnp.asarray(x, jnp.float32), jax.jit(jnp.matmul),
                         jax.block_until_ready)


def _measure_jax(cfg: BenchConfig) -> list[dict]:
    import jax
    import jax.numpy as jnp

    chunk_fn, base_fn = _jax_kernels()
    scale = cfg.dk**-0.5
    variant = chunk_variant("jax", cfg)
    chunk_grad = _jax_grad(chunk_fn, scale, variant=variant)
    base_grad = _jax_grad(base_fn, scale)
    device = jax.devices()[0]
    kind = getattr(device, "device_kind", "") or device.platform
    device_name = device.platform if kind == device.platform else f"{device.platform} ({kind})"
    _progress(f"jax on {device_name}: float32 matmul reference")
    matmul = _jax_matmul(cfg)
    rows = []
    for T in cfg.seq_lens:
        x = make_inputs(cfg, T)
        cast = {n: jnp.asarray(x[n], cfg.dtype) for n in ("q", "k", "v", "g", "beta")}
        args = (cast["q"], cast["k"], cast["v"], cast["g"], cast["beta"],
                jnp.asarray(x["initial_state"]), jnp.asarray(x["dy"]),
                jnp.asarray(x["dfinal_state"]))
        _progress(f"jax T={T}: chunkwise ({variant})")
        chunk = _jax_time(chunk_grad, args, cfg.repeats)
        base = (None, None)
        if T <= cfg.baseline_max_T:
            _progress(f"jax T={T}: sequential baseline")
            base = _jax_time(base_grad, args, cfg.repeats)
        rows.append(_row("jax", variant.backend, device_name, cfg, T, chunk, base, matmul))
    return rows


# --- MLX -----------------------------------------------------------------------------------


def _mlx_kernels():
    """(chunkwise, sequential baseline) MLX callables; both ``(q,k,v,g,beta,s0,*,scale,gate)``."""
    import mlx.core as mx
    from mlx_lm.models.gated_delta import gated_delta_ops

    from gdngen.mlx import gated_delta

    def baseline(q, k, v, g, beta, initial_state, *, scale, gate):
        if gate != "log":
            raise ValueError("the MLX baseline is wired for gate='log' only")
        return gated_delta_ops(q * scale, k, v, mx.exp(g), beta, initial_state)

    return gated_delta, baseline


def _mlx_time(fn, args, repeats: int, scale: float, **kwargs) -> tuple[float, int]:
    import mlx.core as mx

    dy, ds = args[6], args[7]

    def loss(q, k, v, g, beta, s0):
        y, s = fn(q, k, v, g, beta, s0, scale=scale, gate="log", **kwargs)
        return mx.sum(y.astype(mx.float32) * dy) + mx.sum(s.astype(mx.float32) * ds)

    grad = mx.grad(loss, argnums=[0, 1, 2, 3, 4, 5])
    seconds = _median_seconds(lambda: grad(*args[:6]), mx.eval, repeats,
                              before_timing=mx.reset_peak_memory)
    return seconds, int(mx.get_peak_memory())


def _mlx_matmul(cfg: BenchConfig) -> dict:
    import mlx.core as mx

    return _matmul_rates(cfg, lambda x: mx.array(x.astype(np.float32)), mx.matmul, mx.eval)


def _matmul_rates(cfg: BenchConfig, array, matmul, sync) -> dict:
    """``{key: (GFLOP/s, label)}`` of ``matmul`` on float32 operands made by ``array`` from
    NumPy, for each shape of `_matmul_shapes` (median of at least 3 runs, ``sync`` after)."""
    rng = np.random.default_rng(cfg.seed)
    repeats = max(3, cfg.repeats)
    out = {}
    for key, (label, a_shape, b_shape, flops) in _matmul_shapes(cfg).items():
        a, b = array(rng.standard_normal(a_shape)), array(rng.standard_normal(b_shape))
        seconds = _median_seconds(lambda a=a, b=b: matmul(a, b), sync, repeats)
        out[key] = (flops / seconds / 1e9, label)
    return out


def _measure_mlx(cfg: BenchConfig) -> list[dict]:
    import mlx.core as mx

    chunk_fn, base_fn = _mlx_kernels()
    scale = cfg.dk**-0.5
    variant = chunk_variant("mlx", cfg)
    device_name = str(mx.default_device())
    _progress(f"mlx on {device_name}: float32 matmul reference")
    matmul = _mlx_matmul(cfg)
    dtype = getattr(mx, cfg.dtype)
    rows = []
    for T in cfg.seq_lens:
        x = make_inputs(cfg, T)
        args = tuple(mx.array(x[n]).astype(dtype) for n in ("q", "k", "v", "g", "beta"))
        args += tuple(mx.array(x[n]) for n in ("initial_state", "dy", "dfinal_state"))
        mx.eval(args)
        _progress(f"mlx T={T}: chunkwise ({variant})")
        chunk = _mlx_time(chunk_fn, args, cfg.repeats, scale, variant=variant)
        base = (None, None)
        if T <= cfg.baseline_max_T:
            _progress(f"mlx T={T}: sequential baseline")
            base = _mlx_time(base_fn, args, cfg.repeats, scale)
        rows.append(_row("mlx", variant.backend, device_name, cfg, T, chunk, base, matmul))
    return rows


# --- shared --------------------------------------------------------------------------------


def _matmul_shapes(cfg: BenchConfig) -> dict:
    """``{"square"|"chunk": (label, a_shape, b_shape, flops)}`` of the matmul references."""
    C, Dk, Dv = cfg.chunk_size, cfg.dk, cfg.dv
    nb = cfg.batch * cfg.hv * -(-max(cfg.seq_lens) // C)
    shapes = {"chunk": (f"{nb}x[{C}x{Dk}]@[{Dk}x{Dv}]", (nb, C, Dk), (nb, Dk, Dv),
                        2 * nb * C * Dk * Dv)}
    if cfg.matmul_n:
        n = cfg.matmul_n
        shapes["square"] = (f"{n}x{n}x{n}", (n, n), (n, n), 2 * n**3)
    return shapes


def _row(framework, backend, device, cfg: BenchConfig, T, chunk, base, matmul) -> dict:
    chunk_s, chunk_peak = chunk
    base_s, base_peak = base
    matmul_gflops, matmul_shape = matmul.get("square", (None, None))
    chunk_matmul_gflops, chunk_matmul_shape = matmul["chunk"]
    flops = chunkwise_flops(cfg.batch, T, cfg.hk, cfg.hv, cfg.dk, cfg.dv, cfg.chunk_size)
    chunk_gflops = flops / chunk_s / 1e9
    row = {
        "framework": framework,
        "backend": backend,
        "device": device,
        "T": T,
        "B": cfg.batch,
        "Hk": cfg.hk,
        "Hv": cfg.hv,
        "Dk": cfg.dk,
        "Dv": cfg.dv,
        "chunk_size": cfg.chunk_size,
        "dtype": cfg.dtype,
        "gate": cfg.gate,
        "repeats": cfg.repeats,
        "chunk_ms": chunk_s * 1e3,
        "baseline_ms": None if base_s is None else base_s * 1e3,
        "speedup": None if base_s is None else base_s / chunk_s,
        "chunk_peak_bytes": chunk_peak,
        "baseline_peak_bytes": base_peak,
        "memory_measure": MEMORY_MEASURES[framework],
        "flops": flops,
        "chunk_gflops": chunk_gflops,
        "matmul_gflops": matmul_gflops,
        "matmul_shape": matmul_shape,
        "matmul_ratio": chunk_gflops / matmul_gflops if matmul_gflops else None,
        "chunk_matmul_gflops": chunk_matmul_gflops,
        "chunk_matmul_shape": chunk_matmul_shape,
        "chunk_matmul_ratio": chunk_gflops / chunk_matmul_gflops,
    }
    assert tuple(row) == ROW_KEYS
    return row


def measure(framework: str, cfg: BenchConfig) -> list[dict]:
    """Measure one framework in this process; one row per ``cfg.seq_lens`` entry."""
    if framework == "jax":
        return _measure_jax(cfg)
    if framework == "mlx":
        return _measure_mlx(cfg)
    raise ValueError(f"framework must be one of {FRAMEWORKS}, got {framework!r}")


def _measure_in_subprocess(framework: str, cfg: BenchConfig) -> list[dict]:
    """`measure` in a fresh ``python -m gdngen.tools.bench --worker FRAMEWORK`` (`gdngen
    .worker_protocol`: the config goes to its stdin; its stderr, progress included, is ours)."""
    outcome = worker_protocol.call(
        "gdngen.tools.bench", dataclasses.asdict(cfg), args=("--worker", framework),
        tag=_ROWS_TAG, capture_stderr=False)
    if outcome.status != "ok":
        raise RuntimeError(
            f"bench worker for {framework} failed (exit {outcome.returncode}); its error is above"
        )
    return outcome.result


def run(cfg: BenchConfig, frameworks=FRAMEWORKS, *, isolate: bool = True) -> list[dict]:
    """Measure each framework (in a fresh subprocess when ``isolate``); rows in order."""
    rows = []
    for framework in frameworks:
        if isolate:
            rows.extend(_measure_in_subprocess(framework, cfg))
        else:
            rows.extend(measure(framework, cfg))
    return rows


def write_json(rows: list[dict], path) -> None:
    """Write ``rows`` as JSON to ``path`` atomically (temporary file + ``os.replace``)."""
    atomic_write_text(path, json.dumps(rows, indent=2) + "\n")


def _fmt(x, spec: str) -> str:
    return "—" if x is None else format(x, spec)


def format_table(rows: list[dict]):
    """A ``rich.table.Table`` of the rows; the caption names the matmul shapes and memory
    measures used."""
    from rich.table import Table

    title = "gated delta forward+backward"
    if rows:
        r = rows[0]
        title += (f" — B={r['B']} Hk={r['Hk']} Hv={r['Hv']} Dk={r['Dk']} Dv={r['Dv']}"
                  f" C={r['chunk_size']} {r['dtype']} {r['gate']} gate, median of "
                  f"{r['repeats']}")
    table = Table(title=title)
    for name in ("framework", "T", "chunk ms", "seq ms", "speedup", "chunk MiB", "seq MiB",
                 "GFLOP/s", "square mm", "of square", "chunk mm", "of chunk mm"):
        table.add_column(name, justify="left" if name == "framework" else "right")
    mib = 1 / 2**20
    notes = {}
    for r in rows:
        table.add_row(
            f"{r['framework']} ({r['backend']})",
            str(r["T"]),
            _fmt(r["chunk_ms"], ".1f"),
            _fmt(r["baseline_ms"], ".1f"),
            _fmt(r["speedup"], ".2f"),
            _fmt(None if r["chunk_peak_bytes"] is None else r["chunk_peak_bytes"] * mib, ".1f"),
            _fmt(None if r["baseline_peak_bytes"] is None else r["baseline_peak_bytes"] * mib,
                 ".1f"),
            _fmt(r["chunk_gflops"], ".1f"),
            _fmt(r["matmul_gflops"], ".1f"),
            _fmt(None if r["matmul_ratio"] is None else 100 * r["matmul_ratio"], ".1f") + "%",
            _fmt(r["chunk_matmul_gflops"], ".1f"),
            _fmt(100 * r["chunk_matmul_ratio"], ".1f") + "%",
        )
        notes[r["framework"]] = (
            f"{r['framework']} on {r['device']}: peak memory = {r['memory_measure']}; "
            f"square mm = float32 {r['matmul_shape']}, chunk mm = float32 "
            f"{r['chunk_matmul_shape']} (GFLOP/s)"
        )
    header = ("seq = sequential baseline (— = skipped above --baseline-max-T); "
              "GFLOP/s = gdngen.flops.chunkwise_flops / chunk time")
    table.caption = "\n".join([header, *notes.values()])
    table.caption_justify = "left"
    return table


def print_table(rows: list[dict]) -> None:
    """Print `format_table` to stdout; unsqueezed (160 columns) when stdout is not a terminal."""
    from rich.console import Console

    console = Console()
    if not console.is_terminal:
        console = Console(width=160)
    console.print(format_table(rows))


def _worker_main(argv=None) -> None:
    parser = argparse.ArgumentParser(description="gdngen bench worker (one framework)")
    parser.add_argument("--worker", required=True, choices=FRAMEWORKS)
    parser.add_argument("--config", default=None,
                        help="BenchConfig fields as JSON (default: read them from stdin)")
    ns = parser.parse_args(argv)
    fields = json.loads(ns.config) if ns.config is not None else worker_protocol.read_request()
    worker_protocol.reply(_ROWS_TAG, measure(ns.worker, BenchConfig(**fields)))


if __name__ == "__main__":
    _worker_main()
