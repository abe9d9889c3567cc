"""Tasks: what the model is asked to do. The declaration API for plugin authors is re-exported here
(`from rtserver.tasks import Task, Choices, JSONSchema`); `run.py` runs stateless tasks, `chat.py` prepares
chat turns, `head.py` fits a task's learned head, `registry.py` finds and configures plugins."""

from .declare import (
    Choices,
    Grammar,
    JSONSchema,
    LearnedHead,
    Regex,
    Task,
    TaskError,
    TaskOutput,
    Variant,
    has_cjk,
)

__all__ = [
    "Choices",
    "Grammar",
    "JSONSchema",
    "LearnedHead",
    "Regex",
    "Task",
    "TaskError",
    "TaskOutput",
    "Variant",
    "has_cjk",
]
