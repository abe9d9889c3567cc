"""The end-to-end WebSocket load client against a real server (scripted engine: no timing asserted)."""

from __future__ import annotations

import pytest

from rtbench.loadclient import run_chat_load

from ..serverutil import ScriptedEngine, make_settings, scripted_app, serve


@pytest.mark.asyncio
async def test_run_chat_load_summary(smol):
    settings = make_settings()
    engine = ScriptedEngine(smol, script=smol.tokenizer.encode(" a b c", add_special_tokens=False))
    async with serve(scripted_app(smol, settings, engine), settings) as (base, url):
        out = await run_chat_load(url, sessions=3, turns=2, max_new_tokens=8, timeout_s=120)
    assert out["errors"] == {} and out["completed_turns"] == 6
    assert out["tokens"] == 6 * 3 and out["tokens_per_s"] > 0
    assert set(out["per_turn"]) == {1, 2} and out["per_turn"][2]["n"] == 3
    assert out["per_turn"][2]["prompt_tokens_mean"] > out["per_turn"][1]["prompt_tokens_mean"]
    assert out["ttft_p50_ms"] is not None and out["turn_ratio_p50"] is not None
