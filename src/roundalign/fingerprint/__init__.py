"""Op-level fingerprint of an engine build: which rounding rule each region follows, per mode (eager / compiled).

Cheaper and sharper than fitting log-probs: a battery of bf16 inputs chosen to separate the rules
(``battery.make_battery``), a standalone script that runs them through the engine's own layers on its machine
(``runner.py``, copied out by ``roundalign fingerprint runner``), and a reader that recomputes every rule with
``roundalign.ops`` and names the one the outputs follow (``reader.read_results``), optionally as a Profile
(``profile.build_profile``). docs/fingerprint.md has the workflow and what the op level cannot see.
"""

from roundalign.fingerprint.battery import make_battery, save_battery
from roundalign.fingerprint.profile import build_profile
from roundalign.fingerprint.reader import load_results, read_results
from roundalign.fingerprint.runner import Adapter, collect, run_battery

__all__ = ["Adapter", "build_profile", "collect", "load_results", "make_battery", "read_results", "run_battery",
           "save_battery"]
