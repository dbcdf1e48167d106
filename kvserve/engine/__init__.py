"""The engine: requests in, tokens out, one step at a time.

engine.py          add, step (schedule -> run -> accept -> advance), abort, retire, stats
async_engine.py    the step loop under asyncio, for the server
setup.py           building an engine: every config check, pool sizing, backend, cache, manager, tiers
request.py         a request's state (no tensors); scheduler.py + scheduler_output.py (what runs, no tensors);
                   runner.py (how it runs, no policy); validation.py, breakpoints.py, fault_isolation.py
sample/            sampling.py (SamplingParams, the sampler), acceptance.py (logits -> accepted tokens),
                   constrained.py (structured output: matchers, forced tokens)
output/            types.py (RequestOutput, RequestDelta, metrics), processor.py (stops, text, deltas),
                   detokenizer.py, prefix_report.py (why a prompt hit as far as it did)
spec_decode/       drafting.py (the Proposer seam), proposers (ngram, suffix), policy, verify, slots, counters
observe/           stats.py + snapshots.py (the one snapshot readers take), integrity.py (block accounting),
                   kv_publisher.py (KV events on ZMQ)
"""
