"""The suffix index over past outputs: drafts a repeated output, per tenant, within its memory bound."""

from kvserve.engine.spec_decode.suffix import SuffixProposer

PROMPT = [1, 2, 3, 4, 5]
CALL = [50, 51, 52, 53, 54, 55, 56, 57, 58, 59]  # a tool call the agent emitted before


def test_a_past_output_is_drafted_from_the_prompt_tail_on():
    proposer = SuffixProposer()
    proposer.finish("a", "tenant", PROMPT + CALL, num_prompt_tokens=len(PROMPT))
    # A new request with the same prompt tail: its first tokens are drafted from the past output...
    assert proposer.propose("b", [9, 9] + PROMPT, 4, tenant="tenant") == CALL[:4]
    # ...and so are the later ones, once it is repeating it.
    assert proposer.propose("b", [9, 9] + PROMPT + CALL[:5], 3, tenant="tenant") == CALL[5:8]


def test_one_tenants_outputs_never_draft_anothers():
    proposer = SuffixProposer()
    proposer.finish("a", "alice", PROMPT + CALL, num_prompt_tokens=len(PROMPT))
    assert proposer.propose("b", PROMPT + CALL[:4], 4, tenant="bob") == []
    assert proposer.propose("b", PROMPT + CALL[:4], 4, tenant=None) == []
    assert proposer.propose("b", PROMPT + CALL[:4], 4, tenant="alice") == CALL[4:8]


def test_the_request_itself_is_looked_up_too():
    proposer = SuffixProposer()
    source = list(range(200, 240))
    assert proposer.propose("r", source + source[:6], 4, tenant="t") == source[6:10]


def test_memory_is_bounded_per_tenant_and_in_tenants():
    proposer = SuffixProposer(max_tokens_per_tenant=100, max_tenants=2)
    for i in range(10):
        proposer.finish(str(i), "t", PROMPT + [1000 + 40 * i + j for j in range(40)], len(PROMPT))
    assert proposer.num_indexed_tokens("t") <= 100
    # The oldest outputs were evicted with their n-grams; the newest still draft.
    assert proposer.propose("x", PROMPT + [1000, 1001, 1002], 2, tenant="t") == []
    assert proposer.propose("x", PROMPT + [1360, 1361, 1362], 2, tenant="t") == [1363, 1364]
    index = proposer._tenants["t"]
    assert all(doc_id in index._docs for doc_id, _ in index._grams.values())
    proposer.finish("y", "u", PROMPT + CALL, len(PROMPT))
    proposer.finish("z", "v", PROMPT + CALL, len(PROMPT))
    assert proposer.num_indexed_tokens("t") == 0  # the least recently used tenant went first
    assert proposer.num_indexed_tokens("v") > 0
