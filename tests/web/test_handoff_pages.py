"""The hand-off to people in a real browser (Playwright, Debian's chromium) on the embedded model: an
upset customer's conversation enters the console's queue with its reason, an agent takes over and
answers; out of hours the customer leaves an e-mail that the agent sees. Both are `slow` (seconds of
model time on a shared machine), as test_pages.py's real-model tests.

With RT_README_SHOTS=1 these tests also write the README's screenshots, docs/img/console-queue.png
and docs/img/widget-handoff.png; else every screenshot goes to artifacts/ (git-ignored).
"""

from __future__ import annotations

import os
import re

import pytest

from rtserver.web.app import create_app

from ..serverutil import make_settings, serve
from .test_handoff import closed_today
from .test_pages import ROOT, TOKEN, browser, new_page, open_widget, send, shot  # noqa: F401 (fixture)

pytestmark = pytest.mark.asyncio

UPSET = "My order never arrived, this is terrible and I am really angry. Your service is awful!"
# Each time a conversation first shows as waiting in the console's list: when (ms) and its wait's start (s).
WATCH_QUEUE = """() => {
  window.queueSeen = [];
  const seen = new Set();
  new MutationObserver(() => {
    for (const b of document.querySelectorAll(".item.waiting .waiting-badge")) {
      if (seen.has(b.dataset.since)) continue;
      seen.add(b.dataset.since);
      window.queueSeen.push({ at: Date.now(), since: Number(b.dataset.since) });
    }
  }).observe(document.getElementById("list"), { childList: true, subtree: true });
}"""


def readme_shot(name: str) -> str:
    """Where a README screenshot goes: docs/img with RT_README_SHOTS=1, else artifacts/."""
    if os.environ.get("RT_README_SHOTS") == "1":
        return str(ROOT / "docs" / "img" / name)
    return shot(name)


COPILOT = ["suggest_reply", "extract", "summarize", "translate", "translate_reply"]


def handoff_app(smol, copilot: bool = True, **handoff: object):
    """The embedded model's server with the hand-off on. The copilot, which opening a conversation
    starts, runs only short drafts (`copilot`: else not at all): the model's time goes to the flow."""
    settings = make_settings(
        security={"console_token": TOKEN},
        handoff={"enabled": True, "mood_min_messages": 1, **handoff},
        tasks={"disabled": ["summarize", "translate", "translate_reply"] if copilot else COPILOT},
    )
    settings.chat.max_new_tokens = 16
    settings.chat.decoding = {"temperature": 0.0}  # greedy: the same screenshots every run
    settings.task = {"suggest_reply": {"drafts": 2, "max_new_tokens": 20}}
    return create_app(settings, lambda: smol), settings


async def agent_page(browser, base: str, name: str = "Sam"):  # noqa: F811 (the fixture's name)
    agent = await new_page(browser, viewport={"width": 1100, "height": 640})
    await agent.goto(base + "/console")
    await agent.get_by_label("Console token").fill(TOKEN)
    await agent.get_by_label("Your name").fill(name)
    await agent.get_by_role("button", name="Sign in").click()
    await agent.locator("#conn").filter(has_text="Live").wait_for()
    return agent


@pytest.mark.slow
async def test_an_upset_customer_is_queued_and_an_agent_takes_over(smol, browser):  # noqa: F811
    from playwright.async_api import expect

    app, settings = handoff_app(smol)
    async with serve(app, settings) as (base, url):
        agent = await agent_page(browser, base)
        await agent.evaluate(WATCH_QUEUE)
        customer = await new_page(browser, viewport={"width": 460, "height": 720})
        await customer.goto(base + "/")
        await open_widget(customer)
        await send(customer, UPSET)

        # the sentiment auto-task rates the message negative: the conversation waits for a person
        banner = customer.locator(".rt-handoff")
        await expect(banner).to_be_visible()
        await expect(banner.locator(".rt-handoff-line")).to_have_text(
            "A person will join this conversation soon."
        )
        await expect(banner.locator(".rt-handoff-place")).to_have_text("You're next in line.")
        await expect(customer.locator(".rt-email-form")).to_be_hidden()
        await expect(customer.locator(".rt-send")).to_be_visible()
        item = agent.locator(".item.waiting")
        await expect(item).to_have_count(1)
        await expect(item.locator(".reason")).to_have_text(re.compile(r"The customer is upset \(mood -1\.00"))
        await expect(agent.locator("#queue")).to_have_text("1 conversation waits for a person")
        [seen] = await agent.evaluate("window.queueSeen")
        latency = seen["at"] / 1000 - seen["since"]
        print(f"\nagent saw the waiting conversation {latency * 1000:.0f} ms after the hand-off fired")
        assert latency < 1.0, f"the agent saw the waiting conversation {latency:.3f} s after the trigger"
        await item.click()
        await expect(agent.locator("#handoff")).to_contain_text("The customer is upset")
        await expect(agent.locator("#handoff")).not_to_contain_text("null")
        await customer.screenshot(path=readme_shot("widget-handoff.png"))
        await agent.screenshot(path=readme_shot("console-queue.png"))

        # the bot is silent meanwhile: the customer's next message goes to the team
        await send(customer, "Hello? Is anyone there?")
        await expect(customer.locator(".rt-sent").last).to_have_text("Sent to the team.")
        await expect(agent.locator(".msg-user").last.locator(".tag-routed")).to_be_visible()

        # an agent takes over and answers: the wait ends, the customer reads the agent's reply
        await agent.get_by_role("button", name="Take over").click()
        await expect(customer.locator(".rt-agent-banner")).to_have_text(re.compile("Sam, a human agent"))
        await expect(banner).to_be_hidden()
        await expect(agent.locator(".item.waiting")).to_have_count(0)
        await expect(agent.locator("#handoff")).to_be_hidden()
        reply = agent.get_by_label("Reply to the customer", exact=True)
        await reply.fill("Hi, I'm Sam. I'm sorry <b>about</b> that, let me look at your order.")
        await reply.press("Enter")
        await expect(customer.locator(".rt-agent .rt-body")).to_have_text(
            "Hi, I'm Sam. I'm sorry <b>about</b> that, let me look at your order."
        )
        for page in (customer, agent):
            assert not page.js_errors, page.js_errors


@pytest.mark.slow
async def test_out_of_hours_the_customer_leaves_an_email_for_the_agent(smol, browser):  # noqa: F811
    from playwright.async_api import expect

    paris = "Europe/Paris"
    app, settings = handoff_app(smol, copilot=False, days=closed_today(paris), timezone=paris)
    async with serve(app, settings) as (base, url):
        agent = await agent_page(browser, base)
        customer = await new_page(browser, viewport={"width": 460, "height": 720})
        await customer.goto(base + "/")
        await open_widget(customer)
        await send(customer, "Can I talk to a human please?")
        banner = customer.locator(".rt-handoff")
        await expect(banner.locator(".rt-handoff-line")).to_have_text(re.compile("We're closed right now"))
        form = customer.locator(".rt-email-form")
        await expect(form).to_be_visible()
        await expect(banner.locator(".rt-handoff-place")).to_be_hidden()
        # a hostile address: the server's clear error shows by the form, nothing is kept
        box = customer.get_by_label("Leave your e-mail and a person will write back:")
        await box.fill('"><img src=x onerror="window.pwned=1">@example.com')
        await customer.get_by_role("button", name="Leave e-mail").click()
        await expect(customer.locator(".rt-email-error")).to_have_text(
            "Please enter a valid e-mail address, like name@example.com."
        )
        await box.fill("dana@example.com")
        await customer.get_by_role("button", name="Leave e-mail").click()
        await expect(customer.locator(".rt-email-thanks")).to_have_text(
            "Thanks! A person will write to dana@example.com."
        )
        await expect(form).to_be_hidden()
        # the agent sees the conversation waiting out of hours, with the e-mail
        item = agent.locator(".item.waiting")
        await expect(item.locator(".waiting-badge")).to_have_text("Waiting · out of hours")
        await expect(item.locator(".email")).to_have_text("dana@example.com")
        await item.click()
        await expect(agent.locator(".handoff-email")).to_have_text("E-mail: dana@example.com")
        await customer.screenshot(path=shot("widget-handoff-email.png"))
        await agent.screenshot(path=shot("console-queue-email.png"))
        for page in (customer, agent):
            assert await page.evaluate("window.pwned") is None
            assert not page.js_errors, page.js_errors
