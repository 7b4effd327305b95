"""Tasks (prompt/answer datasets) and verifiable rewards."""

from .rewards import extract_answer, math_verify_reward
from .tasks import DatasetError, Example, Task, file_task, load_task, reasoning_gym_task

__all__ = [
    "DatasetError",
    "Example",
    "Task",
    "extract_answer",
    "file_task",
    "load_task",
    "math_verify_reward",
    "reasoning_gym_task",
]
