/*
 * rtserver chat widget: one script tag embeds a floating chat box on any page.
 *
 *   <script src="https://chat.example.com/widget.js" defer
 *           data-server="https://chat.example.com"   (default: where widget.js came from)
 *           data-servers="https://a.example.com,https://b.example.com"   (several nodes of one cluster:
 *                                                    each reconnect tries the next; the session follows)
 *           data-title="Ask us anything"             (header title)
 *           data-accent="#4f46e5" data-accent-text="#ffffff"   (colours)
 *           data-position="right"                    (right | left)
 *           data-name="Jane"                         (customer name shown to agents)
 *           data-greeting="Hi! How can we help?"
 *           data-open="false"></script>              (start open)
 *
 * Protocol: docs/protocol.md (/ws). Text from the user, the model or an agent only ever reaches the
 * DOM through textContent; nothing here uses innerHTML.
 */
(function () {
  "use strict";

  const script = document.currentScript ||
    document.querySelector("script[data-rtserver], script[src*='widget.js']");
  if (!script) return;
  if (window.__rtserverWidget) return; // one widget per page
  const ds = script.dataset;
  const scriptUrl = new URL(script.src || "widget.js", location.href);
  const servers = (ds.servers ? ds.servers.split(",").map((u) => u.trim()).filter(Boolean)
    : [ds.server || scriptUrl.origin + "/"]).map((u) => new URL(u, location.href));
  const server = servers[0];
  let serverIndex = 0;  // which of `servers` the next connection goes to
  function wsUrlFor(sessionId) {
    const s = servers[serverIndex % servers.length];
    // the session id in the URL lets a load balancer route it to the node whose KV is warm
    return (s.protocol === "https:" ? "wss://" : "ws://") + s.host + s.pathname.replace(/\/+$/, "") +
      "/ws" + (sessionId ? "?session=" + encodeURIComponent(sessionId) : "");
  }
  const storeKey = "rtserver:" + server.host + server.pathname;  // one key for every node of a cluster
  const cfg = {
    title: ds.title || "Chat with us",
    accent: ds.accent || "#4f46e5",
    accentText: ds.accentText || "#ffffff",
    position: ds.position === "left" ? "left" : "right",
    name: ds.name || "",
    greeting: ds.greeting || "Hi! Ask me anything.",
    open: ds.open === "true",
  };

  const FRIENDLY = {
    overloaded: "Lots of people are chatting right now. Please try again in a moment.",
    rate_limited: "You're sending messages a little too quickly. Please wait a few seconds and try again.",
    not_ready: "The assistant is still starting up. We'll connect as soon as it's ready…",
    loading: "The assistant is still starting up. We'll connect as soon as it's ready…",
    chat_busy: "Please wait for the current reply to finish (or stop it) before sending another message.",
    input_too_long: "That message is too long. Please shorten it.",
    request_too_large: "That message is too long for this conversation. Please shorten it.",
    empty_text: "Please type a message first.",
    too_many_requests: "Please wait for the current reply to finish.",
    unauthorized: "This chat is not available on this page.",
    internal: "Sorry, something went wrong. Please try again.",
    shutting_down: "The assistant is restarting. We'll reconnect in a moment…",
    too_many_sessions: "Too many chats are open from your network. Please close one and try again.",
    unavailable: "The chat is briefly unavailable. We'll reconnect in a moment…",
    server_full: "Lots of people are chatting right now. We'll connect you in a moment…",
    sessions_full: "Lots of people are chatting right now. We'll connect you in a moment…",
    over_budget: "Lots of people are chatting right now. Please try again in a moment.",
  };

  // -- DOM helpers (no innerHTML anywhere) ---------------------------------------------------
  function el(tag, attrs, ...children) {
    const node = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (v === null || v === undefined || v === false) continue;
      if (k === "class") node.className = v;
      else if (k === "text") node.textContent = v;
      else node.setAttribute(k, v === true ? "" : String(v));
    }
    for (const c of children) if (c) node.append(c);
    return node;
  }

  // -- the widget's DOM, in a shadow root so the host page's CSS cannot break it ----------------
  const host = el("div", { id: "rtserver-widget", "data-rtserver-widget": "" });
  host.style.setProperty("--rt-accent", cfg.accent);
  host.style.setProperty("--rt-accent-text", cfg.accentText);
  host.classList.add("rt-pos-" + cfg.position);
  const root = host.attachShadow({ mode: "open" });
  root.append(el("link", { rel: "stylesheet", href: new URL("widget.css", scriptUrl).href }));

  const uid = "rtw" + Math.random().toString(36).slice(2, 8);
  const launcher = el("button", { class: "rt-launcher", type: "button", "aria-expanded": "false",
    "aria-controls": uid + "-panel", "aria-label": "Open chat: " + cfg.title });
  launcher.append(el("span", { class: "rt-launcher-icon", "aria-hidden": "true", text: "💬" }),
    el("span", { class: "rt-launcher-text", text: "Chat" }));

  const titleEl = el("h2", { class: "rt-title", id: uid + "-title", text: cfg.title });
  const statusEl = el("p", { class: "rt-status", id: uid + "-status", role: "status", text: "Connecting…" });
  const closeBtn = el("button", { class: "rt-icon-btn rt-close", type: "button", "aria-label": "Close chat",
    text: "✕" });
  const newBtn = el("button", { class: "rt-icon-btn rt-new", type: "button", "aria-label": "Start a new conversation",
    title: "New conversation", text: "↺" });
  const header = el("header", { class: "rt-header" },
    el("div", { class: "rt-heading" }, titleEl, statusEl), newBtn, closeBtn);
  const agentBanner = el("p", { class: "rt-agent-banner", hidden: true, role: "status" });
  // hand-off to people: who is coming, the place in the queue, the e-mail form when nobody answers now
  const handoffLine = el("p", { class: "rt-handoff-line", role: "status" });
  const placeLine = el("p", { class: "rt-handoff-place", hidden: true });
  const emailInput = el("input", { class: "rt-email", id: uid + "-email", type: "email", maxlength: "254",
    autocomplete: "email", placeholder: "name@example.com", required: true });
  const emailError = el("p", { class: "rt-email-error", role: "alert", hidden: true });
  // novalidate: the server checks the address and its error is shown here, the same in every browser
  const emailForm = el("form", { class: "rt-email-form", hidden: true, novalidate: true,
    "aria-label": "Leave your e-mail" },
    el("label", { for: uid + "-email", text: "Leave your e-mail and a person will write back:" }),
    el("span", { class: "rt-email-row" }, emailInput,
      el("button", { class: "rt-email-send", type: "submit", text: "Leave e-mail" })),
    emailError);
  const emailThanks = el("p", { class: "rt-email-thanks", hidden: true, role: "status" });
  const handoffBox = el("section", { class: "rt-handoff", hidden: true, "aria-label": "Waiting for a person" },
    handoffLine, placeLine, emailForm, emailThanks);
  const log = el("ol", { class: "rt-log", role: "log", "aria-live": "polite", "aria-relevant": "additions text",
    "aria-label": "Conversation", tabindex: "0" });
  const notice = el("p", { class: "rt-notice", role: "alert", hidden: true });
  const input = el("textarea", { class: "rt-input", id: uid + "-input", rows: "1", maxlength: "4000",
    placeholder: "Type your message…", autocomplete: "off" });
  const inputLabel = el("label", { class: "rt-sr-only", for: uid + "-input", text: "Your message" });
  const sendBtn = el("button", { class: "rt-send", type: "submit", text: "Send" });
  const stopBtn = el("button", { class: "rt-stop", type: "button", hidden: true, text: "Stop",
    "aria-label": "Stop the reply" });
  const hint = el("p", { class: "rt-sr-only", id: uid + "-hint",
    text: "Press Enter to send, Shift+Enter for a new line." });
  input.setAttribute("aria-describedby", uid + "-hint");
  const form = el("form", { class: "rt-form", "aria-label": "Send a message" },
    inputLabel, hint, input, stopBtn, sendBtn);
  const panel = el("section", { class: "rt-panel", id: uid + "-panel", role: "dialog",
    "aria-labelledby": uid + "-title", hidden: true },
    header, agentBanner, handoffBox, log, notice, form);
  root.append(launcher, panel);

  // -- state ----------------------------------------------------------------------------------
  let ws = null;
  let connected = false;
  let backoff = 0; // attempts since the last good connection
  let retryTimer = null;
  let countdownTimer = null;
  let noReconnect = false;
  let current = null; // {id, li, body, started}
  let agentName = null;
  let counter = 0;
  // {outOfHours, email, agents, emailSent} while the conversation waits for a person, else null
  let waiting = null;

  function stored() {
    try { return JSON.parse(sessionStorage.getItem(storeKey) || "null"); } catch (e) { return null; }
  }
  function store(v) {
    try {
      if (v) sessionStorage.setItem(storeKey, JSON.stringify(v)); else sessionStorage.removeItem(storeKey);
    } catch (e) { /* storage disabled: no resume after reload */ }
  }

  function setStatus(text) { statusEl.textContent = text; }
  function showNotice(text) {
    notice.textContent = text || "";
    notice.hidden = !text;
  }

  function scrollDown() { log.scrollTop = log.scrollHeight; }

  function addMessage(role, text, opts) {
    opts = opts || {};
    const li = el("li", { class: "rt-msg rt-" + role });
    const who = role === "user" ? "You" : role === "agent" ? (opts.agent || "Agent") + " (agent)" :
      role === "system" ? "" : "Assistant";
    if (who) li.append(el("span", { class: "rt-who", text: who }));
    const body = el("span", { class: "rt-body" });
    body.textContent = text || "";
    li.append(body);
    log.append(li);
    scrollDown();
    return { li, body };
  }

  // A knowledge reply's citations: its "Sources: [n]" ending becomes a list of the articles, each a link
  // when its URL is http(s); titles are text, never markup.
  function showSources(c, sources) {
    c.body.textContent = c.body.textContent.replace(/\s*Sources: \[\d+\](?:, \[\d+\])*$/, "");
    if (!sources.length) return;
    const list = el("ol", { class: "rt-sources", "aria-label": "Sources" });
    for (const s of sources) {
      if (!s || typeof s !== "object") continue;
      const label = "[" + Number(s.n) + "] " + String(s.title || s.id || "article");
      const url = typeof s.url === "string" ? s.url : "";
      let safe = null;
      try { safe = /^https?:$/.test(new URL(url).protocol) ? url : null; } catch (e) { safe = null; }
      const item = safe ? el("a", { href: safe, target: "_blank", rel: "noopener noreferrer", text: label }) :
        el("span", { text: label });
      list.append(el("li", {}, item));
    }
    c.li.append(el("span", { class: "rt-sources-label", text: "Sources" }), list);
  }

  function setBusy(busy) {
    stopBtn.hidden = !busy;
    sendBtn.hidden = busy;
  }

  function updateControls() {
    const ok = connected && !current;
    sendBtn.disabled = !ok;
    input.setAttribute("aria-disabled", connected ? "false" : "true");
  }

  function endThinking(c) {  // the first text replaces the "thinking" dots
    if (!c.li.classList.contains("rt-thinking")) return;
    c.li.classList.remove("rt-thinking");
    c.body.textContent = "";
  }

  function finishCurrent(note) {
    if (!current) return;
    const c = current;
    current = null;
    c.li.classList.remove("rt-thinking");
    c.li.removeAttribute("aria-busy");
    if (!c.body.textContent) {
      if (note) c.body.textContent = note; else c.li.remove();
    } else if (note) {
      c.li.append(el("span", { class: "rt-note", text: note }));
    }
    setBusy(false);
    updateControls();
  }

  function setAgent(name) {
    agentName = name || null;
    agentBanner.hidden = !agentName;
    agentBanner.textContent = agentName ? agentName + ", a human agent, is answering you." : "";
    panel.classList.toggle("rt-with-agent", !!agentName);
  }

  function renderWaiting() {
    handoffBox.hidden = !waiting;
    if (!waiting) return;
    const nobody = waiting.outOfHours || waiting.agents === 0;
    handoffLine.textContent = waiting.outOfHours ? "We're closed right now, so no one can answer at the moment." :
      waiting.agents === 0 ? "No one is available right now." : "A person will join this conversation soon.";
    placeLine.hidden = !(waiting.place && waiting.agents > 0 && !waiting.outOfHours);
    placeLine.textContent = waiting.place === 1 ? "You're next in line." :
      "You're number " + waiting.place + " in line.";
    emailForm.hidden = !nobody || !!waiting.email;
    emailThanks.hidden = !waiting.email;
    emailThanks.textContent = waiting.email ? "Thanks! A person will write to " + waiting.email + "." : "";
  }

  function setWaiting(event) {
    if (!event) { waiting = null; renderWaiting(); return; }
    waiting = Object.assign(waiting || { agents: null, place: null }, {
      outOfHours: !!event.out_of_hours, email: event.email || null });
    if (waiting.email) { waiting.emailSent = false; emailError.hidden = true; }
    renderWaiting();
  }

  function sendEmail() {
    const email = emailInput.value.trim();
    if (!email || !ws || !connected) return;
    emailError.hidden = true;
    waiting.emailSent = true;
    ws.send(JSON.stringify({ type: "handoff_email", email }));
  }

  function renderHistory(history) {
    log.replaceChildren();
    if (!history || !history.length) {
      addMessage("bot", cfg.greeting);
      return;
    }
    for (const m of history) {
      const role = m.role === "user" ? "user" : m.agent ? "agent" : "bot";
      addMessage(role, role === "user" ? m.content : m.content.trim(), { agent: m.agent });
    }
  }

  // -- connection -----------------------------------------------------------------------------
  function connect() {
    clearTimeout(retryTimer);
    clearInterval(countdownTimer);
    if (ws) return;
    setStatus(backoff ? "Reconnecting…" : "Connecting…");
    let sock;
    const saved = stored();
    try { sock = new WebSocket(wsUrlFor(saved && saved.session_id)); } catch (e) { scheduleReconnect(); return; }
    ws = sock;
    sock.onopen = () => {
      const s = stored();
      const hello = { type: "hello" };
      if (s && s.session_id && s.resume_token) {
        hello.session_id = s.session_id;
        hello.resume_token = s.resume_token;
      }
      if (cfg.name) hello.client = cfg.name;
      sock.send(JSON.stringify(hello));
    };
    sock.onmessage = (ev) => {
      let msg;
      try { msg = JSON.parse(ev.data); } catch (e) { return; }
      onEvent(msg);
    };
    sock.onclose = (ev) => {
      if (ws !== sock) return;
      ws = null;
      connected = false;
      if (current) finishCurrent("(interrupted)");
      updateControls();
      if (ev.code === 4409) {
        noReconnect = true;
        setStatus("Disconnected");
        showNotice("This conversation was continued in another window.");
        addReconnectButton();
        return;
      }
      if (ev.code === 4401) {
        noReconnect = true;
        setStatus("Unavailable");
        showNotice(FRIENDLY.unauthorized);
        return;
      }
      if (ev.code === 4429 || ev.code === 1008) {  // too many sessions / page not allowed
        noReconnect = true;
        setStatus("Unavailable");
        showNotice(ev.code === 4429 ? FRIENDLY.too_many_sessions : FRIENDLY.unauthorized);
        return;
      }
      // 1013: starting up, or full (the error event before the close said which)
      const said = [FRIENDLY.unavailable, FRIENDLY.server_full];
      if (ev.code === 1013 && !said.includes(notice.textContent)) showNotice(FRIENDLY.loading);
      if (!noReconnect) scheduleReconnect();
    };
  }

  function addReconnectButton() {
    const btn = el("button", { class: "rt-reconnect", type: "button", text: "Continue here" });
    btn.addEventListener("click", () => {
      btn.remove();
      showNotice("");
      noReconnect = false;
      backoff = 0;
      connect();
    });
    notice.append(" ", btn);
  }

  function scheduleReconnect() {
    serverIndex += 1;  // several servers: the next one (its node may be the one that went away)
    const delay = Math.min(30000, 500 * Math.pow(2, backoff)) * (0.8 + Math.random() * 0.4);
    backoff += 1;
    let left = Math.ceil(delay / 1000);
    setStatus("Offline — reconnecting in " + left + " s");
    clearInterval(countdownTimer);
    countdownTimer = setInterval(() => {
      left -= 1;
      if (left > 0) setStatus("Offline — reconnecting in " + left + " s");
    }, 1000);
    retryTimer = setTimeout(connect, delay);
  }

  function onEvent(msg) {
    switch (msg.type) {
      case "ready": {
        connected = true;
        backoff = 0;
        store({ session_id: msg.session_id, resume_token: msg.resume_token });
        if (msg.resumed || !log.children.length || msg.history && msg.history.length) {
          renderHistory(msg.history);
        }
        if (msg.resumed && msg.history && msg.history.length) {
          setStatus("Online — conversation resumed");
        } else {
          setStatus("Online");
        }
        if (notice.textContent === FRIENDLY.loading) showNotice("");
        setAgent(msg.agent);
        updateControls();
        break;
      }
      case "token": {
        if (!current || msg.id !== current.id) return;
        endThinking(current);
        // a reply's leading whitespace (common in model output) is not worth showing
        current.body.textContent = current.body.textContent ? current.body.textContent + msg.text :
          msg.text.replace(/^\s+/, "");
        scrollDown();
        break;
      }
      case "done": {
        if (!current || msg.id !== current.id) return;
        endThinking(current);
        current.body.textContent = msg.text.trim();
        if (Array.isArray(msg.sources)) showSources(current, msg.sources);
        finishCurrent(msg.finish_reason === "cancelled" ? "(stopped)" : null);
        break;
      }
      case "forwarded": {
        if (current && msg.id === current.id) {
          if (current.li.classList.contains("rt-sent")) {
            current.body.textContent = "Sent to " + (msg.agent || agentName || "the team") + ".";
          } else {
            current.li.remove(); // the bot was asked, but a human took over meanwhile
          }
          current = null;
          setBusy(false);
          updateControls();
        }
        break;
      }
      case "handoff": {
        if (msg.state === "waiting") {
          if (!waiting) addMessage("system", "We're bringing in a person to help you.");
          setWaiting(msg);
        } else {
          setWaiting(null);
        }
        break;
      }
      case "queue_position": {
        if (!waiting) return;
        waiting.place = msg.position;
        waiting.agents = msg.agents_online;
        renderWaiting();
        break;
      }
      case "handover": {
        setWaiting(null);
        if (msg.to === "agent") {
          setAgent(msg.agent || "An agent");
          addMessage("system", (msg.agent || "An agent") + " joined the conversation.");
        } else {
          setAgent(null);
          addMessage("system", "You're chatting with the assistant again.");
        }
        break;
      }
      case "agent_message": {
        if (!agentName && msg.agent) setAgent(msg.agent);
        addMessage("agent", msg.text, { agent: msg.agent });
        break;
      }
      case "reset": {
        renderHistory([]);
        setWaiting(null);
        break;
      }
      case "shutting_down": {
        showNotice(FRIENDLY.shutting_down);
        break;
      }
      case "error": {
        if (msg.auto) return; // an auto-task (e.g. sentiment) failed: nothing for the customer
        if (msg.code === "session_expired") {
          store(null);
          log.replaceChildren();
          showNotice("Your previous conversation has expired, so we started a new one.");
          return;
        }
        if (msg.code === "session_taken_over") return; // the close (4409) follows
        if (waiting && waiting.emailSent && !msg.id) {  // the e-mail was refused: say why by the form
          waiting.emailSent = false;
          emailError.textContent = msg.code === "not_waiting" ? "No one is waiting for this message any more." :
            "Please enter a valid e-mail address, like name@example.com.";
          emailError.hidden = false;
          emailInput.focus();
          return;
        }
        let text = FRIENDLY[msg.code] || FRIENDLY.internal;
        if ((msg.code === "rate_limited" || msg.code === "over_budget") && msg.retry_after_s) {
          text += " (" + Math.ceil(msg.retry_after_s) + " s)";
        }
        if (msg.code === "shutting_down" && current && msg.id === current.id) {
          finishCurrent("(interrupted)"); // keep what was written so far
          updateControls();
        }
        if (current && msg.id === current.id) {
          current.li.remove();
          current = null;
          setBusy(false);
          updateControls();
        }
        showNotice(text);
        break;
      }
      default:
        break;
    }
  }

  // -- user actions ---------------------------------------------------------------------------
  function send() {
    const text = input.value.trim();
    if (!text || !connected || current || !ws) return;
    showNotice("");
    counter += 1;
    const id = "w" + Date.now().toString(36) + counter;
    addMessage("user", text);
    input.value = "";
    autoGrow();
    if (!agentName && !waiting) {
      const pending = addMessage("bot", "Thinking…");
      pending.li.classList.add("rt-thinking");
      pending.li.setAttribute("aria-busy", "true");
      current = { id, li: pending.li, body: pending.body };
      setBusy(true);
    } else {
      // a human answers: no bot reply is coming; keep a placeholder until the server confirms
      const pending = addMessage("system", "Sending…");
      current = { id, li: pending.li, body: pending.body };
      pending.li.classList.add("rt-sent");
    }
    updateControls();
    ws.send(JSON.stringify({ type: "chat", id, text }));
  }

  function autoGrow() {
    input.style.height = "auto";
    input.style.height = Math.min(input.scrollHeight, 120) + "px";
  }

  form.addEventListener("submit", (ev) => { ev.preventDefault(); send(); });
  emailForm.addEventListener("submit", (ev) => { ev.preventDefault(); sendEmail(); });
  input.addEventListener("keydown", (ev) => {
    if (ev.key === "Enter" && !ev.shiftKey && !ev.isComposing) { ev.preventDefault(); send(); }
  });
  input.addEventListener("input", autoGrow);
  stopBtn.addEventListener("click", () => {
    if (current && ws && connected) ws.send(JSON.stringify({ type: "cancel", id: current.id }));
    input.focus();
  });
  newBtn.addEventListener("click", () => {
    if (ws && connected) ws.send(JSON.stringify({ type: "reset" }));
    input.focus();
  });

  function open() {
    panel.hidden = false;
    launcher.setAttribute("aria-expanded", "true");
    launcher.hidden = true;
    if (!ws && !noReconnect) connect();
    input.focus();
    scrollDown();
    try { sessionStorage.setItem(storeKey + ":open", "1"); } catch (e) { /* ignore */ }
  }
  function close() {
    panel.hidden = true;
    launcher.hidden = false;
    launcher.setAttribute("aria-expanded", "false");
    launcher.focus();
    try { sessionStorage.removeItem(storeKey + ":open"); } catch (e) { /* ignore */ }
  }
  launcher.addEventListener("click", open);
  closeBtn.addEventListener("click", close);
  panel.addEventListener("keydown", (ev) => { if (ev.key === "Escape") close(); });

  window.addEventListener("online", () => { if (!ws && !noReconnect) { backoff = 0; connect(); } });

  function mount() {
    document.body.append(host);
    updateControls();
    let wasOpen = false;
    try { wasOpen = sessionStorage.getItem(storeKey + ":open") === "1"; } catch (e) { /* ignore */ }
    // connect at once when a session is stored (resume after reload), else when first opened
    if (stored()) connect();
    if (cfg.open || wasOpen) open();
  }

  window.__rtserverWidget = { open, close, get connected() { return connected; } };
  if (document.body) mount(); else document.addEventListener("DOMContentLoaded", mount);
})();
