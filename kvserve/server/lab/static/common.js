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

lab.fetchJSON = async (path, options) => {
  const opts = Object.assign({}, options || {});
  opts.headers = lab.headers(opts.headers);
  const response = await fetch(path, opts);
  const body = await response.json().catch(() => ({}));
  if (response.status === 401 || response.status === 403) lab.showKeyBar(body.error ? body.error.message : "");
  if (!response.ok) throw new Error(body.error ? body.error.message : "HTTP " + response.status);
  return body;
};

// Server-sent events over fetch (EventSource cannot send an Authorization header).
lab.stream = async (path, options, onEvent) => {
  const opts = Object.assign({}, options || {});
  opts.headers = lab.headers(opts.headers);
  const response = await fetch(path, opts);
  if (!response.ok) {
    const body = await response.json().catch(() => ({}));
    if (response.status === 401 || response.status === 403) lab.showKeyBar(body.error ? body.error.message : "");
    throw new Error(body.error ? body.error.message : "HTTP " + response.status);
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

// A small line chart on a canvas: values over time, y from 0 to max(values, floor).
lab.lineChart = (canvas, series, options) => {
  const ratio = window.devicePixelRatio || 1;
  const width = canvas.clientWidth, height = canvas.clientHeight;
  if (canvas.width !== width * ratio) { canvas.width = width * ratio; canvas.height = height * ratio; }
  const ctx = canvas.getContext("2d");
  ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
  ctx.clearRect(0, 0, width, height);
  const all = series.flatMap((s) => s.values).filter((v) => v !== null && isFinite(v));
  const top = Math.max(options.floor || 1, ...all) * 1.1;
  const count = Math.max(options.points || 2, ...series.map((s) => s.values.length));
  ctx.strokeStyle = "#e5e7eb"; ctx.lineWidth = 1;
  ctx.beginPath(); ctx.moveTo(0, height - 0.5); ctx.lineTo(width, height - 0.5); ctx.stroke();
  for (const s of series) {
    ctx.strokeStyle = s.color; ctx.lineWidth = 1.8; ctx.beginPath();
    let started = false;
    s.values.forEach((v, i) => {
      if (v === null || !isFinite(v)) return;
      const x = count > 1 ? (i / (count - 1)) * (width - 2) + 1 : 1;
      const y = height - 2 - (v / top) * (height - 6);
      if (started) ctx.lineTo(x, y); else { ctx.moveTo(x, y); started = true; }
    });
    ctx.stroke();
  }
};

lab.loadInfo = async () => {
  const info = await lab.fetchJSON("/lab/api/info");
  lab.text("model-info", `${info.model} · ${lab.int(info.num_blocks)} blocks × ${info.block_size} tokens · ` +
    `KV ${info.kv_dtype}, ${lab.int(info.bytes_per_token)} B/token`);
  return info;
};
