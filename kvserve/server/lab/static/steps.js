// Cached vs recomputed: stream both runs' steps from /lab/api/steps and draw them as they come.
"use strict";

const runs = { cached: [], recompute: [] };
let run = null;

function row(step) {
  let tr = document.querySelector(`#steps-table tr[data-step="${step}"]`);
  if (!tr) {
    tr = document.createElement("tr");
    tr.dataset.step = step;
    for (const name of ["step", "token", "cached-tokens", "cached-reused", "cached-ms", "recompute-tokens", "recompute-reused", "recompute-ms"]) {
      const td = document.createElement("td");
      td.dataset.col = name;
      if (name === "token") td.className = "text";
      tr.append(td);
    }
    tr.querySelector('[data-col="step"]').textContent = step;
    lab.el("steps-table").tBodies[0].append(tr);
  }
  return tr;
}

function cumulative(values) { let sum = 0; return values.map((v) => (sum += v)); }

function draw() {
  const c = runs.cached, r = runs.recompute, n = Math.max(run ? run.max_tokens : 2, 2);
  const series = (list, key, color) => ({ values: list.map((s) => s[key]), color });
  const axes = { floor: 1, points: n, xLabel: `generation step (0 – ${n - 1})` };
  lab.lineChart(lab.el("chart-step-tokens"), [series(c, "tokens", "#2563eb"), series(r, "tokens", "#c2410c")], { ...axes, unit: " tok" });
  lab.lineChart(lab.el("chart-cumulative"), [{ values: cumulative(c.map((s) => s.tokens)), color: "#2563eb" },
                                              { values: cumulative(r.map((s) => s.tokens)), color: "#c2410c" }], { ...axes, unit: " tok" });
  lab.lineChart(lab.el("chart-ms"), [series(c, "ms", "#2563eb"), series(r, "ms", "#c2410c")], { ...axes, unit: " ms" });
}

function summary() {
  const total = (list, key) => list.reduce((a, s) => a + s[key], 0);
  const ct = total(runs.cached, "tokens"), rt = total(runs.recompute, "tokens");
  const cms = total(runs.cached, "ms"), rms = total(runs.recompute, "ms");
  lab.el("summary").innerHTML = `<h2>Totals</h2><table>
    <tr><th></th><th class="mode-cache">cached</th><th class="mode-recompute">recomputed</th><th>ratio</th></tr>
    <tr><td>tokens computed</td><td id="total-cached-tokens"></td><td id="total-recompute-tokens"></td><td id="ratio-tokens"></td></tr>
    <tr><td>time</td><td id="total-cached-ms"></td><td id="total-recompute-ms"></td><td id="ratio-ms"></td></tr></table>
    <p id="same-output" class="muted"></p>`;
  lab.text("total-cached-tokens", lab.int(ct)); lab.text("total-recompute-tokens", lab.int(rt));
  lab.text("ratio-tokens", ct ? (rt / ct).toFixed(1) + "×" : "–");
  lab.text("total-cached-ms", cms.toFixed(0) + " ms"); lab.text("total-recompute-ms", rms.toFixed(0) + " ms");
  lab.text("ratio-ms", cms ? (rms / cms).toFixed(1) + "×" : "–");
}

function onEvent(e) {
  if (e.event === "start") {
    run = e;
    lab.text("steps-status", `running: prompt of ${e.prompt_tokens} tokens, ${e.max_tokens} new tokens…`);
  } else if (e.event === "step") {
    runs[e.mode].push(e);
    const tr = row(e.step);
    tr.querySelector(`[data-col="${e.mode}-tokens"]`).textContent = lab.int(e.tokens);
    tr.querySelector(`[data-col="${e.mode}-reused"]`).textContent = lab.int(e.reused);
    tr.querySelector(`[data-col="${e.mode}-ms"]`).textContent = e.ms.toFixed(1) + " ms";
    if (e.mode === "cached") tr.querySelector('[data-col="token"]').textContent = JSON.stringify(e.text);
    draw(); summary();
  } else if (e.event === "done") {
    lab.text("steps-status", "done");
    lab.text("same-output", e.same_output ? "Both runs generated the same tokens." :
      "The runs' tokens differ (different kernels for 1 row and for many rows can round differently).");
    document.body.dataset.done = "1";
  } else if (e.event === "error") {
    lab.text("steps-status", "failed: " + e.message);
    document.body.dataset.done = "error";
  }
}

lab.el("examples").addEventListener("input", () => (lab.el("prompt").value = lab.el("examples").value));
lab.el("max-tokens").addEventListener("input", () => lab.text("max-tokens-label", lab.el("max-tokens").value));
lab.text("max-tokens-label", lab.el("max-tokens").value);

lab.el("run").addEventListener("click", async () => {
  const button = lab.el("run");
  button.disabled = true;
  runs.cached = []; runs.recompute = []; run = null;
  delete document.body.dataset.done;
  lab.el("steps-table").tBodies[0].replaceChildren();
  lab.el("summary").replaceChildren();
  lab.text("steps-status", "starting…");
  try {
    await lab.stream("/lab/api/steps", {
      method: "POST", headers: { "Content-Type": "application/json" },
      body: JSON.stringify({ prompt: lab.el("prompt").value, max_tokens: Number(lab.el("max-tokens").value) }),
    }, onEvent);
  } catch (error) {
    lab.text("steps-status", "failed: " + error.message);
    document.body.dataset.done = "error";
  } finally {
    button.disabled = false;
  }
});

lab.loadInfo().then((info) => {
  lab.el("max-tokens").max = info.steps.max_new_tokens;
}).catch(() => {});
