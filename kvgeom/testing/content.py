"""Known content for real transfers: every source byte encodes its logical coordinate, so that the
consumer can check each received byte against the independent layout model (:mod:`kvgeom.testing._layout`).

``byte_of(tag, salt)`` maps a coordinate tag (see :class:`kvgeom.testing.CoordSpace`) to a byte by hashing;
the ``salt`` (one per request) makes two requests of equal length hold different bytes, so that one
request's bytes landing in another's blocks is seen. ``fill_source`` writes a request's coordinates into a
producer rank's tensors; ``verify_report`` compares a consumer rank's tensors with the expected bytes of
all its requests, zero-or-poison in free blocks, and the poison everywhere else, and counts bad bytes.

The tensors are numpy arrays or torch tensors (CPU or CUDA: read through ``.cpu().numpy()``, a CUDA tensor
written back with ``copy_``); this module imports no torch. The demo and the transport's test host
(``kvgeom_lab``) fill and check their ranks with it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvgeom.blocks import as_group_ids, logical_to_kernel
from kvgeom.layout.card import GeometryCard
from kvgeom.layout.geometry import RankGeometry
from kvgeom.testing._coords import CoordSpace
from kvgeom.testing._layout import NEEDED, OPTIONAL, OUTSIDE, rank_image

__all__ = [
    "BACKGROUND",
    "POISON_BYTE",
    "byte_of",
    "fill_source",
    "verify",
    "verify_report",
    "check_request",
    "Mismatch",
    "Report",
]

BACKGROUND = 0x5A  # producer bytes outside any request
POISON_BYTE = 0xA5  # consumer bytes before anything is received


def byte_of(tags: np.ndarray, salt: int = 0) -> np.ndarray:
    """One byte per coordinate tag and request salt (a multiplicative hash; misplaced bytes differ with
    p = 255/256)."""
    h = (
        np.asarray(tags, dtype=np.uint64) + np.uint64(1) + np.uint64(salt) * np.uint64(0x100000001B3)
    ) * np.uint64(0x9E3779B97F4A7C15)
    return np.asarray(h >> np.uint64(56), dtype=np.uint8)


def _np(t: Any) -> np.ndarray:
    if isinstance(t, np.ndarray):
        return t
    return np.asarray(t.cpu().numpy() if t.device.type != "cpu" else t.numpy())


def fill_source(
    tensors: Sequence[Any],
    card: GeometryCard,
    space: CoordSpace,
    ids: Sequence[Sequence[int]],
    num_tokens: int,
    salt: int = 0,
) -> int:
    """Write a request's coordinate bytes into a producer rank's tensors; returns bytes written."""
    img = rank_image(card.geometry, space, ids, 0, num_tokens)
    written = 0
    for region, t in enumerate(tensors):
        mask = img.tags[region] >= 0
        host = _np(t)  # CPU tensors: a view; CUDA tensors: a copy, written back below
        host[mask] = byte_of(img.tags[region][mask], salt)
        if not isinstance(t, np.ndarray) and t.device.type != "cpu":
            t.copy_(t.new_tensor(host))  # a tensor of t's dtype on t's device, from the host copy
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


@dataclass(frozen=True)
class Report:
    """Outcome of :func:`verify_report`: mismatching runs (at most ``limit``), the number of bad bytes,
    bytes checked, and bytes not checked because their blocks are still quarantined."""

    mismatches: list[Mismatch]
    bad_bytes: int
    checked_bytes: int
    skipped_bytes: int
    bad_outside: int = 0  # of bad_bytes, those outside every successful request's blocks


def verify(
    tensors: Sequence[Any],
    card: GeometryCard,
    space: CoordSpace,
    requests: Sequence[tuple[Any, ...]],
    limit: int = 20,
) -> list[Mismatch]:
    """Check a consumer rank after its requests (see :func:`verify_report`); the mismatching runs."""
    return verify_report(tensors, card, space, requests, limit=limit).mismatches


def _page_mask(geom: RankGeometry, ids: Sequence[Sequence[int]]) -> list[np.ndarray]:
    """Per region, the bytes of the kernel blocks the ids name (an SSM group's id: all its kernel blocks)."""
    kinds = geom.group_is_ssm
    kernel = logical_to_kernel(as_group_ids(ids, kinds, "ids"), geom.ppl, kinds)
    blocks = [
        k if not ssm else (k[:, None] * geom.ppl + np.arange(geom.ppl)).ravel()
        for k, ssm in zip(kernel, kinds)
    ]
    whole = np.unique(np.concatenate([np.zeros(0, np.int64), *blocks]))
    masks = []
    for r in geom.regions:
        mask = np.zeros(r.nbytes, dtype=bool)
        for b in whole.tolist():
            mask[b * r.block_stride : (b + 1) * r.block_stride] = True
        masks.append(mask)
    return masks


def verify_report(
    tensors: Sequence[Any],
    card: GeometryCard,
    space: CoordSpace,
    requests: Sequence[tuple[Any, ...]],
    free_ids: Sequence[Sequence[int]] = (),
    skip_ids: Sequence[Sequence[int]] = (),
    limit: int = 20,
) -> Report:
    """Check a consumer rank after its requests. Each request is ``(ids, first_token, num_tokens, ok)``
    or ``(..., ok, salt)``: a successful request's needed bytes must hold their coordinates (optional
    ones: theirs or zero); a failed request's blocks must be zero or untouched. ``free_ids`` (per group)
    are blocks given back to the pool: zero or untouched. ``skip_ids`` are still quarantined: not
    checked (nothing hands them out). Every other byte keeps the poison."""
    geom = card.geometry
    expected, optional, failed = _expectations(geom, space, requests)
    skip = [np.zeros(r.nbytes, dtype=bool) for r in geom.regions]
    if any(len(g) for g in free_ids):
        for region, m in enumerate(_page_mask(geom, free_ids)):
            failed[region] |= m
    if any(len(g) for g in skip_ids):
        skip = _page_mask(geom, skip_ids)
    out: list[Mismatch] = []
    bad_total = checked = skipped = outside = 0
    for region, t in enumerate(tensors):
        got = _np(t).astype(np.int16)
        want = expected[region]
        bad = _bad_bytes(got, want, optional[region], failed[region]) & ~skip[region]
        bad_total += int(bad.sum())
        outside += int((bad & (want == -1)).sum())
        skipped += int(skip[region].sum())
        checked += got.size - int(skip[region].sum())
        for off, n in _runs(bad)[: max(0, limit - len(out))]:
            out.append(Mismatch(region, off, n, _mismatch_kind(int(want[off]), bool(failed[region][off]))))
    return Report(out, bad_total, checked, skipped, outside)


def _expectations(
    geom: RankGeometry, space: CoordSpace, requests: Sequence[tuple[Any, ...]]
) -> tuple[list[np.ndarray], list[np.ndarray], list[np.ndarray]]:
    """Per region, after ``requests``: the byte each position must hold (-1 the poison, -2 anything),
    where zero is allowed too (optional bytes), and the blocks of failed requests."""
    expected = [np.full(r.nbytes, -1, dtype=np.int16) for r in geom.regions]  # -1: poison expected
    optional = [np.zeros(r.nbytes, dtype=bool) for r in geom.regions]
    failed = [np.zeros(r.nbytes, dtype=bool) for r in geom.regions]
    for req in requests:
        ids, first, num_tokens, ok = req[:4]
        salt = req[4] if len(req) > 4 else 0
        img = rank_image(geom, space, ids, first, num_tokens)
        for region in range(len(expected)):
            inside = img.role[region] != OUTSIDE
            if not ok:
                failed[region] |= inside
                continue
            expected[region][inside] = -2  # padding: anything
            needed = (img.role[region] == NEEDED) | (img.role[region] == OPTIONAL)
            expected[region][needed] = byte_of(img.tags[region][needed], salt)
            optional[region] |= img.role[region] == OPTIONAL
    return expected, optional, failed


def _bad_bytes(got: np.ndarray, want: np.ndarray, optional: np.ndarray, failed: np.ndarray) -> np.ndarray:
    """Where one region's bytes ``got`` break ``want``: poison changed, a failed or free block neither
    zero nor untouched, content wrong (an optional byte may be zero)."""
    bad = np.zeros(got.size, dtype=bool)
    poison = want == -1
    bad |= poison & ~failed & (got != POISON_BYTE)
    bad |= failed & (got != 0) & (got != POISON_BYTE)
    content = want >= 0
    bad |= content & (got != want) & ~(optional & (got == 0))
    return bad


def _mismatch_kind(want: int, failed: bool) -> str:
    """What a bad run is, from the first byte's expectation and whether its block failed or is free."""
    if want == -1 and not failed:
        return "changed outside the request"
    if want == -1:
        return "not zero in a failed or free block"
    if want >= 0:
        return "wrong or missing content"
    return "not zeroed after failure"


def check_request(
    tensors: Sequence[Any],
    card: GeometryCard,
    space: CoordSpace,
    ids: Sequence[Sequence[int]],
    num_tokens: int,
    salt: int = 0,
) -> int:
    """Bad bytes inside one request's blocks right after it completed (content where the oracle expects
    it, anything in padding): what a consumer checks before it reports the request done."""
    img = rank_image(card.geometry, space, ids, 0, num_tokens)
    bad = 0
    for region, t in enumerate(tensors):
        needed = (img.role[region] == NEEDED) | (img.role[region] == OPTIONAL)
        if not needed.any():
            continue
        got = _np(t)[needed]
        want = byte_of(img.tags[region][needed], salt)
        opt = (img.role[region] == OPTIONAL)[needed]
        bad += int(((got != want) & ~(opt & (got == 0))).sum())
    return bad
