// The memory calculator: controls <-> URL, figures from /lab/api/memory (the planner behind `kvserve memory`).
"use strict";

const FIELDS = ["model", "context", "batch", "kv_dtype", "weights_dtype", "memory", "overhead", "block_size",
                "layers", "kv_heads", "head_dim", "heads", "params", "kv_compression", "max_tokens"];
// Controls read and set as they are (the sliders and custom fields have their own handling).
const PLAIN = ["model", "context", "batch", "kv_dtype", "weights_dtype", "memory", "block_size", "kv_compression",
               "max_tokens"];
const CUSTOM_FIELDS = ["layers", "kv_heads", "head_dim", "heads", "params"];
// The model is the served one (the catalog names it) unless the URL says otherwise.
const DEFAULTS = { model: null, batch: "1", kv_dtype: "float16", weights_dtype: "float16", memory: "80GiB",
                   overhead: "0.1", block_size: "16", kv_compression: "none", max_tokens: "0" };
let catalog = null;
let pending = 0;

function option(select, value, label) {
  const o = document.createElement("option");
  o.value = value; o.textContent = label || value;
  select.append(o);
}

function ensureOption(select, value) {
  if (value && ![...select.options].some((o) => o.value === value)) option(select, value);
}

function modelShape(name) { return catalog.models.find((m) => m.name === name); }

function readURL() {
  const params = new URLSearchParams(location.search);
  const values = Object.assign({}, DEFAULTS);
  for (const f of FIELDS) if (params.has(f)) values[f] = params.get(f);
  if (!values.context) values.context = String((modelShape(values.model) || {}).context || 8192);
  return values;
}

function setControls(v) {
  ensureOption(lab.el("memory"), v.memory);
  ensureOption(lab.el("kv_dtype"), v.kv_dtype);
  ensureOption(lab.el("kv_compression"), v.kv_compression);
  for (const f of PLAIN) lab.el(f).value = v[f];
  if (v.model === "custom") for (const f of CUSTOM_FIELDS) if (v[f]) lab.el(f).value = v[f];
  lab.el("context-slider").value = Math.round(Math.log2(Number(v.context)));
  lab.el("batch-slider").value = v.batch;
  lab.el("overhead-slider").value = Math.round(100 * Number(v.overhead));
}

function controls() {
  const v = {};
  for (const f of PLAIN) v[f] = lab.el(f).value;
  v.overhead = String(Number(lab.el("overhead-slider").value) / 100);
  if (v.model === "custom") {
    for (const f of CUSTOM_FIELDS) v[f] = lab.el(f).value;
    if (v.params) v.params = String(Number(v.params) * 1e9);
  }
  return v;
}

// The URL holds every setting that differs from the defaults (and always the model and context).
function writeURL(v) {
  const params = new URLSearchParams();
  for (const f of FIELDS) {
    if (v[f] === undefined || v[f] === "") continue;
    if (f !== "model" && f !== "context" && DEFAULTS[f] === v[f]) continue;
    params.set(f, f === "params" ? String(Number(v[f])) : v[f]);
  }
  if (v.memory === "") params.set("memory", "");
  history.replaceState(null, "", location.pathname + "?" + params.toString());
}

async function update() {
  const v = controls();
  lab.el("custom").style.display = v.model === "custom" ? "" : "none";
  lab.text("context-label", lab.int(v.context));
  lab.text("batch-label", lab.int(v.batch));
  lab.text("overhead-label", lab.el("overhead-slider").value + "%");
  writeURL(v);
  const query = new URLSearchParams();
  for (const [k, value] of Object.entries(v)) if (value !== "" && value !== undefined) query.set(k, value);
  const ticket = ++pending;
  let result;
  try {
    result = await lab.fetchJSON("/lab/api/memory?" + query.toString());
  } catch (error) {
    if (ticket === pending) { lab.text("error", error.message); document.body.dataset.ready = "error"; }
    return;
  }
  if (ticket !== pending) return; // a newer query is on its way
  lab.text("error", "");
  show(result.plan, result.display);
  document.body.dataset.ready = query.toString();
}

function show(p, d) {
  lab.text("formula", p.formula);
  lab.text("context-text", lab.int(p.context));
  lab.text("batch-text", lab.int(p.batch));
  document.querySelectorAll(".context-text2").forEach((e) => (e.textContent = lab.int(p.context)));
  document.querySelectorAll(".batch-text2").forEach((e) => (e.textContent = lab.int(p.batch)));
  lab.text("kv-per-request", d.kv_bytes_per_request);
  lab.text("kv-per-request-bytes", lab.int(p.kv_bytes_per_request) + " bytes");
  // Gemma 4-style models: what the shared layers and K = V save, beside the same model without them.
  lab.el("kv-unshared").style.display = p.kv_bytes_per_request_unshared ? "" : "none";
  lab.text("kv-unshared-size", d.kv_bytes_per_request_unshared);
  lab.text("kv-total", d.kv_bytes_total);
  lab.text("kv-total-bytes", lab.int(p.kv_bytes_total) + " bytes");
  lab.text("weights", d.weights_bytes);
  lab.text("weights-dtype-text", p.weights_dtype);
  lab.text("params-text", (p.num_parameters / 1e9).toFixed(2) + "B");
  lab.text("overhead", `${d.overhead_bytes} (${Math.round(100 * p.overhead_fraction)}%)`);
  lab.text("total", d.total_bytes);
  lab.text("total-bytes", lab.int(p.total_bytes) + " bytes");
  lab.text("attention", `${p.attention}, context up to ${lab.int(p.model_max_context)}`);
  const scale = Math.max(p.total_bytes, p.memory_bytes || 0);
  lab.el("bar-weights").style.width = (100 * p.weights_bytes / scale) + "%";
  lab.el("bar-kv").style.width = (100 * p.kv_bytes_total / scale) + "%";
  lab.el("bar-overhead").style.width = (100 * p.overhead_bytes / scale) + "%";
  showStates(p, d, scale);
  showCompression(p, d);
  const hasMemory = p.memory_bytes !== null;
  lab.el("device-line").style.display = lab.el("device-label").style.display = hasMemory ? "" : "none";
  lab.el("fit-facts").style.display = hasMemory ? "" : "none";
  lab.el("no-memory").style.display = hasMemory ? "none" : "";
  const fits = lab.el("fits");
  if (hasMemory) {
    const share = 100 * p.memory_bytes / scale, at = share + "%";
    lab.el("device-line").style.left = at; lab.el("device-label").style.left = at;
    lab.el("device-label").style.transform = share > 85 ? "translateX(-100%)" : "translateX(-50%)";
    lab.text("device-label", "device " + d.memory_bytes);
    lab.text("memory-text", d.memory_bytes);
    lab.text("max-requests", lab.int(p.max_concurrent_requests));
    lab.text("max-context", lab.int(p.max_context_for_batch));
    lab.text("kv-room", d.kv_room_bytes);
    fits.textContent = p.total_bytes <= p.memory_bytes ? "· fits" : "· does not fit";
    fits.className = p.total_bytes <= p.memory_bytes ? "ok" : "bad";
  } else fits.textContent = "";
}

// A hybrid model's second cache kind: K/V per token for its attention layers, a state per request for the rest.
function showStates(p, d, scale) {
  const hybrid = p.recurrent_layers > 0;
  lab.el("hybrid-kinds").style.display = lab.el("state-legend").style.display = hybrid ? "" : "none";
  lab.el("bar-state").style.width = hybrid ? (100 * p.state_bytes_total / scale) + "%" : "0";
  lab.text("total-parts", hybrid ? "Weights + KV + recurrent states + overhead" : "Weights + KV + overhead");
  lab.text("room-label", hybrid ? "room for KV and recurrent states after weights and overhead"
    : "room for KV after weights and overhead");
  lab.text("formula-title", hybrid ? "Bytes per token of KV, bytes per request of recurrent state" : "Bytes per token of KV");
  if (!hybrid) return;
  lab.text("attention-layers", p.attention_layers);
  lab.text("recurrent-layers", p.recurrent_layers);
  lab.text("kv-per-token", lab.int(p.bytes_per_token));
  lab.text("state-per-request", lab.int(p.state_bytes_per_request));
  lab.text("state-formula", p.state_formula);
  lab.text("state-total", d.state_bytes_total);
  lab.text("state-total-bytes", lab.int(p.state_bytes_total) + " bytes");
  lab.text("per-request", d.bytes_per_request);
  lab.text("per-request-bytes", lab.int(p.bytes_per_request) + " bytes");
}

// KV compression (--kv-compression): the same request with its prompt's chunks compressed, beside the plain one.
function showCompression(p, d) {
  const on = Boolean(p.kv_compression);
  lab.el("compressed").style.display = on ? "" : "none";
  if (!on) return;
  lab.text("compressed-spec", p.kv_compression);
  lab.text("compressed-prompt", lab.int(p.context - p.max_new_tokens));
  lab.text("compressed-generated", lab.int(p.max_new_tokens));
  lab.text("compressed-chunks", lab.int(p.compressed_chunks_per_request));
  lab.text("compressed-dropped", lab.int(p.dropped_tokens_per_request));
  lab.text("compressed-per-request", d.kv_bytes_per_request_compressed);
  lab.text("compressed-per-request-bytes", lab.int(p.kv_bytes_per_request_compressed) + " bytes");
  lab.text("compressed-total", d.kv_bytes_total_compressed);
  const fit = p.max_concurrent_requests_compressed !== null;
  lab.el("compressed-fit").style.display = fit ? "" : "none";
  if (!fit) return;
  lab.text("compressed-max-requests", lab.int(p.max_concurrent_requests_compressed));
  lab.text("compressed-max-context", lab.int(p.max_context_compressed));
}

function syncFromSlider(slider, input, transform) {
  lab.el(slider).addEventListener("input", () => { lab.el(input).value = transform(lab.el(slider).value); update(); });
  lab.el(input).addEventListener("input", () => update());
}

(async () => {
  try {
    lab.loadInfo().catch(() => {});
    catalog = await lab.fetchJSON("/lab/api/models");
  } catch (error) { lab.text("error", error.message); return; }
  DEFAULTS.model = catalog.served;
  for (const m of catalog.models) {
    option(lab.el("model"), m.name, `${m.name}${m.name === catalog.served ? ", served" : ""} ` +
      `(${m.attention}, ${m.layers} layers${m.recurrent_layers ? `: ${m.attention_layers} attention, ` +
        `${m.recurrent_layers} recurrent` : ""}, ${m.kv_heads} KV heads)`);
  }
  option(lab.el("model"), "custom", "Custom shape…");
  for (const d of catalog.kv_dtypes) option(lab.el("kv_dtype"), d);
  for (const d of catalog.weights_dtypes) option(lab.el("weights_dtype"), d);
  for (const c of catalog.kv_compressions) option(lab.el("kv_compression"), c);
  setControls(readURL());
  syncFromSlider("context-slider", "context", (x) => String(2 ** Number(x)));
  syncFromSlider("batch-slider", "batch", (x) => x);
  lab.el("batch").addEventListener("input", () => (lab.el("batch-slider").value = lab.el("batch").value));
  lab.el("context").addEventListener("input", () => (lab.el("context-slider").value = Math.round(Math.log2(Number(lab.el("context").value)))));
  lab.el("overhead-slider").addEventListener("input", update);
  for (const f of ["kv_dtype", "weights_dtype", "memory", "block_size", "kv_compression", "max_tokens",
                   ...CUSTOM_FIELDS]) lab.el(f).addEventListener("input", update);
  lab.el("model").addEventListener("input", () => {
    const shape = modelShape(lab.el("model").value);
    if (shape) lab.el("context").value = shape.context; // a preset starts at its own context
    lab.el("context-slider").value = Math.round(Math.log2(Number(lab.el("context").value)));
    update();
  });
  update();
})();
