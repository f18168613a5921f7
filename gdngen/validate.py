"""Validate a backend runner against the float64 reference on the adversarial battery.

`check_case` draws a case's inputs, rounds them to the tested dtype, runs the backend runner
(protocol in docs/CONTRACT.md) once with gate="log" and once with gate="linear", runs
`gdngen.algebra.reference.vjp` on the SAME rounded inputs, and records one relative L2 error per
quantity in `QUANTITIES`:

* y, final_state, dq, dk, dv, dbeta, dinitial_state: max over the log and linear runs;
* dg: the log-gate run's dg (d/d log g); dg_linear: the linear run's dg (d/d g);
* y_other_path, final_state_other_path (max over both runs, when the runner returns them): the
  outputs of a forward-only call through the path of the variant's recurrent switch
  (`gdngen.config.recurrent_switch`) that the differentiated call did not take at the case's
  T: the recurrent kernel when the call ran chunkwise, the chunk kernels when its forward ran
  recurrent (its VJP is the chunk path's either way). So both forward paths meet the reference
  on every case, whatever the variant's crossover.
* step_states, chunk_states (the log-gate run of the cases marked ``states``, when the runner
  returns them): the states of forward-only calls with ``return_states="steps"`` over the
  case's first `STEP_WINDOW` steps (a draft window) and ``return_states="chunks"`` with
  ``checkpoint_every`` the variant's chunk (the runner returns the stride it used), against
  the reference's state after each step and at each boundary.

A case passes when every error is <= its tolerance: `gdngen.tolerance.allowed_error` of the
variant under test (the dtype's battery tolerance `tolerance(dtype)` without one).

The battery runners live here too (`runner_for`): each runs one backend on a case's inputs
through its framework's public ``gated_delta`` with an explicit variant (the backend's default
for the case's shape at the case's chunk size, when none is given) and returns the outputs and
the six gradients of the case's cotangents as float64 NumPy arrays (docs/CONTRACT.md).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

import ml_dtypes
import numpy as np

from gdngen import cases as cases_mod
from gdngen import registry
from gdngen.cases import BATTERY, Case
from gdngen.config import RECURRENT_ALWAYS
from gdngen.tolerance import DTYPE_TOLERANCES, allowed_error, dtype_tolerance

__all__ = [
    "OTHER_PATH_QUANTITIES",
    "QUANTITIES",
    "STATE_QUANTITIES",
    "STEP_WINDOW",
    "TOLERANCES",
    "CaseResult",
    "check_case",
    "format_table",
    "relative_error",
    "results_to_json",
    "round_to_dtype",
    "run_battery",
    "runner_for",
    "tolerance",
]

QUANTITIES = ("y", "final_state", "dq", "dk", "dv", "dg", "dbeta", "dinitial_state", "dg_linear")
#: recorded when the runner returns them (every registered backend's runner, `runner_for`)
OTHER_PATH_QUANTITIES = ("y_other_path", "final_state_other_path")
#: the returned states of a dense case (`gdngen.algebra.states`), when the runner gives them
STATE_QUANTITIES = ("step_states", "chunk_states")
#: the draft window a runner's ``return_states="steps"`` call covers: a case's first steps
STEP_WINDOW = 16
TOLERANCES = DTYPE_TOLERANCES
_NUMPY_DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16,
                 "float64": np.float64}
# Quantities taken from both runs (max of the two errors); dg is split by gate convention.
_SHARED = ("y", "final_state", "dq", "dk", "dv", "dbeta", "dinitial_state")
# Outputs of the forward-only call through the other path, checked against y / final_state.
_OTHER_PATH = {"y_other_path": "y", "final_state_other_path": "final_state"}
# Inputs rounded to the tested dtype (the gate is rounded separately, per convention).
_ROUNDED_INPUTS = ("q", "k", "v", "beta", "dy", "dfinal_state")


def tolerance(dtype: str) -> float:
    """Relative L2 error a backend may reach at ``dtype``: float32 5e-5, bf16/fp16 2e-2."""
    return dtype_tolerance(dtype)


def relative_error(x, ref, scale=None) -> float:
    """``||x - ref||_2 / ||ref||_2`` in float64 (``||x||_2`` when ref is all zero); with
    ``scale`` (``ref``'s shape: the root sum of squares of the terms each entry sums) over
    ``max(||ref||_2, ||scale||_2)``: a sum's error against what its terms' rounding allows,
    however far it cancels (where it does not, ``||ref||_2`` is the larger).

    inf when x is None, has a different shape than ref, or holds NaN/inf. A non-finite ``ref``
    is a harness bug and raises ValueError.
    """
    ref = np.asarray(ref, dtype=np.float64)
    if not np.all(np.isfinite(ref)):
        raise ValueError("reference value is not finite")
    if x is None:
        return math.inf
    x = np.asarray(x, dtype=np.float64)
    if x.shape != ref.shape or not np.all(np.isfinite(x)):
        return math.inf
    ref_norm = float(np.linalg.norm(ref.ravel()))
    if scale is not None:
        ref_norm = max(ref_norm, float(np.linalg.norm(np.ravel(scale))))
    diff_norm = float(np.linalg.norm((x - ref).ravel()))
    return diff_norm / ref_norm if ref_norm > 0 else diff_norm


def round_to_dtype(x, dtype: str) -> np.ndarray | None:
    """Round float64 ``x`` to ``dtype`` (bfloat16 via ml_dtypes) and return it as float64.

    None passes through; -inf/inf/NaN are preserved.
    """
    if x is None:
        return None
    if dtype not in _NUMPY_DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_NUMPY_DTYPES)}, got {dtype!r}")
    return np.asarray(x, dtype=np.float64).astype(_NUMPY_DTYPES[dtype]).astype(np.float64)


def _error_rank(err: float) -> tuple[bool, float]:
    """Sort key for errors: NaN above everything, then by value."""
    return (math.isnan(err), 0.0 if math.isnan(err) else err)


@dataclass
class CaseResult:
    """Errors of one case at one dtype; ``errors`` maps quantity -> relative L2 error."""

    case: str
    dtype: str
    errors: dict[str, float] = field(default_factory=dict)
    tolerance: float = 0.0

    @property
    def passed(self) -> bool:
        """True when every error is <= tolerance (NaN fails)."""
        return all(err <= self.tolerance for err in self.errors.values())

    @property
    def worst(self) -> tuple[str, float]:
        """(quantity, error) with the largest error; NaN ranks above inf, ties go to the first."""
        if not self.errors:
            return ("", 0.0)
        return max(self.errors.items(), key=lambda item: _error_rank(item[1]))


def _resolve_runner(runner):
    if isinstance(runner, str):
        return runner_for(runner)
    return runner


# ------------------------------------------------------------------------------ runners

_NAMES = ("q", "k", "v", "g", "beta")
_GRADS = ("dq", "dk", "dv", "dg", "dbeta", "dinitial_state")


def _case_problem(inputs: dict, dtype: str):
    from gdngen.problem import Problem

    _, _, Hk, Dk = inputs["q"].shape
    _, _, Hv, Dv = inputs["v"].shape
    gate = "vector" if np.ndim(inputs["g"]) == 4 else "scalar"
    return Problem(int(Hk), int(Hv), int(Dk), int(Dv), dtype, gate)


def _case_variant(backend: str, inputs: dict, dtype: str, chunk_size: int, variant):
    """``variant``, or ``backend``'s default for the case's shape at ``chunk_size``."""
    if variant is not None:
        return variant
    from gdngen.variant import Variant

    base = registry.default_variant(backend, _case_problem(inputs, dtype))
    return Variant(backend, dict(base.as_dict(), chunk_size=chunk_size))


def _state_shape(inputs: dict) -> tuple:
    """``[B or N, Hv, Dv, Dk]``: the states of a case's call (N for a packed row)."""
    B, _, _, Dk = np.shape(inputs["q"])
    Hv, Dv = np.shape(inputs["v"])[2:]
    packed = inputs.get("cu_seqlens")
    return (B if packed is None else len(packed) - 1, Hv, Dv, Dk)


def _jax_runner(inputs, *, gate, dtype, scale, variant, other_path, states):
    import jax
    import jax.numpy as jnp

    from gdngen.jax import gated_delta

    jdt = jnp.dtype(dtype)
    args = [jnp.asarray(inputs[n], jdt) for n in _NAMES]
    S0 = inputs.get("initial_state")
    S0 = jnp.zeros(_state_shape(inputs), jnp.float32) if S0 is None else \
        jnp.asarray(S0, jnp.float32)
    mask = None if inputs.get("mask") is None else jnp.asarray(inputs["mask"])
    packed = {} if inputs.get("cu_seqlens") is None else \
        {"cu_seqlens": jnp.asarray(inputs["cu_seqlens"], jnp.int32)}

    def f(q, k, v, g, beta, s0):
        return gated_delta(q, k, v, g, beta, s0, mask=mask, scale=scale, gate=gate,
                           variant=variant, **packed)

    (y, S), vjp = jax.vjp(f, *args, S0)
    grads = vjp((jnp.asarray(inputs["dy"], jdt),
                 jnp.asarray(inputs["dfinal_state"], jnp.float32)))
    out = {"y": y, "final_state": S, **dict(zip(_GRADS, grads))}
    if other_path is not None:
        out["y_other_path"], out["final_state_other_path"] = gated_delta(
            *args, S0, mask=mask, scale=scale, gate=gate, variant=other_path)
    if states:
        out.update(_returned_states(gated_delta, args, S0, mask, scale=scale, gate=gate,
                                    variant=variant))
    return _float64(out, lambda x: np.asarray(x, np.float64))


def _returned_states(gated_delta, args, S0, mask, *, scale, gate, variant) -> dict:
    """``step_states`` of a ``return_states="steps"`` call over the first `STEP_WINDOW` steps
    and ``chunk_states`` of a ``return_states="chunks"`` call at ``checkpoint_every`` the
    variant's chunk (also returned), forward only."""
    W = min(int(args[0].shape[1]), STEP_WINDOW)
    every = int(variant.get("chunk_size", 64))
    window = None if mask is None else mask[:, :W]
    _, steps = gated_delta(*(a[:, :W] for a in args), S0, mask=window, scale=scale, gate=gate,
                           variant=variant, return_states="steps")
    _, chunks = gated_delta(*args, S0, mask=mask, scale=scale, gate=gate, variant=variant,
                            return_states="chunks", checkpoint_every=every)
    return {"step_states": steps, "chunk_states": chunks, "checkpoint_every": every}


def _float64(out: dict, convert) -> dict:
    """A runner's outputs as float64 NumPy arrays (``checkpoint_every`` stays an int)."""
    return {n: x if n == "checkpoint_every" else convert(x) for n, x in out.items()}


def _mlx_runner(inputs, *, gate, dtype, scale, variant, other_path, states):
    import mlx.core as mx

    from gdngen.mlx import gated_delta

    mdt = getattr(mx, dtype)
    args = [mx.array(np.asarray(inputs[n], np.float32)).astype(mdt) for n in _NAMES]
    S0 = inputs.get("initial_state")
    S0 = mx.zeros(_state_shape(inputs)) if S0 is None else mx.array(np.asarray(S0, np.float32))
    mask = None if inputs.get("mask") is None else mx.array(inputs["mask"])
    packed = {} if inputs.get("cu_seqlens") is None else \
        {"cu_seqlens": mx.array(np.asarray(inputs["cu_seqlens"], np.int32))}

    def f(q, k, v, g, beta, s0):
        return gated_delta(q, k, v, g, beta, s0, mask=mask, scale=scale, gate=gate,
                           variant=variant, **packed)

    cot = [mx.array(np.asarray(inputs["dy"], np.float32)).astype(mdt),
           mx.array(np.asarray(inputs["dfinal_state"], np.float32))]
    (y, S), grads = mx.vjp(f, args + [S0], cot)
    out = {"y": y, "final_state": S, **dict(zip(_GRADS, grads))}
    if other_path is not None:
        out["y_other_path"], out["final_state_other_path"] = gated_delta(
            *args, S0, mask=mask, scale=scale, gate=gate, variant=other_path)
    if states:
        out.update(_returned_states(gated_delta, args, S0, mask, scale=scale, gate=gate,
                                    variant=variant))
    return _float64(out, lambda x: np.asarray(x.astype(mx.float32), np.float64))


def _other_path(variant, T: int):
    """``variant`` forced onto the path of its recurrent switch that a call of ``T`` steps does
    not take (recurrent kernel at every T, or chunk kernels at every T); None for a backend
    without a switch."""
    below = variant.get("recurrent_below")
    if below is None:
        return None
    return variant.replace(recurrent_below=0 if T < below else RECURRENT_ALWAYS)


def runner_for(backend: str):
    """The battery runner of ``backend`` (protocol in docs/CONTRACT.md): forward + VJP through
    its framework's ``gated_delta`` with ``variant``, else the backend's default variant for the
    case's shape at the case's ``chunk_size``; and a forward-only call through the path of the
    variant's recurrent switch the first call did not take (``y_other_path``,
    ``final_state_other_path``; `_other_path`); with ``states`` (dense cases) the returned
    states too (`_returned_states`)."""
    spec = registry.get(backend)
    run = _jax_runner if spec.framework == "jax" else _mlx_runner

    def runner(inputs, *, gate, dtype, chunk_size, scale, variant=None, states=True):
        from gdngen import dispatch

        chosen = _case_variant(backend, inputs, dtype, chunk_size, variant)
        # a packed row always walks chunks (`gdngen.algebra.packed`): no recurrent path to check
        packed = inputs.get("cu_seqlens") is not None
        T = np.shape(inputs["q"])[1]
        with dispatch.ungated():  # the battery is the check: its calls run the kernels as given
            return run(inputs, gate=gate, dtype=dtype, scale=scale, variant=chosen,
                       other_path=None if packed else _other_path(chosen, T),
                       states=states and not packed)

    runner.backend = backend
    runner.returns_states = True
    return runner


def _resolve_case(case) -> Case:
    return cases_mod.get_case(case) if isinstance(case, str) else case


def _copy_inputs(inputs: dict) -> dict:
    return {key: (None if val is None else np.array(val)) for key, val in inputs.items()}


def check_case(runner, case, *, dtype="float32", seed=None, chunk_size=None,
               variant=None, precision="ieee", gates=("log", "linear")) -> CaseResult:
    """Run ``runner`` (callable or backend name) on ``case`` (Case or name) at ``dtype``.

    Inputs q, k, v, beta, dy, dfinal_state and the gate are rounded to ``dtype``;
    initial_state is rounded to float32. Both the runner and the reference see exactly these
    values (the runner gets its own copies). ``chunk_size`` overrides ``case.chunk_size``.
    dinitial_state is skipped when the case has no initial state and the runner returns None
    for it. A ``variant`` (`gdngen.Variant`) is passed on to the runner, whose chunk it sets;
    the case's tolerance is then `gdngen.tolerance.allowed_error` of the variant at ``dtype``
    under policy ``precision`` (else the dtype's battery tolerance). ``gates``: the gate
    conventions run (a first-use check runs its call's only, `gdngen.firstuse`).
    """
    from gdngen.algebra import reference

    runner = _resolve_runner(runner)
    case = _resolve_case(case)
    tol = tolerance(dtype) if variant is None else allowed_error(variant, dtype, precision)
    raw = case.inputs(seed)
    base = {name: round_to_dtype(raw[name], dtype) for name in _ROUNDED_INPUTS}
    base["initial_state"] = round_to_dtype(raw["initial_state"], "float32")
    base["mask"] = raw["mask"]
    if not gates or not set(gates) <= {"log", "linear"}:
        raise ValueError(f"gates must name 'log' and/or 'linear', got {gates!r}")
    drawn = {"log": lambda: round_to_dtype(raw["g_log"], dtype),
             "linear": lambda: round_to_dtype(np.exp(raw["g_log"]), dtype)}
    gates = {name: drawn[name]() for name in gates}

    per_gate: dict[str, dict[str, float]] = {}
    base["cu_seqlens"] = raw["cu_seqlens"]
    for gate, g in gates.items():
        arrays = (base["q"], base["k"], base["v"], g, base["beta"], base["initial_state"],
                  base["dy"], base["dfinal_state"])
        if base["cu_seqlens"] is None:
            ref = reference.vjp(*arrays, mask=base["mask"], scale=case.scale, gate=gate,
                                steps=True)
        else:
            ref = reference.packed_vjp(*arrays, base["cu_seqlens"], mask=base["mask"],
                                       scale=case.scale, gate=gate)
        extra = {} if variant is None else {"variant": variant}
        if getattr(runner, "returns_states", False):  # `runner_for`'s: asked per case
            extra["states"] = case.states and gate == next(iter(gates))
        out = runner(_copy_inputs(dict(base, g=g)), gate=gate, dtype=dtype,
                     chunk_size=chunk_size or case.chunk_size, scale=case.scale, **extra)
        if base["cu_seqlens"] is None:
            ref.update(_reference_states(ref.pop("states"), out))
        errors = {}
        for name in _SHARED + ("dg",):
            if (name == "dinitial_state" and base["initial_state"] is None
                    and out.get(name) is None):
                continue
            errors[name] = relative_error(out.get(name), ref[name])
        for name, of in _OTHER_PATH.items():
            if name in out:
                errors[name] = relative_error(out[name], ref[of])
        for name in STATE_QUANTITIES:
            if name in out:
                errors[name] = relative_error(out[name], ref[name])
        per_gate[gate] = errors

    errors = {}
    for name in QUANTITIES + OTHER_PATH_QUANTITIES + STATE_QUANTITIES:
        if name == "dg":
            values = [per_gate.get("log", {}).get("dg")]
        elif name == "dg_linear":
            values = [per_gate.get("linear", {}).get("dg")]
        else:
            values = [per_gate[gate].get(name) for gate in gates]
        values = [v for v in values if v is not None]
        if values:
            errors[name] = max(values, key=_error_rank)
    return CaseResult(case=case.name, dtype=dtype, errors=errors, tolerance=tol)


def _reference_states(steps, out: dict) -> dict:
    """The float64 states the runner's ``step_states`` (its first steps) and ``chunk_states``
    (at ``out["checkpoint_every"]``, then the final one) stand for, from the reference's state
    after every step ``steps`` [B,T,Hv,Dv,Dk]."""
    T = steps.shape[1]
    refs = {}
    if "step_states" in out:
        refs["step_states"] = steps[:, :np.shape(out["step_states"])[1]]
    if "chunk_states" in out:
        every = int(out["checkpoint_every"])
        refs["chunk_states"] = steps[:, [t - 1 for t in range(every, T, every)] + [T - 1]]
    return refs


def run_battery(runner, *, dtype="float32", cases=None, seed=None, chunk_size=None,
                variant=None, precision="ieee") -> list[CaseResult]:
    """`check_case` over ``cases`` (Cases or names; default the whole `BATTERY`).

    With a ``variant``, ``runner`` may be None (the variant's backend runner is used), and
    vector-gate cases are left out for backends that only implement scalar gates.
    """
    if runner is None:
        if variant is None:
            raise ValueError("run_battery needs a runner or a variant")
        runner = variant.backend
    runner = _resolve_runner(runner)
    selected = BATTERY if cases is None else [_resolve_case(c) for c in cases]
    if variant is not None and "vector" not in registry.get(variant.backend).gates:
        selected = [case for case in selected if not case.vector_gate]
    return [check_case(runner, case, dtype=dtype, seed=seed, chunk_size=chunk_size,
                       variant=variant, precision=precision) for case in selected]


def _format_error(err: float | None) -> str:
    return "-" if err is None else f"{err:.1e}"


def format_table(results) -> str:
    """One row per result: case, dtype, an error per quantity, worst quantity, PASS/FAIL.

    Rendered with rich as plain text (no ANSI codes).
    """
    from gdngen.tables import render_table

    header = ["case", "dtype", *QUANTITIES, "worst", "result"]
    rows = []
    for res in results:
        worst_name, worst_err = res.worst
        rows.append([res.case, res.dtype, *(_format_error(res.errors.get(q)) for q in QUANTITIES),
                     f"{worst_name} {_format_error(worst_err)}",
                     "PASS" if res.passed else "FAIL"])
    return render_table("gated delta battery vs float64 reference", header, rows, width=250,
                        right=[*QUANTITIES, "result"])


def _json_float(x: float):
    """Finite floats as is; inf/nan as the strings "inf", "-inf", "nan" (valid JSON)."""
    return x if math.isfinite(x) else str(x)


def results_to_json(results) -> list[dict]:
    """JSON-serialisable dicts: case, dtype, tolerance, passed, worst {quantity, error}, errors.

    Non-finite errors become the strings "inf"/"nan".
    """
    out = []
    for res in results:
        worst_name, worst_err = res.worst
        out.append({"case": res.case, "dtype": res.dtype, "tolerance": res.tolerance,
                    "passed": res.passed,
                    "worst": {"quantity": worst_name, "error": _json_float(worst_err)},
                    "errors": {q: _json_float(e) for q, e in res.errors.items()}})
    json.dumps(out)  # fail here, not in the caller, if something is not serialisable
    return out


# ------------------------------------------------------------------------------ fused inputs

#: the quantities of `check_fused_case` (gradients of the raw layer inputs)
FUSED_QUANTITIES = ("y", "final_state", "dq", "dk", "dv", "dg", "dbeta", "dinitial_state",
                    "dA_log", "ddt_bias", "dconv_weight", "dconv_state", "dnorm_weight",
                    "doutput_gate")
#: the causal conv's kernel size in a fused check with ``conv`` (the mixers' K)
FUSED_CONV_SIZE = 4
#: the gated norm's epsilon in a fused check with ``norm`` (the mixers')
NORM_EPS = 1e-6


def _conv64(x, w, state):
    """Float64 causal depthwise conv + SiLU (`gdngen.algebra.mixer.conv`) of ``x [B, T, C]``
    with ``w [C, K]`` and ``state [B, C, K-1]``, and its pullback ``dh -> (dx, dw, dstate)``."""
    from gdngen.algebra import reference

    T, K = x.shape[1], w.shape[1]
    window = np.concatenate([np.swapaxes(state, 1, 2), x], axis=1)  # [B, K-1+T, C]
    pre = sum(w[:, j] * window[:, j:j + T] for j in range(K))
    sig = reference.sigmoid(pre)

    def pullback(dh):
        dpre = dh * (sig * (1.0 + pre * (1.0 - sig)))
        dwindow = np.zeros_like(window)
        for j in range(K):
            dwindow[:, j:j + T] += dpre * w[:, j]
        dw = np.stack([(dpre * window[:, j:j + T]).sum(axis=(0, 1)) for j in range(K)], 1)
        return dwindow[:, K - 1:], dw, np.swapaxes(dwindow[:, :K - 1], 1, 2)

    return pre * sig, pullback


def check_fused_case(variant, case, *, qk_norm: bool, gate_form: str | None,
                     lower_bound: float | None = None, dtype: str = "float32",
                     precision: str = "ieee", seed=None, conv: bool = False,
                     norm: str | None = None) -> CaseResult:
    """``case`` through ``variant`` as a layer calls it with the inputs its kernels compute
    (`gdngen.backend.Backend.fused_inputs`): raw q, k with ``qk_norm``; with ``gate_form``
    ("softplus" / "sigmoid_bound") the raw projection ``a`` and ``A_log``, ``dt_bias``
    (``[Hv]``; per-channel ``[Hv, 1]`` and ``[Hv, Dk]``; A_log up to 2); with ``conv`` raw q,
    k, v before the causal conv + SiLU, ``conv_weight [C, 4]`` and ``conv_state [B, C, 3]``
    (the mixer's layout); with ``norm`` (the activation) the output's gated RMSNorm,
    ``norm_weight [Dv]`` and ``output_gate [B, T, Hv, Dv]``, whose value is the call's
    undifferentiated output (the kernel computing it in its stores) and whose gradients come
    from the differentiated call. Values and every gradient (of the raw arrays) against the
    float64 composition (`_conv64`, `gdngen.algebra.reference.LayerInputsVJP`,
    `gdngen.algebra.reference.vjp`, `gdngen.algebra.mixer.gated_norm_reference`), and the
    values of a forward-only call through the other side of the variant's recurrent switch
    (``y_other_path``, ``final_state_other_path``: the chunk forward's fused build where the
    case is short). dg, dA_log, ddt_bias are measured against their terms' size too
    (`relative_error`'s ``scale``)."""
    from gdngen.algebra import reference

    raw = case.inputs(seed)
    rng = np.random.default_rng(None if seed is None else seed + 1)
    x = {name: round_to_dtype(raw[name], dtype) for name in _ROUNDED_INPUTS}
    x["initial_state"] = np.zeros(_state_shape(raw)) if raw["initial_state"] is None \
        else round_to_dtype(raw["initial_state"], "float32")
    x["mask"] = raw["mask"]
    if qk_norm:  # raw: norms far from 1
        x["q"], x["k"] = (round_to_dtype(raw[n] * rng.uniform(0.3, 3.0, raw[n].shape[:-1] + (1,)),
                                         dtype) for n in ("q", "k"))
    Hv, Dk = case.Hv, case.Dk
    params = {}
    if gate_form is None:
        x["g"] = round_to_dtype(raw["g_log"], dtype)
        g_log = x["g"]
    else:
        shape = raw["g_log"].shape
        x["g"] = round_to_dtype(rng.standard_normal(shape) * 2.0, dtype)
        params = {"A_log": rng.uniform(-1.0, 2.0, (Hv, 1) if case.vector_gate else (Hv,)),
                  "dt_bias": rng.uniform(-0.5, 0.5, (Hv, Dk) if case.vector_gate else (Hv,))}
        lower_bound = -5.0 if gate_form == "sigmoid_bound" and lower_bound is None \
            else lower_bound
        layer = reference.LayerInputsVJP(x["q"], x["k"], x["g"], np.zeros_like(x["beta"]),
                                         params["A_log"], params["dt_bias"], gate_form,
                                         lower_bound)
        g_log = layer.log_g
    h = {n: x[n] for n in ("q", "k", "v")}  # the recurrence's q, k, v before the norm
    if conv:
        B, T = x["v"].shape[:2]
        widths = [case.Hk * case.Dk, case.Hk * case.Dk, case.Hv * case.Dv]
        C = sum(widths)
        params["conv_weight"] = 0.5 * rng.standard_normal((C, FUSED_CONV_SIZE))
        params["conv_state"] = rng.standard_normal((B, C, FUSED_CONV_SIZE - 1))
        keep = np.ones((B, T), bool) if x["mask"] is None else np.asarray(x["mask"], bool)
        # the call zeroes masked steps' raw inputs: a zero in the windows after them
        raw_row = np.concatenate([np.where(keep[..., None], x[n].reshape(B, T, -1), 0.0)
                                  for n in ("q", "k", "v")], axis=-1)
        h_row, conv_pullback = _conv64(raw_row, params["conv_weight"], params["conv_state"])
        h = dict(zip(("q", "k", "v"), (part.reshape(x[n].shape) for n, part in zip(
            ("q", "k", "v"), np.split(h_row, np.cumsum(widths)[:2], axis=-1)))))
    q, k = (reference.l2_normalize(h[n])[0] for n in ("q", "k")) if qk_norm else (h["q"], h["k"])
    dy, normed = x["dy"], None
    if norm is not None:  # y's cotangent through the float64 norm, at the float64 y
        from gdngen.algebra.mixer import gated_norm_reference

        params["norm_weight"] = 1.0 + 0.1 * rng.standard_normal(case.Dv)
        params["output_gate"] = rng.standard_normal(x["v"].shape)
        y64 = reference.vjp(q, k, h["v"], g_log, x["beta"], x["initial_state"], None, None,
                            mask=x["mask"], scale=case.scale, gate="log")["y"]
        nargs = (y64, params["output_gate"], params["norm_weight"], NORM_EPS, norm)
        dy, normed = gated_norm_reference(*nargs, x["dy"])
        normed.update(y=gated_norm_reference(*nargs, None)[0])
    ref = reference.vjp(q, k, h["v"], g_log, x["beta"], x["initial_state"], dy,
                        x["dfinal_state"], mask=x["mask"], scale=case.scale, gate="log",
                        dg_scale=True)
    if normed is not None:
        ref.update(y=normed["y"], dnorm_weight=normed["dnorm_weight"],
                   doutput_gate=normed["dz"])
    if qk_norm:
        for n in ("q", "k"):
            xn, r = reference.l2_normalize(h[n])
            ref["d" + n] = reference.l2_normalize_vjp(xn, r, ref["d" + n])
    if conv:
        dh = np.concatenate([ref["d" + n].reshape(B, T, -1) for n in ("q", "k", "v")], axis=-1)
        draw, ref["dconv_weight"], ref["dconv_state"] = conv_pullback(dh)
        draw = np.where(keep[..., None], draw, 0.0)
        for n, part in zip(("q", "k", "v"), np.split(draw, np.cumsum(widths)[:2], axis=-1)):
            ref["d" + n] = part.reshape(x[n].shape)
    # dg, dA_log, ddt_bias also against their terms' size: sums that can cancel far below
    # them (identical keys, beta = 1, a strong fused gate: dg ~ 1e-7 from O(1) terms)
    scales = {"dg": ref.pop("dg_scale")}
    if gate_form is not None:
        scales = layer.reduction_scales(scales["dg"])
        chained = layer.grads(dict(ref, dbeta=np.zeros_like(ref["dbeta"])))
        ref.update(dg=chained["dg"], dA_log=chained["dA_log"], ddt_bias=chained["ddt_bias"])
    options = {"qk_norm": qk_norm, "scale": case.scale}
    if norm is not None:
        options.update(norm_gate=norm, norm_eps=NORM_EPS)
    if gate_form is not None:
        options.update(gate=gate_form, lower_bound=lower_bound)
    spec = registry.get(variant.backend)
    run = _fused_jax if spec.framework == "jax" else _fused_mlx
    from gdngen import dispatch

    with dispatch.ungated():
        out = run(x, params, options, variant, dtype,
                  _other_path(variant, np.shape(x["q"])[1]))
    errors = {name: relative_error(out.get(name), ref[name], scales.get(name))
              for name in FUSED_QUANTITIES
              if name in ref and (name in out or name not in ("dA_log", "ddt_bias"))}
    errors.update({name: relative_error(out[name], ref[_OTHER_PATH[name]])
                   for name in OTHER_PATH_QUANTITIES if name in out})
    if conv and not {"dconv_weight", "dconv_state"} <= set(errors):
        raise AssertionError("a conv check must compare dconv_weight and dconv_state")
    if norm and not {"dnorm_weight", "doutput_gate"} <= set(errors):
        raise AssertionError("a norm check must compare dnorm_weight and doutput_gate")
    return CaseResult(case=case.name, dtype=dtype, errors=errors,
                      tolerance=allowed_error(variant, dtype, precision))


_FUSED_NAMES = ("q", "k", "v", "g", "beta", "initial_state")
_FUSED_GRADS = ("dq", "dk", "dv", "dg", "dbeta", "dinitial_state")


def _fused_grads(params: dict) -> tuple:
    """The names of a fused call's gradients: the arrays', then each of ``params``' (A_log,
    dt_bias, conv_weight, conv_state, in their order there)."""
    return _FUSED_GRADS + tuple(f"d{name}" for name in params)


def _fused_jax(x, params, options, variant, dtype, other_path=None):
    import jax
    import jax.numpy as jnp

    from gdngen.jax import gated_delta

    args = [jnp.asarray(x[n], jnp.float32 if n == "initial_state" else dtype)
            for n in _FUSED_NAMES] + [jnp.asarray(params[n], jnp.float32) for n in params]
    mask = None if x["mask"] is None else jnp.asarray(x["mask"])

    def f(q, k, v, g, beta, s0, *p):
        return gated_delta(q, k, v, g, beta, s0, mask=mask, variant=variant,
                           **dict(zip(params, p)), **options)

    (y, s), pullback = jax.vjp(f, *args)
    grads = pullback((jnp.asarray(x["dy"], dtype), jnp.asarray(x["dfinal_state"], jnp.float32)))
    if "norm_weight" in params:  # the undifferentiated call's output (a kernel's norm)
        y, s = f(*args)
    out = {"y": y, "final_state": s, **dict(zip(_fused_grads(params), grads))}
    if other_path is not None:  # forward only, through the other side of the switch
        out["y_other_path"], out["final_state_other_path"] = gated_delta(
            *args[:6], mask=mask, variant=other_path, **dict(zip(params, args[6:])), **options)
    return {n: np.asarray(v, np.float64) for n, v in out.items()}


def _fused_mlx(x, params, options, variant, dtype, other_path=None):
    import mlx.core as mx

    from gdngen.mlx import gated_delta

    mdt = getattr(mx, dtype)
    args = [mx.array(np.asarray(x[n], np.float32)).astype(
        mx.float32 if n == "initial_state" else mdt) for n in _FUSED_NAMES] + \
        [mx.array(np.asarray(params[n], np.float32)) for n in params]
    mask = None if x["mask"] is None else mx.array(x["mask"])

    def f(q, k, v, g, beta, s0, *p):
        return gated_delta(q, k, v, g, beta, s0, mask=mask, variant=variant,
                           **dict(zip(params, p)), **options)

    cot = [mx.array(np.asarray(x["dy"], np.float32)).astype(mdt),
           mx.array(np.asarray(x["dfinal_state"], np.float32))]
    (y, s), grads = mx.vjp(lambda *a: f(*a), args, cot)
    out = {"y": y, "final_state": s, **dict(zip(_fused_grads(params), grads))}
    if other_path is not None:  # forward only, through the other side of the switch
        out["y_other_path"], out["final_state_other_path"] = gated_delta(
            *args[:6], mask=mask, variant=other_path, **dict(zip(params, args[6:])), **options)
    return {n: np.asarray(v.astype(mx.float32), np.float64) for n, v in out.items()}
