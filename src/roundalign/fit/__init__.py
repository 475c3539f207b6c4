"""Detect an engine's rounding profile from the log-probs it dumped: ``roundalign fit``.

    from roundalign.fit import fit
    result = fit(model, read_engine_logprobs(path, vocab_size=V, max_model_len=L))   # roundalign.rollouts
    result.profile.save("engine-profile.json")

``roundalign.fit.space`` is the rule space, ``roundalign.fit.search`` the search and its ranking, and
``roundalign.fit.cli`` the command line (docs/fit.md).
"""

from roundalign.fit.search import DumpNotExplained, FitResult, fit, sign_test
from roundalign.fit.space import Candidate, Space

__all__ = ["Candidate", "DumpNotExplained", "FitResult", "Space", "fit", "sign_test"]
