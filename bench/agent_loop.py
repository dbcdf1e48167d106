"""W9: an agent loop over HTTP: a ~4,000-token tool manifest, a system prompt, 8 turns of call -> result -> call.

Each turn resends the whole history, as agent frameworks do (OpenAI chat completions with `tools`): the
system prompt, the manifest, every earlier assistant tool call and every tool result. The turn's call is
named (`tool_choice` a function, rotating through the manifest) so that a 135M model's choice does not
decide the loop's shape; the call's arguments are the model's, constrained by the tool's schema. Streamed,
greedy. Per turn: prompt tokens, cached tokens (usage.prompt_tokens_details.cached_tokens), TTFT as the
client sees it (first streamed delta).

Engines, one after another in one sitting, on the embedded SmolLM2 GGUF:
  kvserve            `kvserve serve` (prefix caching on)
  kvserve-no-cache   `kvserve serve --no-prefix-caching`
  llama-server       llama.cpp's `llama-server --jinja` on the same GGUF, when bench/llama_server.py finds the
                     binary. Its chat template handling drops the tools for this model's template (SmolLM2's
                     has no tool support: the prompt would lack the manifest), so it is sent each turn's exact
                     prompt tokens (kvserve's /tokenize of the same request) on its /completion endpoint with
                     its prompt cache on: the same loop, the same tokens; its own greedy answer follows

    .venv/bin/python bench/agent_loop.py [--turns 8] [--tools 17] [--engines kvserve kvserve-no-cache llama-server]
"""

from __future__ import annotations

import argparse
import json
import time

import httpx

from kvserve.cpu_features import describe_cpu
from kvserve.model.loader import embedded_model_path
from llama_server import LlamaServer, find_llama_server
from serve import start_server
from workloads import save

SYSTEM = ("You are a careful coding agent working in a repository. Think about which tool fits, call exactly one "
          "tool per turn, read its result, then continue until the task is done. Never invent file contents: "
          "read them. Keep edits minimal and explain nothing unless asked.")
TASK = "The test suite fails in tests/test_cache.py. Find out why and fix it."
MAX_TOKENS = 160  # a call with its arguments fits
AREAS = ["file", "directory", "git", "test", "package", "process", "http", "database", "log", "config",
         "issue", "branch", "symbol", "docs"]
VERBS = [("read", "Reads"), ("search", "Searches")]


def manifest(count: int) -> list[dict]:
    """`count` function tools, each with a description and a schema of the size real manifests carry."""
    tools = []
    for index in range(count):
        area = AREAS[index % len(AREAS)]
        verb, verb_text = VERBS[(index // len(AREAS)) % len(VERBS)]
        name = f"{verb}_{area}"
        tools.append({"type": "function", "function": {
            "name": name,
            "description": (f"{verb_text} the {area} named by `target` in the current workspace and returns what it "
                            f"finds as JSON. Use it before changing any {area}; results are truncated to `limit` "
                            f"entries, newest first. Fails with an error object when the {area} does not exist or "
                            f"the agent lacks permission, and never changes anything on disk."),
            "parameters": {"type": "object", "properties": {
                "target": {"type": "string", "maxLength": 24, "description": f"the {area}'s path or name"},
                "limit": {"type": "integer", "minimum": 1, "maximum": 100, "description": "most entries returned"},
                "mode": {"type": "string", "enum": ["summary", "full", "names"],
                         "description": "how much of each entry to return"},
                "recursive": {"type": "boolean", "description": f"whether nested {area} entries are included"},
            }, "required": ["target", "limit", "mode", "recursive"], "additionalProperties": False},
        }})
    return tools


def tool_result(turn: int, call: dict) -> str:
    """A deterministic result, the size a real tool returns (a few hundred characters)."""
    entries = [{"name": f"entry_{turn}_{i}", "size": 100 * i + turn, "status": "ok" if i % 3 else "stale"}
               for i in range(4)]
    return json.dumps({"tool": call["name"], "turn": turn, "entries": entries})


def stream_turn(http: httpx.Client, url: str, body: dict) -> dict:
    """One streamed chat completion: TTFT, the assembled tool call, usage."""
    started = time.perf_counter()
    ttft, call, usage = None, {"id": "", "name": "", "arguments": ""}, {}
    with http.stream("POST", url + "/chat/completions", json=body) as reply:
        if reply.status_code != 200:
            raise RuntimeError(f"HTTP {reply.status_code}: {reply.read()[:500]!r}")
        for line in reply.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            usage = chunk.get("usage") or usage
            for choice in chunk.get("choices") or []:
                delta = choice.get("delta") or {}
                if ttft is None and (delta.get("content") or delta.get("tool_calls")):
                    ttft = time.perf_counter() - started
                for fragment in delta.get("tool_calls") or []:
                    call["id"] = fragment.get("id") or call["id"]
                    function = fragment.get("function") or {}
                    call["name"] += function.get("name") or ""
                    call["arguments"] += function.get("arguments") or ""
    return {"ttft_s": ttft, "call": call, "usage": usage}


def run_loop(url: str, model: str | None, tools: list[dict], turns: int, prompts: list[list[int]]) -> list[dict]:
    """The loop through kvserve's chat completions; each turn's prompt tokens (/tokenize) go into `prompts`."""
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": TASK}]
    rows = []
    with httpx.Client(timeout=600) as http:
        for turn in range(1, turns + 1):
            name = tools[(turn * 5) % len(tools)]["function"]["name"]
            body = {"model": model, "messages": messages, "tools": tools, "temperature": 0, "max_tokens": MAX_TOKENS,
                    "tool_choice": {"type": "function", "function": {"name": name}}, "parallel_tool_calls": False,
                    "stream": True, "stream_options": {"include_usage": True}}
            prompts.append(http.post(url.removesuffix("/v1") + "/tokenize", json=body).json()["tokens"])
            done = stream_turn(http, url, body)
            call, usage = done["call"], done["usage"]
            prompt = usage.get("prompt_tokens", 0)
            cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
            rows.append({"turn": turn, "prompt_tokens": prompt, "cached_tokens": cached, "ttft_s": done["ttft_s"],
                         "call": call["name"]})
            report(rows[-1])
            call_id = call["id"] or f"call_{turn}"
            messages.append({"role": "assistant", "content": None, "tool_calls": [
                {"id": call_id, "type": "function", "function": {"name": call["name"], "arguments": call["arguments"]}}]})
            messages.append({"role": "tool", "tool_call_id": call_id, "content": tool_result(turn, call)})
    return rows


def report(row: dict) -> None:
    print(f"  turn {row['turn']}: prompt {row['prompt_tokens']:5d} tokens, cached {row['cached_tokens']:5d} "
          f"({row['cached_tokens'] / max(row['prompt_tokens'], 1):6.1%}), TTFT {(row['ttft_s'] or 0) * 1e3:8.1f} ms"
          + (f", called {row['call']}" if row.get("call") else ""), flush=True)


def replay_llama_server(prompts: list[list[int]]) -> list[dict] | None:
    """kvserve's prompts, turn by turn, through llama-server's /completion (prompt cache on)."""
    binary = find_llama_server()
    if binary is None:
        return None
    rows = []
    with LlamaServer(binary, embedded_model_path(), "--jinja", ctx=16384) as server:
        server.complete([1, 2, 3], 2)  # warm-up, then the loop's slot starts empty
        server.complete([4], 1, cache_prompt=False)
        for turn, prompt in enumerate(prompts, 1):
            done = server.complete(prompt, MAX_TOKENS)
            rows.append({"turn": turn, "prompt_tokens": len(prompt), "cached_tokens": done.cached_tokens,
                         "ttft_s": done.ttft_s})
            report(rows[-1])
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--tools", type=int, default=17, help="manifest size (17 tools ~ 4,000 tokens in the default block)")
    parser.add_argument("--engines", nargs="+", default=["kvserve", "kvserve-no-cache", "llama-server"])
    args = parser.parse_args()
    print(f"CPU: {describe_cpu()}", flush=True)
    tools = manifest(args.tools)
    results, prompts = {}, []
    for engine in [e for e in args.engines if e != "llama-server"]:
        print(f"{engine}:", flush=True)
        extra = ["--kv-cache-memory", "1GiB"] + (["--no-prefix-caching"] if engine == "kvserve-no-cache" else [])
        process, url = start_server(extra)
        try:
            turn_prompts: list[list[int]] = []
            results[engine] = run_loop(url, None, tools, args.turns, turn_prompts)
            prompts = prompts or turn_prompts
        finally:
            process.terminate()
            process.wait(timeout=30)
    if "llama-server" in args.engines and prompts:
        print("llama-server (kvserve's prompt tokens, turn by turn):", flush=True)
        rows = replay_llama_server(prompts)
        if rows is not None:
            results["llama-server"] = rows
    summarize(results)
    print(f"wrote {save('agent_loop', {'args': vars(args), 'results': results})}")


def summarize(results: dict[str, list[dict]]) -> None:
    for engine, rows in results.items():
        later = rows[1:]
        if not later:
            continue
        fraction = min(r["cached_tokens"] / max(r["prompt_tokens"], 1) for r in later)
        ttft = sum(r["ttft_s"] or 0.0 for r in later) / len(later)
        print(f"{engine:17s}: turn 1 TTFT {rows[0]['ttft_s'] * 1e3:8.1f} ms; turns 2-{len(rows)}: mean TTFT "
              f"{ttft * 1e3:8.1f} ms, least cached fraction {fraction:.1%}")
    if "kvserve" in results:
        base = sum(r["ttft_s"] or 0.0 for r in results["kvserve"][1:])
        for other in ("kvserve-no-cache", "llama-server"):
            if other in results and base:
                ratio = sum(r["ttft_s"] or 0.0 for r in results[other][1:]) / base
                print(f"turns 2+: {other} TTFT / kvserve TTFT = {ratio:.2f}x")


if __name__ == "__main__":
    main()
