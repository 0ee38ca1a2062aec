"""A Mooncake rank's block memory: its regions as numpy arrays, zeroing ``(region, offset, length)`` rows in the fewest runs, and the consumer's receive step (regroups, then zero ranges)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvgeom import GeometryCard, RankGeometry, Regroup, block_rows, zero_runs


def allocate(card: GeometryCard) -> list[np.ndarray]:
    """One zeroed uint8 array per region of the card's geometry (``region.nbytes`` each)."""
    return [np.zeros(r.nbytes, dtype=np.uint8) for r in card.geometry.regions]


block_spans = block_rows
"""``(region, offset, length)`` rows covering every kernel block of a request on this rank, in every region
(whole block strides): :func:`kvgeom.block_rows`, the geometry both transports zero with."""


def zero_rows(arrays: Sequence[np.ndarray], rows: np.ndarray) -> int:
    """Zero ``(region, offset, length)`` rows (merged per region where they touch); the rows' byte total.
    A row outside its region is a :class:`kvgeom.PlanError` before any byte is written."""
    rows = np.asarray(rows, dtype=np.int64).reshape(-1, 3)
    sizes = np.asarray([a.size for a in arrays], dtype=np.int64)
    run_region, start, end, total = zero_runs(rows, sizes)  # the fewest runs (kvgeom.zero_runs)
    for r, o, e in zip(run_region.tolist(), start.tolist(), end.tolist()):
        arrays[r][o:e] = 0
    return total


_ORDER = {"head_major": (0, 2, 1, 3, 4), "token_major": (0, 1, 3, 2, 4)}
"""Axes of a block seen as ``[block, bsr, heads, tokens / bsr, head_bytes]`` in the order each layout stores."""


def _regroup(arrays: Sequence[np.ndarray], geom: RankGeometry, step: Regroup) -> None:
    blocks = np.asarray(step.blocks, dtype=np.int64)
    n = step.tokens // step.bsr
    for region in step.regions:
        r = geom.regions[region]
        view = arrays[region].reshape(r.num_blocks, r.block_stride)
        page = view[blocks, : r.block_len]
        view[blocks, : r.block_len] = (
            page.reshape(-1, step.bsr, step.heads, n, step.head_bytes)
            .transpose(_ORDER[step.layout.value])
            .reshape(blocks.size, -1)
        )


def apply_receive(
    arrays: Sequence[np.ndarray], geom: RankGeometry, regroups: Sequence[Regroup], zero: np.ndarray
) -> int:
    """The consumer's receive step on its arrays: the plan's regroups, then its zero ranges."""
    for step in regroups:
        _regroup(arrays, geom, step)
    return zero_rows(arrays, zero)
