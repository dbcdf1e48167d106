"""`kvserve generate`'s flags for what the output must be (a JSON schema, a regex) and the tools it may call,
and the server's ToolUse they make: the same constraint, prompt rendering and call parsing as over HTTP."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from kvserve.errors import KVServeError
from kvserve.server.core.tool_use import ToolUse
from kvserve.server.openai.tool_protocol import ChatTool
from kvserve.structured.params import StructuredOutputsParams
from kvserve.tools.calls import FunctionTool
from kvserve.tools.grammar import ToolChoice


def add_output_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("structured output and tools (the server's response_format and tools)")
    group.add_argument("--json-schema", metavar="FILE_OR_JSON",
                       help="constrain the output to this JSON schema: a file holding it, or its JSON text")
    group.add_argument("--regex", help="constrain the output to match this regular expression")
    group.add_argument("--tools", metavar="FILE",
                       help="a JSON file of tools in OpenAI's chat format ([{\"type\": \"function\", \"function\": "
                            "{\"name\": ..., \"parameters\": ...}}]), rendered with the model's chat template (implies "
                            "--chat); the calls parsed from the output are printed to stderr")
    group.add_argument("--tool-choice", default="auto", metavar="auto|none|required|NAME",
                       help="with --tools: whether and which function the model must call (default auto)")


def tool_use_from_args(args: argparse.Namespace) -> ToolUse:
    """The output constraint and tools `generate` asks for, as the server's ToolUse; checked before the load."""
    if args.json_schema is not None and args.regex is not None:
        raise KVServeError("give --json-schema or --regex, not both")
    output = None
    if args.json_schema is not None:
        output = StructuredOutputsParams(json=_read_json(args.json_schema, "--json-schema"))
    elif args.regex is not None:
        output = StructuredOutputsParams(regex=args.regex)
    tools = _read_tools(args.tools) if args.tools is not None else []
    mode = args.tool_choice if args.tool_choice in ("auto", "none", "required") else "named"
    use = ToolUse(tools, ToolChoice(mode, args.tool_choice if mode == "named" else None), output=output,
                  output_param="--json-schema" if args.json_schema is not None else "--regex")
    if args.tool_choice != "auto" and not tools:
        raise KVServeError("--tool-choice needs --tools")
    use.check("--tool-choice")
    use.constraint()  # refuses what cannot be combined (tools with a regex) before the load
    return use


def _read_json(value: str, flag: str) -> Any:
    """A flag's JSON: the file it names, or the value itself."""
    path = Path(value)
    text = path.read_text() if len(value) < 4096 and path.is_file() else value
    try:
        return json.loads(text)
    except ValueError as exc:
        raise KVServeError(f"{flag}: not a file, and not valid JSON: {exc}") from None


def _read_tools(path: str) -> list[FunctionTool]:
    """The tools of a JSON file: a list of OpenAI chat tools, or an object with such a "tools" list."""
    if not Path(path).is_file():
        raise KVServeError(f"--tools: no such file: {path}")
    value = _read_json(path, "--tools")
    items = value.get("tools") if isinstance(value, dict) else value
    if not isinstance(items, list) or not items:
        raise KVServeError(f"--tools: {path} must hold a non-empty list of tools (or {{\"tools\": [...]}})")
    try:
        return [ChatTool.model_validate(item).definition() for item in items]
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first["loc"])
        raise KVServeError(f"--tools: {path}: tool {where}: {first['msg']}") from None
