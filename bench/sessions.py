"""W6 chat session: 10 turns on a 1,500-token system prompt, TTFT per turn, three ways in one run.

- responses: /v1/responses with previous_response_id (token-exact continuation), prefix caching on;
- chat, cache on: /v1/chat/completions resending the whole history each turn, prefix caching on;
- chat, cache off: the same with prefix caching off (every turn prefills everything).

The app runs in process (Starlette's TestClient, no port) on the embedded SmolLM2; TTFT is the
engine's own (arrival to first token), read from the server's request observer. Greedy, EOS
ignored, so every answer has exactly --output-len tokens and the three ways see the same lengths.

    .venv/bin/python bench/sessions.py [--turns 10 --system-tokens 1500 --output-len 16]
"""

from __future__ import annotations

import argparse
import time

from fastapi.testclient import TestClient

from kvserve.config import EngineConfig
from kvserve.engine.engine import Engine
from kvserve.model.loader import load_model
from kvserve.server.app import create_app
from kvserve.server.core.serving import ServerSettings
from workloads import save

WORDS = ("cache block prefix token layer head value key pool page hash chain turn session pin expire "
         "window batch step decode prefill tenant salt").split()


def system_prompt(tokenizer, num_tokens: int) -> str:
    """Deterministic prose of about `num_tokens` tokens."""
    words, i = [], 0
    while len(tokenizer.encode(" ".join(words))) < num_tokens:
        words += [f"Rule {i}:", WORDS[i % len(WORDS)], WORDS[(i * 7) % len(WORDS)], "stays", "exact."]
        i += 1
    return " ".join(words)


def run(client: TestClient, ttfts: dict, mode: str, system: str, turns: int, output_len: int) -> list[dict]:
    rows, history, previous = [], [{"role": "system", "content": system}], None
    common = {"model": "SmolLM2-135M-Instruct", "temperature": 0, "ignore_eos": True}
    for turn in range(turns):
        question = f"Question {turn + 1}: what does rule {turn * 3} say about the {WORDS[turn]}?"
        start = time.perf_counter()
        if mode == "responses":
            body = client.post("/v1/responses", json={**common, "instructions": system, "input": question,
                                                      "max_output_tokens": output_len,
                                                      "previous_response_id": previous}).json()
            previous = body["id"]
            request_id = body["id"] + "-0"
            prompt, cached = body["usage"]["input_tokens"], body["usage"]["input_tokens_details"]["cached_tokens"]
        else:
            history.append({"role": "user", "content": question})
            body = client.post("/v1/chat/completions", json={**common, "messages": history,
                                                             "max_tokens": output_len}).json()
            history.append({"role": "assistant", "content": body["choices"][0]["message"]["content"]})
            request_id = body["id"] + "-0"
            prompt, cached = body["usage"]["prompt_tokens"], body["usage"]["prompt_tokens_details"]["cached_tokens"]
        rows.append({"turn": turn + 1, "prompt_tokens": prompt, "cached_tokens": cached,
                     "ttft_s": ttfts[request_id], "e2e_s": time.perf_counter() - start})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--system-tokens", type=int, default=1500)
    parser.add_argument("--output-len", type=int, default=16)
    args = parser.parse_args()

    loaded = load_model()
    system = system_prompt(loaded.tokenizer, args.system_tokens)
    results = {}
    for mode, caching in (("responses", True), ("chat, cache on", True), ("chat, cache off", False)):
        engine = Engine(EngineConfig(kv_cache_memory="1GiB", enable_prefix_caching=caching), loaded=loaded)
        app = create_app(engine, ServerSettings(model_name="SmolLM2-135M-Instruct"))
        ttfts: dict[str, float] = {}

        def record(delta, ttfts=ttfts) -> None:
            if delta.finished and delta.metrics.ttft is not None:
                ttfts[delta.request_id] = delta.metrics.ttft

        app.state.async_engine.observers.append(record)
        with TestClient(app) as client:
            results[mode] = run(client, ttfts, mode, system, args.turns, args.output_len)
        print(f"{mode}: done", flush=True)

    modes = list(results)
    print(f"\nTTFT per turn (ms), {args.system_tokens}-token system prompt, {args.output_len}-token answers; "
          f"prompt / cached tokens in brackets")
    print(f"{'turn':>4} | " + " | ".join(f"{m:>28}" for m in modes))
    for turn in range(args.turns):
        cells = [f"{results[m][turn]['ttft_s'] * 1000:8.0f} ({results[m][turn]['prompt_tokens']:5d}/"
                 f"{results[m][turn]['cached_tokens']:5d})" for m in modes]
        print(f"{turn + 1:>4} | " + " | ".join(f"{c:>28}" for c in cells))
    for m in modes:
        later = [r["ttft_s"] for r in results[m][1:]]
        print(f"{m}: mean TTFT of turns 2-{args.turns} {sum(later) / len(later) * 1000:.0f} ms")
    print(f"wrote {save('sessions', {'workload': 'W6', 'args': vars(args), 'results': results})}")


if __name__ == "__main__":
    main()
