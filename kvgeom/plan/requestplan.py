"""A request's plan as a value: per remote rank the transfer (local table, descriptor ids, notification), the
ranks only notified, and what the consumer does after the bytes land (:class:`Regroup`, zero rows);
:meth:`RequestPlan.moves` resolves it into byte moves; :func:`check_writes` and :func:`contiguous_runs` read it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from kvgeom.blocks import (
    BlockIds,
    as_group_ids,
    logical_to_kernel,
)
from kvgeom.errors import PlanError
from kvgeom.layout.engine import KVLayout
from kvgeom.plan.pairing import LocalKey, Pairing

__all__ = ["MOVE_COLUMNS", "Transfer", "Regroup", "RequestPlan", "contiguous_runs", "check_writes"]


MOVE_COLUMNS = ("src_rank", "src_region", "src_offset", "dst_rank", "dst_region", "dst_offset", "length")


@dataclass(frozen=True, eq=False)
class Transfer:
    """One NIXL transfer: ``local_ids`` of local table ``local_table`` paired with ``remote_ids`` of the
    remote rank's table, carrying ``notif``."""

    remote_rank: int
    local_table: LocalKey
    local_ids: np.ndarray
    remote_ids: np.ndarray
    notif: str

    def __len__(self) -> int:
        return int(self.local_ids.size)


@dataclass(frozen=True, eq=False)
class Regroup:
    """Post-receive regroup of kernel blocks that arrived as ``bsr`` head-major remote pages: view each
    block of ``regions`` as ``[bsr, heads, tokens // bsr, head_bytes]`` and store it in ``layout``:
    ``[heads, tokens, head_bytes]`` (head-major, vLLM B.3.9 step 2) or ``[tokens, heads, head_bytes]``
    (token-major: the LBHNC-into-LBNHC permute, B.6.15; also at ``bsr`` 1)."""

    regions: tuple[int, ...]
    blocks: np.ndarray
    bsr: int
    heads: int
    tokens: int
    head_bytes: int
    layout: KVLayout = KVLayout.HEAD_MAJOR


@dataclass(frozen=True, eq=False)
class RequestPlan:
    """Everything one rank does for one request. ``zero`` rows are ``(region, offset, length)`` of the
    consumer rank ``consumer_rank`` (this rank in pull; in push, the D ranks zero their own)."""

    request_id: str
    mode: str
    transfers: tuple[Transfer, ...]
    notify_only: tuple[int, ...]
    expected_notifications: int
    consumer_rank: int
    regroup: tuple[Regroup, ...] = ()
    zero: np.ndarray = field(default_factory=lambda: np.zeros((0, 3), dtype=np.int64))

    @property
    def op(self) -> str:
        return "READ" if self.mode == "pull" else "WRITE"

    @property
    def num_descriptors(self) -> int:
        return sum(len(t) for t in self.transfers)

    def moves(self, pairing: Pairing) -> np.ndarray:
        """Byte moves, one row per descriptor pair, columns :data:`MOVE_COLUMNS`."""
        out = []
        me = pairing.local.global_rank
        for t in self.transfers:
            lrows = pairing.local_table(t.local_table).take(t.local_ids)
            rrows = pairing.remote_table(t.remote_rank).take(t.remote_ids)
            unequal = lrows[:, 2] != rrows[:, 2]
            if unequal.any():
                i = int(np.flatnonzero(unequal)[0])
                raise PlanError(
                    "descriptor length",
                    f"pair {i} of the transfer to rank {t.remote_rank} has local "
                    f"length {lrows[i, 2]} and remote length {rrows[i, 2]}",
                    local=int(lrows[i, 2]),
                    remote=int(rrows[i, 2]),
                )
            src, dst = (rrows, lrows) if self.mode == "pull" else (lrows, rrows)
            peer = pairing.remotes[t.remote_rank].global_rank
            src_rank, dst_rank = (peer, me) if self.mode == "pull" else (me, peer)
            m = np.empty((len(t), 7), dtype=np.int64)
            m[:, 0], m[:, 1], m[:, 2] = src_rank, src[:, 0], src[:, 1]
            m[:, 3], m[:, 4], m[:, 5] = dst_rank, dst[:, 0], dst[:, 1]
            m[:, 6] = src[:, 2]
            out.append(m)
        return np.concatenate(out) if out else np.zeros((0, 7), dtype=np.int64)

    def describe(self, pairing: Pairing | None = None) -> str:
        lines = [
            f"request {self.request_id!r}: {self.mode} ({self.op}), {len(self.transfers)} transfer(s), "
            f"{self.num_descriptors} descriptor pairs"
        ]
        for t in self.transfers:
            which = "whole" if t.local_table[1] < 0 else f"split for source #{t.local_table[1]}"
            line = (
                f"  rank {t.remote_rank}: {len(t)} descs, local table {which} at ratio {t.local_table[0]}, "
                f"notif {t.notif!r}"
            )
            if pairing is not None:
                nbytes = int(pairing.local_table(t.local_table).take(t.local_ids)[:, 2].sum())
                line += f", {nbytes} B"
            lines.append(line)
        if self.notify_only:
            lines.append(f"  notify only: ranks {list(self.notify_only)}")
        lines.append(f"  the other side expects {self.expected_notifications} notification(s) per rank")
        for r in self.regroup:
            into = (
                f"[{r.tokens},{r.heads},*]"
                if r.layout is KVLayout.TOKEN_MAJOR
                else f"[{r.heads},{r.tokens},*]"
            )
            lines.append(
                f"  regroup {r.blocks.size} block(s) in regions {list(r.regions)[:4]}... "
                f"([{r.bsr},{r.heads},{r.tokens // r.bsr},*] -> {into})"
            )
        if len(self.zero):
            lines.append(
                f"  zero on rank {self.consumer_rank}: {len(self.zero)} range(s), "
                f"{int(self.zero[:, 2].sum())} B"
            )
        return "\n".join(lines)


def contiguous_runs(moves: np.ndarray) -> int:
    """How many contiguous runs ``moves`` coalesce into (moves adjacent on both sides merged): the
    fewest descriptors a transport could post for them."""
    if not len(moves):
        return 0
    m = moves[np.lexsort((moves[:, 5], moves[:, 4], moves[:, 3], moves[:, 2], moves[:, 1], moves[:, 0]))]
    same = (m[1:, [0, 1, 3, 4]] == m[:-1, [0, 1, 3, 4]]).all(axis=1)
    adj = same & (m[1:, 2] == m[:-1, 2] + m[:-1, 6]) & (m[1:, 5] == m[:-1, 5] + m[:-1, 6])
    return int(len(m) - adj.sum())


def check_writes(plan: RequestPlan, pairing: Pairing, dst_ids: BlockIds) -> None:
    """Refuse a plan that would write outside the destination request's own blocks (invariant I1).

    ``dst_ids`` are the logical ids of the side that is written (the local ids in pull, the remote ids
    in push). Run it before posting: a peer's card is untrusted input, and NIXL only checks that a
    descriptor lies inside *some* registered region, not inside this request's blocks.
    """
    dst_geom = pairing.local if plan.mode == "pull" else pairing.remotes[pairing.targets[0]]
    kinds = dst_geom.group_is_ssm
    ids = as_group_ids(dst_ids, kinds, "dst_ids")
    kernel = logical_to_kernel(ids, dst_geom.ppl, kinds)
    ppl = dst_geom.ppl
    # attention ids are kernel ids already; an SSM slot's page spans ppl kernel blocks
    ok_blocks = np.unique(
        np.concatenate(
            [np.zeros(0, np.int64)]
            + [k if not ssm else (k[:, None] * ppl + np.arange(ppl)).ravel() for k, ssm in zip(kernel, kinds)]
        )
    )
    moves = plan.moves(pairing)
    if not len(moves):
        return
    strides = np.asarray([r.block_stride for r in dst_geom.regions], dtype=np.int64)
    region, off, length = moves[:, 4], moves[:, 5], moves[:, 6]
    if np.any((region < 0) | (region >= strides.size)):
        raise PlanError(
            "destination region",
            "a move targets a region the destination does not have",
            value=int(region.max()),
            expected=strides.size,
        )
    first = off // strides[region]
    last = (off + np.maximum(length, 1) - 1) // strides[region]
    bad = ~np.isin(first, ok_blocks) | ~np.isin(last, ok_blocks) | (last - first >= ppl) | (off < 0)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise PlanError(
            "destination",
            f"move {i} writes region {int(region[i])} bytes [{int(off[i])}, "
            f"{int(off[i] + length[i])}) outside the request's blocks {sorted(ok_blocks.tolist())[:8]}",
            value=(int(region[i]), int(off[i]), int(length[i])),
        )
