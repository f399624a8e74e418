"""Tables that read at 80 columns: short headers, cells that never wrap or get cut, and whatever is long
(notes, paths, URLs) below the table as numbered notes, whole."""

from __future__ import annotations

from rich import box
from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text


def narrow_table(title: str | None, *columns: str, left: tuple[str, ...] = ()) -> Table:
    """Columns are right-aligned (figures) unless named in `left`. Cells never wrap."""
    table = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, padding=(0, 0), pad_edge=False,
                  collapse_padding=True, show_edge=False)
    for column in columns:
        table.add_column(column, justify="left" if column in left else "right", no_wrap=True)
    return table


class Notes:
    """Long texts of a table's rows, numbered; the row shows the number."""

    def __init__(self) -> None:
        self.texts: list[str] = []

    def add(self, text: str) -> str:
        """The marker for the row's cell, e.g. "[2]"; "" for no text."""
        if not text:
            return ""
        self.texts.append(text)
        return f"[{len(self.texts)}]"

    def lines(self) -> list[str]:
        return [f"[{i}] {text}" for i, text in enumerate(self.texts, start=1)]


def with_lines(table: Table, lines: list[str]) -> RenderableType:
    """The table, then lines printed whole below it (a path or URL is never cut)."""
    return Group(table, *(Text(line, no_wrap=True, overflow="ignore") for line in lines)) if lines else table
