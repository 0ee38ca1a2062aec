"""Request-shape recipes: a plan's integers as one gather of the request's block ids.

Outside DCP and region-mapped pairs, every integer a plan holds (descriptor ids, regroup blocks, zero
ranges) is either a constant of the pairing or ``c + m * id`` of exactly one block id of the request, at
a position fixed by the request's *shape*: the number of ids per group on each side and the token counts
(block-size-ratio mapping, prefix trimming, token alignment and segment offsets all select by position
and scale by constants; the planner's refusals, too, depend on the shape alone). A :class:`Recipe`
records, per output integer, that position ``p``, the factor ``m`` and the constant ``c``; a later
request of the same shape is then planned as ``c + m * concat(ids)[p]``: one gather for the whole plan.

Recipes are found by running the general planner on probe ids (:func:`trace`), never written by hand,
and a recipe is kept only if it reproduces the planner's output on every probe and on the request it
was traced for.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["Recipe", "trace"]

Run = Callable[[list[np.ndarray], list[np.ndarray]], np.ndarray]


@dataclass(frozen=True, eq=False)
class Recipe:
    """``out = const + factor * ids[position]`` over the request's ids (local then remote, group order)."""

    position: np.ndarray
    factor: np.ndarray
    const: np.ndarray

    def apply(self, ids: np.ndarray) -> np.ndarray:
        if not ids.size:
            return np.array(self.const, copy=True)
        return np.asarray(self.const + self.factor * ids[self.position], dtype=np.int64)


def _split(flat: np.ndarray, sizes: Sequence[int]) -> list[np.ndarray]:
    return list(np.split(flat, np.cumsum(sizes)[:-1])) if len(sizes) else []


def trace(
    run: Run, local_sizes: Sequence[int], remote_sizes: Sequence[int], local_pool: int, remote_pool: int
) -> Recipe | None:
    """The recipe of ``run`` (block ids per group on each side -> one flat ``int64`` output) at this shape,
    or None where the output is not of the recipe form, a probe is refused, or the pools are too small
    for the probes (twice the request's ids on each side)."""
    nl, nr = int(sum(local_sizes)), int(sum(remote_sizes))
    if 2 * nl > local_pool or 2 * nr > remote_pool:
        return None
    even_l, even_r = 2 * np.arange(nl, dtype=np.int64), 2 * np.arange(nr, dtype=np.int64)

    def out(lflat: np.ndarray, rflat: np.ndarray) -> np.ndarray:
        return np.asarray(run(_split(lflat, local_sizes), _split(rflat, remote_sizes)), dtype=np.int64)

    try:
        base = out(even_l, even_r)
        step_l = out(even_l + 1, even_r) - base  # the factor of an element taken from a local id
        step_r = out(even_l, even_r + 1) - base
        rev_l = out(even_l[::-1].copy(), even_r)  # ids in reverse order: tells the position
        rev_r = out(even_l, even_r[::-1].copy())
    except Exception:  # noqa: BLE001 - a shape the planner refuses stays on the general path
        return None
    if any(x.shape != base.shape for x in (step_l, step_r, rev_l, rev_r)) or np.any(
        (step_l != 0) & (step_r != 0)
    ):
        return None
    factor = step_l + step_r
    remote = step_r != 0
    rev = np.where(remote, rev_r, rev_l)
    n = np.where(remote, nr, nl)
    # base = c + 2 m p and rev = c + 2 m (n - 1 - p): c = (base + rev) / 2 - m (n - 1), p = (base - c) / (2 m)
    twice_c = base + rev - 2 * factor * (n - 1)
    moving = factor != 0
    if np.any(twice_c[moving] % 2):
        return None
    const = np.where(moving, twice_c // 2, base)
    position = np.zeros(base.size, dtype=np.int64)
    if moving.any():
        num, den = base[moving] - const[moving], 2 * factor[moving]
        if np.any(num % den):
            return None
        position[moving] = num // den
    if np.any(position < 0) or np.any(position >= np.maximum(n, 1)):
        return None
    recipe = Recipe(np.where(remote, position + nl, position), factor, const)
    for lflat, rflat, want in (
        (even_l, even_r, base),
        (even_l + 1, even_r, base + step_l),
        (even_l[::-1], even_r, rev_l),
        (even_l, even_r[::-1], rev_r),
    ):
        if not np.array_equal(recipe.apply(np.concatenate([lflat, rflat])), want):
            return None
    return recipe
