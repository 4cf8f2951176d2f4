// The millwheel console: reads the Tracker API (docs/ui.md) every REFRESH_MS and
// draws it. Text from the service is only ever set as textContent (never as HTML).
"use strict";
(function () {
  const REFRESH_MS = 1000;
  const SVG = "http://www.w3.org/2000/svg";
  const $ = (id) => document.getElementById(id);
  let selected = null;       // the computation shown in the panel
  let stream = null;         // the logged stream shown
  let keysAfter = [""];      // paging: the "after" of each page seen
  let timer = null;
  let actions = [];          // the console actions this session's role may take (/api/v1/session)

  async function api(path, params) {
    const q = new URLSearchParams(params || {}).toString();
    const resp = await fetch(path + (q ? "?" + q : ""), { credentials: "same-origin", headers: { Accept: "application/json" } });
    if (resp.status === 401) { showLogin(); throw new Error("unauthorized"); }
    const body = await resp.json();
    if (!resp.ok) { const e = new Error(body.error || resp.statusText); e.status = resp.status; throw e; }
    return body;
  }

  function el(tag, attrs, text) {
    const e = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
    if (text !== undefined && text !== null) e.textContent = String(text);
    return e;
  }
  function svg(tag, attrs, text) {
    const e = document.createElementNS(SVG, tag);
    for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, String(v));
    if (text !== undefined) e.textContent = String(text);
    return e;
  }
  function fillRows(table, rows) {
    const body = table.tBodies[0];
    body.replaceChildren(...rows.map((cells) => {
      const tr = el("tr");
      for (const c of cells) tr.appendChild(el("td", {}, c));
      return tr;
    }));
  }
  function fmtWm(wm) {
    if (wm === "-inf") return "−∞ (nothing yet)";
    if (wm === "+inf") return "+∞ (done)";
    // past year 9900: near the ±2^62 µs sentinels (a timer "at the end of time"), not a date
    if (wm >= 2.5e17) return "+∞ (end of input)";
    if (wm <= -2.5e17) return "−∞ (before any record)";
    return new Date(wm / 1000).toISOString().replace("T", " ").replace("Z", "");
  }
  function fmtLag(s) { return s === null || s === undefined ? "" : "lag " + fmtSecs(s); }
  function fmtSecs(s) {
    if (s < 120) return s.toFixed(1) + " s";
    if (s < 7200) return (s / 60).toFixed(1) + " min";
    if (s < 172800) return (s / 3600).toFixed(1) + " h";
    return (s / 86400).toFixed(1) + " d";
  }
  // A labelled state field: a list of {time, value} one per line, other values as JSON.
  function fmtField(v) {
    if (typeof v === "boolean") return v ? "yes" : "no";
    if (Array.isArray(v)) {
      if (!v.length) return "(none)";
      const text = (x) => (typeof x === "string" ? x : JSON.stringify(x));
      return v.map((x) => "\n      " + (x && typeof x === "object" && "time" in x ? `${x.time}: ${text(x.value)}` : text(x))).join("");
    }
    return typeof v === "string" ? v : JSON.stringify(v);
  }
  function fmtRate(r) { return r === null || r === undefined ? "–" : (r >= 100 ? r.toFixed(0) : r.toFixed(1)); }

  // An action (role operator; the server checks it again): POST JSON, show the answer.
  async function act(name, body) {
    const resp = await fetch("/api/v1/actions/" + name, { method: "POST", credentials: "same-origin",
      headers: { Accept: "application/json", "Content-Type": "application/json" }, body: JSON.stringify(body) });
    const answer = await resp.json();
    if (!resp.ok) throw new Error(answer.error || resp.statusText);
    return answer;
  }
  async function replayDeadLetters() {
    if (!selected) return;
    $("action-result").textContent = "replaying…";
    try {
      const r = await act("replay-dead-letters", { computation: selected });
      $("action-result").textContent = `${r.replayed} replayed, ${r.skipped} skipped, ${r.remaining} remaining`;
    } catch (e) { $("action-result").textContent = "refused: " + e.message; }
  }

  function showLogin() {
    $("console").hidden = true;
    $("login").hidden = false;
    $("summary").textContent = "not logged in";
    const why = new URLSearchParams(location.search).get("login");
    if (why === "failed") $("login-error").hidden = false;
    if (why === "link-spent") $("login-link-spent").hidden = false;
    if (timer) { clearInterval(timer); timer = null; }
  }

  // -- topology graph ---------------------------------------------------------------
  // Node width: the longest name whole (about 7 px a character at the graph's font size),
  // at least 120 px; a name over LABEL_MAX characters is cut (its tooltip has it whole).
  const LABEL_MAX = 40;
  const QUEUED_WARN = 1000;  // records a producer holds unacknowledged before its edge shows backpressure
  function drawGraph(graph) {
    const longest = Math.min(LABEL_MAX, Math.max(0, ...graph.nodes.map((n) => n.name.length)));
    const W = Math.max(120, Math.ceil(longest * 7.2) + 20), H = 30, GX = 34, GY = 14;
    const layers = {};
    for (const n of graph.nodes) (layers[n.layer] = layers[n.layer] || []).push(n);
    const keys = Object.keys(layers).map(Number).sort((a, b) => a - b);
    const pos = {};
    let maxRows = 1;
    keys.forEach((layer, col) => {
      layers[layer].sort((a, b) => a.name.localeCompare(b.name));
      layers[layer].forEach((n, row) => { pos[n.id] = { x: 10 + col * (W + GX), y: 10 + row * (H + GY) }; });
      maxRows = Math.max(maxRows, layers[layer].length);
    });
    const width = 20 + keys.length * (W + GX) - GX, height = 20 + maxRows * (H + GY) - GY;
    const root = svg("svg", { viewBox: `0 0 ${Math.max(width, 200)} ${height}`, width: Math.max(width, 200), height: height, "aria-label": "topology graph" });
    const defs = svg("defs");
    const marker = svg("marker", { id: "arrow", viewBox: "0 0 10 10", refX: 10, refY: 5, markerWidth: 6, markerHeight: 6, orient: "auto-start-reverse" });
    marker.appendChild(svg("path", { d: "M 0 0 L 10 5 L 0 10 z", fill: "#6b7785" }));
    defs.appendChild(marker); root.appendChild(defs);
    // Edge labels: records/s, and what the producer holds unacknowledged ("queued"):
    // an edge whose producer holds QUEUED_WARN or more is drawn as backpressured. A
    // label that would overlap one already placed moves down until it does not.
    const placed = [];
    const place = (x, y, w) => {
      for (let tries = 0; tries < 20 && placed.some((p) => Math.abs(p.x - x) < (p.w + w) / 2 + 2 && Math.abs(p.y - y) < 12); tries++) y += 12;
      placed.push({ x, y, w });
      return y;
    };
    for (const e of graph.edges) {
      const a = pos[e.from], b = pos[e.to];
      if (!a || !b) continue;
      const x1 = a.x + W, y1 = a.y + H / 2, x2 = b.x, y2 = b.y + H / 2, mx = (x1 + x2) / 2;
      const blocked = (e.queued || 0) >= QUEUED_WARN;
      root.appendChild(svg("path", { class: "edge" + (blocked ? " backpressure" : ""), d: `M ${x1} ${y1} C ${mx} ${y1}, ${mx} ${y2}, ${x2} ${y2}`, "marker-end": "url(#arrow)" }));
      const parts = [];
      if (e.per_s !== null && e.per_s !== undefined) parts.push(fmtRate(e.per_s) + "/s");
      if (e.queued) parts.push(`${e.queued} queued`);
      if (parts.length) {
        const text = parts.join(" · ");
        // At the target's row (an edge's midpoint between rows sat beside other edges'
        // labels: whose rate was it?), in the gap before the target.
        const y = place(mx, y2 - 4, text.length * 6.2);
        const label = svg("text", { class: "rate" + (blocked ? " backpressure" : ""), x: mx, y: y, "text-anchor": "middle",
          "data-from": e.from, "data-to": e.to }, text);
        const group = svg("g", { class: "edge-label" });  // its title says which edge, on hover
        // Into a connector sink ("k:"): what the sink wrote out to its system.
        const what = e.to.startsWith("k:") ? " written" : "";
        group.appendChild(svg("title", {}, `${e.from.slice(2)} → ${e.to.slice(2)}: ${text}${what}`));
        group.appendChild(label);
        root.appendChild(group);
      }
    }
    for (const n of graph.nodes) {
      const p = pos[n.id];
      const g = svg("g", { class: `node ${n.kind} ${n.health}`, transform: `translate(${p.x},${p.y})`, "data-name": n.name, "data-kind": n.kind });
      g.appendChild(svg("rect", { width: W, height: H, rx: n.kind === "computation" ? 6 : 16 }));
      const label = n.name.length > LABEL_MAX ? n.name.slice(0, LABEL_MAX - 1) + "…" : n.name;
      g.appendChild(svg("text", { x: W / 2, y: H / 2 + 4, "text-anchor": "middle" }, label));
      g.appendChild(svg("title", {}, `${n.kind} ${n.name}: ${n.health}`));
      if (n.kind === "computation") g.addEventListener("click", () => select(n.name));
      root.appendChild(g);
    }
    $("graph").replaceChildren(root);
    graphFit();
  }

  // A graph larger than its panel scrolls inside it (both ways), with a scrollbar that
  // shows and a line saying so; "Fit to panel" scales it whole into the panel instead.
  function graphFit() {
    const g = $("graph"), fitted = g.classList.contains("fit");
    const over = g.scrollWidth > g.clientWidth + 1 || g.scrollHeight > g.clientHeight + 1;
    $("graph-hint").hidden = fitted || !over;
    $("graph-fit").hidden = !fitted && !over;
    $("graph-fit").textContent = fitted ? "Actual size" : "Fit to panel";
    $("graph-fit").setAttribute("aria-pressed", String(fitted));
  }

  // -- sparklines -------------------------------------------------------------------
  // The line, and under it its values in words: now, lowest, highest, and over how long.
  function sparkline(target, points, fmt) {
    const W = 300, H = 60;
    const root = svg("svg", { viewBox: `0 0 ${W} ${H}`, preserveAspectRatio: "none" });
    let values = "no data yet";
    if (points.length >= 1) {
      const vs = points.map((p) => p[1]);
      const span = points[points.length - 1][0] - points[0][0];
      values = `now ${fmt(vs[vs.length - 1])} · min ${fmt(Math.min(...vs))} · max ${fmt(Math.max(...vs))}` +
        (span > 0 ? ` · last ${fmtSecs(span)}` : "");
    }
    if (points.length >= 2) {
      const t0 = points[0][0], t1 = points[points.length - 1][0];
      const vs = points.map((p) => p[1]);
      // From 0 (both series are never negative): a flat lag must look flat, not be
      // stretched to the full height by a difference of milliseconds.
      const lo = Math.min(0, ...vs), hi = Math.max(...vs);
      const xs = (t) => (t1 === t0 ? 0 : ((t - t0) / (t1 - t0)) * (W - 4) + 2);
      const ys = (v) => (hi === lo ? H / 2 : H - 4 - ((v - lo) / (hi - lo)) * (H - 8));
      root.appendChild(svg("polyline", { points: points.map((p) => `${xs(p[0]).toFixed(1)},${ys(p[1]).toFixed(1)}`).join(" ") }));
      root.appendChild(svg("title", {}, `min ${lo.toFixed(2)}, max ${hi.toFixed(2)}, now ${vs[vs.length - 1].toFixed(2)}`));
    }
    target.replaceChildren(root, el("div", { class: "spark-values" }, values));
  }

  // -- panels ------------------------------------------------------------------------
  function fillSelect(select, names, current) {
    const have = Array.from(select.options).map((o) => o.value).join("\u001f");
    if (have !== names.join("\u001f")) select.replaceChildren(...names.map((n) => el("option", { value: n }, n)));
    if (current !== null) select.value = current;
  }

  async function select(name) {
    if (name !== selected) {
      selected = name;
      keysAfter = [""];
      $("state-result").textContent = "";
      $("comp-select").value = name;
      loadSpec();
      loadKeys();
    }
    await refreshComputation();
  }

  async function refreshComputation() {
    if (!selected) return;
    const c = await api("/api/v1/computation", { computation: selected });
    const h = $("comp-health");
    h.className = "health " + c.health;
    h.textContent = c.health + (c.health_reason ? ": " + c.health_reason : "") + (c.version ? ` · version ${c.version}` : "") +
      (c.rescaling_to ? ` · rescaling to ${c.rescaling_to} key ranges` : "");
    $("held-by").textContent = c.held_by ? "watermark held by: " + c.held_by : "";
    $("in-wm").textContent = fmtWm(c.input_low_watermark);
    $("in-lag").textContent = fmtLag(c.input_lag_s);
    $("out-wm").textContent = fmtWm(c.low_watermark);
    $("out-lag").textContent = fmtLag(c.lag_s);
    $("rates").textContent = `${fmtRate(c.in_per_s)} · ${fmtRate(c.out_per_s)}`;
    $("totals").textContent = c.records_in_total === null ? "" : `${c.records_in_total} in, ${c.records_out_total} out in all`;
    $("checkpoints").textContent = c.checkpoints_per_s === null ? "" : `${fmtRate(c.checkpoints_per_s)} checkpoints/s` + (c.checkpoint_ms === null ? "" : `, ${c.checkpoint_ms.toFixed(1)} ms each`) +
      (c.checkpoint_p50_ms === null ? "" : ` (p50 ≤ ${c.checkpoint_p50_ms} ms, p95 ≤ ${c.checkpoint_p95_ms} ms)`);
    $("err-counts").textContent = `${c.dead_lettered} · ${c.skipped} · ${c.late_dropped}`;
    // late records per input stream: what became of them (docs/ui.md)
    $("late-inputs").textContent = (c.late || []).map((l) => {
      const parts = ["dropped", "routed", "processed"].filter((a) => l[a]).map((a) => `${l[a]} ${a}`);
      return `${l.label}: ${parts.length ? parts.join(", ") : "0 late"}`;
    }).join(" · ");
    $("backpressure").textContent = c.backpressure.map((b) => `injector ${b.injector}: outbox ${b.outbox}, waited ${b.backpressure_s_total.toFixed(1)} s`).join("; ");
    sparkline($("lag-spark"), c.history.lag, (v) => fmtSecs(v));
    sparkline($("rate-spark"), c.history.in, (v) => fmtRate(v) + "/s");
    sparkline($("checkpoint-spark"), c.history.checkpoint_ms, (v) => v.toFixed(1) + " ms");
    sparkline($("checkpoint-p95-spark"), c.history.checkpoint_p95_ms, (v) => "≤ " + v.toFixed(1) + " ms");
    sparkline($("checkpoint-rate-spark"), c.history.checkpoints, (v) => fmtRate(v) + "/s");
    const ranges = (c.failing_ranges || []).map((f) => ({ time: f.last, key: `key range ${f.range}`, type: f.type, message: f.message, outcome: `range failing (${f.stage})`, attempts: f.attempts }));
    const errs = [...ranges, ...c.retrying, ...c.recent_errors];
    fillRows($("errors"), errs.map((e) => [e.time ? new Date(e.time / 1000).toISOString().slice(11, 23) : "", e.record_id ? `${e.key} (record ${e.record_id})` : e.key, `${e.type}: ${e.message}`, `${e.outcome}${e.attempts ? " after " + e.attempts + " attempt(s)" : ""}`]));
    $("errors-none").hidden = errs.length > 0;
    fillRows($("ranges"), c.ranges.map((r) => [r.range, r.worker ? `${r.worker} (${r.address})` : "(unassigned)", r.token, fmtWm(r.watermark), r.failing ? `${r.pending} (failing: ${r.failing})` : r.pending]));
  }

  async function loadSpec() {
    const s = await api("/api/v1/spec", { computation: selected });
    $("spec").textContent = s.yaml;
  }

  async function loadKeys() {
    const after = keysAfter[keysAfter.length - 1];
    const k = await api("/api/v1/keys", { computation: selected, after: after, limit: 30 });
    $("keys").replaceChildren(...k.keys.map((key) => {
      const li = el("li");
      const a = el("a", { tabindex: "0", role: "button" }, key);
      a.addEventListener("click", () => { $("state-key").value = key; lookup(); });
      li.appendChild(a);
      return li;
    }));
    if (!k.keys.length) $("keys").appendChild(el("li", {}, "(no keys with state)"));
    $("keys-next").disabled = !k.next_after;
    $("keys-next").dataset.next = k.next_after || "";
  }

  async function lookup() {
    const key = $("state-key").value;
    if (!selected || !key) return;
    try {
      const s = await api("/api/v1/state", { computation: selected, key: key });
      const lines = [`${s.computation} key ${JSON.stringify(s.key)} (range ${s.range})`];
      if (!s.exists) lines.push("no state and no pending timers");
      else {
        if (s.state_labelled) {  // a built-in operator's state, its fields named (docs/ui.md)
          const l = s.state_labelled;
          lines.push(`state (${l.operator}):` + (l.entries.length ? "" : " (empty)"));
          for (const e of l.entries) {
            lines.push("  " + e.label);
            for (const [k, v] of Object.entries(e.fields)) lines.push(`    ${k}: ${fmtField(v)}`);
          }
        } else {
          lines.push("state: " + (s.state_json !== null ? JSON.stringify(s.state_json, null, 2) : (s.state_text === null ? "(none)" : s.state_text)));
        }
        if (s.truncated) lines.push(`(first bytes of ${s.state_bytes})`);
        lines.push(s.timers.length ? "timers:" : "timers: (none)");
        for (const t of s.timers) lines.push(`  ${t.tag_text || t.tag} at ${t.time_text || fmtWm(t.time)} UTC (${t.domain}${t.hold ? ", holds the watermark" : ""})`);
      }
      $("state-result").textContent = lines.join("\n");
    } catch (e) {
      $("state-result").textContent = "error: " + e.message;
    }
  }

  async function refreshRecords(logged) {
    if (!logged.length) { $("records").tBodies[0].replaceChildren(); return; }
    if (stream === null || !logged.includes(stream)) stream = logged[0];
    fillSelect($("stream-select"), logged, stream);
    const r = await api("/api/v1/records", { stream: stream, n: 20 });
    fillRows($("records"), r.records.slice().reverse().map((x) => [x.seq, fmtWm(x.timestamp), x.key, x.value]));
  }

  // Connector sinks failing to write (their streams wait in the log): named in the summary.
  function sinksDown(sinks) {
    const down = Object.values(sinks).filter((k) => k.down_s !== null);
    return down.length ? `, sink down: ${down.map((k) => `${k.name} (${Math.round(k.down_s)} s)`).join(", ")}` : "";
  }

  // The computation the console opens on: the one in the worst health (failing first),
  // else the one whose producers hold the most records for it (QUEUED_WARN or more),
  // else the first by name. A user opening the console looks for what is wrong.
  const HEALTH_RANK = { failing: 0, "dead-lettering": 1, retrying: 2, lagging: 3 };
  function worst(comps) {
    const rank = (c) => (c.health in HEALTH_RANK ? HEALTH_RANK[c.health] : 9);
    const sorted = comps.slice().sort((a, b) => rank(a) - rank(b) || (b.backlog || 0) - (a.backlog || 0) || a.name.localeCompare(b.name));
    if (!sorted.length) return null;
    const top = sorted[0];
    if (rank(top) < 9 || (top.backlog || 0) >= QUEUED_WARN) return top.name;
    return comps.map((c) => c.name).sort()[0];
  }

  async function refresh() {
    try {
      const o = await api("/api/v1/overview");
      $("login").hidden = true;
      $("console").hidden = false;
      $("fatal").hidden = true;
      const bad = o.computations.filter((c) => c.health !== "ok").length;
      const rescaling = o.computations.filter((c) => c.rescaling_to).map((c) => `${c.name} rescaling to ${c.rescaling_to}`);
      $("summary").textContent = `${o.computations.length} computations, ${o.injectors.length} injectors, ` +
        (o.leading ? `${o.workers.alive}/${o.workers.total} workers alive`
          : `${o.workers.total} workers (liveness known to the leader ${o.leader || "(none elected)"}; this controller stands by)`) +
        (bad ? `, ${bad} not ok` : "") + (rescaling.length ? `, ${rescaling.join(", ")}` : "") +
        (o.last_savepoint ? `; last savepoint ${new Date(o.last_savepoint.created_us / 1000).toISOString().slice(0, 19).replace("T", " ")} UTC` +
          ` (${(o.last_savepoint.bytes / 1048576).toFixed(1)} MB${o.last_savepoint.stopped ? ", service stopped" : ""})` : "") +
        sinksDown(o.sinks || {});
      $("updated").textContent = "updated " + new Date().toISOString().slice(11, 19) + " UTC";  // as every time here
      drawGraph(o.graph);
      const names = o.computations.map((c) => c.name).sort();
      if (selected === null || !names.includes(selected)) {
        selected = null;
        fillSelect($("comp-select"), names, null);
        const first = worst(o.computations);
        if (first) await select(first);
      } else {
        fillSelect($("comp-select"), names, selected);
        await refreshComputation();
      }
      const w = await api("/api/v1/workers");
      fillRows($("workers"), w.workers.map((x) => [x.id, x.address, x.state, Math.max(0, x.last_heartbeat_s).toFixed(1) + " s ago",
        x.cpu_pct == null ? "-" : `${x.cpu_pct.toFixed(0)}%`, x.rss_mb == null ? "-" : `${x.rss_mb.toFixed(0)} MB`,
        x.ranges.join(" ")]));
      await refreshRecords(o.logged_streams);
    } catch (e) {
      if (e.message !== "unauthorized") { $("fatal").hidden = false; $("fatal").textContent = "cannot reach the console API: " + e.message; }
    }
  }

  document.addEventListener("DOMContentLoaded", () => {
    $("comp-select").addEventListener("change", (ev) => select(ev.target.value));
    $("stream-select").addEventListener("change", (ev) => { stream = ev.target.value; refresh(); });
    $("state-form").addEventListener("submit", (ev) => { ev.preventDefault(); lookup(); });
    $("keys-next").addEventListener("click", () => { const n = $("keys-next").dataset.next; if (n) { keysAfter.push(n); loadKeys(); } });
    $("keys-first").addEventListener("click", () => { keysAfter = [""]; loadKeys(); });
    $("replay-dead-letters").addEventListener("click", replayDeadLetters);
    $("graph-fit").addEventListener("click", () => { $("graph").classList.toggle("fit"); graphFit(); });
    api("/api/v1/session").then((s) => {
      if (!s.authorized) { showLogin(); return; }
      $("logout").hidden = !s.auth_required;
      actions = s.actions || [];
      $("actions").hidden = !actions.includes("replay-dead-letters");  // only what the role may do
      refresh();
      timer = setInterval(refresh, REFRESH_MS);
    }).catch((e) => { $("fatal").hidden = false; $("fatal").textContent = "cannot reach the console API: " + e.message; });
  });
})();
