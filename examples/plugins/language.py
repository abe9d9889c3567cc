"""Example plugin: which language is a message written in? Drop this file into a plugin folder
(`[tasks] plugin_dirs = ["plugins", "examples/plugins"]`) and call the task `language`."""

from rtserver.tasks import Choices, Task

LANGUAGES = {"english": " English", "chinese": " Chinese", "french": " French",
             "german": " German", "spanish": " Spanish"}

TASK = Task(
    name="language",
    description="Language of a message, scored over a closed set with a probability each.",
    prompt="Text: {text}\nThe language of this text is",  # the part before {text} is shared
    chat_template=False,  # a plain completion prompt
    max_input_tokens=128,
    truncate="head",  # a long message keeps its start
    choices=Choices(LANGUAGES, calibration=["N/A"]),  # one forward pass, always a valid label
    cache_size=1024,  # LRU + TTL result cache
    cache_ttl_s=600,
)
