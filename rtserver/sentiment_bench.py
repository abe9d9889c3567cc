"""The sentiment workload of `rtserver bench`: 256 distinct texts at once, then the same 256 again
(result cache), against the write-ups' method (generative prompt, greedy, 3 new tokens, HF `generate`
in batches of 4)."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import torch

DATA_DIR = Path(__file__).resolve().parent.parent / "data" / "sentiment"
WRITEUP_PROMPT = ("Classify the sentiment of the following text as positive or negative. "
                  "Answer with one word only.\nText: {text}")


def sentiment_texts(n: int = 256) -> list[str]:
    """n distinct short texts: the shipped labeled test sets when present, else generated ones."""
    texts: list[str] = []
    for name in ("en_test.jsonl", "zh_test.jsonl", "en_dev.jsonl", "zh_dev.jsonl"):
        path = DATA_DIR / name
        if path.exists():
            for line in path.read_text(encoding="utf-8").splitlines():
                text = json.loads(line)["text"]
                if len(text) < 200 and text not in texts:
                    texts.append(text)
    i = 0
    while len(texts) < n:
        texts.append(f"Review {i}: the product was {'great' if i % 2 else 'disappointing'} overall.")
        i += 1
    return texts[:n]


async def engine_sentiment(engine: Any, tokenizer: Any, registry: Any = None) -> dict:
    from .config import Settings
    from .tasks import load_registry

    if registry is None:
        registry, _ = load_registry(Settings(), tokenizer)
    texts = sentiment_texts()
    await registry.run(engine, "sentiment", {"text": "warm-up text"})  # calibration + warm-up
    started = time.perf_counter()
    fresh = await asyncio.gather(*(registry.run(engine, "sentiment", {"text": t}) for t in texts))
    fresh_s = time.perf_counter() - started
    started = time.perf_counter()
    again = await asyncio.gather(*(registry.run(engine, "sentiment", {"text": t}) for t in texts))
    cached_s = time.perf_counter() - started
    assert all(a.cached for a in again) and [a.output for a in again] == [f.output for f in fresh]
    return {"texts": len(texts), "fresh_per_s": len(texts) / fresh_s, "cached_per_s": len(texts) / cached_s}


def hf_sentiment_baseline(model: Any, tokenizer: Any, n: int = 64, batch: int = 4) -> dict:
    texts = sentiment_texts()[:n]
    pad = model.generation_config.pad_token_id or tokenizer.eos_token_id
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": WRITEUP_PROMPT.format(text=t)}],
                                             add_generation_prompt=True, tokenize=True, return_dict=False)
               for t in texts]
    started = time.perf_counter()
    for i in range(0, len(prompts), batch):
        group = prompts[i:i + batch]
        width = max(len(p) for p in group)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in group])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in group])
        model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False, pad_token_id=pad)
    wall = time.perf_counter() - started
    return {"texts": len(texts), "per_s": len(texts) / wall}
