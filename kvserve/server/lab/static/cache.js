// The live cache map: block cells, request table and counters over time, from the feed.
"use strict";

const COLORS = { free: "#e4e8ee", cached: "#8fc1e3", used: "#2f9e5b", shared: "#e0672b" };
const HISTORY = 120; // points per chart (30 s at four updates a second)
const state = { view: null, holders: [], selected: null, hover: null, layout: null, history: [], info: null };

function blockState(view, id) {
  const ref = view.ref[id];
  return ref > 1 ? "shared" : ref === 1 ? "used" : view.hashed[id] === "1" ? "cached" : "free";
}

function setView(view) {
  state.view = view;
  state.holders = view.ref.map(() => []);
  for (const [requestId, ids] of Object.entries(view.tables)) for (const id of ids) state.holders[id].push(requestId);
  const counts = view.counts;
  lab.text("count-total", lab.int(view.ref.length));
  for (const key of ["free", "cached", "used", "shared"]) lab.text("count-" + key, lab.int(counts[key]));
  lab.text("view-step", lab.int(view.step));
  document.body.dataset.viewStep = view.step;
  drawMap();
}

// Cells as large as fit: the whole pool always on screen.
function layout(canvas, count) {
  const width = canvas.clientWidth;
  let cell = 22;
  while (cell > 3 && Math.ceil(count / Math.floor(width / cell)) * cell > 420) cell -= 1;
  const columns = Math.max(1, Math.floor(width / cell));
  return { cell, columns, rows: Math.ceil(count / columns), width };
}

function drawMap() {
  const canvas = lab.el("blockmap"), view = state.view;
  if (!view) return;
  const l = (state.layout = layout(canvas, view.ref.length));
  const ratio = window.devicePixelRatio || 1, height = l.rows * l.cell;
  canvas.style.height = height + "px";
  canvas.width = l.width * ratio; canvas.height = height * ratio;
  const ctx = canvas.getContext("2d");
  ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
  const gap = l.cell >= 8 ? 2 : 1;
  for (let id = 0; id < view.ref.length; id++) {
    const x = (id % l.columns) * l.cell, y = Math.floor(id / l.columns) * l.cell;
    const s = blockState(view, id);
    ctx.fillStyle = COLORS[s];
    ctx.fillRect(x, y, l.cell - gap, l.cell - gap);
    if (view.hashed[id] === "1" && view.ref[id] > 0 && l.cell >= 8) { // in use and also cached: a dot
      ctx.fillStyle = "rgba(255,255,255,.8)";
      ctx.fillRect(x + l.cell / 2 - 2, y + l.cell / 2 - 2, 3, 3);
    }
  }
  const mark = state.selected !== null ? state.selected : state.hover;
  if (mark !== null && mark < view.ref.length) {
    ctx.strokeStyle = "#111"; ctx.lineWidth = 2;
    ctx.strokeRect((mark % l.columns) * l.cell + 1, Math.floor(mark / l.columns) * l.cell + 1, l.cell - gap - 1, l.cell - gap - 1);
  }
  showBlock(mark);
}

const STATE_TEXT = { free: "free", cached: "free, prefix still cached (reusable until handed out)",
                     used: "in use by one request", shared: "shared by several requests" };

function showBlock(id) {
  const panel = lab.el("block-info"), view = state.view;
  if (id === null || !view || id >= view.ref.length) {
    panel.innerHTML = '<h2>Block</h2><p class="muted">Hover over a cell; click to pin it.</p>';
    return;
  }
  const holders = state.holders[id];
  panel.innerHTML = `<h2>Block ${id}${state.selected === id ? " (pinned)" : ""}</h2><dl>
    <dt>state</dt><dd id="info-state"></dd><dt>ref count</dt><dd id="info-ref"></dd>
    <dt>hashed</dt><dd id="info-hashed"></dd><dt>held by</dt><dd id="info-holders"></dd></dl>`;
  lab.text("info-state", STATE_TEXT[blockState(view, id)]);
  lab.text("info-ref", view.ref[id]);
  lab.text("info-hashed", view.hashed[id] === "1" ? "yes: a full block of a cached prefix" : "no");
  lab.text("info-holders", holders.length ? holders.join(", ") : "nobody");
}

function cellAt(event) {
  const l = state.layout, rect = lab.el("blockmap").getBoundingClientRect();
  if (!l) return null;
  const col = Math.floor((event.clientX - rect.left) / l.cell), row = Math.floor((event.clientY - rect.top) / l.cell);
  const id = row * l.columns + col;
  return col < l.columns && id >= 0 && id < state.view.ref.length ? id : null;
}

lab.el("blockmap").addEventListener("mousemove", (e) => { state.hover = cellAt(e); drawMap(); });
lab.el("blockmap").addEventListener("mouseleave", () => { state.hover = null; drawMap(); });
lab.el("blockmap").addEventListener("click", (e) => {
  const id = cellAt(e);
  state.selected = id === state.selected ? null : id;
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

function recordHistory(snapshot) {
  snapshot.received = performance.now() / 1000;
  const h = state.history;
  h.push(snapshot);
  if (h.length > HISTORY) h.shift();
  const c = snapshot.counters, pool = snapshot.pool;
  const usage = h.map((s) => s.pool.used / s.pool.num_blocks);
  const hits = h.map((s) => (s.counters.prefix_cache_queries ? s.counters.prefix_cache_hits / s.counters.prefix_cache_queries : null));
  const preemptions = h.map((s) => s.counters.preemptions);
  // tokens/s over the last ~2 s, so one step's burst does not dominate; by the time each snapshot
  // arrived, since an idle engine takes no new snapshot (its `t` stands still while the rate is 0)
  const tps = h.map((s, i) => {
    const j = Math.max(0, i - 8), dt = s.received - h[j].received;
    return dt > 0 ? (s.counters.generated_tokens - h[j].counters.generated_tokens) / dt : null;
  });
  lab.lineChart(lab.el("chart-usage"), [{ values: usage.map((x) => 100 * x), color: COLORS.used }], { floor: 100, points: HISTORY });
  lab.lineChart(lab.el("chart-hits"), [{ values: hits.map((x) => (x === null ? null : 100 * x)), color: "#3b82f6" }], { floor: 100, points: HISTORY });
  lab.lineChart(lab.el("chart-preemptions"), [{ values: preemptions, color: "#dc2626" }], { floor: 1, points: HISTORY });
  lab.lineChart(lab.el("chart-tps"), [{ values: tps, color: "#7c3aed" }], { floor: 10, points: HISTORY });
  lab.text("now-usage", `${lab.pct(pool.used / pool.num_blocks)} (${lab.int(pool.used)} blocks)`);
  lab.text("now-hits", c.prefix_cache_queries ? `${lab.pct(c.prefix_cache_hits / c.prefix_cache_queries)} of ${lab.int(c.prefix_cache_queries)}` : "–");
  lab.text("now-preemptions", lab.int(c.preemptions));
  lab.text("now-tps", tps[tps.length - 1] === null ? "–" : tps[tps.length - 1].toFixed(1));
}

function apply(snapshot) {
  if (snapshot.blocks) setView(snapshot.blocks);
  setRequests(snapshot);
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

(async () => {
  try {
    state.info = await lab.loadInfo();
    apply(await lab.fetchJSON("/lab/api/snapshot"));
  } catch (error) {
    lab.text("feed-state", error.message);
    return;
  }
  follow();
})();
