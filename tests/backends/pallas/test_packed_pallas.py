"""Native packed kernels of the Pallas backends (pallas_tpu, pallas_gpu): packed battery cases
through each backend's packed build (`render_packed`: the walk takes the injected states and
returns the entering ones; `gdngen.algebra.packed`; per-channel gates: the packed build's chunk
walks between the shared jnp stages), run as the dense kernels are validated
off-device (TPU / Pallas interpret mode, buffers NaN-filled, TPU race detection on), their lowering
for the real compilers, and the dense renders left byte for byte as they were."""

from __future__ import annotations

import importlib

import pytest

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")

from gdngen import Problem, Variant, default_variant, registry, settings, validate
from gdngen.cases import Case, get_case

BACKENDS = ("pallas_tpu", "pallas_gpu")
QUANTITIES = {"y", "final_state", "dinitial_state", "dq", "dk", "dv", "dbeta", "dg",
              "dg_linear"}


def _module(backend):
    return importlib.import_module(registry.BACKENDS[backend])


def _check(backend, case, monkeypatch, **changes):
    """``case`` on ``backend``'s packed kernels (its default variant at the case's chunk, with
    ``changes``), outputs poisoned; asserts every quantity passes and the packed core ran."""
    monkeypatch.setenv(settings.ENV_POISON_OUTPUTS, "1")
    spec = registry.get(backend)
    assert spec.native_packed(False) and spec.native_packed(True)
    core = _module(backend).packed_core
    calls = core.cache_info().hits + core.cache_info().misses
    variant = None
    if changes:
        problem = Problem(case.Hk, case.Hv, case.Dk, case.Dv)
        variant = Variant(backend, dict(default_variant(backend, problem).as_dict(),
                                        chunk_size=case.chunk_size, **changes))
    result = validate.check_case(backend, case, variant=variant)
    assert result.passed, result.errors
    assert set(result.errors) >= QUANTITIES, result.errors
    assert core.cache_info().hits + core.cache_info().misses > calls  # the native walk ran
    return result


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def testpacked_core_matches_the_portable_walk(backend):
    """The packed core (`packed_core`: the chunk walk from a zero state, a non-zero state
    injected at every chunk end, the entering states out) and its VJP (the cotangents of the
    entering states in at every chunk, the injections' out) against the portable one
    (`gdngen.backends.portable.jax_chunkwise.packed_core`), on random inputs."""
    import numpy as np

    from gdngen.backends.portable import jax_chunkwise

    module = _module(backend)
    M, Hk, r, C, Dk, Dv = 2, 1, 2, 32, 32, 32
    problem = Problem(Hk, Hk * r, Dk, Dv)
    kernels = module.load_packed_kernels(_variant(backend, problem, {"chunk_size": C}), problem)
    rng = np.random.default_rng(0)

    def draw(*shape, scale=1.0):
        return jnp.asarray(scale * rng.standard_normal(shape), jnp.float32)

    k = draw(M, 1, Hk, C, Dk)
    args = (draw(M, 1, Hk, C, Dk, scale=0.2), k / jnp.linalg.norm(k, axis=-1, keepdims=True),
            draw(M, 1, Hk, r, C, Dv), -jnp.abs(draw(M, 1, Hk, r, C, scale=0.1)),
            jax.nn.sigmoid(draw(M, 1, Hk, r, C)), draw(M, 1, Hk, r, Dv, Dk))
    cotangents = (draw(M, 1, Hk, r, C, Dv), draw(M, 1, Hk, r, Dv, Dk))
    results = []
    for core in (module.packed_core((kernels.sha256, kernels.interpret), "log"),
                 lambda *a: jax_chunkwise.packed_core(*a, "log", 8, True)):
        outputs, vjp = jax.vjp(core, *args)
        results.append((*outputs, *vjp(cotangents)))
    names = ("Y", "S_in", "dq", "dk", "dv", "dgates", "dbeta", "dinject")
    for name, got, want in zip(names, *results):
        err = float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want))
        assert err < 5e-6, (name, err)


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_packed_long_masked_passes(backend, monkeypatch):
    """packed_long_masked: an initial state carried through two chunk ends, the padding mask."""
    _check(backend, get_case("packed_long_masked"), monkeypatch)


#: Dv = 256 split into two 128-wide Dv tiles (pallas_tpu) / 16-wide Dk and 32-wide Dv register
#: tiles (pallas_gpu): the packed additions on every state tile
TILED = Case("packed_tiled", "packed row, an initial state over a chunk end, several state tiles",
             B=1, T=150, Hk=1, Hv=2, Dk=32, Dv=256, has_initial_state=True,
             cu_seqlens=(0, 30, 64, 65, 150))


@pytest.mark.slow
@pytest.mark.parametrize("backend,changes", [
    ("pallas_tpu", {"save_states": False}),
    ("pallas_tpu", {"dv_tile": 128}),
    ("pallas_tpu", {"dv_tile": 128, "save_states": False, "head_tile": 1}),
    ("pallas_gpu", {"save_states": False}),
    ("pallas_gpu", {"bk": 16, "bv": 32}),
])
def test_packed_variants_pass(backend, changes, monkeypatch):
    """Recomputed entering states (the state walk with the injection), several state tiles."""
    case = get_case("packed_boundaries") if changes == {"save_states": False} else TILED
    _check(backend, case, monkeypatch, **changes)


# ----------------------------------------------------------------------------- rendering

#: sha256 of dense renders (before the packed build existed; re-recorded when issue 45
#: corrected the templates' comments): tuned entries are keyed on them,
#: so the ``packed`` flag, off, must leave every dense source byte for byte as it was
DENSE_SHA256 = {
    ("pallas_tpu", (2, 6, 32, 64), ()):
        "1512a483e6b094d36202d2f1e5c3b31f2363fdcb69f4c5434a3011c0ccab2eea",
    ("pallas_tpu", (2, 6, 32, 64), (("save_states", False),)):
        "7474f9fff96f80dee9a83b9582db4d4d05970480ef7faa41a3d623c45ec114f5",
    ("pallas_tpu", (1, 2, 64, 256), ()):
        "195fdcc841e07efa302077528af12d1a15d93ff0df8b74f28e7755c528150daf",
    ("pallas_tpu", (1, 2, 64, 256), (("dv_tile", 128),)):
        "cd3cd47a4f17bf20e419232daf3013342e5cbe49127172387476d753ce9eb45d",
    ("pallas_tpu", (1, 2, 64, 256), (("dv_tile", 128), ("save_states", False))):
        "50ed0ccc72257111a4a3ed828aba42b38bca7b1807c0f1f2e91359b45f0f9b7a",
    ("pallas_tpu", (2, 4, 128, 128), ()):
        "673c6a47fe773be269a5cb575e66d1e9aef1bf086c8874fd4862de297ceadcab",
    ("pallas_tpu", (2, 4, 128, 128), (("head_tile", 1), ("precision", "bf16"))):
        "e9a252e501968e1b0351560ee2860d321b9af64c0e8a4b5414c50b21f65f6cac",
    ("pallas_gpu", (2, 6, 32, 64), ()):
        "c2feec68629ad05cd16871c8983019ffdc78c5b15ee06c91318da1f3e5f989b6",
    ("pallas_gpu", (2, 6, 32, 64), (("save_states", False),)):
        "1985b264fe45ecb025b1da7e65bb31ece308de4977a1f0ede3a5899f073af9ac",
    ("pallas_gpu", (1, 2, 64, 256), (("bk", 32), ("bv", 32))):
        "7192f19ea779be70e26cad390b11efed15a4856c6e17e13b69a2cf5c87127e3a",
    ("pallas_gpu", (2, 4, 128, 128), ()):
        "051115ef169255de6170a71187a511ccec7296df012cf2b40001c87636e21ad0",
    ("pallas_gpu", (2, 4, 128, 128), (("chunk_size", 32), ("precision", "tf32"))):
        "4a2f7df2134e6abe7935a87d28e36f8e1f806a6833dc3f144ae679d5d0a149a9",
}


def _variant(backend, problem, changes=()):
    return Variant(backend, dict(default_variant(backend, problem).as_dict(), **dict(changes)))


def test_dense_renders_unchanged_and_packed_build_differs():
    """Every dense render keeps its sha256; each packed build is its own source (its own
    cache entry) and deterministic, for both gate kinds."""
    for (backend, dims, changes), sha in DENSE_SHA256.items():
        problem = Problem(*dims)
        variant = _variant(backend, problem, changes)
        assert registry.get(backend).render(variant, problem).sha256 == sha, (backend, dims,
                                                                             changes)
        packed_build = _module(backend).render_packed(variant, problem)
        assert packed_build.sha256 != sha
        assert _module(backend).render_packed(variant, problem).sha256 == packed_build.sha256
        assert set(packed_build.sources) == {"packed_forward.py", "packed_backward.py"}
    for backend in BACKENDS:
        vector = Problem(1, 2, 32, 32, gate="vector")
        variant = _variant(backend, vector)
        dense = registry.get(backend).render(variant, vector)
        packed_build = _module(backend).render_packed(variant, vector)
        assert packed_build.sha256 != dense.sha256
        assert "inj_ref" in packed_build.sources["packed_forward.py"]
        assert "inj_ref" not in dense.sources["forward.py"]
        assert "dsin" in packed_build.sources["packed_backward.py"]


#: a small per-channel packed row: a sequence inside chunk 0, an empty one, one across the
#: chunk end (its initial state injected there), exact per-channel zeros and ones
PACKED_VECTOR = Case("packed_vector_small", "per-channel packed row, three sequences", B=1,
                     T=70, Hk=1, Hv=2, Dk=16, Dv=16, vector_gate=True,
                     gates="channel_zero_and_one", has_initial_state=True,
                     cu_seqlens=(0, 7, 7, 45, 70), chunk_size=32)


@pytest.mark.parametrize("backend", BACKENDS)
def test_per_channel_packed_rows_run_the_packed_walks(backend, monkeypatch):
    """A per-channel packed row runs the packed build's kernels (the intra-chunk kernel and
    its VJP's, the chunk walks taking ``inject`` / ``dS_in``), not the portable path, and
    matches float64 (log gates here; both conventions and the packed_vector case:
    test_packed.py's slow cases)."""
    from gdngen.backends import fallback

    monkeypatch.setenv(settings.ENV_POISON_OUTPUTS, "1")
    spec = registry.get(backend)
    native, portable = [], []
    monkeypatch.setattr(spec, "packed", lambda *a, **k: native.append(1) or
                        type(spec).packed(spec, *a, **k))
    monkeypatch.setattr(fallback, "packed", lambda *a, **k: portable.append(1))
    cores = []
    for hook in ("channel_core", "channel_walk_core"):
        original = getattr(type(spec), hook)
        monkeypatch.setattr(type(spec), hook, staticmethod(
            lambda *key, hook=hook, original=original: cores.append(hook) or original(*key)))
    result = validate.check_case(backend, PACKED_VECTOR, gates=("log",))
    assert result.passed, result.errors
    assert set(result.errors) >= QUANTITIES - {"dg_linear"}, result.errors
    assert native and not portable
    assert {"channel_core", "channel_walk_core"} <= set(cores)  # the kernels' intra stages


@pytest.mark.parametrize("backend", BACKENDS)
def test_per_channel_packed_walks_lower_for_the_device(backend):
    """The per-channel packed build's walks (``inject`` in, ``dsin`` in, ``dinject`` out)
    lower through Mosaic (TPU) / the Triton lowering (CUDA), no device needed."""
    module = _module(backend)
    problem = Problem(1, 2, 32, 32, gate="vector")
    kernels = module.load_packed_kernels(_variant(backend, problem), problem)
    spec, f32 = jax.ShapeDtypeStruct, jnp.float32
    B, N, Hv, C = 1, 2, 2, kernels.params["chunk_size"]
    Hk = problem.Hk
    if backend == "pallas_tpu":
        Dk, Dv = problem.Dk, problem.Dv
        values, keys = spec((N, B, Hv, C, Dv), f32), spec((N, B, Hv, C, Dk), f32)
        pm, dcc = spec((N, B, Hv, C, C), f32), spec((N, B, Hv, 1, Dk), f32)
        key_heads = spec((N, B, Hk, C, Dk), f32)
        platform, marker = "tpu", "tpu_custom_call"
    else:
        Dk, Dv, T = kernels.params["dk"], kernels.params["dv"], N * C
        values, keys = spec((B, Hv, T, Dv), f32), spec((B, Hv, T, Dk), f32)
        pm, dcc = spec((B, Hv, T, C), f32), spec((B, Hv, N, Dk), f32)
        key_heads = spec((B, T, Hk, Dk), f32)
        platform, marker = "cuda", "triton"
    state = spec((B, Hv, Dv, Dk), f32)
    states = spec((N, B, Hv, Dv, Dk) if backend == "pallas_tpu" else (B, Hv, N, Dv, Dk), f32)
    calls = [(kernels.forward.forward, (values, keys, keys, keys, pm, dcc, state, states), {}),
             (kernels.backward.backward, (pm, key_heads, key_heads, keys, keys, values, states,
                                          values, state, states), {"scale": 0.5})]
    for fn, args, static in calls:
        static = {"interpret": False, **static}
        text = (jax.jit(fn, static_argnames=tuple(static)).trace(*args, **static)
                .lower(lowering_platforms=(platform,)).as_text())
        assert marker in text


@pytest.mark.parametrize("backend", BACKENDS)
def test_packed_kernels_lower_for_the_device(backend):
    """The packed builds lower through Mosaic (TPU) / the Triton lowering (CUDA) as the dense
    kernels do (no device needed): every kernel, saving and recomputing variants."""
    module = _module(backend)
    case = get_case("packed_boundaries")
    problem = Problem(case.Hk, case.Hv, case.Dk, case.Dv)
    spec, f32 = jax.ShapeDtypeStruct, jnp.float32
    B, N, Hk, Hv = 1, 2, problem.Hk, problem.Hv
    for save in (True, False):
        kernels = module.load_packed_kernels(_variant(backend, problem, {"save_states": save}),
                                             problem)
        C = kernels.params["chunk_size"]
        texts = []
        if backend == "pallas_tpu":
            Dk, Dv = problem.Dk, problem.Dv
            key, values = spec((B, Hk, N, C, Dk), f32), spec((B, Hv, N, C, Dv), f32)
            g_col, g_row = spec((B, Hv, N, C, 1), f32), spec((B, Hv, N, 1, C), f32)
            state, states = spec((B, Hv, Dv, Dk), f32), spec((B, Hv, N, Dv, Dk), f32)
            tinv = (spec((B, Hv, N, C, C), f32),) if save else ()
            platform, marker = "tpu", "tpu_custom_call"
            calls = [(kernels.forward.forward, (key, key, values, g_col, g_row, g_col, state,
                                                states), {"scale": 1.0}),
                     (kernels.backward.backward, (key, key, values, g_col, g_row, g_col, states,
                                                  *tinv, values, state, states),
                      {"scale": 1.0})]
            if not save:
                calls.append((kernels.forward.chunk_states,
                              (key, values, g_col, g_row, g_col, state, states), {}))
        else:
            Dk, Dv, T = kernels.params["dk"], kernels.params["dv"], N * C
            q, v = spec((B, T, Hk, Dk), f32), spec((B, T, Hv, Dv), f32)
            gates, state = spec((B, Hv, T), f32), spec((B, Hv, Dv, Dk), f32)
            states = spec((B, Hv, N, Dv, Dk), f32)
            residuals = (spec((B, Hv, T, Dv), f32), spec((B, Hv, T, Dk), f32),
                         spec((B, Hv, T, C), f32), spec((B, Hv, T, C), f32), states)
            platform, marker = "cuda", "triton"
            calls = [(kernels.forward.forward, (q, q, v, gates, gates, state, states),
                      {"scale": 1.0}),
                     (kernels.forward.residuals, (q, q, v, gates, gates, state, states),
                      {"scale": 1.0}),
                     (kernels.backward.backward, (q, q, v, gates, gates, *residuals, v, state,
                                                  states), {"scale": 1.0})]
        for fn, args, static in calls:
            static = dict(static, interpret=False)
            texts.append(jax.jit(fn, static_argnames=tuple(static)).trace(*args, **static)
                         .lower(lowering_platforms=(platform,)).as_text())
        assert all(marker in text for text in texts)


def test_packed_entry_checks_its_call():
    """The packed entries check the offsets."""
    shape_args = {"q": jnp.zeros((1, 8, 1, 16)), "k": jnp.zeros((1, 8, 1, 16)),
                  "v": jnp.zeros((1, 8, 2, 16)), "beta": jnp.ones((1, 8, 2))}
    short = jnp.asarray([0, 3, 7], jnp.int32)
    for backend in BACKENDS:
        entry = registry.get(backend).packed_entry
        variant = default_variant(backend, Problem(1, 2, 16, 16))
        with pytest.raises(ValueError, match="int32 array"):
            entry(**shape_args, g=jnp.zeros((1, 8, 2)), variant=variant, cu_seqlens=[0, 3, 8])
        for g in (jnp.zeros((1, 8, 2)), jnp.zeros((1, 8, 2, 16))):  # both gate kinds
            with pytest.raises(ValueError, match="must end at T=8"):
                entry(**shape_args, g=g, variant=variant, cu_seqlens=short)
