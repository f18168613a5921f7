"""Every dotted ``gdngen.*`` name in the package's code and docstrings, the README and docs/
and the kernel templates names something that exists (a module, or an attribute or dataclass
field of one), so a rename cannot leave a stale reference behind."""

from __future__ import annotations

import dataclasses
import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
#: ``gdngen.a.b`` not preceded by a word character, dot, dash or slash (paths, package names)
REFERENCE = re.compile(r"(?<![\w.\-/])gdngen(?:\.[A-Za-z_]\w*)+")


def scanned() -> list[Path]:
    return sorted([*ROOT.glob("gdngen/**/*.py"), *ROOT.glob("gdngen/**/*.j2"),
                   ROOT / "README.md", *ROOT.glob("docs/*.md")])


def resolves(reference: str) -> bool:
    """Whether ``reference`` (``gdngen.x.y``) names a module, or an attribute / dataclass field
    reached from the longest importable module prefix."""
    parts = reference.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for name in parts[i:]:
            if hasattr(obj, name):
                obj = getattr(obj, name)
            elif dataclasses.is_dataclass(obj) and name in obj.__dataclass_fields__:
                obj = obj.__dataclass_fields__[name].type
            elif hasattr(obj, "__path__"):  # a package's submodule not imported yet
                try:
                    obj = importlib.import_module(f"{obj.__name__}.{name}")
                except ImportError:
                    return False
            else:
                return False
        return True
    return False


def test_the_resolver_tells_real_names_from_stale_ones():
    assert resolves("gdngen.entry.bind") and resolves("gdngen.devices.Device.kind")
    assert resolves("gdngen.backends.metal.sim")
    assert not resolves("gdngen.chunkwise.straddle_sum")  # moved to gdngen.algebra
    assert not resolves("gdngen.dispatch.call")


def test_every_dotted_reference_resolves():
    pytest.importorskip("jax")
    pytest.importorskip("mlx")
    stale = []
    for path in scanned():
        for number, line in enumerate(path.read_text().splitlines(), 1):
            for match in REFERENCE.finditer(line):
                if not resolves(match.group(0)):
                    stale.append(f"{path.relative_to(ROOT)}:{number}: {match.group(0)}")
    assert not stale, "\n".join(stale)
