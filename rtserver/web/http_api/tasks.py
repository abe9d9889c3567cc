"""The task door: `/v1/tasks` (list, run one), and the write-ups' compatible `/sentiment` and `/chat`."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ...tasks import Task, TaskError
from ...tasks.chat import CHAT
from ...tasks.declare import API
from .. import events
from ..state import AppState
from ..turns import TurnResult
from .bodies import ChatHistory, Sentiment, TaskCall, parse
from .common import HTTPError, JSONObject, api_client, run_held_task, task_sampling, turns


def _task_text(task: Task, raw: object, param: str) -> None:
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


async def _stateless_chat(request: Request, state: AppState, body: ChatHistory, endpoint: str) -> TurnResult:
    params = task_sampling(state.tasks.chat.task, body.options)  # before any tokenization
    return await turns(request).reply(api_client(request), body.history, params, endpoint)


async def list_tasks(request: Request, state: AppState, body: JSONObject) -> Response:
    reg = state.tasks
    return JSONResponse({"tasks": reg.describe(API), "auto_tasks": list(reg.auto_tasks)})


async def run_task(request: Request, state: AppState, raw: JSONObject) -> Response:
    name = request.path_params["name"]
    body = parse(TaskCall, raw)
    _for_api(state, name)
    if name == CHAT:  # a stateless turn of the chat, not a task call
        return await _run_chat(request, state, name, body)
    task = state.tasks.get(name)
    _task_text(task.task, body.input, "input")  # refused here with the field named, as below
    if body.options:
        task_sampling(task.task, body.options)
    out = await run_held_task(request, state, name, body.input, body.options)
    state.metrics.requests.labels("http", "task").inc()
    return JSONResponse(out.to_json())


async def _run_chat(request: Request, state: AppState, name: str, call: TaskCall) -> Response:
    """`/v1/tasks/<a chat task>`: one stateless turn over the history given."""
    inp = call.input
    if not isinstance(inp, dict) or "history" not in inp:
        raise HTTPError("invalid_input", f'{name} takes {{"history": [{{role, content}}, ...]}}', "input")
    body = parse(ChatHistory, {"history": inp["history"], "options": call.options})
    done = await _stateless_chat(request, state, body, "http_task")
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


async def sentiment(request: Request, state: AppState, raw: JSONObject) -> Response:
    text = parse(Sentiment, raw).text
    _for_api(state, "sentiment")
    _task_text(state.tasks.get("sentiment").task, text, "text")
    out = await run_held_task(request, state, "sentiment", {"text": text}, None)
    state.metrics.requests.labels("http", "task").inc()
    return JSONResponse(dict(out.output))


async def chat(request: Request, state: AppState, raw: JSONObject) -> Response:
    body = parse(ChatHistory, raw)
    _for_api(state, "chat")
    done = await _stateless_chat(request, state, body, "http_chat")
    return JSONResponse({**done.output, "usage": events.usage_json(done.result.usage)})
