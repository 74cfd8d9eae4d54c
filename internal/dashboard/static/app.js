// gpufrac dashboard: renders the view the server pushes over /api/stream.
// Every figure is text in the page; the bars only draw what the text says.
"use strict";

let open = new Set(); // tenants whose annotations are shown, kept across updates
let shown = new Set(); // tenants on the page now

function mib(v) {
  if (v !== 0 && v % 1024 === 0) return (v / 1024) + "Gi";
  return v + "Mi";
}

function pct(part, whole) {
  return whole > 0 ? (Math.round(part * 1000 / whole) / 10) + "%" : "0%";
}

function el(tag, attrs, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "class") e.className = v;
    else e.setAttribute(k, v);
  }
  for (const c of children) {
    if (c === null || c === undefined) continue;
    e.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return e;
}

// Tenants of one GPU get distinct colours, in their order on the GPU.
const palette = ["#3f6fd8", "#d9822b", "#2e9e6a", "#c2417a", "#7a52c7", "#1f9bb0", "#b8a12a", "#8a5a3c"];
function colour(i) { return palette[i % palette.length]; }

function segment(cls, widthPct, colourValue, title) {
  const s = el("span", { class: cls, title: title });
  s.style.width = widthPct + "%";
  s.style.flex = "0 0 auto";
  if (colourValue) s.style.backgroundColor = colourValue;
  return s;
}

function renderSummary(v) {
  const s = v.summary;
  const box = document.getElementById("summary-figures");
  const figure = (label, value, id) => el("div", { id: id }, el("dt", {}, label), el("dd", {}, value));
  box.replaceChildren(
    figure("GPUs", String(s.gpus), "fig-gpus"),
    figure("Memory allocated", mib(s.allocatedMiB) + " of " + mib(s.totalMiB) + " (" + s.allocationPct + "%)", "fig-allocated"),
    figure("Free to schedule", mib(s.freeMiB), "fig-free"),
    figure("Stranded on shared GPUs", mib(s.strandedMiB) + " (" + s.fragmentationPct + "% of free)", "fig-stranded"),
    figure("Fractions pending", String(s.pending), "fig-pending"),
  );
}

function renderPending(v) {
  const list = document.getElementById("pending-list");
  document.getElementById("pending-none").hidden = v.pending.length > 0;
  list.replaceChildren(...v.pending.map(p => el("li", { "data-pod": p.pod },
    el("strong", {}, p.pod), " asks " + p.asks,
    el("span", { class: "reason" }, p.reason ? "scheduler: " + p.reason : "no scheduler event yet"))));
}

// spark draws a history of use (memory in MiB over time) against a
// ceiling as a small line: the text beside it says the figures.
function spark(history, ceiling, label) {
  const ns = "http://www.w3.org/2000/svg";
  const svg = document.createElementNS(ns, "svg");
  svg.setAttribute("class", "spark");
  svg.setAttribute("viewBox", "0 0 100 20");
  svg.setAttribute("preserveAspectRatio", "none");
  svg.setAttribute("role", "img");
  svg.setAttribute("aria-label", label);
  const h = history || [];
  svg.dataset.samples = String(h.length);
  if (h.length > 0) {
    const t0 = h[0].t, span = Math.max(h[h.length - 1].t - t0, 1), top = Math.max(ceiling, ...h.map(p => p.u), 1);
    const line = document.createElementNS(ns, "polyline");
    line.setAttribute("points", h.map(p => ((p.t - t0) * 100 / span).toFixed(1) + "," + (20 - p.u * 20 / top).toFixed(1)).join(" "));
    svg.append(line);
  }
  return svg;
}

// usage says what a tenant uses against its grant, with its marks.
function usage(t) {
  const u = t.use;
  if (!u || u.usedMiB === undefined) {
    return el("span", { class: "used unknown", title: "no reading: the node's agent has not measured it, or its driver cannot say" }, "used unknown");
  }
  const parts = ["used " + mib(u.usedMiB) + " of " + mib(t.requestMiB) + " (" + pct(u.usedMiB, t.requestMiB) + ")"];
  if (u.smPercent !== undefined) parts.push("SM " + u.smPercent + "%");
  if (u.p95MiB !== undefined) parts.push("p95 " + mib(u.p95MiB) + " over " + u.samples + " readings");
  return el("span", { class: "used" + (t.nearLimit ? " near" : "") + (t.idle ? " idle" : "") }, parts.join(" · "),
    t.idle ? el("strong", { class: "mark idle" }, " idle") : null,
    t.nearLimit ? el("strong", { class: "mark near" }, " near its limit") : null,
    t.advice ? el("span", { class: "advice", title: t.advice.why }, " · advice: request " + mib(t.advice.requestMiB)) : null);
}

function renderTenant(node, gpu, t, i) {
  const key = node.name + "/" + gpu.uuid + "/" + t.pod;
  const nums = "request " + mib(t.requestMiB) + " · limit " + mib(t.limitMiB) +
    (t.limitMiB > t.requestMiB ? " (burst " + mib(t.limitMiB - t.requestMiB) + ")" : "") +
    (t.priority ? " · priority " + t.priority : "") +
    (t.portion ? " · compute " + t.portion : "") +
    (t.resize ? " · " + t.resize : "");
  const swatch = el("span", { class: "swatch", "aria-hidden": "true" });
  swatch.style.backgroundColor = colour(i);
  const details = el("details", {},
    el("summary", { "data-key": key }, swatch, el("span", { class: "pod" }, t.pod), el("span", { class: "nums" }, nums),
      usage(t), spark(t.history, t.limitMiB, "use of " + t.pod + " over the last hour")));
  if (t.advice) details.append(el("p", { class: "command" }, el("code", {}, t.advice.command)));
  shown.add(key);
  const dl = el("dl", { "aria-label": "annotations of " + t.pod });
  for (const k of Object.keys(t.annotations || {}).sort()) {
    dl.append(el("dt", {}, k), el("dd", {}, t.annotations[k]));
  }
  details.append(dl);
  details.open = open.has(key);
  details.addEventListener("toggle", () => { if (details.open) open.add(key); else open.delete(key); });
  return el("li", { "data-pod": t.pod }, details);
}

function renderGPU(node, gpu) {
  gpu.tenants = gpu.tenants || [];
  const total = node.memoryMiB || 1;
  const reserve = Math.max(total - gpu.schedulableMiB, 0);
  const requests = el("div", { class: "bar", "aria-hidden": "true" });
  const limits = el("div", { class: "bar limits", "aria-hidden": "true" });
  let limitSum = 0;
  gpu.tenants.forEach((t, i) => {
    requests.append(segment("request", t.requestMiB * 100 / total, colour(i), t.pod + ": request " + mib(t.requestMiB)));
    limits.append(segment("request", t.requestMiB * 100 / total, colour(i), t.pod + ": request " + mib(t.requestMiB)));
    if (t.limitMiB > t.requestMiB) {
      limits.append(segment("burst", (t.limitMiB - t.requestMiB) * 100 / total, colour(i), t.pod + ": burst to " + mib(t.limitMiB)));
    }
    limitSum += t.limitMiB;
  });
  const used = gpu.tenants.reduce((a, t) => a + t.requestMiB, 0);
  const gap = el("span", { class: "gap" });
  gap.style.flex = "1 1 auto";
  requests.append(gap);
  if (reserve > 0) requests.append(segment("reserve", reserve * 100 / total, null, "reserve " + mib(reserve)));
  const free = el("p", { class: "free" }, "free " + mib(gpu.freeMiB) + " of " + mib(gpu.schedulableMiB) + " schedulable",
    reserve > 0 ? " (reserve " + mib(reserve) + ")" : "", " · requests " + mib(used) + " (" + pct(used, total) + ")",
    limitSum > total ? " · limits add up to " + mib(limitSum) + ", over the GPU's memory: bursts contend" : "");
  const u = gpu.use;
  const use = el("p", { class: "gpu-use" }, u && u.usedMiB !== undefined
    ? "in use " + mib(u.usedMiB) + " (" + pct(u.usedMiB, total) + ")" + (u.smPercent !== undefined ? " · utilisation " + u.smPercent + "%" : "") +
      (u.unattributedMiB ? " · " + mib(u.unattributedMiB) + " outside the shares" : "")
    : "in use: no reading", spark(gpu.history, total, "use of GPU " + gpu.uuid + " over the last hour"));
  return el("div", { class: "gpu", "data-uuid": gpu.uuid },
    el("div", { class: "head" },
      el("span", { class: "uuid" }, gpu.uuid),
      el("span", { class: "mode " + gpu.mode }, gpu.mode)),
    requests, limits, free, use,
    gpu.reclaimOrder && gpu.reclaimOrder.length
      ? el("p", { class: "reclaim", title: "above their request, lowest priority first, then furthest above it: the node agent stops them in this order when the GPU runs short of memory" },
        "reclaimed first if short of memory: " + gpu.reclaimOrder.join(", "))
      : null,
    el("ul", { class: "tenants", "aria-label": "tenants of " + gpu.uuid }, ...gpu.tenants.map((t, i) => renderTenant(node, gpu, t, i))));
}

function renderNode(n) {
  const ready = n.ready ? el("span", { class: "state" }, "ready for fractions")
    : el("span", { class: "state bad" }, "NOT READY for fractions" + (n.readyReason ? ": " + n.readyReason : "") + (n.readyMessage ? " — " + n.readyMessage : ""));
  const meta = el("p", { class: "meta" }, n.gpus + " × " + n.model + ", " + mib(n.memoryMiB) + " each",
    " · enforcement: " + (n.enforcement || "not reported"), n.reserveMiB > 0 ? " · reserve " + mib(n.reserveMiB) + " per GPU" : "");
  const card = el("article", { class: "node" + (n.ready ? "" : " notready"), "data-node": n.name, "aria-label": "node " + n.name },
    el("h3", {}, n.name), meta, ready);
  for (const g of n.shared || []) card.append(renderGPU(n, g));
  const whole = n.whole || [];
  if (whole.length > 0) {
    card.append(el("p", { class: "whole" }, "Whole GPUs: " + whole.map(w => w.pod + " (" + w.gpus + ")").join(", ")));
  }
  card.append(el("p", { class: "idle" }, "Idle GPUs: " + n.idle));
  return card;
}

function render(v) {
  // Go writes an empty list as null.
  v.nodes = v.nodes || [];
  v.pending = v.pending || [];
  // The page is drawn afresh: keep the keyboard's place on a tenant.
  const focused = document.activeElement && document.activeElement.dataset ? document.activeElement.dataset.key : undefined;
  shown = new Set();
  renderSummary(v);
  renderPending(v);
  document.getElementById("nodes").replaceChildren(...v.nodes.map(renderNode));
  open = new Set([...open].filter(k => shown.has(k))); // forget tenants that left
  if (focused) {
    const again = [...document.querySelectorAll("summary[data-key]")].find(e => e.dataset.key === focused);
    if (again) again.focus();
  }
}

function connect() {
  // The status line is announced (aria-live) only when the connection
  // changes, not at every update; the time of the last update is beside it.
  const status = document.getElementById("status");
  const updated = document.getElementById("updated");
  const say = (text, cls) => {
    if (status.textContent !== text) status.textContent = text;
    status.className = cls;
  };
  const source = new EventSource("api/stream");
  source.addEventListener("view", e => {
    render(JSON.parse(e.data));
    say("live", "live");
    updated.textContent = "updated " + new Date().toLocaleTimeString();
  });
  source.onerror = () => {
    // EventSource reconnects by itself; say so meanwhile.
    say("disconnected, reconnecting…", "down");
  };
}

connect();
