// The live cache map: block cells, request table and counters over time, from the feed.
"use strict";

const COLORS = { free: "#e4e8ee", cached: "#8fc1e3", used: "#2f9e5b", shared: "#e0672b" };
const HISTORY = 120; // points per chart (30 s at four updates a second)
const state = { view: null, holders: [], selected: null, hover: null, layout: null, history: [], info: null,
                drafts: new Map() };

function blockState(view, id) {
  const ref = view.ref[id];
  return ref > 1 ? "shared" : ref === 1 ? "used" : view.hashed[id] === "1" ? "cached" : "free";
}

// A cell of a large pool stands for several blocks; it takes the busiest state among them, so a few
// blocks in use among thousands free still show at a glance.
const PRIORITY = ["free", "cached", "used", "shared"];

function cellState(view, cell, group) {
  let best = 0;
  for (let id = cell * group, end = Math.min(id + group, view.ref.length); id < end; id++) {
    best = Math.max(best, PRIORITY.indexOf(blockState(view, id)));
    if (best === PRIORITY.length - 1) break;
  }
  return PRIORITY[best];
}

function setView(view) {
  state.view = view;
  state.drafts = drafts.byBlock(view);
  state.holders = view.ref.map(() => []);
  for (const [requestId, ids] of Object.entries(view.tables)) for (const id of ids) state.holders[id].push(requestId);
  const counts = view.counts;
  lab.text("count-total", lab.int(view.ref.length));
  for (const key of ["free", "cached", "used", "shared"]) lab.text("count-" + key, lab.int(counts[key]));
  lab.text("view-step", lab.int(view.step));
  stateMap.show(view.states); // the state slots at the same step as the blocks
  document.body.dataset.viewStep = view.step;
  drawMap();
}

// The whole pool always on screen, in cells no smaller than MIN_CELL pixels: one block per cell
// while they fit, else GROUP blocks per cell (hover or click one to see its blocks).
const MIN_CELL = 8, MAX_MAP_HEIGHT = 420;

function layout(canvas, count) {
  const width = canvas.clientWidth;
  const rowsFor = (cell, group) => Math.ceil(Math.ceil(count / group) / Math.max(1, Math.floor(width / cell)));
  let cell = 22;
  while (cell > MIN_CELL && rowsFor(cell, 1) * cell > MAX_MAP_HEIGHT) cell -= 1;
  const capacity = Math.max(1, Math.floor(width / cell)) * Math.floor(MAX_MAP_HEIGHT / cell);
  const group = Math.max(1, Math.ceil(count / capacity));
  const columns = Math.max(1, Math.floor(width / cell)), cells = Math.ceil(count / group);
  return { cell, columns, group, cells, rows: Math.ceil(cells / columns), width };
}

function drawMap() {
  const canvas = lab.el("blockmap"), view = state.view;
  if (!view) return;
  const l = (state.layout = layout(canvas, view.ref.length));
  lab.text("map-scale", l.group > 1 ? `Each cell is ${lab.int(l.group)} blocks (the pool has too many to draw one by one) ` +
    "and shows the busiest block in it; hover or click a cell to see its blocks." : "Each cell is one block.");
  const ratio = window.devicePixelRatio || 1, height = l.rows * l.cell;
  canvas.style.height = height + "px";
  canvas.width = l.width * ratio; canvas.height = height * ratio;
  const ctx = canvas.getContext("2d");
  ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
  const gap = l.cell >= 8 ? 2 : 1;
  for (let c = 0; c < l.cells; c++) {
    const x = (c % l.columns) * l.cell, y = Math.floor(c / l.columns) * l.cell;
    ctx.fillStyle = COLORS[cellState(view, c, l.group)];
    ctx.fillRect(x, y, l.cell - gap, l.cell - gap);
    if (l.group === 1 && view.hashed[c] === "1" && view.ref[c] > 0) { // in use and also cached: a dot
      ctx.fillStyle = "rgba(255,255,255,.8)";
      ctx.fillRect(x + l.cell / 2 - 2, y + l.cell / 2 - 2, 3, 3);
    }
  }
  drafts.draw(ctx, l, gap, state.drafts, state.info ? state.info.block_size : 16);
  const mark = state.selected !== null ? state.selected : state.hover;
  if (mark !== null && mark < l.cells) {
    ctx.strokeStyle = "#111"; ctx.lineWidth = 2;
    ctx.strokeRect((mark % l.columns) * l.cell + 1, Math.floor(mark / l.columns) * l.cell + 1, l.cell - gap - 1, l.cell - gap - 1);
  }
  showCell(mark);
}

const STATE_TEXT = { free: "free", cached: "free, prefix still cached (reusable until handed out)",
                     used: "in use by one request", shared: "shared by several requests" };

function showCell(cell) {
  const panel = lab.el("block-info"), view = state.view, l = state.layout;
  if (cell === null || !view || !l || cell >= l.cells) {
    panel.innerHTML = '<h2>Block</h2><p class="muted">Hover over a cell; click to pin it.</p>';
    return;
  }
  if (l.group === 1) return showBlock(cell);
  const first = cell * l.group, last = Math.min(first + l.group, view.ref.length) - 1;
  const counts = { free: 0, cached: 0, used: 0, shared: 0 }, holders = new Set(), busy = [];
  for (let id = first; id <= last; id++) {
    const s = blockState(view, id);
    counts[s] += 1;
    if (view.ref[id] > 0) busy.push(id);
    for (const h of state.holders[id]) holders.add(h);
  }
  panel.innerHTML = `<h2>Blocks ${first}–${last}${state.selected === cell ? " (pinned)" : ""}</h2><dl>
    <dt>in use</dt><dd id="info-used"></dd><dt>shared</dt><dd id="info-shared"></dd>
    <dt>cached, free</dt><dd id="info-cached"></dd><dt>free</dt><dd id="info-free"></dd>
    <dt>in-use blocks</dt><dd id="info-busy"></dd><dt>held by</dt><dd id="info-holders"></dd>
    <dt>drafts</dt><dd id="info-drafts"></dd></dl>`;
  for (const key of ["used", "shared", "cached", "free"]) lab.text("info-" + key, lab.int(counts[key]));
  lab.text("info-busy", busy.length ? busy.slice(0, 24).join(", ") + (busy.length > 24 ? ", …" : "") : "none");
  lab.text("info-holders", holders.size ? [...holders].join(", ") : "nobody");
  lab.text("info-drafts", drafts.describeRange(state.drafts, first, last));
}

function showBlock(id) {
  const panel = lab.el("block-info"), view = state.view;
  const holders = state.holders[id];
  panel.innerHTML = `<h2>Block ${id}${state.selected === id ? " (pinned)" : ""}</h2><dl>
    <dt>state</dt><dd id="info-state"></dd><dt>ref count</dt><dd id="info-ref"></dd>
    <dt>hashed</dt><dd id="info-hashed"></dd><dt>held by</dt><dd id="info-holders"></dd>
    <dt>drafts</dt><dd id="info-drafts"></dd></dl>`;
  lab.text("info-state", STATE_TEXT[blockState(view, id)]);
  lab.text("info-ref", view.ref[id]);
  lab.text("info-hashed", view.hashed[id] === "1" ? "yes: a full block of a cached prefix" : "no");
  lab.text("info-holders", holders.length ? holders.join(", ") : "nobody");
  lab.text("info-drafts", drafts.describe(state.drafts.get(id)));
}

function cellAt(event) {
  const l = state.layout, rect = lab.el("blockmap").getBoundingClientRect();
  if (!l) return null;
  const col = Math.floor((event.clientX - rect.left) / l.cell), row = Math.floor((event.clientY - rect.top) / l.cell);
  const cell = row * l.columns + col;
  return col < l.columns && cell >= 0 && cell < l.cells ? cell : null;
}

lab.el("blockmap").addEventListener("mousemove", (e) => { state.hover = cellAt(e); drawMap(); });
lab.el("blockmap").addEventListener("mouseleave", () => { state.hover = null; drawMap(); });
lab.el("blockmap").addEventListener("click", (e) => {
  const cell = cellAt(e);
  state.selected = cell === state.selected ? null : cell;
  drawMap();
});
window.addEventListener("resize", drawMap);

function requestRow(r) {
  const tr = document.createElement("tr");
  const cells = [r.id, null, lab.int(r.prompt), lab.int(r.cached), lab.int(r.output), lab.int(r.blocks),
                 lab.ms(r.ttft), lab.ms(r.tpot), r.preemptions ? lab.int(r.preemptions) : "–"];
  cells.forEach((value, i) => {
    const td = document.createElement("td");
    if (i === 1) {
      td.className = "text";
      const badge = document.createElement("span");
      badge.className = "badge " + r.status; badge.textContent = r.status; td.append(badge);
    } else td.textContent = value;
    tr.append(td);
  });
  tr.dataset.request = r.id;
  return tr;
}

function setRequests(snapshot) {
  const rows = snapshot.running.concat(snapshot.waiting);
  lab.el("requests").tBodies[0].replaceChildren(...rows.map(requestRow));
  lab.el("no-requests").style.display = rows.length ? "none" : "";
  lab.text("request-counts", `· ${snapshot.running.length} running, ${snapshot.waiting.length} waiting`);
}

function setTenants(snapshot) {
  // Per-tenant usage (the lab is the admin's view): one row per tenant with requests, blocks or tokens.
  const rows = (snapshot.tenants || []).map((t) => {
    const row = document.createElement("tr");
    const cells = [t.tenant === null ? "anonymous" : t.tenant.slice(0, 12), t.weight, t.running, t.waiting,
                   lab.int(t.blocks), lab.int(t.cached_free), t.share.toFixed(0), lab.int(t.scheduled_tokens)];
    cells.forEach((value, i) => {
      const cell = document.createElement("td");
      if (i === 0) cell.className = "text";
      cell.textContent = String(value);
      row.appendChild(cell);
    });
    return row;
  });
  lab.el("tenants").tBodies[0].replaceChildren(...rows);
}

function recordHistory(snapshot) {
  snapshot.received = performance.now() / 1000;
  const h = state.history;
  h.push(snapshot);
  if (h.length > HISTORY) h.shift();
  const c = snapshot.counters;
  // The pool in use, from the block view the cards show (the same numbers in the same frame).
  const usage = h.map((s) => s.usedBlocks / s.pool.num_blocks);
  const hits = h.map((s) => (s.counters.prefix_cache_queries ? s.counters.prefix_cache_hits / s.counters.prefix_cache_queries : null));
  const preemptions = h.map((s) => s.counters.preemptions);
  // tokens/s over the last ~2 s, so one step's burst does not dominate; by the time each snapshot
  // arrived, since an idle engine takes no new snapshot (its `t` stands still while the rate is 0)
  const tps = h.map((s, i) => {
    const j = Math.max(0, i - 8), dt = s.received - h[j].received;
    return dt > 0 ? (s.counters.generated_tokens - h[j].counters.generated_tokens) / dt : null;
  });
  const time = { points: HISTORY, xLabel: `last ${HISTORY * 0.25} s` };
  lab.lineChart(lab.el("chart-usage"), [{ values: usage.map((x) => 100 * x), color: COLORS.used }], { ...time, floor: 100, unit: "%" });
  lab.lineChart(lab.el("chart-hits"), [{ values: hits.map((x) => (x === null ? null : 100 * x)), color: "#3b82f6" }], { ...time, floor: 100, unit: "%" });
  lab.lineChart(lab.el("chart-preemptions"), [{ values: preemptions, color: "#dc2626" }], { ...time, floor: 1, unit: "" });
  lab.lineChart(lab.el("chart-tps"), [{ values: tps, color: "#7c3aed" }], { ...time, floor: 10, unit: " tok/s" });
  lab.text("now-usage", `${lab.pct(snapshot.usedBlocks / snapshot.pool.num_blocks)} (${lab.int(snapshot.usedBlocks)} blocks)`);
  lab.text("now-hits", c.prefix_cache_queries ? `${lab.pct(c.prefix_cache_hits / c.prefix_cache_queries)} of ${lab.int(c.prefix_cache_queries)}` : "–");
  lab.text("now-preemptions", lab.int(c.preemptions));
  lab.text("now-tps", tps[tps.length - 1] === null ? "–" : tps[tps.length - 1].toFixed(1));
}

function apply(snapshot) {
  if (snapshot.blocks) setView(snapshot.blocks);
  drafts.showCounts(snapshot.drafts);
  // A snapshot without a new block view is of the same blocks as the last one (the feed sends a view
  // only when it changed): cards and chart both read the view shown, never two different moments.
  const counts = state.view ? state.view.counts : null;
  snapshot.usedBlocks = counts ? counts.used + counts.shared : snapshot.pool.used;
  setRequests(snapshot);
  setTenants(snapshot);
  recordHistory(snapshot);
  document.body.dataset.updates = (Number(document.body.dataset.updates || 0) + 1).toString();
}

async function follow() {
  for (;;) {
    try {
      lab.text("feed-state", "live");
      await lab.stream("/lab/api/feed", {}, apply);
    } catch (error) {
      lab.text("feed-state", "disconnected: " + error.message + "; retrying");
    }
    await new Promise((resolve) => setTimeout(resolve, 1000));
  }
}

// Gemma 4-style models: which layers store K/V (in what shape, over which pool slots) and which read another's.
function drawKVLayers(kv) {
  if (!kv) return;
  document.getElementById("kv-layer-strip").style.display = "";
  const readers = kv.layers.filter((l) => l.reads !== undefined).length;
  lab.text("kv-layer-about", `${kv.layers.length - readers} layers store K/V in ${kv.slots} slots of ` +
    `${kv.slot_rows} × ${kv.row_width}, ${readers} read an earlier layer's; ` +
    `${lab.int(kv.padding_bytes_per_token)} B/token of padding`);
  const cells = document.getElementById("kv-layer-cells");
  cells.replaceChildren(...kv.layers.map((l) => {
    const cell = document.createElement("span");
    const kind = l.reads !== undefined ? "read" : l.k_eq_v ? "keqv" : "store";
    cell.className = `kv-layer kv-${kind}`;
    cell.textContent = l.reads !== undefined ? `${l.layer}→${l.reads}` : `${l.layer}`;
    const window = l.window ? `window ${l.window}` : "full attention";
    cell.title = l.reads !== undefined ? `layer ${l.layer} (${window}) reads layer ${l.reads}'s cache`
      : `layer ${l.layer} (${window}): ${l.kv_heads} KV head(s) of ${l.head_dim}` +
        `${l.k_eq_v ? ", V alone" : ""}, slot${l.slots.length > 1 ? "s" : ""} ${l.slots.join(", ")}`;
    return cell;
  }));
}

(async () => {
  try {
    state.info = await lab.loadInfo();
    drawKVLayers(state.info.kv_layers);
    apply(await lab.fetchJSON("/lab/api/snapshot"));
  } catch (error) {
    lab.text("feed-state", error.message);
    return;
  }
  follow();
})();
