"""Cache breakpoints waiting for their prompt: pinned once it is computed (kv/prefix/pins.py holds the pins)."""

from __future__ import annotations

from collections.abc import Sequence

from kvserve.engine.request import Request
from kvserve.errors import InvalidRequestError
from kvserve.kv.manager import KVCacheManager
from kvserve.kv.prefix.pins import PinRequest, cache_write_tokens


def check_breakpoints(pins: Sequence[PinRequest], num_prompt_tokens: int) -> None:
    bad_pin = next((p for p in pins if not 0 < p.num_tokens <= num_prompt_tokens or p.ttl_s <= 0), None)
    if bad_pin is not None:
        raise InvalidRequestError(f"a cache breakpoint must lie in the prompt ({num_prompt_tokens} tokens) and "
                                  f"have a positive TTL, got {bad_pin}")


class PendingBreakpoints:
    """Per request, the breakpoints to pin once its prompt is computed."""

    def __init__(self, kv_manager: KVCacheManager, block_size: int) -> None:
        self.kv = kv_manager
        self.block_size = block_size
        self._pending: dict[str, tuple[PinRequest, ...]] = {}

    def add(self, request_id: str, pins: Sequence[PinRequest]) -> None:
        if pins:
            self._pending[request_id] = tuple(pins)

    def remove(self, request_id: str) -> None:
        self._pending.pop(request_id, None)

    def prompt_computed(self, request: Request) -> None:
        """A request's prompt is computed (it accepted a token): pin its breakpoints, and count the
        tokens it wrote to the cache at the last one."""
        pins = self._pending.pop(request.request_id, None)
        if not pins:
            return
        for pin in pins:
            self.kv.pin(request.block_hashes, pin.num_tokens, pin.ttl_s)
        last = max(pin.num_tokens for pin in pins)
        self.kv.record_cache_write(cache_write_tokens(last, request.num_cached_tokens or 0, self.block_size))
