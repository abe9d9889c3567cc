"""The HTTP API, one module per door on the shared admission path (common.py `api`): the tasks
(tasks.py), the OpenAI-compatible chat (openai.py) and this server as another hub's node (node.py)."""

from __future__ import annotations

from . import node, node_sessions, openai, tasks
from .common import api, refused_response

ROUTES = [
    ("/v1/tasks", tasks.list_tasks, ["GET"]),
    ("/v1/tasks/{name}", tasks.run_task, ["POST"]),
    ("/sentiment", tasks.sentiment, ["POST"]),
    ("/chat", tasks.chat, ["POST"]),
    ("/v1/chat/completions", openai.chat_completions, ["POST"]),
    ("/v1/models", openai.list_models, ["GET"]),
    ("/v1/completions", node.completions, ["POST"]),
    ("/tokenize", node.tokenize, ["POST"]),
    ("/v1/sessions/drop", node_sessions.drop_sessions, ["POST"]),
]

__all__ = ["ROUTES", "api", "refused_response"]
