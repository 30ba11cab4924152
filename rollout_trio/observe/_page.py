"""The live page: one HTML file with its style and script inline; it polls ``live.json`` each second."""

from __future__ import annotations

__all__ = ["PAGE_HTML"]

PAGE_HTML = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>rollout-trio live</title>
<style>
body{font:14px/1.4 system-ui,-apple-system,"Segoe UI",sans-serif;margin:0;background:#f6f7f9;color:#1d2330}
header{background:#1d2330;color:#fff;padding:10px 18px;display:flex;gap:24px;align-items:baseline;flex-wrap:wrap}
header h1{font-size:17px;margin:0}
header .dim{color:#aab}
#state.bad{color:#ff8a80}
main{padding:14px 18px;display:grid;grid-template-columns:repeat(auto-fit,minmax(330px,1fr));gap:14px}
section{background:#fff;border:1px solid #dde1e7;border-radius:6px;padding:10px 14px}
h2{font-size:13px;text-transform:uppercase;letter-spacing:.04em;color:#5a6270;margin:0 0 8px}
.tiles{display:grid;grid-template-columns:repeat(auto-fill,minmax(92px,1fr));gap:8px}
.tile{background:#f2f4f7;border-radius:4px;padding:6px 8px}
.tile b{display:block;font-size:19px;font-variant-numeric:tabular-nums}
.tile span{color:#5a6270;font-size:12px}
table{border-collapse:collapse;width:100%;font-variant-numeric:tabular-nums}
td,th{padding:3px 6px;text-align:right;border-bottom:1px solid #eef0f3}
td:first-child,th:first-child{text-align:left}
.bar{fill:#4a7bd0}.line{fill:none;stroke:#4a7bd0;stroke-width:2}.axis{stroke:#b8bfca}
svg text{font-size:11px;fill:#5a6270}
.empty{color:#8a919c;font-style:italic}
</style></head>
<body>
<header><h1>rollout-trio live</h1><span id="source" class="dim"></span>
<span>version <b id="version">-</b></span><span>loop lag <b id="looplag">-</b></span>
<span id="state" class="dim">connecting…</span></header>
<main>
<section><h2>Tasks</h2><div id="counts" class="tiles"></div></section>
<section><h2>Throughput</h2><div id="rates"></div></section>
<section><h2>Staleness of consumed data (version lag)</h2><div id="lag"></div></section>
<section><h2>Reward by weight version</h2><div id="rewards"></div></section>
<section><h2>Inference servers</h2><div id="servers"></div></section>
</main>
<script>
"use strict";
const history = {};
const HISTORY = 120;
const fmt = (v, d) => v === null || v === undefined ? "-" :
  (Number.isInteger(v) ? v.toLocaleString("en-US") : v.toFixed(d === undefined ? 2 : d));
const esc = s => String(s).replace(/[&<>"]/g, c => ({"&":"&amp;","<":"&lt;",">":"&gt;",'"':"&quot;"}[c]));
function spark(values, w, h) {
  if (values.length < 2) return "";
  const max = Math.max(...values, 1e-9);
  const pts = values.map((v, i) => `${(i / (values.length - 1) * w).toFixed(1)},${(h - v / max * (h - 4) - 2).toFixed(1)}`);
  return `<svg width="${w}" height="${h}"><line class="axis" x1="0" y1="${h-1}" x2="${w}" y2="${h-1}"/>` +
    `<polyline class="line" points="${pts.join(" ")}"/></svg>`;
}
function bars(rows, w, h) {
  if (!rows.length) return '<p class="empty">nothing consumed yet</p>';
  const max = Math.max(...rows.map(r => r[1]), 1), bw = w / rows.length;
  let s = `<svg width="${w}" height="${h + 30}">`;
  rows.forEach(([label, n], i) => {
    const bh = n / max * h;
    s += `<rect class="bar" x="${i*bw+3}" y="${h-bh+14}" width="${bw-6}" height="${bh}"/>` +
      `<text x="${i*bw+bw/2}" y="${h-bh+11}" text-anchor="middle">${fmt(n)}</text>` +
      `<text x="${i*bw+bw/2}" y="${h+27}" text-anchor="middle">${esc(label)}</text>`;
  });
  return s + "</svg>";
}
function render(snap) {
  document.getElementById("source").textContent = snap.source;
  document.getElementById("version").textContent = fmt(snap.version);
  document.getElementById("looplag").textContent = snap.loop_lag === null ? "-" : (snap.loop_lag * 1000).toFixed(1) + " ms";
  document.getElementById("counts").innerHTML = snap.counts.map(([k, v]) =>
    `<div class="tile" data-key="${esc(k)}"><b>${fmt(v)}</b><span>${esc(k)}</span></div>`).join("");
  document.getElementById("rates").innerHTML = snap.rates.length ? snap.rates.map(([k, v]) => {
    (history[k] = history[k] || []).push(v);
    if (history[k].length > HISTORY) history[k].shift();
    return `<div><b data-rate="${esc(k)}">${fmt(v, 1)}</b> ${esc(k)}<br>${spark(history[k], 300, 46)}</div>`;
  }).join("") : '<p class="empty">no rates</p>';
  const lag = snap.lag;
  document.getElementById("lag").innerHTML = bars(lag.buckets, 300, 80) +
    (lag.count ? `<div>${fmt(lag.count)} consumed, mean lag ${fmt(lag.mean)}</div>` : "");
  document.getElementById("rewards").innerHTML = snap.rewards.length ?
    "<table><tr><th>version</th><th>episodes</th><th>mean reward</th></tr>" +
    snap.rewards.map(([ver, n, m]) => `<tr><td>${ver}</td><td>${fmt(n)}</td><td>${m.toFixed(3)}</td></tr>`).join("") +
    "</table>" : '<p class="empty">no rewards yet</p>';
  document.getElementById("servers").innerHTML = snap.servers.length ?
    "<table><tr><th>server</th><th>in flight</th><th>calls</th><th>mean latency</th><th>aborts</th><th>errors</th></tr>" +
    snap.servers.map(s => `<tr><td>${esc(s.server)}</td><td>${fmt(s.in_flight)}</td><td>${fmt(s.calls)}</td>` +
      `<td>${s.mean_latency === null ? "-" : (s.mean_latency * 1000).toFixed(1) + " ms"}</td>` +
      `<td>${fmt(s.aborts)}</td><td>${fmt(s.errors)}</td></tr>`).join("") + "</table>" :
    '<p class="empty">no remote servers (an embedded engine)</p>';
}
async function poll() {
  const state = document.getElementById("state");
  try {
    const r = await fetch("live.json", {cache: "no-store"});
    if (!r.ok) throw new Error("HTTP " + r.status);
    render(await r.json());
    state.textContent = "updated " + new Date().toLocaleTimeString();
    state.className = "dim";
  } catch (e) {
    state.textContent = "disconnected (" + e.message + ")";
    state.className = "bad";
  }
  setTimeout(poll, 1000);
}
poll();
</script>
</body></html>
"""
