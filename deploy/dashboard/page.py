"""The dashboard page: one self-contained HTML document (inline CSS and JS, no CDN, no build step).

Mental model: the page is a thin view. Every ~2 s it fetches `<page path>/data` (the query string,
which may carry an access key, is passed on), and redraws every section from that one JSON object
with plain DOM calls and SVG; it keeps nothing but a short history of tokens/s for the sparkline.
Text from the server (tenant and worker names) is only ever set as `textContent`, never parsed as
HTML. Numbers are formatted in one place (`fmtMs`, `fmtPct`, `fmtRate`): latencies with one
decimal in ms, rates with two decimals, so a test can predict every rendered string from the JSON.
Elements carry `data-tenant` / `data-worker` / `data-tier` / `data-field` attributes for tests.
"""

from __future__ import annotations

PAGE_HTML = r"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>ferry dashboard</title>
<meta name="viewport" content="width=device-width, initial-scale=1">
<style>
:root { --bg:#0f1419; --panel:#182028; --line:#26303a; --fg:#e6e6e6; --muted:#8a96a3;
        --ok:#3fb950; --bad:#f85149; --warn:#d29922; --accent:#58a6ff; }
body { margin:0; font:14px/1.4 system-ui, sans-serif; background:var(--bg); color:var(--fg); }
header { display:flex; justify-content:space-between; align-items:baseline; padding:12px 20px;
         border-bottom:1px solid var(--line); }
h1 { font-size:18px; margin:0; }
h2 { font-size:12px; margin:0 0 8px; color:var(--muted); text-transform:uppercase; letter-spacing:.05em; }
main { display:grid; grid-template-columns:repeat(2, minmax(0, 1fr)); gap:16px; padding:16px 20px; }
section { background:var(--panel); border-radius:6px; padding:12px 14px; min-width:0; }
section.tbl { overflow-x:auto; }
section.wide { grid-column:1 / -1; }
table { width:100%; border-collapse:collapse; font-variant-numeric:tabular-nums; }
th, td { text-align:right; padding:4px 6px; border-bottom:1px solid var(--line); white-space:nowrap; }
th:first-child, td:first-child { text-align:left; }
th { color:var(--muted); font-weight:500; }
.ok { color:var(--ok); } .bad { color:var(--bad); } .muted { color:var(--muted); }
.cards { display:flex; gap:12px; flex-wrap:wrap; }
.card { flex:1 1 0; min-width:110px; } .card .v { font-size:24px; font-weight:600; }
.card .l { color:var(--muted); font-size:12px; }
.bar { position:relative; height:10px; width:140px; background:var(--line); border-radius:3px;
       overflow:hidden; display:inline-block; }
.bar > span { position:absolute; left:0; top:0; bottom:0; background:var(--accent); }
.dot { display:inline-block; width:9px; height:9px; border-radius:50%; margin-right:6px; }
.legend span { margin-right:14px; white-space:nowrap; color:var(--muted); }
.legend i { display:inline-block; width:10px; height:10px; margin-right:4px; vertical-align:-1px; }
#notes { color:var(--warn); margin:0; }
svg text { fill:var(--muted); font-size:11px; font-family:system-ui, sans-serif; }
</style></head>
<body>
<header><h1>ferry</h1>
  <div><span id="status" class="muted">loading</span> &middot; <span id="updated" class="muted"></span></div></header>
<main>
<section class="wide"><h2>Throughput <span id="tp-span"></span></h2><div class="cards">
  <div class="card"><div class="v" id="tp-rps">-</div><div class="l">requests/s</div></div>
  <div class="card"><div class="v" id="tp-tps">-</div><div class="l">output tokens/s</div></div>
  <div class="card"><div class="v" id="tp-completed">-</div><div class="l">completed in window</div></div>
  <div class="card"><div class="v" id="tp-tokens">-</div><div class="l">tokens in window</div></div>
  <div class="card"><div class="v" id="tp-refused">-</div><div class="l">refused since start</div></div>
  <div class="card"><svg id="spark" width="100%" height="40" viewBox="0 0 220 40"
  preserveAspectRatio="none"></svg><div class="l">tokens/s over recent polls</div></div>
</div></section>
<section class="wide tbl"><h2>Tenants: latency against SLO targets (over the window)</h2>
<table id="tenants"><thead><tr><th>tenant</th><th>completed</th><th>running</th><th>TTFT P50</th><th>TTFT P99</th>
<th>TTFT SLO</th><th>TPOT P50</th><th>TPOT P99</th><th>TPOT SLO</th><th>SLO met</th><th>KV blocks</th></tr></thead><tbody></tbody></table>
</section>
<section class="wide tbl"><h2>Workers</h2>
<table id="workers"><thead><tr><th>worker</th><th>kind</th><th>running</th><th>waiting</th><th>reserved</th>
<th>KV blocks used</th><th>KV use</th><th>KV by tenant</th><th>offloaded</th><th>last step</th><th>memory</th>
<th title="speculative decoding: the method, and accepted over proposed draft tokens since the worker started">draft acceptance</th>
</tr></thead><tbody></tbody></table></section>
<section class="wide tbl" id="experts-panel" hidden><h2>Experts: MoE routing load since the last poll</h2>
<table id="experts"><thead><tr><th>worker</th><th>table</th><th>tokens routed</th>
<th title="worst layer: max over mean tokens per expert (1.0 is even)">imbalance</th><th title="one group of bars per MoE layer, one bar per expert">share per expert, by layer</th>
<th>safe mode</th></tr></thead><tbody></tbody></table></section>
<section class="tbl"><h2>Prefix cache hit rate by tier</h2>
<table id="tiers"><thead><tr><th>tier</th><th>hits</th><th>lookups</th><th>hit rate</th><th></th></tr></thead>
<tbody></tbody></table></section>
<section class="tbl"><h2>Refusals by reason (since start)</h2><table id="refusals"><tbody></tbody></table></section>
<section class="wide"><h2>Recent requests: stages and token ticks (ms since arrival)</h2>
<div class="legend" id="legend"></div><svg id="timeline" width="100%" height="30"></svg></section>
<section class="wide" id="notes-panel" hidden><h2>Notes</h2><ul id="notes"></ul></section>
</main>
<script>
"use strict";
const STAGES = {queue: ["queue", "#8b949e"], prefix_lookup: ["prefix lookup", "#d29922"],
  prefill_compute: ["prefill compute", "#f0883e"], queue_prefill: ["queue + prefill", "#db6d28"],
  kv_transfer: ["KV transfer", "#a371f7"], decode: ["decode", "#2ea043"]};
const SVGNS = "http://www.w3.org/2000/svg";
const dataUrl = location.pathname.replace(/\/+$/, "") + "/data" + location.search;
const tpsHistory = [];

function fmtMs(v) { return v == null ? "-" : v.toFixed(1) + " ms"; }
function fmtPct(v) { return v == null ? "-" : (100 * v).toFixed(1) + "%"; }
function fmtRate(v) { return v.toFixed(2); }

function el(tag, attrs, text) {
  const e = tag.startsWith("svg:") ? document.createElementNS(SVGNS, tag.slice(4)) : document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
  if (text != null) e.textContent = text;
  return e;
}
function cell(row, field, text, cls) {
  const td = el("td", {"data-field": field}, text);
  if (cls) td.className = cls;
  row.appendChild(td);
  return td;
}
function versus(v, target) { return v == null || target == null ? "" : (v <= target ? "ok" : "bad"); }
function meter(fraction, color) {
  const bar = el("span", {"class": "bar"}), fill = el("span");
  fill.style.width = Math.max(0, Math.min(1, fraction || 0)) * 100 + "%";
  if (color) fill.style.background = color;
  bar.appendChild(fill);
  return bar;
}
function fillBody(id, rows) { const body = document.querySelector("#" + id + " tbody"); body.replaceChildren(...rows); }

function renderTenants(tenants) {
  fillBody("tenants", tenants.map(t => {
    const tr = el("tr", {"data-tenant": t.tenant});
    cell(tr, "tenant", t.tenant);
    cell(tr, "num_completed", String(t.num_completed));
    cell(tr, "num_running", String(t.num_running));
    const slo = t.slo;
    cell(tr, "ttft_p50_ms", fmtMs(t.ttft_p50_ms), versus(t.ttft_p50_ms, slo && slo.ttft_ms));
    cell(tr, "ttft_p99_ms", fmtMs(t.ttft_p99_ms), versus(t.ttft_p99_ms, slo && slo.ttft_ms));
    cell(tr, "ttft_slo_ms", slo ? fmtMs(slo.ttft_ms) : "no SLO", "muted");
    cell(tr, "tpot_p50_ms", fmtMs(t.tpot_p50_ms), versus(t.tpot_p50_ms, slo && slo.tpot_ms));
    cell(tr, "tpot_p99_ms", fmtMs(t.tpot_p99_ms), versus(t.tpot_p99_ms, slo && slo.tpot_ms));
    cell(tr, "tpot_slo_ms", slo ? fmtMs(slo.tpot_ms) : "no SLO", "muted");
    cell(tr, "slo_attainment", slo ? fmtPct(t.slo_attainment) : "no SLO", slo ? "" : "muted");
    cell(tr, "kv_blocks", String(t.kv_blocks || 0));
    return tr;
  }));
}

function renderWorkers(workers) {
  fillBody("workers", workers.map(w => {
    const tr = el("tr", {"data-worker": w.name});
    const name = cell(tr, "name", "");
    name.appendChild(el("span", {"class": "dot", "title": w.healthy ? "healthy" : "unhealthy"}));
    name.firstChild.style.background = w.healthy ? "var(--ok)" : "var(--bad)";
    name.appendChild(document.createTextNode(w.name));
    cell(tr, "kind", w.kind);
    cell(tr, "num_running", String(w.num_running));
    cell(tr, "num_waiting", String(w.num_waiting));
    cell(tr, "num_reserved", String(w.num_reserved));
    cell(tr, "kv_blocks", w.kv_blocks_used + " / " + w.kv_blocks_total);
    const use = w.kv_blocks_total ? w.kv_blocks_used / w.kv_blocks_total : 0;
    cell(tr, "kv_use", "").appendChild(meter(use, use > 0.9 ? "var(--bad)" : null));
    const byTenant = Object.entries(w.kv_blocks_by_tenant || {}).map(([t, n]) => (t || "-") + ": " + n).join(", ");
    cell(tr, "kv_by_tenant", byTenant || "-");
    cell(tr, "offloaded_mib", w.offloaded_mib ? w.offloaded_mib + " MiB" : "-");
    cell(tr, "last_step_ms", fmtMs(w.last_step_ms));
    cell(tr, "rss_mib", w.rss_mib == null ? "-" : w.rss_mib + " MiB");
    const decodes = w.kind !== "prefill" && w.spec_method && w.spec_method !== "off";
    cell(tr, "spec_acceptance", decodes ? w.spec_method + " " + fmtPct(w.spec_acceptance) : "-", decodes ? "" : "muted");
    return tr;
  }));
}

function shareBars(shares) {
  const svg = el("svg:svg", {width: 4 * shares.length + 2, height: 16, "class": "shares"});
  const top = Math.max(1e-9, ...shares);
  shares.forEach((v, e) => {
    const r = el("svg:rect", {x: 1 + 4 * e, y: 16 - 15 * v / top, width: 3, height: 15 * v / top, fill: "#58a6ff"});
    r.appendChild(el("svg:title", {}, "expert " + e + ": " + fmtPct(v)));
    svg.appendChild(r);
  });
  return svg;
}

function renderExperts(experts) {
  document.getElementById("experts-panel").hidden = !experts || experts.length === 0;
  fillBody("experts", (experts || []).map(x => {
    const tr = el("tr", {"data-worker": x.worker});
    cell(tr, "worker", x.worker);
    cell(tr, "table_version", "v" + x.table_version);
    cell(tr, "num_tokens", String(x.num_tokens));
    cell(tr, "imbalance", x.imbalance.toFixed(2), x.imbalance > 2 ? "bad" : "");
    const bars = cell(tr, "shares", "");
    x.shares.forEach(layer => bars.appendChild(shareBars(layer)));
    cell(tr, "safe_mode_layers", x.safe_mode_layers.length ? x.safe_mode_layers.join(", ") : "-",
         x.safe_mode_layers.length ? "bad" : "muted");
    return tr;
  }));
}

function renderTiers(tiers, refusals) {
  fillBody("tiers", tiers.map(t => {
    const tr = el("tr", {"data-tier": t.tier});
    cell(tr, "tier", t.tier);
    cell(tr, "hits", t.hits + " " + t.unit);
    cell(tr, "lookups", t.lookups + " " + t.unit);
    cell(tr, "hit_rate", fmtPct(t.hit_rate));
    cell(tr, "meter", "").appendChild(meter(t.hit_rate, "var(--ok)"));
    return tr;
  }));
  const reasons = Object.entries(refusals);
  fillBody("refusals", reasons.length ? reasons.map(([reason, n]) => {
    const tr = el("tr", {"data-reason": reason});
    cell(tr, "reason", reason); cell(tr, "count", String(n));
    return tr;
  }) : [el("tr", {}, "none")]);
}

function renderThroughput(tp, refusals) {
  document.getElementById("tp-span").textContent = "(last " + tp.span_s.toFixed(0) + " s)";
  document.getElementById("tp-rps").textContent = fmtRate(tp.requests_per_s);
  document.getElementById("tp-tps").textContent = fmtRate(tp.output_tokens_per_s);
  document.getElementById("tp-completed").textContent = String(tp.num_completed);
  document.getElementById("tp-tokens").textContent = String(tp.num_output_tokens);
  document.getElementById("tp-refused").textContent = String(Object.values(refusals).reduce((a, b) => a + b, 0));
  tpsHistory.push(tp.output_tokens_per_s);
  if (tpsHistory.length > 60) tpsHistory.shift();
  const svg = document.getElementById("spark"), top = Math.max(1e-9, ...tpsHistory);
  const step = 220 / Math.max(1, tpsHistory.length - 1);
  const pts = tpsHistory.map((v, i) => (i * step).toFixed(1) + "," + (38 - 36 * v / top).toFixed(1));
  svg.replaceChildren(el("svg:polyline", {points: pts.join(" "), fill: "none", stroke: "#58a6ff",
    "stroke-width": "1.5", "vector-effect": "non-scaling-stroke"}));
}

function renderTimeline(recent) {
  const svg = document.getElementById("timeline");
  const width = svg.clientWidth || 1200, label = 200, rowH = 18, top = 18;
  const ends = recent.map(r => Math.max(r.e2e_ms || 0, ...r.token_ms, ...r.stages.map(s => s.end_ms)));
  const span = Math.max(1, ...ends), x = ms => label + (width - label - 10) * ms / span;
  const kids = [];
  for (let i = 0; i <= 4; i++) {
    const ms = span * i / 4;
    kids.push(el("svg:line", {x1: x(ms), x2: x(ms), y1: top - 4, y2: top + rowH * recent.length, stroke: "#26303a"}));
    kids.push(el("svg:text", {x: x(ms), y: 11, "text-anchor": i ? "end" : "start"}, ms.toFixed(0) + " ms"));
  }
  recent.forEach((r, i) => {
    const y = top + i * rowH, g = el("svg:g", {"data-request": r.request_id, "data-status": r.status});
    g.appendChild(el("svg:text", {x: 0, y: y + 12}, r.tenant + "  " + r.request_id.slice(-8)));
    for (const s of r.stages) {
      const [name, color] = STAGES[s.stage] || [s.stage, "#58a6ff"];
      const rect = el("svg:rect", {x: x(s.start_ms), y: y + 3, height: rowH - 6, fill: color, "data-stage": s.stage,
        width: Math.max(1, x(s.end_ms) - x(s.start_ms))});
      rect.appendChild(el("svg:title", {}, name + ": " + fmtMs(s.end_ms - s.start_ms)));
      g.appendChild(rect);
    }
    for (const t of r.token_ms)
      g.appendChild(el("svg:line", {x1: x(t), x2: x(t), y1: y + 1, y2: y + rowH - 1, stroke: "#e6e6e6",
        "stroke-opacity": "0.8", "class": "tick"}));
    kids.push(g);
  });
  svg.setAttribute("height", top + rowH * recent.length + 4);
  svg.replaceChildren(...kids);
  document.getElementById("legend").replaceChildren(...Object.values(STAGES).map(([name, color]) => {
    const s = el("span", {}, name), swatch = el("i");
    swatch.style.background = color; s.prepend(swatch);
    return s;
  }), el("span", {}, "| token tick"));
}

function render(d) {
  renderThroughput(d.throughput, d.refusals);
  renderTenants(d.tenants);
  renderWorkers(d.workers);
  renderTiers(d.tiers, d.refusals);
  renderExperts(d.experts);
  renderTimeline(d.recent);
  document.getElementById("notes").replaceChildren(...d.notes.map(n => el("li", {}, n)));
  document.getElementById("notes-panel").hidden = d.notes.length === 0;
  const at = new Date(d.generated_at_unix_s * 1000);
  document.getElementById("updated").textContent = "updated " + at.toLocaleTimeString();
}

async function poll() {
  const status = document.getElementById("status");
  try {
    const resp = await fetch(dataUrl, {cache: "no-store"});
    if (!resp.ok) throw new Error("HTTP " + resp.status);
    render(await resp.json());
    status.textContent = "live"; status.className = "ok";
  } catch (e) {
    status.textContent = "cannot load data: " + e.message; status.className = "bad";
  } finally {
    setTimeout(poll, 2000);
  }
}
poll();
</script>
</body></html>
"""
