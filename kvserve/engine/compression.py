"""KV compression at the engine's edge (issue 43): the flag's spec, checked at startup, and each request's.

The spec itself, chunks and refusals live in kv/compression/engine_spec.py; here they meet the engine's parts and
its errors (ConfigError at startup, InvalidRequestError, a 400, per request).
"""

from __future__ import annotations

from kvserve.config import EngineConfig
from kvserve.engine.sample.sampling import SamplingParams
from kvserve.errors import ConfigError, InvalidRequestError
from kvserve.kv.cache.kv_spec import KVSpec
from kvserve.kv.compressed_chunks import ChunkPolicy
from kvserve.kv.compression.engine_spec import EngineSupport, chunk_policy, engine_spec, request_spec
from kvserve.kv.compression.spec import CompressionSpec


class RequestCompression:
    """The engine's default spec (`EngineConfig.kv_compression`) and what it can compress."""

    def __init__(self, config: EngineConfig, kv_spec: KVSpec) -> None:
        self.block_size = config.block_size
        self.support = EngineSupport(
            only_windows=None not in kv_spec.layout.windows,
            shared_layers=bool(kv_spec.layer_kv or kv_spec.layer_sources),
            blockwise_codec=kv_spec.has_open_blocks, context_shift=config.context_overflow == "shift",
            no_kv_cache=not config.enable_kv_cache)
        try:
            self.default = engine_spec(config.kv_compression, self.block_size)
        except ValueError as exc:
            raise ConfigError(f"kv_compression: {exc}") from None
        if self.default is not None and (why := self.support.refusal()) is not None:
            raise ConfigError(f"kv_compression={config.kv_compression!r}: {why}")

    def for_request(self, params: SamplingParams) -> CompressionSpec | None:
        """The spec a request runs with; InvalidRequestError where its override cannot run."""
        try:
            return request_spec(params.kv_compression, self.default, self.block_size, self.support)
        except ValueError as exc:
            raise InvalidRequestError(str(exc), param="kv_compression") from None

    def policy(self, spec: CompressionSpec | None, num_prompt_tokens: int) -> ChunkPolicy | None:
        return None if spec is None else chunk_policy(spec, self.block_size, num_prompt_tokens)
