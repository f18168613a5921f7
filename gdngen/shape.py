"""The shape of one gated-delta call (`CallShape`), checked before any backend runs.

`check_call` validates the arguments shared by every framework's ``gated_delta`` and returns a
`CallShape` describing them. Errors are ``ValueError``s that name the argument, its shape and the
expected shape, so model code fails at the call site rather than inside a kernel.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from gdngen.algebra import layer_inputs

#: the frameworks with a ``gated_delta`` entry point (`gdngen.jax`, `gdngen.mlx`).
FRAMEWORKS = ("jax", "mlx")
GATES = ("log", "linear")
FLOAT_DTYPES = ("float32", "bfloat16", "float16")
MIN_HEAD_DIM, MAX_HEAD_DIM = 16, 256


@dataclass(frozen=True)
class CallShape:
    """Sizes of one call: batch B, length T, key heads Hk, value heads Hv, head dims Dk, Dv."""

    B: int
    T: int
    Hk: int
    Hv: int
    Dk: int
    Dv: int
    vector_gate: bool
    #: N, the number of packed sequences of a ``cu_seqlens`` call (`gdngen.algebra.packed`),
    #: else None
    sequences: int | None = None

    @property
    def group(self) -> int:
        """Value heads per key head (Hv / Hk); value head h reads key head h // group."""
        return self.Hv // self.Hk


def check_framework(framework: str) -> None:
    """ValueError unless ``framework`` is one of `FRAMEWORKS`."""
    if framework not in FRAMEWORKS:
        raise ValueError(f"framework must be one of {FRAMEWORKS}, got {framework!r}")


def dtype_name(x) -> str:
    """Framework-neutral dtype name of an array (``"float32"``, ``"bfloat16"``, ``"bool"`` ...)."""
    dtype = getattr(x, "dtype", None)
    if dtype is None:
        return type(x).__name__
    name = _DTYPE_NAMES.get(dtype)  # dtype objects (jax, mlx, numpy) are hashable
    if name is None:
        name = _DTYPE_NAMES[dtype] = str(dtype).replace("mlx.core.", "")
    return name


_DTYPE_NAMES: dict = {}  # dtype object -> name: a decode-length call asks a dozen times


def _shape_error(name: str, x, expected: str, why: str = "") -> ValueError:
    extra = f" ({why})" if why else ""
    return ValueError(f"{name} has shape {tuple(x.shape)}, expected {expected}{extra}")


def _concrete(x):
    """``x`` as a NumPy array when its values are known here (not a tracer), else None."""
    try:
        return np.asarray(x)
    except TypeError:  # a JAX tracer (under jit / vmap): checked where it is concrete
        return None


def check_cu_seqlens(cu_seqlens, B: int, T: int) -> int:
    """Check the offsets of a packed call (`gdngen.algebra.packed`: fla's ``cu_seqlens``); return N,
    the number of sequences.

    ValueError naming ``cu_seqlens`` and what was expected: not a 1-D int32 array of at least
    two entries, B != 1, and, whenever its values are concrete, not starting at 0, decreasing,
    or not ending at T."""
    if not hasattr(cu_seqlens, "shape") or not hasattr(cu_seqlens, "dtype"):
        raise ValueError("cu_seqlens must be an int32 array [N+1] of sequence offsets, got "
                         f"{type(cu_seqlens).__name__}")
    if len(cu_seqlens.shape) != 1 or int(cu_seqlens.shape[0]) < 2:
        raise ValueError(f"cu_seqlens has shape {tuple(cu_seqlens.shape)}, expected [N+1] "
                         "with N >= 1 (1-D offsets)")
    if dtype_name(cu_seqlens) != "int32":
        raise ValueError(f"cu_seqlens has dtype {dtype_name(cu_seqlens)}, expected int32")
    if B != 1:
        raise ValueError(f"cu_seqlens needs the packed sequences in one row (B == 1), got "
                         f"B={B}")
    values = _concrete(cu_seqlens)
    if values is not None:
        if int(values[0]) != 0:
            raise ValueError(f"cu_seqlens must start at 0, got cu_seqlens[0]={int(values[0])}")
        steps = np.diff(values)
        if (steps < 0).any():
            at = int(np.argmax(steps < 0))
            raise ValueError(f"cu_seqlens must be non-decreasing, got cu_seqlens[{at}]="
                             f"{int(values[at])} > cu_seqlens[{at + 1}]={int(values[at + 1])}")
        if int(values[-1]) != T:
            raise ValueError(f"cu_seqlens must end at T={T}, got cu_seqlens[-1]="
                             f"{int(values[-1])}")
    return int(cu_seqlens.shape[0]) - 1


def check_call(q, k, v, g, beta, initial_state=None, mask=None, *, gate="log", chunk_size=64,
               scale=1.0, cu_seqlens=None) -> CallShape:
    """`check_call_once`, remembered per shapes, dtypes and options when ``cu_seqlens`` is None
    (then nothing it checks depends on values): a decode loop pays for the checks once.
    ``gate`` may be a `gdngen.algebra.layer_inputs.ParameterGate` with ``g`` its ``(a, A_log,
    dt_bias)``:
    ``a`` is checked as a log gate (the parameters are `gdngen.algebra.layer_inputs`' to check)."""
    g, gate = layer_inputs.raw_gates(g), layer_inputs.convention(gate)
    if cu_seqlens is not None:
        return check_call_once(q, k, v, g, beta, initial_state, mask, gate=gate,
                               chunk_size=chunk_size, scale=scale, cu_seqlens=cu_seqlens)
    key = (gate, chunk_size, type(chunk_size), type(scale),
           tuple(None if x is None else (tuple(x.shape), dtype_name(x))
                 for x in (q, k, v, g, beta, initial_state, mask)))
    try:
        shape = _CHECKED.get(key)
    except TypeError:  # an unhashable option: the checks name it
        return check_call_once(q, k, v, g, beta, initial_state, mask, gate=gate,
                               chunk_size=chunk_size, scale=scale)
    if shape is None:  # raises unless every check passes; nothing remembered then
        shape = check_call_once(q, k, v, g, beta, initial_state, mask, gate=gate,
                                chunk_size=chunk_size, scale=scale)
        if len(_CHECKED) < 4096:
            _CHECKED[key] = shape
    return shape


_CHECKED: dict = {}  # check_call's key -> CallShape of a call that passed every check


def check_call_once(q, k, v, g, beta, initial_state=None, mask=None, *, gate="log",
                    chunk_size=64, scale=1.0, cu_seqlens=None) -> CallShape:
    """Check shapes, dtypes and options of a ``gated_delta`` call; return its `CallShape`.

    q, k ``[B,T,Hk,Dk]``; v ``[B,T,Hv,Dv]`` with Hv a multiple of Hk; g ``[B,T,Hv]`` or
    ``[B,T,Hv,Dk]``; beta ``[B,T,Hv]``; initial_state ``[B,Hv,Dv,Dk]``; mask ``[B,T]`` bool.
    With ``cu_seqlens`` (`check_cu_seqlens`: int32 ``[N+1]``, B = 1)
    initial_state is ``[N,Hv,Dv,Dk]``, one per sequence.
    """
    if gate not in GATES:
        raise ValueError(f"gate must be one of {GATES}, got {gate!r}")
    if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
    if not isinstance(scale, (int, float)) or isinstance(scale, bool):
        raise TypeError(f"scale must be a Python float, got {type(scale).__name__}")
    for name, x in (("q", q), ("k", k), ("v", v)):
        if len(x.shape) != 4:
            dims = "[B,T,Hk,Dk]" if name != "v" else "[B,T,Hv,Dv]"
            raise _shape_error(name, x, dims, "4-D")
    B, T, Hk, Dk = (int(s) for s in q.shape)
    if T < 1:
        raise _shape_error("q", q, "[B,T,Hk,Dk] with T >= 1")
    if tuple(k.shape) != tuple(q.shape):
        raise _shape_error("k", k, f"{tuple(q.shape)} (same as q)")
    if int(v.shape[0]) != B or int(v.shape[1]) != T:
        raise _shape_error("v", v, f"({B}, {T}, Hv, Dv)")
    Hv, Dv = int(v.shape[2]), int(v.shape[3])
    if Hv % Hk:
        raise _shape_error("v", v, f"({B}, {T}, Hv, Dv) with Hv a multiple of Hk={Hk}")
    for name, d in (("q", Dk), ("v", Dv)):
        if not MIN_HEAD_DIM <= d <= MAX_HEAD_DIM:
            x = q if name == "q" else v
            raise _shape_error(name, x, f"head dim in {MIN_HEAD_DIM}..{MAX_HEAD_DIM}")
    if tuple(beta.shape) != (B, T, Hv):
        raise _shape_error("beta", beta, f"({B}, {T}, {Hv})")
    if tuple(g.shape) == (B, T, Hv):
        vector_gate = False
    elif tuple(g.shape) == (B, T, Hv, Dk):
        vector_gate = True
    else:
        raise _shape_error("g", g, f"({B}, {T}, {Hv}) or ({B}, {T}, {Hv}, {Dk})")
    sequences = None
    if cu_seqlens is not None:
        sequences = check_cu_seqlens(cu_seqlens, B, T)
    states = B if sequences is None else sequences
    if initial_state is not None and tuple(initial_state.shape) != (states, Hv, Dv, Dk):
        raise _shape_error("initial_state", initial_state, f"({states}, {Hv}, {Dv}, {Dk})",
                           "" if sequences is None else
                           f"one state per sequence of cu_seqlens, N={sequences}")
    if mask is not None:
        if tuple(mask.shape) != (B, T):
            raise _shape_error("mask", mask, f"({B}, {T})")
        if dtype_name(mask) != "bool":
            raise ValueError(f"mask has dtype {dtype_name(mask)}, expected bool")
    for name, x in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        if dtype_name(x) not in FLOAT_DTYPES:
            raise ValueError(f"{name} has dtype {dtype_name(x)}, expected one of {FLOAT_DTYPES}")
    if initial_state is not None and dtype_name(initial_state) not in FLOAT_DTYPES:
        raise ValueError(f"initial_state has dtype {dtype_name(initial_state)}, expected float32")
    return CallShape(B, T, Hk, Hv, Dk, Dv, vector_gate, sequences)
