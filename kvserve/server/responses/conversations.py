"""OpenAI's Conversations API (`/v1/conversations` and its items) and `conversation` on `responses.create`.

A conversation keeps its items (OpenAI's shapes, with ids) and, while they are exactly what its last
response saw and said, that response's exact token ids (`state`, a StoredResponse's JSON): the next turn
then continues those ids as previous_response_id does, so each turn hits every block the previous one
computed. Adding or deleting items by hand drops the state; the next turn renders the items through the
one prompt builder (its prefix still hits where it is unchanged). Conversations live in the Responses
store (`--responses-store-path`: `conv_*.json` beside the responses, so a restart keeps them), per tenant:
another tenant's conversation is a 404. Two turns racing on one conversation: the last to finish wins.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import ClassVar

from kvserve.server.core.errors import APIError, bad_request
from kvserve.server.responses.protocol import (MAX_METADATA_KEYS, ConversationCreate, ConversationItemsCreate,
                                               ConversationUpdate, InputMessage, ResponsesRequest)
from kvserve.server.responses.store import ResponsesStore, StoredResponse

MAX_ITEMS_PER_CALL = 20  # as OpenAI: items given at creation or added at once
_ID_PATTERN = r"conv_[0-9a-f]{32}"


@dataclass(frozen=True, slots=True)
class StoredConversation:
    PREFIX: ClassVar[str] = "conv_"

    conversation_id: str
    tenant: str
    created_at: int
    metadata: dict
    items: tuple[dict, ...]
    state: dict | None = None  # the last response's StoredResponse JSON while the items are what it saw

    @property
    def key(self) -> str:
        return self.conversation_id

    @property
    def num_bytes(self) -> int:
        return len(json.dumps(self.to_json(), ensure_ascii=False))

    def to_json(self) -> dict:
        return {"version": 1, "conversation_id": self.conversation_id, "tenant": self.tenant,
                "created_at": self.created_at, "metadata": self.metadata, "items": list(self.items),
                "state": self.state}

    @classmethod
    def from_json(cls, data: dict) -> "StoredConversation":
        if data.get("version") != 1 or not re.fullmatch(_ID_PATTERN, str(data["conversation_id"])):
            raise ValueError("not a stored conversation of this version")
        if not isinstance(data["metadata"], dict) or not all(isinstance(i, dict) for i in data["items"]):
            raise ValueError("malformed metadata or items")
        state = data.get("state")
        if state is not None:
            StoredResponse.from_json(state)  # raises for a malformed one
        return cls(data["conversation_id"], str(data["tenant"]), int(data["created_at"]), data["metadata"],
                   tuple(data["items"]), state)

    def body(self) -> dict:
        return {"id": self.conversation_id, "object": "conversation", "created_at": self.created_at,
                "metadata": self.metadata}


def conversation_not_found(conversation_id: str) -> APIError:
    return APIError(404, f"Conversation with id '{conversation_id}' not found.", param="conversation_id",
                    code="not_found")


def _checked_items(items: list[InputMessage], param: str) -> list[dict]:
    """Input items as a conversation keeps them (validated as responses.create validates input), with ids."""
    if len(items) > MAX_ITEMS_PER_CALL:
        raise bad_request(f"{param} has {len(items)} items; at most {MAX_ITEMS_PER_CALL} at a time", param)
    return [_with_id(message.item(), message.type) for message in items]


def _with_id(item: dict, kind: str) -> dict:
    prefix = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "compaction": "cmp",
              "reasoning": "rs"}[kind]
    entry = {"id": f"{prefix}_{uuid.uuid4().hex}", **item}
    return {**entry, "status": "completed"} if kind == "message" else entry


def _metadata(metadata: dict[str, str] | None) -> dict:
    if metadata is not None and len(metadata) > MAX_METADATA_KEYS:
        raise bad_request(f"metadata has {len(metadata)} keys; at most {MAX_METADATA_KEYS}", "metadata")
    return metadata or {}


class ConversationsServing:
    def __init__(self, store: ResponsesStore) -> None:
        self.store = store  # of StoredConversation

    def _get(self, conversation_id: str, tenant: str) -> StoredConversation:
        entry = self.store.get(conversation_id, tenant)
        if entry is None:  # another tenant's reads exactly like one that never existed
            raise conversation_not_found(conversation_id)
        return entry

    # --- /v1/conversations -------------------------------------------------------------

    def create(self, body: ConversationCreate, tenant: str) -> dict:
        items = _checked_items(body.items or [], "items")
        entry = StoredConversation(f"conv_{uuid.uuid4().hex}", tenant, int(time.time()), _metadata(body.metadata),
                                   tuple(items))
        self.store.put(entry)
        return entry.body()

    def retrieve(self, conversation_id: str, tenant: str) -> dict:
        return self._get(conversation_id, tenant).body()

    def update(self, conversation_id: str, body: ConversationUpdate, tenant: str) -> dict:
        entry = replace(self._get(conversation_id, tenant), metadata=_metadata(body.metadata))
        self.store.put(entry)
        return entry.body()

    def delete(self, conversation_id: str, tenant: str) -> dict:
        if not self.store.delete(conversation_id, tenant):
            raise conversation_not_found(conversation_id)
        return {"id": conversation_id, "object": "conversation.deleted", "deleted": True}

    # --- items ------------------------------------------------------------------------

    def list_items(self, conversation_id: str, tenant: str, limit: int, order: str, after: str | None) -> dict:
        items = list(self._get(conversation_id, tenant).items)
        if not 1 <= limit <= 100:
            raise bad_request(f"limit must be between 1 and 100, got {limit}", "limit")
        if order not in ("asc", "desc"):
            raise bad_request(f"order must be 'asc' or 'desc', got {order!r}", "order")
        if order == "desc":
            items.reverse()
        if after is not None:
            ids = [item["id"] for item in items]
            if after not in ids:
                raise bad_request(f"no item with id '{after}' in this conversation", "after")
            items = items[ids.index(after) + 1:]
        return _page(items[:limit], len(items) > limit)

    def add_items(self, conversation_id: str, body: ConversationItemsCreate, tenant: str) -> dict:
        added = _checked_items(body.items, "items")
        entry = self._get(conversation_id, tenant)
        self.store.put(replace(entry, items=entry.items + tuple(added), state=None))  # the ids no longer match
        return _page(added, False)

    def get_item(self, conversation_id: str, item_id: str, tenant: str) -> dict:
        for item in self._get(conversation_id, tenant).items:
            if item["id"] == item_id:
                return item
        raise APIError(404, f"Item with id '{item_id}' not found.", param="item_id", code="not_found")

    def delete_item(self, conversation_id: str, item_id: str, tenant: str) -> dict:
        entry = self._get(conversation_id, tenant)
        kept = tuple(item for item in entry.items if item["id"] != item_id)
        if len(kept) == len(entry.items):
            raise APIError(404, f"Item with id '{item_id}' not found.", param="item_id", code="not_found")
        entry = replace(entry, items=kept, state=None)
        self.store.put(entry)
        return entry.body()

    # --- responses.create(conversation=...) ----------------------------------------------

    def continued(self, body: ResponsesRequest, tenant: str
                  ) -> tuple[ResponsesRequest, StoredResponse | None, Callable[[StoredResponse], None]]:
        """(the request as it runs, the stored turn it continues token-exactly or None, what to call with the
        finished turn): with a state, the stored ids continue; without, the items are the input's head."""
        entry = self._get(body.conversation_id, tenant)
        previous = StoredResponse.from_json(entry.state) if entry.state is not None else None
        if previous is None and entry.items:
            new = body.input if isinstance(body.input, list) else \
                [InputMessage(type="message", role="user", content=body.input)]
            body = body.model_copy(update={"input": [InputMessage.model_validate(item) for item in entry.items] + new})
        num_history = len(entry.items) if previous is None else 0  # items of the input that are already kept

        def finished(turn: StoredResponse) -> None:
            current = self.store.get(entry.conversation_id, tenant)
            if current is None:  # deleted while the turn ran
                return
            new_items = turn.input_items[num_history:]
            self.store.put(replace(current, items=current.items + new_items + tuple(turn.body["output"]),
                                   state=turn.to_json()))

        return body, previous, finished


def _page(items: list[dict], has_more: bool) -> dict:
    return {"object": "list", "data": items, "first_id": items[0]["id"] if items else None,
            "last_id": items[-1]["id"] if items else None, "has_more": has_more}
