"""Tier reads off the compute thread: a step never waits on a disk.

The runner submits a request's load when the scheduler admits it and, at the
start of each step, takes the reads that have arrived (and copies them into
the pool itself: this module holds no tensors). Everything here but the read
runs on the engine's thread, so the table of reads needs no lock; a read
whose request went away meanwhile (an abort) runs to its end on its thread
and is dropped unseen.
"""

from __future__ import annotations

from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait

from kvserve.kv.tiers.connector import Payload, TierConnector, TierLoad

# One thread: a request's blocks are one sequential run of files, and a second reader would only take
# a core from the forward on a 2-core machine.
_READER_THREADS = 1


class TierReader:
    """Loads in flight, by request id."""

    def __init__(self, connector: TierConnector, num_threads: int = _READER_THREADS) -> None:
        self.connector = connector
        self._threads = ThreadPoolExecutor(max_workers=num_threads, thread_name_prefix="kvserve-kv-tier-reader")
        self._reads: dict[str, tuple[TierLoad, Future]] = {}

    def submit(self, load: TierLoad) -> None:
        if load.request_id in self._reads:
            raise ValueError(f"request {load.request_id} already has a load in flight")
        self._reads[load.request_id] = (load, self._threads.submit(self.connector.load, load.hit))

    def cancel(self, request_id: str) -> None:
        """Forget a request's load: what it reads is never handed out (its blocks may be someone else's)."""
        read = self._reads.pop(request_id, None)
        if read is not None:
            read[1].cancel()  # not started yet: it never runs

    def in_flight(self) -> dict[str, TierLoad]:
        return {request_id: load for request_id, (load, _) in self._reads.items()}

    def take_arrived(self) -> list[tuple[TierLoad, list[Payload], BaseException | None]]:
        """The loads whose read has ended, in submission order: their payloads (a leading run of the keys,
        shorter where an entry was missing or bad), or the exception the read raised."""
        arrived = []
        for request_id in [request_id for request_id, (_, future) in self._reads.items() if future.done()]:
            load, future = self._reads.pop(request_id)
            error = future.exception()
            arrived.append((load, [] if error is not None else future.result(), error))
        return arrived

    def wait(self, timeout_s: float) -> None:
        """Until some read ends, or `timeout_s` passes (for an engine with nothing else to do)."""
        if self._reads:
            wait([future for _, future in self._reads.values()], timeout=timeout_s, return_when=FIRST_COMPLETED)

    def close(self) -> None:
        for request_id in list(self._reads):
            self.cancel(request_id)
        self._threads.shutdown(wait=True)
