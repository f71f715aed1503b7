// The playground's chart: polls the bucket's status, fires requests, draws both on an SVG.
"use strict";

const WINDOW_SECONDS = 30;
const POLL_MS = 200;
const WIDTH = 800, HEIGHT = 320, LEFT = 44, RIGHT = 12, TOP = 14, BOTTOM = 26;
const SVG = "http://www.w3.org/2000/svg";

const chart = document.getElementById("chart");
const select = document.getElementById("limit");
const csrf = document.querySelector("[name=csrfmiddlewaretoken]").value;
const api = chart.dataset.api;

let limit = null;          // the limit's config, from the status API
let samples = [];          // {t, v}: the bucket's value at the store's time t
let marks = [];            // {t, v, ok}: one per request fired
let clockOffset = 0;       // store time minus this browser's time, in seconds
let generation = 0;        // bumped on a switch of limit, so late answers are dropped
let latest = null;         // the sample of the newest decision or poll, by the store's time

const el = (name, attributes, parent) => {
  const node = document.createElementNS(SVG, name);
  for (const [key, value] of Object.entries(attributes)) node.setAttribute(key, value);
  if (parent) parent.append(node);
  return node;
};
const fmt = (x) => (Math.round(x * 100) / 100).toString();

function record(status) {
  const sample = {t: status.timestamp, v: status.value};
  samples.push(sample);
  // Answers of a burst arrive in any order; the newest decision is the one that counts.
  if (!latest || sample.t >= latest.t) {
    latest = sample;
    clockOffset = status.timestamp - Date.now() / 1000;
  }
}

// Newest first, as decided: by the store's time, and at one time by what was left
// (each decision of a burst leaves less than the one before it).
const decidedAfter = (a, b) => a.t > b.t || (a.t === b.t && a.v < b.v);

async function poll() {
  const mine = generation;
  try {
    const response = await fetch(`${api}${select.value}/`, {cache: "no-store"});
    const data = await response.json();
    if (mine === generation) {
      limit = data.limit;
      record(data.status);
      showLimit();
    }
  } finally {
    setTimeout(poll, POLL_MS);
  }
}

async function fire() {
  const mine = generation;
  const body = new URLSearchParams({count: document.getElementById("count").value});
  const response = await fetch(`${api}${select.value}/hit/`, {
    method: "POST", body, headers: {"X-CSRFToken": csrf},
  });
  const data = await response.json();
  if (mine !== generation || !data.status) return;
  const status = data.status;
  if (status.ok) samples.push({t: status.timestamp, v: status.value + status.count});
  record(status);
  marks.push({t: status.timestamp, v: status.value, ok: status.ok});
  chart.dataset[status.ok ? "allowed" : "denied"] = Number(chart.dataset[status.ok ? "allowed" : "denied"]) + 1;
  let text = `${response.status} ${status.ok ? "allowed" : "denied"}`;
  if (status.retry_after !== null) text += `, retry after ${fmt(status.retry_after)} s`;
  const entry = document.createElement("li");
  entry.className = status.ok ? "allowed" : "denied";
  entry.dataset.t = status.timestamp;
  entry.dataset.v = status.value;
  entry.textContent = `${new Date((status.timestamp) * 1000).toISOString().slice(11, 23)}  took ${status.count} → ${text}` +
    `; ${fmt(status.value)} left`;
  const log = document.getElementById("log");
  const decision = {t: status.timestamp, v: status.value};
  const older = [...log.children].find((li) => decidedAfter(decision, {t: Number(li.dataset.t), v: Number(li.dataset.v)}));
  log.insertBefore(entry, older || null);
  if (log.firstChild === entry) document.getElementById("answer").textContent = text;
  while (log.children.length > 8) log.lastChild.remove();
}

function showLimit() {
  const option = select.selectedOptions[0];
  document.getElementById("description").textContent = option.dataset.description;
  document.getElementById("capacity").textContent = fmt(limit.capacity);
  const per = limit.period === 1 ? "s" : `${fmt(limit.period)} s`;
  const window = limit.kind === "fixed window" ? " window" : "";
  document.getElementById("refill").textContent = `${fmt(limit.rate)} per ${per}${window}`;
  if (latest) document.getElementById("value").textContent = fmt(latest.v);
}

function draw() {
  requestAnimationFrame(draw);
  if (!limit) return;
  const now = Date.now() / 1000 + clockOffset;
  const start = now - WINDOW_SECONDS;
  samples = samples.filter((s) => s.t >= start - 2);
  marks = marks.filter((m) => m.t >= start - 2);
  const low = -(limit.max_reserved || 0), high = limit.capacity;
  const x = (t) => LEFT + (t - start) / WINDOW_SECONDS * (WIDTH - LEFT - RIGHT);
  const y = (v) => TOP + (high - v) / (high - low) * (HEIGHT - TOP - BOTTOM);

  chart.replaceChildren();
  const grid = el("g", {class: "grid"}, chart);
  const step = high - low > 12 ? Math.ceil((high - low) / 6) : 1;
  for (let v = low; v <= high; v += step) {
    el("line", {x1: LEFT, x2: WIDTH - RIGHT, y1: y(v), y2: y(v), class: v === 0 ? "zero" : ""}, grid);
    el("text", {x: LEFT - 8, y: y(v) + 4, "text-anchor": "end"}, grid).textContent = v;
  }
  for (let ago = WINDOW_SECONDS; ago >= 0; ago -= 5) {
    const t = now - ago;
    el("text", {x: x(t), y: HEIGHT - 6, "text-anchor": "middle"}, grid).textContent = ago ? `-${ago} s` : "now";
  }
  el("line", {x1: LEFT, x2: WIDTH - RIGHT, y1: y(high), y2: y(high), class: "capacity"}, chart);

  const points = samples.slice().sort((a, b) => a.t - b.t).filter((s) => s.t >= start);
  if (points.length) {
    const path = points.map((s) => `${x(s.t).toFixed(1)},${y(s.v).toFixed(1)}`);
    const floor = y(0);  // the area is the tokens held (above zero) or owed (below)
    el("polygon", {class: "area", points: `${x(points[0].t)},${floor} ${path.join(" ")} ${x(points.at(-1).t)},${floor}`}, chart);
    el("polyline", {class: "level", points: path.join(" ")}, chart);
  }
  const layer = el("g", {class: "marks"}, chart);
  let cluster = null;  // denials of one burst land on one spot: label how many
  for (const mark of marks.slice().sort((a, b) => a.t - b.t)) {
    if (mark.t < start) continue;
    const cx = x(mark.t), cy = y(mark.v);
    if (mark.ok) {
      el("circle", {class: "mark allowed", cx, cy, r: 5}, layer);
      continue;
    }
    el("path", {class: "mark denied", d: `M${cx - 5},${cy - 5}L${cx + 5},${cy + 5}M${cx - 5},${cy + 5}L${cx + 5},${cy - 5}`}, layer);
    if (cluster && Math.abs(cx - cluster.x) < 6 && Math.abs(cy - cluster.y) < 6) {
      cluster.count += 1;
      cluster.label.textContent = `${cluster.count}×`;
    } else {
      cluster = {x: cx, y: cy, count: 1, label: el("text", {class: "mark-label", x: cx + 9, y: cy - 7}, layer)};
    }
  }
  chart.dataset.samples = samples.length;
  if (latest) chart.dataset.value = latest.v;
}

async function burst(n) {
  // Sent together, as a real burst; the server decides them one after the other.
  await Promise.all(Array.from({length: n}, fire));
}

select.addEventListener("change", () => {
  generation += 1;
  samples = [];
  marks = [];
  latest = null;
  limit = null;
  chart.dataset.allowed = chart.dataset.denied = 0;
  document.getElementById("log").replaceChildren();
});
document.getElementById("fire-one").addEventListener("click", fire);
document.getElementById("fire-burst").addEventListener("click", () => burst(10));
document.getElementById("reset").addEventListener("click", async () => {
  const response = await fetch(`${api}${select.value}/reset/`, {method: "POST", headers: {"X-CSRFToken": csrf}});
  record((await response.json()).status);
});

poll();
requestAnimationFrame(draw);
