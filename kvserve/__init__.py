"""kvserve: a KV-cache-centric LLM inference engine."""

from kvserve.engine.output import CompletionOutput, RequestOutput
from kvserve.engine.sampling import SamplingParams
from kvserve.llm import LLM

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]
