"""An action in a real browser: the widget asks where an order is, the shop's status comes back, and
the console shows the call (arguments, status, result). Playwright with Debian's chromium, the embedded
model, the real shop server (tests/shopserver.py)."""

from __future__ import annotations

from rtserver.web.app import create_app

from ..serverutil import serve
from ..shopserver import ShopServer
from .test_bot_actions import STATUS, settings_for
from .test_pages import TOKEN, browser, new_page, open_widget, send, shot  # noqa: F401 (browser: a fixture)


async def test_the_widget_gets_the_status_and_the_console_shows_the_call(smol, browser):  # noqa: F811
    from playwright.async_api import expect

    async with ShopServer() as shop:
        settings = settings_for(shop, security={"console_token": TOKEN})
        async with serve(create_app(settings, lambda: smol), settings) as (base, _):
            page = await new_page(browser)
            await page.goto(base + "/")
            await open_widget(page)
            await send(page, "Hi! My order #AB-1234 hasn't arrived and I'm really annoyed.")
            await expect(page.locator(".rt-bot .rt-body").last).to_have_text(STATUS)
            await page.screenshot(path=shot("widget-action.png"))
            agent = await new_page(browser, viewport={"width": 1280, "height": 800})
            await agent.goto(base + "/console")
            await agent.get_by_label("Console token").fill(TOKEN)
            await agent.get_by_role("button", name="Sign in").click()
            await agent.locator(".item").first.click()
            call = agent.locator(".msg-action")
            await expect(call).to_have_count(1)
            await expect(call.locator(".who")).to_contain_text("Action order_status")
            await expect(call.locator(".tag")).to_have_text("ok")
            await expect(call.locator(".call").first).to_have_text('arguments {"order_id":"AB-1234"}')
            await expect(call.locator(".call").last).to_contain_text('"status":"out for delivery"')
            await expect(agent.locator(".msg-bot .body")).to_have_text(STATUS)
            await agent.screenshot(path=shot("console-action.png"))
            assert not page.js_errors and not agent.js_errors, (page.js_errors, agent.js_errors)
        assert shop.requests == ["/orders/AB-1234"]
