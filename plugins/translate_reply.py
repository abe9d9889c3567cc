"""Built-in `translate_reply`: the agent's reply in the customer's language, to edit before sending.

The input's first line names the language, the rest is the reply: `French\nWe will send it today.`
The console finds the language with a scoring task (`language`, `examples/plugins/language.py`) on
the customer's last message and writes that first line. The answer is free text (the translation
alone). Runs at `assist` priority.
"""

from rtserver.tasks import Task

NAME = "translate_reply"


def make_task(options: dict) -> Task:
    if options:
        raise ValueError(f"unknown settings: {', '.join(sorted(options))} (none are known)")
    return Task(
        name=NAME,
        description="The agent's reply translated to the language named on the input's first line.",
        prompt=(
            "Translate the reply below the first line into the language the first line names. "
            "Answer with the translation only.\n\n{text}"
        ),
        max_input_chars=4000,
        max_input_tokens=512,
        max_new_tokens=256,
        stop=["\n\n"],
        priority="assist",
        audience=("agents",),  # the agents' copilot: never a customer's call
        speculate=True,  # it quotes the conversation: drafts from it pay
    )
