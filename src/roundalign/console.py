"""The terminal every command prints to: a rich ``Console`` whose width is the terminal's, or ``COLUMNS``.

Output piped into a file or another program has no terminal width. It then takes ``COLUMNS`` when that is set,
and otherwise ``PIPED_WIDTH``, wide enough for every table's widest layout, so that a log file holds the same table
a wide terminal shows. Every table also has a narrow layout, so any width reads (docs/probe.md).
"""

from __future__ import annotations

import os

from roundalign.errors import MissingDependency

PIPED_WIDTH = 240


def make_console(purpose: str = "the tables"):
    """A rich Console; ``MissingDependency`` (exit status 6) when the [cli] extra is not installed."""
    try:
        from rich.console import Console
    except ImportError:
        raise MissingDependency("rich", "cli", purpose) from None
    console = Console()
    if console.is_terminal or os.environ.get("COLUMNS"):
        return console
    return Console(width=PIPED_WIDTH)
