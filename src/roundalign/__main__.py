"""``python -m roundalign``: the command line, for a Python whose scripts are not on PATH (an engine's venv)."""

import sys

from roundalign.cli import main

sys.exit(main())
