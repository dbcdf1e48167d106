"""`kvserve generate --json-schema / --regex / --tools`: the server's constraint and tool machinery from the
terminal, the calls parsed back out, and every misuse refused before the model loads."""

import json
import re

import pytest

from kvserve.cli import main
from tests.test_cli import kvserve

WEATHER = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


@pytest.fixture
def tools_file(tmp_path):
    path = tmp_path / "tools.json"
    path.write_text(json.dumps(WEATHER))
    return path


@pytest.mark.parametrize("args, message", [
    (["--tool-choice", "required"], "--tool-choice needs --tools"),
    (["--json-schema", "{bad"], "--json-schema: not a file, and not valid JSON"),
    (["--json-schema", "{}", "--regex", "a"], "give --json-schema or --regex, not both"),
    (["--tools", "/no/such/tools.json"], "--tools: no such file: /no/such/tools.json"),
])
def test_misuse_is_one_line_before_anything_loads(args, message, capsys):
    assert main(["generate", *args, "hi"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvserve: error: ") and message in err
    assert err.count("\n") == 1


def test_tools_are_checked_before_anything_loads(tools_file, tmp_path, capsys):
    assert main(["generate", "--tools", str(tools_file), "--tool-choice", "get_time", "hi"]) == 2
    assert "'get_time', which is not among the tools (get_weather)" in capsys.readouterr().err
    assert main(["generate", "--tools", str(tools_file), "--regex", "a+", "hi"]) == 2
    assert "only a JSON structured output" in capsys.readouterr().err
    broken = tmp_path / "broken.json"
    broken.write_text(json.dumps([{"type": "function", "function": {"description": "no name"}}]))
    assert main(["generate", "--tools", str(broken), "hi"]) == 2
    assert "tool function.name: Field required" in capsys.readouterr().err


@pytest.mark.slow
def test_a_required_tool_call_is_generated_and_printed(tools_file):
    done = kvserve("generate", "--quiet", "--temperature", "0", "--max-tokens", "40", "--tools", str(tools_file),
                   "--tool-choice", "required", "What is the weather in Paris?")
    assert done.returncode == 0, done.stderr
    assert '"name": "get_weather"' in done.stdout
    calls = re.findall(r"^tool call get_weather (.*)$", done.stderr, re.M)
    assert calls and all(isinstance(json.loads(arguments)["city"], str) for arguments in calls), done.stderr


@pytest.mark.slow
def test_json_schema_from_a_file_and_regex_constrain_the_output(tmp_path):
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps({"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
                                  "additionalProperties": False}))
    done = kvserve("generate", "--quiet", "--temperature", "0", "--max-tokens", "30", "--json-schema", str(schema),
                   "Give a number as JSON")
    assert done.returncode == 0, done.stderr
    assert isinstance(json.loads(done.stdout)["n"], int), done.stdout
    done = kvserve("generate", "--quiet", "--temperature", "0", "--max-tokens", "8", "--regex", "[0-9]{3}-[0-9]{2}",
                   "Code:")
    assert done.returncode == 0, done.stderr
    assert re.fullmatch(r"[0-9]{3}-[0-9]{2}", done.stdout.strip()), done.stdout
