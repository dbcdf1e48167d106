// A hybrid model's recurrent-state slots, beside the KV blocks: one cell per slot (or per few slots in a large
// pool), colored by kind, from the feed's `states` (absent for a model whose every layer attends).
"use strict";

const stateMap = (() => {
  const KINDS = { l: "live", s: "snapshot", w: "working", f: "free" };
  const COLORS = { live: "#2f9e5b", snapshot: "#8fc1e3", working: "#f2b134", free: "#e4e8ee" };
  const PRIORITY = ["f", "s", "w", "l"]; // a cell of several slots shows the busiest
  const MAX_HEIGHT = 120, MIN_CELL = 6;
  let last = null;

  function layout(width, count) {
    let cell = 18;
    const rows = (c, group) => Math.ceil(Math.ceil(count / group) / Math.max(1, Math.floor(width / c)));
    while (cell > MIN_CELL && rows(cell, 1) * cell > MAX_HEIGHT) cell -= 1;
    const columns = Math.max(1, Math.floor(width / cell));
    const group = Math.max(1, Math.ceil(count / (columns * Math.floor(MAX_HEIGHT / cell))));
    const cells = Math.ceil(count / group);
    return { cell, columns, group, cells, rows: Math.ceil(cells / columns) };
  }

  function draw() {
    const states = last, canvas = lab.el("statemap");
    if (!states || !canvas.clientWidth) return;
    const kinds = states.kinds, l = layout(canvas.clientWidth, kinds.length);
    const ratio = window.devicePixelRatio || 1, height = l.rows * l.cell;
    canvas.style.height = height + "px";
    canvas.width = canvas.clientWidth * ratio; canvas.height = height * ratio;
    const ctx = canvas.getContext("2d");
    ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
    const gap = l.cell >= 8 ? 2 : 1;
    for (let c = 0; c < l.cells; c++) {
      let best = 0;
      for (let i = c * l.group, end = Math.min(i + l.group, kinds.length); i < end; i++) {
        best = Math.max(best, PRIORITY.indexOf(kinds[i]));
      }
      ctx.fillStyle = COLORS[KINDS[PRIORITY[best]]];
      ctx.fillRect((c % l.columns) * l.cell, Math.floor(c / l.columns) * l.cell, l.cell - gap, l.cell - gap);
    }
    lab.text("state-scale", l.group > 1 ? `Each cell is ${lab.int(l.group)} slots and shows the busiest of them.`
      : "Each cell is one slot: one request's state over every recurrent layer.");
  }

  // Show the slots of a snapshot (hidden when it has none: a model without recurrent layers).
  function show(states) {
    const strip = lab.el("state-strip");
    if (!states) { strip.style.display = "none"; return; }
    strip.style.display = "";
    last = states;
    const counts = { l: 0, s: 0, w: 0, f: 0 };
    for (const k of states.kinds) counts[k] += 1;
    for (const [letter, kind] of Object.entries(KINDS)) lab.text("state-count-" + kind, lab.int(counts[letter]));
    lab.text("state-evicted", lab.int(states.evicted));
    lab.text("state-about", `· ${lab.int(states.slots)} slots of ${lab.int(states.slot_bytes)} bytes, ` +
      `snapshots every ${states.snapshot_interval} blocks`);
    Object.assign(document.body.dataset, { stateSlots: states.slots, stateLive: counts.l, stateSnapshots: counts.s });
    draw();
  }

  window.addEventListener("resize", draw);
  return { show };
})();
