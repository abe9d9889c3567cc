"""Built-in `suggest_reply`: reply drafts for the agent, from the conversation so far.

On a conversation whose session lives on this node, a draft is the chat's own next reply: the
prompt is the conversation as the chat task renders it (`conversation_prompt = ""`, no instruction
added), so it starts from the session's cached KV and only the reply is computed. Elsewhere (another
node's conversation, or a text given) the input is a transcript (one line a message, `Customer:` /
`Agent:` / `Bot:`, the console renders it; the newest messages kept) in `PROMPT`. Either way the model
writes one reply per draft, each drawn with its own seed (`samples`), so a small model gives plain
sentences rather than a list it must also format: `{"samples": [{"text": "..."}, ...]}`, the distinct
drafts in order, each cut at its last whole sentence. Agent assist runs at `assist` priority, so
customers' replies are served first.

Options in `[task.suggest_reply]`: `drafts` (how many, 1..5, default 3), `max_new_tokens` (per draft),
`continue_session` (default true; false: the transcript prompt always).
"""

import re

from rtserver.tasks import Task

NAME = "suggest_reply"
PROMPT = (
    "Here is a chat between a customer and our support team:\n\n{text}\n\n"
    "Write the support agent's next reply to the customer: one or two friendly sentences in the "
    "customer's language."
)
SENTENCE_END = re.compile(r"[.!?。！？](?=\s|$)")


def draft(text: str) -> dict:
    """The reply up to its last whole sentence (a reply cut by the token limit ends mid-sentence)."""
    text = " ".join(text.split()).strip('"')
    ends = [m.end() for m in SENTENCE_END.finditer(text)]
    return {"text": text[: ends[-1]] if ends else text}


def make_task(options: dict) -> Task:
    most = options.pop("drafts", 3)
    follow = options.pop("continue_session", True)
    if options:
        raise ValueError(f"unknown settings: {', '.join(sorted(options))} (known: drafts, continue_session)")
    if not isinstance(most, int) or isinstance(most, bool) or not 1 <= most <= 5:
        raise ValueError(f"drafts = {most!r}: an integer 1..5")
    if not isinstance(follow, bool):
        raise ValueError(f"continue_session = {follow!r}: true or false")
    return Task(
        name=NAME,
        description="Reply drafts for the agent from the conversation so far.",
        prompt=PROMPT,
        system_prompt="You are a helpful customer-support agent.",
        max_input_chars=8000,
        max_input_tokens=1024,
        truncate="tail",  # the newest messages matter most
        max_new_tokens=64,
        stop=["\n"],
        decoding={"temperature": 0.7, "top_p": 0.9},
        overridable={"temperature": (0.0, 1.5), "seed": (0, 2**62)},  # the seed: draft i takes seed + i
        parser=draft,
        samples=most,
        priority="assist",
        audience=("agents",),  # the agents' copilot: never a customer's call
        speculate=True,  # it quotes the conversation: drafts from it pay
        conversation_prompt="" if follow else None,
    )
