"""While the server idles, its KV pool is committed a piece at a time (Engine.zero_pool_ahead; kv/cache/zeroing.py
says why): pages a step would otherwise fault in, every layer's at once, are in place before the requests come."""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import Executor

from kvserve.engine.engine import Engine

log = logging.getLogger(__name__)


class IdlePoolZeroing:
    """Whether the pool may have pages left to zero ahead, and one piece of them on the compute thread."""

    def __init__(self, engine: Engine, enabled: bool = True) -> None:
        self.engine = engine
        self.enabled = enabled  # off for good once a piece failed: the steps zero what they use, as without it
        self.pending = enabled  # set again after every step, which may have used blocks past the lookahead

    def stepped(self) -> None:
        self.pending = self.enabled

    async def piece(self, executor: Executor | None) -> None:
        """One piece (milliseconds), so that a request arriving meanwhile waits for no more than that."""
        try:
            self.pending = await asyncio.get_running_loop().run_in_executor(executor, self.engine.zero_pool_ahead)
        except Exception:
            log.exception("zeroing the KV pool ahead failed; steps zero their blocks as they use them")
            self.enabled = self.pending = False
