"""Built-in `chat`: a multi-turn assistant over the session's history window and persistent KV."""

from rtserver.tasks import Task

TASK = Task(
    name="chat",
    description="Multi-turn assistant; streams its reply and keeps the conversation between turns.",
    stateful=True,
    input_kind="chat",
    system_prompt="You are a helpful AI assistant named SmolLM, trained by Hugging Face",
    max_input_chars=4000,
    max_input_tokens=1024,
    truncate="tail",  # an over-long message keeps its newest part
    max_new_tokens=128,
    decoding={"temperature": 0.7, "top_p": 0.9},
    overridable={
        "temperature": (0.0, 2.0),
        "top_p": (0.05, 1.0),
        "top_k": (0, 200),
        "repetition_penalty": (0.8, 2.0),
        "max_new_tokens": (1, 512),
        "seed": (0, 2**31 - 1),
        "stop": (0, 4),
    },
    max_history_turns=20,
    max_history_tokens=1500,
)
