// Sluice dashboard: polls /dashboard/data, fills the tables (the figures) and draws SVG charts from them.
// No framework, no build step. Stale data (a failed refresh, or an answer older than STALE_S) is marked.
"use strict";
(function () {
  const REFRESH_MS = 2000;
  const STALE_S = 10;
  const SVG = "http://www.w3.org/2000/svg";
  const COLORS = ["#0b61c4", "#b35900", "#1a7f37", "#8250df", "#bf3989", "#57606a"];
  let last = null;          // the last good answer
  let lastOkAt = 0;         // Date.now() when it arrived
  let failures = 0;
  const history = [];       // [{t, byBackend: {backend: tokens/s}}] for the line chart

  const $ = (id) => document.getElementById(id);
  const fmt = {
    rate: (v) => (v === null || v === undefined ? "–" : v.toFixed(2)),
    count: (v) => String(Math.round(v)),
    ms: (v) => (v === null || v === undefined ? "–" : (v * 1000).toFixed(1)),
    money: (v) => (v === null || v === undefined ? "–" : v.toFixed(6)),
    pct: (v) => (v === null || v === undefined ? "n/a" : (v * 100).toFixed(1) + " %"),
    secs: (v) => (v === null || v === undefined ? "no capacity" : v.toFixed(3)),
    text: (v) => (v === null || v === undefined ? "–" : String(v)),
  };

  function cell(tr, value, kind, key) {
    const td = document.createElement("td");
    td.textContent = fmt[kind](value);
    if (kind !== "text") td.className = "num";
    if (key) td.dataset.key = key;
    if (typeof value === "number") td.dataset.value = String(value);
    tr.appendChild(td);
    return td;
  }

  function fill(tableId, rows, build) {
    const body = $(tableId).tBodies[0];
    body.replaceChildren();
    if (!rows.length) {
      const tr = body.insertRow();
      const td = tr.insertCell();
      td.colSpan = $(tableId).tHead.rows[0].cells.length;
      td.textContent = "None yet.";
      return;
    }
    for (const r of rows) {
      const tr = body.insertRow();
      build(tr, r);
    }
  }

  function el(name, attrs, text) {
    const e = document.createElementNS(SVG, name);
    for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, String(v));
    if (text !== undefined) e.textContent = text;
    return e;
  }

  function size(svg) {
    const box = svg.getBoundingClientRect();
    const w = Math.max(200, Math.round(box.width)), h = Math.max(60, Math.round(box.height));
    svg.setAttribute("viewBox", `0 0 ${w} ${h}`);
    svg.replaceChildren();
    return [w, h];
  }

  // Horizontal bars: items [{label, value, text, color}], scaled to max (or the given max).
  function bars(svg, items, max) {
    const [w, h] = size(svg);
    if (!items.length) { svg.appendChild(el("text", { x: 8, y: 20 }, "No data yet")); return; }
    const top = max || Math.max(...items.map((i) => i.value), 1e-12);
    const row = Math.min(26, (h - 8) / items.length), labelW = 200, valueW = 90;
    items.forEach((it, n) => {
      const y = 4 + n * row;
      svg.appendChild(el("text", { x: 6, y: y + row * 0.65 }, it.label));
      const bw = Math.max(1, ((w - labelW - valueW) * Math.min(it.value, top)) / top);
      svg.appendChild(el("rect", { x: labelW, y: y + 3, width: bw, height: row - 6, fill: it.color || COLORS[0] }));
      svg.appendChild(el("text", { x: labelW + bw + 6, y: y + row * 0.65 }, it.text));
    });
  }

  // Lines over time: series {name: [values]} aligned with `history`.
  function lines(svg, series, unit) {
    const [w, h] = size(svg);
    const names = Object.keys(series);
    const all = names.flatMap((n) => series[n]).filter((v) => v !== null);
    if (!all.length) { svg.appendChild(el("text", { x: 8, y: 20 }, "Collecting rates…")); return; }
    const max = Math.max(...all, 1e-9), left = 48, bottom = h - 16, n = history.length;
    svg.appendChild(el("line", { x1: left, y1: 6, x2: left, y2: bottom, stroke: "#8c959f" }));
    svg.appendChild(el("line", { x1: left, y1: bottom, x2: w - 4, y2: bottom, stroke: "#8c959f" }));
    svg.appendChild(el("text", { x: 2, y: 14 }, max.toFixed(1)));
    svg.appendChild(el("text", { x: 2, y: bottom }, "0"));
    svg.appendChild(el("text", { x: left + 4, y: h - 3 }, `${unit}, last ${n} refreshes`));
    names.forEach((name, i) => {
      const pts = series[name].map((v, k) => (v === null ? null :
        `${left + ((w - left - 8) * k) / Math.max(1, n - 1)},${bottom - ((bottom - 8) * v) / max}`)).filter(Boolean);
      const color = COLORS[i % COLORS.length];
      svg.appendChild(el("polyline", { points: pts.join(" "), fill: "none", stroke: color, "stroke-width": 2 }));
      svg.appendChild(el("text", { x: left + 190 + i * 170, y: h - 3, fill: color }, `■ ${name}: ${fmt.rate(series[name].at(-1))}`));
    });
  }

  function render(d) {
    $("model").textContent = d.model || "–";
    $("window").textContent = d.rate_window_s ? `${d.rate_window_s.toFixed(1)} s` : "– (collecting)";

    fill("t-requests", d.requests, (tr, r) => {
      cell(tr, r.tier, "text"); cell(tr, r.backend, "text");
      cell(tr, r.per_s, "rate", `requests/${r.tier}/${r.backend}/per_s`);
      cell(tr, r.total, "count", `requests/${r.tier}/${r.backend}/total`);
    });
    fill("t-tokens", d.tokens, (tr, r) => {
      cell(tr, r.tier, "text"); cell(tr, r.backend, "text"); cell(tr, r.kind, "text");
      cell(tr, r.per_s, "rate", `tokens/${r.tier}/${r.backend}/${r.kind}/per_s`);
      cell(tr, r.total, "count", `tokens/${r.tier}/${r.backend}/${r.kind}/total`);
    });
    const byBackend = {};
    for (const r of d.tokens) {
      if (r.per_s === null) continue;
      byBackend[r.backend] = (byBackend[r.backend] || 0) + r.per_s;
    }
    history.push({ byBackend: d.rate_window_s ? byBackend : {} });
    if (history.length > 60) history.shift();
    const backends = [...new Set(history.flatMap((p) => Object.keys(p.byBackend)))].sort();
    const series = {};
    for (const b of backends) series[b] = history.map((p) => (b in p.byBackend ? p.byBackend[b] : null));
    lines($("chart-traffic"), series, "tokens/s");

    fill("t-queue", d.queue, (tr, r) => {
      cell(tr, r.tier, "text");
      cell(tr, r.depth, "count", `queue/${r.tier}/depth`);
      cell(tr, r.wait_estimate_s, "secs", `queue/${r.tier}/wait`);
    });
    bars($("chart-queue"), d.queue.map((r, i) => ({ label: r.tier, value: r.depth,
      text: `${fmt.count(r.depth)} waiting, ~${fmt.secs(r.wait_estimate_s)} s`, color: COLORS[i] })));

    const lat = [...d.latency.ttft.map((r) => ({ ...r, m: "ttft" })),
      ...d.latency.inter_token.map((r) => ({ ...r, m: "inter_token" }))];
    fill("t-latency", lat, (tr, r) => {
      cell(tr, r.m === "ttft" ? "Time to first token" : "Inter-token", "text");
      cell(tr, r.tier, "text"); cell(tr, r.backend, "text");
      cell(tr, r.p50_s, "ms", `${r.m}/${r.tier}/${r.backend}/p50`);
      cell(tr, r.p99_s, "ms", `${r.m}/${r.tier}/${r.backend}/p99`);
      cell(tr, r.count, "count", `${r.m}/${r.tier}/${r.backend}/count`);
    });
    bars($("chart-latency"), d.latency.ttft.flatMap((r, i) => [
      { label: `${r.tier}/${r.backend} p50`, value: r.p50_s * 1000, text: `${fmt.ms(r.p50_s)} ms`, color: COLORS[i % 6] },
      { label: `${r.tier}/${r.backend} p99`, value: r.p99_s * 1000, text: `${fmt.ms(r.p99_s)} ms`, color: COLORS[i % 6] },
    ]));

    const e = d.engine;
    fill("t-engine", [["Busy ratio", e.busy_ratio, "pct", "engine/busy"], ["KV cache used", e.kv_usage, "pct", "engine/kv"],
      ["Requests in the engine", e.in_flight, "count", "engine/in_flight"]], (tr, r) => {
      cell(tr, r[0], "text"); cell(tr, r[1] === null ? null : r[1], r[1] === null ? "pct" : r[2], r[3]);
    });
    bars($("chart-engine"), [["busy", e.busy_ratio], ["KV used", e.kv_usage]].map(([l, v], i) =>
      ({ label: l, value: v || 0, text: fmt.pct(v), color: COLORS[i + 2] })), 1);

    fill("t-workers", d.workers, (tr, w) => {
      cell(tr, w.id, "text"); cell(tr, w.state, "text", `worker/${w.id}/state`);
      cell(tr, w.in_flight, "count"); cell(tr, w.capacity, "count"); cell(tr, w.running, "count");
      cell(tr, w.waiting, "count"); cell(tr, w.steps, "count"); cell(tr, w.step_errors, "count");
    });
    fill("t-models", d.models || [], (tr, m) => {
      cell(tr, m.id, "text"); cell(tr, m.kind, "text"); cell(tr, m.ready ? "yes" : "no", "text", `model/${m.id}/ready`);
      cell(tr, m.workers, "count"); cell(tr, m.in_flight, "count");
      cell(tr, m.requests, "count", `model/${m.id}/requests`); cell(tr, m.per_s, "rate", `model/${m.id}/per_s`);
      cell(tr, m.prompt_tokens, "count", `model/${m.id}/prompt`); cell(tr, m.completion_tokens, "count");
      cell(tr, m.inputs, m.inputs === null ? "text" : "count", `model/${m.id}/inputs`);
    });
    const bt = d.batches || { batches: [], lane: [], lines_taken_back: 0 };
    $("lane-summary").textContent = `${bt.batches.length} unfinished batch(es); ` +
      `${bt.lines_taken_back} line(s) taken back for interactive requests since start.`;
    fill("t-lane", bt.lane, (tr, l) => {
      cell(tr, l.model, "text"); cell(tr, l.batch_in_flight, "count", `lane/${l.model}/batch`);
      cell(tr, l.in_flight, "count"); cell(tr, l.capacity, "count");
      cell(tr, l.share, "pct", `lane/${l.model}/share`);
    });
    fill("t-batches", bt.batches, (tr, b) => {
      const k = `batch/${b.id}`;
      cell(tr, b.id, "text"); cell(tr, b.owner === null ? "(anonymous)" : b.owner, "text");
      cell(tr, b.endpoint, "text"); cell(tr, b.status, "text", `${k}/status`);
      cell(tr, `${b.completed + b.failed} / ${b.total}`, "text", `${k}/done`);
      cell(tr, b.failed, "count", `${k}/failed`);
      cell(tr, b.lines_per_s, "rate", `${k}/per_s`);
      cell(tr, b.eta_s === null ? null : b.eta_s, b.eta_s === null ? "text" : "rate", `${k}/eta`);
    });
    fill("t-providers", d.providers, (tr, p) => {
      cell(tr, p.name, "text");
      const c = cell(tr, p.circuit + (p.config_error ? ` (${p.config_error})` : ""), "text", `provider/${p.name}/circuit`);
      if (p.circuit !== "closed") c.className = "open";
      cell(tr, p.in_flight, "count");
      cell(tr, p.attempts.ok || 0, "count", `provider/${p.name}/ok`);
      const er = cell(tr, p.errors, "count", `provider/${p.name}/errors`);
      if (p.errors_per_s) er.className = "num bad";
      cell(tr, p.errors_per_s, "rate", `provider/${p.name}/errors_per_s`);
      cell(tr, Object.entries(p.attempts).filter(([o]) => o !== "ok").map(([o, n]) => `${o}: ${n}`).join(", ") || "none", "text");
    });

    const s = d.savings;
    $("savings-summary").textContent = `Cost ${fmt.money(s.cost)}; the same tokens at remote prices ` +
      `${fmt.money(s.remote_price_cost)}; saved ${fmt.money(s.saved)}.`;
    $("savings-summary").dataset.saved = String(s.saved);
    fill("t-savings", s.rows, (tr, r) => {
      const k = `savings/${r.model}/${r.backend}`;
      cell(tr, r.model, "text"); cell(tr, r.backend, "text");
      cell(tr, r.prompt_tokens, "count", `${k}/prompt`); cell(tr, r.completion_tokens, "count", `${k}/completion`);
      cell(tr, r.cost, "money", `${k}/cost`); cell(tr, r.remote_price_cost, "money", `${k}/remote`);
      cell(tr, r.saved, "money", `${k}/saved`);
    });
    bars($("chart-spend"), s.rows.flatMap((r) => [
      { label: `${r.model} (${r.backend})`, value: r.cost, text: fmt.money(r.cost), color: COLORS[0] },
      { label: "  at remote prices", value: r.remote_price_cost || 0, text: fmt.money(r.remote_price_cost), color: COLORS[1] },
    ]));
    fill("t-spend", d.spend, (tr, r) => {
      cell(tr, r.key, "text"); cell(tr, r.model, "text"); cell(tr, r.cost, "money", `spend/${r.key}/${r.model}`);
    });
  }

  function showStatus() {
    const st = $("status");
    if (!last) {
      st.dataset.state = failures ? "error" : "loading";
      st.textContent = failures ? `No data: ${failures} refreshes failed.` : "Loading…";
      return;
    }
    const age = Date.now() / 1000 - last.generated_at;
    const stale = failures > 0 || age > STALE_S;
    st.dataset.state = stale ? "stale" : "live";
    st.dataset.generatedAt = String(last.generated_at);
    const when = new Date(last.generated_at * 1000).toLocaleTimeString();
    st.textContent = (stale ? `STALE: figures from ${when} (${age.toFixed(0)} s old)` +
      (failures ? `; ${failures} refreshes failed` : "") : `Live: figures from ${when} (${age.toFixed(0)} s old)`);
  }

  async function refresh() {
    try {
      const r = await fetch("/dashboard/data", { cache: "no-store", credentials: "same-origin" });
      if (!r.ok) throw new Error(`HTTP ${r.status}`);
      const d = await r.json();
      last = d; lastOkAt = Date.now(); failures = 0;
      render(d);
    } catch (err) {
      failures += 1;
    }
    showStatus();
  }

  refresh();
  setInterval(refresh, REFRESH_MS);
  setInterval(showStatus, 1000);
  window.sluiceDashboard = { refresh, get last() { return last; }, get lastOkAt() { return lastOkAt; } };
})();
