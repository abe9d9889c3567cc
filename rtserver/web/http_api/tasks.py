"""The task door: `/v1/tasks` (list, run one), and the write-ups' compatible `/sentiment` and `/chat`."""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ...tasks import Task, TaskError
from ...tasks import bounds as B
from ...tasks.chat import CHAT
from ...tasks.declare import API
from .. import events
from ..state import AppState
from ..turns import TurnResult
from .common import Body, HTTPError, api_client, run_held_task, task_sampling, turns

Message = dict[str, str]  # {"role", "content"}


def _history(value: Any) -> list[Message]:
    """A validated user/assistant history ending with a user message, within the size bounds."""
    if not isinstance(value, list) or not value:
        raise HTTPError(
            "invalid_input", "'history' must be a non-empty list of {role, content} messages", "history"
        )
    count, chars = B.SIZES["history"], B.SIZES["text_chars"]
    if len(value) > count:
        raise HTTPError(
            "request_too_large", f"'history' has {len(value)} messages, the limit is {count}", "history"
        )
    out: list[Message] = []
    total = 0
    for i, m in enumerate(value):
        if (
            not isinstance(m, dict)
            or m.get("role") not in ("user", "assistant")
            or not isinstance(m.get("content"), str)
        ):
            raise HTTPError(
                "invalid_input",
                f'history[{i}] must be {{"role": "user"|"assistant", "content": string}}',
                "history",
            )
        total += len(m["content"])
        if total > chars:  # checked before any message is tokenized
            raise HTTPError(
                "request_too_large", f"'history' has more than {chars} characters of content", "history"
            )
        out.append({"role": m["role"], "content": m["content"]})
    if out[-1]["role"] != "user":
        raise HTTPError("invalid_input", "the last history message must be the user's", "history")
    return out


def _task_text(task: Task, raw: Any, param: str) -> None:
    """A stateless task's input text checked (type, emptiness, size) before it runs, naming the field."""
    try:
        task.clean_text(raw.get("text") if isinstance(raw, dict) else raw)
    except TaskError as exc:
        raise HTTPError(exc.code, exc.message, param) from None


def _for_api(state: AppState, name: str) -> None:
    """The task exists and serves the API (`Task.audience`): else 404 or 403, before any work."""
    try:
        state.tasks.check_caller(name, API)
    except TaskError as exc:
        status = 403 if exc.code == "task_not_allowed" else None
        raise HTTPError(exc.code, exc.message, status=status) from None


def _options(options: Any) -> None:
    if options is not None and not isinstance(options, dict):
        raise HTTPError("invalid_field", "'options' must be an object of decoding settings", "options")


async def _stateless_chat(
    request: Request, state: AppState, history_value: Any, options: Any, endpoint: str
) -> TurnResult:
    _options(options)
    params = task_sampling(state.tasks.chat.task, options)  # before any tokenization
    history = _history(history_value)
    return await turns(request).reply(api_client(request), history, params, endpoint)


async def list_tasks(request: Request, state: AppState, body: Any) -> Response:
    reg = state.tasks
    return JSONResponse({"tasks": reg.describe(API), "auto_tasks": list(reg.auto_tasks)})


async def run_task(request: Request, state: AppState, body: Body) -> Response:
    name = request.path_params["name"]
    if "input" not in body:
        raise HTTPError("missing_field", '\'input\' is required, e.g. {"input": {"text": "..."}}', "input")
    options = body.get("options")
    _options(options)
    _for_api(state, name)
    if name == CHAT:  # a stateless turn of the chat, not a task call
        return await _run_chat(request, state, name, body["input"], options)
    task = state.tasks.get(name)
    _task_text(task.task, body["input"], "input")  # refused here with the field named, as below
    if options:
        task_sampling(task.task, options)
    out = await run_held_task(request, state, name, body["input"], options)
    state.metrics.requests.labels("http", "task").inc()
    return JSONResponse(out.to_json())


async def _run_chat(request: Request, state: AppState, name: str, inp: Any, options: Any) -> Response:
    """`/v1/tasks/<a chat task>`: one stateless turn over the history given."""
    if not isinstance(inp, dict) or "history" not in inp:
        raise HTTPError("invalid_input", f'{name} takes {{"history": [{{role, content}}, ...]}}', "input")
    done = await _stateless_chat(request, state, inp["history"], options, "http_task")
    result = done.result
    timing = {"queued_ms": result.queued_ms, "ttft_ms": result.ttft_ms, "total_ms": result.total_ms}
    return JSONResponse(
        {
            "task": name,
            "output": done.output,
            "text": result.text,
            "usage": events.usage_json(result.usage),
            "timing": timing,
            "cached": False,
        }
    )


async def sentiment(request: Request, state: AppState, body: Body) -> Response:
    if "text" not in body:
        raise HTTPError("missing_field", "'text' is required", "text")
    _for_api(state, "sentiment")
    _task_text(state.tasks.get("sentiment").task, body["text"], "text")
    out = await run_held_task(request, state, "sentiment", {"text": body["text"]}, None)
    state.metrics.requests.labels("http", "task").inc()
    return JSONResponse(dict(out.output))


async def chat(request: Request, state: AppState, body: Body) -> Response:
    if "history" not in body:
        raise HTTPError("missing_field", "'history' is required", "history")
    _for_api(state, "chat")
    done = await _stateless_chat(request, state, body["history"], body.get("options"), "http_chat")
    return JSONResponse({**done.output, "usage": events.usage_json(done.result.usage)})
