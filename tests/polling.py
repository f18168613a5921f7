"""Waiting in tests for something another process does (a trial to start, a file to appear)."""

from __future__ import annotations

import time


def wait_for(predicate, timeout: float, what: str, every: float = 0.05):
    """``predicate()``'s first truthy value, polled every ``every`` s; AssertionError naming
    ``what`` after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"timed out waiting for {what}")
