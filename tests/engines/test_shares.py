"""Splitting a list among data-parallel ranks and joining their results back (forge.engines.titan.shares)."""

import pytest

from forge.engines.titan.shares import Share, join_shares, share_bounds, share_of


@pytest.mark.parametrize(
    ("count", "ranks", "bounds"),
    [
        (5, 2, [(0, 3), (3, 5)]),
        (6, 3, [(0, 2), (2, 4), (4, 6)]),
        (7, 3, [(0, 3), (3, 5), (5, 7)]),
        (1, 2, [(0, 1), (1, 1)]),
        (0, 2, [(0, 0), (0, 0)]),
        (4, 1, [(0, 4)]),
    ],
)
def test_shares_are_contiguous_and_the_first_ones_take_the_remainder(count, ranks, bounds):
    assert share_bounds(count, ranks) == bounds


def test_the_shares_in_rank_order_are_the_list():
    items = list("abcdefg")
    for ranks in range(1, 10):
        shares = [share_of(items, rank, ranks) for rank in range(ranks)]
        assert [x for share in shares for x in share] == items
        assert max(map(len, shares)) - min(map(len, shares)) <= 1


def test_share_of_refuses_a_rank_outside_the_ranks():
    with pytest.raises(ValueError, match="rank 2 is not among 2 ranks"):
        share_of([1, 2, 3], 2, 2)


def test_join_puts_each_ranks_results_back_in_the_lists_order_whatever_order_they_come_in():
    items = list("abcde")
    shares = [Share(rank, 2, [x.upper() for x in share_of(items, rank, 2)]) for rank in (1, 0)]
    assert join_shares(shares, len(items)) == list("ABCDE")


def test_join_takes_a_tensor_parallel_groups_result_once_and_an_empty_share_as_nothing():
    # Four processes, two TP pairs: data-parallel ranks 0, 0, 1, 1; one item, so rank 1 has none.
    shares = [Share(0, 2, ["A"]), Share(0, 2, ["A"]), Share(1, 2, []), Share(1, 2, [])]
    assert join_shares(shares, 1) == ["A"]


def test_join_refuses_a_missing_rank_a_wrong_length_or_ranks_that_disagree():
    with pytest.raises(
        ValueError, match=r"results from data-parallel ranks \[0\], expected one from each of 0..1"
    ):
        join_shares([Share(0, 2, ["A", "B", "C"])], 5)
    with pytest.raises(ValueError, match=r"rank 1 returned 1 results for its share of 2 \(items 3..4 of 5\)"):
        join_shares([Share(0, 2, ["A", "B", "C"]), Share(1, 2, ["D"])], 5)
    with pytest.raises(ValueError, match=r"disagree on how many data-parallel ranks there are: \[2, 3\]"):
        join_shares([Share(0, 2, ["A"]), Share(1, 3, [])], 1)
