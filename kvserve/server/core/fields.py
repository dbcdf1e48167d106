"""Request field types every API's body shares: strict numbers, valid Unicode text, documented bounds."""

from __future__ import annotations

import re
from typing import Annotated, Any

from pydantic import AfterValidator, Field, StrictFloat, StrictInt
from pydantic_core import PydanticCustomError

# Strict numbers: "0.7" (a string) is a type error, as in OpenAI's API; ints are accepted as floats.
Number = StrictFloat | StrictInt
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def _valid_text(value: str) -> str:
    # JSON can spell a lone surrogate ("\ud800"); Python keeps it, but no tokenizer or UTF-8
    # encoder accepts it. Refuse it here, where the error can name the field.
    if not value.isascii() and (match := _LONE_SURROGATE.search(value)):
        raise PydanticCustomError(
            "lone_surrogate", "contains a lone surrogate (U+{code}) at character {position}: not valid Unicode text",
            {"code": f"{ord(match.group()):04X}", "position": match.start()})
    return value


# Every string a request carries.
Text = Annotated[str, AfterValidator(_valid_text)]


def bounded(default: Any = None, **bounds: Any) -> Any:
    """A field whose range is documented in the OpenAPI schema (JSON Schema keywords) and enforced
    by SamplingParams or the API's own checks, which word the errors the same way for the offline API."""
    return Field(default, json_schema_extra=bounds)
