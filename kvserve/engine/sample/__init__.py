"""From logits to tokens: sampling.py (SamplingParams, vLLM's names, and the sampler), acceptance.py (a step's
logits rows -> each request's accepted tokens, drafts verified), constrained.py (each constrained request's
grammar matcher and forced tokens)."""
