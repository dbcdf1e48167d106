"""Server-side compaction (the summary buffer): older turns folded into a summary the model writes, carried
by the client as a sealed item and rendered, through the one prompt builder, as a prefix the cache keeps.

sealing.py: the sealed item (encrypted, signed with a server secret, bound to a tenant); summary.py: the
summarizing prompt kvserve owns and how a compacted history renders; summarizer.py: the pass that runs it.
"""
