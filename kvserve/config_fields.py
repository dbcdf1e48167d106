"""What an EngineConfig field says about itself: its help, its command-line flag, its choices and the
static check of its value.

Written once, read twice: `kvserve serve | generate` build their engine flags from it (kvserve/cli.py)
and `EngineConfig.__post_init__` runs `check_fields`, so Python and command-line users get the same
ranges, choices and help. Checks that need the machine or the model (the KV budget against RAM,
max_model_len against the model) are not static and live where the engine is built.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from kvserve.errors import ConfigError

# A check returns None for a good value, else what is wrong: (for Python, for the command line). The
# second may be None (same words); it differs where argparse has already made the value the right type.
Problem = tuple[str, str | None]
Check = Callable[[Any], Problem | None]


class ConfigFieldError(ConfigError):
    """One field's value is out of range; the message starts with the field's name."""

    def __init__(self, field: str, problem: str, flag_problem: str | None = None) -> None:
        super().__init__(f"{field}{problem}")
        self.field = field
        self.flag_problem = flag_problem if flag_problem is not None else problem

    def for_flag(self, flag: str) -> str:
        """The same error naming the command-line flag (`--max-num-seqs must be >= 1, got 0`)."""
        return f"{flag}{self.flag_problem}"


def engine_arg(help: str, *, check: Check | None = None, choices: Sequence[str] | None = None,
               flag: str | None = None, cli: bool = True) -> dict[str, Any]:
    """A field's metadata. `help` may name other fields as {field_name} (the CLI writes their flags there)
    and the field's choices as {choices}. `flag`: the flag where it is not --field-name; a bool field that
    defaults to True is turned off by its flag (enable_kv_cache -> --no-kv-cache), and a bool's help says
    what its flag does. `choices` are checked unless `check` says otherwise. `cli=False`: no flag (yet)."""
    if choices is not None and check is None:
        check = one_of(choices)
    return {"help": help, "check": check, "choices": tuple(choices) if choices is not None else None,
            "flag": flag, "cli": cli}


def check_fields(config: Any) -> None:
    """Run every field's check on `config` (a dataclass); a None where the default is None means "the
    default rule" and is not checked. Raises ConfigFieldError for the first bad value."""
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        check = field.metadata.get("check")
        if check is None or (value is None and field.default is None):
            continue
        problem = check(value)
        if problem is not None:
            raise ConfigFieldError(field.name, *problem)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def positive_int(value: Any) -> Problem | None:
    if _is_int(value) and value >= 1:
        return None
    return f" must be a positive integer, got {value!r}", f" must be >= 1, got {value!r}"


def token_count(value: Any) -> Problem | None:
    """Zero or more tokens."""
    return None if _is_int(value) and value >= 0 else (f" must be a token count >= 0, got {value!r}", None)


def fraction(value: Any) -> Problem | None:
    if (_is_int(value) or isinstance(value, float)) and 0 <= value <= 1:
        return None
    return f" must be between 0 and 1, got {value!r}", None


def one_of(choices: Sequence[str]) -> Check:
    def check(value: Any) -> Problem | None:
        return None if value in choices else (f" must be one of {', '.join(choices)}, got {value!r}", None)

    return check


def a_name(what: str) -> Check:
    """A non-empty string, resolved later against a registry (which names what exists)."""
    def check(value: Any) -> Problem | None:
        return None if isinstance(value, str) and value else (f" must be {what}, got {value!r}", None)

    return check


def memory_size(parse: Callable[[Any], int]) -> Check:
    """Bytes or a size such as "2GiB", read by `parse` (which raises ValueError saying why not)."""
    def check(value: Any) -> Problem | None:
        try:
            parse(value)
        except ValueError as exc:
            return f": {exc}", None
        return None

    return check


def flag_names(config_class: type) -> Mapping[str, str]:
    """Field name -> its command-line flag, for every field that has one."""
    return {field.name: field.metadata.get("flag") or "--" + field.name.replace("_", "-")
            for field in dataclasses.fields(config_class) if field.metadata.get("cli")}
