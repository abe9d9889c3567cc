"""How a generating task answers: `generate` draws its `samples` replies, streams and parses them.

Replies are drawn side by side, each with its own seed; a cancelled call cancels them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import random
import secrets
import time
from collections.abc import Callable, Hashable, Mapping

from ..engine.backend import FinishReason, Generation, InferenceBackend, SamplingParams, SequenceResult
from .declare import Task, TaskError, TaskOutput

log = logging.getLogger("rtserver.tasks")

Deltas = Callable[[int, str], None]  # (sample index, text): a generating call's replies as they stream


def no_deltas(sample: int, text: str) -> None:
    """Nobody watches the replies arrive."""


async def generate(
    task: Task,
    backend: InferenceBackend,
    prompt: list[int],
    params: SamplingParams,
    public: int,
    on_delta: Deltas,
    fork: Hashable | None = None,
) -> TaskOutput:
    """A generating task's call: the reply parsed by the task's parser (a JSON task's: as JSON);
    with `samples` above 1, that many replies, `{"samples": [parsed, ...]}` (the distinct ones, in
    order), each drawn with its own seed."""
    started = time.perf_counter()
    results = await _replies(task.samples, backend, prompt, params, public, on_delta, fork)
    parsed = [parse(task, r, params) for r in results]
    output: Mapping[str, object]
    if len(parsed) == 1:
        output = parsed[0]
    else:
        output = {"samples": [p for i, p in enumerate(parsed) if p not in parsed[:i]]}
    lead = results[0]  # submitted as the call began: its first token is the call's
    usage = dataclasses.asdict(lead.usage)
    usage["generated_tokens"] = sum(r.usage.generated_tokens for r in results)
    return TaskOutput(
        task.name,
        output,
        lead.text if len(results) == 1 else "\n".join(r.text for r in results),
        usage,
        {
            "queued_ms": lead.queued_ms,
            "ttft_ms": lead.ttft_ms,
            "total_ms": (time.perf_counter() - started) * 1000,
        },
    )


async def _replies(
    n: int,
    backend: InferenceBackend,
    prompt: list[int],
    params: SamplingParams,
    public: int,
    on_delta: Deltas,
    fork: Hashable | None,
) -> list[SequenceResult]:
    """The call's `n` replies. The first one's prompt goes alone (from `fork`'s KV where given); the
    others follow its first token and reuse that prompt's KV. A cancelled call cancels them."""
    seed = params.seed if params.seed is not None else random.getrandbits(48)
    scope = secrets.randbits(62)  # this call's own: no other call, nor session, shares it
    streams: list[Generation] = []

    def draw(i: int) -> Generation:
        source = fork if i == 0 else None
        if n == 1:
            stream = backend.generate(prompt, params, public_tokens=public, fork_session=source)
        else:
            one = dataclasses.replace(params, seed=seed + i)
            stream = backend.generate(
                prompt, one, public_tokens=public, prefix_scope=scope, fork_session=source
            )
        streams.append(stream)
        return stream

    async def forward(i: int, stream: Generation, *, first_only: bool = False) -> None:
        async for event in stream:
            if event.text:
                on_delta(i, event.text)
            if first_only:
                return

    async def follow(i: int, stream: Generation) -> SequenceResult:
        await forward(i, stream)
        return await stream.result()

    try:
        lead = draw(0)
        if n > 1:
            await forward(0, lead, first_only=True)
        rest = [draw(i) for i in range(1, n)]
        return list(await asyncio.gather(*(follow(i, s) for i, s in enumerate([lead, *rest]))))
    except asyncio.CancelledError:
        for stream in streams:
            stream.cancel()
        raise


def parse(task: Task, result: SequenceResult, params: SamplingParams) -> Mapping[str, object]:
    """One reply's value: the task's parser on its text, its JSON, or the text itself."""
    if result.error:
        raise TaskError("internal", f"{task.name}: generation failed")
    fmt = params.output
    if not fmt.free and result.finish_reason is not FinishReason.EOS:
        raise TaskError(
            "output_truncated",
            f"{task.name}: the output reached {params.max_new_tokens} tokens before its "
            f"{fmt.kind} was complete",
        )
    parsed: object
    try:
        if task.parser:
            parsed = task.parser(result.text)
        else:
            parsed = json.loads(result.text) if fmt.is_json else {"text": result.text}
    except Exception as exc:  # a plugin bug: this request fails, nothing else does
        log.exception("%s: output parser failed on %r", task.name, result.text)
        raise TaskError(
            "internal", f"{task.name}: the task's output parser failed ({type(exc).__name__})"
        ) from exc
    return parsed if isinstance(parsed, dict) else {"value": parsed}
