"""W8: speculative decoding on copy-heavy work, drafting on vs off, in one process, one sitting.

Workloads (chat prompts to the embedded SmolLM2-135M-Instruct, greedy):
  code   edit a ~600-token code file (the output mostly repeats the input)
  quote  answer with quotes from a ~1,000-token document
  json   repeat a previous JSON tool call with one field changed (4 in a row: the later ones can draft
         from the earlier outputs through the suffix index)
  prose  a short story (W2's kind of output: prose that repeats little), and W2 itself (512 random tokens)
Each is run with --speculative off and with the method under test (auto by default), interleaved, best
of `--rounds`; TPOT per request and the draft acceptance are printed. W1 (32 x 256 prompt, 128 output)
throughput too, on and off.

    .venv/bin/python bench/spec_decode.py [--method auto] [--rounds 2] [--skip-w1]
    .venv/bin/python bench/spec_decode.py cost       # the marginal cost of a verified token, by batch size

llama.cpp's llama-server is run on the same GGUF and the same prompt tokens, without drafting and with
each of its draftless --spec-type ngram-* types, when bench/llama_server.py finds the binary; otherwise
the script says so and skips it.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from kvserve.config import EngineConfig
from kvserve.cpu_features import describe_cpu
from kvserve.engine.spec_decode.drafting import Drafting
from kvserve.engine.engine import Engine
from kvserve.engine.output.types import RequestOutputAssembler
from kvserve.engine.spec_decode.policy import DraftPolicy
from kvserve.model.loader import embedded_model_path, load_model
from llama_server import LlamaServer, find_llama_server
from workloads import freeze_setup, greedy, random_prompts, run_engine, save

ROOT = Path(__file__).resolve().parent.parent
# llama-server's draftless speculative types (this build's names), and no drafting.
LLAMA_SPEC_TYPES = ("off", "ngram-simple", "ngram-map-k", "ngram-mod")


def first_tokens(tokenizer, text: str, count: int) -> str:
    return tokenizer.decode(tokenizer.encode(text)[:count])


def chat(tokenizer, *messages: tuple[str, str]) -> list[int]:
    return tokenizer.encode_chat([{"role": role, "content": content} for role, content in messages])


def w8_prompts(tokenizer) -> dict[str, tuple[list[list[int]], int]]:
    """name -> (prompts, max_tokens)."""
    code = first_tokens(tokenizer, (ROOT / "kvserve/engine/scheduler.py").read_text(), 600)
    document = first_tokens(tokenizer, (ROOT / "README.md").read_text(), 1000)
    call = ('{"name": "get_weather", "arguments": {"city": "Berlin", "unit": "celsius", "days": 3, '
            '"include": ["temperature", "wind", "humidity"], "language": "en"}}')
    cities = ["Paris", "Madrid", "Rome", "Vienna"]
    return {
        "code": ([chat(tokenizer, ("user", f"Here is a file:\n\n{code}\n\nRewrite the whole file with the class "
                                           f"`Scheduler` renamed to `BatchScheduler`. Output only the file."))], 700),
        "quote": ([chat(tokenizer, ("user", f"{document}\n\nQuote, word for word, the first three paragraphs of "
                                            f"the document above."))], 300),
        "json": ([chat(tokenizer, ("user", "What is the weather in Berlin?"), ("assistant", call),
                       ("user", f"Now the same call for {city}. Answer with the JSON call only."))
                  for city in cities], 80),
        "prose": ([chat(tokenizer, ("user", "Write a short story about a lighthouse keeper who finds a "
                                            "message in a bottle."))], 128),
        "W2": (random_prompts(1, 512, seed=512), 128),
    }


def run_workload(engine: Engine, prompts: list[list[int]], max_tokens: int, tenant: str) -> dict:
    """The prompts one after another (a session of one tenant): TPOT per request, draft acceptance over all.
    Each round is a new tenant, so the suffix index never drafts a round from an earlier round's outputs."""
    tpots, drafted, accepted, outputs = [], 0, 0, 0
    for prompt in prompts:
        request_id = engine.add_request(prompt, greedy(max_tokens), cache_salt=tenant)
        assembler, output = RequestOutputAssembler(), None
        while engine.has_unfinished():
            for delta in engine.step():
                output = assembler.add(delta) or output
        if output is None or output.request_id != request_id:
            raise RuntimeError("the workload's request did not finish")
        tpots.append(output.metrics.tpot)
        drafted += output.metrics.num_draft_tokens
        accepted += output.metrics.num_accepted_draft_tokens
        outputs += len(output.outputs[0].token_ids)
    return {"tpot_s": statistics.mean(tpots), "draft_tokens": drafted, "accepted_tokens": accepted,
            "output_tokens": outputs}


def w1_throughput(engine: Engine) -> float:
    outputs, stats = run_engine(engine, random_prompts(32, 256), greedy(128))
    return sum(len(o.outputs[0].token_ids) for o in outputs) / stats["wall_s"]


class _RepeatLast:
    """Drafts k copies of the last token (almost always rejected): what a verify costs, not what it yields."""

    def propose(self, request_id, token_ids, max_tokens, tenant=None):
        return [token_ids[-1]] * max_tokens

    def observe(self, request_id, num_proposed, num_accepted):
        pass

    def finish(self, request_id, tenant, token_ids, num_prompt_tokens):
        pass


class _FixedK(DraftPolicy):
    def num_tokens(self, request_id: str, batch_size: int) -> int:
        return self.max_k


def step_times(loaded, batch: int, k: int, context: int, pairs: int = 30) -> tuple[float, float]:
    """Median seconds of a plain decode step and of a verify step (k drafts per request) of `batch` requests
    at ~`context` tokens, alternating in one engine so that the machine's drift hits both alike."""
    engine = Engine(EngineConfig(kv_cache_memory="1GiB", speculative="off", max_num_seqs=batch), loaded=loaded)
    drafting = Drafting(_RepeatLast(), k, engine.max_model_len, _FixedK(k))
    for prompt in random_prompts(batch, context, seed=batch):
        engine.add_request(prompt, greedy(2 * pairs + 8))
    while any(r.num_tokens - r.num_computed_tokens > 1 for r in engine.scheduler.running + list(engine.scheduler.waiting)):
        engine.step()
    plain, verify = [], []
    for _ in range(pairs):
        for drafts_in_this_step, times in ((False, plain), (True, verify)):
            # Drafts are proposed at the end of a step for the next one.
            engine.drafting = None if drafts_in_this_step else drafting
            started = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - started)
    for request_id in engine.unfinished_request_ids():
        engine.abort(request_id)
    return statistics.median(plain), statistics.median(verify)


def measure_cost(loaded, k: int = 4, context: int = 256) -> dict:
    """c(B): one more query token's cost, as a fraction of a plain decode token's share of its step (every
    request of the batch carries k drafts: the step grows by B * k tokens)."""
    table = {}
    for batch in (1, 4, 16, 32):
        plain, verify = step_times(loaded, batch, k, context)
        cost = (verify - plain) / (batch * k) / (plain / batch)
        table[batch] = {"plain_step_s": plain, "verify_step_s": verify, "cost_per_token": cost}
        print(f"batch {batch:3d}: decode step {plain * 1e3:7.1f} ms, with {k} drafts each {verify * 1e3:7.1f} ms"
              f" -> one more query token costs {cost:.2f} of a plain decode token", flush=True)
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--method", default="auto", choices=["auto", "ngram", "suffix"])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--weights-dtype", default="auto")
    parser.add_argument("--workloads", nargs="+", default=None)
    parser.add_argument("--skip-w1", action="store_true")
    parser.add_argument("mode", nargs="?", default="w8", choices=["w8", "cost"],
                        help="w8: the workloads; cost: the verify's marginal cost per token, by batch size")
    args = parser.parse_args()
    print(f"CPU: {describe_cpu()}", flush=True)
    loaded = load_model(weights_dtype=args.weights_dtype)
    print(f"kvserve linear weights: {loaded.linear_dtype}", flush=True)
    freeze_setup()
    if args.mode == "cost":
        print(f"wrote {save('spec_decode_cost', {'args': vars(args), 'results': measure_cost(loaded)})}")
        return
    engines = {mode: Engine(EngineConfig(kv_cache_memory="1GiB", speculative=mode), loaded=loaded)
               for mode in ("off", args.method)}
    for engine in engines.values():
        run_engine(engine, random_prompts(1, 64, seed=1), greedy(4))  # warm-up
    prompts = w8_prompts(loaded.require_tokenizer())
    results = {}
    for name, (workload, max_tokens) in prompts.items():
        if args.workloads and name not in args.workloads:
            continue
        best: dict[str, dict] = {}
        for round_index in range(args.rounds):
            for mode, engine in engines.items():
                row = run_workload(engine, workload, max_tokens, tenant=f"{name}-{round_index}")
                if mode not in best or row["tpot_s"] < best[mode]["tpot_s"]:
                    best[mode] = row
        on, off = best[args.method], best["off"]
        rate = on["accepted_tokens"] / on["draft_tokens"] if on["draft_tokens"] else 0.0
        print(f"{name:6s}: TPOT off {off['tpot_s'] * 1e3:6.1f} ms, {args.method} {on['tpot_s'] * 1e3:6.1f} ms "
              f"({off['tpot_s'] / on['tpot_s']:.2f}x); {on['draft_tokens']} draft tokens, "
              f"{rate:.0%} accepted; {on['output_tokens']} output tokens", flush=True)
        results[name] = best
    if not args.skip_w1:
        w1 = {mode: max(w1_throughput(engine) for _ in range(args.rounds)) for mode, engine in engines.items()}
        print(f"W1    : off {w1['off']:.1f} tok/s, {args.method} {w1[args.method]:.1f} tok/s "
              f"({w1[args.method] / w1['off']:.2f}x)", flush=True)
        results["W1"] = w1
    binary = find_llama_server()
    if binary is not None:
        results["llama-server"] = llama_server_w8(binary, prompts, args)
    print(f"wrote {save('spec_decode', {'args': vars(args), 'results': results})}")


def llama_server_w8(binary: Path, prompts: dict, args: argparse.Namespace) -> dict:
    """The same prompts (token ids) through llama-server: no drafting, and each of its draftless n-gram
    types; best of `--rounds` TPOT per workload (its own predicted_per_token_ms). The prompt cache is off
    so a round never reuses the previous round's slot (the drafts would then come from the same output)."""
    table: dict[str, dict] = {}
    for spec in LLAMA_SPEC_TYPES:
        extra = [] if spec == "off" else ["--spec-type", spec, "--spec-draft-n-max", "16"]
        with LlamaServer(binary, embedded_model_path(), *extra) as server:
            server.complete([1, 2, 3], 4)  # warm-up
            for name, (workload, max_tokens) in prompts.items():
                if args.workloads and name not in args.workloads:
                    continue
                best = None
                for _ in range(args.rounds):
                    done = [server.complete(prompt, max_tokens, cache_prompt=False) for prompt in workload]
                    row = {"tpot_s": statistics.mean(d.tpot_ms for d in done) / 1e3,
                           "draft_tokens": sum(d.draft_tokens for d in done),
                           "accepted_tokens": sum(d.accepted_tokens for d in done),
                           "output_tokens": sum(len(d.token_ids) for d in done)}
                    best = row if best is None or row["tpot_s"] < best["tpot_s"] else best
                table.setdefault(name, {})[spec] = best
                rate = best["accepted_tokens"] / best["draft_tokens"] if best["draft_tokens"] else 0.0
                print(f"llama-server {spec:12s} {name:6s}: TPOT {best['tpot_s'] * 1e3:6.1f} ms; "
                      f"{best['draft_tokens']} draft tokens, {rate:.0%} accepted; {best['output_tokens']} output tokens",
                      flush=True)
    return table


if __name__ == "__main__":
    main()
