"""The summary buffer: a 30-turn chat on a 1,500-token system prompt, three ways, in one run.

- compaction: /v1/responses with previous_response_id and `context_management: [{"type": "compaction",
  "compact_threshold": 3000}]`: past 3,000 input tokens the server has the model summarize the history and
  answers from instructions + summary + the new turn; later turns continue from that (a cached prefix);
- verbatim: the same chain without compaction: every turn continues the whole history token-exactly;
- truncation: the same chain with `truncation: "auto"` on an engine whose context is the threshold
  (3,000 tokens + the answer): the oldest turns are dropped (the rolling window).

Per turn: prompt tokens, prompt tokens computed (prompt - cached; a compaction turn adds its pass's), TTFT
(the engine's, arrival to first token; a compaction turn adds its pass's whole time, which the client waits
for), the KV the session holds after the turn (its prompt + answer: what the next turn reuses), in tokens
and MiB. A fact is planted in turn 2 and asked for in the last turn: each way's answer is checked for it
(--trials N plants N different facts, one whole run each; the rate is over trials, for this small model).

The app runs in process (Starlette's TestClient) on the embedded SmolLM2-135M; greedy answers of exactly
--output-len tokens (EOS ignored, as bench/sessions.py: the three ways see the same lengths, and the chat
grows past the threshold; the summary itself stops at EOS).

    .venv/bin/python bench/compaction.py [--turns 30 --system-tokens 1500 --threshold 3000 --trials 1]
"""

from __future__ import annotations

import argparse
import time

from fastapi.testclient import TestClient

from kvserve.config import EngineConfig
from kvserve.cpu_features import describe_cpu
from kvserve.engine.engine import Engine
from kvserve.kv.cache.kv_spec import kv_bytes_per_token
from kvserve.model.loader import load_model
from kvserve.server.app import create_app
from kvserve.server.core.serving import ServerSettings
from sessions import WORDS, system_prompt
from workloads import save

FACTS = [("my locker code", "4719"), ("my sister's name", "Ingrid"), ("the meeting room", "B12"),
         ("my flight number", "LX318"), ("the wifi password", "heron77")]
MODES = ("compaction", "verbatim", "truncation")


def question(turn: int, trial: int, turns: int) -> str:
    subject, value = FACTS[trial % len(FACTS)]
    if turn == 2:
        return f"Please remember this: {subject} is {value}. Just say OK."
    if turn == turns:
        return f"What is {subject}? Answer with the value only."
    return f"Question {turn}: in one sentence, what does rule {turn * 3} say about the {WORDS[turn % len(WORDS)]}?"


def run(client: TestClient, finished: dict, mode: str, system: str, args, trial: int) -> list[dict]:
    rows, previous = [], None
    common = {"model": "SmolLM2-135M-Instruct", "temperature": 0, "instructions": system,
              "max_output_tokens": args.output_len, "ignore_eos": True}
    if mode == "compaction":
        common["context_management"] = [{"type": "compaction", "compact_threshold": args.threshold}]
    if mode == "truncation":
        common["truncation"] = "auto"
    for turn in range(1, args.turns + 1):
        seen = set(finished)
        start = time.perf_counter()
        response = client.post("/v1/responses", json={**common, "input": question(turn, trial, args.turns),
                                                      "previous_response_id": previous})
        assert response.status_code == 200, response.text
        body = response.json()
        e2e = time.perf_counter() - start
        previous = body["id"]
        passes = [finished[rid] for rid in set(finished) - seen if rid.startswith("cmp_")]
        answer = finished[body["id"] + "-0"]
        usage = body["usage"]
        compacted = any(item["type"] == "compaction" for item in body["output"])
        pass_prompt = sum(p.metrics.num_prompt_tokens for p in passes)
        text = "".join(part["text"] for item in body["output"] if item["type"] == "message"
                       for part in item["content"])
        rows.append({
            "turn": turn, "compacted": compacted,
            "prompt_tokens": usage["input_tokens"] - pass_prompt,
            "computed_tokens": usage["input_tokens"] - usage["input_tokens_details"]["cached_tokens"],
            "ttft_s": answer.metrics.ttft + sum(p.metrics.last_token_time - p.metrics.arrival_time for p in passes),
            "e2e_s": e2e, "held_tokens": answer.metrics.num_prompt_tokens + answer.metrics.num_output_tokens,
            "answer": text})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--turns", type=int, default=30)
    parser.add_argument("--system-tokens", type=int, default=1500)
    parser.add_argument("--threshold", type=int, default=3000)
    parser.add_argument("--output-len", type=int, default=48)
    parser.add_argument("--trials", type=int, default=1)
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    args = parser.parse_args()

    loaded = load_model()
    system = system_prompt(loaded.tokenizer, args.system_tokens)
    mib_per_token = kv_bytes_per_token(loaded.config, "float16") / 2**20
    results: dict[str, list[list[dict]]] = {mode: [] for mode in args.modes}
    for trial in range(args.trials):
        for mode in args.modes:
            context = args.threshold + args.output_len if mode == "truncation" else None
            engine = Engine(EngineConfig(kv_cache_memory="1GiB", max_model_len=context), loaded=loaded)
            app = create_app(engine, ServerSettings(model_name="SmolLM2-135M-Instruct"))
            finished: dict = {}

            def record(delta, finished=finished) -> None:
                if delta.finished:
                    finished[delta.request_id] = delta

            app.state.async_engine.observers.append(record)
            with TestClient(app) as client:
                results[mode].append(run(client, finished, mode, system, args, trial))
            print(f"trial {trial + 1}, {mode}: done", flush=True)

    print(f"\n{describe_cpu()}; {args.turns} turns, {args.system_tokens}-token instructions, threshold "
          f"{args.threshold}, answers of {args.output_len} tokens (trial 1)")
    print("per turn: computed / prompt tokens, TTFT ms, KV held after the turn (tokens); * = compacted")
    print(f"{'turn':>4} | " + " | ".join(f"{m:>30}" for m in args.modes))
    for turn in range(args.turns):
        cells = []
        for mode in args.modes:
            row = results[mode][0][turn]
            cells.append(f"{'*' if row['compacted'] else ' '}{row['computed_tokens']:5d}/{row['prompt_tokens']:5d} "
                         f"{row['ttft_s'] * 1000:7.0f} {row['held_tokens']:6d}")
        print(f"{turn + 1:>4} | " + " | ".join(f"{c:>30}" for c in cells))
    for mode in args.modes:
        rows = results[mode][0]
        computed = sum(r["computed_tokens"] for r in rows)
        ttft = sorted(r["ttft_s"] for r in rows)[len(rows) // 2]
        held = max(r["held_tokens"] for r in rows)
        value = [FACTS[t % len(FACTS)][1] for t in range(args.trials)]
        recalled = sum(value[t].lower() in results[mode][t][-1]["answer"].lower() for t in range(args.trials))
        print(f"{mode}: {computed} prompt tokens computed in all, median TTFT {ttft * 1000:.0f} ms, "
              f"most KV held {held} tokens ({held * mib_per_token:.1f} MiB), compactions "
              f"{sum(r['compacted'] for r in rows)}; fact from turn 2 recalled in turn {args.turns}: "
              f"{recalled}/{args.trials} ({[results[mode][t][-1]['answer'][:60] for t in range(args.trials)]})")
    print(f"wrote {save('compaction', {'args': vars(args), 'cpu': describe_cpu(), 'results': results})}")


if __name__ == "__main__":
    main()
