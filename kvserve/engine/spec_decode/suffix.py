"""Suffix decoding (Snowflake's, vLLM's `method: "suffix"`): drafts from what earlier requests generated.

An agent repeats itself: the same tool call with one field changed, the same
file re-emitted after an edit, the same boilerplate answer. Prompt lookup
cannot draft those when the prompt does not hold them; an index over past
outputs can. Each finished request's output (with the few prompt tokens before
it, so its first tokens can be drafted too) is indexed by its n-grams; a
request looks up its longest suffix there and drafts what followed.

Per tenant (the request's cache_salt, the same isolation as the prefix cache):
one tenant's outputs never draft another tenant's tokens, so no output leaks
across tenants through a draft, nor through its timing. Bounded: each tenant
keeps its most recent `max_tokens_per_tenant` tokens of output, and the least
recently used tenants are dropped past `max_tenants`.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence

from kvserve.engine.spec_decode.ngram import NgramProposer


class OutputIndex:
    """One tenant's past outputs and, for every n-gram in them, where it last occurred."""

    def __init__(self, min_n: int, max_n: int, max_tokens: int) -> None:
        self.min_n, self.max_n, self.max_tokens = min_n, max_n, max_tokens
        self._docs: dict[int, list[int]] = {}
        self._order: deque[int] = deque()  # doc ids, oldest first
        self._next_id = 0
        self.num_tokens = 0
        # n-gram -> (doc id, index of the token after it): the most recent occurrence wins.
        self._grams: dict[tuple[int, ...], tuple[int, int]] = {}

    def add(self, tokens: list[int]) -> None:
        if len(tokens) <= self.min_n or len(tokens) > self.max_tokens:
            return
        doc_id, self._next_id = self._next_id, self._next_id + 1
        self._docs[doc_id] = tokens
        self._order.append(doc_id)
        self.num_tokens += len(tokens)
        for n in range(self.min_n, self.max_n + 1):
            for end in range(n, len(tokens)):
                self._grams[tuple(tokens[end - n:end])] = (doc_id, end)
        while self.num_tokens > self.max_tokens:
            self._evict(self._order.popleft())

    def _evict(self, doc_id: int) -> None:
        tokens = self._docs.pop(doc_id)
        self.num_tokens -= len(tokens)
        for n in range(self.min_n, self.max_n + 1):
            for end in range(n, len(tokens)):
                key = tuple(tokens[end - n:end])
                if self._grams.get(key, (None,))[0] == doc_id:
                    del self._grams[key]

    def lookup(self, token_ids: Sequence[int], max_tokens: int) -> tuple[int, list[int]]:
        """(match length, continuation) of the longest suffix of `token_ids` seen in a past output."""
        for n in range(min(self.max_n, len(token_ids)), self.min_n - 1, -1):
            hit = self._grams.get(tuple(token_ids[-n:]))
            if hit is not None:
                doc_id, end = hit
                return n, self._docs[doc_id][end:end + max_tokens]
        return 0, []


class SuffixProposer:
    """Drafts from the tenant's past outputs, or from the request itself (prompt lookup), whichever
    matches the longer suffix."""

    def __init__(self, min_n: int = 3, max_n: int = 8, prompt_min_n: int = 2, prompt_max_n: int = 5,
                 max_tokens_per_tenant: int = 65536, max_tenants: int = 64) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        self.min_n, self.max_n = min_n, max_n
        self.prompt_lookup = NgramProposer(prompt_min_n, prompt_max_n)
        self.max_tokens_per_tenant = max_tokens_per_tenant
        self.max_tenants = max_tenants
        self._tenants: OrderedDict[str | None, OutputIndex] = OrderedDict()

    def propose(self, request_id: str, token_ids: Sequence[int], max_tokens: int, tenant: str | None = None
                ) -> list[int]:
        own_n, own = self.prompt_lookup.lookup(request_id, token_ids, max_tokens)
        index = self._tenants.get(tenant)
        if index is None:
            return own
        self._tenants.move_to_end(tenant)
        past_n, past = index.lookup(token_ids, max_tokens)
        return past if past_n > own_n or (past_n == own_n and len(past) > len(own)) else own

    def observe(self, request_id: str, num_proposed: int, num_accepted: int) -> None:
        """The index learns from finished outputs (finish), not from acceptance."""

    def finish(self, request_id: str, tenant: str | None, token_ids: Sequence[int], num_prompt_tokens: int) -> None:
        """Index a finished request's output, with the prompt's last tokens before it (none: it was aborted
        or failed, and only its state goes)."""
        self.prompt_lookup.finish(request_id, tenant, token_ids, num_prompt_tokens)
        if len(token_ids) <= num_prompt_tokens:
            return
        index = self._tenants.get(tenant)
        if index is None:
            index = self._tenants[tenant] = OutputIndex(self.min_n, self.max_n, self.max_tokens_per_tenant)
            if len(self._tenants) > self.max_tenants:
                self._tenants.popitem(last=False)  # the least recently used tenant's index
        self._tenants.move_to_end(tenant)
        index.add(list(token_ids[max(num_prompt_tokens - self.max_n, 0):]))

    def num_indexed_tokens(self, tenant: str | None) -> int:
        index = self._tenants.get(tenant)
        return index.num_tokens if index is not None else 0
