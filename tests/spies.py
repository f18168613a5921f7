"""Spies for tests that check which path a call took."""

from __future__ import annotations


def spy_calls(monkeypatch, module, names) -> list:
    """Replace each function ``module.<name>`` of ``names`` by one that records its name, in
    call order, in the returned list, then calls the original. Forgets the compiled steps of
    eager JAX calls (`gdngen.eager`), which would otherwise skip the spied Python."""
    from gdngen import eager

    eager.clear()
    ran = []
    for name in names:
        original = getattr(module, name)

        def spy(*args, _name=name, _original=original, **kwargs):
            ran.append(_name)
            return _original(*args, **kwargs)

        monkeypatch.setattr(module, name, spy)
    return ran
