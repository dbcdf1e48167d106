"""A request's state as the scheduler sees it: token ids, progress and status. No tensors."""

from __future__ import annotations

import enum

from kvserve.engine.output.types import RequestMetrics, TokenLogprob
from kvserve.engine.sample.sampling import SamplingParams
from kvserve.kv.compressed_chunks import ChunkPolicy
from kvserve.kv.compression.spec import CompressionSpec
from kvserve.kv.prefix.hashing import BlockHashChain


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    LOADING = "loading"  # admitted, holding its blocks, waiting for a lower tier's blocks to arrive
    RUNNING = "running"
    FINISHED = "finished"


class Request:
    """`num_tokens` (prompt + generated) and `num_computed_tokens` (whose K/V are cached).

    Every step the scheduler gives a request tokens so that num_computed_tokens
    catches up with num_tokens; once it has, the last position's logits give
    the next token.

    `block_hashes` holds the stable hashes of its full blocks (prefix
    caching), computed once as tokens arrive: the prompt's at creation, an
    output block's when its last token is appended. Without a `block_size`
    (prefix caching off) it stays empty.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        prompt: str | None = None,
        cache_salt: str | None = None,
        block_size: int | None = None,
        tenant: str | None = None,
        priority: int = 0,
        kv_compression: CompressionSpec | None = None,
    ) -> None:
        self.request_id = request_id
        # Who sent it (the server's id of its API key; None: anonymous), for the scheduler's fair share, and
        # its `priority` among that tenant's requests (lower first).
        self.tenant = tenant
        self.priority = priority
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.all_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.metrics = RequestMetrics(num_prompt_tokens=len(prompt_token_ids))
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_preemptions = 0
        self.kv_blocks_held = 0  # blocks held when it finished (for reporting)
        self.finish_reason: str | None = None
        self.cache_salt = cache_salt
        # KV compression (issue 43): the engine's resolved spec and the prompt's chunk geometry (None: off). Its
        # block keys chain the spec too, so it never reads a plain request's blocks.
        self.kv_compression = kv_compression
        self._compression: ChunkPolicy | None = None
        if kv_compression is not None and block_size is not None:
            cache_salt = f"{cache_salt or ''}\x00kv_compression:{kv_compression.key()}"
        self._hash_salt = cache_salt
        self.block_hashes = BlockHashChain(block_size, cache_salt)
        self.block_hashes.extend(self.all_token_ids)
        self._output_token_ids: list[int] = []
        # Tokens a proposer guessed follow all_token_ids (speculative decoding): the next step computes them
        # after the last token and keeps those the model agrees with. Never part of all_token_ids.
        self.draft_token_ids: list[int] = []
        # Tokens a request's grammar forces next (structured outputs, engine/sample/constrained.py), already
        # consumed by its matcher: the step that reaches the last token computes them too and they become
        # outputs without sampling. Kept across a preemption (the grammar has moved past them).
        self.forced_token_ids: list[int] = []
        self.num_shifted_tokens = 0  # dropped from the context by context shifts (kv/context_shift.py)
        # Prefix cache outcome at first admission: prompt tokens served from the
        # cache, and where the prompt left the closest cached chain (or None).
        self.num_cached_tokens: int | None = None
        self.num_tier_cached_tokens = 0  # of those, loaded from a lower tier (disk) for this request
        self.prefix_divergence = None
        # A hybrid model's hit stopped short of its cached attention blocks (at the last state snapshot): how
        # far the blocks went (0: it did not).
        self.num_attention_cached_tokens = 0
        self.prefix_cache_report = None  # built once from the two above, for outputs
        # Logprob entries recorded and not yet handed out: outputs are deltas, so each entry goes
        # out once (take_new_logprobs) and the request keeps no history of them.
        self.new_logprobs: list[TokenLogprob] | None = [] if sampling_params.logprobs is not None else None
        self.new_prompt_logprobs: list[TokenLogprob | None] | None = (
            [None] if sampling_params.prompt_logprobs is not None else None)  # the first token has none
        self.num_prompt_logprobs = 1  # prompt positions recorded so far, handed out or not

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def compression(self) -> ChunkPolicy | None:
        """The prompt's chunk geometry under KV compression (None: off); set once, by the engine."""
        return self._compression

    @compression.setter
    def compression(self, policy: ChunkPolicy | None) -> None:
        self._compression = self.block_hashes.compression = policy

    def compression_stop(self, start: int, count: int) -> int:
        """Tokens a step computing from `start` may take (at most `count`): it stops at the end of a chunk KV
        compression compresses, which the runner compresses before any later token is computed."""
        return count if self.compression is None else self.compression.stop(start, count)

    @property
    def num_dropped_prompt_tokens(self) -> int:
        """Prompt tokens KV compression dropped from the cache so far (0 without compression)."""
        return 0 if self.compression is None else self.compression.dropped(self.num_computed_tokens)

    @property
    def output_token_ids(self) -> list[int]:
        return self._output_token_ids

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    @property
    def is_decoding(self) -> bool:
        """Whether the request is in its decode phase: at most its last sampled token is still to compute
        (drafts and forced tokens ride on it). The one rule for the scheduler's order, drafting and stats;
        how a step's share of query tokens runs (a decode or a prefill chunk) is the attention backend's
        `is_decode`, a separate question."""
        return self.num_tokens - self.num_computed_tokens <= 1

    def append_output_tokens(self, token_ids: list[int]) -> None:
        """Record a step's accepted tokens (the output processor has already cut them at a stop)."""
        self.all_token_ids.extend(token_ids)
        self._output_token_ids.extend(token_ids)
        self.block_hashes.extend(self.all_token_ids)
        for _ in token_ids:
            self.metrics.record_token()

    def shift_context(self, keep: int, drop: int) -> None:
        """Drop `drop` tokens after the first `keep` from the context (`all_token_ids`: what the model
        attends over) and move the computed count with them; the outputs stay as produced. The block hashes
        are rebuilt for the new token sequence (the KV manager never caches shifted K/V under them)."""
        if drop <= 0 or keep + drop > self.num_tokens:
            raise ValueError(f"cannot drop {drop} of {self.num_tokens} tokens after {keep}")
        del self.all_token_ids[keep : keep + drop]
        computed = self.num_computed_tokens
        self.num_computed_tokens = computed if computed <= keep else max(computed - drop, keep)
        self.num_shifted_tokens += drop
        self.block_hashes = BlockHashChain(self.block_hashes.block_size, self._hash_salt)
        self.block_hashes.extend(self.all_token_ids)

    def record_prompt_logprobs(self, first: int, entries: list[TokenLogprob]) -> None:
        """Record prompt logprobs for positions first, first + 1, ...; positions already recorded
        (a prompt recomputed after a preemption) are not recorded twice."""
        already = self.num_prompt_logprobs - first
        if already >= 0 and already < len(entries):
            self.new_prompt_logprobs.extend(entries[already:])
            self.num_prompt_logprobs += len(entries) - already

    def take_new_logprobs(self) -> tuple[list[TokenLogprob] | None, list[TokenLogprob | None] | None]:
        """The logprob and prompt-logprob entries recorded since the last call (None where not asked for)."""
        logprobs, prompt_logprobs = self.new_logprobs, self.new_prompt_logprobs
        if logprobs is not None:
            self.new_logprobs = []
        if prompt_logprobs is not None:
            self.new_prompt_logprobs = []
        return logprobs, prompt_logprobs
