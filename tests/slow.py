"""Test helper: parametrize values with some marked ``slow`` (left to ``make test-all``)."""

from __future__ import annotations

import pytest


def marked(values, slow) -> list:
    """``values`` for ``pytest.mark.parametrize``, those in ``slow`` wrapped in ``pytest.param``
    with the ``slow`` mark (a tuple value spreads over several argument names)."""
    return [pytest.param(*(v if isinstance(v, tuple) else (v,)), marks=pytest.mark.slow)
            if v in slow else v for v in values]
