// The prefix-cache explainer: recent requests' reports, or a pasted prompt looked up now.
"use strict";

let selected = null;

function span(text, cls) {
  const s = document.createElement("span");
  s.className = cls; s.textContent = text;
  return s;
}

function block(label, parts) {
  const wrap = document.createElement("div");
  const head = document.createElement("div");
  head.className = "muted"; head.style.margin = "8px 0 2px"; head.textContent = label;
  const body = document.createElement("div");
  body.className = "snippet"; body.append(...parts);
  wrap.append(head, body);
  return wrap;
}

function show(result, title) {
  lab.text("result-title", title);
  lab.text("explain-cached", lab.int(result.num_cached_tokens));
  lab.text("explain-total", lab.int(result.num_prompt_tokens));
  lab.el("explain-bar").style.width = (100 * result.num_cached_tokens / Math.max(result.num_prompt_tokens, 1)) + "%";
  lab.text("explain-reason", result.reason[0].toUpperCase() + result.reason.slice(1) + ".");
  const div = lab.el("explain-divergence"), prompt = lab.el("explain-prompt");
  div.replaceChildren(); prompt.replaceChildren();
  const d = result.divergence;
  if (d) {
    const lead = document.createElement("p");
    lead.textContent = `At token ${result.divergence_position}, this prompt goes on differently from the closest cached prompt` +
      (d.prompt === null ? "." : " (green: the text both share; then how each goes on):");
    div.append(lead);
    if (d.prompt !== null) div.append(block("this prompt", ["…", span(d.common, "hl-cached"), span(d.prompt, "hl-ours")]));
    if (d.cached !== null) div.append(block("cached prompt", ["…", span(d.common || "", "hl-cached"), span(d.cached, "hl-theirs")]));
  }
  if (result.prompt) {
    prompt.append(block("the whole prompt: green came from the cache, yellow matched a cached block but was computed (a block is shared only when all of it matches), grey is new",
      [span(result.prompt.cached, "hl-cached"), span(result.prompt.matched, "hl-matched"), span(result.prompt.rest, "hl-rest")]));
  }
  lab.text("explain-note", result.cached_text_shown ? "" :
    "Other requests' prompt text is shown only when the server runs with --log-prompts.");
  document.body.dataset.explained = String(result.num_cached_tokens);
}

async function explain(body, title) {
  try {
    show(await lab.fetchJSON("/lab/api/explain", { method: "POST", headers: { "Content-Type": "application/json" },
                                                   body: JSON.stringify(body) }), title);
  } catch (error) {
    lab.text("explain-reason", error.message);
  }
  // The answer is below the recent requests: bring it into view, or a click seems to do nothing.
  lab.el("result-panel").scrollIntoView({ block: "start" });
}

async function refresh() {
  let data;
  try { data = await lab.fetchJSON("/lab/api/recent"); } catch (error) { return; }
  const rows = data.requests.map((r) => {
    const tr = document.createElement("tr");
    tr.className = "clickable" + (r.id === selected ? " selected" : "");
    tr.dataset.request = r.id;
    const hit = r.prompt_tokens ? r.cached_tokens / r.prompt_tokens : 0;
    const name = r.compaction_pass ? r.id + " (compaction pass)" : r.id;
    for (const [value, cls] of [[name, "text"], [lab.int(r.prompt_tokens)], [lab.int(r.cached_tokens)], [lab.pct(hit)],
                                [lab.int(r.kv_tokens)], [r.reason, "text"]]) {
      const td = document.createElement("td");
      td.textContent = value; if (cls) td.className = cls;
      tr.append(td);
    }
    tr.addEventListener("click", () => { selected = r.id; explain({ request_id: r.id }, "Request " + r.id); refresh(); });
    return tr;
  });
  lab.el("recent").tBodies[0].replaceChildren(...rows);
  lab.el("no-recent").style.display = rows.length ? "none" : "";
}

lab.el("explain").addEventListener("click", () => {
  const body = { prompt: lab.el("prompt").value };
  if (lab.el("tenant-row").style.display !== "none") body.tenant = Number(lab.el("tenant").value);
  selected = null;
  document.querySelectorAll("#recent tr.selected").forEach((tr) => tr.classList.remove("selected"));
  explain(body, "The pasted prompt, against the cache as it is now");
});

lab.loadInfo().then((info) => {
  if (info.num_tenants) {
    lab.el("tenant-row").style.display = "";
    for (let i = 1; i <= info.num_tenants; i++) {
      const o = document.createElement("option"); o.value = i; o.textContent = "tenant " + i; lab.el("tenant").append(o);
    }
  }
}).catch(() => {});
refresh();
setInterval(refresh, 2000);
