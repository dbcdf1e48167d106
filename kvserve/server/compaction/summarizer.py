"""The compaction pass: the model writes the summary (summary.py's prompt), greedy, through the engine like
any request (its prompt hits the conversation's cached blocks, its own blocks are freed when it ends), and
the result is sealed into an item (sealing.py) the client carries back."""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from kvserve.engine.output.types import RequestOutput, RequestOutputAssembler
from kvserve.engine.sample.sampling import SamplingParams
from kvserve.errors import RequestFailedError
from kvserve.server.compaction.sealing import Compaction, Sealer
from kvserve.server.compaction.summary import SUMMARY_MAX_TOKENS
from kvserve.server.core.serving import Serving


COMPACTION_PASS_PREFIX = "cmp_"  # of a pass's engine request id (the lab tells passes apart by it)


@dataclass(frozen=True)
class SummaryPass:
    """A finished compaction pass: the summary, and what it cost."""

    summary: str
    num_prompt_tokens: int
    num_cached_tokens: int
    num_output_tokens: int
    item: dict  # the compaction item: {"type": "compaction", "id", "encrypted_content"}


class Summarizer:
    def __init__(self, serving: Serving, sealer: Sealer) -> None:
        self.serving = serving
        self.sealer = sealer

    @property
    def max_summary_tokens(self) -> int:
        """The summary's budget: SUMMARY_MAX_TOKENS, or a quarter of a smaller context."""
        return min(SUMMARY_MAX_TOKENS, self.serving.context_limit() // 4)

    def fits(self, num_prompt_tokens: int) -> bool:
        """Whether a pass over this many prompt tokens leaves room for the summary."""
        return num_prompt_tokens + self.max_summary_tokens <= self.serving.context_limit()

    def params(self) -> SamplingParams:
        return SamplingParams(max_tokens=self.max_summary_tokens, temperature=0.0)

    async def run(self, token_ids: list[int], tenant: str, salt: str | None) -> SummaryPass:
        """Generate the summary for the pass prompt `token_ids` (built by the API's own prompt path)."""
        params = self.params()
        await self.serving.off_loop(self.serving.engine.validate_request, token_ids, params)
        request_id = f"{COMPACTION_PASS_PREFIX}{uuid.uuid4().hex}"
        engine = self.serving.async_engine
        assembler, final = RequestOutputAssembler(), None
        try:
            async for delta in engine.generate(token_ids, params, request_id, salt):
                final = assembler.add(delta) or final
        finally:
            if final is None:  # cancelled (the client left) or failed: free the pass's blocks
                engine.abort(request_id)
        return self._finished(final, len(token_ids), tenant)

    def _finished(self, final: RequestOutput | None, num_prompt_tokens: int, tenant: str) -> SummaryPass:
        if final is None or final.outputs[0].finish_reason not in ("stop", "length"):
            raise RequestFailedError(final.request_id if final else "compaction",
                                     "the compaction pass ended without a summary")
        completion = final.outputs[0]
        summary = completion.text.strip() or "(nothing to summarize)"
        sealed = self.sealer.seal(Compaction(summary, tenant, self.serving.settings.model_name))
        item = {"type": "compaction", "id": f"cmp_{uuid.uuid4().hex}", "encrypted_content": sealed,
                "created_by": "kvserve"}
        return SummaryPass(summary, num_prompt_tokens, final.num_cached_tokens, len(completion.token_ids), item)

    def open(self, sealed: str, tenant: str, param: str = "input") -> str:
        """The summary of a compaction item the client sent back (a 400 unless this server sealed it for them)."""
        return self.sealer.open(sealed, tenant, self.serving.settings.model_name, param).summary
