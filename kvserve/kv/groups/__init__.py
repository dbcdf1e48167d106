"""KV groups: layers that share block tables. layout.py (the groups of a model: full attention, window W),
group_manager.py (one group's block tables: the part that depends on the attention kind), full.py (every
block kept), window.py (blocks behind the window freed)."""
