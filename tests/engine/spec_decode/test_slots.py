"""The draft slots the engine's snapshot carries for the lab's cache map: written, accepted and rolled back
per step, checked against what the scheduler truncated in the KV manager."""

from kvserve.config import EngineConfig
from kvserve.engine.engine import Engine
from kvserve.engine.sample.sampling import SamplingParams
from kvserve.server.lab.feed import snapshot_json
from tests.engine.test_spec_decode_engine import CONFIG, repetitive_prompts, weights  # noqa: F401 (fixture)


def spy_on_truncate(engine: Engine) -> list[tuple[str, list[int], int, list[int]]]:
    """Every truncate of this step: (request id, its first group's block ids before, tokens kept, after)."""
    calls, kv = [], engine.kv_manager
    real = kv.truncate

    def truncate(request_id, num_tokens):
        before = kv.block_ids(request_id)[0]
        kept = real(request_id, num_tokens)
        calls.append((request_id, before, kept, kv.block_ids(request_id)[0]))
        return kept

    kv.truncate = truncate
    return calls


def test_snapshot_carries_the_draft_slots_the_scheduler_wrote_and_truncated(weights):
    engine = Engine(EngineConfig(**CONFIG, speculative="ngram", num_speculative_tokens=6), loaded=weights["float32"])
    size = engine.config.block_size
    calls = spy_on_truncate(engine)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    for prompt in repetitive_prompts(count=4):
        engine.add_request(prompt, params)
    seen = {"written": 0, "accepted": 0, "rolled_back": 0, "freed": 0}
    while engine.has_unfinished():
        engine.request_block_view()  # the next snapshot carries a view of its step, as the lab's feed asks
        calls.clear()
        engine.step()
        engine.check_integrity()
        stats = engine.stats()
        drafts, view = stats.draft_slots, stats.blocks
        assert drafts.num_steps == stats.num_steps and view.drafts is drafts
        truncated = {request_id: (before, kept, after) for request_id, before, kept, after in calls}
        assert {r.request_id for r in drafts.requests if r.num_rolled_back} == set(truncated)
        for r in drafts.requests:
            assert len(r.written) == r.num_written > 0
            assert r.num_accepted + r.num_rolled_back == r.num_written  # greedy, no stop: nothing else cuts
            if r.request_id not in truncated:
                assert r.rolled_back == () and r.freed_blocks == ()
                continue
            before, kept, after = truncated[r.request_id]
            end = kept + r.num_rolled_back  # the rolled-back drafts are the tail the cut removed
            assert r.rolled_back == tuple((before[p // size], p % size) for p in range(kept, end))
            assert r.rolled_back == r.written[r.num_accepted:]
            assert r.freed_blocks == tuple(before[len(after):])
            assert all(view.ref_counts[block] == 0 for block in r.freed_blocks)  # back in the pool
        seen["written"] += drafts.num_written
        seen["accepted"] += drafts.num_accepted
        seen["rolled_back"] += drafts.num_rolled_back
        seen["freed"] += drafts.num_freed_blocks
        feed = snapshot_json(stats)
        assert feed["drafts"]["last"] == {"written": drafts.num_written, "accepted": drafts.num_accepted,
                                          "rolled_back": drafts.num_rolled_back,
                                          "freed_blocks": drafts.num_freed_blocks}
        assert [len(r["written"]) for r in feed["blocks"]["drafts"]] == [2 * r.num_written for r in drafts.requests]
    assert seen["accepted"] > 0 and seen["rolled_back"] > 0 and seen["freed"] > 0  # every case happened
    totals, spec = engine.stats().draft_slots, engine.stats().spec_decode
    assert (totals.total_written, totals.total_accepted) == (spec.num_draft_tokens, spec.num_accepted_tokens)
    assert (totals.total_written, totals.total_accepted, totals.total_rolled_back, totals.total_freed_blocks) == \
        (seen["written"], seen["accepted"], seen["rolled_back"], seen["freed"])


def test_no_draft_slots_with_drafting_off(weights):
    engine = Engine(EngineConfig(**CONFIG, speculative="off"), loaded=weights["float32"])
    engine.add_request(repetitive_prompts(count=1)[0], SamplingParams(max_tokens=8, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    assert engine.stats().draft_slots is None and snapshot_json(engine.stats())["drafts"] is None
