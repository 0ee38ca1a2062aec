"""Known content for real transfers: every source byte encodes its logical coordinate, so that the
consumer can check each received byte against kvgeom.testing's independent layout model.

``byte_of(tag)`` maps a coordinate tag (see :class:`kvgeom.testing.CoordSpace`) to a byte by hashing;
``fill_source`` writes a request's coordinates into a producer rank's tensors; ``verify`` compares a
consumer rank's tensors with the expected bytes of all its requests (and the poison everywhere else).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvgeom import GeometryCard
from kvgeom.testing import CoordSpace
from kvgeom.testing._layout import NEEDED, OPTIONAL, OUTSIDE, rank_image

__all__ = ["BACKGROUND", "POISON_BYTE", "byte_of", "fill_source", "verify", "Mismatch"]

BACKGROUND = 0x5A  # producer bytes outside any request
POISON_BYTE = 0xA5  # consumer bytes before anything is received


def byte_of(tags: np.ndarray) -> np.ndarray:
    """One byte per coordinate tag (a multiplicative hash; misplaced bytes differ with p = 255/256)."""
    h = (np.asarray(tags, dtype=np.uint64) + np.uint64(1)) * np.uint64(0x9E3779B97F4A7C15)
    return (h >> np.uint64(56)).astype(np.uint8)


def _np(t) -> np.ndarray:
    return t.cpu().numpy() if t.device.type != "cpu" else t.numpy()


def fill_source(tensors: Sequence, card: GeometryCard, space: CoordSpace, ids: Sequence[Sequence[int]],
                num_tokens: int) -> int:
    """Write a request's coordinate bytes into a producer rank's tensors; returns bytes written."""
    img = rank_image(card.geometry, space, ids, 0, num_tokens)
    written = 0
    for region, t in enumerate(tensors):
        mask = img.tags[region] >= 0
        host = _np(t)  # CPU tensors: a view; CUDA tensors: a copy, written back below
        host[mask] = byte_of(img.tags[region][mask])
        if t.device.type != "cpu":
            import torch

            t.copy_(torch.from_numpy(host).to(t.device))
        written += int(mask.sum())
    return written


@dataclass(frozen=True)
class Mismatch:
    """A run of bytes that does not hold what it should."""

    region: int
    offset: int
    length: int
    what: str

    def __str__(self) -> str:
        return f"region {self.region} bytes [{self.offset}, {self.offset + self.length}): {self.what}"


def _runs(mask: np.ndarray) -> list[tuple[int, int]]:
    idx = np.flatnonzero(mask)
    if not idx.size:
        return []
    cuts = np.flatnonzero(np.diff(idx) != 1)
    starts = np.concatenate([[idx[0]], idx[cuts + 1]])
    ends = np.concatenate([idx[cuts], [idx[-1]]]) + 1
    return list(zip(starts.tolist(), (ends - starts).tolist()))


def verify(tensors: Sequence, card: GeometryCard, space: CoordSpace,
           requests: Sequence[tuple[Sequence[Sequence[int]], int, int, bool]], limit: int = 20) -> list[Mismatch]:
    """Check a consumer rank after its requests. Each request is ``(ids, first_token, num_tokens, ok)``:
    a successful request's needed bytes must hold their coordinates (optional ones: theirs or zero); a
    failed request's blocks must be zero or untouched; bytes outside every request keep the poison."""
    geom = card.geometry
    expected = [np.full(r.nbytes, -1, dtype=np.int16) for r in geom.regions]  # -1: poison expected
    optional = [np.zeros(r.nbytes, dtype=bool) for r in geom.regions]
    failed = [np.zeros(r.nbytes, dtype=bool) for r in geom.regions]
    for ids, first, num_tokens, ok in requests:
        img = rank_image(geom, space, ids, first, num_tokens)
        for region in range(len(expected)):
            inside = img.role[region] != OUTSIDE
            if not ok:
                failed[region] |= inside
                continue
            expected[region][inside] = -2  # padding: anything
            needed = (img.role[region] == NEEDED) | (img.role[region] == OPTIONAL)
            expected[region][needed] = byte_of(img.tags[region][needed])
            optional[region] |= img.role[region] == OPTIONAL
    out: list[Mismatch] = []
    for region, t in enumerate(tensors):
        got = _np(t).astype(np.int16)
        want = expected[region]
        bad = np.zeros(got.size, dtype=bool)
        poison = want == -1
        bad |= poison & ~failed[region] & (got != POISON_BYTE)
        bad |= failed[region] & (got != 0) & (got != POISON_BYTE)
        content = want >= 0
        bad |= content & (got != want) & ~(optional[region] & (got == 0))
        for off, n in _runs(bad)[:limit]:
            kind = ("changed outside the request" if want[off] == -1 else
                    "wrong or missing content" if want[off] >= 0 else "not zeroed after failure")
            out.append(Mismatch(region, off, n, kind))
    return out
