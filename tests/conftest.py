"""Shared pytest setup. Keep this generic: helpers live in tests/helpers.py, references in tests/formulas.py."""

import sys
from pathlib import Path

# Make tests/helpers.py and tests/formulas.py importable whatever pytest's import mode is.
_TESTS = str(Path(__file__).resolve().parent)
if _TESTS not in sys.path:
    sys.path.insert(0, _TESTS)
