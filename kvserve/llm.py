"""The offline API, named as in vLLM: `LLM(model=...).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
from typing import Sequence

from kvserve.config import EngineConfig
from kvserve.engine.engine import Engine
from kvserve.engine.output.types import RequestOutput, RequestOutputAssembler
from kvserve.engine.sample.sampling import SamplingParams
from kvserve.errors import ConfigError, InvalidRequestError, RequestFailedError
from kvserve.model.tokenizer import Tokenizer

_ENGINE_ARGS = tuple(f.name for f in dataclasses.fields(EngineConfig))

PromptInput = str | list[int]


def configure_default_logging() -> None:
    """What vLLM's LLM() does (VLLM_CONFIGURE_LOGGING): a script that set up no logging still sees kvserve's
    INFO lines (the model loaded, which kernels run) on stderr. An application's own handlers, or
    KVSERVE_CONFIGURE_LOGGING=0, leave logging alone."""
    package = logging.getLogger("kvserve")
    if os.environ.get("KVSERVE_CONFIGURE_LOGGING", "1") == "0" or package.handlers or logging.getLogger().handlers:
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    package.addHandler(handler)
    package.setLevel(logging.INFO)


class LLM:
    """Load a model once and generate for many prompts with continuous batching.

    `model=None` is the embedded SmolLM2-135M-Instruct. Engine arguments are
    those of EngineConfig (block_size, max_num_seqs, max_num_batched_tokens,
    kv_cache_dtype, kv_cache_memory, max_model_len, enable_kv_cache); any
    other name is rejected, not ignored.
    """

    def __init__(self, model: str | None = None, **engine_args) -> None:
        unknown = sorted(set(engine_args) - set(_ENGINE_ARGS))
        if unknown:
            raise ConfigError(
                f"unknown engine argument(s): {', '.join(unknown)}; known: {', '.join(_ENGINE_ARGS)}"
            )
        configure_default_logging()
        self.engine = Engine(EngineConfig(model=model, **engine_args))  # bad values raise ConfigError

    def get_tokenizer(self) -> Tokenizer:
        return self.engine.loaded.require_tokenizer()

    def generate(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for every prompt (text or token ids); outputs come back in input order."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise InvalidRequestError(f"{len(params_list)} SamplingParams for {len(prompts)} prompts")
        ids = []
        try:
            for prompt, params in zip(prompts, params_list):
                ids.append(self.engine.add_request(prompt, params))
        except Exception:
            for request_id in ids:  # a bad prompt leaves nothing behind
                self.engine.abort(request_id)
            raise
        return self._run(ids, use_tqdm)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        assembler = RequestOutputAssembler()
        progress = None
        if use_tqdm and len(ids) > 1:
            from tqdm import tqdm

            progress = tqdm(total=len(ids), desc="Processed prompts", unit="req", dynamic_ncols=True)
        try:
            while len(finished) < len(ids):
                for delta in self.engine.step():
                    if delta.error is not None:
                        raise RequestFailedError(delta.request_id, delta.error)
                    final = assembler.add(delta)
                    if final is not None:
                        finished[final.request_id] = final
                        if progress is not None:
                            progress.update(1)
        except BaseException:
            for request_id in ids:  # nothing left running (or holding blocks) behind the error
                self.engine.abort(request_id)
            raise
        finally:
            if progress is not None:
                progress.close()
        return [finished[i] for i in ids]
