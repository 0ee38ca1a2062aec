"""What the planner (:mod:`kvgeom.plan.request`) derives from one pairing and reuses for every request.

A :class:`~kvgeom.plan.pairing.Pairing` is an immutable value holding everything fixed at handshake. What
planning learns on the way -- the request shapes it has seen (a shape seen twice gets a recipe,
:mod:`kvgeom.plan.recipe`), and shape-only tables it builds on first use -- is a :class:`PlanMemo`, kept here per
pairing object and dropped with it (a weak-keyed table: a pairing compares by identity).
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from kvgeom.plan.align import PageSet
from kvgeom.plan.descids import Segments
from kvgeom.plan.pairing import Pairing

__all__ = ["PlanMemo", "memo_of"]


@dataclass(eq=False)
class PlanMemo:
    """The planner's per-pairing memo: nothing in it depends on a request's block ids."""

    #: request shape (block counts per group on each side, tokens) -> 1 (seen once), its recipe, or 0 (none)
    shapes: OrderedDict[tuple[Any, ...], Any] = field(default_factory=OrderedDict)
    #: descriptor-id segment tables by (side, remote rank)
    segments: dict[tuple[str, int], Segments] = field(default_factory=dict)
    #: a region-mapped pull's (local, remote) segment tables by remote rank
    region_segments: dict[int, tuple[Segments, ...]] = field(default_factory=dict)
    #: per (only the pages this pairing fills?, local group), the pages the receive step zeroes, as arrays
    #: (:class:`~kvgeom.plan.align.PageSet`)
    page_sets: dict[tuple[bool, int], PageSet] = field(default_factory=dict)
    #: per remote rank, what its transfer reads of the pairing (:func:`kvgeom.plan.bind.rank_tables`)
    ranks: dict[int, Any] = field(default_factory=dict)
    #: the groups some transfer rank's requests carry
    sent_groups: tuple[bool, ...] | None = None
    #: per (side, remote rank): whether every id a checked request can bring stays inside its segment and
    #: its table (then the planner does not bound the descriptor ids again per request)
    bounded: dict[tuple[str, int], bool] = field(default_factory=dict)
    #: vLLM push: the P ranks (mod DCP) whose mappings write D rank ``rank``
    push_writers: dict[int, set[int]] = field(default_factory=dict)


_MEMOS: weakref.WeakKeyDictionary[Pairing, PlanMemo] = weakref.WeakKeyDictionary()


def memo_of(pairing: Pairing) -> PlanMemo:
    """The planner's memo of ``pairing`` (empty until its first request)."""
    memo = _MEMOS.get(pairing)
    if memo is None:
        memo = _MEMOS.setdefault(pairing, PlanMemo())
    return memo
