"""Op-level fingerprint of an engine build: which rounding rule each region follows, per mode (eager / compiled).

Cheaper and sharper than fitting log-probs: a battery of bf16 inputs chosen to separate the rules
(``battery.make_battery``), a standalone script that runs them through the engine's own layers on its machine
(``runner.py``, copied out by ``roundalign fingerprint runner``), and a reader that recomputes every rule with
``roundalign.ops`` and names the one the outputs follow (``reader.read_results``), optionally as a Profile
(``profile.build_profile``). ``battery.model_constants`` adds cases shaped like the user's model (``make --model``);
``runner.NativeAdapter`` (``--engine native``) runs vLLM's native code for a dry run on any machine.
docs/fingerprint.md has the workflow and what the op level cannot see.
"""

from roundalign.fingerprint.battery import make_battery, model_constants, save_battery
from roundalign.fingerprint.profile import build_profile
from roundalign.fingerprint.reader import load_results, read_results
from roundalign.fingerprint.runner import Adapter, NativeAdapter, collect, run_battery

__all__ = [
    "Adapter",
    "NativeAdapter",
    "build_profile",
    "collect",
    "load_results",
    "make_battery",
    "model_constants",
    "read_results",
    "run_battery",
    "save_battery",
]
