"""llguidance vs xgrammar at the embedded SmolLM2's 49,152-token vocabulary (issue 29's engine choice).

For each engine: the vocabulary build, the compile time of a ~20-tool manifest's call schema
(bench/tool_manifest.py), the first-mask latency (a fresh matcher's first bitmask), and the per-token mask
time mid-generation (walking a valid tool call's tokens: fill the bitmask, then consume the token), for the
tool schema and a small object schema. Both with compact JSON (no free whitespace), one thread.

xgrammar is not a kvserve dependency: install it apart and point PYTHONPATH at it, e.g.
    pip install --no-deps --target /tmp/xg xgrammar apache-tvm-ffi
    PYTHONPATH=$PWD:/tmp/xg .venv/bin/python bench/grammar_engines.py
Without it, its rows are skipped with a message.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as package_version

import torch

from bench.tool_manifest import SAMPLE_CALL, tool_call_schema
from kvserve.model.loader import load_model

SMALL = {"type": "object", "additionalProperties": False, "required": ["name", "age", "colour"],
         "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                        "colour": {"enum": ["red", "green", "blue"]}}}
SMALL_SAMPLE = '{"name": "Grace Hopper", "age": 85, "colour": "blue"}'


def version(package: str) -> str:
    try:
        return package_version(package)
    except PackageNotFoundError:  # imported from a --target folder without its metadata on the path
        return "?"


class Llguidance:
    name = "llguidance"

    def __init__(self, tokenizer, vocab_size: int) -> None:
        import llguidance

        from kvserve.structured.vocabulary import build_grammar_vocabulary
        self.llg = llguidance
        self.version = version("llguidance")
        start = time.perf_counter()
        self.vocabulary = build_grammar_vocabulary(tokenizer, vocab_size)
        self.vocab_seconds = time.perf_counter() - start
        self.bitmask = torch.zeros((vocab_size + 31) // 32, dtype=torch.int32)

    def compile(self, schema: dict):
        from kvserve.structured.compiler import JSON_DEFAULTS
        grammar = self.llg.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_DEFAULTS)
        matcher = self.llg.LLMatcher(self.vocabulary, grammar, log_level=0)
        if matcher.is_error():
            raise RuntimeError(matcher.get_error())
        return matcher

    def new_matcher(self, compiled):
        return compiled.deep_copy()

    def fill(self, matcher) -> None:
        matcher.unsafe_compute_mask_ptr(self.bitmask.data_ptr(), self.bitmask.numel() * 4)

    def consume(self, matcher, token: int) -> None:
        if not matcher.consume_token(token):
            raise RuntimeError(f"refused {token}: {matcher.get_error()}")


class Xgrammar:
    name = "xgrammar"

    def __init__(self, tokenizer, vocab_size: int) -> None:
        import xgrammar
        self.xgr = xgrammar
        self.version = version("xgrammar")
        start = time.perf_counter()
        vocab = [tokenizer.backend.id_to_token(i) or "" for i in range(vocab_size)]
        info = xgrammar.TokenizerInfo(vocab, vocab_type=xgrammar.VocabType.BYTE_LEVEL, vocab_size=vocab_size,
                                      stop_token_ids=sorted(tokenizer.stop_token_ids))
        self.vocab_seconds = time.perf_counter() - start
        self.info = info
        self.bitmask = xgrammar.allocate_token_bitmask(1, vocab_size)

    def compile(self, schema: dict):
        # A fresh compiler each time: its cache would turn a second compile into a lookup.
        compiler = self.xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)
        return compiler.compile_json_schema(json.dumps(schema), any_whitespace=False, separators=(", ", ": "))

    def new_matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, matcher) -> None:
        matcher.fill_next_token_bitmask(self.bitmask)

    def consume(self, matcher, token: int) -> None:
        if not matcher.accept_token(token):
            raise RuntimeError(f"refused {token}")


def measure(engine, schema: dict, sample: str, token_ids: list[int], repeats: int) -> dict:
    compile_s = []
    for _ in range(repeats):
        start = time.perf_counter()
        compiled = engine.compile(schema)
        compile_s.append(time.perf_counter() - start)
    first_mask_s, per_token_s = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        matcher = engine.new_matcher(compiled)
        engine.fill(matcher)
        first_mask_s.append(time.perf_counter() - start)
        engine.consume(matcher, token_ids[0])
        for token in token_ids[1:]:
            start = time.perf_counter()
            engine.fill(matcher)
            per_token_s.append(time.perf_counter() - start)
            engine.consume(matcher, token)
    return {"compile_ms": statistics.median(compile_s) * 1e3, "first_mask_ms": statistics.median(first_mask_s) * 1e3,
            "mask_us_mean": statistics.mean(per_token_s) * 1e6, "mask_us_p50": statistics.median(per_token_s) * 1e6,
            "mask_us_p99": statistics.quantiles(per_token_s, n=100)[98] * 1e6}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(1)
    loaded = load_model()
    tokenizer, vocab_size = loaded.require_tokenizer(), loaded.config.vocab_size
    cases = [("20-tool call", tool_call_schema(), SAMPLE_CALL), ("small object", SMALL, SMALL_SAMPLE)]
    engines = []
    for kind in (Llguidance, Xgrammar):
        try:
            engines.append(kind(tokenizer, vocab_size))
        except ImportError as error:
            print(f"{kind.name}: skipped, cannot import it ({error}); see this script's docstring")
    print(f"vocabulary: {vocab_size} tokens; torch threads 1")
    print(f"{'engine':<22}{'schema':<14}{'vocab s':>8}{'compile ms':>11}{'1st mask ms':>12}"
          f"{'mask us mean':>13}{'p50':>8}{'p99':>9}")
    for engine in engines:
        for label, schema, sample in cases:
            tokens = tokenizer.encode(sample, add_special_tokens=False)
            row = measure(engine, schema, sample, tokens, args.repeats)
            print(f"{engine.name + ' ' + engine.version:<22}{label:<14}{engine.vocab_seconds:>8.2f}"
                  f"{row['compile_ms']:>11.2f}{row['first_mask_ms']:>12.3f}{row['mask_us_mean']:>13.1f}"
                  f"{row['mask_us_p50']:>8.1f}{row['mask_us_p99']:>9.1f}")


if __name__ == "__main__":
    main()
