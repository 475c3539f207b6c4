"""verl's reward function for the arithmetic task (``custom_reward_function``): 1 for the right answer, else 0.

verl loads this file by path (``reward.custom_reward_function.path``) and calls ``compute_score`` for each response
with the row's ``data_source`` and ``reward_model.ground_truth`` (the answer, as text); ``loop.py`` writes the rows.
"""

from __future__ import annotations

from roundalign.tasks import extract_answer

DATA_SOURCE = "roundalign/arithmetic"


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs) -> float:
    """1.0 if the response's answer (``The answer is N.``) is ``ground_truth``, else 0.0."""
    if data_source != DATA_SOURCE:
        raise ValueError(f"this reward scores {DATA_SOURCE!r} rows, not {data_source!r}")
    return 1.0 if extract_answer(solution_str) == int(ground_truth) else 0.0


__all__ = ["DATA_SOURCE", "compute_score"]
