// Rewind's web page: chat, models, and what the prompt cache saved per session.
// Plain JavaScript, no build step, no third-party code. Every text from the server or the user
// goes into the page as textContent, never as HTML. The API key lives in sessionStorage only.
"use strict";

const KEY_STORAGE = "rewind-api-key";
const POLL_MS = 2000; // the sessions view's refresh: modest, and only while it is on screen
const $ = (id) => document.getElementById(id);

// ---------------------------------------------------------------- helpers

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs || {})) {
    if (name === "class") node.className = value;
    else if (name.startsWith("on")) node.addEventListener(name.slice(2), value);
    else node.setAttribute(name, value);
  }
  for (const child of children) {
    if (child === null || child === undefined) continue;
    node.append(child instanceof Node ? child : String(child));
  }
  return node;
}

const SVG_NS = "http://www.w3.org/2000/svg";
function svg(tag, attrs, ...children) {
  const node = document.createElementNS(SVG_NS, tag);
  for (const [name, value] of Object.entries(attrs || {})) node.setAttribute(name, value);
  for (const child of children) node.append(child instanceof Node ? child : String(child));
  return node;
}

function bytes(n) {
  if (n === null || n === undefined) return "–";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let value = n, unit = 0;
  while (value >= 1024 && unit < units.length - 1) { value /= 1024; unit += 1; }
  return `${value.toFixed(unit === 0 ? 0 : 1)} ${units[unit]}`;
}

const count = (n) => (n === null || n === undefined ? "–" : Number(n).toLocaleString("en-US"));
const seconds = (s) => (s ? `${(s * 1000).toFixed(0)} ms` : "–");
const clock = (t) => new Date(t * 1000).toLocaleTimeString();

function showError(message) {
  const bar = $("error-bar");
  bar.textContent = message;
  bar.hidden = !message;
}

// ---------------------------------------------------------------- the API, with the key

function apiKey() { return sessionStorage.getItem(KEY_STORAGE) || ""; }

function askForKey(why) {
  $("key-form").hidden = false;
  $("key-hint").textContent = why;
  $("key-input").focus();
}

class ApiError extends Error {
  constructor(status, message) { super(message); this.status = status; }
}

async function api(path, options = {}) {
  const headers = { ...(options.headers || {}) };
  if (options.body !== undefined) headers["content-type"] = "application/json";
  const key = apiKey();
  if (key) headers.authorization = `Bearer ${key}`;
  const response = await fetch(path, {
    method: options.method || (options.body !== undefined ? "POST" : "GET"),
    headers,
    body: options.body === undefined ? undefined : JSON.stringify(options.body),
    signal: options.signal,
  });
  if (response.status === 401) {
    askForKey(key ? "The server refused this key: enter another." :
      "This server asks for an API key. It is kept in this tab's session storage only.");
  }
  if (!response.ok) {
    let message = `${response.status} ${response.statusText}`;
    try {
      const body = await response.json();
      message = (body.error && body.error.message) || message;
    } catch (_) { /* not JSON: keep the status line */ }
    throw new ApiError(response.status, message);
  }
  return response;
}

const getJson = async (path) => (await api(path)).json();

// ---------------------------------------------------------------- views

const views = ["chat", "models", "sessions"];
let currentView = "chat";

function show(view) {
  currentView = view;
  for (const name of views) {
    $(`view-${name}`).hidden = name !== view;
    $(`tab-${name}`).classList.toggle("active", name === view);
  }
  if (view === "models") refreshModels();
  if (view === "sessions") refreshSessions();
  if (location.hash !== `#${view}`) history.replaceState(null, "", `#${view}`);
}

// ---------------------------------------------------------------- chat

// A message: {role, content, reasoning, toolCalls: [{id, name, arguments}], usage, image, error}
const chat = { messages: [], controller: null, editing: -1 };

function selectedModel() { return $("model-select").value || undefined; }

function wireContent(message) {
  if (!message.image) return message.content;
  return [{ type: "text", text: message.content },
          { type: "image_url", image_url: { url: message.image } }];
}

function wireMessages(messages) {
  return messages.map((m) => {
    const out = { role: m.role, content: wireContent(m) };
    if (m.toolCalls && m.toolCalls.length) {
      out.tool_calls = m.toolCalls.map((call) => ({
        id: call.id, type: "function",
        function: { name: call.name, arguments: call.arguments || "{}" },
      }));
    }
    return out;
  });
}

function usageLine(usage) {
  if (!usage) return null;
  const cached = (usage.prompt_tokens_details || {}).cached_tokens || 0;
  return el("div", { class: "usage" },
    `prompt ${count(usage.prompt_tokens)} tokens, `,
    el("span", { class: "cached" }, `${count(cached)} cached`),
    `, ${count(usage.prompt_tokens - cached)} computed; answer ${count(usage.completion_tokens)} tokens`);
}

function renderMessage(message, index) {
  const node = el("div", { class: `message ${message.role}`, "data-index": String(index) });
  node.append(el("div", { class: "role" }, message.role));
  if (chat.editing === index) {
    const box = el("textarea", { class: "edit-box", rows: "3" });
    box.value = message.content;
    node.append(box, el("div", { class: "message-actions" },
      el("button", { type: "button", onclick: () => resendEdited(index, box.value) }, "Send edited"),
      el("button", { type: "button", class: "quiet", onclick: () => { chat.editing = -1; renderChat(); } }, "Cancel")));
    return node;
  }
  if (message.reasoning) {
    const details = el("details", { class: "reasoning" },
      el("summary", {}, `Reasoning (${message.reasoning.length} characters)`),
      el("pre", {}, message.reasoning));
    node.append(details);
  }
  if (message.image) node.append(el("img", { class: "thumb", src: message.image, alt: "attached image" }));
  node.append(el("div", { class: "content" }, message.content));
  for (const call of message.toolCalls || []) {
    node.append(el("div", { class: "tool-call" },
      el("span", { class: "tool-name" }, `tool call: ${call.name}`),
      el("pre", {}, call.arguments)));
  }
  if (message.error) node.append(el("div", { class: "error" }, message.error));
  const usage = usageLine(message.usage);
  if (usage) node.append(usage);
  const busy = chat.controller !== null;
  const actions = el("div", { class: "message-actions" });
  if (message.role === "user" && !busy) {
    actions.append(el("button", { type: "button", class: "quiet edit",
      onclick: () => { chat.editing = index; renderChat(); } }, "Edit"));
  }
  if (message.role === "assistant" && index === chat.messages.length - 1 && !busy) {
    actions.append(el("button", { type: "button", class: "quiet regenerate", onclick: regenerate }, "Regenerate"));
  }
  if (actions.childNodes.length) node.append(actions);
  return node;
}

function renderChat() {
  const box = $("messages");
  box.replaceChildren(...chat.messages.map(renderMessage));
  box.scrollTop = box.scrollHeight;
  const busy = chat.controller !== null;
  $("send").disabled = busy;
  $("stop").disabled = !busy;
}

// Server-sent events -> onData(each data line's JSON), until the stream or a [DONE] ends it.
// (fetch, not EventSource: EventSource can neither POST nor send the key's header.)
async function readEvents(response, onData) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data:")) continue; // event names and keep-alive comments
        const data = line.slice(5).trim();
        if (data === "[DONE]") return;
        onData(JSON.parse(data));
      }
    }
  }
}

// A streamed chat completion -> the message being written.
function readStream(response, message) {
  return readEvents(response, (chunk) => { applyChunk(chunk, message); renderChat(); });
}

function applyChunk(chunk, message) {
  if (chunk.error) { message.error = chunk.error.message || "generation failed"; return; }
  if (chunk.usage) message.usage = chunk.usage;
  for (const choice of chunk.choices || []) {
    const delta = choice.delta || {};
    if (delta.content) message.content += delta.content;
    if (delta.reasoning_content) message.reasoning += delta.reasoning_content;
    for (const call of delta.tool_calls || []) {
      const index = call.index || 0;
      const known = message.toolCalls[index] ||
        (message.toolCalls[index] = { id: call.id, name: "", arguments: "" });
      if (call.id) known.id = call.id;
      if (call.function && call.function.name) known.name = call.function.name;
      if (call.function && call.function.arguments) known.arguments += call.function.arguments;
    }
    if (choice.finish_reason) message.finish = choice.finish_reason;
  }
}

async function generate() {
  const message = { role: "assistant", content: "", reasoning: "", toolCalls: [], usage: null };
  const history = wireMessages(chat.messages);
  chat.messages.push(message);
  chat.controller = new AbortController();
  renderChat();
  const body = {
    model: selectedModel(), messages: history, stream: true,
    stream_options: { include_usage: true },
    temperature: Number($("temperature").value),
    max_tokens: Number($("max-tokens").value) || undefined,
  };
  // Qwen's and the tiny test models' templates read enable_thinking; others ignore it.
  const thinking = $("thinking").value;
  if (thinking) body.chat_template_kwargs = { enable_thinking: thinking === "on" };
  try {
    const response = await api("/v1/chat/completions", { body, signal: chat.controller.signal });
    await readStream(response, message);
  } catch (error) {
    if (error.name === "AbortError") message.error = "stopped";
    else message.error = error.message;
  } finally {
    chat.controller = null;
    renderChat();
  }
}

async function send(event) {
  event.preventDefault();
  const text = $("prompt").value.trim();
  if (!text || chat.controller) return;
  chat.messages.push({ role: "user", content: text, image: chat.pendingImage || null });
  $("prompt").value = "";
  clearImage();
  await generate();
}

async function regenerate() {
  if (chat.controller) return;
  if (chat.messages.length && chat.messages[chat.messages.length - 1].role === "assistant") {
    chat.messages.pop();
  }
  await generate();
}

async function resendEdited(index, text) {
  // The agent pattern: the conversation up to here is the same prefix, cached; only the edited
  // message and what follows are computed again.
  chat.messages = chat.messages.slice(0, index + 1);
  chat.messages[index] = { ...chat.messages[index], content: text };
  chat.editing = -1;
  await generate();
}

function clearImage() {
  chat.pendingImage = null;
  $("image-input").value = "";
  $("image-name").textContent = "";
}

function pickImage() {
  const file = $("image-input").files[0];
  if (!file) { clearImage(); return; }
  const reader = new FileReader();
  reader.onload = () => { chat.pendingImage = reader.result; $("image-name").textContent = file.name; };
  reader.readAsDataURL(file);
}

async function loadModelPicker() {
  const select = $("model-select");
  const previous = select.value;
  const models = (await getJson("/v1/models")).data;
  select.replaceChildren(...models.map((m) =>
    el("option", { value: m.id }, m.loaded ? `${m.id} (loaded)` : m.id)));
  const loaded = models.find((m) => m.loaded);
  if (models.some((m) => m.id === previous)) select.value = previous;
  else if (loaded) select.value = loaded.id;
}

// ---------------------------------------------------------------- models

async function modelAction(action, id) {
  const body = { model: id };
  const keepAlive = $("keep-alive").value.trim();
  if (action === "load" && keepAlive) body.keep_alive = /^-?\d+(\.\d+)?$/.test(keepAlive) ? Number(keepAlive) : keepAlive;
  try {
    showError("");
    await api(`/v1/models/${action}`, { body });
  } catch (error) {
    showError(`${action} ${id}: ${error.message}`);
  }
  await refreshModels();
  await loadModelPicker().catch(() => {});
}

// POST /v1/models/pull: its progress events feed the bar; the list is refreshed when done.
async function pullModel(event) {
  event.preventDefault();
  const repo = $("pull-repo").value.trim();
  const bar = $("pull-progress"), status = $("pull-status"), button = $("pull-button");
  if (!repo || button.disabled) return;
  button.disabled = true;
  bar.hidden = false;
  bar.max = 1;
  bar.value = 0;
  status.classList.remove("error");
  status.textContent = `asking the hub for ${repo} ...`;
  try {
    const response = await api("/v1/models/pull", { body: { model: repo } });
    let finished = null;
    await readEvents(response, (data) => {
      if (data.type === "error") throw new Error(data.error.message);
      if (data.type === "progress") {
        bar.max = Math.max(data.total, 1);
        bar.value = data.done;
        const whole = data.files.filter((f) => f.total !== null && f.done >= f.total).length;
        status.textContent = `${repo}: ${bytes(data.done)} of ${bytes(data.total)}, ` +
          `${whole} of ${data.files.length} files`;
      } else if (data.type === "done") {
        finished = data;
      }
    });
    if (!finished) throw new Error("the server ended the stream before the pull finished");
    bar.value = bar.max;
    status.textContent = `${finished.model} is pulled: ${finished.form}, ${bytes(finished.size_bytes)}`;
    $("pull-repo").value = "";
    await refreshModels();
    await loadModelPicker().catch(() => {});
  } catch (error) {
    status.classList.add("error");
    status.textContent = `pull ${repo}: ${error.message}`;
  } finally {
    button.disabled = false;
  }
}

async function refreshModels() {
  let models;
  try {
    models = (await getJson("/v1/models")).data;
  } catch (error) {
    showError(`models: ${error.message}`);
    return;
  }
  const rows = models.map((m) => {
    const busy = m.state === "loading" || m.state === "unloading";
    const button = m.loaded
      ? el("button", { type: "button", class: "unload", onclick: () => modelAction("unload", m.id) }, "Unload")
      : el("button", { type: "button", class: "load", onclick: () => modelAction("load", m.id) }, "Load");
    if (busy) button.disabled = true;
    return el("tr", { "data-model": m.id },
      el("td", {}, m.id), el("td", { class: `state ${m.state}` }, m.state),
      el("td", {}, m.form || m.kind || ""), el("td", {}, bytes(m.size_bytes)),
      el("td", {}, m.loaded ? bytes(m.memory_bytes) : "–"),
      el("td", {}, count(m.context_length)), el("td", {}, m.loaded ? count(m.running) : "–"),
      el("td", {}, button));
  });
  $("models-table").tBodies[0].replaceChildren(...rows);
}

// ---------------------------------------------------------------- sessions and cache

const sessions = { selected: null, timer: null };

function memoryChart(memory) {
  // One stacked bar: what fills the memory budget, part by part.
  const parts = [["base", memory.base_bytes], ["models", memory.models_bytes],
    ["loading", memory.loading_bytes], ["live KV", memory.live_kv_bytes],
    ["RAM tier", memory.ram_tier_bytes]];
  const total = Math.max(memory.budget_bytes, 1);
  const width = 600, height = 28;
  // Stretched to the panel's width (preserveAspectRatio none): it holds no text to distort.
  const chart = svg("svg", { viewBox: `0 0 ${width} ${height}`, class: "memory", role: "img",
    preserveAspectRatio: "none", "aria-label": "memory budget" });
  chart.append(svg("rect", { x: 0, y: 0, width, height, class: "budget" }));
  let x = 0;
  parts.forEach(([name, value], i) => {
    const w = Math.min(width - x, (value / total) * width);
    if (w <= 0) return;
    const rect = svg("rect", { x, y: 0, width: w, height, class: `part part-${i}` });
    rect.append(svg("title", {}, `${name}: ${bytes(value)}`));
    chart.append(rect);
    x += w;
  });
  const caption = el("p", { class: "caption" },
    `${bytes(memory.committed_bytes)} committed of a ${bytes(memory.budget_bytes)} budget; process RSS ${bytes(memory.rss_bytes)}`);
  const legend = el("div", { class: "legend" }, ...parts.map(([name, value], i) =>
    el("span", {}, el("i", { class: `swatch part-${i}` }), `${name} ${bytes(value)}`)));
  $("memory-chart").replaceChildren(chart, caption, legend);
}

const TOKEN_KINDS = [["ram", "from RAM"], ["disk", "from disk"], ["recomputed", "recomputed"]];

// A session's timeline: turns along x; per turn a bar as tall as its prompt, split into the
// tokens restored from RAM, from disk and recomputed (the prefix restored sits at the bottom,
// as it is the prompt's start), with a tick at each prompt position the cache checkpointed.
// `compact` is the sessions table's thumbnail: no labels, no tooltips.
function timelineChart(turns, compact) {
  const width = compact ? 160 : 600, height = compact ? 36 : 160;
  const pad = compact ? 2 : 30, top = compact ? 2 : 16, bottom = compact ? 0 : 20;
  const most = Math.max(1, ...turns.map((t) => t.prompt_tokens));
  const slot = (width - pad) / Math.max(turns.length, 1);
  const bar = Math.max(2, Math.min(compact ? 14 : 40, slot * 0.7));
  const scale = (tokens) => (tokens / most) * (height - top);
  const chart = svg("svg", { viewBox: `0 0 ${width} ${height + bottom}`, role: "img",
    class: compact ? "timeline compact" : "timeline turns",
    "aria-label": `prompt tokens and checkpoints over ${turns.length} turns` });
  chart.append(svg("line", { x1: pad, y1: height, x2: width, y2: height, class: "axis" }));
  if (!compact) chart.append(svg("text", { x: 0, y: 12, class: "label" }, count(most)));
  turns.forEach((turn, i) => {
    const x = pad + i * slot + (slot - bar) / 2;
    let y = height;
    for (const [kind, words] of TOKEN_KINDS) {
      const h = scale(turn[`${kind}_tokens`]);
      if (h <= 0) continue;
      y -= h;
      const rect = svg("rect", { x, y, width: bar, height: h, class: `tokens ${kind}` });
      if (!compact) rect.append(svg("title", {}, `turn ${i + 1}: ${count(turn[`${kind}_tokens`])} ${words}`));
      chart.append(rect);
    }
    const overhang = compact ? 1 : 4;
    for (const position of turn.checkpoints) {
      const at = height - scale(position);
      const tick = svg("line", { x1: x - overhang, x2: x + bar + overhang, y1: at, y2: at,
        class: "checkpoint" });
      if (!compact) tick.append(svg("title", {}, `turn ${i + 1}: checkpoint at token ${count(position)}`));
      chart.append(tick);
    }
    if (!compact) {
      chart.append(svg("text", { x: x + bar / 2, y: height + 14, class: "label tick" }, String(i + 1)));
    }
  });
  return chart;
}

function turnsChart(turns) {
  const legend = el("div", { class: "legend" },
    ...TOKEN_KINDS.map(([kind, words]) => el("span", {}, el("i", { class: `swatch tokens ${kind}` }), words)),
    el("span", {}, el("i", { class: "swatch checkpoint" }), "checkpoint"));
  $("turns-chart").replaceChildren(timelineChart(turns, false), legend);
}

function renderStatus(status) {
  const r = status.requests;
  $("card-requests").textContent =
    `${r.running} running of ${r.parallel} slots, ${r.queued} queued, ${r.waiting_for_memory} waiting for memory`;
  const c = status.cache;
  $("card-cache").textContent = c.enabled
    ? `hit rate ${(c.hit_rate * 100).toFixed(1)}%: ${count(c.tokens_restored_ram)} tokens from RAM, ` +
      `${count(c.tokens_restored_disk)} from disk, ${count(c.tokens_recomputed)} recomputed`
    : "off (--no-prompt-cache)";
  const tier = (t) => (t ? `${bytes(t.bytes)} of ${bytes(t.budget_bytes)}, ${count(t.entries)} records, ` +
    `${count(t.evictions)} evictions` : "none");
  $("card-ram").textContent = tier(c.ram);
  $("card-disk").textContent = c.disk
    ? `${tier(c.disk)}, ${bytes(c.disk.bytes_written)} written${c.disk.persistent ? ", persistent" : ""}`
    : "none";
  memoryChart(status.memory);
}

function renderSessions(list) {
  const rows = list.data.map((s) => {
    const last = s.turns[s.turns.length - 1];
    const row = el("tr", { class: `session${s.id === sessions.selected ? " selected" : ""}`,
      "data-session": s.id, onclick: () => { sessions.selected = s.id; renderSessions(list); } },
      el("td", { class: "mono" }, s.id), el("td", {}, s.model), el("td", {}, count(s.turn_count)),
      el("td", {}, count(s.totals.prompt_tokens)), el("td", { class: "ram" }, count(s.totals.ram_tokens)),
      el("td", { class: "disk" }, count(s.totals.disk_tokens)),
      el("td", { class: "recomputed" }, count(s.totals.recomputed_tokens)),
      el("td", {}, last ? seconds(last.ttft_seconds) : "–"), el("td", {}, clock(s.last_seen)),
      el("td", { class: "timeline-cell" }, timelineChart(s.turns, true)));
    return row;
  });
  if (!rows.length) {
    rows.push(el("tr", {}, el("td", { colspan: "10", class: "hint" }, "No sessions yet: send a chat.")));
  }
  $("sessions-table").tBodies[0].replaceChildren(...rows);
  const chosen = list.data.find((s) => s.id === sessions.selected) || list.data[0];
  $("session-detail").hidden = !chosen;
  if (!chosen) return;
  sessions.selected = chosen.id;
  for (const row of $("sessions-table").tBodies[0].rows) {
    row.classList.toggle("selected", row.dataset.session === chosen.id);
  }
  $("session-title").textContent = `Session ${chosen.id} (${chosen.source === "header" ? "named by the client" : `prefix of ${count(chosen.anchor_tokens)} tokens`})`;
  turnsChart(chosen.turns);
  const first = chosen.turn_count - chosen.turns.length;
  $("turns-table").tBodies[0].replaceChildren(...chosen.turns.map((t, i) => el("tr", {},
    el("td", {}, String(first + i + 1)), el("td", {}, clock(t.at)), el("td", {}, count(t.prompt_tokens)),
    el("td", { class: "ram" }, count(t.ram_tokens)), el("td", { class: "disk" }, count(t.disk_tokens)),
    el("td", { class: "recomputed" }, count(t.recomputed_tokens)), el("td", {}, count(t.completion_tokens)),
    el("td", {}, seconds(t.ttft_seconds)),
    el("td", { class: "mono", title: t.checkpoints.join(", ") }, t.checkpoints.join(" ")))));
}

async function refreshSessions() {
  clearTimeout(sessions.timer);
  if (currentView !== "sessions") return;
  try {
    const [status, list] = await Promise.all([getJson("/v1/rewind/status"), getJson("/v1/rewind/sessions")]);
    renderStatus(status);
    renderSessions(list);
    showError("");
  } catch (error) {
    showError(`sessions: ${error.message}`);
  }
  if (currentView === "sessions") sessions.timer = setTimeout(refreshSessions, POLL_MS);
}

// ---------------------------------------------------------------- start

function start() {
  for (const name of views) $(`tab-${name}`).addEventListener("click", () => show(name));
  $("composer").addEventListener("submit", send);
  $("prompt").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey) { event.preventDefault(); $("composer").requestSubmit(); }
  });
  $("stop").addEventListener("click", () => chat.controller && chat.controller.abort());
  $("new-chat").addEventListener("click", () => {
    if (chat.controller) chat.controller.abort();
    chat.messages = [];
    chat.editing = -1;
    renderChat();
  });
  $("image-input").addEventListener("change", pickImage);
  $("models-refresh").addEventListener("click", refreshModels);
  $("pull-form").addEventListener("submit", pullModel);
  $("key-button").addEventListener("click", () => askForKey("Kept in this tab's session storage only."));
  $("key-form").addEventListener("submit", (event) => {
    event.preventDefault();
    sessionStorage.setItem(KEY_STORAGE, $("key-input").value.trim());
    $("key-input").value = "";
    $("key-form").hidden = true;
    showError("");
    begin();
  });
  $("key-forget").addEventListener("click", () => {
    sessionStorage.removeItem(KEY_STORAGE);
    $("key-form").hidden = true;
  });
  document.addEventListener("visibilitychange", () => {
    if (!document.hidden && currentView === "sessions") refreshSessions();
  });
  renderChat();
  begin();
}

async function begin() {
  // Ask for the key before the first API call where one is needed: a refused call would be
  // an error in the browser's console, and the page would flash an error it can answer.
  let settings = { auth_required: false };
  try {
    settings = await (await fetch("/ui/settings.json")).json();
  } catch (error) {
    showError(`cannot reach the server: ${error.message}`);
  }
  if (settings.auth_required && !apiKey()) {
    askForKey("This server asks for an API key. It is kept in this tab's session storage only.");
    return;
  }
  const wanted = location.hash.slice(1);
  show(views.includes(wanted) ? wanted : "chat");
  loadModelPicker().catch((error) => {
    if (!(error instanceof ApiError && error.status === 401)) showError(`models: ${error.message}`);
  });
}

document.addEventListener("DOMContentLoaded", start);
