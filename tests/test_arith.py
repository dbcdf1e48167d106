import pytest

from kvserve.arith import cdiv, round_up


@pytest.mark.parametrize(("n", "d", "expected"), [(0, 16, 0), (1, 16, 1), (16, 16, 1), (17, 16, 2), (33, 32, 2)])
def test_cdiv_counts_the_pieces_that_cover_n(n, d, expected):
    assert cdiv(n, d) == expected


@pytest.mark.parametrize(("value", "multiple", "expected"), [(0, 32, 0), (1, 32, 32), (32, 32, 32), (33, 32, 64)])
def test_round_up_to_a_multiple(value, multiple, expected):
    assert round_up(value, multiple) == expected
