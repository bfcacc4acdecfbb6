// mlxcel web UI (A5): plain JS, no build step. Every call carries the key in a header
// (never a cookie); the events stream is read with fetch() for the same reason.
"use strict";

const API = "../ui-api/v1";
const CHAT_URL = "../v1/chat/completions";
const KEY_STORE = "mlxcel.key";
const HISTORY = 90; // dashboard samples kept (one a second)

const $ = (sel, root = document) => root.querySelector(sel);
const el = (tag, attrs = {}, ...children) => {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === "class") node.className = v;
    else if (k === "dataset") Object.assign(node.dataset, v);
    else if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
    else if (v !== undefined && v !== null && v !== false) node.setAttribute(k, v === true ? "" : v);
  }
  for (const child of children.flat()) node.append(child instanceof Node ? child : document.createTextNode(child ?? ""));
  return node;
};

const state = { key: sessionStorage.getItem(KEY_STORE), boot: null, models: null, catalog: [], jobs: new Map(),
  series: {}, eventsAbort: null, chat: [], chatAbort: null };

// ---- HTTP ----

async function api(path, options = {}) {
  const headers = { Authorization: `Bearer ${state.key}`, ...(options.body ? { "Content-Type": "application/json" } : {}) };
  const reply = await fetch(API + path, { ...options, headers: { ...headers, ...(options.headers || {}) } });
  const body = await reply.json().catch(() => ({}));
  if (!reply.ok) {
    const error = new Error(body?.error?.message || `${reply.status} ${reply.statusText}`);
    error.status = reply.status;
    throw error;
  }
  return body;
}
const post = (path, body) => api(path, { method: "POST", body: JSON.stringify(body || {}) });

function toast(text, kind = "") {
  const node = el("div", { class: `toast ${kind}` }, text);
  $("#toasts").append(node);
  setTimeout(() => node.remove(), 5000);
}

// ---- login ----

async function connect(key) {
  state.key = key;
  const boot = await api("/bootstrap");
  sessionStorage.setItem(KEY_STORE, key);
  state.boot = boot;
  $("#login").hidden = true;
  $("#app").hidden = false;
  $("#server-version").textContent = `${boot.server.name} ${boot.server.version}`;
  $("#models-dir").textContent = boot.settings.models_dir;
  setModels(boot.models);
  await Promise.all([refreshCatalog(), refreshJobs()]);
  openEvents(boot.last_event_seq);
}

$("#login-form").addEventListener("submit", async (event) => {
  event.preventDefault();
  $("#login-error").textContent = "";
  try {
    await connect($("#key-input").value.trim());
  } catch (error) {
    $("#login-error").textContent = error.status === 401 ? "That key is not valid for this server." : error.message;
  }
});

$("#logout").addEventListener("click", () => {
  sessionStorage.removeItem(KEY_STORE);
  location.reload();
});

// ---- navigation ----

const TITLES = { models: "Models", dashboard: "Dashboard", chat: "Chat" };
for (const button of document.querySelectorAll(".nav")) {
  button.addEventListener("click", () => showPage(button.dataset.page));
}
function showPage(page) {
  for (const button of document.querySelectorAll(".nav")) button.classList.toggle("active", button.dataset.page === page);
  for (const name of Object.keys(TITLES)) $(`#page-${name}`).hidden = name !== page;
  $("#page-title").textContent = TITLES[page];
  if (page === "chat") $("#chat-input").focus();
  if (page === "dashboard") drawCharts();
}

// ---- models ----

function setModels(models) {
  state.models = models;
  const chat = models.chat;
  const pill = $("#served-model");
  const loading = models.loading && models.loading.chat;
  pill.textContent = chat ? chat.name : loading ? `loading ${loading}…` : "no model";
  pill.classList.toggle("on", Boolean(chat));
  renderLoaded();
  renderCatalog();
}

function renderLoaded() {
  const models = state.models || {};
  const cards = [
    ["chat", models.chat ? models.chat.name : null,
      models.chat ? `${models.chat.model_type} · ${models.chat.slots} slots · ${models.chat.context_size} tokens each` : "Load a chat model from the catalog."],
    ["embedding", models.embedding, models.embedding ? "served on /v1/embeddings" : "optional side model"],
    ["rerank", models.rerank, models.rerank ? "served on /v1/rerank" : "optional side model"],
  ];
  $("#loaded-cards").replaceChildren(...cards.map(([role, name, meta]) => el("div",
    { class: `card loaded ${name ? "" : "empty"}`, dataset: { role } },
    el("div", { class: "role" }, role === "chat" ? "Chat model" : `${role} model`),
    el("div", { class: "name" }, name || (models.loading && models.loading[role] ? `loading ${models.loading[role]}…` : "none")),
    el("div", { class: "meta" }, meta),
    name ? el("div", { class: "row" },
      el("button", { class: "small act-unload", onclick: () => unload(role, name) }, "Unload")) : "")));
}

async function refreshCatalog() {
  try {
    const catalog = await api("/catalog");
    state.catalog = catalog.data;
    renderCatalog();
  } catch (error) {
    toast(`Catalog: ${error.message}`, "bad");
  }
}
$("#refresh-catalog").addEventListener("click", refreshCatalog);

function formatBytes(n) {
  if (!n) return "—";
  const units = ["B", "KB", "MB", "GB", "TB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i += 1; }
  return `${n.toFixed(n >= 10 || i === 0 ? 0 : 1)} ${units[i]}`;
}

function renderCatalog() {
  const body = $("#catalog-body");
  if (!state.catalog.length) {
    body.replaceChildren(el("tr", {}, el("td", { colspan: 7, class: "muted" }, "No models yet: download one below.")));
    return;
  }
  const hasChat = Boolean(state.models && state.models.chat);
  body.replaceChildren(...state.catalog.map((entry) => {
    const actions = [];
    if (entry.loaded_as) {
      actions.push(el("span", { class: "tag loaded" }, `loaded · ${entry.loaded_as}`));
    } else if (entry.kind === "chat") {
      actions.push(el("button", { class: `small ${hasChat ? "act-switch" : "primary act-load"}`,
        onclick: () => (hasChat ? switchTo(entry) : load(entry, "chat")) }, hasChat ? "Switch to" : "Load"));
    } else {
      actions.push(el("button", { class: "small act-load", onclick: () => load(entry, entry.kind) }, `Load as ${entry.kind}`));
    }
    if (entry.is_deletable && !entry.loaded_as) {
      actions.push(el("button", { class: "small danger act-delete", onclick: () => remove(entry) }, "Delete"));
    }
    return el("tr", { dataset: { id: entry.id, name: entry.name } },
      el("td", {}, el("div", { class: "model-name" }, entry.name), el("div", { class: "model-src" }, entry.source)),
      el("td", {}, el("span", { class: `tag ${entry.kind}` }, entry.kind)),
      el("td", {}, entry.family || "—"),
      el("td", {}, entry.quantization || "—"),
      el("td", {}, entry.context ? entry.context.toLocaleString() : "—"),
      el("td", {}, formatBytes(entry.size_bytes)),
      el("td", { class: "actions" }, actions));
  }));
}

async function startJob(path, body, label) {
  try {
    const { job } = await post(path, body);
    upsertJob(job);
    toast(`${label} started`);
  } catch (error) {
    toast(`${label}: ${error.message}`, "bad");
  }
}
const load = (entry, role) => startJob("/models/load", { model: entry.id, role }, `Loading ${entry.name}`);
const switchTo = (entry) => startJob("/models/switch", { model: entry.id, mode: "drain" }, `Switching to ${entry.name}`);
const unload = (role, name) => startJob("/models/unload", { role, mode: "drain" }, `Unloading ${name}`);

async function remove(entry) {
  const dialog = $("#confirm");
  $("#confirm-title").textContent = `Delete ${entry.name}?`;
  $("#confirm-text").textContent = `This removes ${formatBytes(entry.size_bytes)} from ${state.boot.settings.models_dir}. It cannot be undone.`;
  dialog.returnValue = "";
  dialog.showModal();
  dialog.addEventListener("close", async () => {
    if (dialog.returnValue !== "ok") return;
    try {
      await post("/models/delete", { model: entry.id });
      toast(`Deleted ${entry.name}`, "ok");
    } catch (error) {
      toast(`Delete: ${error.message}`, "bad");
    }
    refreshCatalog();
  }, { once: true });
}

$("#download-form").addEventListener("submit", async (event) => {
  event.preventDefault();
  const repo = $("#download-input").value.trim();
  $("#download-error").textContent = "";
  try {
    const { job } = await post("/downloads", { repo_id: repo });
    upsertJob(job);
    $("#download-input").value = "";
  } catch (error) {
    $("#download-error").textContent = error.message;
  }
});

// ---- jobs ----

async function refreshJobs() {
  const { data } = await api("/jobs");
  for (const job of data.reverse()) state.jobs.set(job.id, job);
  renderJobs();
}

function upsertJob(job) {
  const before = state.jobs.get(job.id);
  state.jobs.set(job.id, job);
  renderJobs();
  if (before && before.state !== job.state && ["succeeded", "failed", "cancelled"].includes(job.state)) {
    const what = `${job.kind.replace("_", " ")} ${job.target || (job.kind.startsWith("load") ? "default model" : "")}`.trim();
    if (job.state === "failed") toast(`${what} failed: ${job.error}`, "bad");
    else toast(`${what} ${job.state}`, job.state === "succeeded" ? "ok" : "");
    if (job.kind === "download" || job.kind.includes("load") || job.kind === "switch") refreshCatalog();
  }
}

function renderJobs() {
  const jobs = [...state.jobs.values()].sort((a, b) => b.created - a.created).slice(0, 30);
  if (!jobs.length) return;
  $("#jobs").replaceChildren(...jobs.map((job) => {
    const pct = Math.round(job.progress * 100);
    const fill = el("div", { class: "bar-fill" });
    fill.style.width = `${pct}%`;
    const active = !["succeeded", "failed", "cancelled"].includes(job.state);
    return el("li", { class: `job ${job.state}`, dataset: { id: job.id, kind: job.kind, state: job.state } },
      el("div", { class: "job-top" },
        el("span", { class: "job-kind" }, job.kind.replace("_", " ")),
        el("span", { class: "job-target" }, job.target || (job.kind.startsWith("load") ? "default model" : "")),
        el("span", { class: "job-pct" }, `${pct}%`),
        el("span", { class: `job-state ${job.state}` }, job.state),
        active ? el("button", { class: "small ghost", onclick: () => post(`/jobs/${job.id}/cancel`).catch((e) => toast(e.message, "bad")) }, "Cancel") : ""),
      el("div", { class: "bar", role: "progressbar", "aria-valuemin": 0, "aria-valuemax": 100, "aria-valuenow": pct }, fill),
      el("div", { class: "job-msg" }, job.error || job.message || ""));
  }));
}

// ---- events (SSE over fetch, so the key stays in a header) ----

async function openEvents(since) {
  let seq = since;
  let delay = 500;
  for (;;) {
    const controller = new AbortController();
    state.eventsAbort = controller;
    try {
      const reply = await fetch(`${API}/events?since=${seq}`, { headers: { Authorization: `Bearer ${state.key}` }, signal: controller.signal });
      if (reply.status === 401) { sessionStorage.removeItem(KEY_STORE); location.reload(); return; }
      if (!reply.ok) throw new Error(`events: ${reply.status}`);
      setConn("live", "live");
      delay = 500;
      const reader = reply.body.getReader();
      const decoder = new TextDecoder();
      let buffer = "";
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        buffer += decoder.decode(value, { stream: true });
        let cut;
        while ((cut = buffer.indexOf("\n\n")) >= 0) {
          const frame = parseFrame(buffer.slice(0, cut));
          buffer = buffer.slice(cut + 2);
          if (frame) { if (frame.id) seq = Number(frame.id); onEvent(frame.event, frame.data); }
        }
      }
    } catch (error) {
      /* reconnect below */
    }
    setConn("down", "reconnecting");
    await new Promise((r) => setTimeout(r, delay));
    delay = Math.min(delay * 2, 8000);
  }
}

function parseFrame(text) {
  const frame = { event: "message", data: "", id: null };
  for (const line of text.split("\n")) {
    if (line.startsWith("event: ")) frame.event = line.slice(7);
    else if (line.startsWith("data: ")) frame.data += line.slice(6);
    else if (line.startsWith("id: ")) frame.id = line.slice(4);
  }
  if (!frame.data) return null;
  try { frame.data = JSON.parse(frame.data); } catch { return null; }
  return frame;
}

function onEvent(kind, data) {
  if (kind === "job") upsertJob(data);
  else if (kind === "model" || kind === "hello") api("/models").then(setModels).catch(() => {});
  else if (kind === "catalog") refreshCatalog();
  else if (kind === "stats") onStats(data);
}

function setConn(kind, text) {
  $("#conn").className = `conn ${kind}`;
  $("#conn-text").textContent = text;
}

// ---- dashboard ----

const CHARTS = {
  tps: { color: "#8f9bff" }, pps: { color: "#b36dff" }, queue: { color: "#f5b14c" },
  active: { color: "#3ecf8e" }, kv: { color: "#7fd9c0", max: 100 }, hit: { color: "#ff8fa3", max: 100 },
};

function onStats(stats) {
  const values = {
    tps: stats.throughput.generated_tokens_per_s, pps: stats.throughput.prompt_tokens_per_s,
    queue: stats.queue_depth, active: stats.active,
    kv: stats.kv ? stats.kv.usage * 100 : 0, hit: stats.prefix_cache ? stats.prefix_cache.hit_rate * 100 : 0,
  };
  for (const [name, value] of Object.entries(values)) {
    const series = (state.series[name] ||= []);
    series.push(value);
    if (series.length > HISTORY) series.shift();
  }
  $("#m-tps").textContent = values.tps.toFixed(1);
  $("#m-pps").textContent = values.pps.toFixed(0);
  $("#m-queue").textContent = values.queue;
  $("#m-active").textContent = values.active;
  $("#m-slots").textContent = `/ ${stats.max_batch_size}`;
  $("#m-kv").textContent = values.kv.toFixed(0);
  $("#m-hit").textContent = values.hit.toFixed(0);
  renderSlots(stats);
  renderCounters(stats);
  if (!$("#page-dashboard").hidden) drawCharts();
}

function drawCharts() {
  for (const [name, chart] of Object.entries(CHARTS)) {
    const canvas = $(`#c-${name}`);
    const series = state.series[name] || [];
    const ratio = window.devicePixelRatio || 1;
    const width = canvas.clientWidth || 260;
    const height = canvas.clientHeight || 48;
    canvas.width = width * ratio;
    canvas.height = height * ratio;
    const ctx = canvas.getContext("2d");
    ctx.scale(ratio, ratio);
    ctx.clearRect(0, 0, width, height);
    if (series.length < 2) continue;
    const max = chart.max || Math.max(1, ...series) * 1.15;
    const step = width / (HISTORY - 1);
    const x0 = width - (series.length - 1) * step;
    const y = (v) => height - 2 - (v / max) * (height - 6);
    ctx.beginPath();
    series.forEach((v, i) => (i ? ctx.lineTo(x0 + i * step, y(v)) : ctx.moveTo(x0, y(v))));
    ctx.strokeStyle = chart.color;
    ctx.lineWidth = 1.6;
    ctx.stroke();
    ctx.lineTo(x0 + (series.length - 1) * step, height);
    ctx.lineTo(x0, height);
    ctx.closePath();
    const gradient = ctx.createLinearGradient(0, 0, 0, height);
    gradient.addColorStop(0, `${chart.color}55`);
    gradient.addColorStop(1, `${chart.color}00`);
    ctx.fillStyle = gradient;
    ctx.fill();
  }
}

function renderSlots(stats) {
  if (!stats.slots.length) {
    $("#slots").replaceChildren(el("p", { class: "muted" }, "No model loaded."));
    return;
  }
  $("#slots").replaceChildren(...stats.slots.map((slot) => el("div", { class: `slot ${slot.is_processing ? "busy" : ""}` },
    el("b", {}, `Slot ${slot.id}`),
    slot.is_processing ? `${slot.n_prompt_tokens} prompt · ${slot.n_decoded} out` : "idle")));
}

function renderCounters(stats) {
  const c = stats.counters || {};
  const p = stats.prefix_cache || {};
  const rows = [["Model", stats.model || "—"], ["Requests started", c.requests_started ?? 0],
    ["Requests completed", c.requests_completed ?? 0], ["Tokens generated", c.tokens_generated ?? 0],
    ["Prompt tokens", c.prompt_tokens ?? 0], ["Prefix hits / misses", `${p.hits ?? 0} / ${p.misses ?? 0}`],
    ["Reused prompt tokens", p.reused_tokens ?? 0], ["KV blocks used / free", stats.kv ? `${stats.kv.blocks_used} / ${stats.kv.blocks_free}` : "—"],
    ["Host prefix cache", p.host ? `${formatBytes(p.host.size_bytes)} of ${formatBytes(p.host.capacity_bytes)} · ${p.host.hits} hits` : "off"],
    ["Disk prefix cache", p.disk ? `${formatBytes(p.disk.size_bytes)} of ${formatBytes(p.disk.capacity_bytes)} · ${p.disk.hits} hits${p.disk.writable ? "" : " · read-only"}` : "off"]];
  $("#counters").replaceChildren(...rows.flatMap(([k, v]) => [el("dt", {}, k), el("dd", {}, String(v))]));
}

// ---- chat ----

$("#p-temp").addEventListener("input", () => { $("#o-temp").textContent = $("#p-temp").value; });
$("#chat-clear").addEventListener("click", () => {
  state.chat = [];
  $("#messages").replaceChildren(el("div", { class: "empty muted" }, "Conversation cleared."));
});
$("#chat-input").addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey) { event.preventDefault(); $("#chat-form").requestSubmit(); }
});
$("#chat-stop").addEventListener("click", () => state.chatAbort && state.chatAbort.abort());
$("#chat-form").addEventListener("submit", async (event) => {
  event.preventDefault();
  const text = $("#chat-input").value.trim();
  if (!text || state.chatAbort) return;
  $("#chat-input").value = "";
  const file = $("#chat-image").files[0];
  $("#chat-image").value = "";
  sendChat(text, file ? await dataUrl(file) : null);
});

// An attached image goes as an image_url data URL before the text (issue 43: a model that takes images).
function dataUrl(file) {
  return new Promise((resolve, reject) => {
    const reader = new FileReader();
    reader.onload = () => resolve(reader.result);
    reader.onerror = () => reject(reader.error);
    reader.readAsDataURL(file);
  });
}

function addMessage(role, text) {
  $(".messages .empty")?.remove();
  const content = el("div", { class: "content" }, text);
  const node = el("div", { class: `msg ${role}` }, content);
  $("#messages").append(node);
  node.scrollIntoView({ block: "end" });
  return { node, content };
}

async function sendChat(text, image = null) {
  const userContent = image ? [{ type: "image_url", image_url: { url: image } }, { type: "text", text }] : text;
  state.chat.push({ role: "user", content: userContent });
  addMessage("user", image ? `[image] ${text}` : text);
  const { node, content } = addMessage("assistant", "");
  let reasoning = null;
  const controller = new AbortController();
  state.chatAbort = controller;
  $("#chat-stop").hidden = false;
  $("#chat-send").disabled = true;
  const system = $("#p-system").value.trim();
  const body = { model: state.models?.chat?.name || "default", stream: true, stream_options: { include_usage: true },
    temperature: Number($("#p-temp").value), max_tokens: Number($("#p-max").value) || 256,
    messages: [...(system ? [{ role: "system", content: system }] : []), ...state.chat] };
  let answer = "";
  let finish = null;
  let usage = null;
  const started = performance.now();
  try {
    const reply = await fetch(CHAT_URL, { method: "POST", signal: controller.signal,
      headers: { "Content-Type": "application/json", Authorization: `Bearer ${state.key}` }, body: JSON.stringify(body) });
    if (!reply.ok) {
      const error = await reply.json().catch(() => ({}));
      throw new Error(error?.error?.message || `${reply.status} ${reply.statusText}`);
    }
    const reader = reply.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, { stream: true });
      const lines = buffer.split("\n");
      buffer = lines.pop();
      for (const line of lines) {
        if (!line.startsWith("data: ") || line === "data: [DONE]") continue;
        const chunk = JSON.parse(line.slice(6));
        if (chunk.usage) usage = chunk.usage;
        const choice = chunk.choices && chunk.choices[0];
        if (!choice) continue;
        const delta = choice.delta || {};
        if (delta.reasoning_content) {
          if (!reasoning) {
            reasoning = el("div", { class: "reasoning-text" });
            node.prepend(el("details", { class: "reasoning", open: true }, el("summary", {}, "Reasoning"), reasoning));
          }
          reasoning.textContent += delta.reasoning_content;
        }
        if (delta.content) { answer += delta.content; content.textContent = answer; }
        if (choice.finish_reason) finish = choice.finish_reason;
        node.scrollIntoView({ block: "end" });
      }
    }
  } catch (error) {
    if (error.name === "AbortError") finish = "stopped";
    else { node.classList.add("error"); content.textContent = error.message; }
  } finally {
    state.chatAbort = null;
    $("#chat-stop").hidden = true;
    $("#chat-send").disabled = false;
  }
  if (answer) state.chat.push({ role: "assistant", content: answer });
  const seconds = (performance.now() - started) / 1000;
  const tokens = usage ? usage.completion_tokens : null;
  const facts = [finish && `finish: ${finish}`, tokens !== null && `${tokens} tokens`,
    tokens ? `${(tokens / seconds).toFixed(1)} tok/s` : null, `${seconds.toFixed(1)} s`].filter(Boolean);
  node.append(el("div", { class: "stats" }, facts.join(" · ")));
  node.dataset.done = "true";
}

// ---- start ----

if (state.key) {
  connect(state.key).catch(() => { sessionStorage.removeItem(KEY_STORE); $("#key-input").focus(); });
} else {
  $("#key-input").focus();
}
