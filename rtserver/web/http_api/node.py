"""The node door: rtserver as the inference server of other hubs (`model.backend = "openai"`):
`/v1/completions` over token ids (streamed or not, or scoring candidates) and llama-server's
`/tokenize`, which a hub uses to check that this node tokenizes as it does."""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ...engine.backend import FinishReason, Generation, SamplingError, SamplingParams
from ...tasks import bounds as B
from ..admission import Admission, Surface
from ..connection import client_ip
from ..errors import GenerationFailed
from ..state import AppState
from .bodies import parse
from .common import (
    HTTPError,
    JSONObject,
    api_client,
    check_prompt,
    event_stream,
    fields,
    finish_reason,
    openai_usage,
    turns,
)
from .node_body import Completion, Tokenize


def _token_ids(value: object, what: str, vocab: int, most: int) -> list[int]:
    if not (isinstance(value, list) and 0 < len(value) <= most):
        raise HTTPError("invalid_field", f"'{what}' must be a list of 1..{most} token ids", what)
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise HTTPError("invalid_field", f"'{what}' must be a list of token ids (integers)", what)
    if any(not 0 <= t < vocab for t in value):
        raise HTTPError("invalid_field", f"'{what}' holds a token id outside 0..{vocab - 1}", what)
    return value


def _completion_params(body: Completion) -> SamplingParams:
    """Decoding from a checked /v1/completions body."""
    penalty = body.repetition_penalty
    params = SamplingParams(
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=body.top_k,
        max_new_tokens=body.max_tokens,
        min_new_tokens=body.min_tokens or 0,
        repetition_penalty=penalty if penalty is not None else body.repeat_penalty,
        seed=body.seed,
        stop=body.stop,
        ignore_eos=body.ignore_eos,
    )
    try:
        params.validate()
    except SamplingError as exc:
        raise HTTPError("bad_decoding", str(exc)) from None
    return params


def _candidates(value: object, vocab: int) -> list[list[int]]:
    """`score_candidates`: 1..32 token-id lists of 1..64 tokens, at most 1024 tokens in all."""
    count, each, total = (B.SIZES[k] for k in ("candidates", "candidate_tokens", "candidates_tokens"))
    if not (isinstance(value, list) and 0 < len(value) <= count):
        raise HTTPError(
            "invalid_field",
            f"'score_candidates' must be a list of 1..{count} token-id lists",
            "score_candidates",
        )
    out = [_token_ids(c, "score_candidates", vocab, each) for c in value]
    if sum(map(len, out)) > total:
        raise HTTPError(
            "request_too_large",
            f"'score_candidates' holds more than {total} tokens in all",
            "score_candidates",
        )
    return out


def _public_tokens(value: object, prompt_tokens: int) -> int:
    """`rtserver_public_tokens`: how much of the prompt a hub shares across its sessions (default: all
    of it, this node API being a trusted hub's)."""
    if value is None:
        return prompt_tokens
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= prompt_tokens:
        raise HTTPError(
            "invalid_field",
            f"'rtserver_public_tokens' must be an integer 0..{prompt_tokens} (the prompt's length)",
            "rtserver_public_tokens",
        )
    return value


def _prompt(state: AppState, prompt: object, vocab: int) -> list[int]:
    """The prompt's token ids (a text prompt tokenized), within the sequence limit."""
    limit = state.settings.engine.max_sequence_tokens
    if isinstance(prompt, str) and prompt:
        with fields():
            B.text("prompt", prompt, B.SIZES["text_chars"])
        prompt = state.backend.tokenizer.encode(prompt, add_special_tokens=False)
        if len(prompt) > limit:
            check_prompt(state, len(prompt), 0, "prompt")
    elif isinstance(prompt, list) and len(prompt) > limit:
        check_prompt(state, len(prompt), 0, "prompt")  # refused before its ids are read
    return _token_ids(prompt, "prompt", vocab, limit)


class _Reply:
    """The `text_completion` objects of one answer (whole, or its stream's events)."""

    def __init__(self, state: AppState, with_ids: bool, include_usage: bool):
        self.cid, self.created, self.model = "cmpl-" + secrets.token_hex(12), int(time.time()), state.model_id
        self.with_ids, self.include_usage = with_ids, include_usage

    def choice(self, text: str, finish: str | None, ids: list[int] | None = None) -> JSONObject:
        c: JSONObject = {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}
        if self.with_ids and ids is not None:
            c["token_ids"] = ids
        return c

    def body(self, **data: object) -> JSONObject:
        return {
            "id": self.cid,
            "object": "text_completion",
            "created": self.created,
            "model": self.model,
            **data,
        }

    def sse(self, **data: object) -> str:
        return "data: " + json.dumps(self.body(**data), ensure_ascii=False) + "\n\n"


async def completions(request: Request, state: AppState, raw: JSONObject) -> Response:
    """OpenAI-style /v1/completions over token ids, for hubs that use this node as their inference
    server: `prompt` is token ids (or text); `stream` with `stream_options.include_usage`;
    `return_token_ids` puts each chunk's token ids in `choices[0].token_ids` (as vLLM does);
    `rtserver_session` keeps the prompt's KV for that key's next turn; `rtserver_public_tokens` is how
    many leading prompt tokens this node's prefix cache may share (default: all); `score_candidates` (a
    list of token-id lists) answers `choices[0].candidate_logprobs`, the log-probability of each
    continuation."""
    body = parse(Completion, raw, max_tokens=state.settings.security.api_max_tokens)
    vocab = len(state.backend.tokenizer)
    params = _completion_params(body)  # checked when scoring too
    prompt = _prompt(state, body.prompt, vocab)
    public = _public_tokens(body.rtserver_public_tokens, len(prompt))
    reply = _Reply(state, body.return_token_ids is True, body.include_usage)
    candidates, session = body.score_candidates, body.rtserver_session
    if candidates is not None:
        return await _score(request, state, reply, prompt, _candidates(candidates, vocab), public)
    check_prompt(state, len(prompt), params.max_new_tokens, "prompt")
    key = f"remote:{session}" if session else None  # never collides with this node's own sessions
    if not body.stream:
        client = api_client(request)
        result = await turns(request).complete(client, prompt, public, params, "completions", key)
        choice = reply.choice(result.text, finish_reason(result.finish_reason), result.token_ids)
        return JSONResponse(reply.body(choices=[choice], usage=openai_usage(result)))
    gen = await turns(request).start(
        api_client(request), prompt, params, public_tokens=public, session_key=key
    )
    return event_stream(_stream(state, gen, reply))


async def _score(
    request: Request, state: AppState, reply: _Reply, prompt: list[int], lists: list[list[int]], public: int
) -> Response:
    """`score_candidates`: each continuation's log-probability, no token generated. The call holds its
    prompt and longest candidate against the API budget while it runs, as a generation does."""
    longest = max(map(len, lists))
    check_prompt(state, len(prompt), longest, "prompt")
    admission: Admission = request.app.state.admission
    held = await admission.reserve_queued(Surface.API, client_ip(request), len(prompt) + longest)
    try:
        scores = await state.backend.score(prompt, lists, public_tokens=public)
        held.release(len(prompt))
    finally:
        held.release()  # a call that failed pays what it held
    choice = {
        "index": 0,
        "text": "",
        "finish_reason": "length",
        "logprobs": None,
        "candidate_logprobs": scores,
    }
    usage = {"prompt_tokens": len(prompt), "completion_tokens": 0, "total_tokens": len(prompt)}
    return JSONResponse(reply.body(choices=[choice], usage=usage))


async def _stream(state: AppState, gen: Generation, reply: _Reply) -> AsyncIterator[str]:
    """The completion's events, an error event when it failed."""
    finished = False
    try:
        async for ev in gen:
            if ev.text or reply.with_ids:
                yield reply.sse(choices=[reply.choice(ev.text, None, [ev.token_id])])
        result = await gen.result()
        finished = True
        if result.finish_reason is FinishReason.ERROR:
            failed = GenerationFailed(result)
            state.metrics.error(failed.code)
            yield "data: " + json.dumps({"error": {"code": failed.code, "message": failed.message}}) + "\n\n"
            return
        state.metrics.observe_generation("completions", result)
        yield reply.sse(choices=[reply.choice("", finish_reason(result.finish_reason), [])])
        if reply.include_usage:
            yield reply.sse(choices=[], usage=openai_usage(result))
        yield "data: [DONE]\n\n"
    finally:
        if not finished:
            gen.cancel()  # the hub went away mid-stream


async def tokenize(request: Request, state: AppState, raw: JSONObject) -> Response:
    """llama-server's /tokenize: {"content", "add_special"} -> {"tokens"} (a hub checks that this node
    tokenizes as it does)."""
    body = parse(Tokenize, raw)
    tokens = state.backend.tokenizer.encode(body.content, add_special_tokens=body.add_special)
    return JSONResponse({"tokens": tokens})
