// Speculative decoding on the cache map: the draft slots of the step the map shows, drawn over its blocks,
// and the written / accepted / rolled-back counters (the feed's `blocks.drafts` and `drafts`).
"use strict";

const drafts = (() => {
  const COLORS = { accepted: "#7c3aed", rolledBack: "#dc2626" };

  // By block id: the offsets written as drafts and kept (accepted), those rolled back, whether the
  // rollback gave the block back to the pool, and which requests drafted there.
  function byBlock(view) {
    const blocks = new Map();
    const entry = (id) => blocks.get(id) || blocks.set(id, { kept: [], rolledBack: [], freed: false, requests: new Set() }).get(id);
    for (const r of view.drafts || []) {
      const rolled = new Set();
      for (let i = 0; i < r.rolled_back.length; i += 2) {
        const e = entry(r.rolled_back[i]);
        e.rolledBack.push(r.rolled_back[i + 1]); e.requests.add(r.id);
        rolled.add(r.rolled_back[i] + ":" + r.rolled_back[i + 1]);
      }
      for (let i = 0; i < r.written.length; i += 2) {
        if (rolled.has(r.written[i] + ":" + r.written[i + 1])) continue;
        const e = entry(r.written[i]);
        e.kept.push(r.written[i + 1]); e.requests.add(r.id);
      }
      for (const id of r.freed_blocks) entry(id).freed = true;
    }
    return blocks;
  }

  // Diagonal stripes: a slot written as a draft and accepted (one pattern per canvas: map and close-up).
  const hatches = new WeakMap();
  function hatchPattern(ctx) {
    if (hatches.has(ctx)) return hatches.get(ctx);
    const tile = document.createElement("canvas");
    tile.width = tile.height = 4;
    const t = tile.getContext("2d");
    t.fillStyle = COLORS.accepted; t.fillRect(0, 0, 4, 4);
    t.strokeStyle = "rgba(255,255,255,.75)"; t.lineWidth = 1;
    t.beginPath(); t.moveTo(0, 4); t.lineTo(4, 0); t.stroke();
    const hatch = ctx.createPattern(tile, "repeat");
    hatches.set(ctx, hatch);
    return hatch;
  }

  // A block's slots as a small grid inside a square of side `inner` at (x, y): hatched purple, accepted;
  // solid red, rolled back. Returns how many of each it drew.
  function drawSlots(ctx, x, y, inner, d, blockSize) {
    const side = Math.ceil(Math.sqrt(blockSize)), slot = (inner - 4) / side;
    const at = (offset) => [x + 2 + (offset % side) * slot, y + 2 + Math.floor(offset / side) * slot];
    ctx.fillStyle = hatchPattern(ctx);
    for (const offset of d.kept) { const [sx, sy] = at(offset); ctx.fillRect(sx, sy, slot, slot); }
    ctx.fillStyle = COLORS.rolledBack;
    for (const offset of d.rolledBack) { const [sx, sy] = at(offset); ctx.fillRect(sx, sy, slot, slot); }
    return [d.kept.length, d.rolledBack.length];
  }

  // The outline of a block that took drafts: purple if every draft stayed, red if some were rolled back,
  // dashed red if the rollback returned the block to the pool.
  function outline(ctx, x, y, inner, d) {
    ctx.save(); ctx.lineWidth = 2;
    if (d.freed) ctx.setLineDash([3, 2]);
    ctx.strokeStyle = d.freed || d.rolledBack.length ? COLORS.rolledBack : COLORS.accepted;
    ctx.strokeRect(x + 1, y + 1, inner - 2, inner - 2); ctx.restore();
  }

  // Each cell whose blocks took drafts in the step shown is outlined. One block per cell also shows its
  // slots inside; a cell of several blocks is too small for them, so the close-up below the map shows
  // them (closeUp). O(draft slots): nothing more per frame.
  function draw(ctx, l, gap, blocks, blockSize) {
    const cells = new Set();
    let kept = 0, rolledBack = 0;
    for (const [id, d] of blocks) {
      const c = Math.floor(id / l.group);
      if (c >= l.cells) continue;
      cells.add(c);
      const x = (c % l.columns) * l.cell, y = Math.floor(c / l.columns) * l.cell, inner = l.cell - gap;
      outline(ctx, x, y, inner, d);
      if (l.group > 1) continue;
      const [k, r] = drawSlots(ctx, x, y, inner, d, blockSize);
      kept += k; rolledBack += r;
    }
    if (l.group > 1) [kept, rolledBack] = closeUp(blocks, blockSize);
    else lab.el("draft-closeup").style.display = "none";
    // For tests: cells drawn with draft marks, and the accepted and rolled-back slots drawn.
    Object.assign(document.body.dataset, { draftCells: cells.size, draftKept: kept, draftRolledBack: rolledBack });
  }

  // Grouped cells: the step's drafted blocks drawn large in a strip, each with its slots and its id.
  const CLOSE = 44, CLOSE_GAP = 14, CLOSE_MAX = 24;
  function closeUp(blocks, blockSize) {
    const wrap = lab.el("draft-closeup"), canvas = lab.el("draft-closeup-map");
    const shown = [...blocks.keys()].sort((a, b) => a - b).slice(0, CLOSE_MAX);
    wrap.style.display = shown.length ? "" : "none";
    lab.text("draft-closeup-more", blocks.size > shown.length ? `(the first ${shown.length} of ${lab.int(blocks.size)})` : "");
    if (!shown.length) return [0, 0];
    const ratio = window.devicePixelRatio || 1, width = shown.length * (CLOSE + CLOSE_GAP), height = CLOSE + 16;
    canvas.style.width = width + "px"; canvas.style.height = height + "px";
    canvas.width = width * ratio; canvas.height = height * ratio;
    const ctx = canvas.getContext("2d");
    ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
    ctx.font = "11px system-ui, sans-serif"; ctx.textAlign = "center";
    let kept = 0, rolledBack = 0;
    shown.forEach((id, i) => {
      const d = blocks.get(id), x = i * (CLOSE + CLOSE_GAP);
      ctx.fillStyle = d.freed ? "#e4e8ee" : "#2f9e5b";
      ctx.fillRect(x, 0, CLOSE, CLOSE);
      outline(ctx, x, 0, CLOSE, d);
      const [k, r] = drawSlots(ctx, x, 0, CLOSE, d, blockSize);
      kept += k; rolledBack += r;
      ctx.fillStyle = "#667085"; ctx.fillText(String(id), x + CLOSE / 2, CLOSE + 12);
    });
    return [kept, rolledBack];
  }

  // The drafted blocks among `first`..`last` (a grouped cell), each described, or that there are none.
  function describeRange(blocks, first, last) {
    const lines = [...blocks.keys()].filter((id) => id >= first && id <= last).sort((a, b) => a - b)
      .map((id) => `block ${id}: ${describe(blocks.get(id))}`);
    return lines.length ? lines.join("; ") : "none in the step shown";
  }

  function describe(d) {
    if (!d) return "none in the step shown";
    const list = (offsets) => offsets.slice().sort((a, b) => a - b).join(", ");
    const parts = [];
    if (d.kept.length) parts.push(`slots ${list(d.kept)} accepted`);
    if (d.rolledBack.length) parts.push(`slots ${list(d.rolledBack)} rolled back`);
    if (d.freed) parts.push("block returned to the pool");
    return parts.join("; ") + ` (${[...d.requests].join(", ")})`;
  }

  // Draft tokens written / accepted / rolled back: the last step's and in total. Hidden with drafting off.
  function showCounts(counts) {
    lab.el("draft-legend").style.display = counts ? "" : "none";
    if (!counts) return;
    const line = (d) => `${lab.int(d.written)} written, ${lab.int(d.accepted)} accepted, ${lab.int(d.rolled_back)} rolled back`;
    lab.text("drafts-last", line(counts.last));
    lab.text("drafts-total", `· in total ${line(counts.total)}, ${lab.int(counts.total.freed_blocks)} blocks returned`);
    document.body.dataset.draftsWritten = counts.total.written;
  }

  return { byBlock, draw, describe, describeRange, showCounts };
})();
