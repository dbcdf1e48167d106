"""The asyncio driver on a tiny model: streams, aborts by cancellation, failures that do not stop the loop."""

import asyncio
from concurrent.futures import Executor, Future

import pytest

from kvserve.engine.async_engine import AsyncEngine, EngineFailedError
from kvserve.engine.output.types import RequestOutputAssembler
from kvserve.engine.sample.sampling import SamplingParams
from kvserve.errors import InvalidRequestError
from tests.engine.test_engine import make_engine

PROMPT = [5, 17, 33, 2, 90, 41, 7]


class InlineExecutor(Executor):
    """Steps on the calling thread. torch work on a second thread would give the test process a
    second OpenMP team and slow every later test (see platform.compute_executor); the real
    threaded path is exercised by the server tests, in their own process."""

    def submit(self, fn, *args, **kwargs):
        future = Future()
        try:
            future.set_result(fn(*args, **kwargs))
        except Exception as exc:
            future.set_exception(exc)
        return future


def async_engine_for(engine, **kwargs) -> AsyncEngine:
    return AsyncEngine(engine, step_executor=InlineExecutor(), **kwargs)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, timeout=60))


async def started(engine):
    async_engine = async_engine_for(engine)
    await async_engine.start()
    return async_engine


def test_streams_match_the_synchronous_engine(tiny_models):
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    sync_engine = make_engine(tiny_models())
    sync_engine.add_request(PROMPT, params)
    assembler, expected = RequestOutputAssembler(), None
    while sync_engine.has_unfinished():
        expected = assembler.add(sync_engine.step()[0]) or expected
    expected = expected.outputs[0].token_ids

    async def main():
        async_engine = await started(make_engine(tiny_models()))
        streams = [async_engine.generate(PROMPT, params, f"r{i}") for i in range(3)]

        async def consume(stream):
            return [output async for output in stream]

        results = await asyncio.gather(*(consume(s) for s in streams))
        await async_engine.stop()
        return results

    for outputs in run(main()):
        final = RequestOutputAssembler.assemble(outputs)
        assert outputs[-1].finished and final.outputs[0].token_ids == expected
        assert sum(len(o.new_token_ids) for o in outputs) == 10


def test_a_consumer_that_stops_early_aborts_and_frees_its_blocks(tiny_models):
    engine = make_engine(tiny_models())
    seen = []

    async def main():
        async_engine = async_engine_for(engine, observers=[seen.append])
        await async_engine.start()
        stream = async_engine.generate(PROMPT, SamplingParams(max_tokens=200, temperature=0, ignore_eos=True), "long")
        num_tokens = 0
        async for output in stream:
            num_tokens += len(output.new_token_ids)
            if num_tokens >= 3:
                break
        await stream.aclose()
        await async_engine.call(lambda: None)  # the abort ran before this
        await async_engine.stop()

    run(main())
    assert not engine.has_unfinished()
    engine.check_integrity()
    assert seen[-1].finished and seen[-1].finish_reason == "abort"


def test_invalid_requests_raise_from_the_stream_and_leave_nothing(tiny_models):
    engine = make_engine(tiny_models())

    async def main():
        async_engine = await started(engine)
        stream = async_engine.generate([10**6], SamplingParams(), "bad")
        with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
            await stream.__anext__()
        assert async_engine.num_waiting == 0
        await async_engine.stop()

    run(main())
    engine.check_integrity()


def test_a_failing_step_fails_its_requests_and_the_loop_goes_on(tiny_models, monkeypatch):
    engine = make_engine(tiny_models())
    real_step = engine.step
    calls = {"n": 0}

    def flaky_step():
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("simulated allocation failure")
        return real_step()

    monkeypatch.setattr(engine, "step", flaky_step)

    async def main():
        async_engine = await started(engine)
        params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
        with pytest.raises(EngineFailedError, match="simulated"):
            async for _ in async_engine.generate(PROMPT, params, "victim"):
                pass
        outputs = [o async for o in async_engine.generate(PROMPT, params, "after")]
        assert async_engine.running
        await async_engine.stop()
        return outputs

    assert RequestOutputAssembler.assemble(run(main())).outputs[0].finish_reason == "length"
    engine.check_integrity()


async def idle_until(condition, timeout_s: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "the loop never got there while idle"
        await asyncio.sleep(0.001)


def test_an_idle_loop_zeroes_the_pool_ahead_and_a_cache_hit_after_it_gives_the_same_tokens(tiny_models):
    engine = make_engine(tiny_models())
    zeroing = engine.kv_cache.zeroing
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)

    async def main():
        async_engine = await started(engine)
        await idle_until(lambda: zeroing.zeroed_upto >= min(engine.kv_cache.num_blocks, zeroing.lookahead_blocks))
        assert zeroing.used_upto == 0  # no step ran: what was zeroed was zeroed ahead
        cold = [o async for o in async_engine.generate(PROMPT, params, "cold")]
        used = zeroing.used_upto
        lookahead_end = min(engine.kv_cache.num_blocks, used + zeroing.lookahead_blocks)
        await idle_until(lambda: zeroing.zeroed_upto >= lookahead_end)
        cached = [o async for o in async_engine.generate(PROMPT, params, "cached")]
        await async_engine.stop()
        return cold, cached

    cold, cached = run(main())
    assert RequestOutputAssembler.assemble(cached).outputs[0].token_ids == \
        RequestOutputAssembler.assemble(cold).outputs[0].token_ids
    assert engine.stats().prefix_cache_hits > 0  # the second request read the first one's blocks
    engine.check_integrity()


def test_zeroing_ahead_that_fails_is_logged_once_and_the_loop_serves_on(tiny_models, monkeypatch, caplog):
    engine = make_engine(tiny_models())
    calls = {"n": 0}

    def broken() -> bool:
        calls["n"] += 1
        raise RuntimeError("simulated zeroing failure")

    monkeypatch.setattr(engine, "zero_pool_ahead", broken)

    async def main():
        async_engine = await started(engine)
        await idle_until(lambda: calls["n"] > 0)
        params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
        outputs = [[o async for o in async_engine.generate(PROMPT, params, f"r{i}")] for i in range(2)]
        await async_engine.call(lambda: None)
        await async_engine.stop()
        return outputs

    for outputs in run(main()):
        assert RequestOutputAssembler.assemble(outputs).outputs[0].finish_reason == "length"
    assert calls["n"] == 1 and "zeroing the KV pool ahead failed" in caplog.text
    engine.check_integrity()
