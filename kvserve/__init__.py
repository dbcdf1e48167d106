"""kvserve: a KV-cache-centric LLM inference engine."""

from kvserve.engine.output import CompletionOutput, RequestOutput
from kvserve.engine.sampling import SamplingParams
from kvserve.llm import LLM
from kvserve.structured.params import StructuredOutputsParams

__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "RequestOutput", "CompletionOutput"]
