"""Data-parallel evaluation: lm-eval's requests shared out over the torchrun ranks, the answers gathered.

lm-eval runs whole on every rank: the same tasks, documents and requests in the same order (the model tells
lm-eval it is rank 0 of 1, so lm-eval splits and pads nothing and post-processes the complete answer list as a
single process does). Only the model calls are divided: each call's context groups are dealt to the ranks
(:func:`deal`), every rank scores its groups and the answers are all-gathered back into request order. A
context's continuations stay on one rank, so the saving of :class:`hif8qat.evaluate.prefix_lm.SharedContextLM`
is kept. Rank 0 alone writes the result files."""

from __future__ import annotations

import heapq
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from hif8qat.train.distributed import all_gather_objects


@dataclass(frozen=True)
class Ranks:
    """This process's place among the evaluating ranks."""

    rank: int
    world_size: int

    @classmethod
    def current(cls) -> Ranks | None:
        """The initialised torch.distributed group, or None (single process: nothing to share).

        Returns:
            The initialised torch.distributed group of two ranks or more, or None (single process: nothing to share)."""

        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
            return None
        return cls(dist.get_rank(), dist.get_world_size())

    def all_gather(self, obj: Any) -> list[Any]:

        """Every rank's ``obj``, in rank order.

        Args:
            obj: a picklable object.

        Returns:
            One object per rank."""
        return all_gather_objects(obj, self.world_size)


def deal(keys: Sequence[Hashable], costs: Sequence[int], world_size: int) -> list[list[int]]:
    """Indices of ``keys`` per rank: equal keys together, balanced by the summed cost of their groups.

    Groups are taken largest first (then in order of first appearance) and each goes to the rank with the
    smallest total so far (ties: lowest rank): the classic longest-processing-time rule, a pure function of its
    arguments, so every rank computes the same split without communicating.

    Args:
        keys: per request, its group key (its context tokens).
        costs: per request, its tokens.
        world_size: ranks.

    Returns:
        Per rank, its request indices, sorted."""
    groups: dict[Hashable, list[int]] = {}
    for i, key in enumerate(keys):
        groups.setdefault(key, []).append(i)
    order = sorted(groups.values(), key=lambda members: (-sum(costs[i] for i in members), members[0]))
    loads = [(0, r) for r in range(world_size)]
    shares: list[list[int]] = [[] for _ in range(world_size)]
    for members in order:
        load, r = heapq.heappop(loads)
        shares[r].extend(members)
        heapq.heappush(loads, (load + sum(costs[i] for i in members), r))
    return [sorted(s) for s in shares]


def gather_answers(ranks: Ranks, n: int, mine: Sequence[int], answers: Sequence[Any]) -> list[Any]:
    """Every rank's answers, all-gathered into the order of the ``n`` requests they came from.

    Args:
        ranks: the ranks.
        n: requests in the call.
        mine: this rank's request indices.
        answers: its answers, in that order.

    Returns:
        The ``n`` answers in request order.

    Raises:
        RuntimeError: the ranks disagree on the requests (not every request was answered once)."""
    out: list[Any] = [None] * n
    filled = 0
    for indices, values in ranks.all_gather((list(mine), list(answers))):
        for i, value in zip(indices, values, strict=True):
            out[i] = value
            filled += 1
    if filled != n:  # a rank scored another split: the ranks disagree on the requests
        raise RuntimeError(f"evaluation ranks returned {filled} answers for {n} requests")
    return out


def summed(ranks: Ranks | None, counts: dict[str, int]) -> tuple[dict[str, int], list[dict[str, int]]]:
    """Counters summed over the ranks, e.g. the tokens each rank forwarded.

    Args:
        ranks: the ranks (None: one process).
        counts: this rank's counters.

    Returns:
        ``(the counters summed over the ranks, each rank's own)``."""
    per_rank = ranks.all_gather(dict(counts)) if ranks is not None else [dict(counts)]
    return {k: sum(c.get(k, 0) for c in per_rank) for k in counts}, per_rank
