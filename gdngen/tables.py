"""Plain-text tables for the command line (rich, rendered without ANSI codes)."""

from __future__ import annotations

import io


def render_table(title: str, columns, rows, *, width: int = 200, right=(), footer=()) -> str:
    """``rows`` (sequences of str, one per column in ``columns``) as a rich table rendered to
    plain text ``width`` columns wide. Cells are escaped (a ``[`` in a variant name is text,
    not markup); the ``right`` columns are right-justified, the others fold; ``footer`` lines
    are printed under the table."""
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    table = Table(title=title)
    for name in columns:
        if name in right:
            table.add_column(name, justify="right")
        else:
            table.add_column(name, overflow="fold")
    for row in rows:
        table.add_row(*map(escape, row))
    buffer = io.StringIO()
    console = Console(file=buffer, width=width, color_system=None, force_terminal=False)
    console.print(table)
    for line in footer:
        console.print(escape(line))
    return buffer.getvalue()
