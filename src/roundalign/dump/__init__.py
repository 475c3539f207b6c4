"""``roundalign dump``: a real engine samples rollouts and scores them again in prefill; both go to a dump directory.

This is the code that runs in the engine's own Python (your GPU machine's vLLM, or the CPU vLLM that ``make vllm``
installs), so it imports only the engine, torch and roundalign's core. ``roundalign probe --engine vllm`` and
``roundalign calibrate`` run it as a subprocess in that Python; ``probe``, ``fit`` and ``calibrate`` read what it
writes (``roundalign.rollouts.dumpdir``).
"""
