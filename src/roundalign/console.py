"""The terminal every command prints to: a rich ``Console`` whose width is the terminal's, or ``COLUMNS``.

Output piped into a file or another program has no terminal width. It then takes ``COLUMNS`` when that is set,
and otherwise ``PIPED_WIDTH``, wide enough for every table's widest layout, so that a log file holds the same table
a wide terminal shows. Every table also has a narrow layout, so any width reads (docs/probe.md).
"""

from __future__ import annotations

import os

from roundalign.extras import require

PIPED_WIDTH = 240


def make_console(purpose: str = "the tables"):
    """A rich Console; ``MissingDependency`` (exit status 6) when the [cli] extra is not installed."""
    require("rich", purpose)
    from rich.console import Console

    console = Console()
    if console.is_terminal or os.environ.get("COLUMNS"):
        return console
    return Console(width=PIPED_WIDTH)


def fits(console, renderable) -> bool:
    """Whether ``renderable`` prints at ``console``'s width without rich cutting a no-wrap cell (a formula, a
    number, a rule name), which it marks with an ellipsis, or cropping lines wider than the console (a table
    whose no-wrap columns alone are wider): rendered once off screen, uncropped, at that width to find out."""
    import io

    from rich.console import Console

    trial = Console(width=console.width, file=io.StringIO(), color_system=None, force_terminal=False)
    trial.print(renderable, crop=False)  # uncropped: a table wider than the console shows as longer lines
    text = trial.file.getvalue()
    return "…" not in text and all(len(line) <= console.width for line in text.splitlines())


def key_value_table(rows: list[tuple[str, str]], title: str | None = None):
    """A narrow fallback layout: one ``key  value`` row per field, values wrapped at spaces; fits 80 columns."""
    from rich.table import Table

    table = Table(title=title, show_header=False, title_justify="left")
    table.add_column("key", style="bold cyan", no_wrap=True)
    table.add_column("value", overflow="fold")
    for key, value in rows:
        table.add_row(key, value)
    return table
