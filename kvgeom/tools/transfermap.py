"""What a picture of one request's transfer shows: which bytes of which P rank land where on which D rank.

:func:`transfer_map` computes it with numpy only: for every rank of both engines and every region, the
request's blocks as byte segments; the byte moves merged into runs per (source rank, source region,
destination rank, destination region) where both sides are contiguous; and the D ranges the post-receive
step zeroes. Regions whose picture is the same (same segments, runs and zero ranges) form one class, drawn
once. :mod:`kvgeom.tools.draw` renders a :class:`TransferMap`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from kvgeom.layout.allocate import rank_geometry
from kvgeom.layout.engine import KVLayout
from kvgeom.layout.geometry import RankGeometry
from kvgeom.modes import policy_of
from kvgeom.plan.receive import receive_step
from kvgeom.plan.requestplan import Regroup

if TYPE_CHECKING:  # pragma: no cover
    from kvgeom.tools.scenario import RequestIds, Scenario

__all__ = ["TransferMap", "transfer_map", "P_SIDE", "D_SIDE"]

#: the ``side`` column of :attr:`TransferMap.segments`: P's rows, D's rows
P_SIDE, D_SIDE = 0, 1
_P, _D = P_SIDE, D_SIDE


@dataclass(frozen=True, eq=False)
class TransferMap:
    """What a picture of one request shows.

    ``segments`` rows: ``(side, rank, region, offset, length, is_ssm, block)`` (side 0 = P, 1 = D; one
    row per kernel block of an attention group, or per SSM state slot, that the request holds in the
    region). ``runs`` rows: ``(src_rank, src_region, src_offset, dst_rank, dst_region, dst_offset,
    length)``, P to D, merged where both sides continue. ``zero`` rows: ``(d_rank, region, offset,
    length)``. ``classes``: regions with the same picture, each drawn once.
    """

    description: str
    mode: str
    num_tokens: int
    p_tp: int
    d_tp: int
    region_names: tuple[str, ...]
    region_members: tuple[str, ...]
    segments: np.ndarray
    runs: np.ndarray
    zero: np.ndarray
    classes: tuple[tuple[int, ...], ...]
    regrouped: bool

    def to_json(self) -> dict[str, Any]:
        return {
            "description": self.description,
            "mode": self.mode,
            "num_tokens": self.num_tokens,
            "p_tp": self.p_tp,
            "d_tp": self.d_tp,
            "regions": [
                {"index": i, "name": n, "members": m}
                for i, (n, m) in enumerate(zip(self.region_names, self.region_members))
            ],
            "region_classes": [list(c) for c in self.classes],
            "segment_columns": ["side", "rank", "region", "offset", "length", "is_ssm", "block"],
            "segments": self.segments.tolist(),
            "run_columns": [
                "src_rank",
                "src_region",
                "src_offset",
                "dst_rank",
                "dst_region",
                "dst_offset",
                "length",
            ],
            "runs": self.runs.tolist(),
            "zero_columns": ["d_rank", "region", "offset", "length"],
            "zero": self.zero.tolist(),
            "regrouped_after_receive": self.regrouped,
        }


def _segments(geom: RankGeometry, ids: tuple[tuple[int, ...], ...], side: int) -> np.ndarray:
    """The request's logical blocks of one rank as byte segments of its regions: an attention block
    spans its ``ppl`` kernel blocks, an SSM slot its state (a loop over groups and regions; the blocks
    themselves are arrays)."""
    ssm_len = geom.ssm.conv_bytes + geom.ssm.ssm_bytes if geom.ssm else 0
    out = [np.zeros((0, 7), dtype=np.int64)]
    for g, logical in zip(geom.groups, ids):
        blocks = np.asarray(logical, dtype=np.int64)
        for region in geom.regions:
            if region.member_of(g.index) is None or not blocks.size:
                continue
            rows = np.empty((blocks.size, 7), dtype=np.int64)
            rows[:, 0], rows[:, 1], rows[:, 2] = side, geom.tp_rank, region.index
            rows[:, 3] = blocks * region.block_stride * geom.ppl
            rows[:, 4] = ssm_len if g.is_ssm else (geom.ppl - 1) * region.block_stride + region.block_len
            rows[:, 5], rows[:, 6] = int(g.is_ssm), blocks
            out.append(rows)
    seg = np.concatenate(out)
    return seg[np.lexsort((seg[:, 3], seg[:, 2]))]


def _merge_runs(moves: np.ndarray) -> np.ndarray:
    """Moves merged where consecutive rows continue on both sides (same ranks and regions)."""
    if not len(moves):
        return np.zeros((0, 7), dtype=np.int64)
    m = moves[np.lexsort((moves[:, 2], moves[:, 4], moves[:, 3], moves[:, 1], moves[:, 0]))]
    same = (m[1:, [0, 1, 3, 4]] == m[:-1, [0, 1, 3, 4]]).all(axis=1)
    cont = same & (m[1:, 2] == m[:-1, 2] + m[:-1, 6]) & (m[1:, 5] == m[:-1, 5] + m[:-1, 6])
    starts = np.flatnonzero(np.concatenate(([True], ~cont)))
    runs: np.ndarray = m[starts].copy()
    runs[:, 6] = np.add.reduceat(m[:, 6], starts)
    return runs


def _regroup(runs: np.ndarray, step: Regroup, d_rank: int, stride: np.ndarray) -> np.ndarray:
    """``runs`` with the destination bytes of ``step``'s blocks moved to where the consumer's regroup
    puts them: a block received as ``[bsr, heads, n, b]`` is stored as ``[heads, bsr * n, b]`` (token-major
    ``step.layout``: ``[bsr * n, heads, b]``). Runs are cut at the chunks the regroup moves (``n * b``
    bytes; token-major: ``b``) (arrays, no loop over runs)."""
    n = step.tokens // step.bsr
    token_major = step.layout is KVLayout.TOKEN_MAJOR
    chunk = step.head_bytes if token_major else n * step.head_bytes
    hit = (runs[:, 3] == d_rank) & np.isin(runs[:, 4], step.regions)
    block = runs[:, 5] // stride[runs[:, 4]]
    hit &= np.isin(block, step.blocks)
    if not hit.any():
        return runs
    r = runs[hit]
    start = block[hit] * stride[r[:, 4]]
    rel = r[:, 5] - start
    first, last = rel // chunk, (rel + r[:, 6] - 1) // chunk
    counts = last - first + 1
    idx = np.repeat(np.arange(len(r)), counts)
    c = first[idx] + (np.arange(idx.size) - np.repeat(np.cumsum(counts) - counts, counts))
    lo = np.maximum(rel[idx], c * chunk)
    hi = np.minimum(rel[idx] + r[idx, 6], (c + 1) * chunk)
    pieces = r[idx].copy()
    pieces[:, 2] = r[idx, 2] + (lo - rel[idx])
    if token_major:  # chunk c = (s, h, t) of [bsr, heads, n] goes to token s * n + t, head h
        s, h, t = c // (step.heads * n), c // n % step.heads, c % n
        dest = (s * n + t) * step.heads + h
    else:
        dest = (c % step.heads) * step.bsr + c // step.heads
    pieces[:, 5] = start[idx] + dest * chunk + (lo - c * chunk)
    pieces[:, 6] = hi - lo
    return np.concatenate([runs[~hit], pieces])


def transfer_map(sc: Scenario, req: RequestIds) -> TransferMap:
    """The picture of request ``req`` of scenario ``sc`` (raises what planning raises). D bytes are
    shown where they are after the post-receive step (regrouped head-major blocks included)."""
    plans = sc.plans(req)
    moves = [p.moves(sc.pairings[r]) for r, p in plans.items()]
    runs = _merge_runs(np.concatenate(moves) if moves else np.zeros((0, 7), dtype=np.int64))
    p_geoms = [rank_geometry(sc.model, sc.prefill.with_rank(r)) for r in range(sc.prefill.tp_size)]
    d_geoms = [rank_geometry(sc.model, sc.decode.with_rank(r)) for r in range(sc.decode.tp_size)]
    # D's receive steps, (rank, regroups, zero ranges): its plans' in pull; in push kvgeom's receive_step on
    # every D rank (vLLM never zeroes in push, docs/vllm-behaviour.md B.6.1 item 9, nor permutes, B.6.15)
    if sc.mode == "pull":
        received = [(plan.consumer_rank, plan.regroup, plan.zero) for plan in plans.values()]
    elif policy_of(sc.compat).by_tokens:
        received = [
            (d.tp_rank, *receive_step(d, p_geoms[0], req.decode, req.prefill, req.num_tokens))
            for d in d_geoms
        ]
    else:
        received = []
    if any(steps for _, steps, _ in received):
        stride = np.asarray([reg.block_stride for reg in d_geoms[0].regions], dtype=np.int64)
        for rank, steps, _ in received:
            for step in steps:
                runs = _regroup(runs, step, rank, stride)
        runs = _merge_runs(runs)
    segments = np.concatenate(
        [_segments(g, req.prefill, _P) for g in p_geoms] + [_segments(g, req.decode, _D) for g in d_geoms]
    )
    zero_parts = [np.zeros((0, 4), dtype=np.int64)]
    for rank, _, z in received:
        z = np.asarray(z, dtype=np.int64).reshape(-1, 3)
        zero_parts.append(np.column_stack([np.full(len(z), rank, dtype=np.int64), z]))
    zero = np.concatenate(zero_parts)
    zero = zero[np.lexsort((zero[:, 2], zero[:, 1], zero[:, 0]))]
    geom = d_geoms[0]
    names = tuple(r.name for r in geom.regions)
    members = tuple(_members(geom, r.index) for r in geom.regions)
    classes = _classes(len(names), segments, runs, zero, members)
    regrouped = any(steps for _, steps, _ in received)
    return TransferMap(
        sc.describe(),
        sc.mode,
        req.num_tokens,
        sc.prefill.tp_size,
        sc.decode.tp_size,
        names,
        members,
        segments,
        runs,
        zero,
        classes,
        regrouped,
    )


def _members(geom: RankGeometry, region: int) -> str:
    kinds: dict[str, int] = {}
    for g, _ in geom.regions[region].members:
        k = geom.groups[g].kind.value
        kinds[k] = kinds.get(k, 0) + 1
    return " + ".join(k if n == 1 else f"{n} {k}" for k, n in kinds.items())


def _classes(
    n: int, segments: np.ndarray, runs: np.ndarray, zero: np.ndarray, members: tuple[str, ...]
) -> tuple[tuple[int, ...], ...]:
    """Group regions whose segments, runs and zero ranges are equal (one loop over regions)."""
    seen: dict[bytes, list[int]] = {}
    for r in range(n):
        key = b"|".join(
            [
                members[r].encode(),
                segments[segments[:, 2] == r][:, [0, 1, 3, 4, 5]].tobytes(),
                runs[runs[:, 1] == r][:, [0, 2, 3, 5, 6]].tobytes(),
                zero[zero[:, 1] == r][:, [0, 2, 3]].tobytes(),
            ]
        )
        seen.setdefault(key, []).append(r)
    return tuple(tuple(v) for v in seen.values())
