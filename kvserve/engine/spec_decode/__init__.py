"""Speculative decoding without a draft model: drafting.py (the Proposer seam: who drafts, how many), ngram.py
(prompt lookup), suffix.py (suffix decoding over earlier outputs), factory.py, policy.py (k from measured
acceptance and cost), verify.py (drafts checked exactly), slots.py (per-slot draft records for the lab),
counters.py (vLLM's spec-decode metrics)."""
