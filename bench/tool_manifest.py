"""A realistic ~20-tool manifest (OpenAI function tools) and one valid call, shared by the structured-output
benchmarks: the schema a `tool_choice: required` request constrains its output to."""

from __future__ import annotations

_STRING = {"type": "string"}
_TOOLS = {
    "get_weather": ({"city": _STRING, "unit": {"enum": ["celsius", "fahrenheit"]}}, ["city"]),
    "search_web": ({"query": _STRING, "max_results": {"type": "integer", "minimum": 1, "maximum": 50}}, ["query"]),
    "read_file": ({"path": _STRING, "start_line": {"type": "integer"}, "end_line": {"type": "integer"}}, ["path"]),
    "write_file": ({"path": _STRING, "content": _STRING, "overwrite": {"type": "boolean"}}, ["path", "content"]),
    "list_directory": ({"path": _STRING, "recursive": {"type": "boolean"}}, ["path"]),
    "run_shell_command": ({"command": _STRING, "timeout_seconds": {"type": "number"}}, ["command"]),
    "send_email": ({"to": {"type": "array", "items": _STRING}, "subject": _STRING, "body": _STRING,
                    "priority": {"enum": ["low", "normal", "high"]}}, ["to", "subject", "body"]),
    "create_calendar_event": ({"title": _STRING, "start_time": _STRING, "end_time": _STRING,
                               "attendees": {"type": "array", "items": _STRING}, "location": _STRING},
                              ["title", "start_time", "end_time"]),
    "query_database": ({"sql": _STRING, "database": {"enum": ["analytics", "billing", "users"]},
                        "limit": {"type": "integer", "minimum": 1}}, ["sql", "database"]),
    "translate_text": ({"text": _STRING, "source_language": _STRING, "target_language": _STRING}, ["text", "target_language"]),
    "get_stock_price": ({"ticker": _STRING, "exchange": {"enum": ["NYSE", "NASDAQ", "LSE", "TSE"]}}, ["ticker"]),
    "convert_currency": ({"amount": {"type": "number"}, "from_currency": _STRING, "to_currency": _STRING},
                         ["amount", "from_currency", "to_currency"]),
    "create_github_issue": ({"repository": _STRING, "title": _STRING, "body": _STRING,
                             "labels": {"type": "array", "items": _STRING}}, ["repository", "title"]),
    "summarize_document": ({"document_id": _STRING, "max_words": {"type": "integer", "minimum": 10}}, ["document_id"]),
    "set_reminder": ({"message": _STRING, "remind_at": _STRING, "repeat": {"enum": ["never", "daily", "weekly"]}},
                     ["message", "remind_at"]),
    "get_directions": ({"origin": _STRING, "destination": _STRING,
                        "mode": {"enum": ["driving", "walking", "transit", "cycling"]}}, ["origin", "destination"]),
    "book_restaurant": ({"restaurant_name": _STRING, "party_size": {"type": "integer", "minimum": 1},
                         "date_time": _STRING, "special_requests": _STRING}, ["restaurant_name", "party_size", "date_time"]),
    "create_invoice": ({"customer": {"type": "object", "properties": {"name": _STRING, "email": _STRING},
                                     "required": ["name"], "additionalProperties": False},
                        "line_items": {"type": "array", "items": {
                            "type": "object", "properties": {"description": _STRING, "quantity": {"type": "integer"},
                                                             "unit_price": {"type": "number"}},
                            "required": ["description", "quantity", "unit_price"], "additionalProperties": False}}},
                       ["customer", "line_items"]),
    "analyze_sentiment": ({"text": _STRING, "granularity": {"enum": ["document", "sentence"]}}, ["text"]),
    "fetch_url": ({"url": _STRING, "method": {"enum": ["GET", "POST"]}, "headers": {"type": "object"}}, ["url"]),
}


def tool_call_schema() -> dict:
    """One call of any tool: {"name": <tool>, "arguments": <its parameters>}."""
    return {"anyOf": [
        {"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
         "properties": {"name": {"const": name}, "arguments": {
             "type": "object", "properties": properties, "required": required, "additionalProperties": False}}}
        for name, (properties, required) in _TOOLS.items()]}


SAMPLE_CALL = ('{"name": "create_invoice", "arguments": {"customer": {"name": "Ada Lovelace", "email": '
               '"ada@example.com"}, "line_items": [{"description": "Analytical engine maintenance", "quantity": 3, '
               '"unit_price": 199.5}, {"description": "Punched cards", "quantity": 500, "unit_price": 0.02}]}}')
