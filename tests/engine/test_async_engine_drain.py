"""AsyncEngine.drain / stop: requests in flight finish or end with a final "abort" output, never an exception."""

import asyncio

from kvserve.engine.output.types import RequestOutputAssembler
from kvserve.engine.sample.sampling import SamplingParams
from tests.engine.test_async_engine import PROMPT, run, started
from tests.engine.test_engine import make_engine


async def _first_outputs(streams):
    """Advance every stream to its first output, so each request is running."""
    return [await stream.__anext__() for stream in streams]


async def _rest(stream):
    return [output async for output in stream]


def test_drain_lets_requests_finish_within_the_timeout(tiny_models):
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)

    async def main():
        async_engine = await started(make_engine(tiny_models()))
        streams = [async_engine.generate(PROMPT, params, f"r{i}") for i in range(3)]
        firsts = await _first_outputs(streams)
        rests = [asyncio.create_task(_rest(s)) for s in streams]
        num_aborted = await async_engine.drain(timeout=60)
        outputs = [[first] + rest for first, rest in zip(firsts, await asyncio.gather(*rests))]
        await async_engine.stop()
        return async_engine, num_aborted, outputs

    async_engine, num_aborted, outputs = run(main())
    assert num_aborted == 0 and async_engine.draining
    for rest in outputs:
        final = RequestOutputAssembler.assemble(rest)
        assert final.finished and final.outputs[0].finish_reason == "length"
        assert len(final.outputs[0].token_ids) == 8


def test_drain_past_its_timeout_aborts_the_rest_with_a_final_output(tiny_models):
    engine = make_engine(tiny_models())
    params = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)

    async def main():
        async_engine = await started(engine)
        streams = [async_engine.generate(PROMPT, params, f"r{i}") for i in range(3)]
        firsts = await _first_outputs(streams)
        rests = [asyncio.create_task(_rest(s)) for s in streams]
        num_aborted = await async_engine.drain(timeout=0)
        # no exception: every stream ends with its final output
        outputs = [[first] + rest for first, rest in zip(firsts, await asyncio.gather(*rests))]
        in_flight = async_engine.num_in_flight
        await async_engine.stop()
        return num_aborted, outputs, in_flight

    num_aborted, outputs, in_flight = run(main())
    assert num_aborted == 3 and in_flight == 0
    for rest in outputs:
        final = RequestOutputAssembler.assemble(rest)
        assert final.finished and final.outputs[0].finish_reason == "abort"
        assert 1 <= len(final.outputs[0].token_ids) < 200
    assert not engine.has_unfinished()
    engine.check_integrity()  # every block is back


def test_stop_ends_streams_in_flight_with_abort(tiny_models):
    engine = make_engine(tiny_models())
    params = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)

    async def main():
        async_engine = await started(engine)
        stream = async_engine.generate(PROMPT, params, "r0")
        await _first_outputs([stream])
        rest = asyncio.create_task(_rest(stream))
        await async_engine.stop()
        return await rest, async_engine.running

    rest, running = run(main())
    assert rest[-1].finished and rest[-1].finish_reason == "abort"
    assert not running and not engine.has_unfinished()
