"""Tests for gdngen.algebra.reference: finite differences vs the hand-derived VJP, and forward
checks."""

from __future__ import annotations

import numpy as np
import pytest

from gdngen.algebra import reference

D = 16  # check_call requires head dims in 16..256
N_FD = 20  # entries per input checked by finite differences
EPS = 1e-6
RTOL = 1e-6


def _seed() -> int:
    return int(np.random.SeedSequence().entropy % (2**63))


def _make(rng, *, B=2, T=5, Hk=1, Hv=1, vector=False, gate="log", mask=False, init=True,
          beta_hi=2.0):
    """Random inputs with L2-normalised keys (so the recurrence stays bounded for beta <= 2)."""
    q = rng.standard_normal((B, T, Hk, D))
    k = rng.standard_normal((B, T, Hk, D))
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    v = rng.standard_normal((B, T, Hv, D))
    gshape = (B, T, Hv, D) if vector else (B, T, Hv)
    a = rng.uniform(0.3, 1.0, gshape)
    g = np.log(a) if gate == "log" else a
    beta = rng.uniform(0.0, beta_hi, (B, T, Hv))
    s0 = rng.standard_normal((B, Hv, D, D)) if init else None
    m = None
    if mask:
        m = rng.random((B, T)) < 0.6
        m[:, 0] = True
        m[0, 1] = False
    dy = rng.standard_normal((B, T, Hv, D))
    dfin = rng.standard_normal((B, Hv, D, D))
    return {"q": q, "k": k, "v": v, "g": g, "beta": beta, "initial_state": s0, "mask": m,
            "dy": dy, "dfin": dfin}


CONFIGS = {
    "scalar_log": {"gate": "log"},
    "scalar_linear": {"gate": "linear"},
    "vector_log": {"gate": "log", "vector": True},
    "vector_linear": {"gate": "linear", "vector": True},
    "gva_scalar_log": {"gate": "log", "Hk": 1, "Hv": 3, "B": 1, "T": 4},
    "gva_vector_linear": {"gate": "linear", "vector": True, "Hk": 2, "Hv": 4, "B": 1, "T": 3},
    "mask_log": {"gate": "log", "mask": True, "T": 6},
    "mask_vector_linear": {"gate": "linear", "vector": True, "mask": True, "T": 6, "Hv": 2,
                           "Hk": 2},
    "zero_init": {"gate": "log", "init": False, "T": 3},
}
ARGS = ("q", "k", "v", "g", "beta", "initial_state")


@pytest.mark.parametrize("name", list(CONFIGS))
def test_vjp_matches_finite_differences(name):
    seed = _seed()
    rng = np.random.default_rng(seed)
    cfg = dict(CONFIGS[name])
    gate = cfg["gate"]
    inp = _make(rng, **cfg)
    scale = 0.25 if name.startswith("scalar") else 1.0
    mask, dy, dfin = inp["mask"], inp["dy"], inp["dfin"]
    args = {a: inp[a] for a in ARGS}
    out = reference.vjp(*args.values(), dy, dfin, mask=mask, scale=scale, gate=gate)
    if args["initial_state"] is None:  # dinitial_state is still returned; check it at zeros
        args["initial_state"] = np.zeros_like(out["dinitial_state"])

    def loss(a):
        y, fin = reference.forward(*a.values(), mask=mask, scale=scale, gate=gate)
        return np.sum(y * dy) + np.sum(fin * dfin)

    for arg in ARGS:
        x = args[arg]
        grad = out["d" + arg]
        assert grad.shape == x.shape, (arg, grad.shape, x.shape, seed)
        idx = rng.choice(x.size, size=min(N_FD, x.size), replace=False)
        fd, an = np.empty(len(idx)), grad.reshape(-1)[idx]
        for j, i in enumerate(idx):
            lp, lm = dict(args), dict(args)
            xp, xm = x.copy().reshape(-1), x.copy().reshape(-1)
            xp[i] += EPS
            xm[i] -= EPS
            lp[arg], lm[arg] = xp.reshape(x.shape), xm.reshape(x.shape)
            fd[j] = (loss(lp) - loss(lm)) / (2 * EPS)
        err = np.linalg.norm(fd - an) / max(np.linalg.norm(an), 1e-12)
        assert err <= RTOL, f"{name}: d{arg} rel err {err:.3g} (seed={seed})"


def _loop_forward(q, k, v, g, beta, s0, mask, scale, gate):
    """Independent per-element forward: explicit loops over b, h, t with np.outer."""
    B, T, Hk, _ = q.shape
    Hv = v.shape[2]
    r = Hv // Hk
    y = np.zeros(v.shape)
    fin = np.zeros((B, Hv, v.shape[3], q.shape[3]))
    for b in range(B):
        for h in range(Hv):
            S = s0[b, h].copy()
            for t in range(T):
                if mask is not None and not mask[b, t]:
                    continue
                a = np.exp(g[b, t, h]) if gate == "log" else g[b, t, h]
                Sp = S * a  # vector gate broadcasts over columns (Dk)
                kk, qq = k[b, t, h // r], q[b, t, h // r]
                S = Sp + beta[b, t, h] * np.outer(v[b, t, h] - Sp @ kk, kk)
                y[b, t, h] = scale * S @ qq
            fin[b, h] = S
    return y, fin


@pytest.mark.parametrize("vector,gate", [(False, "log"), (True, "linear")])
def test_forward_matches_loop(vector, gate):
    seed = _seed()
    inp = _make(np.random.default_rng(seed), B=2, T=5, Hk=2, Hv=4, vector=vector, gate=gate,
                mask=True)
    args = [inp[a] for a in ARGS]
    y, fin = reference.forward(*args, mask=inp["mask"], scale=0.5, gate=gate)
    y2, fin2 = _loop_forward(*args, inp["mask"], 0.5, gate)
    np.testing.assert_allclose(y, y2, rtol=1e-12, atol=1e-12, err_msg=f"seed={seed}")
    np.testing.assert_allclose(fin, fin2, rtol=1e-12, atol=1e-12, err_msg=f"seed={seed}")


@pytest.mark.parametrize("vector", [False, True])
def test_log_neg_inf_equals_linear_zero(vector):
    seed = _seed()
    inp = _make(np.random.default_rng(seed), B=2, T=5, Hv=2, Hk=1, vector=vector, gate="log")
    g_log = inp["g"].copy()
    reset = np.zeros(g_log.shape, dtype=bool)
    reset[0, 2] = True
    reset[1, 3, 1] = True
    g_log[reset] = -np.inf
    args = [inp[a] for a in ("q", "k", "v")]
    rest = (inp["beta"], inp["initial_state"], inp["dy"], inp["dfin"])
    lo = reference.vjp(*args, g_log, *rest, gate="log")
    li = reference.vjp(*args, np.exp(g_log), *rest, gate="linear")
    for key in ("y", "final_state", "dq", "dk", "dv", "dbeta", "dinitial_state"):
        np.testing.assert_allclose(lo[key], li[key], rtol=1e-12, atol=1e-12,
                                   err_msg=f"{key} seed={seed}")
    assert np.all(np.isfinite(lo["dg"])) and np.all(np.isfinite(li["dg"]))
    assert np.all(lo["dg"][reset] == 0.0), f"seed={seed}"
    assert np.all(li["dg"][reset] != 0.0), f"seed={seed}"
    # Chain rule between conventions: d/dg_log = d/da * a.
    np.testing.assert_allclose(lo["dg"], li["dg"] * np.exp(g_log), rtol=1e-12, atol=1e-12)


def test_masked_steps():
    seed = _seed()
    rng = np.random.default_rng(seed)
    inp = _make(rng, B=2, T=6, Hk=1, Hv=2, vector=True, gate="log", mask=True)
    mask = inp["mask"]
    off = ~mask
    # Garbage in masked steps must not matter.
    for a in ("q", "k", "v", "beta"):
        inp[a][off] = 1e3 * rng.standard_normal(inp[a][off].shape)
    inp["g"][off] = 5.0
    args = [inp[a] for a in ARGS]
    out = reference.vjp(*args, inp["dy"], inp["dfin"], mask=mask, gate="log")
    assert np.all(out["y"][off] == 0.0), f"seed={seed}"
    for key in ("dq", "dk", "dv", "dg", "dbeta"):
        assert np.all(out[key][off] == 0.0), f"{key} seed={seed}"
    # Each batch row equals the forward of its compacted (unmasked-only) sequence.
    for b in range(mask.shape[0]):
        keep = mask[b]
        sub = [inp[a][b:b + 1, keep] for a in ("q", "k", "v", "g", "beta")]
        y, fin = reference.forward(*sub, inp["initial_state"][b:b + 1], gate="log")
        np.testing.assert_allclose(out["y"][b, keep], y[0], rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(out["final_state"][b], fin[0], rtol=1e-12, atol=1e-12)
    # A fully masked row leaves the state untouched and passes dfinal_state straight through.
    full = np.zeros_like(mask)
    out = reference.vjp(*args, inp["dy"], inp["dfin"], mask=full, gate="log")
    np.testing.assert_array_equal(out["final_state"], inp["initial_state"])
    np.testing.assert_array_equal(out["dinitial_state"], inp["dfin"])


@pytest.mark.parametrize("vector", [False, True])
def test_dg_scale_is_the_size_of_the_terms_dg_sums(vector):
    """``dg_scale``: each step's dg is a sum over the state's entries; its root sum of squares
    matches |dg| in size on random keys, and stays at the terms' size where identical keys
    with beta = 1 and strong scalar decay cancel dg to ~0 (S_{t-1}(I - k k^T) has decayed)."""
    seed = _seed()
    rng = np.random.default_rng(seed)
    inp = _make(rng, B=1, T=12, Hv=2, vector=vector, gate="log", beta_hi=1.0)
    rest = (inp["beta"], inp["initial_state"], inp["dy"], inp["dfin"])
    out = reference.vjp(inp["q"], inp["k"], inp["v"], inp["g"], *rest, dg_scale=True)
    assert out["dg_scale"].shape == out["dg"].shape and "dg_scale" not in reference.vjp(
        inp["q"], inp["k"], inp["v"], inp["g"], *rest)
    ratio = np.linalg.norm(out["dg"]) / np.linalg.norm(out["dg_scale"])
    assert 0.05 < ratio < 20.0, f"seed={seed} ratio={ratio}"
    if vector:  # diag(g) does not commute with I - k k^T: no such trap per channel
        return
    k = np.broadcast_to(inp["k"][:, :1], inp["k"].shape)  # one key, beta = 1, g = e^-8
    g = np.full(inp["g"].shape, -8.0)
    beta = np.ones_like(inp["beta"])
    out = reference.vjp(inp["q"], k, inp["v"], g, beta, *rest[1:], dg_scale=True)
    later, scale = np.abs(out["dg"][:, 3:]), out["dg_scale"][:, 3:]
    assert np.all(later < 1e-9 * scale), f"seed={seed}"
