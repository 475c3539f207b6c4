"""The real inference engines, vLLM and SGLang: everything roundalign knows about running them, in one place.

Per engine: how it is detected and installed, the environment it runs in, what build it is (``engine.json``), the
dump it writes (``roundalign dump`` runs the engine's half in the engine's own Python), the in-process engine that
``roundalign train --engine vllm`` and TRL's rollout function drive, and the trainer profile that matches a build.
``launch`` runs a dump as a subprocess in the engine's Python (``probe --engine``, ``calibrate``).

Not to be confused with ``roundalign.engine``, the reference engine that roundalign implements itself. This package
imports roundalign's core (profiles, rollouts, prompts, the reference engine's sampling types), never the commands
(``probe``, ``dump``, ``calibrate``, ``rl``) or the integrations, which import it.
"""

ENGINES = ("vllm", "sglang")

__all__ = ["ENGINES"]
