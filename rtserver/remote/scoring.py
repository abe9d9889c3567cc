"""Label scoring on remote servers: the log-probability of each candidate continuation of a prompt.

What each kind of server offers differs, so the start-up check learns the kind (servers.py) and one
scorer class per kind does the asking:
- rtserver: `score_candidates` on its /v1/completions (exact, one request);
- llama-server: the top-20 log-probabilities of the next token, and a token grammar forcing a
  candidate that is not among them (or is longer than one token);
- vLLM: `logprob_token_ids` (vLLM >= 0.26) for first tokens and `prompt_logprobs` for longer ones.
After a call the slot it used is cut back to the prompt's public prefix, in the background (reuse.py).
"""

from __future__ import annotations

import asyncio
import logging

from ..engine.backend import SamplingParams
from .client import Upstreams
from .pool import Upstream
from .reuse import Lease
from .sse import UpstreamProtocolError
from .wire import (
    PREFETCH_RESPONSE_LIMIT,
    Json,
    UpstreamError,
    completion_body,
    describe,
    first_choice,
    read_head,
)

log = logging.getLogger("rtserver.remote")

TOP_LOGPROBS = 20


class Scorer:
    """Scores candidates on one kind of server; `post` is one non-streamed scoring request."""

    def __init__(self, ups: Upstreams):
        self.ups = ups

    async def score(
        self, up: Upstream, prompt: list[int], candidates: list[list[int]], lease: Lease
    ) -> list[float]:
        raise NotImplementedError

    async def post(
        self, up: Upstream, lease: Lease, prompt: list[int], max_tokens: int, **extra: object
    ) -> Json:
        """One non-streamed scoring request; the slot it used then holds its prompt."""
        body: Json = {
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "top_k": 0,
            "top_p": 1.0,
            "min_p": 0.0,
            "stream": False,
            **extra,
            **lease.fields(prompt),
        }
        if self.ups.model:
            body["model"] = self.ups.model
        data = await self.ups.post(up, body)
        lease.wrote(prompt, [])
        return data


class RtserverScorer(Scorer):
    """Another rtserver: its own `score_candidates`, exact, in one request."""

    async def score(
        self, up: Upstream, prompt: list[int], candidates: list[list[int]], lease: Lease
    ) -> list[float]:
        data = await self.post(up, lease, prompt, 1, score_candidates=candidates)
        scores = (first_choice(data) or {}).get("candidate_logprobs")
        if not (
            isinstance(scores, list)
            and len(scores) == len(candidates)
            and all(isinstance(s, (int, float)) for s in scores)
        ):
            raise UpstreamProtocolError("no candidate_logprobs in the scoring response")
        return [float(s) for s in scores]


class LlamaScorer(Scorer):
    """llama-server (and servers of an unknown kind): top log-probabilities, then forced candidates."""

    async def score(
        self, up: Upstream, prompt: list[int], candidates: list[list[int]], lease: Lease
    ) -> list[float]:
        entries = _llama_logprobs(await self.post(up, lease, prompt, 1, logprobs=TOP_LOGPROBS))
        tops = entries[0].get("top_logprobs") if entries else None
        top = {_token_id(t): _logprob(t) for t in tops} if isinstance(tops, list) else {}
        scores: list[float] = []
        for cand in candidates:
            if len(cand) == 1 and cand[0] in top:
                scores.append(top[cand[0]])
            else:
                scores.append(await self._forced(up, prompt, cand, lease))
        return scores

    async def _forced(self, up: Upstream, prompt: list[int], cand: list[int], lease: Lease) -> float:
        # force exactly this continuation: a grammar of its token ids (one token: the same)
        grammar = "root ::= " + " ".join(f"<[{t}]>" for t in cand)
        forced = _llama_logprobs(await self.post(up, lease, prompt, len(cand), logprobs=1, grammar=grammar))
        if len(forced) != len(cand):
            raise UpstreamError(
                f"{up.url} could not score a label of {len(cand)} tokens "
                "(its tokens are not whole characters)",
                False,
            )
        return sum(_logprob(e) for e in forced)


class VllmScorer(Scorer):
    """vLLM: the first tokens' log-probabilities asked by id, the rest from prompt log-probabilities."""

    async def score(
        self, up: Upstream, prompt: list[int], candidates: list[list[int]], lease: Lease
    ) -> list[float]:
        firsts = sorted({c[0] for c in candidates})
        data = await self.post(
            up, lease, prompt, 1, logprobs=1, logprob_token_ids=firsts, return_tokens_as_token_ids=True
        )
        logprobs = (first_choice(data) or {}).get("logprobs")
        tops = logprobs.get("top_logprobs") if isinstance(logprobs, dict) else None
        top = tops[0] if isinstance(tops, list) and tops and isinstance(tops[0], dict) else {}
        first = {
            int(k.split(":", 1)[1]): _number(v) for k, v in top.items() if str(k).startswith("token_id:")
        }
        scores = []
        for cand in candidates:
            if cand[0] not in first:
                raise UpstreamError(
                    f"{up.url} returned no log-probability for token {cand[0]} (vLLM >= 0.26 "
                    "is needed for label scoring)",
                    False,
                    code="internal",
                )
            score = first[cand[0]]
            if len(cand) > 1:  # the rest from prompt log-probabilities of prompt + candidate
                rest = await self.post(up, lease, prompt + cand, 1, prompt_logprobs=0)
                plp = (first_choice(rest) or {}).get("prompt_logprobs")
                for pos, tok in enumerate(cand[1:], start=len(prompt) + 1):
                    at = plp[pos] if isinstance(plp, list) and pos < len(plp) else None
                    score += _logprob(at.get(str(tok)) if isinstance(at, dict) else None)
            scores.append(score)
        return scores


class LabelScoring:
    """`score` over the pool: the URL's scorer by its kind, retries, and the slot cut back after."""

    def __init__(self, ups: Upstreams):
        self.ups = ups
        llama = LlamaScorer(ups)
        self.scorers: dict[str, Scorer] = {"rtserver": RtserverScorer(ups), "vllm": VllmScorer(ups)}
        self.default = llama  # llama.cpp and servers of an unknown kind
        self.background: set[asyncio.Task[None]] = set()  # slots being cut back to a public prefix

    async def score(
        self, prompt_ids: list[int], candidates: list[list[int]], public_tokens: int
    ) -> list[float]:
        async def attempt(up: Upstream) -> list[float]:
            scorer = self.scorers.get(self.ups.kinds.get(up.url, "openai"), self.default)
            lease = await self.ups.reuse_of(up).lease(None, public_tokens, self.ups.settings.timeout_s)
            try:
                scores = await scorer.score(up, prompt_ids, candidates, lease)
            except BaseException:
                lease.release()
                raise
            self._leave_public(up, lease, prompt_ids[:public_tokens])
            return scores

        # scores are log-probabilities: normalized whatever `normalize` says
        return await self.ups.with_retries(None, attempt, lambda: True)

    def _leave_public(self, up: Upstream, lease: Lease, prefix: list[int]) -> None:
        """After a scoring call, in the background: cut its slot back to the public prefix, so later
        requests may reuse it (remote/reuse.py); the slot is released when that is done."""
        fields = lease.public_fields() if prefix else None
        if fields is None:
            lease.release()
            return
        params = SamplingParams(temperature=0.0, max_new_tokens=1)
        body = completion_body(prefix, params, False, self.ups.model)
        body.update(fields)
        task = asyncio.get_running_loop().create_task(self._cut(up, lease, prefix, body))
        self.background.add(task)
        task.add_done_callback(self.background.discard)

    async def _cut(self, up: Upstream, lease: Lease, prefix: list[int], body: Json) -> None:
        try:
            async with asyncio.timeout(self.ups.settings.timeout_s):
                async with self.ups.completion(up, body, gated=False) as resp:
                    await read_head(resp, PREFETCH_RESPONSE_LIMIT)
            lease.wrote_public(prefix)
        except Exception as exc:
            log.info(
                "%s: cutting a slot back to its public prefix failed (no harm done): %s",
                up.url,
                describe(exc),
            )
        finally:
            lease.release()

    def stop(self) -> None:
        for task in list(self.background):
            task.cancel()


def _llama_logprobs(data: Json) -> list[Json]:
    lp = (first_choice(data) or {}).get("logprobs")
    content = lp.get("content") if isinstance(lp, dict) else None
    if not isinstance(content, list) or not all(isinstance(e, dict) for e in content):
        raise UpstreamProtocolError("no logprobs in the response (is it llama-server?)")
    return content


def _number(value: object) -> float:
    """A log-probability as the server wrote it; anything else is not the protocol."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise UpstreamProtocolError("a log-probability that is not a number")
    try:
        return float(value)
    except ValueError:
        raise UpstreamProtocolError("a log-probability that is not a number") from None


def _logprob(entry: object) -> float:
    """An entry's `logprob` (llama-server's and vLLM's entries alike)."""
    return _number(entry.get("logprob") if isinstance(entry, dict) else None)


def _token_id(entry: object) -> int:
    """A llama-server entry's token `id`."""
    token = entry.get("id") if isinstance(entry, dict) else None
    if type(token) is not int:
        raise UpstreamProtocolError("a token id that is not an integer")
    return token
