"""Cached vs recomputed, step by step: one short prompt through two small engines of the lab's own.

Both engines share the serving engine's loaded model (weights are only read)
but have their own small KV pools, so the serving engine's blocks, prefix
cache and requests are untouched. One keeps its KV cache; the other has
`enable_kv_cache=False` and recomputes the whole sequence every step. Their
steps alternate, each on the compute thread (where the serving engine's steps
run too, so a lab step never overlaps a serving step: they take turns), and
every event is a measurement: the tokens the step computed and the cached
tokens it reused come from the engine's stats snapshot, the time from a clock
around `Engine.step`.

Bounded: at most `max_prompt_tokens` + `max_new_tokens` tokens, one run at a
time (a second gets 429). A run owns an asyncio task, so a client that leaves
mid-run cannot leave a lab engine half-used: the run finishes (a few seconds
at most) and the next one starts clean.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace

from kvserve.arith import cdiv
from kvserve.engine.engine import Engine
from kvserve.engine.sample.sampling import SamplingParams
from kvserve.errors import InvalidRequestError
from kvserve.kv.state.state_spec import state_spec
from kvserve.platform import compute_executor

MODES = ("cached", "recompute")  # with the KV cache, and with enable_kv_cache=False


@dataclass(frozen=True)
class StepsLimits:
    max_prompt_tokens: int = 256
    max_new_tokens: int = 32


class StepsBusyError(Exception):
    """A run is already in progress."""


class StepsRunner:
    def __init__(self, engine: Engine, limits: StepsLimits = StepsLimits()) -> None:
        self.serving_engine = engine
        self.limits = limits
        self._engines: dict[str, Engine] | None = None
        self._task: asyncio.Task | None = None

    @property
    def busy(self) -> bool:
        return self._task is not None and not self._task.done()

    def check(self, token_ids: list[int], max_new_tokens: int) -> None:
        """Raise InvalidRequestError for a run past the limits."""
        if not token_ids:
            raise InvalidRequestError("the prompt is empty", param="prompt")
        if len(token_ids) > self.limits.max_prompt_tokens:
            raise InvalidRequestError(f"the prompt is {len(token_ids)} tokens; the lab runs at most "
                                      f"{self.limits.max_prompt_tokens} (it recomputes all of them every step)",
                                      param="prompt")
        if not 1 <= max_new_tokens <= self.limits.max_new_tokens:
            raise InvalidRequestError(f"max_tokens must be in 1..{self.limits.max_new_tokens}", param="max_tokens")
        self.serving_engine.validate_request(token_ids, SamplingParams(max_tokens=max_new_tokens))

    def start(self, token_ids: list[int], max_new_tokens: int) -> AsyncIterator[dict]:
        """Start a run now (StepsBusyError if one is in progress) and return its events: one per step of
        each engine, then a summary. The run goes on to its end even if nobody reads the events."""
        if self.busy:
            raise StepsBusyError()
        self.check(token_ids, max_new_tokens)
        queue: asyncio.Queue = asyncio.Queue()
        self._task = asyncio.create_task(self._run(token_ids, max_new_tokens, queue), name="kvserve-lab-steps")
        return self._events(queue)

    @staticmethod
    async def _events(queue: asyncio.Queue) -> AsyncIterator[dict]:
        while (event := await queue.get()) is not None:
            yield event

    async def _run(self, token_ids: list[int], max_new_tokens: int, queue: asyncio.Queue) -> None:
        loop = asyncio.get_running_loop()

        def on_compute_thread(fn, *args):
            return loop.run_in_executor(compute_executor(), fn, *args)

        engines: dict[str, Engine] = {}
        try:
            engines = await on_compute_thread(self._get_engines)
            params = SamplingParams(max_tokens=max_new_tokens, temperature=0.0, ignore_eos=True)
            for mode, engine in engines.items():
                await on_compute_thread(lambda e=engine, m=mode: e.add_request(token_ids, params, request_id=m))
            queue.put_nowait({"event": "start", "prompt_tokens": len(token_ids), "max_tokens": max_new_tokens,
                              "num_layers": self.serving_engine.loaded.config.num_layers})
            outputs: dict[str, list[int]] = {mode: [] for mode in engines}
            step = 0
            running = dict(engines)
            while running:
                for mode, engine in list(running.items()):
                    seconds, work, deltas = await on_compute_thread(_timed_step, engine)
                    new_ids = [t for d in deltas for t in d.new_token_ids]
                    outputs[mode] += new_ids
                    queue.put_nowait({"event": "step", "mode": mode, "step": step, "tokens": work.num_tokens,
                                      "reused": work.num_reused_tokens, "ms": seconds * 1000,
                                      "token_ids": new_ids, "text": "".join(d.new_text for d in deltas)})
                    failed = next((d.error for d in deltas if d.error), None)
                    if failed:
                        raise RuntimeError(f"the {mode} run failed: {failed}")
                    if not engine.has_unfinished():  # only the lab's own calls touch it: safe to ask here
                        del running[mode]
                step += 1
            queue.put_nowait({"event": "done", "token_ids": outputs,
                              "same_output": outputs["cached"] == outputs["recompute"]})
        except Exception as exc:  # shown on the page; the serving engine is not involved
            queue.put_nowait({"event": "error", "message": f"{type(exc).__name__}: {exc}"})
        finally:
            for mode, engine in engines.items():  # leaves both pools empty for the next run
                await on_compute_thread(engine.abort, mode)
            queue.put_nowait(None)

    def _get_engines(self) -> dict[str, Engine]:
        """Built once, on the compute thread, the first time the page runs something."""
        if self._engines is None:
            base = self.serving_engine.config
            block_size = base.block_size
            tokens = self.limits.max_prompt_tokens + self.limits.max_new_tokens
            pool_bytes = (cdiv(tokens, block_size) + 1) * block_size * self.serving_engine.kv_spec.bytes_per_token
            # A hybrid model's one request also needs its recurrent states: a live one, one to step into, and
            # one for a snapshot, beside the K/V (the serving engine's share would not fit in so small a pool).
            states = state_spec(self.serving_engine.loaded.config)
            state_bytes = 3 * states.slot_bytes if states is not None else 0
            state_share = {"state_cache_fraction": state_bytes / (pool_bytes + state_bytes)} if states else {}
            # One request, one step per token, and no prefix cache: step 0 always computes the whole prompt.
            # No disk tier either: these engines share nothing, and a tier needs prefix caching. No drafting:
            # a verify step computes several tokens, and the page shows one token per step.
            small = replace(base, kv_cache_memory=pool_bytes + state_bytes, max_num_seqs=1,
                            enable_prefix_caching=False, max_num_batched_tokens=max(base.max_num_batched_tokens, tokens),
                            kv_disk_path=None, speculative="off", **state_share)
            loaded = self.serving_engine.loaded
            self._engines = {"cached": Engine(small, loaded=loaded),
                             "recompute": Engine(replace(small, enable_kv_cache=False), loaded=loaded)}
        return self._engines


def _timed_step(engine: Engine):
    started = time.perf_counter()
    deltas = engine.step()
    return time.perf_counter() - started, engine.stats().last_step, deltas
