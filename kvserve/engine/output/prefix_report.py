"""Why a request's prompt hit the prefix cache as far as it did, in words a user can act on."""

from __future__ import annotations

from kvserve.engine.output.types import PrefixCacheReport
from kvserve.engine.request import Request
from kvserve.engine.sample.sampling import SamplingParams
from kvserve.errors import InvalidRequestError
from kvserve.kv.manager import KVCacheManager
from kvserve.model.tokenizer import Tokenizer
from kvserve.tools.miss_cause import CONTEXT_TOKENS, divergence_cause


def build_prefix_report(request: Request, prefix_caching: bool, block_size: int,
                        tokenizer: Tokenizer | None) -> PrefixCacheReport:
    """The report of an admitted request: how many prompt tokens were cached (and how many of those
    came from a lower tier), and where the prompt left the closest cached one."""
    cached = request.num_cached_tokens or 0
    report = PrefixCacheReport(request.num_prompt_tokens, cached, "",
                               num_tier_cached_tokens=request.num_tier_cached_tokens)
    if not prefix_caching:
        report.reason = "prefix caching is off"
    elif request.sampling_params.skip_reading_prefix_cache:
        report.reason = "this request skipped reading the cache"
    elif cached >= (request.num_prompt_tokens - 1) // block_size * block_size:
        report.reason = ("every full block of the prompt was cached (the last token is always computed)"
                         if cached else f"the prompt is shorter than one {block_size}-token block plus one token")
    elif request.num_attention_cached_tokens > cached:
        report.reason = (f"the attention layers' blocks are cached up to token {request.num_attention_cached_tokens}, "
                         f"but the recurrent layers' last state snapshot on this prefix is at token {cached} "
                         f"(snapshots are kept every few blocks, at the end of each step and where prompts fork): "
                         f"the tokens between are recomputed, and a snapshot is kept at "
                         f"{request.num_attention_cached_tokens} for the next request")
    elif request.prefix_divergence is None:
        report.reason = ("no cached prompt continues past the cached prefix" if cached
                         else "nothing cached starts like this prompt (for this cache salt)")
    else:
        div = request.prefix_divergence
        report.divergence_position = div.position
        report.reason = f"diverged from the closest cached prompt at token {div.position}"
        if tokenizer is not None:
            context = request.prompt_token_ids[max(div.position - 8, 0) : div.position]
            ours = request.prompt_token_ids[div.position : div.position + 8]
            theirs = list(div.cached_token_ids[div.position - div.block_start :][:8])
            report.common_text = tokenizer.decode(context)
            report.prompt_continuation, report.cached_continuation = tokenizer.decode(ours), tokenizer.decode(theirs)
            before = tokenizer.decode(request.prompt_token_ids[max(div.position - CONTEXT_TOKENS, 0) : div.position])
            cause = divergence_cause(before, report.prompt_continuation, report.cached_continuation)
            if cause is not None:
                report.reason += f"; likely cause: {cause}"
            report.prompt_snippet = f"{report.common_text}[{report.prompt_continuation}]"
            report.cached_snippet = f"{report.common_text}[{report.cached_continuation}]"
    return report


def explain_prompt(kv: KVCacheManager, token_ids: list[int], cache_salt: str | None, prefix_caching: bool,
                   block_size: int, tokenizer: Tokenizer | None) -> PrefixCacheReport:
    """How the prefix cache would serve this prompt now, and where it would leave the closest cached
    prompt: the report a request gets at admission, without running anything. Read-only."""
    if not token_ids:
        raise InvalidRequestError("the prompt is empty")
    request = Request("explain", token_ids, SamplingParams(max_tokens=1), cache_salt=cache_salt,
                      block_size=block_size if prefix_caching else None)
    match = kv.find_cached_prefix(request.all_token_ids, request.block_hashes)
    request.num_cached_tokens = match.num_tokens
    if match.num_attention_tokens > match.num_tokens:
        request.num_attention_cached_tokens = match.num_attention_tokens
    if match.num_tokens < request.num_prompt_tokens - 1:  # as the scheduler does at admission
        request.prefix_divergence = kv.find_divergence(request.all_token_ids, match)
    return build_prefix_report(request, prefix_caching, block_size, tokenizer)
