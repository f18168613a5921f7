"""An empty tuned cache for a test: its own cache root, no shipped entries, no memo."""

from __future__ import annotations

import contextlib

from gdngen import cache, dispatch


@contextlib.contextmanager
def isolated_cache(tmp_path, monkeypatch):
    """Point the user cache at ``tmp_path/root`` and the shipped tuned folder at an empty
    ``tmp_path/shipped``, with tuned lookups on and the memos cleared before and after."""
    monkeypatch.setenv("GDNGEN_CACHE_DIR", str(tmp_path / "root"))
    monkeypatch.delenv(dispatch.ENV_NO_TUNED, raising=False)
    shipped = tmp_path / "shipped"
    shipped.mkdir()
    monkeypatch.setattr(cache, "shipped_tuned_dir", lambda: shipped)
    cache.clear_memo()
    dispatch.clear_memo()
    try:
        yield tmp_path
    finally:
        cache.clear_memo()
        dispatch.clear_memo()
