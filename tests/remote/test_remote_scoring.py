"""Label scoring's reading of each kind of server's answer (rtserver/remote/scoring.py). No network:
each scorer's `post` answers from a list."""

from __future__ import annotations

import pytest

from rtserver.remote.pool import Upstream
from rtserver.remote.reuse import BlindReuse, Lease
from rtserver.remote.scoring import LlamaScorer, Scorer, VllmScorer
from rtserver.remote.sse import UpstreamProtocolError
from rtserver.remote.wire import Json

PROMPT = [1, 2, 3]


class Canned:
    """A scorer's requests answered in order; the extra fields of each kept."""

    def __init__(self, scorer: type[Scorer], answers: list[Json]):
        self.scorer = scorer.__new__(scorer)
        self.answers = answers
        self.sent: list[dict[str, object]] = []

        async def post(
            up: Upstream, lease: Lease, prompt: list[int], max_tokens: int, **extra: object
        ) -> Json:
            self.sent.append({"prompt": prompt, "max_tokens": max_tokens, **extra})
            return self.answers.pop(0)

        self.scorer.post = post

    async def score(self, candidates: list[list[int]]) -> list[float]:
        lease = await BlindReuse().lease(None, 0, 1.0)
        return await self.scorer.score(Upstream("http://fake", 1), PROMPT, candidates, lease)


def llama(entries: list[object]) -> Json:
    return {"choices": [{"text": "", "logprobs": {"content": entries}}]}


async def test_llama_reads_the_top_log_probabilities_then_forces_the_rest():
    top = {"id": 7, "logprob": -0.5, "top_logprobs": [{"id": 7, "logprob": -0.5}, {"id": 8, "logprob": -1.5}]}
    forced = [{"id": 9, "logprob": -2.0}, {"id": 10, "logprob": -0.25}]
    canned = Canned(LlamaScorer, [llama([top]), llama(forced)])
    assert await canned.score([[7], [8], [9, 10]]) == [-0.5, -1.5, -2.25]
    assert [s["max_tokens"] for s in canned.sent] == [1, 2]  # only the two-token label was forced


@pytest.mark.parametrize(
    "entry",
    [
        {"id": "7", "logprob": -0.5, "top_logprobs": [{"id": "seven", "logprob": -0.5}]},
        {"id": 7, "logprob": -0.5, "top_logprobs": [{"id": 7, "logprob": None}]},
        {"id": 7, "logprob": -0.5, "top_logprobs": ["not an entry"]},
    ],
)
async def test_llama_answers_of_the_wrong_shape_are_protocol_errors(entry):
    with pytest.raises(UpstreamProtocolError):
        await Canned(LlamaScorer, [llama([entry])]).score([[7], [8]])


def vllm(top: dict[str, object], prompt_logprobs: list[object] | None = None) -> Json:
    choice: Json = {"text": "", "logprobs": {"top_logprobs": [top]}}
    if prompt_logprobs is not None:
        choice["prompt_logprobs"] = prompt_logprobs
    return {"choices": [choice]}


async def test_vllm_reads_first_tokens_by_id_and_the_rest_from_prompt_log_probabilities():
    first = vllm({"token_id:7": -0.5, "token_id:9": -2.0})
    rest = vllm({}, [None] * 4 + [{"10": {"logprob": -0.25, "rank": 1}}])
    assert await Canned(VllmScorer, [first, rest]).score([[7], [9, 10]]) == [-0.5, -2.25]


@pytest.mark.parametrize(
    "answers",
    [
        [vllm({"token_id:7": "much", "token_id:9": -2.0})],
        [vllm({"token_id:7": -0.5, "token_id:9": -2.0}), vllm({}, [None] * 4)],  # no entry for token 10
        [vllm({"token_id:7": -0.5, "token_id:9": -2.0}), vllm({}, [None] * 4 + [{"10": {}}])],
    ],
)
async def test_vllm_answers_of_the_wrong_shape_are_protocol_errors(answers):
    with pytest.raises(UpstreamProtocolError):
        await Canned(VllmScorer, answers).score([[7], [9, 10]])
