"""Built-in `summarize`: what a conversation is about, for the agent who opens or takes it over.

The input is the conversation as a transcript (see `suggest_reply`). The answer is JSON that always
validates: the customer's issue, what was tried so far, and the customer's mood over the conversation
(one of positive / neutral / negative per stage, oldest first). Runs at `assist` priority.

Options in `[task.summarize]`: `max_chars` (per field, default 200).
"""

from rtserver.tasks import JSONSchema, Task

NAME = "summarize"
MOODS = ["positive", "neutral", "negative"]
PROMPT = (
    "Summarize this customer-service conversation for the agent taking it over.\n\n{text}\n\n"
    "Answer with JSON: the customer's issue, what was tried so far, and the customer's mood at the "
    "start, middle and end."
)


def make_task(options: dict) -> Task:
    chars = options.pop("max_chars", 200)
    if options:
        raise ValueError(f"unknown settings: {', '.join(sorted(options))} (known: max_chars)")
    if not isinstance(chars, int) or isinstance(chars, bool) or not 20 <= chars <= 1000:
        raise ValueError(f"max_chars = {chars!r}: an integer 20..1000")
    text = {"type": "string", "minLength": 1, "maxLength": chars}
    schema = {
        "type": "object",
        "properties": {
            "issue": text,
            "tried": text,
            "mood": {"type": "array", "minItems": 1, "maxItems": 3, "items": {"enum": MOODS}},
        },
        "required": ["issue", "tried", "mood"],
        "additionalProperties": False,
    }
    return Task(
        name=NAME,
        description="The issue, what was tried and the customer's mood over time (JSON).",
        prompt=PROMPT,
        max_input_chars=8000,
        max_input_tokens=1024,
        truncate="tail",
        max_new_tokens=chars + 48,
        output=JSONSchema(schema),
        priority="assist",
        audience=("agents",),  # the agents' copilot: never a customer's call
        speculate=True,  # it quotes the conversation: drafts from it pay
    )
