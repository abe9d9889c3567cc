"""Built-in `sentiment`: positive/negative (optionally neutral) by scoring the label words.

Scoring mode (default) reads the log-probability of each label word after a plain completion prompt,
minus what the model gives the same words for a content-free input (contextual calibration), so the
answer is always one of the labels, with a probability for each. The same prompt serves Chinese input.
`mode = "generate"` keeps the write-ups' method (instruction + greedy 3 tokens + strict parser) for
comparison.

A learned head (`Task.head`, one per language) answers from the same forward pass as label scoring. It is
fitted on the labeled examples shipped next to this file (`sentiment.examples.jsonl`: the train split of
data/sentiment, 8,191 English movie snippets and 5,995 Chinese reviews; scripts/build_sentiment_data.py
rebuilds it) and shipped fitted (`sentiment.head.npz`, written by `rtserver fit-heads --ship`): a server
whose model, dtype, prompt and examples match loads it in milliseconds, any other scores labels until
`rtserver fit-heads` fits it. Without a backend that returns hidden states, or with `head = false`, the
task scores labels as above. With
`neutral = true` there is no head (the examples have no neutral texts).

Options in `[task.sentiment]`: `mode` ("score" | "generate"), `neutral` (bool), `label_names`
(rename the output labels, e.g. {positive = "正面", negative = "负面"}), `head` (bool, default true).
"""

import re
from pathlib import Path

from rtserver.tasks import Choices, LearnedHead, Task, Variant, has_cjk

NAME = "sentiment"
# Chosen on the dev splits (docs/sentiment-research.md): an English few-shot completion prompt works for
# Chinese text too; Chinese label words never beat chance with this model.
PROMPT = (
    "Message: I love this, it made my day!\nSentiment: positive\n\n"
    "Message: This is terrible, I want my money back.\nSentiment: negative\n\n"
    "Message: What a wonderful surprise, thank you so much.\nSentiment: positive\n\n"
    "Message: Boring and a complete waste of time.\nSentiment: negative\n\n"
    "Message: {text}\nSentiment:"
)
WORDS = {"positive": " Positive", "negative": " Negative", "neutral": " Neutral"}  # one token each
CALIBRATION = ["N/A"]
EXAMPLES = Path(__file__).with_name("sentiment.examples.jsonl")
FITTED = Path(__file__).with_name("sentiment.head.npz")  # `rtserver fit-heads` writes it
HEAD_L2 = 1.0  # chosen on the dev splits (docs/sentiment-research.md)
GENERATIVE_PROMPT = (
    "Classify the sentiment of this message. Answer with exactly one word: {labels}.\nMessage: {{text}}"
)


def make_task(options: dict) -> Task:
    mode = options.pop("mode", "score")
    neutral = options.pop("neutral", False)
    names = options.pop("label_names", {})
    head = options.pop("head", True)
    if options:
        raise ValueError(
            f"unknown settings: {', '.join(sorted(options))} (known: mode, neutral, label_names, head)"
        )
    if not isinstance(head, bool):
        raise ValueError(f"head = {head!r}: must be true or false")
    if mode not in ("score", "generate"):
        raise ValueError(f"mode = {mode!r}: allowed 'score', 'generate'")
    keys = ["positive", "negative"] + (["neutral"] if neutral else [])
    unknown = set(names) - set(keys)
    if unknown:
        raise ValueError(
            f"label_names: unknown labels {', '.join(sorted(unknown))} (labels: {', '.join(keys)})"
        )
    out = {k: names.get(k, k) for k in keys}
    if mode == "generate":
        return Task(
            name=NAME,
            description="Sentiment of a message (generative mode, for comparison).",
            prompt=GENERATIVE_PROMPT.format(labels=", ".join(out.values())),
            max_input_tokens=256,
            truncate="head",
            max_new_tokens=3,
            parser=_parser(out),
            cache_size=4096,
        )
    return Task(
        name=NAME,
        description="Sentiment of a message: " + " / ".join(out.values()) + ", with a probability each.",
        prompt=PROMPT,
        chat_template=False,
        max_input_tokens=256,
        truncate="head",
        choices=Choices({out[k]: WORDS[k] for k in keys}, calibration=CALIBRATION),
        # The same prompt for Chinese text, as a variant of its own: it gets its own head (fitted on the
        # Chinese examples); label scoring is the same either way.
        variants=[Variant(when=has_cjk, prompt=PROMPT)],
        head=LearnedHead(EXAMPLES, labels=out, l2=HEAD_L2, fitted=FITTED) if head and not neutral else None,
        cache_size=4096,
        cache_ttl_s=600,
    )


def _parser(labels: dict):
    """Strict parser for the generative mode: valid only when the answer names exactly one label (its key
    or shown name, any case, as a whole word; CJK names anywhere), e.g. "Positive." -> positive, but
    "positive or negative", "positively" and "I think" -> invalid."""
    patterns = {
        key: [
            re.compile(re.escape(w) if has_cjk(w) else rf"(?<![\w-]){re.escape(w)}(?![\w-])")
            for w in {key.lower(), shown.lower()}
        ]
        for key, shown in labels.items()
    }

    def parse(text: str) -> dict:
        answer = text.strip().lower()
        found = [key for key, pats in patterns.items() if any(p.search(answer) for p in pats)]
        if len(found) == 1:
            return {"label": labels[found[0]], "valid": True}
        return {"label": None, "valid": False}

    return parse
