"""Integer arithmetic shared by the cache, the planner and the file readers."""

from __future__ import annotations


def cdiv(numerator: int, denominator: int) -> int:
    """Ceiling division: how many `denominator`-sized pieces cover `numerator` (e.g. blocks for tokens)."""
    return -(-numerator // denominator)


def round_up(value: int, multiple: int) -> int:
    """`value` rounded up to a multiple of `multiple` (block boundaries, file alignment)."""
    return cdiv(value, multiple) * multiple
