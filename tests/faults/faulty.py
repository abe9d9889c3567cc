"""Fault injection for `rtserver loadtest` (its server B loads this folder as a plugin folder): a task
whose output parser always raises."""

from rtserver.tasks import Task


def parse(text):
    raise ValueError("injected parser fault")


TASK = Task(
    name="faulty",
    description="loadtest fault injection",
    prompt="Say hello to {text}.",
    max_new_tokens=4,
    parser=parse,
)
