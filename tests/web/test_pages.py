"""The chat widget and the agent console in a real browser: Playwright for Python driving Debian's chromium.

Most tests run the real server with the scripted engine (fast, deterministic); one (`slow`) runs the
embedded model. Screenshots go to artifacts/ (git-ignored). Without chromium or playwright these
tests skip locally, and fail when RTSERVER_SLOW_TESTS=1 (CI), where they must run (tests/components.py).
"""

from __future__ import annotations

import asyncio
import os
import re
import threading
from pathlib import Path

import pytest

from rtserver.engine.backend import Overloaded
from rtserver.web.app import create_app

from ..components import missing
from ..serverutil import TIMEOUT, ScriptedEngine, make_settings, scripted_app, serve

pytestmark = pytest.mark.asyncio

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--disable-quic",
]
ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS = ROOT / "artifacts"
TOKEN = "console-test-token"
MS = TIMEOUT * 1000


def _browser_missing() -> str | None:
    absent = []
    try:
        import playwright.async_api  # noqa: F401
    except ImportError:
        absent.append("the 'playwright' pip package")
    if not os.path.exists(CHROMIUM):
        absent.append(CHROMIUM)
    return " and ".join(absent) or None


@pytest.fixture
async def browser():
    absent = _browser_missing()
    if absent:
        missing(absent, "pip install -e '.[test]' and apt-get install -y chromium (./run test installs both)")
    from playwright.async_api import async_playwright, expect

    expect.set_options(timeout=MS)
    async with async_playwright() as p:
        b = await p.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS, timeout=MS)
        try:
            yield b
        finally:
            await b.close()


async def new_page(browser, **context_options):
    context = await browser.new_context(**context_options)
    page = await context.new_page()
    page.set_default_timeout(MS)
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.js_errors = errors
    return page


def shot(name: str) -> str:
    ARTIFACTS.mkdir(exist_ok=True)
    return str(ARTIFACTS / name)


def scripted(smol, text: str, delay: float = 0.01, **sections) -> tuple:
    settings = make_settings(security={"console_token": TOKEN}, **sections)
    ids = smol.tokenizer.encode(text, add_special_tokens=False)
    engine = ScriptedEngine(smol, script=ids, delay=delay)
    return scripted_app(smol, settings, engine), settings, engine


# Records every text the newest bot bubble shows, to prove the reply arrives in pieces.
OBSERVE_STREAM = """() => {
  const root = document.querySelector('#rtserver-widget').shadowRoot;
  window.__seen = [];
  new MutationObserver(() => {
    const bodies = root.querySelectorAll('.rt-bot .rt-body');
    const last = bodies[bodies.length - 1];
    if (last && window.__seen[window.__seen.length - 1] !== last.textContent) window.__seen.push(last.textContent);
  }).observe(root.querySelector('.rt-log'), {childList: true, subtree: true, characterData: true});
}"""


async def open_widget(page):
    from playwright.async_api import expect

    await page.locator(".rt-launcher").click()
    await expect(page.locator(".rt-panel")).to_be_visible()
    await expect(page.locator(".rt-status")).to_have_text(re.compile("Online"))


async def send(page, text: str):
    box = page.get_by_label("Your message")
    await box.fill(text)
    await box.press("Enter")


async def test_widget_streams_then_reload_resumes(smol, browser):
    from playwright.async_api import expect

    reply = " Hello! I am the scripted assistant, streaming one token at a time."
    app, settings, engine = scripted(smol, reply, delay=0.02, tasks={"auto_tasks": []})
    engine.gate = asyncio.Event()
    async with serve(app, settings) as (base, url):
        page = await new_page(browser)
        await page.goto(base + "/")
        await expect(page.locator(".rt-launcher")).to_have_attribute("aria-expanded", "false")
        await open_widget(page)
        await expect(page.locator(".rt-bot").first).to_contain_text("demo assistant")  # the greeting
        await page.evaluate(OBSERVE_STREAM)
        await send(page, "Hi there")
        # queued/thinking until the first token (the engine is held by its gate)
        thinking = page.locator(".rt-thinking")
        await expect(thinking).to_be_visible()
        await expect(thinking).to_contain_text("Thinking")
        await expect(page.locator(".rt-stop")).to_be_visible()
        engine.gate.set()
        await expect(page.locator(".rt-bot .rt-body").last).to_have_text(reply.strip())
        await expect(page.locator(".rt-send")).to_be_visible()
        seen = await page.evaluate("window.__seen")
        partial = [s for s in seen if s and s != reply.strip() and not s.startswith("Thinking")]
        assert len(partial) >= 3, f"the reply did not stream token by token: {seen}"
        assert all(reply.lstrip().startswith(s.strip()) for s in partial)
        await page.screenshot(path=shot("widget-desktop.png"))
        stored = await page.evaluate("JSON.stringify(sessionStorage)")
        assert "session_id" in stored and "resume_token" in stored
        # reload: same session, history shown again
        await page.reload()
        await expect(page.locator(".rt-panel")).to_be_visible()
        await expect(page.locator(".rt-status")).to_have_text(re.compile("resumed"))
        await expect(page.locator(".rt-user")).to_have_text(re.compile("Hi there"))
        await expect(page.locator(".rt-bot").last).to_contain_text(reply.strip())
        await send(page, "Second message")
        await expect(page.locator(".rt-bot")).to_have_count(2)
        await expect(page.locator(".rt-bot").last).to_contain_text(reply.strip())
        # the second turn's prompt held the first turn: the server resumed the same session
        assert "Hi there" in smol.tokenizer.decode(engine.prompts[-1])
        assert not page.js_errors, page.js_errors


async def test_stop_cancels_the_reply(smol, browser):
    from playwright.async_api import expect

    app, settings, engine = scripted(smol, " word" * 400, delay=0.03, tasks={"auto_tasks": []})
    async with serve(app, settings) as (base, url):
        page = await new_page(browser)
        await page.goto(base + "/")
        await open_widget(page)
        await send(page, "Tell me a long story")
        await expect(page.locator(".rt-bot").last).to_contain_text("word word")
        await page.get_by_role("button", name="Stop the reply").click()
        await expect(page.locator(".rt-note")).to_have_text("(stopped)")
        await expect(page.locator(".rt-stop")).to_be_hidden()
        await expect(page.locator(".rt-send")).to_be_visible()
        assert engine.cancelled, "the server did not cancel the generation"
        words = (await page.locator(".rt-bot .rt-body").last.text_content()).split()
        assert 0 < len(words) < 400
        assert not page.js_errors, page.js_errors


HOST_PAGE = """<!doctype html><html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1"><title>Shop</title></head>
<body style="font-family: sans-serif; background: #fdf6ec"><h1>Some shop</h1><p>Any page can embed the chat.</p>
<script src="{base}/widget.js" defer data-server="{base}" data-title="Shop help" data-name="Dana"
        data-accent="#0f766e" data-accent-text="#ffffff"></script></body></html>"""

HTML_TEXT = 'I am angry <b>bold</b><img src=x onerror="window.pwned=1"><script>window.pwned=2</script>'
AGENT_TEXT = 'Hello, this is Sam <i>a human</i><img src=y onerror="window.pwned=3">'


async def test_console_take_over_reply_hand_back(smol, browser):
    from playwright.async_api import expect

    reply = " Sure, the bot can help with that."
    app, settings, engine = scripted(smol, reply)
    async with serve(app, settings) as (base, url):
        # the customer: the widget embedded on another site's page, configured by data- attributes
        # another origin (localhost, not 127.0.0.1) serves the host page; a page the test fulfils counts
        # as "public" to chromium, which then needs the local-network-access permission to reach 127.0.0.1
        customer = await new_page(browser, permissions=["local-network-access"])
        shop = base.replace("127.0.0.1", "localhost") + "/shop.html"
        await customer.route(
            shop,
            lambda route: route.fulfill(
                status=200, content_type="text/html", body=HOST_PAGE.format(base=base)
            ),
        )
        await customer.goto(shop)
        await expect(customer.locator(".rt-title")).to_be_hidden()
        await open_widget(customer)
        await expect(customer.locator(".rt-title")).to_have_text("Shop help")
        await send(customer, HTML_TEXT)
        await expect(customer.locator(".rt-bot").last).to_contain_text(reply.strip())
        await expect(customer.locator(".rt-user .rt-body")).to_have_text(HTML_TEXT)  # shown as text

        # the agent, in a second browser context
        agent = await new_page(browser, viewport={"width": 1280, "height": 800})
        await agent.goto(base + "/console")
        await agent.get_by_label("Console token").fill("wrong")
        await agent.get_by_label("Your name").fill("Sam")
        await agent.get_by_role("button", name="Sign in").click()
        await expect(agent.locator("#login-error")).to_have_text(re.compile("not right"))
        await agent.get_by_label("Console token").fill(TOKEN)
        await agent.get_by_role("button", name="Sign in").click()
        item = agent.locator(".item", has_text="Dana")
        await expect(item).to_be_visible()
        await expect(item.locator(".unread")).to_have_text("1")
        await expect(item.locator(".mood")).to_have_text(re.compile("Happy|Upset"))
        # filter by mood: the conversation shows under its own mood only
        mood = await item.locator(".mood").text_content()
        other_mood = "negative" if mood == "Happy" else "positive"
        await agent.get_by_label("Mood").select_option(other_mood)
        await expect(agent.locator(".item")).to_have_count(0)
        await expect(agent.locator("#empty")).to_have_text("No conversation matches this filter.")
        await agent.get_by_label("Mood").select_option("positive" if mood == "Happy" else "negative")
        await expect(item).to_be_visible()
        await agent.get_by_label("Sort").select_option("mood")
        await item.click()
        await expect(item.locator(".unread")).to_have_count(0)
        await expect(agent.locator("#conv-title")).to_have_text("Dana")
        user_msg = agent.locator(".msg-user").first
        await expect(user_msg.locator(".body")).to_have_text(HTML_TEXT)
        await expect(user_msg.locator(".tag").first).to_have_text(
            re.compile(r"sentiment: (positive|negative)")
        )
        await expect(agent.locator(".msg-bot").last).to_contain_text(reply.strip())

        # watch the bot's reply stream live
        await agent.evaluate("""() => { window.__live = [];
          new MutationObserver(() => { const s = document.querySelector('.msg-streaming .body');
            if (s && s.textContent) window.__live.push(s.textContent); })
          .observe(document.getElementById('messages'), {childList: true, subtree: true, characterData: true}); }""")
        await send(customer, "One more question")
        await expect(agent.locator(".msg-bot")).to_have_count(2)
        live = await agent.evaluate("window.__live")
        assert live and reply.strip().startswith(live[0]) and len(live[0]) < len(reply.strip()), live

        # take over: the widget shows that a human answers, the agent's reply reaches it as text
        await agent.get_by_role("button", name="Take over").click()
        await expect(agent.get_by_role("button", name="Hand back to bot")).to_be_visible()
        await expect(customer.locator(".rt-agent-banner")).to_have_text(re.compile("Sam, a human agent"))
        reply_box = agent.get_by_label("Reply to the customer", exact=True)
        await expect(reply_box).to_be_enabled()
        await reply_box.fill(AGENT_TEXT)
        await reply_box.press("Enter")
        await expect(customer.locator(".rt-agent .rt-body")).to_have_text(AGENT_TEXT)
        await expect(customer.locator(".rt-agent .rt-who")).to_have_text("Sam (agent)")
        prompts = len(engine.prompts)
        await send(customer, "Thanks Sam, can you refund me?")
        await expect(agent.locator(".msg-user").last).to_contain_text("refund")
        await expect(agent.locator(".msg-user").last.locator(".tag-routed")).to_be_visible()
        await expect(customer.locator(".rt-sent").last).to_have_text(re.compile("Sent to Sam"))
        assert len(engine.prompts) == prompts, "the bot answered while an agent held the conversation"
        await customer.screenshot(path=shot("widget-agent.png"))
        await agent.screenshot(path=shot("console.png"))

        # nothing the model, the user or the agent wrote became markup
        for page in (customer, agent):
            assert await page.evaluate("window.pwned") is None
        assert (
            await customer.evaluate(
                "document.querySelector('#rtserver-widget').shadowRoot.querySelectorAll('.rt-log img, .rt-log b, .rt-log i').length"
            )
            == 0
        )
        assert await agent.locator(".messages img, .messages b, .messages i").count() == 0

        # hand back: the bot answers again
        await agent.get_by_role("button", name="Hand back to bot").click()
        await expect(customer.locator(".rt-agent-banner")).to_be_hidden()
        await expect(customer.locator(".rt-system").last).to_have_text(re.compile("assistant again"))
        await send(customer, "Back to the bot")
        await expect(customer.locator(".rt-bot")).to_have_count(4)  # greeting + 3 replies
        await expect(customer.locator(".rt-bot").last).to_contain_text(reply.strip())
        await expect(agent.locator(".msg-bot")).to_have_count(3)

        # a second agent sees the same conversation (snapshot) and cannot take over while Sam holds it
        await agent.get_by_role("button", name="Take over").click()
        other = await new_page(browser)
        await other.goto(base + "/console")
        await other.get_by_label("Console token").fill(TOKEN)
        await other.get_by_label("Your name").fill("Kim")
        await other.get_by_role("button", name="Sign in").click()
        await other.locator(".item", has_text="Dana").click()
        await expect(other.locator(".msg-bot")).to_have_count(3)
        await expect(other.locator("#takeover")).to_have_text("Taken over by Sam")
        await expect(other.locator("#takeover")).to_be_disabled()
        for page in (customer, agent, other):
            assert not page.js_errors, page.js_errors


async def test_phone_screen_and_keyboard(smol, browser):
    from playwright.async_api import expect

    app, settings, engine = scripted(smol, " Short answer.", tasks={"auto_tasks": []})
    async with serve(app, settings) as (base, url):
        page = await new_page(
            browser,
            viewport={"width": 390, "height": 844},
            is_mobile=True,
            has_touch=True,
            device_scale_factor=2,
        )
        await page.goto(base + "/")
        # keyboard only: Tab to the launcher (after the page's link), Enter opens, focus goes to the input
        launcher = page.locator(".rt-launcher")
        for _ in range(10):
            await page.keyboard.press("Tab")
            if await launcher.evaluate("el => el.getRootNode().activeElement === el"):
                break
        else:
            pytest.fail("the launcher is not reachable with Tab")
        await page.keyboard.press("Enter")
        box = page.get_by_label("Your message")
        await expect(box).to_be_focused()
        await expect(page.get_by_role("dialog", name="Ask us anything")).to_be_visible()
        await expect(page.get_by_role("log", name="Conversation")).to_have_attribute("aria-live", "polite")
        await expect(page.locator(".rt-status")).to_have_text(re.compile("Online"))
        await page.keyboard.type("Hello from a phone")
        await page.keyboard.press("Enter")
        await expect(page.locator(".rt-bot").last).to_contain_text("Short answer.")
        panel = await page.locator(".rt-panel").bounding_box()
        assert panel["width"] == 390 and panel["height"] >= 800, panel  # the whole screen
        send_btn = await page.locator(".rt-send").bounding_box()
        assert send_btn["x"] + send_btn["width"] <= 390 and send_btn["y"] + send_btn["height"] <= 844
        await page.screenshot(path=shot("widget-phone.png"))
        await page.keyboard.press("Escape")
        await expect(page.locator(".rt-panel")).to_be_hidden()
        await expect(launcher).to_be_focused()
        assert not page.js_errors, page.js_errors


class OverloadedEngine(ScriptedEngine):
    def generate(self, *args, **kwargs):
        raise Overloaded("waiting queue full")


async def test_friendly_loading_and_overloaded_states(smol, browser):
    from playwright.async_api import expect

    settings = make_settings(tasks={"auto_tasks": []})
    loaded = threading.Event()

    def slow_loader():
        assert loaded.wait(TIMEOUT)
        return smol

    app = create_app(settings, slow_loader, engine_factory=lambda loaded_, s: OverloadedEngine(smol))
    async with serve(app, settings, wait_ready=False) as (base, url):
        page = await new_page(browser)
        await page.goto(base + "/")
        await page.locator(".rt-launcher").click()
        # the model is loading: a friendly note, and the widget retries with backoff until it is ready
        await expect(page.locator(".rt-notice")).to_have_text(re.compile("starting up"))
        await expect(page.locator(".rt-status")).to_have_text(re.compile("reconnecting in"))
        loaded.set()
        await expect(page.locator(".rt-status")).to_have_text("Online")
        await expect(page.locator(".rt-notice")).to_be_hidden()
        await send(page, "hello?")
        await expect(page.locator(".rt-notice")).to_have_text(re.compile("Lots of people are chatting"))
        await expect(page.locator(".rt-thinking")).to_have_count(0)
        await expect(page.locator(".rt-send")).to_be_visible()
        assert not page.js_errors, page.js_errors


@pytest.mark.slow
async def test_widget_with_the_real_model(smol, browser):
    from playwright.async_api import expect

    settings = make_settings(security={"console_token": TOKEN})
    settings.chat.max_new_tokens = 24
    async with serve(create_app(settings, lambda: smol), settings) as (base, url):
        page = await new_page(browser)
        await page.goto(base + "/")
        await open_widget(page)
        await page.evaluate(OBSERVE_STREAM)
        await send(page, "What is the capital of France?")
        await expect(page.locator(".rt-send")).to_be_visible()
        await expect(page.locator(".rt-thinking")).to_have_count(0)
        text = (await page.locator(".rt-bot .rt-body").last.text_content()).strip()
        assert text and not text.startswith("Thinking"), text
        seen = [s for s in await page.evaluate("window.__seen") if s and not s.startswith("Thinking")]
        assert len(seen) >= 2, f"the reply did not stream: {seen}"
        await page.screenshot(path=shot("widget-real-model.png"))
        # the console shows the conversation and the real sentiment of the message
        agent = await new_page(browser, viewport={"width": 1280, "height": 800})
        await agent.goto(base + "/console")
        await agent.get_by_label("Console token").fill(TOKEN)
        await agent.get_by_role("button", name="Sign in").click()
        await agent.locator(".item").first.click()
        await expect(agent.locator(".msg-user .tag").first).to_have_text(re.compile(r"sentiment: \w+"))
        await expect(agent.locator(".msg-bot .body")).to_have_text(text)
        await agent.screenshot(path=shot("console-real-model.png"))
        assert not page.js_errors and not agent.js_errors, (page.js_errors, agent.js_errors)


# Every text a streaming draft showed while it was being written, recorded in the page.
WATCH_WRITING = """() => {
  window.sawWriting = [];
  new MutationObserver(() => {
    for (const e of document.querySelectorAll(".draft.writing")) window.sawWriting.push(e.textContent);
  }).observe(document.getElementById("drafts-list"), { childList: true, subtree: true });
}"""


async def test_console_copilot_drafts_summary_translation_and_fields(smol, browser):
    """The agent's copilot on the embedded model: opening a conversation streams reply drafts (shown
    as they are written, then the finished ones to click) and fills the fields panel; taking over heads it with a summary; a draft clicked lands in the reply box, is
    edited, translated to the customer's language (French, found by the `language` task) and sent,
    and reaches the widget; the translate toggle shows the customer's message in English under it.
    Everything the model wrote is shown as text."""
    from playwright.async_api import expect

    plugins = [str(ROOT / "plugins"), str(ROOT / "examples" / "plugins")]
    settings = make_settings(
        security={"console_token": TOKEN},
        tasks={"auto_tasks": [], "learned_heads": False, "plugin_dirs": plugins},
    )
    settings.chat.max_new_tokens = 16
    settings.task = {
        "suggest_reply": {"max_new_tokens": 40},
        "translate_reply": {"max_new_tokens": 40},
        "summarize": {"max_chars": 80},
    }
    async with serve(create_app(settings, lambda: smol), settings) as (base, url):
        customer = await new_page(browser)
        await customer.goto(base + "/")
        await open_widget(customer)
        await send(customer, "Bonjour, ma commande AB-1234 n'est pas arrivée. Mon e-mail: jean@example.fr")
        await expect(customer.locator(".rt-send")).to_be_visible()
        await expect(customer.locator(".rt-thinking")).to_have_count(0)

        agent = await new_page(browser, viewport={"width": 1280, "height": 860})
        await agent.goto(base + "/console")
        await agent.get_by_label("Console token").fill(TOKEN)
        await agent.get_by_label("Your name").fill("Sam")
        await agent.get_by_role("button", name="Sign in").click()
        await agent.evaluate(WATCH_WRITING)
        await agent.locator(".item").first.click()
        # opening: drafts stream in under the conversation, the fields panel fills
        drafts = agent.locator("button.draft")
        await expect(drafts.first).to_be_visible()
        assert 1 <= await drafts.count() <= 3
        written = [" ".join(w.split()).strip('"') for w in await agent.evaluate("window.sawWriting")]
        for text in await drafts.all_text_contents():  # each finished draft was shown as it was written
            assert any(w.startswith(text) for w in written), (text, written)
        await expect(agent.locator("#fields-list dt")).to_have_count(3)
        await expect(agent.locator("#fields-list dt").first).to_have_text("order number")
        # take over: the summary heads the conversation
        await agent.get_by_role("button", name="Take over").click()
        await expect(agent.locator("#summary")).to_contain_text("Issue:")
        await expect(agent.locator("#summary")).to_contain_text("Mood:")
        # translate: the customer's message gets its English line
        await agent.get_by_label("Translate").check()
        await expect(agent.locator(".msg-user .translation")).not_to_have_text(re.compile("translating…"))
        translated = await agent.locator(".msg-user .translation").first.text_content()
        assert translated and not translated.startswith("(not translated"), translated
        # one click puts a draft in the reply box; edited, it is sent and reaches the widget
        first = (await drafts.first.text_content()) or ""
        await drafts.first.click()
        reply_box = agent.get_by_label("Reply to the customer", exact=True)
        await expect(reply_box).to_have_value(first)
        await reply_box.press("End")
        await reply_box.type(" — Sam")
        await reply_box.press("Enter")
        await expect(customer.locator(".rt-agent .rt-body")).to_have_text((first + " — Sam").strip())
        # a reply the agent writes in English goes out in the customer's language
        english = "We will send your order today."
        await reply_box.fill(english)
        await agent.get_by_role("button", name="Translate for the customer").click()
        await expect(agent.locator("#reply-note")).to_have_text("In French: check it, then send.")
        translated_reply = (await reply_box.input_value()).strip()
        assert translated_reply and translated_reply != english, translated_reply
        await reply_box.press("Enter")
        await expect(customer.locator(".rt-agent .rt-body").last).to_have_text(translated_reply)
        await agent.screenshot(path=shot("console-copilot.png"))
        assert await agent.locator(".drafts img, .summary img, .fields img").count() == 0
        assert not customer.js_errors and not agent.js_errors, (customer.js_errors, agent.js_errors)


CLUSTER_PAGE = """<!doctype html><html lang="en"><head><meta charset="utf-8"><title>Shop</title></head>
<body><h1>Some shop</h1>
<script src="{a}/widget.js" defer data-servers="{a},{b}" data-name="Dana"></script></body></html>"""


@pytest.mark.slow
async def test_widget_resumes_on_the_other_node_after_sigkill(browser, tmp_path):
    """Two real nodes (the embedded model) and a real redis-server: the widget, given both URLs, chats
    on node A; A is SIGKILLed; the widget reconnects by itself to B with its session — the history is
    shown again and the next reply is computed from it."""
    from playwright.async_api import expect

    from rtbench.serverproc import RedisProcess, ServerProcess

    from ..clusterutil import redis_binary

    redis = RedisProcess(tmp_path / "redis", binary=redis_binary())
    redis.start()
    config = tmp_path / "config.toml"
    config.write_text("[chat]\nmax_new_tokens = 12\n")
    env = {
        "RTSERVER_CLUSTER_REDIS_URL": redis.url,
        "RTSERVER_SERVER_LOG_LEVEL": "warning",
        "RTSERVER_TASKS_AUTO_TASKS": "",
        "RTSERVER_MODEL_THREADS": "1",
    }
    a = ServerProcess(env, tmp_path / "a.log", str(config))
    b = ServerProcess(env, tmp_path / "b.log", str(config))
    try:
        await asyncio.gather(asyncio.to_thread(a.start, 300), asyncio.to_thread(b.start, 300))
        page = await new_page(browser, permissions=["local-network-access"])
        shop = f"http://localhost:{a.port}/shop.html"
        body = CLUSTER_PAGE.format(a=a.base, b=b.base)
        await page.route(shop, lambda route: route.fulfill(status=200, content_type="text/html", body=body))
        await page.goto(shop)
        await open_widget(page)
        await send(page, "My name is Zorblax. Say hi.")
        await expect(page.locator(".rt-send")).to_be_visible()
        await expect(page.locator(".rt-thinking")).to_have_count(0)
        first_reply = (await page.locator(".rt-bot .rt-body").last.text_content()).strip()
        assert first_reply and not first_reply.startswith("Thinking"), first_reply
        stored = await page.evaluate("JSON.stringify(sessionStorage)")
        assert "session_id" in stored
        a.proc.kill()  # SIGKILL: node A is gone without a word
        a.proc.wait()
        await expect(page.locator(".rt-status")).to_have_text(re.compile("resumed"), timeout=MS)
        # the history, as node B read it from Redis: the message and the reply, no greeting
        await expect(page.locator(".rt-user .rt-body")).to_have_text(["My name is Zorblax. Say hi."])
        await expect(page.locator(".rt-bot .rt-body")).to_have_text([first_reply])
        await send(page, "What is my name?")
        await expect(page.locator(".rt-user .rt-body")).to_have_count(2)
        await expect(page.locator(".rt-send")).to_be_visible()
        await expect(page.locator(".rt-thinking")).to_have_count(0)
        await expect(page.locator(".rt-bot .rt-body")).to_have_count(2)
        await page.screenshot(path=shot("widget-cluster-resumed.png"))
        assert not page.js_errors, page.js_errors
        # node B served the second turn, rendered from the stored first one
        metrics = b.metrics()
        assert metrics.get("rtserver_cluster_resumes_from_store_total", 0) >= 1, metrics
        assert metrics.get("rtserver_cluster_session_writes_total", 0) >= 2
    finally:
        for p in (a, b):
            if p.proc is not None and p.proc.poll() is None:
                p.proc.kill()
                p.proc.wait()
        redis.stop()
