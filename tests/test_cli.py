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
    # float32 weights: the answer's first token is a near tie (logits 25.33 vs 25.24), which 4-bit weights
    # with int8 activations (auto here, as llama.cpp on this file) answer the other way.
    done = kvserve("generate", "--chat", "--temperature", "0", "--max-tokens", "48", "--weights-dtype", "float32",
                   "What is the capital of France?")
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


@pytest.mark.parametrize("args,message", [
    (["serve", "--port", "99999"], "--port must be in 0..65535 (0 = any free port), got 99999"),
    (["serve", "--port", "-1"], "--port must be in 0..65535"),
    (["serve", "--max-waiting-requests", "0"], "--max-waiting-requests must be >= 1, got 0"),
    (["serve", "--shutdown-timeout", "-1"], "--shutdown-timeout must be a number of seconds >= 0, got -1.0"),
    (["serve", "--shutdown-timeout", "nan"], "--shutdown-timeout must be a number of seconds >= 0, got nan"),
    (["serve", "--max-num-seqs", "0"], "--max-num-seqs must be >= 1, got 0"),
    (["generate", "--block-size", "0", "hi"], "--block-size must be >= 1, got 0"),
    (["generate", "--max-num-batched-tokens", "-5", "hi"], "--max-num-batched-tokens must be >= 1, got -5"),
    (["generate", "--max-model-len", "0", "hi"], "--max-model-len must be >= 1, got 0"),
    (["serve", "--kv-cache-memory", "lots"], "--kv-cache-memory: cannot read 'lots' as a memory size"),
    (["serve", "--api-key", "k1", "--api-key", "k2", "--admin-key", "k2"],
     "--admin-key must differ from every --api-key"),
    (["serve", "--compaction-secret", "short"], "--compaction-secret must be at least 16 bytes"),
    (["memory", "SmolLM2-135M", "--context", "0"], "--context must be >= 1, got 0"),
])
def test_out_of_range_flags_are_one_line_errors_before_anything_loads(args, message, capsys):
    from kvserve.cli import main

    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"kvserve: error: {message}")
    assert err.count("\n") == 1  # one line, and nothing loaded before it


def test_port_out_of_range_is_refused_without_a_traceback():
    done = kvserve("serve", "--port", "99999")
    assert done.returncode == 2
    assert done.stderr == "kvserve: error: --port must be in 0..65535 (0 = any free port), got 99999\n"


def test_kv_budget_beyond_available_memory_is_refused_before_the_load():
    done = kvserve("serve", "--port", "0", "--kv-cache-memory", "1000TiB")
    assert done.returncode == 2
    assert "kvserve: error: kv_cache_memory 1,024,000.00 GiB (1,099,511,627,776,000 bytes) is larger than the " \
           "memory available" in done.stderr
    assert "bytes, MemAvailable)" in done.stderr and "--allow-kv-overcommit" in done.stderr
    assert "loaded in" not in done.stderr and "Traceback" not in done.stderr


def test_max_model_len_beyond_the_context_is_refused(tiny_model_dir):
    done = kvserve("generate", "--quiet", "--model", str(tiny_model_dir), "--token-ids", "1,2,3",
                   "--max-model-len", "100000")
    assert done.returncode == 2
    assert "kvserve: error: max_model_len 100,000 is beyond the model's context of 256 tokens" in done.stderr
    assert "Traceback" not in done.stderr


def _parser_flags() -> dict[str, set[str]]:
    """Every option string of each `kvserve` command; "" holds the top-level ones (--version)."""
    import argparse

    from kvserve.cli import _build_parser

    parser = _build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {"": {flag for action in parser._actions for flag in action.option_strings},
            **{name: {flag for action in sub._actions for flag in action.option_strings}
               for name, sub in commands.choices.items()}}


# Flags the README mentions that belong to other tools (pip, llama.cpp).
_OTHER_TOOLS_FLAGS = {"--no-deps", "--cache-type-k", "--head", "--address",  # pip, llama.cpp, `ray start`
                      "--no-repack", "--spec-type", "--spec-draft-n-max", "--jinja"}  # llama-server


def test_readme_flags_exist_on_the_commands_that_document_them():
    import re
    from pathlib import Path

    flags = _parser_flags()
    readme = (Path(__file__).parent.parent / "README.md").read_text()
    sections = dict(re.findall(r"^## (.+?)\n(.*?)(?=^## |\Z)", readme, flags=re.S | re.M))
    commands_of = {"Serving": ["serve"], "Generating": ["generate"], "Planning memory": ["memory"],
                   "Engine flags (serve and generate)": ["serve", "generate"]}
    assert set(commands_of) <= set(sections)
    everywhere = set().union(*flags.values())
    for title, text in sections.items():
        for flag in set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", text)) - _OTHER_TOOLS_FLAGS:
            # Under a command's heading a flag must be that command's; elsewhere some command's.
            allowed = [flags[c] for c in commands_of.get(title, [])] or [everywhere]
            assert all(flag in f for f in allowed), f"README section '{title}' mentions {flag}"


def test_every_command_flag_is_documented_in_the_readme():
    from pathlib import Path

    readme = (Path(__file__).parent.parent / "README.md").read_text()
    for command, flags in _parser_flags().items():
        missing = sorted(f for f in flags if f.startswith("--") and f != "--help" and f not in readme)
        assert not missing, f"kvserve {command} flags missing from README.md: {missing}"


def test_explain_cache_says_what_came_from_disk_after_a_restart(tiny_model_dir, tmp_path):
    disk = str(tmp_path / "tier")
    args = ["generate", "--model", str(tiny_model_dir), "--token-ids", ",".join(str(i) for i in range(1, 40)),
            "--max-tokens", "3", "--temperature", "0", "--explain-cache", "--block-size", "4",
            "--kv-disk-path", disk, "--kv-disk-size", "1MiB"]
    first, second = kvserve(*args), kvserve(*args)  # two processes: a restart in between
    assert first.returncode == 0 and second.returncode == 0, first.stderr + second.stderr
    assert "(0 cached)" in first.stderr and "KV disk tier:" in first.stderr
    assert "prompt 39 tokens (36 cached)" in second.stderr
    assert "36 of 39 prompt tokens cached (0 from the pool, 36 from disk)" in second.stderr
    assert first.stdout == second.stdout


def test_version_names_the_installed_distribution(capsys):
    from importlib.metadata import version

    from kvserve.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out == f"kvserve {version('kvserve')}\n"


@pytest.mark.parametrize("device, message", [
    ("cuda", "device 'cuda': kvserve has attention kernels for the CPU only so far"),
    ("tpu", "device 'tpu' is not a device name"),
])
def test_device_is_an_engine_flag_and_only_cpu_runs(device, message, capsys):
    from kvserve.cli import main

    assert main(["generate", "--device", device, "hi"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"kvserve: error: {message}") and err.count("\n") == 1  # refused before the load
