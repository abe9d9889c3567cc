"""Built-in `intent`: route a customer message to one of a few categories, scored like sentiment.

The prompt names the categories by their labels; each label is scored by a verbalizer word chosen on the
intent dev split (data/intent/, docs in data/intent/SOURCES.md): " payment" for billing, " delivery" for
shipping... score better than the label names themselves with this model. Chinese messages (has_cjk) get
their own prompt ("The customer is asking about"), which the model completes better after Chinese text.

A learned head (`Task.head`, one per prompt) answers from the same forward pass: it is fitted on the
labeled messages shipped next to this file (`intent.examples.jsonl`: 20 per category and language,
written for the project like data/intent/) and loaded from `intent.head.npz` (`rtserver fit-heads`) when
the model, prompts and examples match; on the dev split it beats label scoring by far
(docs/sentiment-research.md). Categories other than the default ones have no examples, hence no head.

Options in `[task.intent]`: `categories = {billing = " payment", ...}` (label -> words scored), `head`
(bool, default true).
"""

from pathlib import Path

from rtserver.tasks import Choices, LearnedHead, Task, Variant, has_cjk

NAME = "intent"
DEFAULT_CATEGORIES = {
    "billing": " payment",
    "technical": " technical problem",
    "shipping": " delivery",
    "account": " account",
    "other": " something else",
}
ZH_PROMPT = "Customer message: {text}\nThe customer is asking about"
EXAMPLES = Path(__file__).with_name("intent.examples.jsonl")
FITTED = Path(__file__).with_name("intent.head.npz")
HEAD_L2 = 1.0  # chosen on the dev split (docs/sentiment-research.md)


def make_task(options: dict) -> Task:
    categories = options.pop("categories", DEFAULT_CATEGORIES)
    head = options.pop("head", True)
    if options:
        raise ValueError(f"unknown settings: {', '.join(sorted(options))} (known: categories, head)")
    if not isinstance(head, bool):
        raise ValueError(f"head = {head!r}: must be true or false")
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
        head=LearnedHead(EXAMPLES, l2=HEAD_L2, fitted=FITTED)
        if head and isinstance(categories, dict) and set(categories) == set(DEFAULT_CATEGORIES)
        else None,
        cache_size=4096,
        cache_ttl_s=600,
    )
