"""vLLM: its build (``build``), the dump's engine half (``dump``), the in-process engine of ``train --engine vllm``
(``inprocess``), and the trainer profile for the build installed here (``profile``). Nothing here imports vLLM at
import time: a module imports it where it starts an engine, in the engine's own Python."""
