// The qos-serve console: reads the router's snapshot stream (GET /console/events, one JSON
// snapshot a second as server-sent events) and draws it. fetch() rather than EventSource, so the
// API key can travel in the authorization header (kept in this browser tab's sessionStorage).
"use strict";

const CLASSES = ["high", "medium", "low"];
const KEY = "qos-console-key";
const $ = (id) => document.getElementById(id);

function text(value) {
  return document.createTextNode(value === undefined || value === null ? "" : String(value));
}

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs || {})) {
    if (name === "class") node.className = value;
    else if (name.startsWith("data-")) node.setAttribute(name, value);
    else node[name] = value;
  }
  for (const child of children) node.append(child instanceof Node ? child : text(child));
  return node;
}

function ms(value) {
  return value ? `${Math.round(value).toLocaleString()} ms` : "–";
}

function className(priority) {
  return el("span", {class: `cls ${priority}`}, priority[0].toUpperCase() + priority.slice(1));
}

function kvBar(priority, held, total, cap) {
  // The bar is the share of the KV blocks the class holds; the black line is its cap.
  const share = total ? held / total : 0;
  const bar = el("span", {class: "kvbar", "data-kv-share": share.toFixed(4), "data-kv-cap": cap,
                          title: `${held} of ${total} blocks; cap ${Math.round(cap * 100)}%`});
  const fill = el("span", {class: `fill ${priority}`});
  fill.style.width = `${Math.min(100, share * 100)}%`;
  const line = el("span", {class: "cap"});
  line.style.left = `calc(${cap * 100}% - 1px)`;
  bar.append(fill, line);
  return el("span", {}, bar, el("span", {class: "kvtext"},
    `${(share * 100).toFixed(1)}% (cap ${Math.round(cap * 100)}%)`));
}

function percent(share) {
  // a share in [0, 1], or null when there is nothing to divide (prefix caching off, no request yet)
  return share === null || share === undefined ? "–" : `${Math.round(share * 100)}%`;
}

function fillRows(tbody, rows) {
  tbody.replaceChildren(...rows.map((cells) => el("tr", {}, ...cells.map((c) => el("td", {}, c)))));
}

function drawClasses(snapshot) {
  const rows = snapshot.classes.map((c) => {
    const row = el("tr", {id: `class-${c.priority}`});
    const cells = [
      className(c.priority),
      el("span", {id: `queue-${c.priority}`}, c.waiting),
      el("span", {id: `running-${c.priority}`}, c.running),
      kvBar(c.priority, c.kv_blocks, c.kv_total, c.kv_cap),
      c.weight,
      c.tok_s.toFixed(1),
      `${ms(c.ttft_p50)} / ${ms(c.ttft_p99)}`,
      `${ms(c.e2e_p50)} / ${ms(c.e2e_p99)}`,
      `${c.completed} / ${c.failed}`,
      c.preempted,
      percent(c.cache_hit_rate),
    ];
    const optional = new Set([4, 5, 6, 7, 8, 9, 10]);   // hidden at phone width (the charts have them)
    row.append(...cells.map((c, i) => el("td", optional.has(i) ? {class: "opt"} : {}, c)));
    return row;
  });
  $("classes").tBodies[0].replaceChildren(...rows);
}

function sparkline(points, series, height) {
  // points: [{t, value per series name}]; a small SVG with one polyline per series.
  const width = 300;
  const ns = "http://www.w3.org/2000/svg";
  const svg = document.createElementNS(ns, "svg");
  svg.setAttribute("viewBox", `0 0 ${width} ${height}`);
  svg.setAttribute("preserveAspectRatio", "none");
  svg.setAttribute("height", String(height));
  const values = points.flatMap((p) => series.map((s) => p[s.key] || 0));
  const top = Math.max(1, ...values);
  const t0 = points.length ? points[0].t : 0;
  const span = Math.max(1, points.length ? points[points.length - 1].t - t0 : 1);
  for (const s of series) {
    const line = document.createElementNS(ns, "polyline");
    line.setAttribute("points", points.map((p) =>
      `${((p.t - t0) / span * width).toFixed(1)},${(height - 2 - (p[s.key] || 0) / top * (height - 4)).toFixed(1)}`).join(" "));
    line.setAttribute("fill", "none");
    line.setAttribute("stroke", s.color);
    line.setAttribute("stroke-width", "1.5");
    if (s.dash) line.setAttribute("stroke-dasharray", "4 3");
    svg.append(line);
  }
  const box = el("div", {class: "spark"}, el("span", {class: "top"}, Math.round(top).toLocaleString()));
  box.append(svg);
  return box;
}

function drawCharts(snapshot) {
  const colors = {high: "#c0392b", medium: "#b9770e", low: "#1f618d"};
  const charts = CLASSES.map((priority) => {
    const points = snapshot.history.map((h) => ({t: h.t, ...h[priority]}));
    const latest = points.length ? points[points.length - 1] : {};
    const lines = (name) => [{key: `${name}_p99`, color: colors[priority]}, {key: `${name}_p50`, color: "#888", dash: true}];
    return el("div", {class: "chart", id: `chart-${priority}`},
      el("div", {class: "title"}, className(priority), ` TTFT p50 ${ms(latest.ttft_p50)}, p99 ${ms(latest.ttft_p99)}`),
      sparkline(points, lines("ttft"), 70),
      el("div", {class: "legend"}, `end to end p50 ${ms(latest.e2e_p50)}, p99 ${ms(latest.e2e_p99)}`),
      sparkline(points, lines("e2e"), 70),
      el("div", {class: "legend"}, `${(latest.tok_s || 0).toFixed(0)} tokens/s`),
      sparkline(points, [{key: "tok_s", color: colors[priority]}], 40));
  });
  const key = el("div", {class: "legend"}, "Last 60 s, one point a second over the requests completed in the " +
    "minute before it: solid = p99, dashed = p50 (ms); the number in each chart's corner is its top.");
  $("charts").replaceChildren(...charts, key);
}

function drawPools(snapshot) {
  $("routing").textContent = snapshot.routing
    ? `routing: ${snapshot.routing}; overflow threshold ${snapshot.threshold} queued` : "";
  $("pools").replaceChildren(...snapshot.pools.map((p) => {
    const scaling = p.max_workers > p.min_workers
      ? `; wants ${p.desired_workers} (${p.min_workers}..${p.max_workers}): ${p.scale_reason}` : "";
    const state = p.draining ? " — DRAINING" : (p.workers === 0 ? " — NO WORKER" : "");
    const classes = p.classes.map((c) => el("div", {class: "facts"}, className(c.priority),
      ` queue ${c.waiting}, running ${c.running}, weight ${c.weight}, cache hits ${percent(c.cache_hit_rate)} `,
      kvBar(c.priority, c.kv_blocks, p.kv_total, c.kv_cap)));
    return el("div", {class: "pool", id: `pool-${p.name}`},
      el("div", {class: "head"}, `${p.name} (${p.device || "?"})${state}`),
      el("div", {class: "facts"}, `workers ${p.workers}${scaling}`),
      el("div", {class: "facts"}, `KV ${p.kv_used} / ${p.kv_total} blocks; utilization ${Math.round(p.utilization * 100)}%; ` +
        `preemptions ${p.preemptions}; failovers ${p.failovers}`),
      el("div", {class: "facts"}, `cost ${p.cost_per_token} per token; spent ${p.cost_units.toFixed(1)} units on ${p.requests} requests`),
      ...classes);
  }));
}

function drawProcesses(snapshot) {
  // Only a supervised local cluster (`qos-serve up`) has rows; elsewhere the platform restarts.
  const rows = snapshot.processes || [];
  $("processes-section").hidden = rows.length === 0;
  $("processes").tBodies[0].replaceChildren(...rows.map((p) => el("tr", {"data-process": p.name},
    ...[p.name, el("span", {class: `process-${p.state}`}, p.state), p.restarts,
        p.last_exit_code === null ? "–" : p.last_exit_code].map((c) => el("td", {}, c)))));
}

function drawAlerts(snapshot) {
  const box = $("alerts");
  const objectives = snapshot.sla.objectives.map((o) => el("div", {class: "facts"},
    className(o.priority), ` ${o.tenant === "*" ? "" : o.tenant + " "}${o.objective}: `,
    o.has_verdict ? (o.objective === "success_rate" ? `${(o.observed * 100).toFixed(2)}%` : ms(o.observed)) : "no verdict",
    ` vs ${o.objective === "success_rate" ? (o.target * 100) + "%" : o.target + " ms"} — `,
    el("span", {class: `state-${o.state}`}, o.state.toUpperCase())));
  const alerts = snapshot.sla.alerts.map((a) => el("div", {class: `alert ${a.state}`},
    `${a.state.toUpperCase()} since ${new Date(a.starts_at_unix_s * 1000).toLocaleTimeString()}: ${a.summary}`));
  const none = snapshot.sla.objectives.length ? [] : [el("div", {class: "muted"}, "no SLA contracts")];
  box.replaceChildren(...objectives, ...none,
    ...(alerts.length ? alerts : [el("div", {class: "muted", id: "no-alerts"}, "no alerts")]));
}

function drawTenants(snapshot) {
  fillRows($("tenants").tBodies[0], snapshot.tenants.map((t) => [
    t.name, t.requests, t.tokens.toLocaleString(), t.spend.toFixed(1), t.limits_hit, t.limits || "none"]));
}

function drawRejections(snapshot) {
  const rows = snapshot.rejections.map((r) => [className(r.priority), r.reason, r.count]);
  fillRows($("rejections").tBodies[0], rows.length ? rows : [["none", "", ""]]);
}

function drawWeights(snapshot) {
  const changes = snapshot.pools.flatMap((p) => p.weight_changes.map((w) => ({pool: p.name, ...w})));
  $("weights").replaceChildren(...(changes.length ? changes.map((w) => el("li", {},
    `${new Date(w.at * 1000).toLocaleTimeString()} pool ${w.pool}: `, className(w.priority),
    ` ${w.old} → ${w.new} (utilization ${Math.round(w.utilization * 100)}%, free KV ${Math.round(w.free_kv * 100)}%)`))
    : [el("li", {class: "muted"}, "no changes")]));
}

function drawRecent(snapshot) {
  $("recent").tBodies[0].replaceChildren(...snapshot.recent.map((r) => {
    const trace = r.trace_url ? el("a", {href: r.trace_url, target: "_blank", rel: "noopener"}, "trace")
                              : el("span", {class: "muted", title: r.trace_id}, r.trace_id.slice(0, 8));
    const optional = new Set([0, 3, 7]);             // hidden at phone width
    return el("tr", {"data-request-id": r.request_id},
      ...[new Date(r.at * 1000).toLocaleTimeString(), className(r.priority), r.tenant, r.pool || "–",
          ms(r.ttft_ms), r.tokens, r.status, trace].map((c, i) => el("td", optional.has(i) ? {class: "opt"} : {}, c)));
  }));
}

function draw(snapshot) {
  $("view").textContent = snapshot.view;
  const cluster = snapshot.scope === "cluster";
  for (const id of ["classes-section", "charts-section", "pools-section", "rejections-section", "weights-section",
                    "processes-section"]) {
    $(id).hidden = !cluster;
  }
  if (cluster) {
    drawClasses(snapshot);
    drawCharts(snapshot);
    drawPools(snapshot);
    drawProcesses(snapshot);
    drawRejections(snapshot);
    drawWeights(snapshot);
  }
  drawAlerts(snapshot);
  drawTenants(snapshot);
  drawRecent(snapshot);
  document.body.dataset.updated = String(snapshot.t);
  document.body.dataset.seq = String(snapshot.seq);
}

function setStatus(live, words) {
  const status = $("status");
  status.className = `status ${live ? "live" : "down"}`;
  status.textContent = words;
}

function askForKey(why) {
  $("main").hidden = true;
  $("login").hidden = false;
  $("login-why").textContent = why;
  setStatus(false, "needs a key");
}

async function follow() {
  const key = sessionStorage.getItem(KEY);
  const headers = key ? {authorization: `Bearer ${key}`} : {};
  $("logout").hidden = !key;
  let response;
  try {
    response = await fetch("/console/events", {headers, cache: "no-store"});
  } catch (error) {
    setStatus(false, "router unreachable; retrying");
    return setTimeout(follow, 2000);
  }
  if (response.status === 401 || response.status === 403) {
    const body = await response.json().catch(() => ({}));
    sessionStorage.removeItem(KEY);
    return askForKey((body.error && body.error.message) || "This router requires an API key.");
  }
  if (!response.ok) {
    setStatus(false, `error ${response.status}; retrying`);
    return setTimeout(follow, 2000);
  }
  $("login").hidden = true;
  $("main").hidden = false;
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  try {
    for (;;) {
      const {value, done} = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, {stream: true});
      let end;
      while ((end = buffer.indexOf("\n\n")) >= 0) {
        const event = buffer.slice(0, end);
        buffer = buffer.slice(end + 2);
        const data = event.split("\n").filter((l) => l.startsWith("data: ")).map((l) => l.slice(6)).join("\n");
        if (data) {
          draw(JSON.parse(data));
          setStatus(true, `live, ${new Date().toLocaleTimeString()}`);
        }
      }
    }
  } catch (error) {
    // the router went away mid-stream (restart, drain): reconnect below
  }
  setStatus(false, "disconnected; reconnecting");
  setTimeout(follow, 1000);
}

$("login").addEventListener("submit", (event) => {
  event.preventDefault();
  sessionStorage.setItem(KEY, $("key").value.trim());
  $("key").value = "";
  follow();
});
$("logout").addEventListener("click", () => {
  sessionStorage.removeItem(KEY);
  location.reload();
});
follow();
