"""The HTTP API, one module per door on the shared admission path (common.py `api`): the tasks
(tasks.py), the OpenAI-compatible chat (openai.py) and this server as another hub's node (node.py)."""

from __future__ import annotations

from . import node, node_sessions, openai, tasks
from .bodies import ChatHistory, Door, Sentiment, TaskCall
from .common import api, refused_response
from .node_body import Completion, DropSessions, Tokenize
from .openai_body import ChatCompletion

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

# each POST door's body (GET /v1/http.schema.json)
BODIES: dict[str, type[Door]] = {
    "/v1/chat/completions": ChatCompletion,
    "/v1/completions": Completion,
    "/tokenize": Tokenize,
    "/v1/sessions/drop": DropSessions,
    "/v1/tasks/{name}": TaskCall,
    "/sentiment": Sentiment,
    "/chat": ChatHistory,
}

__all__ = ["BODIES", "ROUTES", "api", "refused_response"]
