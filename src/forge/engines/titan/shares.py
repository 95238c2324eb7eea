"""A list split among data-parallel ranks, and the ranks' results joined back in its order.

Rank ``r`` of ``ranks`` takes a contiguous share; the first ``len % ranks`` shares hold one item
more than the others, so the shares laid end to end in rank order are the list again. The
ranks of one tensor-parallel group have one data-parallel rank: they take the same share and
return the same result, which `join_shares` takes once.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple, TypeVar

T = TypeVar("T")


class Share(NamedTuple):
    """What one process returns: its data-parallel rank, how many there are, and one result
    per item of its share."""

    rank: int
    ranks: int
    values: list[Any]


def share_bounds(count: int, ranks: int) -> list[tuple[int, int]]:
    """``[start, end)`` of each rank's share of ``count`` items."""
    if ranks < 1 or count < 0:
        raise ValueError(f"cannot split {count} items among {ranks} ranks")
    size, longer = divmod(count, ranks)
    starts = [r * size + min(r, longer) for r in range(ranks + 1)]
    return list(zip(starts[:-1], starts[1:], strict=True))


def share_of(items: Sequence[T], rank: int, ranks: int) -> list[T]:
    """Rank ``rank``'s share of ``items`` (empty when there are fewer items than ranks)."""
    if not 0 <= rank < ranks:
        raise ValueError(f"rank {rank} is not among {ranks} ranks")
    start, end = share_bounds(len(items), ranks)[rank]
    return list(items[start:end])


def join_shares(shares: Iterable[Share], count: int) -> list[Any]:
    """The results of every data-parallel rank for a list of ``count`` items, in the list's
    order. Refuses a missing rank, ranks that disagree on their number, or a share whose
    length is not its rank's (a result would land on the wrong item)."""
    by_rank: dict[int, Share] = {}
    for share in shares:
        by_rank.setdefault(share.rank, share)
    sizes = {share.ranks for share in by_rank.values()}
    if len(sizes) > 1:
        raise ValueError(f"the ranks disagree on how many data-parallel ranks there are: {sorted(sizes)}")
    ranks = sizes.pop() if sizes else 1
    if sorted(by_rank) != list(range(ranks)):
        raise ValueError(
            f"results from data-parallel ranks {sorted(by_rank)}, expected one from each of 0..{ranks - 1}"
        )
    joined: list[Any] = []
    for rank, (start, end) in enumerate(share_bounds(count, ranks)):
        values = by_rank[rank].values
        if len(values) != end - start:
            raise ValueError(
                f"data-parallel rank {rank} returned {len(values)} results for its share of "
                f"{end - start} (items {start}..{end - 1} of {count})"
            )
        joined += values
    return joined
