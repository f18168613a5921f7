"""The mixer call kind (`gdngen.mixer`): ``gated_delta_mixer`` on every registered backend
against the float64 composition (`gdngen.algebra.mixer.reference_vjp`: a per-row convolution
loop, the float64 recurrence and its BPTT, the chain rule of every elementwise stage, checked
here against central differences), every gradient, outputs poisoned; packed rows; decode
continuing a prefill through the conv and recurrent states; mlx-lm's own layer; bad input."""

from __future__ import annotations

import importlib.util
import re
import zlib

import numpy as np
import pytest

from gdngen import prepare, registry, settings
from gdngen.algebra import mixer as stages
from gdngen.problem import Problem
from gdngen.validate import relative_error

#: B, T, Hk, Hv, Dk, Dv, K: GVA 2x, Dk != Dv (metal: multiples of 32), T not a multiple of
#: the chunk
B, T, Hk, Hv, Dk, Dv, K = 2, 37, 1, 2, 32, 64, 4
C = 2 * Hk * Dk + Hv * Dv
DIMS = {"Hk": Hk, "Hv": Hv, "Dk": Dk, "Dv": Dv}
RTOL = 2e-5
#: Qwen3-Next's form and Kimi's (per-channel gate, [Hv, 1] / [Hv, Dk] parameters, the
#: sigmoid-bounded gate of Kimi K3 / Bailing V3, the sigmoid output gate)
FORMS = {"scalar": {}, "vector": {"gate": "sigmoid_bound", "lower_bound": -5.0,
                                  "norm_gate": "sigmoid"}}
#: (backend, form) pairs behind the slow marker: JAX per-channel chunk VJPs compile for minutes
#: here; the per-channel mixer keeps its make-test case on mlx and metal (the same mixer code,
#: the recurrence's per-channel path checked per backend in test_recurrent / test_conformance)
SLOW = {("xla", "vector"), ("ffi_cpu", "vector"), ("pallas_tpu", "vector"),
        ("pallas_gpu", "vector")}
ARGS = ("mixed_qkv", "conv_weight", "a", "b", "z", "A_log", "dt_bias", "norm_weight",
        "conv_state", "initial_state")


@pytest.fixture(autouse=True)
def _poisoned_outputs(monkeypatch):
    monkeypatch.setenv(settings.ENV_POISON_OUTPUTS, "1")


def inputs(form: str, seed: int, *, rows=B, steps=T, mask=True):
    """Fresh float64 arguments of one mixer call (gates from mild to strong decay, a padding
    mask on the last row)."""
    rng = np.random.default_rng(seed)
    vector = form == "vector"
    x = {"mixed_qkv": rng.standard_normal((rows, steps, C)),
         "conv_weight": 0.5 * rng.standard_normal((C, K)),
         "a": rng.standard_normal((rows, steps, Hv) + ((Dk,) if vector else ())),
         "b": rng.standard_normal((rows, steps, Hv)),
         "z": rng.standard_normal((rows, steps, Hv, Dv)),
         "A_log": 0.5 * rng.standard_normal((Hv, 1) if vector else (Hv,)),
         "dt_bias": 0.5 * rng.standard_normal((Hv, Dk) if vector else (Hv,)),
         "norm_weight": 1.0 + 0.1 * rng.standard_normal(Dv),
         "conv_state": rng.standard_normal((rows, C, K - 1)),
         "initial_state": 0.1 * rng.standard_normal((rows, Hv, Dv, Dk))}
    options = dict(FORMS[form])
    if mask:
        m = np.ones((rows, steps), bool)
        m[-1, : steps // 5] = False  # left padding, as mlx-lm's batched prompts
        options["mask"] = m
    return x, options


def cotangents(seed, rows=B, steps=T):
    rng = np.random.default_rng(seed + 1000)
    return {"dout": rng.standard_normal((rows, steps, Hv, Dv)),
            "dfinal_state": rng.standard_normal((rows, Hv, Dv, Dk)),
            "dconv_state": rng.standard_normal((rows, C, K - 1))}


class Framework:
    """One framework's mixer, arrays and gradients."""

    def __init__(self, name):
        if importlib.util.find_spec(name) is None:
            pytest.skip(f"{name} is not installed")
        self.name = name
        if name == "jax":
            import jax
            import jax.numpy as jnp

            from gdngen.jax import gated_delta, gated_delta_mixer

            self.jax, self.m = jax, jnp
        else:
            import mlx.core as mx

            from gdngen.mlx import gated_delta, gated_delta_mixer

            self.m = mx
        self.mixer, self.gated_delta = gated_delta_mixer, gated_delta

    def grads(self, f, args):
        """``[*f(*args), *gradients]`` of ``sum(o * c)`` over f's outputs o, c fixed random
        cotangents, as float64 NumPy arrays."""
        rng = np.random.default_rng(5)
        outputs = f(*args)
        cots = [self.array(rng.standard_normal(tuple(o.shape))) for o in outputs]

        def loss(*args):
            return sum((o * c).sum() for o, c in zip(f(*args), cots))

        argnums = list(range(len(args)))
        grads = self.jax.grad(loss, argnums=tuple(argnums))(*args) if self.name == "jax" \
            else self.m.grad(loss, argnums=argnums)(*args)
        return [np.asarray(a, np.float64) for a in (*outputs, *grads)]

    def array(self, x):
        if x.dtype.kind == "f":
            x = np.asarray(x, np.float32)
        return self.m.array(x) if self.name == "mlx" else self.m.asarray(x)

    def values_and_grads(self, x, options, cots, **extra):
        names = [n for n in ARGS if x.get(n) is not None]
        args = [self.array(x[n]) for n in names]
        opts = {n: self.array(v) if isinstance(v, np.ndarray) else v for n, v in options.items()}
        cot = [self.array(cots[n]) for n in ("dout", "dfinal_state", "dconv_state")]

        def outputs(*args):
            return self.mixer(**dict(zip(names, args)), **DIMS, **opts, **extra)

        def loss(*args):
            return sum((o * c).sum() for o, c in zip(outputs(*args), cot))

        values = outputs(*args)
        if self.name == "jax":
            grads = self.jax.grad(loss, argnums=tuple(range(len(args))))(*args)
        else:
            grads = self.m.grad(loss, argnums=list(range(len(args))))(*args)
        read = lambda a: np.asarray(a.astype(self.m.float32), np.float64)
        out = dict(zip(("out", "final_state", "conv_state"), map(read, values)))
        out.update({f"d{n}": read(g) for n, g in zip(names, grads)})
        return out


def variant_here(backend: str, form: str = "scalar"):
    """``(spec, default variant)`` of ``backend`` for the module's heads and ``form``'s gate;
    skips where the backend cannot run here."""
    spec = registry.get(backend)
    problem = Problem(Hk, Hv, Dk, Dv, gate=form)
    ok, why = spec.capability(problem)
    if not ok:
        pytest.skip(f"{backend} cannot run here: {why}")
    return spec, registry.default_variant(backend, problem)


def check_against_reference(fw, x, options, cots, **extra):
    ref = stages.reference_vjp(**x, **DIMS, **options, **cots,
                               cu_seqlens=extra.get("cu_seqlens"))
    got = fw.values_and_grads(x, options, cots, **extra)
    errors = {n: relative_error(got[n], ref[n]) for n in got}
    assert len(errors) == 3 + sum(x[n] is not None for n in ARGS)
    worst = max(errors.items(), key=lambda item: item[1])
    assert worst[1] <= RTOL, (worst, errors)
    return errors


def test_the_float64_composition_agrees_with_central_differences():
    x, options = inputs("vector", seed=3, rows=2, steps=11)
    cots = cotangents(3, rows=2, steps=11)
    ref = stages.reference_vjp(**x, **DIMS, **options, **cots)
    rng = np.random.default_rng(4)

    def loss(arrays):
        r = stages.reference_vjp(**arrays, **DIMS, **options)
        return sum((r[o] * cots[c]).sum() for o, c in (("out", "dout"), (
            "final_state", "dfinal_state"), ("conv_state", "dconv_state")))

    h = 1e-6
    for name in ARGS:
        direction = rng.standard_normal(x[name].shape)
        plus, minus = dict(x), dict(x)
        plus[name], minus[name] = x[name] + h * direction, x[name] - h * direction
        numeric = (loss(plus) - loss(minus)) / (2 * h)
        analytic = (ref[f"d{name}"] * direction).sum()
        assert abs(numeric - analytic) <= 1e-6 * max(1.0, abs(analytic)), name


@pytest.mark.parametrize("backend, form", [
    pytest.param(b, f, marks=[pytest.mark.slow] if (b, f) in SLOW else [])
    for b in registry.names() for f in sorted(FORMS)])
def test_mixer_matches_the_float64_composition(backend, form):
    fw = Framework(registry.get(backend).framework)
    _, variant = variant_here(backend, form)
    x, options = inputs(form, seed=zlib.crc32(f"{backend}-{form}".encode()) % 1000)
    errors = check_against_reference(fw, x, options, cotangents(7), variant=variant)
    print(backend, form, ", ".join(f"{n} {e:.1e}" for n, e in errors.items()))


def test_ffi_cpu_chunk_core_convolves_and_matches_the_float64_composition():
    """A row past ffi_cpu's recurrent switch (T = 150 >= 128): the chunk kernels run the
    forward with the conv inside the chunk core (raw q, k, v in, `gdngen.backends.generated.
    custom_vjp_core`), a padding mask on the last row, every gradient against float64."""
    spec, variant = variant_here("ffi_cpu")
    assert spec.parse(variant).recurrent_below <= 150
    x, options = inputs("scalar", seed=29, steps=150)
    errors = check_against_reference(Framework("jax"), x, options, cotangents(29, steps=150),
                                     variant=variant)
    print("ffi_cpu T=150", ", ".join(f"{n} {e:.1e}" for n, e in errors.items()))


@pytest.mark.parametrize("backend, form", [
    pytest.param(b, f, marks=[pytest.mark.slow] if f == "vector" else [])
    for b in ("pallas_tpu", "pallas_gpu") for f in sorted(FORMS)])
def test_pallas_chunk_cores_convolve_and_match_the_float64_composition(backend, form,
                                                                       monkeypatch):
    """A row past the Pallas backends' recurrent switch (T = 150): the chunk core takes the
    raw q, k, v slices and convolves them itself over the call's layout
    (`gdngen.backends.generated.custom_vjp_core` with ``conv`` and ``chunk_size``; scalar
    gates `chunk_core`, per-channel `channel_core`), a padding mask on the last row; every
    gradient against float64 (interpret mode, outputs poisoned). pallas_tpu's scalar core
    convolves in its forward kernel's loads (``forward_convolves``: no conv before its
    kernels; the backward recomputes it), the others before their kernels. What it keeps:
    test_conv_and_norm_keep_only_their_raw_inputs_for_the_backward."""
    from gdngen.backends import generated

    spec, variant = variant_here(backend, form)
    assert spec.parse(variant).recurrent_below <= 150
    before = []  # the core forward's convs before its kernels
    monkeypatch.setattr(generated, "conv_inputs", lambda *a, conv_inputs=generated.conv_inputs:
                        before.append(1) or conv_inputs(*a))
    x, options = inputs(form, seed=31, steps=150)
    errors = check_against_reference(Framework("jax"), x, options, cotangents(31, steps=150),
                                     variant=variant)
    assert (before == []) is ((backend, form) == ("pallas_tpu", "scalar")), before
    print(backend, form, "T=150", ", ".join(f"{n} {e:.1e}" for n, e in errors.items()))


@pytest.mark.parametrize("form", sorted(FORMS))
def test_metal_recurrent_kernel_convolves_and_matches_the_float64_composition(form,
                                                                             monkeypatch):
    """A short call (T = 9, under the variant's ``recurrent_below``) on metal: the recurrent
    kernel's conv build takes the raw slices of mixed_qkv with the conv weight and state and
    convolves in its loads, so the forward-only call runs no conv stage (`gdngen.algebra.
    mixer.conv`) and no chunk kernel; values and every gradient (the chunk path's VJP, the
    conv's own) against float64, outputs poisoned, with and without an incoming conv state."""
    from gdngen.backends.metal import calls, launch

    _, variant = variant_here("metal", form)
    variant = variant.replace(recurrent_below=16)
    fw = Framework("mlx")
    convs, kernel_convs = [], []
    conv, forward = stages.conv, calls.recurrent_forward
    monkeypatch.setattr(stages, "conv", lambda *a, **kw: convs.append(1) or conv(*a, **kw))
    monkeypatch.setattr(calls, "recurrent_forward", lambda *a, **kw: kernel_convs.append(
        kw.get("conv") is not None) or forward(*a, **kw))
    for with_state in (True, False):
        x, options = inputs(form, seed=53 + with_state, steps=9)
        if not with_state:
            x["conv_state"] = None
        launcher = launch.default_launcher()
        launcher.threadgroup_bytes.clear()
        convs.clear()
        kernel_convs.clear()
        args = {n: fw.array(v) for n, v in x.items() if v is not None}
        opts = {n: fw.array(v) if isinstance(v, np.ndarray) else v for n, v in options.items()}
        out = fw.mixer(**args, **DIMS, **opts, variant=variant)
        fw.m.eval(*out)
        assert kernel_convs == [True] and convs == [], (kernel_convs, convs)
        assert set(launcher.threadgroup_bytes) == {"recurrent"}, launcher.threadgroup_bytes
        errors = check_against_reference(fw, x, options, cotangents(53, steps=9),
                                         variant=variant)
        print("metal recurrent", form, with_state,
              ", ".join(f"{n} {e:.1e}" for n, e in errors.items()))


@pytest.mark.parametrize("framework", ["jax", "mlx"])
def test_gated_delta_conv_weight_is_the_conv_then_the_call(framework):
    """``gated_delta(q, k, v, ..., conv_weight=, conv_state=)`` on raw q, k, v equals the call
    on ``silu(causal_conv)`` of them (a masked step's input a zero), values and every
    gradient, dense rows and a packed row (whose windows restart at each sequence)."""
    fw = Framework(framework)
    m, gated_delta = fw.m, fw.gated_delta
    xp = prepare.namespace(framework)
    rng = np.random.default_rng(41)
    steps = 150

    def arr(*shape, scale=1.0):
        return m.array(np.asarray(scale * rng.standard_normal(shape), np.float32)) \
            if framework == "mlx" else m.asarray(scale * rng.standard_normal(shape), m.float32)

    for rows, cu in ((B, None), (1, [0, 40, 41, 150])):
        n = rows if cu is None else len(cu) - 1
        q, k, v = arr(rows, steps, Hk, Dk), arr(rows, steps, Hk, Dk), arr(rows, steps, Hv, Dv)
        w, state = arr(C, K, scale=0.5), arr(n, C, K - 1)
        g, beta, S0 = arr(rows, steps, Hv), arr(rows, steps, Hv), arr(n, Hv, Dv, Dk, scale=0.1)
        A_log, dt_bias = arr(Hv, scale=0.5), arr(Hv, scale=0.5)
        mask = np.ones((rows, steps), bool)
        mask[-1, 100:] = False
        mask = fw.array(mask) if framework == "mlx" else m.asarray(mask)
        offsets = None if cu is None else (m.array(np.asarray(cu, np.int32))
                                           if framework == "mlx" else m.asarray(cu, m.int32))
        opts = {"gate": "softplus", "qk_norm": True, "beta_activation": "sigmoid",
                "scale": Dk ** -0.5, "mask": mask, "cu_seqlens": offsets}

        def convolved(q, k, v, w, state, *rest, mask=mask, offsets=offsets, opts=opts):
            x = m.concatenate([r.reshape((*q.shape[:2], -1)) for r in (q, k, v)], axis=-1)
            x = m.where(mask[..., None], x, 0)
            h = stages.conv(xp, x, w, state, offsets)[0]
            kd = Hk * Dk
            y, s = gated_delta(h[..., :kd].reshape(q.shape), h[..., kd:2 * kd].reshape(k.shape),
                               h[..., 2 * kd:].reshape(v.shape), *rest[:3], A_log=rest[3],
                               dt_bias=rest[4], **opts)
            return y, s

        def fused(q, k, v, w, state, *rest, opts=opts):
            return gated_delta(q, k, v, *rest[:3], A_log=rest[3], dt_bias=rest[4],
                               conv_weight=w, conv_state=state, **opts)

        args = (q, k, v, w, state, g, beta, S0, A_log, dt_bias)
        want, got = fw.grads(convolved, args), fw.grads(fused, args)
        for name, a, b in zip(("y", "S", "q", "k", "v", "w", "state", "g", "beta", "S0",
                               "A_log", "dt_bias"), got, want):
            assert relative_error(np.asarray(a), np.asarray(b)) <= 2e-6, (name, rows)


def counted_convs(monkeypatch) -> list:
    """A list that gets an entry each time `gdngen.prepare.convolved` runs (a conv stage
    before the kernels, not in their loads)."""
    convolved, real = [], prepare.convolved
    monkeypatch.setattr(prepare, "convolved", lambda *a: (convolved.append(1), real(*a))[1])
    return convolved


def whole_head_variant(spec, backend: str, variant, form: str):
    """``variant`` with each Pallas program holding a head's whole Dv (pallas_tpu ``dv_tile``,
    pallas_gpu ``bv``): the norm builds' condition."""
    variant = variant.replace(**{"dv_tile" if backend == "pallas_tpu" else "bv": Dv})
    assert spec.holds_whole_head(variant, Problem(Hk, Hv, Dk, Dv, gate=form))
    return variant


def spied_mixer(monkeypatch, framework, form, seed, variant, owner, name, build_of,
                steps=T):
    """The mixer's undifferentiated call on fresh inputs of ``seed`` with ``owner.name`` spied
    (``build_of(args, kwargs)`` of each of its calls recorded) and the norm stage's runs
    counted: ``(fw, x, options, call, builds, norms)``, ``call()`` running it."""
    builds, norms = [], []
    spied, gated_norm = getattr(owner, name), stages.gated_norm

    def spy(*a, **kw):
        builds.append(build_of(a, kw))
        return spied(*a, **kw)

    monkeypatch.setattr(owner, name, spy)
    monkeypatch.setattr(stages, "gated_norm", lambda *a, **kw: norms.append(1) or gated_norm(
        *a, **kw))
    fw = Framework(framework)
    x, options = inputs(form, seed=seed, steps=steps)
    args = {n: fw.array(v) for n, v in x.items() if v is not None}
    opts = {n: fw.array(v) if isinstance(v, np.ndarray) else v for n, v in options.items()}

    def call():
        out = fw.mixer(**args, **DIMS, **opts, variant=variant)
        if framework == "jax":
            # wait for the kernels before anything else is dispatched: an interpret-mode
            # kernel still running reaches back into Python (its callbacks), and an op
            # dispatched meanwhile on the CPU client can wait for it holding the GIL (a hang)
            import jax

            out = jax.block_until_ready(out)
        return out

    return fw, x, options, call, builds, norms


@pytest.mark.parametrize("backend, form", [
    pytest.param(b, f, marks=[pytest.mark.slow] if f == "vector" else [])
    for b in ("ffi_cpu", "pallas_tpu", "pallas_gpu") for f in sorted(FORMS)])
def test_recurrent_kernel_normalises_in_its_stores(backend, form, monkeypatch):
    """A short mixer call (T = 17, under ``recurrent_below``) on ffi_cpu, pallas_tpu and
    pallas_gpu (a variant whose program holds the head's whole Dv): undifferentiated, its
    recurrent kernel is the norm build (`gdngen.backends.kernel_inputs.KernelInputs.norm`) and
    returns the gated norm itself, with no norm stage after it, and the conv build: the raw q,
    k, v convolved in its loads, no conv stage before it; values and every
    gradient (through the norm's VJP) against float64, outputs poisoned."""
    spec, variant = variant_here(backend, form)
    convolved = counted_convs(monkeypatch)
    if backend.startswith("pallas"):
        from gdngen.backends.pallas.backend import PallasBackend as owner

        variant = whole_head_variant(spec, backend, variant, form)
        name, position = "recurrent_forward", None
    else:
        from gdngen.backends.ffi_cpu import vjp as owner

        name, position = "recurrent", 3
    assert spec.parse(variant).recurrent_below > 17
    fw, x, options, call, builds, norms = spied_mixer(
        monkeypatch, "jax", form, 61, variant, owner, name, lambda a, kw: kw.get("inputs")
        if position is None or len(a) <= position else a[position], steps=17)
    out = call()
    assert [b.norm for b in builds if b is not None and b.norm] == [FORMS[form].get(
        "norm_gate", "silu")] and norms == [], (builds, norms)
    # one launch: the conv in the loads (every recurrent build made), the norm in the stores
    assert {b.conv for b in builds if b is not None} == {True} and convolved == [], (
        builds, convolved)
    errors = check_against_reference(fw, x, options, cotangents(61, steps=17), variant=variant)
    assert float(fw.m.max(fw.m.abs(out[0]))) > 0
    print(backend, "recurrent norm", form, ", ".join(f"{n} {e:.1e}" for n, e in errors.items()))


def test_tpu_recurrent_conv_carries_its_rows_across_time_blocks(monkeypatch):
    """pallas_tpu's recurrent conv build over more than one time block (T = 150 > 128, a
    variant whose recurrent kernel runs it): the K - 1 raw rows before each block come from the
    scratch the block before it left, so the undifferentiated output (the conv, the norm and the
    recurrence in the kernel) matches the float64 composition across the block boundary."""
    from gdngen.backends.pallas import tpu
    from gdngen.backends.pallas.backend import PallasBackend as owner

    steps = 150
    assert steps > tpu.RECURRENT_TIME_BLOCK
    _, variant = variant_here("pallas_tpu")
    variant = variant.replace(dv_tile=Dv, recurrent_below=steps + 1)
    _, x, options, call, builds, norms = spied_mixer(
        monkeypatch, "jax", "scalar", 83, variant, owner, "recurrent_forward",
        lambda a, kw: kw.get("inputs"), steps=steps)
    out = call()
    assert [(b.conv, b.norm) for b in builds] == [(True, "silu")] and norms == [], builds
    ref = stages.reference_vjp(**x, **DIMS, **options, **cotangents(83, steps=steps),
                               cu_seqlens=None)
    error = relative_error(np.asarray(out[0], np.float64), ref["out"])
    assert error <= RTOL, error


@pytest.mark.parametrize("form", [
    pytest.param(f, marks=[pytest.mark.slow] if f == "vector" else []) for f in sorted(FORMS)])
def test_metal_recurrent_kernel_normalises_in_its_stores(form, monkeypatch):
    """A short mixer call on metal (the MSL simulator; the norm build takes one threadgroup per
    head, whatever the dv_tile): undifferentiated, its recurrent kernel is the norm build (the conv,
    the q/k norm and the gate in its loads, the gated norm in its stores, the heads' sums of
    squares meeting in threadgroup memory) with no norm stage after it; values and every
    gradient (the plain call's VJP, then the norm's) against float64, outputs poisoned."""
    from gdngen.backends.metal import calls

    spec, variant = variant_here("metal", form)
    assert spec.parse(variant).dv_tile < Dv
    assert spec.parse(variant).recurrent_below > 17
    fw, x, options, call, builds, norms = spied_mixer(
        monkeypatch, "mlx", form, 71, variant, calls, "recurrent_forward",
        lambda a, kw: kw.get("norm_gate"), steps=17)
    out = call()
    assert builds == [FORMS[form].get("norm_gate", "silu")] and norms == [], (builds, norms)
    errors = check_against_reference(fw, x, options, cotangents(71, steps=17), variant=variant)
    assert float(fw.m.max(fw.m.abs(out[0]))) > 0
    # bit-identical under every thread order of the simulator (the barrier between a step's
    # sums of squares and their reads)
    from gdngen.backends.metal import launch

    for schedule, seed in (("reverse", 0), ("random", 1), ("low_first", 0), ("high_first", 0)):
        launcher = launch.SimLauncher(schedule, seed)
        monkeypatch.setattr(launch, "default_launcher", lambda launcher=launcher: launcher)
        again = call()
        assert launcher.threadgroup_bytes, "the patched launcher ran the kernel"
        np.testing.assert_array_equal(np.asarray(again[0]), np.asarray(out[0]), err_msg=schedule)
    print("metal recurrent norm", form, ", ".join(f"{n} {e:.1e}" for n, e in errors.items()))


@pytest.mark.parametrize("backend, form", [
    pytest.param(b, f, marks=[pytest.mark.slow] if (b, f) == ("ffi_cpu", "vector") else [])
    for b in ("ffi_cpu", "pallas_gpu", "pallas_tpu") for f in sorted(FORMS)])
def test_chunk_forward_normalises_in_its_stores(backend, form, monkeypatch):
    """A chunked mixer call (T = 37 over ``recurrent_below`` = 16) on ffi_cpu, pallas_gpu and
    pallas_tpu (scalar gates, a variant whose programs hold the head's whole Dv):
    undifferentiated, its chunk forward is the norm build (`gdngen.backends.ffi_cpu.vjp.
    normed_chunk`: the conv, the q/k norm and the gate in its loads, the gated norm in each
    chunk's stores; the Pallas ``normed_chunk``: the gated norm in the walk's stores, written
    in the call's layout; per-channel gates: the intra-chunk kernel, then that walk; the conv
    in the kernels' loads), with no conv stage before it and no norm stage after it;
    values and every gradient against float64, outputs poisoned."""
    spec, variant = variant_here(backend, form)
    variant = variant.replace(recurrent_below=16)
    convolved = counted_convs(monkeypatch)
    if backend.startswith("pallas"):
        from gdngen.backends.pallas.backend import PallasBackend as owner

        # two chunks of 32 (T = 37): the conv's rows before the second come from the first
        variant = whole_head_variant(spec, backend, variant, form).replace(chunk_size=32)
        name = "normed_chunk_forward"
    else:
        from gdngen.backends.ffi_cpu import vjp as owner

        name = "normed_chunk"
    assert spec.parse(variant).recurrent_below <= T
    fw, x, options, call, builds, norms = spied_mixer(
        monkeypatch, "jax", form, 67, variant, owner, name, lambda a, kw: a)
    out = call()
    norm_gate = FORMS[form].get("norm_gate", "silu")
    if backend.startswith("pallas"):  # (self, call, operands, variant, ...)
        assert [b[1].norm_gate for b in builds] == [norm_gate] and norms == [], (builds, norms)
        # these builds convolve in their loads: no conv stage before them
        assert convolved == [], convolved
    else:
        assert [b[5] for b in builds] == [norm_gate] and builds[0][7] and norms == [], (
            builds, norms)
    errors = check_against_reference(fw, x, options, cotangents(67), variant=variant)
    assert float(fw.m.max(fw.m.abs(out[0]))) > 0
    print(backend, "chunk norm", form, ", ".join(f"{n} {e:.1e}" for n, e in errors.items()))


def test_explain_says_where_the_norm_and_the_conv_run():
    """``explain()`` of a ``norm_weight`` call names where the output's gated norm runs
    (`gdngen.backend.Backend.norm_in_stores`, what each forward reads): ffi_cpu's kernels at
    every T; the Pallas kernels where a program holds the head's Dv (pallas_tpu: dv_tile = Dv,
    pallas_gpu: bv = Dv, not Dv / 2), the recurrent kernel for a short call, the chunk forward
    for a long one (pallas_tpu: where its output blocks are whole vregs or rows); after the
    kernels on xla and for packed rows. With ``conv_weight`` it names where the conv runs
    (`gdngen.backend.Backend.conv_path`): ffi_cpu's forwards' loads; the Pallas recurrent
    kernels' loads for a short call; the Pallas chunk norm builds' loads (up to
    `CHUNK_CONV_TAPS` taps), and pallas_tpu's scalar chunk core's forward kernel's loads, else
    the Pallas chunk cores before their kernels; before the kernels on xla and for packed
    rows."""
    import jax.numpy as jnp

    import gdngen

    rng = np.random.default_rng(3)

    def args(steps):
        return [jnp.asarray(rng.standard_normal(shape), jnp.float32) for shape in (
            (1, steps, Hk, Dk), (1, steps, Hk, Dk), (1, steps, Hv, Dv))] + [
            -jnp.ones((1, steps, Hv)), jnp.full((1, steps, Hv), 0.5)]

    def where(steps, variant, **extra):
        norm = {"norm_weight": jnp.ones(Dv), "output_gate": jnp.ones((1, steps, Hv, Dv))}
        return str(gdngen.load_tuned("jax").explain(*args(steps), variant=variant, **norm,
                                                    **extra))

    stores, after = "norm in the kernels' stores when not differentiated", "norm after the"
    problem = Problem(Hk, Hv, Dk, Dv)
    ffi, tpu, gpu = (registry.default_variant(b, problem)
                     for b in ("ffi_cpu", "pallas_tpu", "pallas_gpu"))
    assert stores in where(17, ffi) and stores in where(200, ffi)
    assert stores in where(17, tpu) and stores in where(200, tpu)
    # Dv = 64 < 128: one head's lanes are a whole output block only with every head in it
    assert after in where(200, tpu.replace(head_tile=1))
    assert stores in where(17, gpu.replace(bv=Dv)) and after in where(17, gpu.replace(
        bv=Dv // 2))
    assert stores in where(200, gpu.replace(bv=Dv)) and after in where(200, gpu.replace(
        bv=Dv // 2))
    assert after in where(17, registry.default_variant("xla", problem))
    assert after in where(17, ffi, cu_seqlens=jnp.asarray([0, 9, 17], jnp.int32))

    conv = {"conv_weight": jnp.full((2 * Hk * Dk + Hv * Dv, 4), 0.1)}
    assert "conv" not in where(17, ffi)
    assert "conv in the recurrent kernel's loads when not differentiated, the chunk " \
        "forward's when differentiated" in where(17, ffi, **conv)
    assert "conv in the chunk forward's loads (raw q, k, v)" in where(200, ffi, **conv)
    recurrent, core = "conv in the recurrent kernel's loads", "conv in the chunk core before"
    chunk = "conv in the chunk forward's loads when not differentiated (its norm build)"
    core_loads = "in the chunk core's forward kernel's loads"
    assert recurrent in where(17, tpu, **conv) and chunk in where(200, tpu, **conv)
    assert f"differentiated, {core_loads}" in where(200, tpu, **conv)
    assert core_loads in where(200, tpu.replace(head_tile=1), **conv)  # no norm build
    assert core in where(200, tpu, conv_weight=jnp.full((2 * Hk * Dk + Hv * Dv, 5), 0.1))
    assert recurrent in where(17, gpu.replace(bv=Dv // 2), **conv)
    assert chunk in where(200, gpu.replace(bv=Dv), **conv)
    assert core in where(200, gpu.replace(bv=Dv // 2), **conv)
    first = "conv before the kernels"
    assert first in where(17, registry.default_variant("xla", problem), **conv)
    assert first in where(17, ffi, cu_seqlens=jnp.asarray([0, 9, 17], jnp.int32), **conv)


def test_explain_says_where_metal_convolves():
    """metal's ``explain()`` of a ``conv_weight`` call: the recurrent kernel's conv build for
    a short call (undifferentiated), the conv before the chunk kernels for a long one."""
    mx = pytest.importorskip("mlx.core")
    import gdngen

    rng = np.random.default_rng(5)
    heads = Problem(1, 2, 32, 32)
    variant = registry.default_variant("metal", heads)

    def where(steps):
        q, k, v = (mx.array(rng.standard_normal((1, steps, h, 32)).astype(np.float32))
                   for h in (1, 1, 2))
        return str(gdngen.load_tuned("mlx").explain(
            q, k, v, -mx.ones((1, steps, 2)), mx.full((1, steps, 2), 0.5), variant=variant,
            conv_weight=mx.full((2 * 32 + 2 * 32, 4), 0.1)))

    below = variant.get("recurrent_below")
    assert "conv in the recurrent kernel's loads when not differentiated" in where(below - 1)
    assert "conv before the kernels" in where(below)


@pytest.mark.parametrize("framework", ["jax", "mlx"])
def test_gated_delta_norm_weight_is_the_call_then_the_norm(framework):
    """``gated_delta(..., norm_weight=, output_gate=)`` equals the call followed by the gated
    RMSNorm (`gdngen.algebra.mixer.gated_norm`), values (undifferentiated: ffi_cpu's norm
    build for the short row) and every gradient, both activations, a dense short row, a dense
    chunked row and a packed row."""
    fw = Framework(framework)
    gated_delta = fw.gated_delta
    xp = prepare.namespace(framework)
    rng = np.random.default_rng(43)

    def arr(*shape, scale=1.0):
        return fw.array(scale * rng.standard_normal(shape))

    for rows, steps, cu, act in ((B, 9, None, "silu"), (B, 150, None, "sigmoid"),
                                 (1, 60, [0, 20, 21, 60], "silu")):
        n = rows if cu is None else len(cu) - 1
        q, k, v = arr(rows, steps, Hk, Dk), arr(rows, steps, Hk, Dk), arr(rows, steps, Hv, Dv)
        g, beta, S0 = arr(rows, steps, Hv), arr(rows, steps, Hv), arr(n, Hv, Dv, Dk, scale=0.1)
        A_log, dt_bias = arr(Hv, scale=0.5), arr(Hv, scale=0.5)
        z, w = arr(rows, steps, Hv, Dv), fw.array(1.0 + 0.1 * rng.standard_normal(Dv))
        mask = np.ones((rows, steps), bool)
        mask[-1, : steps // 4] = False
        offsets = None if cu is None else fw.array(np.asarray(cu, np.int32))
        opts = {"gate": "softplus", "qk_norm": True, "beta_activation": "sigmoid",
                "scale": Dk ** -0.5, "mask": fw.array(mask), "cu_seqlens": offsets}

        def composed(z, w, *rest, opts=opts, act=act):
            y, s = gated_delta(*rest[:6], A_log=rest[6], dt_bias=rest[7], **opts)
            return stages.gated_norm(xp, y, z, w, 1e-5, act), s

        def fused(z, w, *rest, opts=opts, act=act):
            return gated_delta(*rest[:6], A_log=rest[6], dt_bias=rest[7], norm_weight=w,
                               output_gate=z, norm_eps=1e-5, norm_gate=act, **opts)

        args = (z, w, q, k, v, g, beta, S0, A_log, dt_bias)
        want, got = fw.grads(composed, args), fw.grads(fused, args)
        for name, a, b in zip(("out", "S", "z", "w", "q", "k", "v", "g", "beta", "S0",
                               "A_log", "dt_bias"), got, want):
            assert relative_error(np.asarray(a), np.asarray(b)) <= 2e-6, (name, rows, steps)


@pytest.mark.parametrize("change, message", [
    ({"norm_weight": np.zeros(Dv + 1)}, f"norm_weight has shape {(Dv + 1,)}, expected [Dv]"),
    ({"output_gate": np.zeros((B, T, Hv, Dv - 1))},
     f"output_gate has shape {(B, T, Hv, Dv - 1)}, expected [B, T, Hv, Dv]"),
    ({"output_gate": None}, "norm_weight needs output_gate"),
    ({"norm_weight": None}, "output_gate needs norm_weight"),
    ({"norm_gate": "relu"}, "norm_gate must be one of ('silu', 'sigmoid'), got 'relu'"),
    ({"norm_eps": 0.0}, "norm_eps must be a positive float, got 0.0"),
    ({"norm_weight": np.zeros(Dv, np.int32)}, "norm_weight has dtype int32"),
])
def test_gated_delta_norm_arguments_name_the_argument(change, message):
    from gdngen.jax import gated_delta

    rng = np.random.default_rng(3)
    arrays = {"q": rng.standard_normal((B, T, Hk, Dk)), "k": rng.standard_normal((B, T, Hk, Dk)),
              "v": rng.standard_normal((B, T, Hv, Dv)), "g": -rng.random((B, T, Hv)),
              "beta": rng.random((B, T, Hv)), "norm_weight": rng.standard_normal(Dv),
              "output_gate": rng.standard_normal((B, T, Hv, Dv))}
    options = {n: change.pop(n) for n in ("norm_gate", "norm_eps") if n in change}
    arrays.update(change)
    arrays = {n: None if x is None else np.asarray(x, np.float32 if x.dtype.kind == "f" else
                                                   x.dtype) for n, x in arrays.items()}
    with pytest.raises(ValueError, match=re.escape(message)):
        gated_delta(**arrays, **options)


@pytest.mark.parametrize("change, message", [
    ({"conv_weight": np.zeros((C + 1, K))}, f"conv_weight has shape {(C + 1, K)}, expected"),
    ({"conv_weight": np.zeros((C,))}, f"conv_weight has shape {(C,)}, expected"),
    ({"conv_state": np.zeros((B, C, K))},
     f"conv_state has shape {(B, C, K)}, expected [B, C, K-1]"),
    ({"conv_weight": None}, "conv_state needs conv_weight"),
    ({"conv_weight": np.zeros((C, K), np.int32)}, "conv_weight has dtype int32"),
])
def test_gated_delta_conv_arguments_name_the_argument(change, message):
    from gdngen.jax import gated_delta

    rng = np.random.default_rng(3)
    arrays = {"q": rng.standard_normal((B, T, Hk, Dk)), "k": rng.standard_normal((B, T, Hk, Dk)),
              "v": rng.standard_normal((B, T, Hv, Dv)), "g": -rng.random((B, T, Hv)),
              "beta": rng.random((B, T, Hv)), "conv_weight": rng.standard_normal((C, K)),
              "conv_state": rng.standard_normal((B, C, K - 1))}
    arrays.update(change)
    arrays = {n: None if x is None else np.asarray(x, np.float32 if x.dtype.kind == "f" else
                                                   x.dtype) for n, x in arrays.items()}
    with pytest.raises(ValueError, match=re.escape(message)):
        gated_delta(**arrays)


@pytest.mark.parametrize("conv_states", [True, False], ids=["conv_states", "no_conv_state"])
@pytest.mark.parametrize("framework", ["jax", "mlx"])
def test_packed_rows_restart_the_window_at_every_sequence(framework, conv_states):
    """cu_seqlens: each sequence's first K-1 steps read its own conv state (zeros without
    one; one sequence shorter than K-1, one empty), and each returns its own."""
    fw = Framework(framework)
    cu = np.array([0, 2, 2, 19, 40], np.int32)
    N, steps = len(cu) - 1, int(cu[-1])
    x, options = inputs("scalar", seed=5, rows=1, steps=steps, mask=False)
    x["conv_state"] = (np.random.default_rng(6).standard_normal((N, C, K - 1)) if conv_states
                       else None)
    x["initial_state"] = 0.1 * np.random.default_rng(7).standard_normal((N, Hv, Dv, Dk))
    cots = cotangents(8, rows=1, steps=steps)
    cots["dfinal_state"] = np.random.default_rng(9).standard_normal((N, Hv, Dv, Dk))
    cots["dconv_state"] = np.random.default_rng(10).standard_normal((N, C, K - 1))
    check_against_reference(fw, x, options, cots, cu_seqlens=fw.array(cu))


@pytest.mark.parametrize("framework", ["jax", "mlx"])
def test_allow_neg_eigval_takes_beta_up_to_two(framework):
    """``allow_neg_eigval=True`` (OLMo hybrid): beta = 2 sigmoid(b), every gradient as the
    float64 composition's (db through the doubled sigmoid)."""
    fw = Framework(framework)
    x, options = inputs("scalar", seed=23)
    x["b"] = 2.0 * x["b"]  # betas across (0, 2), well past 1
    check_against_reference(fw, x, {**options, "allow_neg_eigval": True}, cotangents(23))


@pytest.mark.parametrize("framework", ["jax", "mlx"])
def test_decode_continues_a_prefill_through_both_states(framework):
    """A prefill of 29 steps, then 8 decode calls of T=1 carrying (final_state, conv_state),
    equal one call over all 37 steps."""
    fw = Framework(framework)
    x, _ = inputs("scalar", seed=11, mask=False)
    x.pop("conv_state"), x.pop("initial_state")
    a = {n: fw.array(v) for n, v in x.items()}
    whole = fw.mixer(**a, **DIMS)
    split, state, conv = [], None, None
    for lo, hi in [(0, 29)] + [(t, t + 1) for t in range(29, T)]:
        part = {n: v[:, lo:hi] if n in ("mixed_qkv", "a", "b", "z") else v
                for n, v in a.items()}
        out, state, conv = fw.mixer(**part, **DIMS, initial_state=state, conv_state=conv)
        split.append(np.asarray(out, np.float64))
    assert relative_error(np.concatenate(split, axis=1), np.asarray(whole[0])) <= RTOL
    assert relative_error(np.asarray(state), np.asarray(whole[1])) <= RTOL
    assert relative_error(np.asarray(conv), np.asarray(whole[2])) == 0.0


@pytest.mark.parametrize("framework", ["jax", "mlx"])
def test_steps_are_the_states_after_every_step(framework):
    """``return_states="steps"`` (a verify window of 6 with a padded step): the state after
    step t is the float64 composition's final state over the first t steps; the output and conv
    state are the final call's."""
    fw = Framework(framework)
    steps = 6
    x, options = inputs("scalar", seed=13, steps=steps, mask=False)
    m = np.ones((B, steps), bool)
    m[0, 2] = False
    options["mask"] = m
    a = {n: fw.array(v) for n, v in x.items()}
    out, states, conv = fw.mixer(**a, **DIMS, mask=fw.array(m), return_states="steps")
    states = np.asarray(states, np.float64)
    assert states.shape == (B, steps, Hv, Dv, Dk)
    for t in range(1, steps + 1):
        prefix = {n: v[:, :t] if n in ("mixed_qkv", "a", "b", "z") else v for n, v in x.items()}
        ref = stages.reference_vjp(**prefix, **DIMS, **{**options, "mask": m[:, :t]})
        assert relative_error(states[:, t - 1], ref["final_state"]) <= RTOL, t
    assert relative_error(np.asarray(out, np.float64), ref["out"]) <= RTOL
    assert relative_error(np.asarray(conv, np.float64), ref["conv_state"]) <= RTOL


def test_matches_mlx_lm_qwen3_next_layer():
    """The layout conventions: mlx-lm's Qwen3NextGatedDeltaNet (conv1d, normalize_qk,
    gated_delta_update, RMSNormGated) on the same weights, with a cache carried over a
    prefill and a decode step, gives the mixer's outputs and states."""
    mlx_lm = pytest.importorskip("mlx_lm")
    import mlx.core as mx
    from mlx_lm.models import qwen3_next
    from mlx_lm.models.cache import ArraysCache

    from gdngen.mlx import gated_delta_mixer

    del mlx_lm
    args = qwen3_next.ModelArgs(
        model_type="qwen3_next", hidden_size=64, num_hidden_layers=1, intermediate_size=64,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, rms_norm_eps=1e-6,
        vocab_size=32, rope_theta=1e4, partial_rotary_factor=0.25, max_position_embeddings=64,
        linear_num_value_heads=Hv, linear_num_key_heads=Hk, linear_key_head_dim=Dk,
        linear_value_head_dim=Dv, linear_conv_kernel_dim=K, num_experts=1,
        num_experts_per_tok=1, decoder_sparse_step=1, shared_expert_intermediate_size=64,
        moe_intermediate_size=64, norm_topk_prob=True, mlp_only_layers=[])
    mx.random.seed(0)
    layer = qwen3_next.Qwen3NextGatedDeltaNet(args)
    layer.eval()
    layer.norm.weight = 1.0 + 0.1 * mx.random.normal((Dv,))
    cache = ArraysCache(size=2)
    conv, state = None, None
    for steps in (19, 1):
        h = mx.random.normal((1, steps, args.hidden_size))
        want = layer(h, cache=cache)
        q, k, v, z, b, a = layer.fix_query_key_value_ordering(layer.in_proj_qkvz(h),
                                                             layer.in_proj_ba(h))
        mixed = mx.concatenate([t.reshape(1, steps, -1) for t in (q, k, v)], axis=-1)
        out, state, conv = gated_delta_mixer(
            mixed, layer.conv1d.weight[..., 0], a, b, z, **DIMS, A_log=layer.A_log,
            dt_bias=layer.dt_bias, norm_weight=layer.norm.weight, conv_state=conv,
            initial_state=state, norm_eps=args.rms_norm_eps)
        got = layer.out_proj(out.reshape(1, steps, -1))
        assert relative_error(np.array(got), np.array(want)) <= 1e-5
        assert relative_error(np.array(conv), np.array(mx.swapaxes(cache[0], 1, 2))) == 0.0
        assert relative_error(np.array(state), np.array(cache[1])) <= 1e-5


@pytest.mark.parametrize("framework", ["jax", "mlx"])
def test_saturated_activations_have_finite_gradients(framework):
    """Conv pre-activations and output gates of +-200 (SiLU and sigmoid saturated both ways):
    every gradient finite (a sigmoid written as 1 / (1 + exp(-x)) differentiates to inf / inf
    at -200 in float32)."""
    fw = Framework(framework)
    x, options = inputs("vector", seed=13, mask=False)
    x["mixed_qkv"] = 200.0 * np.sign(x["mixed_qkv"])
    x["z"] = 200.0 * np.sign(x["z"])
    got = fw.values_and_grads(x, options, cotangents(13))
    assert all(np.isfinite(v).all() for v in got.values()), \
        [n for n, v in got.items() if not np.isfinite(v).all()]


@pytest.mark.parametrize("backend, steps", [("ffi_cpu", T), ("xla", T), ("pallas_tpu", 150),
                                            ("pallas_gpu", 150)])
def test_conv_and_norm_keep_only_their_raw_inputs_for_the_backward(backend, steps):
    """What ``jax.vjp`` keeps (jitted): never mixed_qkv ``[B, T, C]`` or a convolved copy.
    ffi_cpu convolves in its chunk core (``conv_weight``), and so do the Pallas backends'
    chunk cores (a row past their recurrent switch; over the call's layout, before the
    kernels' own), each keeping the raw q, k, v slices: of q's shape exactly the raw q and k
    and of y's shape the raw v, z and y (the norm's inputs), each row-major, and no q or k in
    the chunk layout; xla's conv stage keeps the raw slices ``[B, T, H D]`` (its chunk core
    keeps its own chunk layout). ffi_cpu's short row runs the recurrent kernel, whose VJP is
    the chunk core's. Gradients: test_mixer_matches_the_float64_composition,
    test_pallas_chunk_cores_convolve_and_match_the_float64_composition."""
    import jax
    import jax.numpy as jnp

    from gdngen.jax import gated_delta_mixer

    spec = registry.get(backend)
    ok, why = spec.capability(Problem(Hk, Hv, Dk, Dv))
    if not ok:
        pytest.skip(f"{backend} cannot run here: {why}")
    variant = registry.default_variant(backend, Problem(Hk, Hv, Dk, Dv))
    assert steps >= variant.get("recurrent_below", 0) or backend in ("ffi_cpu", "xla")
    x, _ = inputs("scalar", seed=17, mask=False, steps=steps)
    args = {n: jnp.asarray(np.asarray(x[n], np.float32)) for n in ARGS}

    def call(mixed_qkv, z):
        return gated_delta_mixer(mixed_qkv, args["conv_weight"], args["a"], args["b"], z,
                                 **DIMS, A_log=args["A_log"], dt_bias=args["dt_bias"],
                                 norm_weight=args["norm_weight"], conv_state=args["conv_state"],
                                 initial_state=args["initial_state"], variant=variant)

    kept = [tuple(a.shape) for a in jax.jit(
        lambda m, z: jax.tree.leaves(jax.vjp(call, m, z)[1]))(args["mixed_qkv"], args["z"])]
    assert (B, steps, C) not in kept, kept
    if backend == "xla":
        assert (kept.count((B, T, Hk * Dk)), kept.count((B, T, Hv * Dv))) == (2, 1), kept
        return
    assert kept.count((B, steps, Hk, Dk)) == 2, kept
    assert kept.count((B, steps, Hv, Dv)) == 3, kept
    if backend.startswith("pallas"):
        chunk = variant["chunk_size"]
        n = -(-steps // chunk)
        assert not {(n, B, Hk, chunk, Dk), (n, B, Hk, Hv // Hk, chunk, Dv)} & set(kept), kept


@pytest.mark.parametrize("change, message", [
    ({"mixed_qkv": np.zeros((B, T, C + 1))}, "mixed_qkv has shape"),
    ({"conv_weight": np.zeros((C, K, 1))}, "conv_weight must be [C, K]"),
    ({"conv_state": np.zeros((B, K - 1, C))}, "conv_state has shape"),
    ({"z": np.zeros((B, T, Hv, Dk))}, "z has shape"),
    ({"norm_weight": np.zeros(Dk)}, "norm_weight has shape"),
    ({"a": np.zeros((B, T, Hk))}, "a has shape"),
    ({"b": np.zeros((B, T))}, "b has shape"),
    ({"gate": "log"}, "gate must be one of"),
    ({"norm_gate": "relu"}, "norm_gate must be one of"),
    ({"norm_eps": 0.0}, "norm_eps must be a positive float"),
    ({"Hk": 0}, "Hk must be a positive int"),
    ({"return_states": "chunks"}, "return_states must be 'final' or 'steps'"),
    ({"allow_neg_eigval": 1}, "allow_neg_eigval must be a bool"),
])
@pytest.mark.parametrize("framework", ["jax", "mlx"])
def test_bad_arguments_name_the_argument(framework, change, message):
    fw = Framework(framework)
    x, options = inputs("scalar", seed=12, mask=False)
    kwargs = {**{n: fw.array(v) for n, v in x.items()}, **DIMS, **options}
    kwargs.update({n: fw.array(v) if isinstance(v, np.ndarray) else v
                   for n, v in change.items()})
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        fw.mixer(**kwargs)
