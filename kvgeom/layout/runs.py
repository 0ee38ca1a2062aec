"""The one layout value: **strided runs** of bytes.

A :class:`Runs` is an ordered list of runs ``(base, length, stride, count)``: run ``i`` stands for the
``count[i]`` byte ranges ``[base[i] + k * stride[i], base[i] + k * stride[i] + length[i])``, ``k <
count[i]``, its **elements**, in that order; the elements of all runs, run by run, are the value's
elements, and an element's index is its **id** (a descriptor id, where the runs are a descriptor table).
Addresses are plain integers: a real address, an offset inside a block, or a pseudo-address
(:func:`kvgeom.layout.view.pseudo`, ``region << 44 | offset``), which keeps regions apart.

Every layout kvgeom computes is one: a descriptor table (NIXL's N x 5 strided form is ``(base, length,
device, stride, count)``, :meth:`Runs.from_nixl` / :meth:`Runs.nixl`), a page's token runs (one element per
row, ``length`` one token's bytes: :meth:`Runs.units` takes a token range), a request's byte rows
(``count`` 1), and a replicated copy (``stride`` 0: the same bytes ``count`` times). The operations are
pure and vectorised (numpy, never a Python loop per element):

* :meth:`Runs.slice` -- the same sub-range of every element (what a route cuts: a head slice, a conv piece);
* :meth:`Runs.units` -- units ``[a, a + n)`` of every element, an element being one unit wide (a token range
  of a page's token runs);
* :meth:`Runs.compose` -- ``inner`` placed in every element of the value (blocks of a region x the runs
  of one block);
* :meth:`Runs.joined` -- consecutive runs that continue one another merged, the elements unchanged (fewer
  runs, the same ids);
* :meth:`Runs.coalesced` -- the bytes as the fewest disjoint ranges (what zeroing needs); and
  :func:`coalesce_moves`, pairs of elements that are contiguous on both sides as one pair (what a transfer
  posts);
* :meth:`Runs.expand` / :meth:`Runs.take` -- the elements (all, or by id) as ``(address, length)``.

A transport posts a request's moves with :func:`merge_runs` (its ``(region, offset, length)`` rows of each side
as the fewest pairs contiguous on both sides, checked inside their regions) and :func:`addressed` (rows as
NIXL's ``(addr, nbytes, device_id)`` for registered base addresses); both NIXL transports use them
(``kvgeom_nixl.KVRank`` and ``kvgeom_vllm``'s kvgeom mode).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvgeom.errors import PlanError
from kvgeom.layout.view import OFFSET_MASK, REGION_SHIFT

__all__ = ["Runs", "addressed", "coalesce_moves", "merge_runs"]

IntArray = int | Sequence[int] | np.ndarray


def _check_sizes(length: np.ndarray, count: np.ndarray) -> None:
    for f, c in (("length", length), ("count", count)):
        if c.size and int(c.min()) < 0:
            raise PlanError(f"runs.{f}", "must be >= 0", value=int(c.min()))


def _col(x: IntArray, n: int, field: str) -> np.ndarray:
    a = np.asarray(x, dtype=np.int64).reshape(-1)
    if a.size == 1 and n != 1:
        return np.full(n, int(a[0]), dtype=np.int64)
    if a.size != n:
        raise PlanError(field, f"{a.size} values for {n} runs", value=int(a.size), expected=n)
    return a


@dataclass(frozen=True, eq=False)
class Runs:
    """Strided runs ``(base, length, stride, count)``: four ``int64`` arrays of one length (module doc).
    Lengths and counts are never negative."""

    base: np.ndarray
    length: np.ndarray
    stride: np.ndarray
    count: np.ndarray

    def __post_init__(self) -> None:
        cols = [np.asarray(getattr(self, f), dtype=np.int64).reshape(-1) for f in _FIELDS]
        n = cols[0].size
        for f, c in zip(_FIELDS, cols):
            if c.size != n:
                raise PlanError(f"runs.{f}", f"{c.size} values for {n} runs", value=int(c.size), expected=n)
            object.__setattr__(self, f, c)
        _check_sizes(cols[1], cols[3])

    # -- construction -------------------------------------------------------------------------------
    @classmethod
    def _made(cls, base: np.ndarray, length: np.ndarray, stride: np.ndarray, count: np.ndarray) -> Runs:
        """Runs from columns an operation computed from valid runs (``int64``, one length, lengths and
        counts >= 0): the checks of the public constructor skipped."""
        out = object.__new__(cls)
        object.__setattr__(out, "base", base)
        object.__setattr__(out, "length", length)
        object.__setattr__(out, "stride", stride)
        object.__setattr__(out, "count", count)
        return out

    @classmethod
    def of(cls, base: IntArray, length: IntArray, stride: IntArray = 0, count: IntArray = 1) -> Runs:
        """Runs from columns; a one-value column is repeated for every run."""
        n = max(np.size(base), np.size(length), np.size(stride), np.size(count))
        cols = (
            _col(base, n, "base"),
            _col(length, n, "length"),
            _col(stride, n, "stride"),
            _col(count, n, "count"),
        )
        _check_sizes(cols[1], cols[3])
        return cls._made(*cols)

    @classmethod
    def empty(cls) -> Runs:
        e = np.zeros(0, dtype=np.int64)
        return cls(e, e, e, e)

    @classmethod
    def ranges(cls, address: IntArray, length: IntArray) -> Runs:
        """One element per ``(address, length)`` range (``count`` 1, ``stride`` the length)."""
        a = np.asarray(address, dtype=np.int64).reshape(-1)
        ln = _col(length, a.size, "length")
        if a.size and int(ln.min()) < 0:
            raise PlanError("runs.length", "must be >= 0", value=int(ln.min()))
        return cls._made(a, ln, ln, np.ones(a.size, dtype=np.int64))

    @classmethod
    def from_rows(cls, rows: np.ndarray) -> Runs:
        """``(region, offset, length)`` rows (a plan's moves, zero rows) as one element each, at
        pseudo-addresses (``region << 44 | offset``), so that no operation joins two regions."""
        r = np.asarray(rows, dtype=np.int64).reshape(-1, 3)
        return cls.ranges((r[:, 0] << REGION_SHIFT) | r[:, 1], r[:, 2])

    def rows(self) -> np.ndarray:
        """Every element as a ``(region, offset, length)`` row (the inverse of :meth:`from_rows`)."""
        addr, length = self.expand()
        return np.column_stack([addr >> REGION_SHIFT, addr & OFFSET_MASK, length])

    @classmethod
    def from_nixl(cls, rows: np.ndarray) -> Runs:
        """NIXL's N x 5 strided rows ``(addr, len, dev, stride, count)``, or N x 3 ``(addr, len, dev)``
        descriptors (one element each); the device column is dropped."""
        r = np.asarray(rows, dtype=np.int64)
        if r.size == 0:
            return cls.empty()
        if r.ndim != 2 or r.shape[1] not in (3, 5):
            raise PlanError("rows", f"must be N x 3 or N x 5, got shape {r.shape}", value=r.shape)
        if r.shape[1] == 3:
            return cls.ranges(r[:, 0], r[:, 1])
        length, count = r[:, 1].copy(), r[:, 4].copy()
        _check_sizes(length, count)
        return cls._made(r[:, 0].copy(), length, r[:, 3].copy(), count)

    @classmethod
    def concat(cls, parts: Sequence[Runs]) -> Runs:
        """The runs of ``parts``, in order."""
        parts = [p for p in parts if len(p)]
        if not parts:
            return cls.empty()
        if len(parts) == 1:
            return parts[0]
        return cls._made(
            np.concatenate([p.base for p in parts]),
            np.concatenate([p.length for p in parts]),
            np.concatenate([p.stride for p in parts]),
            np.concatenate([p.count for p in parts]),
        )

    # -- size ---------------------------------------------------------------------------------------
    def __len__(self) -> int:
        return int(self.base.size)

    @property
    def size(self) -> int:
        """The number of elements (descriptors)."""
        return int(self.count.sum())

    @property
    def nbytes(self) -> int:
        """The bytes of every element, counted once per element."""
        return int((self.length * self.count).sum())

    def starts(self) -> np.ndarray:
        """The id of each run's first element."""
        out: np.ndarray = np.cumsum(self.count) - self.count
        return out

    # -- conversion ---------------------------------------------------------------------------------
    def table(self) -> np.ndarray:
        """The runs as an N x 4 ``int64`` array ``(base, length, stride, count)``."""
        return np.column_stack([self.base, self.length, self.stride, self.count]).reshape(-1, 4)

    def nixl(self, device: int = 0) -> np.ndarray:
        """NIXL's N x 5 ``int64`` strided rows ``(addr, len, dev, stride, count)``."""
        out = np.empty((len(self), 5), dtype=np.int64)
        out[:, 0], out[:, 1], out[:, 2], out[:, 3], out[:, 4] = (
            self.base,
            self.length,
            device,
            self.stride,
            self.count,
        )
        return out

    def expand(self) -> tuple[np.ndarray, np.ndarray]:
        """Every element as ``(address, length)``, in id order."""
        if (self.count == 1).all():  # one element per run (byte rows): the columns themselves
            return self.base, self.length
        run = np.repeat(np.arange(len(self)), self.count)
        k = np.arange(run.size, dtype=np.int64) - np.repeat(self.starts(), self.count)
        return self.base[run] + k * self.stride[run], self.length[run]

    def take(self, ids: IntArray) -> tuple[np.ndarray, np.ndarray]:
        """Elements ``ids`` as ``(address, length)``, without expanding the runs; an id outside ``[0,
        size)`` is a :class:`~kvgeom.errors.PlanError`."""
        i = np.asarray(ids, dtype=np.int64).reshape(-1)
        n = self.size
        if i.size and (int(i.min()) < 0 or int(i.max()) >= n):
            raise PlanError("ids", f"id outside the {n} elements", value=int(i.max()), expected=n)
        ends = np.cumsum(self.count)
        run = np.searchsorted(ends, i, side="right")
        k = i - (ends[run] - self.count[run])
        return self.base[run] + k * self.stride[run], self.length[run]

    # -- operations ---------------------------------------------------------------------------------
    def slice(self, offset: IntArray, length: IntArray) -> Runs:
        """Bytes ``[offset, offset + length)`` of every element (per run, or one value for all); a slice
        past an element is a :class:`~kvgeom.errors.PlanError`."""
        off, ln = _col(offset, len(self), "offset"), _col(length, len(self), "length")
        bad = (off < 0) | (ln < 0) | (off + ln > self.length)
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise PlanError(
                "slice",
                f"bytes [{int(off[i])}, {int(off[i] + ln[i])}) of a {int(self.length[i])}-byte element",
                value=(int(off[i]), int(ln[i])),
                expected=int(self.length[i]),
            )
        return Runs._made(self.base + off, ln, self.stride, self.count)

    def units(self, first: IntArray, n: IntArray) -> Runs:
        """Units ``[first, first + n)`` of every element, where an element is one unit (say one token's
        bytes of a row): the ``n * length`` bytes at ``base + first * length``, rows ``stride`` apart."""
        a, m = _col(first, len(self), "first"), _col(n, len(self), "n")
        if len(self) and (int(a.min()) < 0 or int(m.min()) < 0):
            raise PlanError(
                "units", "first unit and unit count must be >= 0", value=(int(a.min()), int(m.min()))
            )
        return Runs._made(self.base + a * self.length, m * self.length, self.stride, self.count)

    def shift(self, delta: IntArray) -> Runs:
        """Every element moved by ``delta`` bytes (per run, or one value for all)."""
        return Runs._made(self.base + _col(delta, len(self), "delta"), self.length, self.stride, self.count)

    def compose(self, inner: Runs) -> Runs:
        """``inner`` placed in every element of this value (its addresses relative to the element's first
        byte): run by run, element by element, then ``inner``'s runs in order. Each element becomes
        ``len(inner)`` runs, so compose frames with few elements (blocks of a table, not tokens)."""
        frame, _ = self.expand()
        return Runs._made(
            (frame[:, None] + inner.base[None, :]).reshape(-1),
            np.tile(inner.length, frame.size),
            np.tile(inner.stride, frame.size),
            np.tile(inner.count, frame.size),
        )

    def joined(self) -> Runs:
        """Consecutive runs of one length and stride where each continues the one before (its first element
        one stride past the other's last) merged into one run: the same elements in the same order."""
        if len(self) < 2:
            return self
        nxt = self.base[:-1] + self.count[:-1] * self.stride[:-1]
        cont = (
            (self.length[1:] == self.length[:-1])
            & (self.stride[1:] == self.stride[:-1])
            & (self.base[1:] == nxt)
            & (self.count[:-1] > 0)
        )
        if not cont.any():
            return self
        first = np.flatnonzero(np.append(True, ~cont))
        return Runs._made(
            self.base[first], self.length[first], self.stride[first], np.add.reduceat(self.count, first)
        )

    def coalesced(self) -> Runs:
        """The bytes of every element as the fewest disjoint ranges (``count`` 1), sorted by address:
        touching or overlapping elements become one range; empty elements are dropped."""
        a, ln = self.expand()
        keep = ln > 0
        if not keep.all():
            a, ln = a[keep], ln[keep]
        if not a.size:
            return Runs.empty()
        end = a + ln
        if (a[1:] < a[:-1]).any():
            order = np.argsort(a, kind="stable")
            a, end = a[order], end[order]
        reach = np.maximum.accumulate(end)  # an element may end before the one it lies in
        first = np.flatnonzero(a[1:] > reach[:-1]) + 1
        start = a[np.append(0, first)]
        stop = reach[np.append(first - 1, a.size - 1)]
        ln = stop - start
        return Runs._made(start, ln, ln, np.ones(start.size, dtype=np.int64))


_FIELDS = ("base", "length", "stride", "count")


def coalesce_moves(src: Runs, dst: Runs) -> tuple[Runs, Runs]:
    """Moves ``src`` element ``i`` -> ``dst`` element ``i`` (equal lengths) as the fewest moves: sorted by
    source then destination address, a maximal chain of moves contiguous on both sides is one move.
    Addresses should be pseudo-addresses (or real ones) so that two regions never touch."""
    s_addr, s_len = src.expand()
    d_addr, d_len = dst.expand()
    if s_addr.size != d_addr.size:
        raise PlanError("moves", f"{s_addr.size} source and {d_addr.size} destination elements")
    if (s_len != d_len).any():
        i = int(np.flatnonzero(s_len != d_len)[0])
        raise PlanError("moves", f"move {i}: {int(s_len[i])} source and {int(d_len[i])} destination bytes")
    if s_addr.size > 1:
        order = np.lexsort((d_addr, s_addr))
        if (order[1:] < order[:-1]).any():
            s_addr, d_addr, s_len = s_addr[order], d_addr[order], s_len[order]
        join = (s_addr[1:] == s_addr[:-1] + s_len[:-1]) & (d_addr[1:] == d_addr[:-1] + s_len[:-1])
        if join.any():
            first = np.flatnonzero(np.append(True, ~join))
            ln = np.add.reduceat(s_len, first)
            return Runs.ranges(s_addr[first], ln), Runs.ranges(d_addr[first], ln)
    return Runs.ranges(s_addr, s_len), Runs.ranges(d_addr, s_len)


def merge_runs(
    local: np.ndarray, remote: np.ndarray, local_sizes: Sequence[int], remote_sizes: Sequence[int], src: str
) -> tuple[np.ndarray, np.ndarray]:
    """One transfer's descriptor pairs (``(region, offset, length)`` rows of each side, row ``i`` moving
    with row ``i``) as the fewest pairs (:func:`coalesce_moves` at pseudo-addresses): a maximal run of pairs
    that are contiguous on both sides, within one region on each side, is one pair. Pairs are ordered as
    :func:`kvgeom.plan.requestplan.contiguous_runs` orders moves (by the ``src`` side, ``"local"`` or
    ``"remote"``, then the other), so the count equals it. Returns the merged ``(region, offset, length)`` rows
    of each side. A merged row outside its region (``*_sizes``) raises :class:`~kvgeom.errors.PlanError`
    (never posted: NIXL would refuse it, or, where two registrations lie side by side, move bytes of the
    wrong region)."""
    local = np.asarray(local, dtype=np.int64).reshape(-1, 3)
    remote = np.asarray(remote, dtype=np.int64).reshape(-1, 3)
    if local.shape != remote.shape:
        raise PlanError("descriptor pairs", f"{len(local)} local rows for {len(remote)} remote rows")
    if (local[:, 2] != remote[:, 2]).any():
        i = int(np.flatnonzero(local[:, 2] != remote[:, 2])[0])
        raise PlanError(
            "descriptor length", f"pair {i}: local {int(local[i, 2])} B, remote {int(remote[i, 2])} B"
        )
    s, d = (local, remote) if src == "local" else (remote, local)
    if len(s) > 1:  # as pseudo-addresses, so that no run crosses a region on either side
        sm, dm = coalesce_moves(Runs.from_rows(s), Runs.from_rows(d))
        s, d = sm.rows(), dm.rows()
    out_l, out_r = (s, d) if src == "local" else (d, s)
    for rows, sizes, side in ((out_l, local_sizes, "local"), (out_r, remote_sizes, "remote")):
        size = np.asarray(sizes, dtype=np.int64)
        reg = rows[:, 0]
        if len(rows) and (int(reg.min()) < 0 or int(reg.max()) >= size.size):
            raise PlanError(f"{side} region", f"a run names region {int(reg.max())}; there are {size.size}")
        bad = (rows[:, 1] < 0) | (rows[:, 1] + rows[:, 2] > size[reg]) if len(rows) else np.zeros(0, bool)
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise PlanError(
                f"{side} run",
                f"run {rows[i].tolist()} ends past its region ({int(size[reg[i]])} B)",
                value=int(rows[i, 1] + rows[i, 2]),
                expected=int(size[reg[i]]),
            )
    return out_l, out_r


def addressed(rows: np.ndarray, bases: Sequence[int], device: int) -> np.ndarray:
    """``(region, offset, length)`` rows as NIXL's N x 3 ``(addr, nbytes, device_id)``."""
    out = np.empty((len(rows), 3), dtype=np.uint64)
    out[:, 0] = np.asarray(bases, dtype=np.uint64)[rows[:, 0]] + rows[:, 1].astype(np.uint64)
    out[:, 1] = rows[:, 2].astype(np.uint64)
    out[:, 2] = np.uint64(device)
    return out
