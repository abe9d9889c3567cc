"""The widget's citations in chromium, on the embedded model: each cited article is listed, a link only for
an http(s) URL, its title as text; a hostile title or URL neither runs nor links. A screenshot of the widget
with citations goes to artifacts/widget-citations.png (docs/img, the README's, with RT_README_SHOTS=1)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from rtserver.web.app import create_app

from ..serverutil import make_settings, serve
from .test_handoff_pages import readme_shot
from .test_pages import browser, new_page, open_widget, send  # noqa: F401 (browser: a fixture)

pytestmark = [pytest.mark.asyncio, pytest.mark.slow]

SHOP = Path(__file__).resolve().parents[1] / "data" / "shop_kb"
EVIL = (
    '---\ntitle: <img src=x onerror="window.__xss=1">Refund tricks\nurl: javascript:window.__xss=2\n---\n'
    "Refunds and returns: the refund goes back to your card within 5 days.\n"
)


async def test_the_widget_lists_cited_articles_as_safe_links(smol, browser, tmp_path):  # noqa: F811
    from playwright.async_api import expect

    kb = tmp_path / "kb"
    kb.mkdir()
    for name in ("refund-time.md", "return-policy.md"):
        shutil.copy(SHOP / name, kb / name)
    (kb / "evil.md").write_text(EVIL)
    settings = make_settings(
        knowledge={"enabled": True, "folder": str(kb), "poll_s": 0.0},
        model={"cache_dir": str(tmp_path / "cache")},
        tasks={"plugin_dirs": [], "auto_tasks": []},
        chat={"decoding": {"temperature": 0.0}, "max_new_tokens": 32},
    )
    async with serve(create_app(settings, lambda: smol), settings) as (base, url):
        page = await new_page(browser)
        await page.goto(base + "/")
        await open_widget(page)
        await send(page, "When do I get my refund after a return?")
        await expect(page.locator(".rt-send")).to_be_visible()  # the reply is done
        items = page.locator(".rt-sources li")
        await expect(items.first).to_be_visible()
        texts = await items.all_inner_texts()
        assert texts and all(t.startswith("[") for t in texts), texts
        hrefs = await page.locator(".rt-sources a").evaluate_all("(as) => as.map((a) => a.href)")
        assert all(h.startswith("https://shop.example/help/") for h in hrefs), hrefs
        body = await page.locator(".rt-bot .rt-body").last.inner_text()
        assert "Sources:" not in body  # the ending became the list
        await page.screenshot(path=readme_shot("widget-citations.png"))
        # the hostile article, when cited, is its title as text and no link
        if any("Refund tricks" in t for t in texts):
            assert any("<img" in t for t in texts)
        assert await page.evaluate("window.__xss === undefined")
        assert not await page.locator(".rt-sources img").count()
        assert not page.js_errors
