"""Tasks: what the model is asked to do. The declaration API for plugin authors is re-exported here
(`from rtserver.tasks import Task, Choices, JSONSchema`); `run.py` runs stateless tasks, `chat.py` prepares
chat turns, `head.py` fits a task's learned head, `registry.py` finds and configures plugins. A plugin may
declare an `Action` instead (`actions.py`): what the bot may do on the business's systems."""

from .actions import Action, Rule
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
    "Action",
    "Choices",
    "Grammar",
    "JSONSchema",
    "LearnedHead",
    "Regex",
    "Rule",
    "Task",
    "TaskError",
    "TaskOutput",
    "Variant",
    "has_cjk",
]
