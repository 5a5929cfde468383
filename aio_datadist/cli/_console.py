"""Output for the command: tables and progress through ``rich`` when it is installed
(``aio_datadist[cli]``), plain text otherwise; JSON for machines."""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Iterator, Sequence
from typing import Any, Protocol

__all__ = ("Progress", "print_json", "print_table", "progress")


def print_json(data: Any) -> None:
    """``data`` as indented JSON on stdout."""
    print(json.dumps(data, indent=2, sort_keys=False, default=str))


def print_table(title: str, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    """A table on stdout: ``rich``'s where installed, else aligned plain text."""
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        cells = [[str(c) for c in columns], *[[str(c) for c in row] for row in rows]]
        widths = [max(len(r[i]) for r in cells) for i in range(len(columns))]
        print(title)
        for n, cell_row in enumerate(cells):
            line = "  ".join(c.ljust(w) for c, w in zip(cell_row, widths, strict=True))
            print("  " + line.rstrip())
            if n == 0:
                print("  " + "  ".join("-" * w for w in widths))
        return
    table = Table(title=title, title_justify="left")
    for column in columns:
        table.add_column(column)
    for row in rows:
        table.add_row(*(str(c) for c in row))
    Console().print(table)


class Progress(Protocol):
    """Advance a task of the progress display."""

    def __call__(self, step: str) -> None: ...


@contextlib.contextmanager
def progress(total: int, *, quiet: bool) -> Iterator[Progress]:
    """A progress bar of ``total`` steps on stderr (``rich``), else one line per step;
    nothing when ``quiet``."""
    if quiet:
        yield lambda step: None
        return
    try:
        from rich.progress import Progress as RichProgress
    except ImportError:

        def plain(step: str) -> None:
            print(f"  {step}", file=sys.stderr, flush=True)

        yield plain
        return
    with RichProgress(transient=True) as bar:
        task = bar.add_task("measuring", total=total)

        def advance(step: str) -> None:
            bar.update(task, advance=1, description=step)

        yield advance
