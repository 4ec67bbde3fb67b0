// siesta status page: live from the control plane's /events (server-sent
// Watch events, resumed by event id), operations through /api/models/...
"use strict";

const token = new URLSearchParams(location.search).get("token") || "";
const S = { models: new Map(), gpus: null, revision: 0, lastId: "", control: "", history: null };
// What arrived when, for tools and tests: {model, state, sleep_level, held,
// held_shown (the row's held cell once rendered), revision, event_at, seen_at}.
window.siesta = { seen: [] };

function withToken(path) {
  return token ? path + (path.includes("?") ? "&" : "?") + "token=" + encodeURIComponent(token) : path;
}

async function api(method, path) {
  const headers = token ? { Authorization: "Bearer " + token } : {};
  const r = await fetch(path, { method, headers });
  const body = await r.json().catch(() => ({}));
  if (!r.ok) throw new Error((body.error && body.error.message) || r.status + " " + r.statusText);
  return body;
}

function el(tag, attrs = {}, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === "text") e.textContent = v;
    else if (k.startsWith("on")) e.addEventListener(k.slice(2), v);
    else e.setAttribute(k, v);
  }
  for (const c of children) if (c != null) e.append(c);
  return e;
}

function gib(b) { return (b / 1073741824).toFixed(1) + " GiB"; }
function ago(ms) {
  const s = Math.max(0, Math.round((Date.now() - ms) / 1000));
  if (s < 90) return s + "s";
  if (s < 5400) return Math.round(s / 60) + "m";
  return (s / 3600).toFixed(1) + "h";
}
function inTime(ms) {
  const s = Math.max(0, Math.round((ms - Date.now()) / 1000));
  return s < 90 ? s + "s" : s < 5400 ? Math.round(s / 60) + "m" : (s / 3600).toFixed(1) + "h";
}
function stateLabel(m) {
  return (m.state === "asleep" || m.state === "sleeping") && m.sleep_level > 0
    ? `${m.state} L${m.sleep_level}` : m.state;
}
function colour(name) {
  let h = 0;
  for (const c of name) h = (h * 31 + c.charCodeAt(0)) % 360;
  return `hsl(${h} 60% 55%)`;
}
function engineBytes(name) {
  let used = 0;
  for (const g of (S.gpus && S.gpus.gpus) || [])
    for (const p of g.processes) if (p.model === name) used += p.used_bytes;
  return used;
}

function log(text, cls) {
  const ol = document.getElementById("log");
  ol.prepend(el("li", { text: new Date().toLocaleTimeString() + "  " + text, class: cls || "" }));
  while (ol.children.length > 200) ol.lastChild.remove();
}

async function op(name, what, query) {
  const out = document.getElementById("op-result");
  try {
    const r = await api("POST", `/api/models/${encodeURIComponent(name)}/${what}${query || ""}`);
    out.textContent = `${what} ${name}: ${r.message}` + (r.warning ? ` (warning: ${r.warning})` : "");
    out.dataset.ok = r.warning ? "false" : "true";
  } catch (e) {
    out.textContent = `${what} ${name}: ${e.message}`;
    out.dataset.ok = "false";
  }
}

function wakeProgress(m) {
  if (m.state !== "waking" && m.state !== "starting") return null;
  const c = m.calibration || {};
  const expected = m.state === "starting" ? c.start_ms : m.sleep_level === 2 ? c.wake_l2_ms : c.wake_l1_ms;
  if (!expected) return el("div", { class: "muted", text: `${ago(m.state_since_unix_ms)} (not calibrated yet)` });
  const done = Date.now() - m.state_since_unix_ms;
  const pct = Math.min(100, (100 * done) / expected);
  return el("div", {},
    el("div", { class: "progress" }, el("span", { style: `width:${pct}%` })),
    el("span", { class: "muted", text: `${(done / 1000).toFixed(1)}s of ~${(expected / 1000).toFixed(1)}s` }));
}

// Rows are kept per model and updated in place, each button kept while its
// model's pin does not change: the table is redrawn every second, and a
// click whose button was replaced between press and release was lost.
const rows = new Map();

function renderModels() {
  const tbody = document.querySelector("#models tbody");
  for (const [name, row] of rows)
    if (!S.models.has(name)) { row.tr.remove(); rows.delete(name); }
  const sorted = [...S.models.values()].sort((a, b) => a.name.localeCompare(b.name));
  sorted.forEach((m, i) => {
    const total = ((S.gpus && S.gpus.gpus) || []).filter(g => m.gpus.includes(g.index))
      .reduce((t, g) => t + g.memory_total_bytes, 0);
    const used = engineBytes(m.name);
    const pinned = m.pinned_until_unix_ms !== 0;
    const tier = m.next_tier && m.next_tier_unix_ms > 0
      ? `${m.next_tier.action === "stop" ? "stop" : "sleep L" + m.next_tier.level} in ${inTime(m.next_tier_unix_ms)}` : "-";
    const b = (what, label, query) =>
      el("button", { "data-model": m.name, "data-op": what + (query ? query.replace("?level=", "") : ""),
        text: label, onclick: () => op(m.name, what, query) });
    let row = rows.get(m.name);
    if (!row) {
      const cells = Array.from({ length: 8 }, () => el("td"));
      row = { tr: el("tr", { id: "model-" + m.name }, ...cells), cells, actions: el("td"), pinned: null };
      row.cells[5].className = "held";
      row.cells[7].className = "error";
      row.tr.append(row.actions);
      rows.set(m.name, row);
    }
    row.tr.dataset.state = m.state;
    const c = row.cells;
    c[0].replaceChildren(el("strong", { text: m.name }), pinned ? el("span", { class: "muted", text: " pinned" }) : "");
    c[1].replaceChildren(el("span", { class: "state", "data-state": m.state, text: stateLabel(m) }),
      el("span", { class: "muted", text: " " + ago(m.state_since_unix_ms) }), wakeProgress(m) || "");
    c[2].textContent = m.gpus.length ? m.gpus.join(",") : "-";
    c[3].replaceChildren(el("div", { class: "bar", title: `${gib(used)} of ${gib(total)}` },
        el("span", { style: `width:${total ? (100 * used) / total : 0}%;background:${colour(m.name)}` })),
      el("span", { class: "muted", text: used ? gib(used) : "-" }));
    c[4].textContent = String(m.in_flight);
    c[5].textContent = String(m.held || 0);
    c[6].textContent = tier;
    c[7].textContent = m.last_error || "";
    if (row.pinned !== pinned) {
      row.actions.replaceChildren(b("wake", "wake"), b("sleep", "sleep L1", "?level=1"), b("sleep", "sleep L2", "?level=2"),
        pinned ? b("unpin", "unpin") : b("pin", "pin"), b("stop", "stop"));
      row.pinned = pinned;
    }
    if (tbody.children[i] !== row.tr) tbody.insertBefore(row.tr, tbody.children[i] || null);
  });
  window.siesta.renders = (window.siesta.renders || 0) + 1;
}

function renderGpus() {
  const box = document.getElementById("gpus");
  box.replaceChildren();
  const g = S.gpus;
  // Why the GPUs shown are an older read (NVML silent or failing), or not NVML's.
  if (g && g.note) box.append(el("div", { class: "gpu-note", id: "gpu-note", text: g.note }));
  if (!g || !g.gpus.length) { box.append(el("span", { class: "muted", text: "no GPUs" })); return; }
  for (const gpu of g.gpus) {
    const bar = el("div", { class: "bar" });
    let known = 0;
    for (const p of gpu.processes) {
      known += p.used_bytes;
      bar.append(el("span", { title: `${p.model || "pid " + p.pid}: ${gib(p.used_bytes)}`,
        style: `width:${(100 * p.used_bytes) / gpu.memory_total_bytes}%;background:${p.model ? colour(p.model) : "var(--stopped)"}` }));
    }
    const other = Math.max(0, gpu.memory_used_bytes - known);
    bar.append(el("span", { class: "other", title: `other: ${gib(other)}`, style: `width:${(100 * other) / gpu.memory_total_bytes}%` }));
    const p2p = g.p2p.filter(p => p.src === gpu.index).map(p => `→${p.dst} ${p.health}`).join("  ");
    box.append(el("div", { class: "gpu", id: "gpu-" + gpu.index },
      el("span", { text: `GPU ${gpu.index} ${gpu.name}` }), bar,
      el("span", { class: "muted", text: `${gib(gpu.memory_used_bytes)} / ${gib(gpu.memory_total_bytes)}  ${p2p}` })));
  }
}

function spanClass(s) {
  if (s.state === "awake") return "awake";
  if (s.state === "asleep") return s.sleep_level === 2 ? "asleep2" : "asleep1";
  if (s.state === "stopped") return "stopped";
  if (s.state === "failed") return "failed";
  return "busy";
}

function renderHistory() {
  const h = S.history;
  const box = document.getElementById("timelines");
  box.replaceChildren();
  if (!h) return;
  const now = Date.now(), from = now - 3600000;
  for (const [name, spans] of Object.entries(h.timelines)) {
    const svg = document.createElementNS("http://www.w3.org/2000/svg", "svg");
    svg.setAttribute("viewBox", "0 0 1000 10");
    svg.setAttribute("preserveAspectRatio", "none");
    spans.forEach((s, i) => {
      const a = Math.max(s.at_unix_ms, from), b = i + 1 < spans.length ? spans[i + 1].at_unix_ms : now;
      if (b <= from) return;
      const r = document.createElementNS("http://www.w3.org/2000/svg", "rect");
      r.setAttribute("x", (1000 * (a - from)) / 3600000);
      r.setAttribute("width", Math.max(1, (1000 * (b - a)) / 3600000));
      r.setAttribute("height", 10);
      r.setAttribute("style", `fill:var(--${spanClass(s)})`);
      r.append(document.createElementNS("http://www.w3.org/2000/svg", "title"));
      r.firstChild.textContent = `${s.state}${s.sleep_level ? " L" + s.sleep_level : ""} from ${new Date(s.at_unix_ms).toLocaleTimeString()}`;
      svg.append(r);
    });
    box.append(el("div", { class: "timeline" }, el("span", { text: name }), svg));
  }
  const wakes = document.getElementById("wakes");
  wakes.replaceChildren();
  if (!h.wakes.length) { wakes.append(el("span", { class: "muted", text: "no wakes in the last hour" })); return; }
  const max = Math.max(...h.wakes.map(w => Math.max(w.duration_ms, w.calibrated_ms)), 1);
  const ns = "http://www.w3.org/2000/svg";
  const svg = document.createElementNS(ns, "svg");
  svg.setAttribute("viewBox", "0 0 1000 180");
  const step = 1000 / Math.max(h.wakes.length, 10);
  h.wakes.forEach((w, i) => {
    const x = i * step, hgt = (170 * w.duration_ms) / max;
    const bar = document.createElementNS(ns, "rect");
    bar.setAttribute("x", x + 2); bar.setAttribute("width", Math.max(2, step - 4));
    bar.setAttribute("y", 175 - hgt); bar.setAttribute("height", hgt);
    bar.setAttribute("fill", colour(w.model));
    const t = document.createElementNS(ns, "title");
    t.textContent = `${w.model} from ${w.from}: ${w.duration_ms} ms (calibrated ${w.calibrated_ms || "-"} ms)`;
    bar.append(t); svg.append(bar);
    if (w.calibrated_ms) {
      const c = document.createElementNS(ns, "line");
      const y = 175 - (170 * w.calibrated_ms) / max;
      c.setAttribute("x1", x); c.setAttribute("x2", x + step); c.setAttribute("y1", y); c.setAttribute("y2", y);
      c.setAttribute("stroke", "#fff"); c.setAttribute("stroke-dasharray", "4 2");
      svg.append(c);
    }
  });
  wakes.append(svg, el("div", { class: "muted", text: "bars: measured wake (or start) time; dashed: the calibrated time before it" }));
}

let historyPending = false;
async function refreshHistory() {
  if (historyPending) return;
  historyPending = true;
  try { S.history = await api("GET", "/api/history"); renderHistory(); } catch (e) { /* the stream says why */ }
  historyPending = false;
}

function render() {
  document.getElementById("revision").textContent = "revision " + S.revision;
  document.getElementById("control").textContent = S.control;
  renderGpus();
  renderModels();
}

function setConn(state, text) {
  const c = document.getElementById("conn");
  c.dataset.conn = state;
  c.textContent = text;
}

let source = null;
function connect() {
  // Resume from the last event's id (INCARNATION-REVISION), not the bare
  // revision: after a control plane restart revisions start again at 1, and
  // an id of the old process gets a fresh snapshot instead of a gap.
  const url = withToken(S.lastId ? `/events?since=${encodeURIComponent(S.lastId)}` : "/events");
  source = new EventSource(url);
  source.onopen = () => setConn("live", "live");
  source.onerror = () => {
    setConn("reconnecting", "reconnecting…");
    if (source.readyState === EventSource.CLOSED) setTimeout(connect, 2000);
  };
  const take = (e) => { const ev = JSON.parse(e.data); S.revision = ev.revision; S.lastId = e.lastEventId; S.control = ev.control_id; return ev; };
  source.addEventListener("snapshot", (e) => {
    const ev = take(e);
    S.models = new Map(ev.models.map(m => [m.name, m]));
    if (ev.gpus) S.gpus = ev.gpus;
    log(ev.resync ? "resynced" : `snapshot: ${S.models.size} models`);
    render(); refreshHistory();
  });
  source.addEventListener("model", (e) => {
    const ev = take(e), m = ev.model;
    const before = S.models.get(m.name);
    S.models.set(m.name, m);
    render();
    const heldCell = document.querySelector(`#model-${CSS.escape(m.name)} td.held`);
    window.siesta.seen.push({ model: m.name, state: m.state, sleep_level: m.sleep_level,
      held: m.held || 0, held_shown: heldCell ? heldCell.textContent : null, revision: ev.revision, event_at: ev.at_unix_ms, seen_at: Date.now() });
    if (window.siesta.seen.length > 1000) window.siesta.seen.shift();
    if (!before || before.state !== m.state || before.sleep_level !== m.sleep_level) {
      log(`${m.name}: ${before ? stateLabel(before) + " → " : ""}${stateLabel(m)}${m.last_error ? " (" + m.last_error + ")" : ""}`);
      refreshHistory();
    }
  });
  source.addEventListener("model_removed", (e) => {
    const name = take(e).model_removed;
    S.models.delete(name); log(`${name} removed`); render();
  });
  source.addEventListener("gpus", (e) => { S.gpus = take(e).gpus; render(); });
  source.addEventListener("placement", (e) => { take(e); });
}

connect();
// Ages and progress bars move with the clock; the data comes only from the stream.
setInterval(() => { if (S.models.size) renderModels(); }, 1000);
setInterval(renderHistory, 30000);
