"""A request's tokens and logprobs do not depend on how it runs (issue 36, DESIGN §3 Determinism), bit for
bit, on the default weights: alone; in a batch with other requests; in prefill chunks of any size; after a
prefix of its prompt was cached; preempted and resumed; with drafts verified at any k. Greedy and seeded."""

import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from kvserve.config import EngineConfig
from kvserve.engine.engine import Engine
from kvserve.engine.output.types import RequestOutputAssembler
from kvserve.engine.sample.sampling import SamplingParams
from kvserve.kernels import ops
from kvserve.model.loader import ModelLoadError

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not ops.available(), reason="the C++ kernels are not built")]
OUTPUT_TOKENS = 8


class Oracle:
    """Drafts the request's own continuation (from its run alone), one wrong token every third proposal:
    verifies accept whole drafts, parts of them, or none."""

    def __init__(self, continuations: dict[tuple[int, ...], list[int]], vocab: int) -> None:
        self.continuations, self.vocab, self.calls, self.accepted = continuations, vocab, 0, 0

    def propose(self, request_id, token_ids, max_tokens, tenant=None):
        for prompt, output in self.continuations.items():
            if tuple(token_ids[: len(prompt)]) == prompt:
                guess = list(output[len(token_ids) - len(prompt) :][:max_tokens])
                self.calls += 1
                if guess and self.calls % 3 == 0:
                    guess[self.calls % len(guess)] = (guess[self.calls % len(guess)] + 1) % self.vocab
                return guess
        return []

    def observe(self, request_id, num_proposed, num_accepted):
        self.accepted += num_accepted

    def finish(self, request_id, tenant, token_ids, num_prompt_tokens):
        pass


def run(loaded, prompts, params, proposer=None, k=4, warm=(), **config):
    """(token ids, logprobs) of each prompt, all added at once; `warm` prompts run to completion first."""
    # Blocks of 4 tokens: short prompts have whole blocks to hit. The block size is the one setting of the
    # cache that moves results (attention's online softmax steps block by block); every run here shares it.
    # A 64 MiB pool holds every run here many times over; the default (30% of RAM, up to 4 GiB) would give a
    # tiny model millions of 4-token blocks, each a Python record made at startup (~10 s an engine).
    config.setdefault("kv_cache_memory", "64MiB")
    engine = Engine(EngineConfig(speculative="off", block_size=4, **config), loaded=loaded, proposer=proposer,
                    num_speculative_tokens=k)
    for prompt in warm:
        generate(engine, [prompt], [SamplingParams(max_tokens=1, temperature=0.0)])
    return generate(engine, prompts, params)


def generate(engine, prompts, params):
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    assembler, finals = RequestOutputAssembler(), {}
    while engine.has_unfinished():
        for delta in engine.step():
            if (final := assembler.add(delta)) is not None:
                finals[final.request_id] = final
    outs = [finals[i].outputs[0] for i in ids]
    return [(o.token_ids, [t.logprob for t in o.logprobs or ()]) for o in outs]


def sampling(seed: int | None) -> SamplingParams:
    temperature = 0.0 if seed is None else 0.9
    return SamplingParams(max_tokens=OUTPUT_TOKENS, temperature=temperature, seed=seed, ignore_eos=True, logprobs=0)


def check_invariance(loaded, data, vocab):
    rng = np.random.default_rng(data.draw(st.integers(0, 2**31), label="seed"))
    count = data.draw(st.integers(1, 4), label="requests")
    lengths = [data.draw(st.integers(2, 90), label="prompt length") for _ in range(count)]
    prompts = [rng.integers(1000, min(vocab, 40000), size=n).tolist() for n in lengths]
    params = [sampling(data.draw(st.one_of(st.none(), st.integers(0, 99)), label="sampling seed")) for _ in prompts]
    alone = [run(loaded, [p], [sp], enable_prefix_caching=False)[0] for p, sp in zip(prompts, params)]
    chunk = data.draw(st.sampled_from([1, 5, 16, 32, 2048]), label="prefill chunk")
    assert run(loaded, prompts, params, max_num_batched_tokens=max(chunk, count)) == alone
    hit = data.draw(st.integers(1, lengths[0]), label="cached prefix")  # blocks of it are hits, any tail
    assert run(loaded, prompts, params, warm=[prompts[0][:hit]]) == alone
    oracle = Oracle({tuple(p): out[0] for p, out in zip(prompts, alone)}, vocab)
    k = data.draw(st.integers(1, 6), label="draft length")
    assert run(loaded, prompts, params, proposer=oracle, k=k) == alone
    # A pool of 48 blocks of 4 tokens: requests preempt one another and resume from the cache.
    assert run(loaded, prompts, params, kv_cache_memory=48 * 4 * loaded_bytes_per_token(loaded),
               max_num_seqs=4) == alone


def loaded_bytes_per_token(loaded) -> int:
    from kvserve.kv.cache.kv_spec import auto_cache_dtype

    config = loaded.config
    width = 4 if auto_cache_dtype(loaded.linear_dtype) == "float32" else 2  # float16 K and V beside int codes
    return 2 * config.num_layers * config.num_kv_heads * config.head_dim * width


@pytest.fixture(scope="module")
def smollm2():
    """The embedded SmolLM2-135M on its default weights (the file's int4/int8 group codes here), not the
    session's float32 `embedded` (torch's fp32 GEMMs are not row-invariant: README, Generating)."""
    from kvserve.model.loader import load_model

    return load_model(weights_dtype="auto")


# No shrinking: each example loads engines and generates (seconds); the drawn values name the failing case.
FEW = {"deadline": None, "suppress_health_check": list(HealthCheck), "phases": [Phase.explicit, Phase.generate]}


@settings(max_examples=3, **FEW)
@given(data=st.data())
def test_embedded_model_gives_each_request_the_same_bits_however_it_runs(smollm2, data):
    check_invariance(smollm2, data, smollm2.config.vocab_size)


@settings(max_examples=1, **FEW)
@given(data=st.data())
def test_float32_weights_give_each_request_the_same_bits_however_it_runs(embedded, data):
    """The session's float32 SmolLM2 (fp32 K/V): torch's GEMMs, few rows padded (kvserve.model.float_gemm)."""
    from kvserve.model.float_gemm import invariant_rows

    if invariant_rows() == 0:
        pytest.skip("this CPU's float32 GEMM is not row-invariant at any padding tried (logged; README)")
    check_invariance(embedded, data, embedded.config.vocab_size)


@pytest.fixture(scope="module")
def gemma3():
    from kvserve.model.loader import gemma3_270m_path, load_model

    try:
        return load_model(str(gemma3_270m_path()), weights_dtype="auto")
    except ModelLoadError as exc:
        pytest.skip(str(exc))


@settings(max_examples=3, **FEW)
@given(data=st.data())
def test_gemma3_gives_each_request_the_same_bits_however_it_runs(gemma3, data):
    check_invariance(gemma3, data, gemma3.config.vocab_size)


def test_cli_answers_a_prompt_the_same_cold_and_from_the_prefix_cache():
    """Issue 36's repro: the second answer comes 1,088 of 1,095 prompt tokens from the cache, and was a
    different greedy answer (first logprob -0.969 cold, -0.910 warm)."""
    import subprocess
    import sys

    prompt = ("Summarize this code:\n\n" + "\n".join(f"def function_{i}(x):\n    return x * {i} + {i * i}  # compute "
                                                     f"value {i}" for i in range(40)) + "\n\nExplanation:")
    result = subprocess.run([sys.executable, "-m", "kvserve.cli", "generate", "--quiet", "--explain-cache",
                             "--temperature", "0", "--max-tokens", "30", prompt, prompt],
                            capture_output=True, text=True, timeout=600, check=True)
    # stdout: the two answers, one after the other (30 tokens each: equal halves); stderr: the stats.
    stats = [line.split("|")[0] for line in result.stderr.splitlines() if line.startswith("[prompt ")]
    assert len(stats) == 2 and "(0 cached)" in stats[0] and "(1088 cached)" in stats[1]
    half = len(result.stdout) // 2
    assert result.stdout.strip() and result.stdout[:half] == result.stdout[half:]
