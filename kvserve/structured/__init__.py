"""Grammar-constrained decoding (issue 29): what a request asks for (params), the grammar engine
(llguidance) bound to kvserve's tokenizer, and the per-request matcher the engine drives."""
