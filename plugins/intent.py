"""Built-in `intent`: route a customer message to one of a few categories, scored like sentiment.

Options in `[task.intent]`: `categories = {billing = " billing", ...}` (label -> word scored).
"""

from rtserver.tasks import Choices, Task

NAME = "intent"
DEFAULT_CATEGORIES = {
    "billing": " billing",
    "technical": " technical",
    "shipping": " shipping",
    "account": " account",
    "other": " other",
}


def make_task(options: dict) -> Task:
    categories = options.pop("categories", DEFAULT_CATEGORIES)
    if options:
        raise ValueError(f"unknown settings: {', '.join(sorted(options))} (known: categories)")
    names = ", ".join(w.strip() for w in categories.values())
    return Task(
        name=NAME,
        description="Route a customer message to a support category.",
        prompt=f"Customer support categories: {names}.\nMessage: {{text}}\nCategory:",
        chat_template=False,
        max_input_tokens=256,
        truncate="head",
        choices=Choices(labels=dict(categories), calibration=["N/A"]),
        cache_size=4096,
        cache_ttl_s=600,
    )
