"""The engine driven from asyncio: a step loop that never blocks the event loop.

One task owns the Engine. Between steps it applies what handlers asked for
(add, abort, inspect) in arrival order; each step itself runs on the compute
thread (torch releases the GIL while it computes), so the event loop
keeps accepting connections and streaming tokens while the model runs. (Build
the Engine on that same thread, `platform.run_on_compute_thread`: see there why.)
Because every engine call happens either in that task between steps or in the
step itself, the Engine never sees two callers at once.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import Executor
from typing import Any, TypeVar

from kvserve.engine.engine import Engine
from kvserve.engine.idle_zeroing import IdlePoolZeroing
from kvserve.engine.output.types import RequestDelta
from kvserve.engine.sample.sampling import SamplingParams
from kvserve.errors import KVServeError, RequestFailedError
from kvserve.kv.prefix.pins import PinRequest
from kvserve.platform import compute_executor

log = logging.getLogger(__name__)

T = TypeVar("T")

_DRAIN_POLL_S = 0.05  # how often drain() looks whether the requests in flight are done


class EngineFailedError(KVServeError):
    """A step raised: the requests in flight were aborted (the server answers 500)."""


class AsyncEngine:
    """`generate()` streams one request's deltas; `call()` runs a function on the engine between steps.

    `observers` are called with every RequestDelta the loop produces (metrics,
    request logs), on the event loop thread.
    """

    def __init__(self, engine: Engine, observers: list[Callable[[RequestDelta], None]] | None = None,
                 step_executor: Executor | None = None, zero_pool_ahead: bool = True) -> None:
        """`zero_pool_ahead=False` leaves the pool's pages to the steps that first use them (bench/pool_zeroing.py)."""
        self.engine = engine
        self._step_executor = step_executor  # None: platform.compute_executor()
        self.observers = list(observers or [])
        self._calls: list[tuple[Callable[[], Any], asyncio.Future]] = []
        self._streams: dict[str, asyncio.Queue] = {}
        self._wakeup: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self.draining = False  # set by drain(): the server refuses new requests from then on
        self._drain_deadline = math.inf  # loop.time() after which drain() aborts what is left
        self.num_pending_adds = 0  # accepted by a handler, not yet in the scheduler
        self.pool_zeroing = IdlePoolZeroing(engine, zero_pool_ahead)  # the loop's work while idle
        # Per tenant: requests accepted whose first delta has not come yet (the per-tenant queue limit).
        self.num_unstarted_by_tenant: Counter = Counter()

    async def start(self) -> None:
        self._wakeup = asyncio.Event()
        self._task = asyncio.create_task(self._loop(), name="kvserve-engine-loop")

    async def stop(self) -> None:
        """End the step loop; a request still in flight first gets its final delta (finish_reason "abort")."""
        await self.drain(0)
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass

    async def drain(self, timeout: float) -> int:
        """Let the requests in flight finish for up to `timeout` seconds, then abort the rest; returns how many
        were aborted. Every stream ends with a final delta (finished; "abort" for those cut short), never an
        exception. Sets `draining` for good, so the server can refuse new requests; a request that still
        arrives is in flight like the others. A second call with a shorter timeout brings the deadline forward.
        """
        self.draining = True
        loop = asyncio.get_running_loop()
        self._drain_deadline = min(self._drain_deadline, loop.time() + timeout)
        num_aborted = 0
        # `_streams` is the in-flight set (added by generate(), removed when a request finishes or its
        # consumer leaves): no engine state is read off the loop.
        while self._streams and self.running:
            if loop.time() >= self._drain_deadline:
                num_aborted += await self.call(self._abort_streams)
                if not self._streams:
                    break
            await asyncio.sleep(_DRAIN_POLL_S)
        return num_aborted

    @property
    def running(self) -> bool:
        """Whether the step loop is alive (health)."""
        return self._task is not None and not self._task.done()

    @property
    def num_in_flight(self) -> int:
        """Requests someone is waiting on (accepted, not finished, consumer still there)."""
        return len(self._streams)

    @property
    def num_waiting(self) -> int:
        """Requests accepted but not running yet (for the bounded queue)."""
        return self.num_pending_adds + self.engine.stats().num_waiting

    def call(self, fn: Callable[[], T]) -> asyncio.Future:
        """Run `fn()` on the engine between steps; the future gets its result or exception.

        `fn` runs even if the caller stops waiting: an add whose caller went
        away is followed by that caller's abort, never silently dropped.
        """
        future = asyncio.get_running_loop().create_future()
        self._calls.append((fn, future))
        self._wakeup.set()
        return future

    def generate(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str,
        cache_salt: str | None = None,
        pins: Sequence[PinRequest] = (),
        tenant: str | None = None,
        priority: int = 0,
    ) -> AsyncIterator[RequestDelta]:
        """Queue a request now and return the stream of its deltas until it finishes (feed them to a
        RequestOutputAssembler for the final output).

        The request counts as waiting from this call on (so the bounded queue
        sees it at once). Invalid requests raise InvalidRequestError from the
        first iteration. A consumer that stops early (client gone, task
        cancelled) aborts the request, which frees its blocks. `tenant` and `priority`: Engine.add_request.
        """
        arrival = time.perf_counter()  # TTFT includes the wait for the step in flight
        queue: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = queue
        self.num_pending_adds += 1
        self.num_unstarted_by_tenant[tenant] += 1

        def add() -> None:
            try:
                self.engine.add_request(prompt_token_ids, params, request_id, cache_salt, arrival_time=arrival,
                                        pins=pins, tenant=tenant, priority=priority)
            except Exception:
                self._streams.pop(request_id, None)  # even if nobody ever reads the stream
                raise
            finally:
                self.num_pending_adds -= 1

        if params.structured_outputs is None:
            return self._stream(request_id, queue, self.call(add), tenant)
        return self._stream(request_id, queue, asyncio.ensure_future(self._compile_then_add(request_id, params, add)),
                            tenant)

    async def _compile_then_add(self, request_id: str, params: SamplingParams, add: Callable[[], None]) -> None:
        """Compile a structured output's grammar on a worker thread (bounded in time, then cached), then add
        the request between steps (its add finds the grammar cached): neither the event loop nor the steps
        of other requests wait for a compilation."""
        try:
            await asyncio.get_running_loop().run_in_executor(None, self.engine.constrained.compile, params)
        except BaseException:  # a grammar that does not compile, or the caller gone meanwhile
            self._streams.pop(request_id, None)
            self.num_pending_adds -= 1
            raise
        await self.call(add)

    async def _stream(self, request_id: str, queue: asyncio.Queue, added: asyncio.Future, tenant: str | None
                      ) -> AsyncIterator[RequestDelta]:
        done = False  # finished, failed, or never added: nothing to abort
        started = False
        try:
            try:
                await added
            except asyncio.CancelledError:
                raise  # the add still runs: abort below
            except Exception:
                done = True  # rejected (or a duplicate id, which must not abort the request that owns it)
                raise
            while True:
                item = await queue.get()
                if isinstance(item, Exception):
                    done = True  # the loop already aborted it
                    raise item
                done = item.finished
                if not started:
                    started = True
                    self._started(tenant)
                yield item
                if done:
                    return
        finally:
            self._streams.pop(request_id, None)
            if not started:
                self._started(tenant)
            if not done:
                self.abort(request_id)

    def _started(self, tenant: str | None) -> None:
        self.num_unstarted_by_tenant[tenant] -= 1
        if self.num_unstarted_by_tenant[tenant] <= 0:
            del self.num_unstarted_by_tenant[tenant]

    def abort(self, request_id: str) -> None:
        """Stop a request wherever it is; safe to call for finished or unknown ids."""
        self.call(lambda: self._abort_now(request_id))

    def _abort_now(self, request_id: str) -> None:
        output = self.engine.abort(request_id)
        if output is not None:
            self._deliver(output)

    def _abort_streams(self) -> int:
        """Abort every request someone is waiting on, delivering each one's final delta (between steps)."""
        num_streams = len(self._streams)
        for request_id in list(self._streams):
            self._abort_now(request_id)  # its final delta ends the stream and removes it
        return num_streams - len(self._streams)

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        executor = self._step_executor or compute_executor()
        while True:
            self._run_calls()
            if not self.engine.has_unfinished():
                self._wakeup.clear()
                if not self._calls:
                    if self.pool_zeroing.pending:  # idle: commit the pool's next pages now, not in a step
                        await self.pool_zeroing.piece(executor)
                    else:
                        await self._wakeup.wait()
                continue
            self.pool_zeroing.stepped()
            try:
                outputs = await loop.run_in_executor(executor, self.engine.step)
            except Exception as exc:  # a bug or an allocation failure: fail what is in flight, keep serving
                log.exception("engine step failed; aborting the requests in flight")
                self._fail_all(EngineFailedError(f"the engine failed while running this request: {exc}"))
                continue
            for output in outputs:
                self._deliver(output)

    def _run_calls(self) -> None:
        calls, self._calls = self._calls, []
        for fn, future in calls:
            try:
                result = fn()
            except Exception as exc:
                if not future.cancelled():
                    future.set_exception(exc)
            else:
                if not future.cancelled():
                    future.set_result(result)

    def _fail_all(self, error: Exception) -> None:
        for request_id in self.engine.unfinished_request_ids():
            queue = self._streams.pop(request_id, None)
            self._abort_now(request_id)
            if queue is not None:
                queue.put_nowait(error)

    def _deliver(self, output: RequestDelta) -> None:
        """To the observers, then to the request's stream (dropped from the table once finished)."""
        self._notify(output)
        queue = self._streams.pop(output.request_id, None) if output.finished else self._streams.get(output.request_id)
        if queue is not None:
            # A request that failed alone ends its own stream with the error (the server answers 500).
            queue.put_nowait(output if output.error is None else RequestFailedError(output.request_id, output.error))

    def _notify(self, output: RequestDelta) -> None:
        for observer in self.observers:
            try:
                observer(output)
            except Exception:  # an observer must never stop the loop
                log.exception("request observer failed")
