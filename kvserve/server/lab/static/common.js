// Shared by every lab page: authenticated fetch, a streaming SSE reader, number formatting.
// The admin key (when the server has one) lives in sessionStorage and goes in an Authorization
// header, never in a URL (URLs end up in logs and browser history).
"use strict";

const lab = {};

lab.key = () => sessionStorage.getItem("kvserve-admin-key");

lab.headers = (extra) => {
  const headers = Object.assign({}, extra || {});
  const key = lab.key();
  if (key) headers["Authorization"] = "Bearer " + key;
  return headers;
};

// Ask for the admin key once a request is refused; the page reloads with it.
lab.showKeyBar = (message) => {
  if (document.getElementById("keybar")) return;
  const bar = document.createElement("div");
  bar.id = "keybar";
  bar.className = "keybar";
  bar.innerHTML = '<span></span><form style="display:inline"><input type="password" ' +
    'placeholder="admin key" autocomplete="current-password"><button>Open the lab</button></form>';
  bar.querySelector("span").textContent = message;
  bar.querySelector("form").addEventListener("submit", (e) => {
    e.preventDefault();
    sessionStorage.setItem("kvserve-admin-key", bar.querySelector("input").value);
    location.reload();
  });
  document.querySelector("main").prepend(bar);
};

// What a page says where it would show an error while the key bar (above) asks for the key: the
// bar already says why, and repeating its sentence in the page's subtitle only doubles it.
class KeyRequired extends Error {
  constructor() { super("waiting for the admin key"); this.name = "KeyRequired"; }
}

lab.refused = (status, body) => {
  if (status !== 401 && status !== 403) return null;
  lab.showKeyBar(body.error ? body.error.message : "");
  return new KeyRequired();
};

lab.fetchJSON = async (path, options) => {
  const opts = Object.assign({}, options || {});
  opts.headers = lab.headers(opts.headers);
  const response = await fetch(path, opts);
  const body = await response.json().catch(() => ({}));
  if (!response.ok) throw lab.refused(response.status, body) || new Error(body.error ? body.error.message : "HTTP " + response.status);
  return body;
};

// Server-sent events over fetch (EventSource cannot send an Authorization header).
lab.stream = async (path, options, onEvent) => {
  const opts = Object.assign({}, options || {});
  opts.headers = lab.headers(opts.headers);
  const response = await fetch(path, opts);
  if (!response.ok) {
    const body = await response.json().catch(() => ({}));
    throw lab.refused(response.status, body) || new Error(body.error ? body.error.message : "HTTP " + response.status);
  }
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const chunk = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      const data = chunk.split("\n").filter((l) => l.startsWith("data: ")).map((l) => l.slice(6)).join("\n");
      if (data) onEvent(JSON.parse(data));
    }
  }
};

lab.int = (n) => (n === null || n === undefined ? "–" : Math.round(n).toLocaleString("en-US"));
lab.ms = (seconds) => (seconds === null || seconds === undefined ? "–" : (seconds * 1000).toFixed(seconds < 0.1 ? 1 : 0) + " ms");
lab.pct = (x) => (x === null || x === undefined || !isFinite(x) ? "–" : (100 * x).toFixed(1) + "%");

// Same as kvserve.config.format_memory: the largest binary unit up to GiB that keeps the number >= 1.
lab.bytes = (n) => {
  for (const [unit, scale] of [["GiB", 2 ** 30], ["MiB", 2 ** 20], ["KiB", 2 ** 10]]) {
    if (n >= scale) return (n / scale).toLocaleString("en-US", { minimumFractionDigits: 2, maximumFractionDigits: 2 }) + " " + unit;
  }
  return lab.int(n) + " B";
};

lab.el = (id) => document.getElementById(id);

lab.text = (id, value) => { const e = lab.el(id); if (e) e.textContent = value; };

// Axis numbers: 1,234 / 12.5k / 3.4M, with the unit after them.
lab.tick = (v, unit) => {
  const abs = Math.abs(v);
  const text = abs >= 1e6 ? (v / 1e6).toFixed(1) + "M" : abs >= 1e4 ? (v / 1e3).toFixed(0) + "k" :
    abs >= 100 || Number.isInteger(v) ? Math.round(v).toLocaleString("en-US") : v.toFixed(1);
  return text + (unit || "");
};

// The next round number at or above v (1, 1.5, 2, 2.5, 3, 4, 5, 6, 8 x a power of ten): an axis's top.
lab.roundUp = (v) => {
  if (!(v > 0)) return 0;
  const p = 10 ** Math.floor(Math.log10(v));
  return [1, 1.5, 2, 2.5, 3, 4, 5, 6, 8, 10].map((m) => m * p).find((x) => x >= v * (1 - 1e-9));
};

// A small line chart on a canvas: values over time, y from 0 to max(floor, a round number above the values); a y axis with
// its top, middle and zero in `options.unit`, and `options.xLabel` under the x axis.
lab.lineChart = (canvas, series, options) => {
  const ratio = window.devicePixelRatio || 1;
  const width = canvas.clientWidth, height = canvas.clientHeight;
  if (canvas.width !== width * ratio) { canvas.width = width * ratio; canvas.height = height * ratio; }
  const ctx = canvas.getContext("2d");
  ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
  ctx.clearRect(0, 0, width, height);
  const all = series.flatMap((s) => s.values).filter((v) => v !== null && isFinite(v));
  const top = Math.max(options.floor || 1, lab.roundUp(Math.max(0, ...all) * 1.05)); // headroom only past the floor
  const count = Math.max(options.points || 2, ...series.map((s) => s.values.length));
  ctx.font = "10px system-ui, sans-serif"; ctx.fillStyle = "#667085";
  const labels = [top, top / 2, 0].map((v) => lab.tick(v, options.unit));
  const left = Math.ceil(Math.max(...labels.map((t) => ctx.measureText(t).width))) + 6;
  const bottom = options.xLabel ? 14 : 4, plotH = height - bottom - 6, plotW = width - left - 2;
  const yOf = (v) => 6 + plotH - (v / top) * plotH;
  ctx.textAlign = "right"; ctx.textBaseline = "middle";
  [top, top / 2, 0].forEach((v, i) => {
    ctx.fillText(labels[i], left - 4, yOf(v));
    ctx.strokeStyle = i === 2 ? "#cbd2dc" : "#eef0f4"; ctx.lineWidth = 1;
    ctx.beginPath(); ctx.moveTo(left, Math.round(yOf(v)) + 0.5); ctx.lineTo(width, Math.round(yOf(v)) + 0.5); ctx.stroke();
  });
  ctx.strokeStyle = "#cbd2dc";
  ctx.beginPath(); ctx.moveTo(left + 0.5, 6); ctx.lineTo(left + 0.5, 6 + plotH); ctx.stroke();
  if (options.xLabel) {
    ctx.textAlign = "center"; ctx.textBaseline = "bottom";
    ctx.fillText(options.xLabel, left + plotW / 2, height);
  }
  for (const s of series) {
    ctx.strokeStyle = s.color; ctx.lineWidth = 1.8; ctx.beginPath();
    let started = false;
    s.values.forEach((v, i) => {
      if (v === null || !isFinite(v)) return;
      const x = left + 1 + (count > 1 ? (i / (count - 1)) * (plotW - 2) : 0);
      if (started) ctx.lineTo(x, yOf(v)); else { ctx.moveTo(x, yOf(v)); started = true; }
    });
    ctx.stroke();
  }
};

lab.loadInfo = async () => {
  const info = await lab.fetchJSON("/lab/api/info");
  lab.text("model-info", `${info.model} · ${lab.int(info.num_blocks)} blocks × ${info.block_size} tokens · ` +
    `KV ${info.kv_dtype}, ${lab.int(info.bytes_per_token)} B/token` +
    (info.recurrent_state ? ` · recurrent state ${lab.int(info.recurrent_state.slot_bytes)} B/request` : ""));
  return info;
};
