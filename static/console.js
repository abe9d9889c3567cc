// rtserver agent console: live list of conversations over /ws/console (docs/protocol.md), take over,
// reply, hand back, and the model's assist: reply drafts, a summary on take-over, translation, the
// fields read from the conversation. The server sends summaries and changes; a conversation's
// messages are asked for (`open`) when the agent opens it, older ones a page at a time. Text from
// customers, the bot, agents or the model only reaches the DOM via textContent.

const $ = (id) => document.getElementById(id);
const KEY = { token: "rtconsole:token", name: "rtconsole:name", rejoin: "rtconsole:rejoin", seen: "rtconsole:seen" };
const MOOD_TEXT = { negative: "Upset", neutral: "Neutral", positive: "Happy", unknown: "Not rated" };
const MOOD_RANK = { negative: 0, neutral: 1, unknown: 2, positive: 3 };

const state = {
  ws: null, me: null, convs: new Map(), selected: null, backoff: 0, retry: null, stopped: false,
  seen: load(KEY.seen, {}),
};
// Assist results per conversation: {drafts, fields, summary: {seq, output} | {seq, pending, error}},
// translations by message seq, and the calls in flight by request id. Drafts stream: while their call
// runs, `drafts.writing` holds each draft's text so far (from `assist_delta`).
const assist = { byConv: new Map(), translateOn: new Set(), pending: new Map(), next: 1, timer: null };

function load(key, dflt) {
  try { return JSON.parse(sessionStorage.getItem(key)) ?? dflt; } catch { return dflt; }
}
function save(key, value) {
  try { sessionStorage.setItem(key, typeof value === "string" ? value : JSON.stringify(value)); } catch { /* */ }
}
function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (v === null || v === undefined || v === false) continue;
    if (k === "class") node.className = v;
    else if (k === "text") node.textContent = v;
    else node.setAttribute(k, v === true ? "" : String(v));
  }
  for (const c of children) if (c !== null && c !== undefined) node.append(c);
  return node;
}
function time(ts) {
  return ts ? new Date(ts * 1000).toLocaleTimeString([], { hour: "2-digit", minute: "2-digit" }) : "";
}
function toast(text) {
  const t = $("toast");
  t.textContent = text;
  t.hidden = false;
  clearTimeout(toast.timer);
  toast.timer = setTimeout(() => { t.hidden = true; }, 6000);
}
function setConn(text) { $("conn").textContent = text; }
// A conversation as this page keeps it: the server's summary, plus the messages known so far.
function fresh(summary) {
  return { ...summary, messages: [], streaming: null, loaded: false, more: false };
}
function openConv(sid, before) {
  const msg = { type: "open", session_id: sid };
  if (before !== undefined) msg.before = before;
  sendWs(msg);
}

// -- login -------------------------------------------------------------------------------------
// The server names agents; the rejoin token it gave keeps this agent's id (and take-overs) on reconnect.
function showLogin(error) {
  $("login").hidden = false;
  $("app").hidden = true;
  $("logout").hidden = true;
  $("me").textContent = "";
  $("login-error").textContent = error || "";
  $("agent-name").value = sessionStorage.getItem(KEY.name) || "";
  setConn("Not signed in");
  $("token").focus();
}

$("login-form").addEventListener("submit", (ev) => {
  ev.preventDefault();
  save(KEY.token, $("token").value);
  save(KEY.name, $("agent-name").value.trim() || "Agent");
  $("token").value = "";
  state.stopped = false;
  state.backoff = 0;
  connect();
});
$("logout").addEventListener("click", () => {
  sessionStorage.removeItem(KEY.token);
  sessionStorage.removeItem(KEY.rejoin);
  state.stopped = true;
  if (state.ws) state.ws.close(1000);
  showLogin("");
});

// -- connection --------------------------------------------------------------------------------
function connect() {
  clearTimeout(state.retry);
  if (state.ws) return;
  const token = sessionStorage.getItem(KEY.token);
  if (!token) { showLogin(""); return; }
  setConn(state.backoff ? "Reconnecting…" : "Connecting…");
  const ws = new WebSocket((location.protocol === "https:" ? "wss://" : "ws://") + location.host + "/ws/console");
  state.ws = ws;
  ws.onopen = () => {
    const login = { type: "login", token, agent: sessionStorage.getItem(KEY.name) || "Agent" };
    const rejoin = sessionStorage.getItem(KEY.rejoin);
    if (rejoin) login.rejoin = rejoin;
    ws.send(JSON.stringify(login));
  };
  ws.onmessage = (ev) => {
    let msg;
    try { msg = JSON.parse(ev.data); } catch { return; }
    onEvent(msg);
  };
  ws.onclose = (ev) => {
    if (state.ws !== ws) return;
    state.ws = null;
    if (ev.code === 4401) {
      sessionStorage.removeItem(KEY.token);
      showLogin("That console token is not right.");
      return;
    }
    if (ev.code === 4429) {
      showLogin("Too many failed sign-ins from this address; wait a minute and try again.");
      return;
    }
    if (ev.code === 4403) {
      sessionStorage.removeItem(KEY.token);
      showLogin("The console is disabled on this server (security.console_token is empty).");
      return;
    }
    if (state.stopped) return;
    const delay = Math.min(30000, 500 * 2 ** state.backoff) * (0.8 + Math.random() * 0.4);
    state.backoff += 1;
    setConn(`Offline — reconnecting in ${Math.ceil(delay / 1000)} s`);
    state.retry = setTimeout(connect, delay);
  };
}

function onEvent(msg) {
  const conv = msg.session_id ? state.convs.get(msg.session_id) : null;
  switch (msg.type) {
    case "console_ready":
      state.me = msg.agent;
      if (msg.rejoin) save(KEY.rejoin, msg.rejoin);
      state.backoff = 0;
      state.convs = new Map(msg.conversations.map((c) => [c.session_id, fresh(c)]));
      if (state.convs.has(state.selected)) openConv(state.selected);
      $("login").hidden = true;
      $("app").hidden = false;
      $("logout").hidden = false;
      $("me").textContent = "Signed in as " + msg.agent.name;
      setConn("Live");
      renderList();
      renderConv();
      break;
    case "conversation": {
      const before = state.convs.get(msg.conversation.session_id);
      const tookOver = msg.conversation.agent && msg.conversation.agent.id === state.me?.id &&
        !(before && before.agent && before.agent.id === state.me?.id);
      state.convs.set(msg.conversation.session_id, before ? { ...before, ...msg.conversation } : fresh(msg.conversation));
      if (tookOver) ask(msg.conversation.session_id, "summarize", "summary");
      renderList();
      if (msg.conversation.session_id === state.selected) renderConv();
      break;
    }
    case "removed":
      state.convs.delete(msg.session_id);
      if (state.selected === msg.session_id) state.selected = null;
      renderList();
      renderConv();
      break;
    case "messages": {
      if (!conv) return;
      if (!conv.loaded) { // the newest page, then the live messages that came meanwhile
        const last = msg.messages.length ? msg.messages[msg.messages.length - 1].seq : 0;
        conv.messages = msg.messages.concat(conv.messages.filter((m) => m.seq > last));
        if (msg.streaming && !conv.streaming) conv.streaming = msg.streaming;
        conv.more = msg.more;
      } else { // an older page
        const first = conv.messages.length ? conv.messages[0].seq : Infinity;
        conv.messages = msg.messages.filter((m) => m.seq < first).concat(conv.messages);
        conv.more = msg.more;
      }
      conv.loaded = true;
      if (conv.session_id === state.selected) { renderConv(); openAssist(conv.session_id); }
      break;
    }
    case "message":
      if (!conv) return;
      if (conv.messages.some((m) => m.seq === msg.message.seq)) return;
      conv.messages.push(msg.message);
      if (msg.message.role === "user") conv.user_seqs = [...(conv.user_seqs || []), msg.message.seq].slice(-20);
      if (conv.messages.length > 500) conv.messages.shift();
      conv.seq = msg.message.seq;
      conv.mood = msg.mood;
      conv.updated_at = msg.updated_at;
      conv.last_message = { role: msg.message.role, text: msg.message.text.slice(0, 200), ts: msg.message.ts };
      if (msg.message.role === "bot" && conv.streaming && conv.streaming.id === msg.message.id) conv.streaming = null;
      renderList();
      if (conv.session_id === state.selected) {
        renderConv();
        if (msg.message.role === "user") {
          refreshAssist(conv.session_id);
          if (assist.translateOn.has(conv.session_id)) translate(conv.session_id, msg.message);
        }
      }
      break;
    case "action": // an action ran for a customer message: shown like a message, with its call
      if (!conv) return;
      if (conv.messages.some((m) => m.seq === msg.message.seq)) return;
      conv.messages.push(msg.message);
      if (conv.messages.length > 500) conv.messages.shift();
      conv.seq = msg.message.seq;
      conv.updated_at = msg.updated_at;
      if (conv.session_id === state.selected) renderConv();
      break;
    case "token":
      if (!conv) return;
      if (!conv.streaming || conv.streaming.id !== msg.id) conv.streaming = { id: msg.id, text: "" };
      conv.streaming.text += msg.text;
      if (conv.session_id === state.selected) updateStreaming(conv);
      break;
    case "stream_end":
      if (!conv) return;
      if (conv.streaming && conv.streaming.id === msg.id) conv.streaming = null;
      if (msg.dropped) {
        conv.messages = conv.messages.filter((m) => m.seq !== msg.dropped);
        conv.user_seqs = (conv.user_seqs || []).filter((seq) => seq !== msg.dropped);
      }
      if (conv.session_id === state.selected) renderConv();
      break;
    case "tag": {
      if (!conv) return;
      const m = conv.messages.find((x) => x.seq === msg.seq);
      if (m) {
        m.tags = { ...(m.tags || {}), [msg.task]: msg.label };
        if (msg.task === "sentiment") m.sentiment = msg.label;
      }
      conv.mood = msg.mood;
      renderList();
      if (conv.session_id === state.selected) renderConv();
      break;
    }
    case "assist_delta":
      onAssistDelta(msg);
      break;
    case "assist":
      onAssist(msg);
      break;
    case "error":
      if (msg.code === "unauthorized" || msg.code === "console_disabled") return; // the close follows
      if (msg.id && assist.pending.has(msg.id)) { onAssistError(msg); return; }
      toast(msg.message || msg.code);
      break;
    default:
      break;
  }
}

// -- unread ------------------------------------------------------------------------------------
// The summary lists the seqs of the newest customer messages; live ones are added as they come.
function unread(conv) {
  const seen = state.seen[conv.session_id] || 0;
  return (conv.user_seqs || []).filter((seq) => seq > seen).length;
}
function markSeen(conv) {
  if (!conv || document.hidden) return;
  if ((state.seen[conv.session_id] || 0) !== conv.seq) {
    state.seen[conv.session_id] = conv.seq;
    save(KEY.seen, state.seen);
  }
}
document.addEventListener("visibilitychange", () => {
  const conv = state.convs.get(state.selected);
  if (conv) { markSeen(conv); renderList(); }
});

// -- list --------------------------------------------------------------------------------------
function moodBadge(mood) {
  const label = (mood && mood.label) || "unknown";
  return el("span", { class: `mood mood-${label}`, text: MOOD_TEXT[label] || label,
    title: mood && mood.n ? `mood over the last ${mood.n} rated messages` : "no rated messages yet" });
}

// A conversation waiting for a person (the hand-off policy fired): its reason, since, the e-mail left.
function handoffBadge(c) {
  const h = c.handoff;
  return el("span", { class: "waiting-badge", "data-since": h.since,
    title: h.text, text: h.out_of_hours ? "Waiting · out of hours" : "Waiting for a person" });
}
function renderHandoff(conv) {
  const box = $("handoff");
  const h = conv.handoff;
  box.hidden = !h;
  if (!h) return;
  box.replaceChildren(...[
    el("p", {}, el("strong", { text: "Waiting for a person" }), ` since ${time(h.since)}: `, h.text),
    h.out_of_hours ? el("p", { text: "Out of business hours: the customer was offered the e-mail form." }) : null,
    h.email ? el("p", { class: "handoff-email" }, el("strong", { text: "E-mail: " }), h.email) :
      h.out_of_hours ? el("p", { class: "note", text: "No e-mail left yet." }) : null,
    el("p", { class: "note", text: "Take over to answer; hand back to let the bot answer again." }),
  ].filter(Boolean));
}

function renderList() {
  const filter = $("filter").value;
  const sort = $("sort").value;
  let convs = [...state.convs.values()];
  if (filter === "waiting") convs = convs.filter((c) => c.handoff);
  else if (filter !== "all") convs = convs.filter((c) => (c.mood?.label || "unknown") === filter);
  const cmp = {
    recent: (a, b) => b.updated_at - a.updated_at,
    mood: (a, b) => (MOOD_RANK[a.mood?.label] ?? 2) - (MOOD_RANK[b.mood?.label] ?? 2) ||
      (a.mood?.score ?? 0) - (b.mood?.score ?? 0) || b.updated_at - a.updated_at,
    unread: (a, b) => unread(b) - unread(a) || b.updated_at - a.updated_at,
    name: (a, b) => a.customer.localeCompare(b.customer),
  }[sort];
  // the queue first, oldest wait first; then the chosen order
  convs.sort((a, b) => (a.handoff ? 0 : 1) - (b.handoff ? 0 : 1) ||
    (a.handoff && b.handoff ? a.handoff.since - b.handoff.since : 0) || cmp(a, b));
  const queued = [...state.convs.values()].filter((c) => c.handoff).length;
  $("queue").hidden = !queued;
  $("queue").textContent = queued === 1 ? "1 conversation waits for a person" : `${queued} conversations wait for a person`;
  const list = $("list");
  list.replaceChildren();
  for (const c of convs) {
    if (c.session_id === state.selected) markSeen(c);
    const n = unread(c);
    const last = c.last_message;
    const lastText = last ? (last.role === "user" ? "" : last.role === "agent" ? "Agent: " : last.role === "action" ? "Action: " : "Bot: ") + last.text : "No messages yet";
    const btn = el("button", { type: "button", class: c.handoff ? "item waiting" : "item",
      "aria-current": c.session_id === state.selected ? "true" : null, "data-session": c.session_id },
      el("span", { class: "item-top" },
        el("span", { class: "name", text: c.customer }),
        moodBadge(c.mood),
        n ? el("span", { class: "unread", text: String(n), "aria-label": `${n} unread` }) : null),
      c.handoff ? el("span", { class: "item-handoff" }, handoffBadge(c),
        el("span", { class: "reason", text: c.handoff.text }),
        c.handoff.email ? el("span", { class: "email", text: c.handoff.email }) : null) : null,
      el("span", { class: "last", text: lastText }),
      el("span", { class: "item-meta" },
        el("span", { class: c.connected ? "dot on" : "dot off", text: c.connected ? "online" : "offline" }),
        c.agent ? el("span", { class: "held", text: c.agent.id === state.me?.id ? "you are answering" : `${c.agent.name} is answering` }) : null,
        el("span", { class: "when", text: time(c.updated_at) })));
    btn.addEventListener("click", () => select(c.session_id));
    list.append(el("li", {}, btn));
  }
  $("count").textContent = `(${state.convs.size})`;
  $("empty").hidden = convs.length > 0;
  $("empty").textContent = state.convs.size ? "No conversation matches this filter." : "No conversations yet.";
}
$("filter").addEventListener("change", renderList);
$("sort").addEventListener("change", renderList);

function select(sid) {
  state.selected = sid;
  const conv = state.convs.get(sid);
  if (conv && !conv.loaded) openConv(sid);
  renderList();
  renderConv();
  openAssist(sid);
  $("messages").focus();
}

// -- assist ------------------------------------------------------------------------------------
// Drafts and fields are asked for when a conversation is opened and again after each new customer
// message (once the conversation has settled for a moment); the summary when this agent takes over.
function slot(sid) {
  if (!assist.byConv.has(sid)) assist.byConv.set(sid, { translations: new Map() });
  return assist.byConv.get(sid);
}
function ask(sid, task, key, extra = {}) {
  const id = `a${assist.next++}`;
  const conv = state.convs.get(sid);
  assist.pending.set(id, { sid, key, seq: conv ? conv.seq : 0 });
  const stream = key === "drafts";
  if (key !== "translation" && key !== "reply") slot(sid)[key] = { ...(slot(sid)[key] || {}), pending: true, error: null, call: id, writing: [] };
  sendWs({ type: "assist", id, session_id: sid, task, stream, ...extra });
  if (sid === state.selected) renderAssist();
  return id;
}
function openAssist(sid) {
  const conv = state.convs.get(sid);
  const mine = slot(sid);
  if (!conv || !conv.messages.some((m) => m.role === "user")) { renderAssist(); return; }
  if (!mine.drafts || (mine.drafts.seq !== conv.seq && !mine.drafts.pending)) ask(sid, "suggest_reply", "drafts");
  if (!mine.fields || (mine.fields.seq !== conv.seq && !mine.fields.pending)) ask(sid, "extract", "fields");
  renderAssist();
}
function refreshAssist(sid) {
  clearTimeout(assist.timer);
  assist.timer = setTimeout(() => { if (state.selected === sid) openAssist(sid); }, 400);
}
function translate(sid, message) {
  const mine = slot(sid);
  if (mine.translations.has(message.seq)) return;
  mine.translations.set(message.seq, { pending: true });
  assist.pending.get(ask(sid, "translate", "translation", { text: message.text })).msgSeq = message.seq;
}
function onAssistDelta(msg) {
  const call = assist.pending.get(msg.id);
  const d = call && slot(call.sid)[call.key];
  if (!d || d.call !== msg.id || !Number.isInteger(msg.sample) || msg.sample < 0 || msg.sample > 8) return;
  d.writing[msg.sample] = (d.writing[msg.sample] || "") + String(msg.text);
  if (call.sid === state.selected) renderAssist();
}
function onAssist(msg) {
  const call = assist.pending.get(msg.id);
  if (!call) return;
  assist.pending.delete(msg.id);
  const mine = slot(call.sid);
  if (call.key === "reply") { onReplyTranslated(call, msg); return; }
  if (call.key === "translation") mine.translations.set(call.msgSeq, { text: msg.text.trim() });
  else mine[call.key] = { seq: call.seq, output: msg.output, pending: false, error: null };
  if (call.sid === state.selected) { renderAssist(); if (call.key === "translation") renderConv(); }
}
function onAssistError(msg) {
  const call = assist.pending.get(msg.id);
  assist.pending.delete(msg.id);
  const mine = slot(call.sid);
  if (call.key === "reply") { replyNote(call.sid, `Not translated: ${msg.message || msg.code}`); return; }
  if (call.key === "translation") mine.translations.set(call.msgSeq, { error: msg.message });
  else mine[call.key] = { seq: call.seq, pending: false, error: msg.message || msg.code };
  if (call.sid === state.selected) renderAssist();
}
// The agent's reply, translated to the customer's language in the reply box (to edit, then send).
function translateReply() {
  const sid = state.selected;
  const text = $("reply").value.trim();
  if (!sid || !text) return;
  replyNote(sid, "Translating your reply…");
  $("reply-translate").disabled = true;
  assist.pending.get(ask(sid, "translate_reply", "reply", { text })).original = text;
}
function onReplyTranslated(call, msg) {
  if (call.sid !== state.selected) return;
  $("reply-translate").disabled = false;
  const reply = $("reply");
  if (reply.value.trim() !== call.original) { replyNote(call.sid, ""); return; } // edited meanwhile
  reply.value = msg.output.text.trim();
  const language = String(msg.output.language || "");
  replyNote(call.sid, `In ${language.charAt(0).toUpperCase() + language.slice(1)}: check it, then send.`);
}
function replyNote(sid, text) {
  if (sid !== state.selected) return;
  $("reply-note").textContent = text;
  $("reply-note").hidden = !text;
  if (!text.startsWith("Translating")) $("reply-translate").disabled = false;
}
function useDraft(text) {
  const reply = $("reply");
  reply.value = text;
  if (!reply.disabled) { reply.focus(); reply.setSelectionRange(text.length, text.length); }
  else toast("Take over to send this reply.");
}
function renderAssist() {
  const sid = state.selected;
  const mine = sid ? slot(sid) : {};
  const list = $("drafts-list");
  const d = mine.drafts;
  const writing = d?.pending ? d.writing.filter((x) => x && x.trim()) : [];
  const texts = d && d.output ? d.output.samples.map((x) => x.text).filter((x) => x) : [];
  const written = (text) => {
    const b = el("button", { type: "button", class: "draft", text, title: "Put this reply in the reply box to edit" });
    b.addEventListener("click", () => useDraft(text));
    return el("li", {}, b);
  };
  const inProgress = (text) => el("li", {}, el("span", { class: "draft writing", text: text.trim() }));
  list.replaceChildren(...(writing.length ? writing.map(inProgress) : texts.map(written)));
  $("drafts-note").textContent = d?.pending ? "Drafting replies…" : d?.error ? `No drafts: ${d.error}` :
    d ? "" : "Drafts appear when the customer has written.";
  const f = mine.fields;
  const dl = $("fields-list");
  dl.replaceChildren();
  for (const [k, v] of Object.entries((f && f.output) || {})) {
    dl.append(el("dt", { text: k.replaceAll("_", " ") }),
      el("dd", { class: v === null ? "none" : null, text: v === null ? "not given" : String(v) }));
  }
  $("fields-note").textContent = f?.pending ? "Reading the conversation…" : f?.error ? `Not read: ${f.error}` : "";
  const box = $("summary");
  const sm = mine.summary;
  const conv = state.convs.get(sid);
  const held = conv && conv.agent && conv.agent.id === state.me?.id;
  box.hidden = !(held && sm);
  if (held && sm) {
    if (sm.output) {
      box.replaceChildren(
        el("p", {}, el("strong", { text: "Issue: " }), sm.output.issue),
        el("p", {}, el("strong", { text: "Tried: " }), sm.output.tried),
        el("p", {}, el("strong", { text: "Mood: " }), sm.output.mood.join(" → ")));
    } else {
      box.replaceChildren(el("p", { text: sm.pending ? "Summarizing the conversation…" : `No summary: ${sm.error}` }));
    }
  }
  $("translate").checked = assist.translateOn.has(sid);
  $("reply-translate").hidden = !(assist.translateOn.has(sid) && held);
}
$("reply-translate").addEventListener("click", translateReply);
$("redraft").addEventListener("click", () => { if (state.selected) ask(state.selected, "suggest_reply", "drafts"); });
$("translate").addEventListener("change", (ev) => {
  const sid = state.selected;
  if (!sid) return;
  if (ev.target.checked) {
    assist.translateOn.add(sid);
    // the newest customer messages: the server runs a few assist calls of an agent at once
    for (const m of state.convs.get(sid).messages.filter((x) => x.role === "user").slice(-2)) translate(sid, m);
  } else assist.translateOn.delete(sid);
  renderConv();
});

// -- one conversation --------------------------------------------------------------------------
// An action call: its name, status and time, then its arguments and result or error as JSON text.
function renderAction(m) {
  const c = m.call || {};
  const ms = typeof c.ms === "number" ? ` · ${Math.round(c.ms)} ms` : "";
  const li = el("li", { class: `msg msg-action action-${c.status === "ok" ? "ok" : "failed"}` },
    el("span", { class: "who" }, `Action ${c.action || ""}`, el("span", { class: "when", text: " · " + time(m.ts) + ms })),
    el("span", { class: "tag", text: c.status || "" }),
    el("code", { class: "call", text: `arguments ${JSON.stringify(c.arguments)}` }));
  if (c.error) li.append(el("code", { class: "call call-error", text: `error ${c.error}` }));
  else li.append(el("code", { class: "call", text: `result ${JSON.stringify(c.result)}` }));
  return li;
}

function renderMessage(m) {
  if (m.role === "action") return renderAction(m);
  const who = m.role === "user" ? "Customer" : m.role === "agent" ? `${m.agent || "Agent"} (agent)` : "Bot";
  const li = el("li", { class: `msg msg-${m.role}` },
    el("span", { class: "who" }, who, el("span", { class: "when", text: " · " + time(m.ts) })),
    el("span", { class: "body", text: m.role === "user" ? m.text : m.text.trim() }));
  if (m.role === "user") {
    const label = m.sentiment;
    li.append(el("span", { class: `tag tag-${label ? String(label).toLowerCase() : "pending"}`,
      text: label ? `sentiment: ${label}` : "sentiment: …" }));
    if (m.to_agent) li.append(el("span", { class: "tag tag-routed", text: "to agent" }));
  }
  if (m.finish_reason === "cancelled") li.append(el("span", { class: "tag", text: "stopped by customer" }));
  if (Array.isArray(m.sources) && m.sources.length) li.append(renderSources(m.sources));
  const tr = m.role === "user" && assist.translateOn.has(state.selected) ?
    slot(state.selected).translations.get(m.seq) : null;
  if (tr) {
    li.append(el("span", { class: "translation",
      text: tr.text ? tr.text : tr.error ? `(not translated: ${tr.error})` : "translating…" }));
  }
  return li;
}

// The articles a knowledge reply cited: a link each where its URL is http(s), else its title as text.
function renderSources(sources) {
  const box = el("span", { class: "sources" }, "Sources: ");
  sources.forEach((s, i) => {
    const label = `[${Number(s.n)}] ${String(s.title || s.id || "article")}`;
    let url = null;
    try { url = /^https?:$/.test(new URL(String(s.url)).protocol) ? String(s.url) : null; } catch (e) { url = null; }
    if (i) box.append(" · ");
    box.append(url ? el("a", { href: url, target: "_blank", rel: "noopener noreferrer", text: label }) :
      el("span", { title: String(s.id || ""), text: label }));
  });
  return box;
}

function updateStreaming(conv) {
  const box = $("messages");
  let li = box.querySelector(".msg-streaming");
  if (!li) {
    li = el("li", { class: "msg msg-bot msg-streaming", "aria-busy": "true" },
      el("span", { class: "who", text: "Bot (typing…)" }), el("span", { class: "body" }));
    box.append(li);
  }
  li.querySelector(".body").textContent = conv.streaming ? conv.streaming.text.replace(/^\s+/, "") : "";
  box.scrollTop = box.scrollHeight;
}

function renderConv() {
  const conv = state.convs.get(state.selected);
  $("placeholder").hidden = !!conv;
  $("conv").hidden = !conv;
  if (!conv) return;
  markSeen(conv);
  renderHandoff(conv);
  $("conv-title").textContent = conv.customer;
  const meta = $("conv-meta");
  meta.replaceChildren(moodBadge(conv.mood),
    ` ${conv.connected ? "online" : "offline"} · session ${conv.session_id.slice(0, 8)}… · ` +
    (conv.agent ? (conv.agent.id === state.me?.id ? "you are answering" : `${conv.agent.name} is answering`) : "the bot is answering"));
  const mine = conv.agent && conv.agent.id === state.me?.id;
  $("takeover").hidden = !!mine;
  $("takeover").disabled = !!conv.agent && !mine;
  $("takeover").textContent = conv.agent && !mine ? `Taken over by ${conv.agent.name}` : "Take over";
  $("handback").hidden = !mine;
  $("reply").disabled = !mine;
  $("send").disabled = !mine;
  $("reply").placeholder = mine ? "Type your reply to the customer…" : "Take over to reply…";
  const box = $("messages");
  box.replaceChildren(...conv.messages.map(renderMessage));
  if (conv.more && conv.messages.length) {
    const older = el("button", { type: "button", class: "older", text: "Load earlier messages" });
    older.addEventListener("click", () => openConv(conv.session_id, conv.messages[0].seq));
    box.prepend(el("li", { class: "msg-older" }, older));
  }
  if (conv.streaming) updateStreaming(conv);
  box.scrollTop = box.scrollHeight;
  renderAssist();
}

function sendWs(obj) {
  if (state.ws && state.ws.readyState === WebSocket.OPEN) state.ws.send(JSON.stringify(obj));
  else toast("Not connected; try again in a moment.");
}
$("takeover").addEventListener("click", () => {
  sendWs({ type: "take_over", session_id: state.selected });
  $("reply").focus();
});
$("handback").addEventListener("click", () => sendWs({ type: "hand_back", session_id: state.selected }));
$("reply-form").addEventListener("submit", (ev) => {
  ev.preventDefault();
  const text = $("reply").value.trim();
  if (!text) return;
  sendWs({ type: "agent_message", session_id: state.selected, text });
  replyNote(state.selected, "");
  $("reply").value = "";
  $("reply").focus();
});
$("reply").addEventListener("keydown", (ev) => {
  if (ev.key === "Enter" && !ev.shiftKey && !ev.isComposing) {
    ev.preventDefault();
    $("reply-form").requestSubmit();
  }
});

if (sessionStorage.getItem(KEY.token)) connect(); else showLogin("");
