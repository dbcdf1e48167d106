"""What every API format shares: the engine, tokenizer work off the event loop, limits, jobs, admission.

The event loop never waits on CPU work: tokenizing, chat templating, prompt
validation and detokenizing a prompt run on a small worker pool (`off_loop`).
Tokenizing releases the GIL (Tokenizer.encode), templating is Python (which
yields the GIL every few milliseconds), and a prompt whose length alone proves
it cannot fit the context is refused before any of that runs.

Each API (openai/, responses/, anthropic/) turns its request body into jobs through
`Serving` and answers through `Serving.respond` with its own OutputFormat.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from functools import lru_cache
from typing import Any, TypeVar

from fastapi import Request as HTTPRequest

from kvserve.engine.async_engine import AsyncEngine
from kvserve.engine.output.types import RequestOutput
from kvserve.engine.sample.sampling import SEED_RANGE, SamplingParams
from kvserve.errors import InvalidRequestError, KVServeError
from kvserve.model.tokenizer import Tokenizer
from kvserve.server.core.errors import bad_request, model_not_found, overloaded, tenant_overloaded
from kvserve.server.core.pin_owners import PinOwners
from kvserve.server.core.streaming import Job, OutputFormat, run_jobs
from kvserve.server.core.tenancy import Tenancy, tenant_id
from kvserve.server.core.reasoning_use import ReasoningUse
from kvserve.server.core.tool_use import ToolUse
from kvserve.server.prompt.answers import GeneratedAnswers
from kvserve.server.prompt.builder import PromptBuilder
from kvserve.structured.params import PARAM as STRUCTURED_PARAM

log = logging.getLogger(__name__)

T = TypeVar("T")

# Large enough for a full 128k-token context as text or as token ids in JSON; small
# enough that parsing the JSON (which happens on the event loop) takes milliseconds.
DEFAULT_MAX_REQUEST_BYTES = 4 * 2**20
_PREPROCESS_WORKERS = 2


@dataclass
class ServerSettings:
    model_name: str
    api_keys: list[str] = field(default_factory=list)
    max_waiting_requests: int = 256  # past this, new requests get 429 at once
    log_prompts: bool = False
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES  # larger bodies get 413
    # Stored responses (/v1/responses with store=true), in memory: least recently used go past either bound.
    responses_store_max_count: int = 10_000
    responses_store_max_bytes: int = 256 * 2**20
    # Where stored responses also persist (JSON files, one per response), so a restart keeps them; None: memory only.
    responses_store_path: str | None = None
    # Seals compaction items (server/compaction/sealing.py); None: kept in responses_store_path, else random.
    compaction_secret: str | None = None
    admin_key: str | None = None  # opens the lab (/lab), which shows every tenant's activity
    # Output cap of a request that gives none (llama.cpp's --n-predict); None: to the end of the context.
    default_max_tokens: int | None = None
    metrics_key: str | None = None  # if set, /metrics needs it (or the admin key); otherwise /metrics is open
    # A replica behind the ingress: the answers it remembers (server/prompt/answers.py) are also queued for
    # the ingress, which hashes the next turn as this server builds it (replicas/routing_key.py).
    forward_answers: bool = False
    # Each API key's weight (in --api-key order; missing ones 1) in the fair share of steps, of the KV pool
    # and of the waiting queue (engine/fair_share.py, kv/pool/tenant_quota.py).
    tenant_weights: list[float] = field(default_factory=list)


@dataclass(frozen=True)
class Usage:
    """Token counts of one API request: prompts once each (not per choice), cached tokens of each
    prompt's first choice, every choice's output."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    # Speculative decoding: draft tokens verified and those the model accepted, over every choice.
    draft_tokens: int = 0
    accepted_draft_tokens: int = 0
    dropped_tokens: int = 0  # prompt tokens KV compression dropped from the cache (kvserve's own detail)

    @classmethod
    def count(cls, jobs: list[Job], finals: dict[int, RequestOutput]) -> "Usage":
        prompt_tokens = cached = dropped = 0
        counted: set[int] = set()
        for job in jobs:  # jobs run prompt by prompt, choice by choice: the first of each prompt counts
            if job.prompt_index in counted:
                continue
            counted.add(job.prompt_index)
            prompt_tokens += len(job.token_ids)
            output = finals.get(job.index)
            cached += output.num_cached_tokens if output is not None else 0
            dropped += output.num_dropped_tokens if output is not None else 0
        completion_tokens = sum(len(o.outputs[0].token_ids) for o in finals.values())
        drafts = sum(o.metrics.num_draft_tokens for o in finals.values())
        accepted = sum(o.metrics.num_accepted_draft_tokens for o in finals.values())
        return cls(prompt_tokens, completion_tokens, cached, drafts, accepted, dropped)

    def openai(self) -> dict:
        usage = {
            "prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }
        if self.dropped_tokens:  # KV compression (--kv-compression, or the request's kv_compression)
            usage["prompt_tokens_details"]["kvserve_dropped_tokens"] = self.dropped_tokens
        if self.draft_tokens:
            # OpenAI's names for predicted outputs, which are drafts verified by the model too.
            usage["completion_tokens_details"] = {
                "accepted_prediction_tokens": self.accepted_draft_tokens,
                "rejected_prediction_tokens": self.draft_tokens - self.accepted_draft_tokens}
        return usage


class Serving:
    """The engine as every API endpoint sees it. Methods marked "worker" run on the
    preprocessing pool (call them through `off_loop`); the rest on the event loop."""

    def __init__(self, async_engine: AsyncEngine, settings: ServerSettings) -> None:
        self.async_engine = async_engine
        self.engine = async_engine.engine
        self.settings = settings
        self.tenancy = Tenancy(settings.api_keys)
        self.pin_owners = PinOwners(self.engine.config.block_size)
        # tool-calling answers' generated ids, for token-exact tool loops
        self.answers = GeneratedAnswers(forward=settings.forward_answers)
        # Every API's format reports the calls it parsed out of a finished output (the app points it at /metrics).
        self.count_tool_calls: Callable[[int], None] = lambda num_calls: None
        self.tokenizer: Tokenizer | None = self.engine.tokenizer
        self._prompts: PromptBuilder | None = None
        self._special_markers: dict[str, bool] = {}
        self._special_tokens: dict[str, int] | None = None
        self._token_text = lru_cache(maxsize=65536)(self._decode_token)
        self._pool = ThreadPoolExecutor(max_workers=_PREPROCESS_WORKERS, thread_name_prefix="kvserve-preprocess")
        self.tenant_weights = self.tenancy.weights(settings.tenant_weights)
        self.engine.set_tenant_weights(self.tenant_weights)

    def close(self) -> None:
        """Stop the preprocessing pool (at shutdown, after the engine has stopped)."""
        self._pool.shutdown(wait=False, cancel_futures=True)

    # --- checks that cost nothing (event loop) --------------------------------

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.settings.model_name:
            raise model_not_found(model)

    def check_batch_size(self, num_jobs: int, param: str) -> None:
        """More engine requests than the queue ever holds is the request's fault (400), not load (429)."""
        limit = self.settings.max_waiting_requests
        if num_jobs > limit:
            raise bad_request(
                f"this request needs {num_jobs} completions (prompts x n) but the server queues at most {limit} "
                f"at once (--max-waiting-requests); split it into smaller requests", param)

    def require_tokenizer(self) -> Tokenizer:
        try:
            return self.engine.loaded.require_tokenizer()
        except KVServeError as exc:
            raise bad_request(str(exc)) from None

    # --- CPU work (worker) -----------------------------------------------------

    async def off_loop(self, fn: Callable[..., T], *args: Any) -> T:
        """Run `fn(*args)` on the preprocessing pool; its exceptions are raised here."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def tool_use(self, body: Any) -> ToolUse:
        """A request's tools (its API's `tool_use()`), calls in the layout the model's chat template writes them
        in history, so the grammar forces the text the next turn renders back (tools/layouts.py)."""
        return body.tool_use().with_template(self.chat_template, self.special_tokens)

    def keep_markers(self, params: SamplingParams, tool_use: ToolUse, reasoning: ReasoningUse) -> SamplingParams:
        """(worker) `params` whose output text keeps the call layout's and the reasoning format's markers where the
        tokenizer counts them special (Mistral's `[TOOL_CALLS]`, gpt-oss's `<|channel|>`): the parsers read them."""
        markers = (*(tool_use.markers() if tool_use.parses_calls else ()), *reasoning.markers())
        if not params.skip_special_tokens or self.tokenizer is None or not markers:
            return params
        if any(self._is_special(marker) for marker in markers):
            return replace(params, skip_special_tokens=False)
        return params

    def _is_special(self, text: str) -> bool:
        """Whether decoding `text`'s tokens without special tokens loses some of it."""
        if text not in self._special_markers:
            ids = self.tokenizer.encode(text, add_special_tokens=False)
            self._special_markers[text] = self.tokenizer.decode(ids, skip_special_tokens=True) != text
        return self._special_markers[text]

    @property
    def special_tokens(self) -> dict[str, int]:
        """The tokenizer's special tokens, text -> id (a grammar writes them as tokens)."""
        if self._special_tokens is None:
            decoder = self.tokenizer.backend.get_added_tokens_decoder() if self.tokenizer else {}
            self._special_tokens = {token.content: i for i, token in decoder.items() if token.special}
        return self._special_tokens

    @property
    def chat_template(self) -> str | None:
        return self.tokenizer.chat_template if self.tokenizer else None

    @property
    def prompts(self) -> PromptBuilder:
        """The one prompt builder (server/prompt/): every API's prompt is built by it (400 without a tokenizer)."""
        if self._prompts is None:
            tokenizer = self.require_tokenizer()
            max_len = self.engine.max_model_len
            self._prompts = PromptBuilder(tokenizer, self.answers, max_len * tokenizer.longest_token_chars, max_len)
        return self._prompts

    def decode_prompt(self, token_ids: list[int]) -> str:
        """(worker) The text of prompt token ids (echo), special tokens included."""
        return self.tokenizer.decode(token_ids, skip_special_tokens=False) if self.tokenizer else ""

    def jobs(self, prompt_index: int, token_ids: list[int], params: SamplingParams, n: int, first_index: int,
             prompt_text: str = "", constraint_param: str | None = None) -> list[Job]:
        """(worker) The `n` choices of one prompt, validated as the engine will validate them. A constraint
        that does not compile is a 400 naming `constraint_param` (the field the API took it from), not the
        engine's own name for it."""
        try:
            self.engine.validate_request(token_ids, params)
        except InvalidRequestError as error:
            if constraint_param is None or error.param != STRUCTURED_PARAM:
                raise
            detail = str(error).split("does not compile: ", 1)[-1]
            # (the grammar engine's own account, with its state, was logged where it failed: structured/)
            log.warning("refused a request: its %s does not compile: %s", constraint_param, detail)
            raise InvalidRequestError(f"{constraint_param}: the schema does not compile: {detail}",
                                      param=constraint_param) from error
        jobs = []
        for choice in range(n):
            choice_params = params
            if n > 1 and params.seed is not None:
                # Same seed for every choice would give n identical samples. Wrapping modulo
                # 2**64 is what the generator does with negative seeds anyway.
                choice_params = replace(params, seed=(params.seed + choice) % (SEED_RANGE[1] + 1))
            jobs.append(Job(first_index + choice, prompt_index, token_ids, choice_params, prompt_text))
        return jobs

    def context_limit(self) -> int:
        """Most tokens (prompt + output) one request can hold: the context, or the whole KV pool if smaller."""
        stats = self.engine.stats()
        return min(self.engine.max_model_len, stats.num_blocks * stats.block_size)

    def default_max_tokens(self, num_prompt_tokens: int, api_default: int | None = None) -> int:
        """The output cap of a request that gives none: the API's own default (completions: 16) and the
        server's (--default-max-tokens), within the room left in the context and the whole KV pool.
        With neither, the room itself, as OpenAI and vLLM do: logged, since a long run looks hung."""
        room = max(self.context_limit() - num_prompt_tokens, 1)
        caps = [cap for cap in (api_default, self.settings.default_max_tokens) if cap is not None]
        if not caps:
            log.info("a request without max_tokens may generate up to %d tokens (to the end of the context); "
                     "--default-max-tokens caps such requests", room)
            return room
        return min(room, *caps)

    # --- answering (event loop) ------------------------------------------------

    async def respond(self, fmt: OutputFormat, jobs: list[Job], http: HTTPRequest, api_key: str,
                      client_salt: str | None, stream: bool, priority: int = 0):
        """Admit the jobs (429 while the queue, or the caller's share of it, is full), run them, and answer
        in `fmt`. `priority` orders them among the caller's own requests (lower first)."""
        waiting, limit = self.async_engine.num_waiting, self.settings.max_waiting_requests
        if waiting + len(jobs) > limit:
            raise overloaded(waiting, limit)
        tenant = tenant_id(api_key) if self.tenancy.requires_key else None
        if tenant is not None:
            tenant_waiting = self.async_engine.num_unstarted_by_tenant[tenant]
            tenant_limit = self.tenant_queue_limit(tenant)
            if tenant_waiting + len(jobs) > tenant_limit:
                raise tenant_overloaded(tenant_waiting, tenant_limit)
        salt = self.tenancy.cache_salt(api_key, client_salt)
        pinned = [job for job in jobs if job.pins]
        if pinned and self.tenancy.requires_key:  # so /v1/kv_cache can show the tenant its own pins
            pins = self.engine.stats().pins
            live = [pin.key for pin in pins.pins] if pins is not None else []
            for job in pinned:
                await self.off_loop(self.pin_owners.file, tenant_id(api_key), job.token_ids, salt, job.pins, live)
        if self.settings.log_prompts:
            for job in jobs:
                log.info("request %s-%d prompt: %r", fmt.request_id, job.index,
                         self.tokenizer.decode(job.token_ids) if self.tokenizer else job.token_ids)
        return await run_jobs(self.async_engine, fmt, jobs, http, salt, stream, tenant, priority)

    def tenant_queue_limit(self, tenant: str) -> int:
        """A tenant's share of the waiting queue (by weight, at least one request): a flooding tenant fills
        its own share and gets 429s while the others still get in."""
        total = sum(self.tenant_weights.values())
        return max(1, int(self.settings.max_waiting_requests * self.tenant_weights.get(tenant, 1.0) / total))

    def token_text(self, token_id: int) -> str:
        """One token's text as logprobs show it (cached)."""
        return self._token_text(token_id)

    def _decode_token(self, token_id: int) -> str:
        if self.tokenizer is None:
            return f"token_id:{token_id}"
        return self.tokenizer.decode([token_id], skip_special_tokens=False)
