"""The planner's one cache: the request shapes a pairing has seen (a shape seen twice gets a recipe,
:mod:`kvgeom.plan.recipe`, so later requests of that shape are one gather).

A :class:`~kvgeom.plan.pairing.Pairing` is an immutable value holding everything fixed at handshake, its
per-pair plan included (:mod:`kvgeom.plan.pairplan`). The shapes are not part of it: they depend on the
requests seen, make repeats cheaper and change no plan, so they are a :class:`PlanMemo` kept here per pairing
object and dropped with it (a weak-keyed table: a pairing compares by identity).
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from kvgeom.plan.pairing import Pairing

__all__ = ["PlanMemo", "memo_of"]


@dataclass(eq=False)
class PlanMemo:
    """The planner's per-pairing memo of request shapes (never their block ids)."""

    #: request shape (block counts per group on each side, tokens) -> 1 (seen once), its recipe, or 0 (none)
    shapes: OrderedDict[tuple[Any, ...], Any] = field(default_factory=OrderedDict)


_MEMOS: weakref.WeakKeyDictionary[Pairing, PlanMemo] = weakref.WeakKeyDictionary()


def memo_of(pairing: Pairing) -> PlanMemo:
    """The planner's memo of ``pairing`` (empty until its first request)."""
    memo = _MEMOS.get(pairing)
    if memo is None:
        memo = _MEMOS.setdefault(pairing, PlanMemo())
    return memo
