"""What requests hand out: types.py (RequestOutput, RequestDelta, metrics, logprobs), processor.py (stop
conditions within a step's tokens, text, deltas), detokenizer.py (ids -> text as tokens arrive),
prefix_report.py (why a prompt hit the prefix cache as far as it did)."""
