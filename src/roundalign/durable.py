"""Crash-safe writes: a kill at any instant leaves either the old file or the new one, never a partial one.

Runs are long and get killed (out of memory, pre-emption, a crashed engine), so every file a run or a command
writes for later reading goes through here. A whole file is written to a temporary file beside it, flushed and
fsynced, then renamed over the old one (``os.replace`` is atomic on POSIX), and the directory is fsynced so that the
rename itself survives a power cut. A line appended to a log (``append_line``) is flushed and fsynced; a kill can
cut only that last line, which readers of append-only logs drop and say so (``rl/logbook.read_metrics``).
"""

from __future__ import annotations

import os
from pathlib import Path


def fsync(path: str | Path) -> None:
    """fsync a file, or a directory (so that the names created or renamed in it are on disk)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_with(path: str | Path, write) -> None:
    """Replace ``path`` atomically with what ``write(tmp_path)`` writes (``Path.write_bytes``, ``torch.save``,
    ``fig.savefig``): the writer gets a temporary path beside ``path``, which is fsynced, renamed over it, and the
    rename made durable by an fsync of the directory."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}{path.suffix}")  # keeps the suffix savefig reads
    try:
        write(tmp)
        fsync(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    fsync(path.parent)


def write_bytes(path: str | Path, data: bytes) -> None:
    """Replace ``path`` with ``data`` atomically."""
    write_with(path, lambda tmp: tmp.write_bytes(data))


def write_text(path: str | Path, text: str) -> None:
    """``write_bytes`` of ``text`` in UTF-8."""
    write_bytes(path, text.encode("utf-8"))


def sync_tree(path: str | Path) -> None:
    """fsync every file under ``path`` and every directory, deepest first: before a directory written in place is
    renamed into its final name (a checkpoint)."""
    for root, _dirs, files in os.walk(path, topdown=False):
        for name in files:
            fsync(Path(root) / name)
        fsync(root)


def replace_dir(tmp: str | Path, final: str | Path) -> None:
    """Move the finished directory ``tmp`` to ``final`` (which must not exist), durably."""
    sync_tree(tmp)
    os.replace(tmp, final)
    fsync(Path(final).parent)


def append_line(file, line: str) -> None:
    """Append ``line`` (with its newline) to an open text file and put it on disk."""
    file.write(line)
    file.flush()
    os.fsync(file.fileno())


__all__ = ["append_line", "fsync", "replace_dir", "sync_tree", "write_bytes", "write_text", "write_with"]
