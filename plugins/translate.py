"""Built-in `translate`: a customer's message in the agent's language.

The answer is free text (the translation alone). Which language a message is in can be asked of a
scoring task (`examples/plugins/language.py`); the console shows the translation under the message.
Runs at `assist` priority.

Options in `[task.translate]`: `to` (the agent's language, default "English").
"""

from rtserver.tasks import Task

NAME = "translate"


def make_task(options: dict) -> Task:
    to = options.pop("to", "English")
    if options:
        raise ValueError(f"unknown settings: {', '.join(sorted(options))} (known: to)")
    if not isinstance(to, str) or not to.replace(" ", "").isalpha() or len(to) > 40:
        raise ValueError(f"to = {to!r}: a language name")
    return Task(
        name=NAME,
        description=f"The message translated to {to}.",
        prompt=f"Translate this message to {to}. Answer with the translation only.\n\n{{text}}",
        max_input_chars=4000,
        max_input_tokens=512,
        max_new_tokens=256,
        stop=["\n\n"],
        priority="assist",
        audience=("agents",),  # the agents' copilot: never a customer's call
        speculate=True,  # it quotes the conversation: drafts from it pay
    )
