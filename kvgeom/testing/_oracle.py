"""The byte oracle's arrays and checks: :class:`Oracle` holds every P and D rank's tagged bytes for one request,
executes moves, zero ranges and regroups on them, and reports I1-I6 (the invariants and the tagging are described
in :mod:`kvgeom.testing.oracle`, which plans requests with kvgeom and runs them here)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvgeom.layout.engine import EngineConfig, KVLayout
from kvgeom.layout.geometry import RankGeometry
from kvgeom.model.spec import ModelSpec
from kvgeom.plan.pairing import Pairing
from kvgeom.plan.requestplan import Regroup, RequestPlan
from kvgeom.testing._coords import POISON, ZERO, CoordSpace, describe_tag, location_tags
from kvgeom.testing._layout import (
    NEEDED,
    OPTIONAL,
    OUTSIDE,
    PADDING,
    RankImage,
    block_span,
    byte_places,
    rank_image,
    region_arrays,
    reported_bytes,
)
from kvgeom.testing._report import Report, Violation
from kvgeom.testing._request import Request, RequestError, check_side, engine_geometries

__all__ = ["D_SIDE", "P_SIDE", "Oracle", "RankPlan"]

_UNWRITTEN = np.iinfo(np.int64).min
P_SIDE, D_SIDE = 0, 1


@dataclass(frozen=True)
class RankPlan:
    """The plan kvgeom made on one local rank (D in pull, P in push), with its pairing."""

    rank: int
    pairing: Pairing
    plan: RequestPlan


class Oracle:
    """Tagged byte arrays of every P and D rank for one request, and the checks I1-I6."""

    def __init__(
        self,
        model: ModelSpec,
        p_geoms: Sequence[RankGeometry],
        d_geoms: Sequence[RankGeometry],
        request: Request,
        limit: int = 20,
    ) -> None:
        self.model, self.request = model, request
        self.p, self.d = list(p_geoms), list(d_geoms)
        for side, geoms in (("P", self.p), ("D", self.d)):
            if [g.global_rank for g in geoms] != list(range(len(geoms))):
                raise RequestError(
                    f"{side.lower()}_geoms",
                    f"{side} geometries must be ranks 0..{len(geoms) - 1} in order (every TP rank "
                    "of every pipeline stage)",
                    value=[g.global_rank for g in geoms],
                    expected=list(range(len(geoms))),
                )
        n, computed = request.num_tokens, request.p_tokens
        pb, db = self.p[0].scheduler_block, self.d[0].scheduler_block  # tokens per list entry (x DCP pages)
        check_side("p_ids", request.p_ids, self.p[0], math.ceil(computed / pb))
        check_side("d_ids", request.d_ids, self.d[0], math.ceil(n / db) - request.prefix_blocks)
        self.prefix_tokens = request.prefix_blocks * db
        attn = [g for g in self.p[0].groups if not g.one_block]
        max_tokens = max(
            [
                n,
                *(len(request.p_ids[g.index]) * pb for g in attn),
                *(self.prefix_tokens + len(request.d_ids[g.index]) * db for g in attn),
            ]
        )
        self.space = CoordSpace(model, max_tokens)
        # tokens past P's computed ones are D's to compute: needed on D are [prefix, computed)
        p_images = [rank_image(g, self.space, request.p_ids, 0, computed) for g in self.p]
        self.d_images: list[RankImage] = [
            rank_image(g, self.space, request.d_ids, self.prefix_tokens, computed) for g in self.d
        ]
        # regions sharing rows (packed CSA-linear) are views of one array per rank: bytes alias as in memory
        self.src = [region_arrays(g, 0, np.int64) for g in self.p]
        for geom, img, arrays in zip(self.p, p_images, self.src):
            for r, (a, t) in enumerate(zip(arrays, img.tags)):
                a[:] = np.where(t >= 0, t, location_tags(P_SIDE, img.rank, *byte_places(geom, r)))
        self.dst = [region_arrays(g, 0, np.int64) for g in self.d]
        for geom, img, arrays in zip(self.d, self.d_images, self.dst):
            for r, (a, role) in enumerate(zip(arrays, img.role)):
                a[:] = np.where(
                    role == OUTSIDE, location_tags(D_SIDE, img.rank, *byte_places(geom, r)), POISON
                )
        for geom in self.d:
            self._zero_own_blocks(geom, request, computed)
        self.writer = [region_arrays(g, _UNWRITTEN, np.int64) for g in self.d]
        self.result = Report(limit=limit)

    def _zero_own_blocks(self, geom: RankGeometry, request: Request, computed: int) -> None:
        """D's blocks (pages, with DCP) that hold no token P computed are D's own: allocated for tokens D
        computes itself (the N-1 flow, or DCP pages past the request's end), written by D before it reads
        them. They start as ``ZERO`` (vLLM zeroes every new block of a Mamba hybrid that no load writes,
        ``KVCacheConfig.needs_kv_cache_zeroing``), not ``POISON``: a transfer may leave them alone, and one
        that writes another coordinate there is still caught (I2)."""
        page, dcp, first = geom.logical_block_size, geom.dcp_size, request.prefix_blocks
        own = [
            b
            for g, ids in zip(geom.groups, request.d_ids)
            if not g.one_block
            for i, b in enumerate(ids)
            if ((first + i) * dcp + geom.dcp_rank) * page >= computed
        ]
        for block in own:
            for region in geom.regions:
                start, length = block_span(region, block, geom.ppl)
                self.dst[geom.global_rank][region.index][start : start + length] = ZERO

    @classmethod
    def for_engines(
        cls, model: ModelSpec, p_engine: EngineConfig, d_engine: EngineConfig, request: Request
    ) -> Oracle:
        return cls(model, engine_geometries(model, p_engine), engine_geometries(model, d_engine), request)

    # -- executing ----------------------------------------------------------------------------------
    def _region(self, side: int, rank: int, region: int) -> np.ndarray | None:
        arrays = self.src if side == P_SIDE else self.dst
        if 0 <= rank < len(arrays) and 0 <= region < len(arrays[rank]):
            return arrays[rank][region]
        return None

    def _bounds(self, side: int, rank: int, region: int, start: int, length: int, what: str) -> bool:
        arr = self._region(side, rank, region)
        size = None if arr is None else arr.size
        if size is not None and start >= 0 and length >= 0 and start + length <= size:
            return True
        where = "no such rank/region" if size is None else f"a {size}-byte region"
        self.result.add(
            Violation(
                "I6",
                "PD"[side],
                rank,
                region,
                start,
                start + max(length, 0),
                f"a range inside {where}",
                f"[{start}, {start + length})",
                what,
            ),
            count=max(length, 1),
        )
        return False

    def execute(self, moves: np.ndarray, label: str = "move") -> None:
        """Copy ``moves`` (N x 7 :data:`~kvgeom.plan.requestplan.MOVE_COLUMNS`, or N x 8 with separate source and
        destination lengths) from P ranks' arrays to D ranks' arrays."""
        moves = np.asarray(moves, dtype=np.int64)
        if moves.size == 0:
            return
        if moves.ndim != 2 or moves.shape[1] not in (7, 8):
            raise RequestError(
                "moves", f"must be an N x 7 or N x 8 array, got shape {moves.shape}", value=moves.shape
            )
        for i, row in enumerate(moves.tolist()):
            sr, sreg, soff, dr, dreg, doff, slen = row[:7]
            dlen = row[7] if len(row) == 8 else slen
            what = f"{label} #{i}"
            self.result.descriptors += 1
            if slen != dlen:
                self.result.add(
                    Violation(
                        "I2",
                        "D",
                        dr,
                        dreg,
                        doff,
                        doff + dlen,
                        f"{dlen} bytes from the source",
                        f"a {slen}-byte source descriptor",
                        f"{what}: unequal lengths",
                    ),
                    count=max(abs(slen - dlen), 1),
                )
            n = min(slen, dlen)
            if not (
                self._bounds(P_SIDE, sr, sreg, soff, slen, f"{what} source")
                & self._bounds(D_SIDE, dr, dreg, doff, dlen, f"{what} destination")
            ):
                continue
            data = self.src[sr][sreg][soff : soff + n]
            seen = self.writer[dr][dreg][doff : doff + n]
            padding = self.d_images[dr].role[dreg][doff : doff + n] == PADDING  # no coordinate: any bytes do
            clash = (seen != _UNWRITTEN) & (seen != data) & ~padding
            for a, b in _runs(clash):
                self.result.add(
                    Violation(
                        "I5",
                        "D",
                        dr,
                        dreg,
                        doff + a,
                        doff + b,
                        self._name(seen[a]),
                        self._name(data[a]),
                        f"{what} overwrites an earlier write",
                    )
                )
            seen[:] = data
            self.dst[dr][dreg][doff : doff + n] = data
            self.result.bytes_moved += n

    def zero(self, rank: int, rows: np.ndarray, label: str = "zero") -> None:
        """Apply zero ranges ``(region, offset, length)`` on D rank ``rank``."""
        for i, (region, offset, length) in enumerate(
            np.asarray(rows, dtype=np.int64).reshape(-1, 3).tolist()
        ):
            if self._bounds(D_SIDE, rank, region, offset, length, f"{label} #{i}"):
                self.dst[rank][region][offset : offset + length] = ZERO
                self.result.bytes_zeroed += length

    def regroup(self, rank: int, step: Regroup, label: str = "regroup") -> None:
        """Apply a :class:`~kvgeom.plan.requestplan.Regroup` on D rank ``rank``, per element from its documented
        meaning: a block viewed as ``[bsr, heads, tokens // bsr, head_bytes]`` is stored as
        ``[heads, tokens, head_bytes]`` (head-major ``layout``) or ``[tokens, heads, head_bytes]``
        (token-major)."""
        if step.bsr < 1 or step.tokens % step.bsr:
            self.result.add(
                Violation(
                    "I6",
                    "D",
                    rank,
                    -1,
                    0,
                    0,
                    "tokens divisible by bsr",
                    f"tokens {step.tokens}, bsr {step.bsr}",
                    label,
                )
            )
            return
        n = step.tokens // step.bsr
        h = np.arange(step.heads)[:, None, None]
        t = np.arange(step.tokens)[None, :, None]
        x = np.arange(step.head_bytes)[None, None, :]
        if step.layout is KVLayout.TOKEN_MAJOR:
            dest = ((t * step.heads + h) * step.head_bytes + x).reshape(-1)
        else:
            dest = ((h * step.tokens + t) * step.head_bytes + x).reshape(-1)
        source = (((t // n * step.heads + h) * n + t % n) * step.head_bytes + x).reshape(-1)
        length = step.heads * step.tokens * step.head_bytes
        for region in step.regions:
            if not 0 <= rank < len(self.d) or not 0 <= region < len(self.d[rank].regions):
                self._bounds(D_SIDE, rank, region, 0, length, label)
                continue
            stride = self.d[rank].regions[region].block_stride
            for block in np.asarray(step.blocks, dtype=np.int64).tolist():
                start = block * stride
                if length > stride:
                    self.result.add(
                        Violation(
                            "I6",
                            "D",
                            rank,
                            region,
                            start,
                            start + length,
                            f"at most one {stride}-byte block",
                            f"{length} bytes",
                            label,
                        )
                    )
                    continue
                if self._bounds(D_SIDE, rank, region, start, length, label):
                    arr = self.dst[rank][region]
                    arr[start + dest] = arr[start + source].copy()
                    self.result.regrouped_blocks += 1

    def run_plan(self, rank_plan: RankPlan) -> None:
        """Execute one rank's plan; in pull also its post-receive step (regroup, then zero)."""
        plan = rank_plan.plan
        label = self._label(rank_plan)
        self.execute(self.moves_of(rank_plan), label)
        if plan.mode == "pull":
            self.receive(rank_plan.rank, plan.regroup, plan.zero, label)

    @staticmethod
    def _label(rank_plan: RankPlan) -> str:
        mode = rank_plan.plan.mode
        return f"{mode} plan of {'D' if mode == 'pull' else 'P'} rank {rank_plan.rank}"

    def receive(
        self, rank: int, regroups: Sequence[Regroup], zero: np.ndarray, label: str = "receive"
    ) -> None:
        """D rank ``rank``'s post-receive step: every regroup, then the zero ranges."""
        for step in regroups:
            self.regroup(rank, step, f"{label} regroup")
        self.zero(rank, zero, f"{label} zero")

    def moves_of(self, rank_plan: RankPlan) -> np.ndarray:
        """A plan's moves, N x 8: :data:`~kvgeom.plan.requestplan.MOVE_COLUMNS` with the source and destination lengths
        both kept, so that an unequal pair is reported (I2), not raised; ids outside their descriptor table
        are reported (I6) and left out."""
        plan, pairing, label = rank_plan.plan, rank_plan.pairing, self._label(rank_plan)
        me = pairing.local.global_rank
        out = [np.zeros((0, 8), dtype=np.int64)]
        for k, t in enumerate(plan.transfers):
            tables = (pairing.local_table(t.local_table).rows, pairing.remote_table(t.remote_rank).rows)
            ids = (np.asarray(t.local_ids, dtype=np.int64), np.asarray(t.remote_ids, dtype=np.int64))
            ok = np.ones(ids[0].size, dtype=bool) if ids[0].size == ids[1].size else None
            if ok is None:
                self.result.add(
                    Violation(
                        "I2",
                        "D",
                        -1,
                        -1,
                        0,
                        0,
                        "as many local as remote ids",
                        f"{ids[0].size} local, {ids[1].size} remote",
                        f"{label} transfer {k}",
                    ),
                    count=1,
                )
                continue
            for side, table, x in zip(("local", "remote"), tables, ids):
                bad = (x < 0) | (x >= len(table))
                for i in np.flatnonzero(bad)[:3].tolist():
                    self.result.add(
                        Violation(
                            "I6",
                            "table",
                            -1,
                            -1,
                            int(x[i]),
                            int(x[i]) + 1,
                            f"an id below {len(table)}",
                            str(int(x[i])),
                            f"{label} transfer {k}: {side} id #{i}",
                        ),
                        count=1,
                    )
                ok &= ~bad
            local, remote = tables[0][ids[0][ok]], tables[1][ids[1][ok]]
            src, dst = (remote, local) if plan.mode == "pull" else (local, remote)
            peer = pairing.remotes[t.remote_rank].global_rank
            src_rank, dst_rank = (peer, me) if plan.mode == "pull" else (me, peer)
            m = np.empty((src.shape[0], 8), dtype=np.int64)
            m[:, 0], m[:, 1], m[:, 2] = src_rank, src[:, 0], src[:, 1]
            m[:, 3], m[:, 4], m[:, 5] = dst_rank, dst[:, 0], dst[:, 1]
            m[:, 6], m[:, 7] = src[:, 2], dst[:, 2]
            out.append(m)
        return np.concatenate(out)

    # -- checking -----------------------------------------------------------------------------------
    def _name(self, tag: int) -> str:
        return describe_tag(int(tag), self.space)

    def report(self) -> Report:
        """Check I1-I4 on the final D bytes (I5, I6 and unequal lengths were checked while executing)."""
        res = self.result
        for img in self.d_images:
            mine = reported_bytes(self.d[img.rank])  # bytes of rows shared by regions: judged once
            for region, (want, role) in enumerate(zip(img.tags, img.role)):
                got = self.dst[img.rank][region]
                if mine is not None:
                    role = np.where(mine[region], role, -1)  # another region reports these bytes
                resident = location_tags(D_SIDE, img.rank, *byte_places(self.d[img.rank], region))
                unset = (got == POISON) | (got == ZERO)
                checks = (
                    ("I1", (role == OUTSIDE) & (got != resident), resident),
                    ("I2", ((role == NEEDED) | (role == OPTIONAL)) & (got != want) & ~unset, want),
                    ("I3", (role == NEEDED) & unset, want),
                    ("I4", (role == OPTIONAL) & (got == POISON), want),
                )
                for inv, mask, expected in checks:
                    for a, b in _runs(mask):
                        detail = "or ZERO (token past num_tokens)" if inv == "I4" else ""
                        res.add(
                            Violation(
                                inv,
                                "D",
                                img.rank,
                                region,
                                a,
                                b,
                                self._name(expected[a]),
                                self._name(got[a]),
                                detail,
                            )
                        )
        return res


def _runs(mask: np.ndarray) -> list[tuple[int, int]]:
    """Maximal runs ``[start, stop)`` of True in a 1-D boolean array."""
    if not mask.any():
        return []
    edges = np.flatnonzero(np.diff(np.concatenate(([0], mask.view(np.int8), [0]))))
    return list(zip(edges[0::2].tolist(), edges[1::2].tolist()))
