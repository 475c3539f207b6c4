"""What can go wrong, as the user sees it: ``UserError`` for bad input, and the command line's exit statuses.

An error is either the user's to fix (a wrong option, a missing file, a model roundalign does not support, an
environment without an optional extra) or a bug in roundalign. The first kind is raised as a ``UserError`` whose
message names the problem and the fix, in the words of the command line (``--top-p must be in (0, 1]``); the
command line prints it on one line and exits with status 2 (or the status the subclass carries). Anything else
is a bug: the command line lets it through, with its traceback, and Python exits with status 1.

``UserError`` is a ``ValueError``, so library callers that catch ``ValueError`` keep working.
"""

from __future__ import annotations

import enum


class ExitStatus(enum.IntEnum):
    """Every exit status of the ``roundalign`` command line (the README's table is this one)."""

    OK = 0
    BUG = 1  # an uncaught exception: a bug in roundalign; Python prints the traceback
    USAGE = 2  # bad input: a wrong option, file, model or profile (argparse's own errors too)
    DIVERGED = 3  # train: a non-finite loss or gradient; the message names the step and the last good checkpoint
    RUNS_FAILED = 4  # compare: some runs of the grid failed; the others ran and are summarised
    NOT_FITTED = 5  # fit: no rounding profile explains the dump (another checkpoint, processed log-probs)
    MISSING_DEPENDENCY = 6  # an optional extra is not installed; the message says which ``pip install``
    ENGINE_FAILED = 7  # the real engine failed (no dump written, or inside train/dump); the message has its log


class Failure(Exception):
    """An error whose message says all the user needs: the command line prints it on one line, without a
    traceback, and exits with ``status``."""

    status: ExitStatus = ExitStatus.BUG


class UserError(Failure, ValueError):
    """Bad input: the message names the problem and the fix."""

    status = ExitStatus.USAGE


class MissingFile(UserError, FileNotFoundError):
    """A file or directory the user named does not exist (also a ``FileNotFoundError``)."""


class UnsupportedModel(UserError):
    """A model roundalign cannot patch or serve (its family, activation, RoPE type); the message says what is
    supported and what to do instead."""


class MissingDependency(UserError):
    """An optional extra that a command needs is not installed."""

    status = ExitStatus.MISSING_DEPENDENCY

    def __init__(self, package: str, extra: str | None = None, purpose: str | None = None, *, install: str = ""):
        if install:  # not an extra (an engine in its own environment): ``install`` says what to do
            super().__init__(f"{purpose + ' needs ' + package + ': ' if purpose else ''}{install}")
            return
        super().__init__(
            f"{purpose} needs {package}, which is in roundalign's [{extra}] extra: pip install -e '.[{extra}]' in "
            f"your roundalign clone (or pip install {package})"
        )


def flag(field: str) -> str:
    """The command-line option of a config field: ``top_p`` -> ``--top-p``."""
    return "--" + field.replace("_", "-")
