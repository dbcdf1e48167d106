"""`kvserve generate` end to end, as a user runs it."""

import subprocess
import sys

import pytest

from tests.helpers import build_hf_model, save_hf_model


def kvserve(*args: str, timeout: int = 180) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvserve.cli", *args], capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    return save_hf_model(build_hf_model("llama-gqa"), tmp_path_factory.mktemp("tiny"))


def test_generate_with_token_ids_on_a_model_without_tokenizer(tiny_model_dir):
    done = kvserve("generate", "--model", str(tiny_model_dir), "--token-ids", "1,2,3,4", "--max-tokens", "5",
                   "--temperature", "0")
    assert done.returncode == 0, done.stderr
    assert len(done.stdout.split()) == 5  # token ids are printed as they are generated
    assert "prompt 4 tokens (0 cached) | output 5 tokens (length)" in done.stderr
    assert "TTFT" in done.stderr and "TPOT" in done.stderr and "tok/s" in done.stderr
    assert "KV cache held" in done.stderr
    assert "token-id input and output only" in done.stderr


def test_no_kv_cache_gives_the_same_tokens(tiny_model_dir):
    args = ["generate", "--model", str(tiny_model_dir), "--token-ids", "5,6,7", "--max-tokens", "8", "--temperature", "0", "--quiet"]
    cached, recomputed = kvserve(*args), kvserve(*args, "--no-kv-cache")
    assert cached.returncode == recomputed.returncode == 0
    assert cached.stdout == recomputed.stdout
    assert "no KV cache" in recomputed.stderr


@pytest.mark.parametrize("args,message", [
    (["--model", "/no/such/model", "hello"], "model not found: /no/such/model"),
    (["--top-p", "0", "hello"], "top_p must be in (0, 1]"),
    (["--kv-cache-dtype", "int3", "hello"], "unsupported KV cache dtype 'int3'"),
])
def test_errors_are_one_clear_line(args, message):
    done = kvserve("generate", "--quiet", *args)
    assert done.returncode == 2
    assert message in done.stderr
    assert "Traceback" not in done.stderr


def test_text_prompt_on_a_model_without_tokenizer_is_refused(tiny_model_dir):
    done = kvserve("generate", "--quiet", "--model", str(tiny_model_dir), "hello")
    assert done.returncode == 2
    assert "send token ids" in done.stderr and "Traceback" not in done.stderr


def test_prompt_longer_than_context_is_refused_with_counts(tiny_model_dir):
    ids = ",".join(["3"] * 250)
    done = kvserve("generate", "--quiet", "--model", str(tiny_model_dir), "--token-ids", ids, "--max-tokens", "10")
    assert done.returncode == 2
    assert "prompt (250 tokens) + max_tokens (10) = 260 tokens exceeds the model's context of 256 tokens" in done.stderr


@pytest.mark.slow
def test_chat_on_the_embedded_model_streams_text():
    done = kvserve("generate", "--chat", "--temperature", "0", "--max-tokens", "48", "What is the capital of France?")
    assert done.returncode == 0, done.stderr
    assert "Paris" in done.stdout
    assert "(stop)" in done.stderr  # ended on <|im_end|>, not the token limit
    assert "30 layers, 9 heads / 3 KV heads (GQA)" in done.stderr


@pytest.mark.slow
def test_explain_cache_across_prompts():
    first = "The meeting is scheduled for Monday at 10:15 in room 4B with the whole platform team and guests. Agenda:"
    second = first.replace("10:15", "10:45")
    done = kvserve("generate", "--quiet", "--explain-cache", "--temperature", "0", "--max-tokens", "3",
                   first, first, second)
    assert done.returncode == 0, done.stderr
    reports = [line for line in done.stderr.splitlines() if line.startswith("prefix cache:")]
    assert len(reports) == 3
    assert "nothing cached starts like this prompt" in reports[0]
    assert "every full block of the prompt was cached" in reports[1]
    assert "diverged from the closest cached prompt at token" in reports[2]
    assert "this prompt:" in done.stderr and "[45" in done.stderr and "[15" in done.stderr
    assert "(0 cached)" in done.stderr and "(16 cached)" in done.stderr
