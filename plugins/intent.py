"""Built-in `intent`: route a customer message to one of a few categories, scored like sentiment.

The prompt names the categories by their labels; each label is scored by a verbalizer word chosen on the
intent dev split (data/intent/, docs in data/intent/SOURCES.md): " payment" for billing, " delivery" for
shipping... score better than the label names themselves with this model. Chinese messages (has_cjk) get
their own prompt ("The customer is asking about"), which the model completes better after Chinese text.

Options in `[task.intent]`: `categories = {billing = " payment", ...}` (label -> words scored).
"""

from rtserver.tasks import Choices, Task, Variant, has_cjk

NAME = "intent"
DEFAULT_CATEGORIES = {
    "billing": " payment",
    "technical": " technical problem",
    "shipping": " delivery",
    "account": " account",
    "other": " something else",
}
ZH_PROMPT = "Customer message: {text}\nThe customer is asking about"


def make_task(options: dict) -> Task:
    categories = options.pop("categories", DEFAULT_CATEGORIES)
    if options:
        raise ValueError(f"unknown settings: {', '.join(sorted(options))} (known: categories)")
    names = ", ".join(categories)
    choices = Choices(labels=dict(categories), calibration=["N/A"])
    return Task(
        name=NAME,
        description="Route a customer message to a support category.",
        prompt=f"Customer support categories: {names}.\nMessage: {{text}}\nCategory:",
        chat_template=False,
        max_input_tokens=256,
        truncate="head",
        choices=choices,
        variants=[Variant(when=has_cjk, prompt=ZH_PROMPT, choices=choices)],
        cache_size=4096,
        cache_ttl_s=600,
    )
