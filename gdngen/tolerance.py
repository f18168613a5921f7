"""The one validation rule: the relative L2 error a variant may reach against the float64
reference, used alike by ``gdngen validate``, ``gdngen build`` and ``gdngen tune``.

``allowed_error(variant, dtype, precision)`` is the larger of

* the battery's tolerance for the input ``dtype`` (`DTYPE_TOLERANCES`: float32 5e-5, 16-bit
  inputs 2e-2), and
* the backend's tolerance (its `BackendSpec.tolerances`, measured per backend) for the precision
  the variant computes at: its own ``precision`` parameter if it has one, else the policy
  ``precision`` the call runs under.
"""

from __future__ import annotations

from gdngen import precision as precision_mod
from gdngen import registry
from gdngen.variant import Variant

DTYPE_TOLERANCES = {"float32": 5e-5, "bfloat16": 2e-2, "float16": 2e-2}


def dtype_tolerance(dtype: str) -> float:
    """The battery's tolerance for input ``dtype``."""
    try:
        return DTYPE_TOLERANCES[dtype]
    except KeyError:
        raise ValueError(f"dtype must be one of {sorted(DTYPE_TOLERANCES)}, got {dtype!r}") \
            from None


def effective_precision(variant: Variant, precision: str = "ieee") -> str:
    """The precision ``variant`` computes at under policy ``precision``."""
    precision_mod.check(precision)
    own = variant.get("precision")
    return precision if own is None else own


def allowed_error(variant: Variant, dtype: str, precision: str = "ieee") -> float:
    """Relative L2 error ``variant`` may reach at input ``dtype`` under policy ``precision``."""
    spec = registry.get(variant.backend)
    return max(dtype_tolerance(dtype), spec.tolerances[effective_precision(variant, precision)])


def table(dtypes=("float32", "bfloat16", "float16")) -> list[tuple]:
    """``(backend, precision, dtype, allowed error)`` for every registered backend."""
    rows = []
    for name in registry.names():
        spec = registry.get(name)
        for policy in precision_mod.PRECISIONS:
            for dtype in dtypes:
                if dtype in spec.dtypes:
                    rows.append((name, policy, dtype,
                                 max(dtype_tolerance(dtype), spec.tolerances[policy])))
    return rows
