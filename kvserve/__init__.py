"""kvserve: a KV-cache-centric LLM inference engine."""

from kvserve.engine.output.types import CompletionOutput, RequestOutput
from kvserve.engine.sample.sampling import SamplingParams
from kvserve.llm import LLM
from kvserve.structured.params import StructuredOutputsParams

__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "RequestOutput", "CompletionOutput"]
