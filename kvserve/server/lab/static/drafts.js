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

  // Diagonal stripes: a slot written as a draft and accepted.
  let hatch = null;
  function hatchPattern(ctx) {
    if (hatch) return hatch;
    const tile = document.createElement("canvas");
    tile.width = tile.height = 4;
    const t = tile.getContext("2d");
    t.fillStyle = COLORS.accepted; t.fillRect(0, 0, 4, 4);
    t.strokeStyle = "rgba(255,255,255,.75)"; t.lineWidth = 1;
    t.beginPath(); t.moveTo(0, 4); t.lineTo(4, 0); t.stroke();
    return (hatch = ctx.createPattern(tile, "repeat"));
  }

  // A cell whose block took drafts in the step shown is outlined: purple if every draft stayed, red if some
  // were rolled back, dashed red if the rollback returned the block to the pool. Inside, one block per cell
  // shows its slots as a small grid: hatched purple, accepted; solid red, rolled back. A cell of several
  // blocks gets the outline only. O(draft slots): nothing more per frame.
  function draw(ctx, l, gap, blocks, blockSize) {
    const side = Math.ceil(Math.sqrt(blockSize)), cells = new Set();
    let kept = 0, rolledBack = 0;
    for (const [id, d] of blocks) {
      const c = Math.floor(id / l.group);
      if (c >= l.cells) continue;
      cells.add(c);
      const x = (c % l.columns) * l.cell, y = Math.floor(c / l.columns) * l.cell, inner = l.cell - gap;
      ctx.save(); ctx.lineWidth = 2;
      if (d.freed) ctx.setLineDash([3, 2]);
      ctx.strokeStyle = d.freed || d.rolledBack.length ? COLORS.rolledBack : COLORS.accepted;
      ctx.strokeRect(x + 1, y + 1, inner - 2, inner - 2); ctx.restore();
      if (l.group > 1) continue;
      const slot = (inner - 4) / side;
      const at = (offset) => [x + 2 + (offset % side) * slot, y + 2 + Math.floor(offset / side) * slot];
      kept += d.kept.length; rolledBack += d.rolledBack.length;
      ctx.fillStyle = hatchPattern(ctx);
      for (const offset of d.kept) { const [sx, sy] = at(offset); ctx.fillRect(sx, sy, slot, slot); }
      ctx.fillStyle = COLORS.rolledBack;
      for (const offset of d.rolledBack) { const [sx, sy] = at(offset); ctx.fillRect(sx, sy, slot, slot); }
    }
    // For tests: cells drawn with draft marks, and the accepted and rolled-back slots drawn.
    Object.assign(document.body.dataset, { draftCells: cells.size, draftKept: kept, draftRolledBack: rolledBack });
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

  return { byBlock, draw, describe, showCounts };
})();
