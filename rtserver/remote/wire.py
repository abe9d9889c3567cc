"""What the remote backend writes to and reads from a server: request bodies, answers, errors."""

from __future__ import annotations

import aiohttp

from ..engine.backend import SamplingParams, Usage
from .pool import Upstream
from .reuse import Lease
from .sse import UpstreamProtocolError

Json = dict[str, object]  # a decoded JSON object, as servers send it: each value checked where read
JSON_HEADERS = {"Content-Type": "application/json"}
PREFETCH_RESPONSE_LIMIT = 1 << 16  # bytes of a one-token answer read (a prefetch, a cut-back slot)


class BackendMismatch(Exception):
    """The remote model does not use the local tokenizer (start-up refuses)."""


class UpstreamError(Exception):
    """One upstream request failed; `retryable` when another URL may succeed (before any token)."""

    def __init__(self, message: str, retryable: bool, code: str = "backend_unavailable", public: str = ""):
        super().__init__(message)
        self.message, self.retryable, self.code = message, retryable, code
        # what a client may read: never the server's URL or its error body
        self.public = public or "the inference server failed"


def completion_body(prompt: list[int], p: SamplingParams, stream: bool, model: str) -> Json:
    """A /v1/completions body with every sampling field spelled out (servers' defaults differ)."""
    body: Json = {
        "prompt": prompt,
        "stream": stream,
        "max_tokens": p.max_new_tokens,
        "temperature": p.temperature,
        "top_p": p.top_p,
        "top_k": p.top_k,
        "min_p": 0.0,
        "stop": list(p.stop),
        "ignore_eos": p.ignore_eos,
    }
    if p.greedy:
        # greedy is top-1: a server that still runs its sampler chain over the whole vocabulary for
        # top_k = 0 (llama-server) sorts ~50k logits per token for nothing
        body.update(temperature=0.0, top_k=1, top_p=1.0)
    if model:
        body["model"] = model
    if p.seed is not None:
        body["seed"] = p.seed
    # both spellings: llama-server reads repeat_penalty, vLLM and rtserver repetition_penalty; each
    # ignores the other's
    body["repeat_penalty"] = body["repetition_penalty"] = p.repetition_penalty
    if p.min_new_tokens:
        body["min_tokens"] = p.min_new_tokens
    if stream:
        body["stream_options"] = {"include_usage": True}
    body["return_token_ids"] = True  # vLLM >= 0.10.2 and rtserver: exact ids per chunk
    return body


def take_usage(event: Json, usage: Usage, lease: Lease) -> None:
    """An event's `usage` into ours; the cached tokens as the lease lets them count."""
    u = event.get("usage")
    if not isinstance(u, dict):
        return
    details = u.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    if isinstance(cached, int):
        usage.cached_tokens = lease.cached(cached)
        usage.prefilled_tokens = max(0, usage.prompt_tokens - usage.cached_tokens)
    if isinstance(u.get("completion_tokens"), int):
        usage.generated_tokens = u["completion_tokens"]


def first_choice(event: Json) -> Json | None:
    """An answer's first choice; None when it has none (a usage event); its error raised."""
    if "error" in event:
        err = event["error"]
        message = err.get("message") if isinstance(err, dict) else str(err)
        raise UpstreamError(
            f"the server reported an error: {message}", True, public="the inference server reported an error"
        )
    choices = event.get("choices")
    if isinstance(choices, list) and choices and isinstance(choices[0], dict):
        return choices[0]
    if choices is None or isinstance(choices, list):
        return None
    raise UpstreamProtocolError("'choices' is not a list")


def chunk_token_ids(choice: Json, vocab: int) -> list[int]:
    """A streamed chunk's token ids (vLLM's and rtserver's `token_ids`, llama-server's logprobs)."""
    ids = choice.get("token_ids")  # vLLM return_token_ids
    if not isinstance(ids, list):
        lp = choice.get("logprobs")
        content = lp.get("content") if isinstance(lp, dict) else None  # llama-server
        if not isinstance(content, list):
            return []
        ids = [e["id"] for e in content if isinstance(e, dict) and "id" in e]
    # the ids become the session's next prompt: a server's stray id must not reach it
    if not all(type(t) is int and 0 <= t < vocab for t in ids):
        raise UpstreamProtocolError(f"token ids outside the vocabulary (0..{vocab - 1}) in a reply")
    return ids


async def read_head(resp: aiohttp.ClientResponse, limit: int = 300) -> str:
    """The first bytes of an error response's body (never the whole of a huge one)."""
    head = b""
    async for chunk in resp.content.iter_any():
        head += chunk
        if len(head) >= limit:
            break
    return head[:limit].decode(errors="replace")


def status_error(up: Upstream, status: int, detail: str) -> UpstreamError:
    """A status other than 200 as an error: retryable when the server is at fault."""
    if status >= 500 or status == 429:
        public = f"the inference server answered {status}"
        return UpstreamError(f"{up.url} answered {status}: {detail}", True, public=public)
    if status == 400 and "exceed_context_size" in detail:
        public = "the prompt does not fit the inference server's context"
        return UpstreamError(f"{up.url}: {public}", False, code="request_too_large", public=public)
    public = f"the inference server refused the request ({status})"
    return UpstreamError(f"{up.url} refused the request ({status}): {detail}", False, "internal", public)


def public_kind(exc: BaseException) -> str:
    """`describe` without what an exception's text may carry (hosts, ports, paths)."""
    if isinstance(exc, UpstreamProtocolError):
        return str(exc).split(":")[0]  # our words; what follows is the server's bytes
    if isinstance(exc, TimeoutError | aiohttp.ClientResponseError):
        return describe(exc)
    return type(exc).__name__


def describe(exc: BaseException) -> str:
    """An exception in a few words, for logs."""
    if isinstance(exc, TimeoutError):  # aiohttp's connect and read timeouts are TimeoutErrors too
        return f"timed out ({type(exc).__name__})"
    if isinstance(exc, aiohttp.ClientResponseError):
        return f"answered {exc.status}"
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
