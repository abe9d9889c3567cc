"""Example plugin: which language is a message written in? Put this file in a plugin folder
(`[tasks] plugin_dirs = ["plugins", "examples/plugins"]`) and call the task `language`."""

from pathlib import Path

from rtserver.tasks import Choices, LearnedHead, Task

LANGUAGES = {
    "english": " English",
    "chinese": " Chinese",
    "french": " French",
    "german": " German",
    "spanish": " Spanish",
}  # label -> word scored after the prompt

TASK = Task(
    name="language",
    description="Language of a message, from a closed set, with a probability each.",
    # Two examples, then the message; the part before {text} is computed once and shared.
    prompt=(
        "Text: Bonjour tout le monde.\nLanguage: French\n\n"
        "Text: Good morning, everyone.\nLanguage: English\n\n"
        "Text: {text}\nLanguage:"
    ),
    chat_template=False,  # a plain completion prompt
    max_input_tokens=128,
    truncate="head",  # a longer message keeps its start
    choices=Choices(LANGUAGES, calibration=["N/A"]),  # one forward pass, always a valid label
    # Optional: labeled examples next to this file; a classifier fitted on the model's hidden states by
    # `rtserver fit-heads` answers from the same forward pass (until then: the label scores above).
    head=LearnedHead(Path(__file__).with_name("language.examples.jsonl")),
    cache_size=1024,  # LRU + TTL result cache (cache_ttl_s: 600 s by default)
)
