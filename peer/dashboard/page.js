"use strict";
// Everything shown is text from the collaboration's public records: it goes in through
// textContent and SVG attributes, never as markup.
const NS = "http://www.w3.org/2000/svg";

function el(name, attrs, text) {
  const node = document.createElementNS(NS, name);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, String(v));
  if (text !== undefined) node.textContent = text;
  return node;
}

function chart(id, points, color, isTime) {
  const svg = document.getElementById(id);
  const width = svg.clientWidth || 400, height = svg.clientHeight || 180, pad = 32;
  svg.replaceChildren();
  svg.appendChild(el("line", {class: "axis", x1: pad, y1: height - pad, x2: width - 4, y2: height - pad}));
  svg.appendChild(el("line", {class: "axis", x1: pad, y1: 4, x2: pad, y2: height - pad}));
  const shown = points.filter(p => p[1] !== null && Number.isFinite(p[1]));
  if (!shown.length) return;
  const xs = shown.map(p => p[0]), ys = shown.map(p => p[1]);
  const x0 = Math.min(...xs), x1 = Math.max(...xs), y0 = Math.min(0, ...ys), y1 = Math.max(...ys);
  const sx = v => pad + (x1 === x0 ? 0.5 : (v - x0) / (x1 - x0)) * (width - pad - 8);
  const sy = v => height - pad - (y1 === y0 ? 0.5 : (v - y0) / (y1 - y0)) * (height - pad - 8);
  svg.appendChild(el("polyline", {stroke: color, points: shown.map(p => `${sx(p[0])},${sy(p[1])}`).join(" ")}));
  for (const p of shown) svg.appendChild(el("circle", {class: "point", cx: sx(p[0]), cy: sy(p[1]), r: 2.5, fill: color}));
  const fmt = v => isTime ? new Date(v * 1000).toLocaleTimeString() : String(v);
  svg.appendChild(el("text", {class: "label", x: pad, y: height - pad + 14}, fmt(x0)));
  svg.appendChild(el("text", {class: "label", x: width - 60, y: height - pad + 14}, fmt(x1)));
  svg.appendChild(el("text", {class: "label", x: 2, y: 12}, y1.toPrecision(3)));
  svg.appendChild(el("text", {class: "label", x: 2, y: height - pad}, y0.toPrecision(3)));
}

function cell(row, text) {
  const td = document.createElement("td");
  td.textContent = text;
  row.appendChild(td);
}

const num = (v, digits) => (v === null || v === undefined) ? "–" : Number(v).toFixed(digits);
const mbit = v => (v === null || v === undefined) ? "–" : (v * 8 / 1e6).toFixed(1);

const plural = (n, word) => `${n} ${word}${n === 1 ? "" : "s"}`;
const online = c => `${plural(c.peers_online, "peer")}, ${plural(c.backbones_online, "backbone")} online`;

function render(state) {
  const c = state.collaboration;
  if (c) {
    document.getElementById("title").textContent = `peertrain: ${c.name}`;
    const t = c.training;
    document.getElementById("summary").textContent = t
      ? `global step ${t.global_step} · ${t.trainers} trainers at it (${t.trainers_behind} behind) · ` +
        `${num(t.samples_per_s, 0)} samples/s · loss ${num(t.loss, 4)}` +
        (t.validation ? ` · validation ${num(t.validation[1], 4)} at step ${t.validation[0]}` : "") +
        ` · ${online(c)}`
      : `${online(c)}; no training yet`;
  }
  chart("loss-chart", state.loss, "#1f77b4", false);
  chart("validation-chart", state.validation, "#d62728", false);
  chart("throughput-chart", state.throughput, "#2ca02c", true);
  chart("peers-chart", state.peers_online, "#9467bd", true);
  const body = document.getElementById("peers");
  body.replaceChildren();
  for (const p of state.peers) {
    const row = document.createElement("tr");
    row.dataset.peer = p.peer_id;
    cell(row, p.peer_id.slice(-10));
    cell(row, p.progress_role || p.role);
    cell(row, p.work || "–");
    cell(row, num(p.samples_per_s, 1));
    cell(row, mbit(p.upload_bps));
    cell(row, mbit(p.download_bps));
    cell(row, p.share === null ? "–" : `${(p.share * 100).toFixed(0)} %`);
    cell(row, p.step === null ? "–" : String(p.step));
    cell(row, p.contribution === null ? "–" : String(p.contribution));
    cell(row, num(p.loss, 4));
    body.appendChild(row);
  }
}

async function refresh() {
  try {
    const response = await fetch("/api/state", {cache: "no-store"});
    render(await response.json());
    document.getElementById("error").textContent = "";
  } catch (error) {
    document.getElementById("error").textContent = `no answer from the server (${error}); retrying`;
  }
}

refresh();
setInterval(refresh, 2000);
