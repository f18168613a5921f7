"""The module scan both drop-ins patch with: every global bound to a library's function is
rebound to gdngen's (aliases too), and put back on unpatch."""

from __future__ import annotations

from types import ModuleType


def rebind(modules, original, replacement) -> list[tuple[ModuleType, str]]:
    """Bind ``replacement`` in place of every global of ``modules`` bound to ``original``;
    return the ``(module, name)`` pairs changed."""
    replaced = []
    for module in modules:
        for name, value in list(vars(module).items()):
            if value is original:
                setattr(module, name, replacement)
                replaced.append((module, name))
    return replaced


def restore(replaced, original) -> None:
    """Bind ``original`` again at every ``(module, name)`` of `rebind`'s result."""
    for module, name in replaced:
        setattr(module, name, original)
