"""Tasks with verifiable answers, for training the shipped model, probing it and rewarding it in RL.

Only one task today: arithmetic word problems (``roundalign.tasks.arithmetic``), in three levels.
"""

from roundalign.tasks.arithmetic import (
    LEVELS,
    Problem,
    extract_answer,
    format_prompt,
    make_problems,
    reward,
)

__all__ = ["LEVELS", "Problem", "extract_answer", "format_prompt", "make_problems", "reward"]
