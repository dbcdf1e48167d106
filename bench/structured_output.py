"""Structured output on the embedded model: forced tokens as a mini-prefill vs one token per step, and the
mask's per-step cost vs an unconstrained run (issue 29).

A JSON-heavy output: three records with long property names and enum values, greedy, on the embedded
SmolLM2. Three runs of one request each, side by side in one process:
- forced: the grammar's forced tokens (keys, punctuation, an enum's rest once its prefix is unique) are fed
  several per step with the request's last token;
- unforced: the same grammar, one sampled token per step (the mask still applied);
- plain: no constraint, ignore_eos, as many tokens as the unforced run (the per-step baseline).
It prints TPOT (decode time per output token), tokens per step and step time, then the ratios, and the
mask's own cost per constrained row (bitmask, masking, consuming) replayed over the output's tokens.

    PYTHONPATH=$PWD .venv/bin/python bench/structured_output.py [--repeats 3] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from kvserve.config import EngineConfig
from kvserve.engine.engine import Engine
from kvserve.engine.sample.sampling import SamplingParams
from kvserve.model.loader import load_model
from kvserve.structured.mask import apply_bitmask
from kvserve.structured.matcher import bitmask_words
from kvserve.structured.params import StructuredOutputsParams

RECORD = {"type": "object", "additionalProperties": False, "properties": {
    "customer_account_identifier": {"type": "string", "maxLength": 12},
    "subscription_plan_category": {"enum": ["enterprise_unlimited_annual", "professional_monthly_standard",
                                            "starter_free_tier_trial"]},
    "preferred_billing_cycle_configuration": {"enum": ["calendar_month_end", "anniversary_of_signup_date"]},
    "notification_channel_preferences": {"type": "array", "maxItems": 2, "items": {
        "enum": ["electronic_mail_digest", "short_message_service", "in_application_banner"]}},
    "is_premium_support_entitlement_enabled": {"type": "boolean"}}}
RECORD["required"] = list(RECORD["properties"])
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["customer_records"], "properties": {
    "customer_records": {"type": "array", "minItems": 3, "maxItems": 3, "items": RECORD}}}


def run(loaded, prompt: str, params: SamplingParams, force: bool) -> dict:
    # No drafting: the plain baseline is one token per step, like the constrained runs (never drafted).
    engine = Engine(EngineConfig(kv_cache_memory="64MiB", speculative="off"), loaded=loaded)
    engine.constrained.force = force
    engine.add_request(prompt, params)
    step_times, tokens, text = [], 0, ""
    while engine.has_unfinished():
        start = time.perf_counter()
        deltas = engine.step()
        step_times.append(time.perf_counter() - start)
        for delta in deltas:
            tokens += len(delta.new_token_ids)
            text += delta.new_text
    decode = step_times[1:]  # after the prompt's step
    return {"tokens": tokens, "steps": len(step_times), "text": text, "tpot": sum(decode) / max(tokens - 1, 1),
            "step": statistics.median(decode), "tokens_per_step": (tokens - 1) / max(len(decode), 1)}


def mask_cost(loaded, spec: StructuredOutputsParams, text: str, repeats: int = 5) -> float:
    """Seconds per token of what a constrained row adds to a step (fill the bitmask, mask the logits row,
    consume the token), replayed over `text`'s tokens: the step-time difference itself is below the
    machine's noise."""
    engine = Engine(EngineConfig(kv_cache_memory="16MiB", speculative="off"), loaded=loaded)
    params = SamplingParams(structured_outputs=spec)
    vocab = loaded.config.vocab_size
    bitmask, logits = torch.zeros(bitmask_words(vocab), dtype=torch.int32), torch.randn(vocab)
    tokens = loaded.require_tokenizer().encode(text, add_special_tokens=False)
    best = float("inf")
    for _ in range(repeats):
        matcher = engine.constrained.new_matcher(params)
        start = time.perf_counter()
        for token in tokens:
            matcher.fill_bitmask(bitmask)
            apply_bitmask(logits, bitmask)
            matcher.consume([token])
        best = min(best, (time.perf_counter() - start) / len(tokens))
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    # One thread: on a shared machine a second OpenMP thread's spin-waits make small GEMMs erratic.
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    loaded = load_model(weights_dtype="auto")  # the server's default weights (int4 or int8 here), not the library's fp32
    prompt = loaded.require_tokenizer().apply_chat_template(
        [{"role": "user", "content": "List three customer records as JSON."}])
    spec = StructuredOutputsParams(json=SCHEMA)
    rows: dict[str, list[dict]] = {"forced": [], "unforced": [], "plain": []}
    for _ in range(args.repeats):  # interleaved, so a busy moment hits all three alike
        rows["forced"].append(run(loaded, prompt, SamplingParams(max_tokens=600, temperature=0.0,
                                                                 structured_outputs=spec), True))
        rows["unforced"].append(run(loaded, prompt, SamplingParams(max_tokens=600, temperature=0.0,
                                                                   structured_outputs=spec), False))
        rows["plain"].append(run(loaded, prompt, SamplingParams(max_tokens=rows["unforced"][-1]["tokens"],
                                                                temperature=0.0, ignore_eos=True), False))
    json.loads(rows["forced"][0]["text"]), json.loads(rows["unforced"][0]["text"])  # both valid JSON
    best = {name: min(runs, key=lambda r: r["tpot"]) for name, runs in rows.items()}
    print(f"embedded SmolLM2, greedy, torch threads {args.threads}, best of {args.repeats}")
    print(f"{'run':<10}{'tokens':>8}{'steps':>7}{'tok/step':>10}{'TPOT ms':>9}{'step ms':>9}")
    for name, row in best.items():
        print(f"{name:<10}{row['tokens']:>8}{row['steps']:>7}{row['tokens_per_step']:>10.2f}"
              f"{row['tpot'] * 1e3:>9.2f}{row['step'] * 1e3:>9.2f}")
    print(f"TPOT unforced / forced: {best['unforced']['tpot'] / best['forced']['tpot']:.2f}x")
    print(f"tokens per step forced / unforced: {best['forced']['tokens_per_step'] / best['unforced']['tokens_per_step']:.2f}x")
    print(f"step time constrained (unforced) / plain: {best['unforced']['step'] / best['plain']['step']:.3f}x "
          "(within the machine's noise)")
    cost = mask_cost(loaded, spec, best["unforced"]["text"])
    print(f"mask per constrained row and step: {cost * 1e6:.0f} us = {cost / best['plain']['step'] * 100:.2f}% "
          f"of a plain step")


if __name__ == "__main__":
    main()
