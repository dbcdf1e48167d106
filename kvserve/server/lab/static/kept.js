// The kept-tokens view: /lab/api/kept lists the recorded requests, /lab/api/kept/{id} sends each compressed chunk
// as one bitmask per layer and KV head (little-endian bits, base64). Drawn as layers x positions.
"use strict";

const ROW = 4; // pixels per KV head line
const COLORS = { kept: [59, 91, 219], dropped: [228, 231, 236], cached: [246, 211, 101], gap: [255, 255, 255] };
const kept = { record: null, bits: null, chunk: 0 };

function decode(b64) {
  const raw = atob(b64), bytes = new Uint8Array(raw.length);
  for (let i = 0; i < raw.length; i++) bytes[i] = raw.charCodeAt(i);
  return bytes;
}

// Whether `layer`'s KV head `head` kept prompt position `position` (null: not a recorded compressed chunk).
function keptAt(layer, head, position) {
  const r = kept.record;
  if (!r) return null;
  const index = Math.floor(position / kept.chunk), bytes = kept.bits[index];
  if (!bytes) return null;
  const at = position - index * kept.chunk, row = (layer * r.kv_heads + head) * (kept.chunk / 8);
  return Boolean(bytes[row + (at >> 3)] & (1 << (at & 7)));
}

function draw() {
  const r = kept.record, canvas = lab.el("kept-map");
  const width = r.num_chunks * kept.chunk, height = r.layers * r.kv_heads * ROW;
  canvas.width = Math.max(width, 1); canvas.height = Math.max(height, 1);
  if (!width || !height) return;
  const ctx = canvas.getContext("2d"), image = ctx.createImageData(width, height);
  for (let layer = 0; layer < r.layers; layer++) {
    for (let head = 0; head < r.kv_heads; head++) {
      for (let p = 0; p < width; p++) {
        const k = keptAt(layer, head, p);
        const color = k === null ? COLORS.cached : k ? COLORS.kept : COLORS.dropped;
        for (let y = 0; y < ROW; y++) {
          // the last line of a layer's band is a gap, so the bands read as layers
          const c = y === ROW - 1 && head === r.kv_heads - 1 ? COLORS.gap : color;
          const i = 4 * (((layer * r.kv_heads + head) * ROW + y) * width + p);
          image.data[i] = c[0]; image.data[i + 1] = c[1]; image.data[i + 2] = c[2]; image.data[i + 3] = 255;
        }
      }
    }
  }
  ctx.putImageData(image, 0, 0);
}

function show(r) {
  kept.record = r;
  kept.chunk = r.chunks.length ? r.chunks[0].chunk : 512;
  kept.bits = {};
  for (const c of r.chunks) kept.bits[c.index] = decode(c.kept);
  const budget = r.chunks.length ? r.chunks[0].budget : 0;
  lab.text("kept-title", `${r.id}: ${lab.int(r.prompt_tokens)} prompt tokens, ${r.num_chunks} compressed chunk(s)` +
    (budget ? `, each keeping ${budget} of ${kept.chunk} per layer and KV head` : "") +
    `${r.finished ? " (finished)" : " (running)"}`);
  lab.text("kept-cached", r.cached.length ? `chunks ${r.cached.join(", ")}: found compressed in the prefix cache ` +
    `(or not computed yet), so this request did not choose their tokens` : "");
  const ids = r.layer_ids.length ? r.layer_ids : [...Array(r.layers).keys()];
  lab.text("kept-rows", `rows: layer ${ids[0]} at the top to layer ${ids[ids.length - 1]} at the bottom` +
    (ids.length < ids[ids.length - 1] + 1 ? ` (the full-attention layers: windowed ones keep every token)` : "") +
    `, ${r.kv_heads} KV head line(s) each`);
  lab.text("kept-first", "position 0");
  lab.text("kept-last", "position " + lab.int(r.num_chunks * kept.chunk - 1));
  draw();
  document.body.dataset.ready = r.id;
}

async function load(id) {
  try {
    show(await lab.fetchJSON("/lab/api/kept/" + encodeURIComponent(id)));
    lab.text("error", "");
  } catch (error) { lab.text("error", error.message); }
}

async function list() {
  let body;
  try { body = await lab.fetchJSON("/lab/api/kept"); } catch (error) { lab.text("error", error.message); return; }
  const select = lab.el("kept-request"), chosen = select.value || new URLSearchParams(location.search).get("request");
  select.innerHTML = "";
  for (const r of body.requests) {
    const o = document.createElement("option");
    o.value = r.id;
    o.textContent = `${r.id} (${lab.int(r.prompt_tokens)} tokens, ${r.num_chunks} chunks${r.finished ? "" : ", running"})`;
    select.append(o);
  }
  lab.text("kept-status", body.requests.length ? "" : "no compressed request recorded yet: send one with " +
    "kv_compression (or start the server with --kv-compression) and refresh");
  document.body.dataset.listed = String(body.requests.length);
  if (body.requests.some((r) => r.id === chosen)) select.value = chosen;
  if (select.value) await load(select.value);
}

lab.el("kept-map").addEventListener("mousemove", (e) => {
  const r = kept.record;
  if (!r) return;
  const rect = e.target.getBoundingClientRect();
  const x = Math.floor((e.clientX - rect.left) * e.target.width / rect.width);
  const line = Math.floor(Math.floor((e.clientY - rect.top) * e.target.height / rect.height) / ROW);
  const layer = Math.floor(line / r.kv_heads), head = line % r.kv_heads, k = keptAt(layer, head, x);
  const layerId = r.layer_ids.length ? r.layer_ids[layer] : layer;
  lab.text("kept-info", `layer ${layerId}, KV head ${head}, position ${lab.int(x)}: ` +
    (k === null ? "chunk from the prefix cache" : k ? "kept" : "dropped"));
});
lab.el("kept-request").addEventListener("input", () => {
  history.replaceState(null, "", location.pathname + "?request=" + encodeURIComponent(lab.el("kept-request").value));
  load(lab.el("kept-request").value);
});
lab.el("kept-refresh").addEventListener("click", list);
lab.loadInfo().catch(() => {});
list();
