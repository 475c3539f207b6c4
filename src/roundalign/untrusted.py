"""Reading files a user may have received (prompt files, profiles, a run's settings): text and JSON, with every
failure a ``UserError`` that names the file, what is wrong and what was expected, never a traceback.

Run directories, dumps and profiles are passed between people, cut short by full disks and edited by hand. The
readers here construct only text and JSON values (no pickle, no code), decode UTF-8 strictly, and say so when a file
is not what the command expects. docs/design.md ("What each reader trusts") lists every reader.
"""

from __future__ import annotations

import json
from pathlib import Path

from roundalign.errors import MissingFile, UserError


def read_text(path: str | Path, what: str) -> str:
    """The UTF-8 text of ``path`` (``what`` it should be, for the messages)."""
    path = Path(path)
    if not path.is_file():
        raise MissingFile(f"{what} {str(path)!r} does not exist")
    try:
        return path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise UserError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start}); expected {what}") from None
    except OSError as e:
        raise UserError(f"{path}: cannot be read ({e.strerror}); expected {what}") from None


def read_json_object(path: str | Path, what: str) -> dict:
    """The JSON object in ``path``; a ``UserError`` naming the line for invalid JSON, and for any other value."""
    path = Path(path)
    text = read_text(path, what)
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise UserError(f"{path}:{e.lineno}: not valid JSON ({e.msg}); expected {what}") from None
    except RecursionError:
        raise UserError(f"{path}: JSON nested too deeply; expected {what}") from None
    if not isinstance(value, dict):
        raise UserError(f"{path}: holds a JSON {type(value).__name__}, not an object; expected {what}")
    return value


__all__ = ["read_json_object", "read_text"]
