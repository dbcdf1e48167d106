"""Structured outputs through the AsyncEngine: compiled on a worker thread, refused cleanly."""

import json
import threading

import pytest

from kvserve.engine.output.types import RequestOutputAssembler
from kvserve.engine.sample.sampling import SamplingParams
from kvserve.errors import InvalidRequestError
from kvserve.structured.params import StructuredOutputsParams as Spec
from tests.engine.test_async_engine import run, started
from tests.engine.sample.test_constrained import LONG_KEYS, make_engine
from tests.server.inprocess import with_tiny_tokenizer


@pytest.fixture(scope="module")
def loaded(tiny_models):
    return with_tiny_tokenizer(tiny_models("llama-gqa"))


def test_grammars_compile_off_the_event_loop_and_stream_valid_json(loaded, monkeypatch):
    engine = make_engine(loaded)
    compile_threads = []
    compile = engine.constrained.compile
    monkeypatch.setattr(engine.constrained, "compile",
                        lambda params: compile_threads.append(threading.get_ident()) or compile(params))
    params = SamplingParams(max_tokens=180, temperature=1.0, seed=4, structured_outputs=Spec(json=LONG_KEYS))

    async def main():
        async_engine = await started(engine)
        assembler, final = RequestOutputAssembler(), None
        async for delta in async_engine.generate(loaded.tokenizer.encode("{"), params, "a"):
            final = assembler.add(delta) or final
        await async_engine.stop()
        return final, threading.get_ident()

    final, loop_thread = run(main())
    assert json.loads(final.outputs[0].text).keys() == LONG_KEYS["properties"].keys()
    # Compiled once, on a worker thread; the add (between steps) found it cached.
    assert compile_threads[0] != loop_thread and engine.constrained.compiler.num_compiled == 1
    engine.check_integrity()


def test_a_grammar_that_does_not_compile_raises_from_the_stream_and_leaves_nothing(loaded):
    engine = make_engine(loaded)

    async def main():
        async_engine = await started(engine)
        stream = async_engine.generate([5, 6], SamplingParams(structured_outputs=Spec(regex="(")), "bad")
        with pytest.raises(InvalidRequestError, match="does not compile"):
            await stream.__anext__()
        assert async_engine.num_waiting == 0
        await async_engine.stop()

    run(main())
    assert not engine.has_unfinished()
    engine.check_integrity()
