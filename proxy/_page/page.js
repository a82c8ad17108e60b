// The live admin page of context-proxy. It reads this proxy's admin routes only
// (same origin; the CSP forbids anything else) and writes every value as text
// (textContent, never markup): a session id is whatever a client sent.
"use strict";

const HISTORY_S = 300; // the chart keeps the last 5 minutes, one point per snapshot
const MIN_SPAN_S = 60; // and spans at least one minute, so that a fresh page is not a dot
const SLOW_POLL_MS = 5000; // sessions and usage: a page each, every 5 s
const SESSION_DETAILS = 20; // sessions whose usage is read (one request each)
const SESSIONS_LISTED = 50; // rows of the sessions table
const PHASE_COLOURS = {
  reading: "#6941c6", parsed: "#2e90fa", prepared: "#175cd3", sent: "#f79009",
  accepted: "#12b76a", streaming: "#1f9d55", committed: "#98a2b3",
};
const RSS_COLOUR = "#1d2430";
const SPOOL_COLOUR = "#98a2b3"; // spooled bytes: in files, not in the heap
const ID_CHARS = 24; // longer ids are cut (the whole id is the cell's title)
const SVG = "http://www.w3.org/2000/svg";

const history = []; // {time, rss, byPhase, spooled}
let inFlightSessions = []; // session ids of the latest snapshot's exchanges, first seen first

function bytes(n) {
  if (n === null || n === undefined) return "-";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let value = n;
  let unit = 0;
  while (value >= 1024 && unit < units.length - 1) { value /= 1024; unit += 1; }
  return (unit === 0 ? String(value) : value.toFixed(1)) + " " + units[unit];
}

function count(n) {
  return n === null || n === undefined ? "-" : Number(n).toLocaleString("en-US");
}

function ago(seconds) {
  if (seconds === null || seconds === undefined) return "-";
  if (seconds < 5) return "just now";
  for (const [unit, size] of [["d", 86400], ["h", 3600], ["m", 60]]) {
    if (seconds >= size) return Math.floor(seconds / size) + " " + unit + " ago";
  }
  return Math.floor(seconds) + " s ago";
}

function cell(text, className) {
  const td = document.createElement("td");
  if (className === "id" && text.length > ID_CHARS) {
    td.textContent = text.slice(0, ID_CHARS - 1) + "\u2026";
    td.title = text;
  } else {
    td.textContent = text;
  }
  if (className) td.className = className;
  return td;
}

function fill(tbody, rows, columns, emptyText) {
  const out = rows.map((row) => {
    const tr = document.createElement("tr");
    for (const td of row.cells) tr.appendChild(td);
    if (row.key !== undefined) tr.dataset.key = row.key;
    return tr;
  });
  if (out.length === 0) {
    const tr = document.createElement("tr");
    tr.className = "empty";
    const td = cell(emptyText);
    td.colSpan = columns;
    tr.appendChild(td);
    out.push(tr);
  }
  tbody.replaceChildren(...out);
}

function showExchanges(exchanges) {
  const rows = exchanges.map((ex) => {
    const held = ex.held_bytes;
    return {
      key: ex.id,
      cells: [
        cell(ex.id, "id"), cell(ex.protocol), cell(ex.session ?? "-", "id"),
        cell(ex.phase, "phase phase-" + ex.phase), cell(String(ex.fold_level), "num"),
        cell(bytes(held.raw), "num"), cell(bytes(held.parsed), "num"),
        cell(bytes(held.outbound), "num"), cell(bytes(held.response), "num"),
        cell(bytes(held.total), "num"), cell(bytes(held.spooled ?? 0), "num"),
        cell(ex.age_s.toFixed(1) + " s", "num"),
      ],
    };
  });
  fill(document.querySelector("#exchanges tbody"), rows, 12, "no exchange in flight");
}

function line(points, colour) {
  const path = document.createElementNS(SVG, "polyline");
  path.setAttribute("points", points.map(([x, y]) => x.toFixed(1) + "," + y.toFixed(1)).join(" "));
  path.setAttribute("fill", "none");
  path.setAttribute("stroke", colour);
  path.setAttribute("stroke-width", "2");
  return path;
}

function label(x, y, text, anchor) {
  const t = document.createElementNS(SVG, "text");
  t.setAttribute("x", String(x));
  t.setAttribute("y", String(y));
  t.setAttribute("text-anchor", anchor);
  t.textContent = text;
  return t;
}

function axes(parts, left, right, top, bottom, max, name) {
  // Under 2 bytes the half and top ticks would repeat the bottom one's label.
  for (const frac of max >= 2 ? [0, 0.5, 1] : [0]) {
    const at = bottom - frac * (bottom - top);
    const axis = document.createElementNS(SVG, "line");
    axis.setAttribute("class", "axis");
    axis.setAttribute("x1", String(left));
    axis.setAttribute("x2", String(right));
    axis.setAttribute("y1", String(at));
    axis.setAttribute("y2", String(at));
    parts.push(axis, label(left - 6, at + 4, bytes(Math.round(max * frac)), "end"));
  }
  parts.push(label(right + 6, (top + bottom) / 2 + 4, name, "start"));
}

function drawChart() {
  // Two panels on one time axis: RSS above, held bytes by phase below (held is often a
  // thousandth of RSS: on one scale it would be a flat line at zero).
  const svg = document.getElementById("chart");
  const [left, right] = [70, 820];
  const panels = { rss: [10, 95], held: [120, 205] };
  const now = history.length ? history[history.length - 1].time : 0;
  const first = history.length ? history[0].time : 0;
  const span = Math.min(HISTORY_S, Math.max(MIN_SPAN_S, now - first));
  const phases = Object.keys(PHASE_COLOURS).filter((p) => history.some((h) => h.byPhase[p]));
  const spooling = history.some((h) => h.spooled);
  let maxRss = 1;
  let maxHeld = 1;
  for (const h of history) {
    maxRss = Math.max(maxRss, h.rss ?? 0);
    maxHeld = Math.max(maxHeld, h.spooled ?? 0, ...phases.map((p) => h.byPhase[p] ?? 0));
  }
  const x = (t) => right - ((now - t) / span) * (right - left);
  const parts = [];
  axes(parts, left, right, ...panels.rss, maxRss, "RSS");
  axes(parts, left, right, ...panels.held, maxHeld, "held by phase");
  const since = span >= 120 ? Math.round(span / 60) + " min ago" : Math.round(span) + " s ago";
  parts.push(label(left, 228, since, "start"), label(right, 228, "now", "end"));
  const series = [["RSS", RSS_COLOUR, (h) => h.rss, maxRss, panels.rss]];
  for (const p of phases) {
    series.push(["held: " + p, PHASE_COLOURS[p], (h) => h.byPhase[p] ?? 0, maxHeld, panels.held]);
  }
  if (spooling) {
    // Body bytes in spool files: page cache, not the heap; drawn so RSS growth is explained.
    series.push(["spooled (file)", SPOOL_COLOUR, (h) => h.spooled ?? 0, maxHeld, panels.held]);
  }
  const legend = [];
  for (const [name, colour, value, max, [top, bottom]] of series) {
    const y = (v) => bottom - (v / max) * (bottom - top);
    const points = history.filter((h) => value(h) !== null).map((h) => [x(h.time), y(value(h))]);
    if (points.length) parts.push(line(points, colour));
    const li = document.createElement("li");
    li.textContent = name;
    li.style.setProperty("--swatch", colour);
    legend.push(li);
  }
  svg.replaceChildren(...parts);
  document.getElementById("legend").replaceChildren(...legend);
}

function onSnapshot(snap) {
  const status = document.getElementById("status");
  status.textContent = snap.draining ? "draining" : "live";
  status.className = "status live";
  document.getElementById("rss").textContent = "RSS " + bytes(snap.rss_bytes);
  showExchanges(snap.exchanges);
  inFlightSessions = [...new Set(snap.exchanges.map((ex) => ex.session).filter((s) => s))];
  history.push({
    time: snap.time, rss: snap.rss_bytes, byPhase: snap.held_by_phase,
    spooled: snap.spooled_bytes ?? 0,
  });
  while (history.length && history[0].time < snap.time - HISTORY_S) history.shift();
  drawChart();
}

async function getJSON(path) {
  const resp = await fetch(path, { headers: { Accept: "application/json" }, cache: "no-store" });
  if (!resp.ok) {
    const err = new Error(path + ": HTTP " + resp.status);
    err.status = resp.status;
    throw err;
  }
  return resp.json();
}

async function refreshSessions() {
  const tbody = document.querySelector("#sessions tbody");
  try {
    const page = await getJSON("sessions?limit=" + SESSIONS_LISTED);
    // Sessions with work in flight first (the listing is oldest first and paged, so an
    // active session may be on a later page), then the most recently active.
    const listed = new Map(page.sessions.map((s) => [s.id, s]));
    const missing = inFlightSessions.filter((id) => !listed.has(id)).slice(0, SESSION_DETAILS);
    const extra = await Promise.all(
      missing.map((id) => getJSON("sessions/" + encodeURIComponent(id)).catch(() => null)),
    );
    const sessions = [...extra.filter((s) => s && s.id), ...page.sessions];
    sessions.sort((a, b) => (b.in_flight > 0) - (a.in_flight > 0) || a.idle_s - b.idle_s);
    const shown = sessions.slice(0, SESSIONS_LISTED);
    const details = await Promise.all(
      shown.slice(0, SESSION_DETAILS).map((s) =>
        s.plugins !== undefined ? s : getJSON("sessions/" + encodeURIComponent(s.id)).catch(() => null)),
    );
    const rows = shown.map((s, i) => {
      const usage = (details[i] && details[i].plugins && details[i].plugins.usage) || {};
      return {
        key: s.id,
        cells: [
          cell(s.id, "id"), cell(count(s.in_flight), "num"), cell(count(s.requests), "num"),
          // A ledger session loaded from disk is listed with live: false.
          cell(s.tombstoned ? "closed" : s.live === false ? "stored" : ago(s.idle_s)),
          cell(count(usage.input_tokens), "num"), cell(count(usage.cache_read_tokens), "num"),
          cell(count(usage.cache_write_tokens), "num"), cell(count(usage.output_tokens), "num"),
        ],
      };
    });
    if (page.next_cursor) {
      const more = cell("more sessions: context-proxy sessions", "more");
      more.colSpan = 8;
      rows.push({ key: "more", cells: [more] });
    }
    fill(tbody, rows, 8, "no sessions");
  } catch (err) {
    fill(tbody, [], 8, "sessions unavailable (" + err.message + ")");
  }
}

async function refreshUsage() {
  const tbody = document.querySelector("#usage tbody");
  let rows = [];
  try {
    const answer = await getJSON("usage?by=model");
    rows = answer.rows.map((r) => ({
      key: r.key,
      cells: [
        cell(r.key, "id"), cell(count(r.requests), "num"), cell(count(r.input_tokens), "num"),
        cell(count(r.cached_input_tokens), "num"), cell(count(r.cache_write_tokens), "num"),
        cell(count(r.output_tokens), "num"),
      ],
    }));
  } catch (err) {
    rows = []; // 404 until the usage store is enabled (or built): "no usage data"
  }
  fill(tbody, rows, 6, "no usage data");
  document.getElementById("usage").dataset.answered = "yes"; // for the tests: a poll landed
}

function connect() {
  const events = new EventSource("events");
  events.addEventListener("snapshot", (e) => onSnapshot(JSON.parse(e.data)));
  events.addEventListener("end", () => {
    events.close();
    const status = document.getElementById("status");
    status.textContent = "proxy stopped";
    status.className = "status ended";
    showExchanges([]);
  });
  events.addEventListener("error", () => {
    if (events.readyState !== EventSource.CLOSED) {
      document.getElementById("status").textContent = "reconnecting…";
      document.getElementById("status").className = "status";
    }
  });
}

function slowPoll() {
  refreshSessions();
  refreshUsage();
}

connect();
slowPoll();
setInterval(slowPoll, SLOW_POLL_MS);
