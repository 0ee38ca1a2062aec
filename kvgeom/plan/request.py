"""Per-request transfer plans (pull and push) and the consumer's post-receive step.

``plan_request(pairing, local_ids, remote_ids, num_tokens=...)`` returns a :class:`RequestPlan`: a plain value naming,
for every remote rank, the local table to use (whole, or this source's split), the local and remote
descriptor ids, and the notification; the ranks that only get a notification; how many notifications
the other side should expect; and what the consumer does after the bytes land (``regroup`` for
head-major pages received as finer remote blocks, then ``zero`` ranges for bytes nothing wrote).

Block ids are logical and per KV-cache group; the plan follows vLLM 0.33.0's NIXL connector
(docs/vllm-behaviour.md B.3.7, B.3.8, B.3.9, B.6.10-B.6.12), so in ``compat="vllm"`` pairings the descriptor ids are vLLM's.
``RequestPlan.moves`` resolves a plan into byte moves for the oracle and for humans.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from kvgeom.blocks import (
    BlockIds,
    _expand,
    apply_prefix_caching,
    as_group_ids,
    check_distinct,
    get_mapped_blocks,
    kernel_of,
    logical_to_kernel,
    map_block_ids_for_block_size_ratio,
    map_checked,
    prefix_checked,
)
from kvgeom.errors import BlockIdError, PlanError, TokenCountError, UnsupportedError
from kvgeom.layout.engine import KVLayout
from kvgeom.layout.geometry import Group, RankGeometry
from kvgeom.layout.view import EngineView
from kvgeom.model.spec import AttentionSpec
from kvgeom.pair.dcp import apply_dcp_prefix_caching, dcp_units
from kvgeom.pair.handshake import check_permute
from kvgeom.pair.streams import region_group_ids
from kvgeom.pair.tp import compute_tp_mapping, dcp_handshake_targets
from kvgeom.plan.align import Page, consumer_zero_rows, group_pages, list_starts, overlap, page_heads
from kvgeom.plan.descids import Segments, apply_segments, desc_segments
from kvgeom.plan.pairing import LocalKey, Pairing
from kvgeom.plan.planmemo import memo_of
from kvgeom.plan.recipe import Recipe, trace
from kvgeom.plan.regionmap import (
    apply_prefix_caching_by_region,
    block_ids_by_region,
    region_zero_ids,
    region_zero_rows,
)

__all__ = [
    "Transfer",
    "Regroup",
    "RequestPlan",
    "plan_request",
    "post_receive",
    "receive_step",
    "check_writes",
    "contiguous_runs",
    "MOVE_COLUMNS",
]

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


def _select(ids: list[np.ndarray], groups: Sequence[bool]) -> list[np.ndarray]:
    return [g if keep else g[:0] for g, keep in zip(ids, groups)]


def _intake(block_ids: BlockIds, kinds: Sequence[bool], field: str) -> list[np.ndarray]:
    """The request's ids per group, without copies when they are already 1-D ``int64`` arrays (the planner
    never writes to them); anything else goes through :func:`~kvgeom.blocks.as_group_ids`. Negative ids are
    refused by :func:`_check_ids`."""
    if (
        isinstance(block_ids, (list, tuple))
        and len(block_ids) == len(kinds)
        and all(isinstance(g, np.ndarray) and g.ndim == 1 and g.dtype == np.int64 for g in block_ids)
    ):
        return list(block_ids)
    return as_group_ids(block_ids, kinds, field)


def _check_ids(ids: list[np.ndarray], geom: RankGeometry, side: str) -> None:
    flat = np.concatenate(ids)  # one array per KV-cache group, and every geometry has a group
    if flat.size:  # the common case in one sort: distinct, inside the pool, not negative
        s = np.sort(flat)
        if s[0] >= 0 and s[-1] < geom.logical_num_blocks and not (s[1:] == s[:-1]).any():
            return
        as_group_ids(ids, [False] * len(ids), f"{side}_ids")  # names a negative id
    check_distinct(ids, f"{side}_ids")
    for g, x in enumerate(ids):
        if x.size and int(x.max()) >= geom.logical_num_blocks:
            raise BlockIdError(
                f"{side}_ids[{g}]",
                f"block id {int(x.max())} is past the {side} pool of "
                f"{geom.logical_num_blocks} logical blocks",
                value=int(x.max()),
                expected=geom.logical_num_blocks,
            )


def plan_request(
    pairing: Pairing,
    local_ids: BlockIds,
    remote_ids: BlockIds,
    request_id: str = "req",
    remote_request_id: str | None = None,
    num_tokens: int | None = None,
    prefill_tokens: int | None = None,
) -> RequestPlan:
    """Plan one request. ``local_ids`` / ``remote_ids``: logical block ids per group on each side (in
    pull, local = D's blocks to fill, remote = P's blocks; in push the reverse). An empty local list
    as a whole means nothing to transfer here (notification only).

    The request's tokens (:mod:`kvgeom.plan.align`): ``num_tokens`` is the number of tokens D holds blocks for
    (the prompt length on D), ``prefill_tokens`` the number P computed and sends (vLLM's
    ``remote_num_tokens``; fewer than ``num_tokens`` in the N-1 flow of Mamba hybrids, where D recomputes
    the last token). Both modes place the lists on the token axis with them: kvgeom mode transfers the
    overlap, vLLM mode pairs by counts as vLLM does and refuses where that would move the wrong tokens.
    ``num_tokens`` is required whenever the local list holds blocks of an attention group (every group but
    SSM states and one-block rings): no block list tells where a prefix hit left D's list, so a plan made
    without it could pair the wrong tokens; omitted, a :class:`~kvgeom.errors.TokenCountError` names it.
    ``prefill_tokens`` may be omitted where the block counts determine it (P's full-attention lists start
    at token 0); otherwise the :class:`~kvgeom.errors.PlanError` names the argument to pass."""
    local = pairing.local
    kinds = local.group_is_ssm
    empty = isinstance(local_ids, (Sequence, np.ndarray)) and len(local_ids) == 0
    lids = _intake([[] for _ in kinds] if empty else local_ids, kinds, "local_ids")
    if pairing.region_mapped:
        return _plan_by_region(
            pairing, lids, remote_ids, request_id, remote_request_id, num_tokens, prefill_tokens
        )
    rids = _intake(remote_ids, kinds, "remote_ids")
    _check_ids(lids, local, "local")
    remote = pairing.remotes[pairing.targets[0]]
    _check_ids(rids, remote, "remote")
    _require_num_tokens(local, lids, num_tokens, "local_ids")
    if pairing.dcp_active:
        return _plan(pairing, lids, rids, request_id, remote_request_id, num_tokens, prefill_tokens)
    # a shape seen twice gets a recipe (kvgeom.plan.recipe): later requests of that shape are one gather
    key = (tuple(x.size for x in lids), tuple(x.size for x in rids), num_tokens, prefill_tokens)
    shapes = memo_of(pairing).shapes
    entry = shapes.get(key)
    if isinstance(entry, _Shape):
        shapes.move_to_end(key)
        return entry.plan(np.concatenate([*lids, *rids]), request_id, remote_request_id)
    plan = _plan(pairing, lids, rids, request_id, remote_request_id, num_tokens, prefill_tokens)
    if entry is None:
        shapes[key] = 1
    elif entry == 1:
        shapes[key] = (
            _Shape.trace(pairing, lids, rids, plan, request_id, remote_request_id, num_tokens, prefill_tokens)
            or 0
        )
    while len(shapes) > _SHAPES_KEPT:
        shapes.popitem(last=False)
    return plan


def _require_num_tokens(geom: RankGeometry, ids: list[np.ndarray], num_tokens: int | None, side: str) -> None:
    """Refuse a plan of ``geom``'s ``ids`` without ``num_tokens`` when they hold attention blocks to place
    on the token axis (a :class:`~kvgeom.errors.TokenCountError`)."""
    if num_tokens is not None:
        return
    for g, (x, one) in enumerate(zip(ids, geom.group_one_block)):
        if x.size and not one:
            raise TokenCountError(
                "num_tokens",
                f"{side}[{g}] holds {x.size} attention block(s), which only the request's num_tokens (the "
                "tokens D holds blocks for) places on the token axis: a prefix hit on D leaves no trace in "
                "the block lists; got None",
                value=None,
                group=g,
                blocks=int(x.size),
            )


_SHAPES_KEPT = 256  # request shapes remembered per pairing (a recipe holds 3 int64 per plan integer)


def _flatten(plan: RequestPlan) -> tuple[np.ndarray, tuple[int, ...]]:
    """A plan's integers as one vector, and the sizes of its parts (transfer ids, regroup blocks, zero)."""
    parts = [x for t in plan.transfers for x in (t.local_ids, t.remote_ids)] + [
        r.blocks for r in plan.regroup
    ]
    parts.append(plan.zero.reshape(-1))
    sizes = tuple(int(x.size) for x in parts)
    return np.concatenate([np.asarray(x, dtype=np.int64) for x in parts]), sizes


@dataclass(frozen=True, eq=False)
class _Shape:
    """The plan of every request of one shape: a recipe for its integers and the plan's other fields."""

    recipe: Recipe
    sizes: tuple[int, ...]
    template: RequestPlan
    suffix: str

    @classmethod
    def trace(
        cls,
        pairing: Pairing,
        lids: list[np.ndarray],
        rids: list[np.ndarray],
        plan: RequestPlan,
        request_id: str,
        remote_request_id: str | None,
        num_tokens: int | None,
        prefill_tokens: int | None,
    ) -> _Shape | None:
        vector, sizes = _flatten(plan)

        def run(lg: list[np.ndarray], rg: list[np.ndarray]) -> np.ndarray:
            out, got = _flatten(
                _plan(pairing, lg, rg, request_id, remote_request_id, num_tokens, prefill_tokens)
            )
            if got != sizes:
                raise ValueError("another plan layout")
            return out

        recipe = trace(
            run,
            [x.size for x in lids],
            [x.size for x in rids],
            pairing.local.logical_num_blocks,
            pairing.remotes[pairing.targets[0]].logical_num_blocks,
        )
        if recipe is None or not np.array_equal(recipe.apply(np.concatenate([*lids, *rids])), vector):
            return None
        tag = remote_request_id if remote_request_id is not None else request_id
        suffix = plan.transfers[0].notif[len(tag) :] if plan.transfers else ""
        return cls(recipe, sizes, plan, suffix)

    def plan(self, ids: np.ndarray, request_id: str, remote_request_id: str | None) -> RequestPlan:
        parts = np.split(self.recipe.apply(ids), np.cumsum(self.sizes)[:-1])
        tag = remote_request_id if remote_request_id is not None else request_id
        t = self.template
        transfers = tuple(
            Transfer(x.remote_rank, x.local_table, parts[2 * i], parts[2 * i + 1], tag + self.suffix)
            for i, x in enumerate(t.transfers)
        )
        k = 2 * len(transfers)
        regroup = tuple(
            Regroup(r.regions, parts[k + i], r.bsr, r.heads, r.tokens, r.head_bytes, r.layout)
            for i, r in enumerate(t.regroup)
        )
        return RequestPlan(
            request_id,
            t.mode,
            transfers,
            t.notify_only,
            t.expected_notifications,
            t.consumer_rank,
            regroup,
            parts[-1].reshape(-1, 3),
        )


def _plan(
    pairing: Pairing,
    lids: list[np.ndarray],
    rids: list[np.ndarray],
    request_id: str,
    remote_request_id: str | None,
    num_tokens: int | None,
    prefill_tokens: int | None,
) -> RequestPlan:
    """The general planner, on checked ids."""
    local, mode = pairing.local, pairing.mode
    kinds = local.group_is_ssm
    any_local = any(x.size for x in lids)
    rview = pairing.remote_view(pairing.targets[0])
    lk = kernel_of(lids, local.ppl, kinds)
    rk = kernel_of(rids, rview.ppl, kinds)
    tag = remote_request_id if remote_request_id is not None else request_id
    bsr = pairing.bsr
    # pull: P frees after the D ranks reading it have read (D_TP/P_TP, or DCP's count); push: D ends after P_TP
    expected = pairing.mapping.local_consumers
    notif = f"{tag}:{expected}" if mode == "pull" else f"{tag}:{local.tp_size}"
    dcp = pairing.dcp_active
    exact = (
        _aligned(pairing, lids, rids, lk, rk, num_tokens, prefill_tokens) if any_local and not dcp else None
    )
    aligned = exact if pairing.compat == "kvgeom" else None
    transfers = []
    if dcp and any_local and pairing.compat == "vllm" and mode == "pull":
        _vllm_pull_covers(pairing, lids, rids, num_tokens, prefill_tokens)
    for rank in pairing.transfer_ranks if any_local else ():
        keep = pairing.group_mask(rank)
        if dcp:
            lg, rg = _dcp_pairs(
                pairing, rank, _select(lids, keep), _select(rids, keep), num_tokens, prefill_tokens
            )
        elif aligned is not None:
            lg, rg = _select(aligned[0], keep), _select(aligned[1], keep)
        else:
            lg, rg = _vllm_pair(pairing, _select(lk, keep), _select(rk, keep), rview)
            if exact is not None:
                _same_tokens(lg, rg, _select(exact[0], keep), _select(exact[1], keep), kinds)
        if not lg or not any(x.size for x in lg):
            continue
        for g, (a, b) in enumerate(zip(lg, rg)):
            if a.size != b.size:
                raise PlanError(
                    f"block_ids[{g}]",
                    f"{a.size} local and {b.size} remote blocks cannot be paired",
                    local=int(a.size),
                    remote=int(b.size),
                )
        rows = pairing.token_rows  # 1 unless kvgeom mode cuts token-major pages per token
        if rows > 1:  # token-major pages cut per token: every attention unit becomes its token rows
            lg = [x if ssm else get_mapped_blocks(x, rows) for x, ssm in zip(lg, kinds)]
            rg = [x if ssm else get_mapped_blocks(x, rows) for x, ssm in zip(rg, kinds)]
        r_desc = apply_segments(_segments(pairing, "remote", rank), rg, checked=True)
        l_desc = apply_segments(_segments(pairing, "local", rank), lg, checked=True)
        if r_desc.size != l_desc.size:
            raise PlanError(
                "descriptor ids",
                f"{l_desc.size} local ids vs {r_desc.size} remote ids",
                local=int(l_desc.size),
                remote=int(r_desc.size),
            )
        key = pairing.local_key(rank)
        for side, ids, n in (
            ("local", l_desc, len(pairing.local_table(key))),
            ("remote", r_desc, len(pairing.remote_table(rank))),
        ):
            if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= n):
                raise PlanError(
                    f"{side} descriptor ids",
                    f"id outside the {n}-row table",
                    value=int(ids.max()),
                    expected=n,
                )
        transfers.append(Transfer(rank, key, l_desc, r_desc, notif))
    sent = {t.remote_rank for t in transfers}
    notify_only = tuple(r for r in pairing.targets if r not in sent)
    regroup: tuple[Regroup, ...] = ()
    zero = np.zeros((0, 3), dtype=np.int64)
    if mode == "pull" and any_local:
        if dcp and pairing.compat == "kvgeom":
            zero = _dcp_zero_rows(
                local,
                pairing.remotes[pairing.targets[0]],
                lids,
                rids,
                num_tokens,
                prefill_tokens,
                pairing.prefix_caching,
            )
        elif aligned is not None:
            regroup = _regroups(local, lk, bsr, pairing.zero_pages, pairing.permute)
            zero = _zero_rows(local, lk, bsr, aligned[2], pairing.zero_pages)
        else:
            regroup, zero = post_receive(
                local,
                rview,
                lk,
                rk,
                bsr,
                pairing.compat,
                pages=lambda g: _pages(pairing, g),
                permute=pairing.permute,
            )
    return RequestPlan(
        request_id,
        mode,
        tuple(transfers),
        notify_only,
        expected,
        local.tp_rank if mode == "pull" else -1,
        regroup,
        zero,
    )


def _plan_by_region(
    pairing: Pairing,
    lids: list[np.ndarray],
    remote_ids: BlockIds,
    request_id: str,
    remote_request_id: str | None,
    num_tokens: int | None,
    prefill_tokens: int | None,
) -> RequestPlan:
    """A pull between sides that group the same regions differently (:mod:`kvgeom.plan.regionmap`): each side's
    kernel ids expanded to one list per region, paired region by region (vLLM mode: vLLM's page-position or
    end-trim pairing, refused where it would pair other tokens than the token axis does; kvgeom mode: by
    tokens), descriptor ids with every region its own list, and D's pages nothing filled zeroed per region."""
    local, rank0 = pairing.local, pairing.targets[0]
    remote = pairing.remotes[rank0]
    rids = as_group_ids(remote_ids, remote.group_is_ssm, "remote_ids")
    _check_ids(lids, local, "local")
    _check_ids(rids, remote, "remote")
    _require_num_tokens(local, lids, num_tokens, "local_ids")
    lgid, rgid = region_group_ids(local), region_group_ids(remote)
    l_by = block_ids_by_region(logical_to_kernel(lids, local.ppl, local.group_is_ssm), lgid)
    r_by = block_ids_by_region(logical_to_kernel(rids, remote.ppl, remote.group_is_ssm), rgid)
    if pairing.dcp_active:
        by_rank, pages = _region_dcp_pairs(pairing, lids, rids, l_by, r_by, num_tokens, prefill_tokens)
        lens, strides = [x.block_len for x in local.regions], [x.block_stride for x in local.regions]
        return _region_plan(
            pairing, by_rank, region_zero_rows(pages, lens, strides), request_id, remote_request_id
        )
    kb = local.block_size  # equal kernel blocks on both sides (handshake)
    spans: list[tuple[int, int, int] | None] = []
    starts: list[int] = []
    for r, (lg, rg) in enumerate(zip(lgid, rgid)):
        if lg < 0 or rg < 0:  # vLLM mode only (kvgeom mode refuses shared regions at handshake)
            spans.append(None)
            starts.append(0)
            continue
        c0, p0 = list_starts(
            lids[lg].size,
            local.logical_block_size,
            rids[rg].size,
            remote.logical_block_size,
            num_tokens,
            pairing.prefix_caching,
            _sliding(local.groups[lg]),
            r,
            prefill_tokens,
        )
        spans.append(overlap(c0 // kb, l_by[r].size, p0 // kb, r_by[r].size))
        starts.append(c0)
    # a region without a span (vllm mode's shared regions) pairs nothing of its own and is zeroed whole
    full = [s if s is not None else (0, 0, 0) for s in spans]
    if pairing.compat == "kvgeom":
        la = [x[c : c + n] for x, (c, _, n) in zip(l_by, full)]
        ra = [x[p : p + n] for x, (_, p, n) in zip(r_by, full)]
    else:
        computed, total = None, None
        tokens = prefill_tokens  # vLLM's remote_num_tokens: without it vLLM end-trims each region
        if tokens is not None and min(lgid) >= 0 and min(rgid) >= 0:
            counts = [_cached_blocks(pairing, x.size, num_tokens, g) for g, x in enumerate(lids)]
            computed = [counts[g] * local.ppl for g in lgid]
            total = math.ceil(tokens / remote.block_size)
        elif any(x.size for x in l_by) and remote.ppl != local.ppl:
            raise UnsupportedError(
                "prefill_tokens",
                "vLLM 0.33.0 pairs differently grouped regions of different "
                "logical block sizes only by page position, from the request's token counts",
                local=local.ppl,
                remote=remote.ppl,
            )
        la, ra = apply_prefix_caching_by_region(l_by, r_by, computed, total, remote_rank=rank0)
        computed_tokens = prefill_tokens if prefill_tokens is not None else num_tokens
        for r, span in enumerate(spans):
            if span is None:
                continue
            c, p, n = (
                span  # vLLM's pairs must be the token axis's, and leave no page holding a computed token
            )
            exact, got = _pairs(l_by[r][c : c + n], r_by[r][p : p + n]), _pairs(la[r], ra[r])
            positions = np.arange(c, c + n)
            left = ~np.isin(l_by[r][positions], la[r])
            if computed_tokens is not None:
                left &= starts[r] + positions * kb < computed_tokens
            if not np.isin(got, exact).all() or left.any():
                raise UnsupportedError(
                    f"regions[{r}]",
                    "vLLM 0.33.0 would pair other pages of this region than the "
                    "token axis does, or leave pages P computed unread; kvgeom mode plans it",
                    local=la[r].tolist()[:8],
                    remote=ra[r].tolist()[:8],
                )
    by_rank = {rank: (la, ra) for rank in pairing.transfer_ranks} if any(x.size for x in la) else {}
    zero = [np.zeros((0, 3), dtype=np.int64)]
    for r, region in enumerate(local.regions):
        if pairing.compat == "vllm" or spans[r] is None:
            stale = l_by[r][la[r].size :]
            zero.append(
                np.stack(
                    [
                        np.full(stale.size, r),
                        stale * region.block_stride,
                        np.full(stale.size, region.block_len),
                    ],
                    axis=1,
                )
            )
        else:
            page = Page(r, 0, region.block_len, region.block_stride, page_heads(local, region.members[0][1]))
            zero.append(consumer_zero_rows([page], l_by[r], 1, full[r][0], full[r][2], kb))
    return _region_plan(
        pairing, by_rank, np.concatenate(zero).astype(np.int64), request_id, remote_request_id
    )


def _region_plan(
    pairing: Pairing,
    by_rank: dict[int, tuple[list[np.ndarray], list[np.ndarray]]],
    zero: np.ndarray,
    request_id: str,
    remote_request_id: str | None,
) -> RequestPlan:
    """A region-mapped pull's plan: one transfer per remote rank of ``by_rank`` (its kernel ids per region, on
    each side), descriptor ids with every region its own list; ``zero`` rows of D's pages nothing filled."""
    local = pairing.local
    n = local.num_regions
    tag = remote_request_id if remote_request_id is not None else request_id
    expected = pairing.mapping.local_consumers
    transfers = []
    for rank, (la, ra) in by_rank.items():
        memo = memo_of(pairing).region_segments
        rows = pairing.token_rows  # kvgeom mode cuts token-major pages per token when heads differ
        if rank not in memo:
            flat = [False] * n
            lv, rv = pairing.local_view, pairing.remote_view(rank)
            memo[rank] = tuple(
                desc_segments(
                    n,
                    v.num_blocks,
                    n,
                    rows if rows > 1 else None,
                    v.ppl,
                    flat,
                    region_group_ids=list(range(n)),
                    uses_region_group_mapping=n > 1,
                )
                for v in (lv, rv)
            )
        lseg, rseg = memo[rank]
        lx = [get_mapped_blocks(x, rows) for x in la] if rows > 1 else la
        rx = [get_mapped_blocks(x, rows) for x in ra] if rows > 1 else ra
        transfers.append(
            Transfer(
                rank,
                pairing.local_key(rank),
                apply_segments(lseg, lx),
                apply_segments(rseg, rx),
                f"{tag}:{expected}",
            )
        )
    sent = {t.remote_rank for t in transfers}
    return RequestPlan(
        request_id,
        "pull",
        tuple(transfers),
        tuple(r for r in pairing.targets if r not in sent),
        expected,
        local.tp_rank,
        (),
        zero,
    )


def _region_dcp_pairs(
    pairing: Pairing,
    lids: list[np.ndarray],
    rids: list[np.ndarray],
    l_by: list[np.ndarray],
    r_by: list[np.ndarray],
    num_tokens: int | None,
    prefill_tokens: int | None,
) -> tuple[dict[int, tuple[list[np.ndarray], list[np.ndarray]]], list[np.ndarray]]:
    """A region-mapped pull with decode context parallelism: per remote rank with pages to read, each region's D
    and P kernel ids, and D's pages to zero per region (pure MLA, equal kernel blocks, every region one group's
    pages on each side in kvgeom mode). kvgeom mode places each region's pages on the token axis by global page
    position (:func:`kvgeom.pair.dcp.dcp_units`): every remote rank sends the pages P computed that it holds, and D's
    pages holding no computed token are zeroed. vLLM mode pairs as vLLM 0.33.0 does: each region by page
    position per remote rank (:func:`~kvgeom.plan.regionmap.apply_prefix_caching_by_region` from ``prefill_tokens``
    and D's cached pages), then zeroes each region past the pages all ranks matched
    (:func:`~kvgeom.plan.regionmap.region_zero_ids`). With a logical block of one kernel block on both sides (the
    handshake refuses others in vLLM mode) a page position is a token range on both sides, so vLLM's pairs are
    the token axis's (docs/vllm-behaviour.md)."""
    local = pairing.local
    remote = pairing.remotes[pairing.targets[0]]
    lgid, rgid = region_group_ids(local), region_group_ids(remote)
    if not any(x.size for x in l_by):
        return {}, l_by  # every list empty: nothing to read or zero
    by_rank: dict[int, tuple[list[np.ndarray], list[np.ndarray]]] = {}
    if pairing.compat == "kvgeom":
        units = [
            _units(local, remote, lids[lg], rids[rg], num_tokens, prefill_tokens, pairing.prefix_caching, lg)
            for lg, rg in zip(lgid, rgid)
        ]
        for rank in pairing.transfer_ranks:
            mine = [u["ok"] & (u["p_rank"] == pairing.remotes[rank].dcp_rank) for u in units]
            la = [u["c_fine"][m] for u, m in zip(units, mine)]
            if any(x.size for x in la):
                by_rank[rank] = (la, [u["p_fine"][m] for u, m in zip(units, mine)])
        return by_rank, [u["c_fine"][~u["ok"]] for u in units]
    if prefill_tokens is None:
        raise PlanError(
            "prefill_tokens",
            "vLLM 0.33.0 pairs differently grouped regions with decode context parallelism by page position "
            "from the tokens P computed: pass prefill_tokens",
            value=None,
        )
    first = [
        _first_position(local, x.size, num_tokens, pairing.prefix_caching, g) for g, x in enumerate(lids)
    ]
    total = math.ceil(prefill_tokens / remote.block_size)
    matched = []
    for rank in pairing.transfer_ranks:
        la, ra = apply_prefix_caching_by_region(
            l_by, r_by, [first[g] for g in lgid], total, rank, local.dcp_size, local.dcp_rank, remote.dcp_size
        )
        matched.append(la)
        if any(x.size for x in la):
            by_rank[rank] = (la, ra)
    return by_rank, region_zero_ids(l_by, matched)


def _cached_blocks(pairing: Pairing, count: int, num_tokens: int | None, group: int) -> int:
    """D's cached blocks of a group (its list is the uncached tail of ``ceil(num_tokens / block)``)."""
    if num_tokens is None:
        if pairing.prefix_caching:
            raise PlanError(
                "num_tokens",
                f"group {group}: with prefix caching D's list starts after its cached blocks: "
                "pass num_tokens",
                value=None,
            )
        return 0
    cached = math.ceil(num_tokens / pairing.local.logical_block_size) - count
    if cached < 0:
        raise PlanError(
            f"block_ids[{group}]",
            f"D's {count} blocks are more than num_tokens={num_tokens} need",
            value=count,
        )
    return cached


def _pages(pairing: Pairing, group: int) -> list[Page]:
    """Every page of the local rank's layers of ``group`` (prepared by the pairing: a shape, not a request)."""
    return pairing.tables.group_pages[group]


def _segments(pairing: Pairing, side: str, rank: int) -> Segments:
    """The descriptor-id segment table of one side of the transfer to/from ``rank`` (built once per
    pairing: per request only the ids are gathered)."""
    memo = memo_of(pairing).segments
    if (side, rank) not in memo:
        kinds, rows = pairing.local.group_is_ssm, pairing.token_rows
        if side == "remote":
            v = pairing.remote_view(rank)
            ratio = rows if rows > 1 else None
            pieces = v.num_conv_pieces or 3
        else:
            v, g = pairing.local_view, pairing.local
            ratio, pieces = pairing.local_rows, g.ssm.num_pieces if g.ssm else 3
        seg = desc_segments(
            len(kinds),
            v.num_blocks,
            v.num_regions,
            ratio,
            v.ppl,
            kinds,
            v.ssm_region_indices or None,
            pieces,
            region_group_ids=v.group_ids or None,
            transfer_layer_group_ids=v.transfer_groups,
            scratch_groups=pairing.local.scratch_groups,
            scratch_region_indices=v.scratch_region_indices,
            ple_group=pairing.local.ple.group if pairing.local.ple else None,
            group_streams=v.group_streams,
        )
        memo[(side, rank)] = seg
    return memo[(side, rank)]


def _first_position(
    consumer: RankGeometry, n: int, num_tokens: int | None, prefix_caching: bool, group: int
) -> int:
    """The consumer's first list position (its cached scheduler blocks) of an attention group."""
    if num_tokens is not None:
        first = math.ceil(num_tokens / consumer.scheduler_block) - n
        if first < 0:
            raise PlanError(
                f"block_ids[{group}]", f"D's {n} blocks are more than num_tokens={num_tokens} need", value=n
            )
        return first
    if not prefix_caching:
        return 0
    raise PlanError(
        "num_tokens",
        f"group {group}: with prefix caching D's pages start after its cached ones: pass "
        "num_tokens (the tokens D holds blocks for) to place them",
        value=None,
    )


def _units(
    consumer: RankGeometry,
    producer: RankGeometry,
    c_ids: np.ndarray,
    p_ids: np.ndarray,
    num_tokens: int | None,
    prefill_tokens: int | None,
    prefix_caching: bool,
    group: int,
) -> dict[str, np.ndarray]:
    """Every unit of the consumer rank's pages of one attention group and where P holds it
    (:func:`kvgeom.pair.dcp.dcp_units`)."""
    first = _first_position(consumer, c_ids.size, num_tokens, prefix_caching, group)
    tokens = prefill_tokens if prefill_tokens is not None else num_tokens
    limit = tokens if tokens is not None else p_ids.size * producer.scheduler_block
    return dcp_units(
        c_ids,
        first,
        consumer.logical_block_size,
        consumer.block_size,
        consumer.dcp_size,
        consumer.dcp_rank,
        p_ids,
        producer.logical_block_size,
        producer.block_size,
        producer.dcp_size,
        limit,
    )


def _dcp_pairs(
    pairing: Pairing,
    rank: int,
    lids: list[np.ndarray],
    rids: list[np.ndarray],
    num_tokens: int | None,
    prefill_tokens: int | None,
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """With decode context parallelism, what this rank exchanges with remote rank ``rank``, per group: local
    ids at the local table's granularity and remote kernel ids. Attention units pair by global token position
    (:mod:`kvgeom.pair.dcp`); SSM slots pair as without DCP. kvgeom mode takes the units P computed; vLLM mode
    pairs as vLLM does (pages by its closed form in pull, by counts in push) and refuses when that differs."""
    local, remote, pull = pairing.local, pairing.remotes[rank], pairing.mode == "pull"
    consumer, producer = (local, remote) if pull else (remote, local)
    c_all, p_all = (lids, rids) if pull else (rids, lids)
    kinds = local.group_is_ssm
    lk, rk = (
        logical_to_kernel(lids, local.ppl, kinds),
        logical_to_kernel(rids, pairing.remote_view(rank).ppl, kinds),
    )
    exact_l, exact_r, allowed = [], [], []
    for g, ssm in enumerate(kinds):
        if ssm or not c_all[g].size or not p_all[g].size:
            exact_l.append(lk[g][:0])
            exact_r.append(rk[g][:0])
            allowed.append(np.zeros(0, np.int64))
            continue
        u = _units(
            consumer, producer, c_all[g], p_all[g], num_tokens, prefill_tokens, pairing.prefix_caching, g
        )
        rank_of = u["p_rank"] == producer.dcp_rank
        mine = u["ok"] & rank_of
        c_fine, p_fine = u["c_fine"], u["p_fine"]  # ids at the tables' granularity on both sides
        exact_l.append((c_fine if pull else p_fine)[mine])
        exact_r.append((p_fine if pull else c_fine)[mine])
        held = u["held"] & rank_of  # same tokens on both sides, computed by P or not
        allowed.append(_pairs((c_fine if pull else p_fine)[held], (p_fine if pull else c_fine)[held]))
    ssm_l, ssm_r = _select(lk, kinds), _select(rk, kinds)
    if pull:
        ssm_l, ssm_r = apply_prefix_caching(ssm_l, ssm_r, local.ppl, remote.ppl, kinds)
    else:
        ssm_r, ssm_l = apply_prefix_caching(ssm_r, ssm_l, remote.ppl, local.ppl, kinds)
    exact_l = [s if ssm else e for s, e, ssm in zip(ssm_l, exact_l, kinds)]
    exact_r = [s if ssm else e for s, e, ssm in zip(ssm_r, exact_r, kinds)]
    if pairing.compat == "kvgeom":
        return exact_l, exact_r
    if pull:  # vLLM's closed form on logical pages, then its block-size-ratio map
        lg, rg = [], []
        for g, (lo, ro, ssm) in enumerate(zip(lids, rids, kinds)):
            if ssm or not lo.size:
                lg.append(lo)
                rg.append(ro if ssm else ro[:0])
                continue
            first = _first_position(local, lo.size, num_tokens, pairing.prefix_caching, g)
            a, b = apply_dcp_prefix_caching(
                lo, ro, rank, local.dcp_size, local.dcp_rank, remote.dcp_size, first
            )
            lg.append(a)
            rg.append(b)
        lg, rg = (
            logical_to_kernel(lg, local.ppl, kinds),
            logical_to_kernel(rg, pairing.remote_view(rank).ppl, kinds),
        )
        if pairing.bsr > 1:
            lg, rg = map_block_ids_for_block_size_ratio(lg, rg, pairing.bsr, kinds)
            if not lg:
                lg = [x[:0] for x in rg]
    else:
        lg, rg = _vllm_pair(pairing, lk, rk, pairing.remote_view(rank))
        if not lg:
            lg, rg = [x[:0] for x in lk], [x[:0] for x in rk]
    if not pull and c_all and any(x.size for x, ssm in zip(c_all, kinds) if not ssm):
        _vllm_push_covers(pairing, rank, c_all, p_all, num_tokens, prefill_tokens)
    for g, ssm in enumerate(kinds):
        if ssm:
            continue
        if lg[g].size != rg[g].size:  # vLLM's descriptor-count assert would fail in _read_blocks
            raise UnsupportedError(
                f"block_ids[{g}]",
                f"with decode context parallelism vLLM 0.33.0 would pair "
                f"{lg[g].size} local with {rg[g].size} remote blocks of remote rank {rank} and fail; "
                "kvgeom mode pairs them by token",
                local=int(lg[g].size),
                remote=int(rg[g].size),
            )
        got, want = _pairs(lg[g], rg[g]), _pairs(exact_l[g], exact_r[g])
        if not np.isin(got, allowed[g]).all() or not np.isin(want, got).all():
            # other tokens paired, or tokens P computed left unread
            raise UnsupportedError(
                f"block_ids[{g}]",
                "with decode context parallelism vLLM 0.33.0 would pair other "
                f"pages ({_unpairs(np.setdiff1d(got, allowed[g]))[:4]}...) or leave pages P "
                f"computed unread ({_unpairs(np.setdiff1d(want, got))[:4]}...); kvgeom mode pairs "
                "them by token",
                local=_unpairs(got)[:8],
                remote=_unpairs(want)[:8],
            )
    return lg, rg


def _pairs(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Id pairs ``(a[i], b[i])`` as one sortable ``int64`` each (ids are below 2**31), over the shorter of the
    two lists (as ``zip`` pairs them: lists of unequal length pair their common prefix)."""
    n = min(len(a), len(b))
    return (np.asarray(a[:n], dtype=np.int64) << 32) | np.asarray(b[:n], dtype=np.int64)


def _unpairs(x: np.ndarray) -> list[tuple[int, int]]:
    return [(int(v) >> 32, int(v) & 0xFFFFFFFF) for v in np.asarray(x)[:8]]


def _vllm_pull_covers(
    pairing: Pairing,
    d_ids: list[np.ndarray],
    p_ids: list[np.ndarray],
    num_tokens: int | None,
    prefill_tokens: int | None,
) -> None:
    """vLLM's pull reads only from the DCP source ranks of its closed form: refuse when a unit P computed for
    this D rank lives on another P rank (pages of other sizes)."""
    local, remote = pairing.local, pairing.remotes[pairing.targets[0]]
    sources = sorted({r % remote.dcp_size for r in pairing.transfer_ranks})
    for g, (c, p) in enumerate(zip(d_ids, p_ids)):
        if local.groups[g].is_ssm or not c.size or not p.size:
            continue
        u = _units(local, remote, c, p, num_tokens, prefill_tokens, pairing.prefix_caching, g)
        lost = u["ok"] & ~np.isin(u["p_rank"], sources)
        if lost.any():
            raise UnsupportedError(
                f"block_ids[{g}]",
                f"vLLM 0.33.0 reads this D rank only from P ranks {sources}, so "
                f"tokens {u['token'][lost][:4].tolist()}... P computed on other ranks would stay "
                "unread; kvgeom mode reads every rank that holds them",
                local=sources,
                remote=sorted(set(u["p_rank"][lost].tolist())),
            )
        rview = pairing.remote_view(pairing.targets[0])
        if (
            pairing.bsr > 1 or rview.ppl != local.ppl
        ):  # vLLM's receive step zeroes past what P's whole list covers
            covered = min(c.size * local.ppl * pairing.bsr, p.size * rview.ppl)
            zeroed = u["ok"] & (np.arange(u["ok"].size) >= covered)
            if zeroed.any():
                raise UnsupportedError(
                    f"block_ids[{g}]",
                    "with decode context parallelism vLLM 0.33.0's receive step "
                    f"counts P's whole list and zeroes tokens {u['token'][zeroed][:4].tolist()}... "
                    "this rank received; kvgeom mode zeroes only what no rank wrote",
                    local=int(c.size),
                    remote=int(p.size),
                )


def _vllm_push_covers(
    pairing: Pairing,
    rank: int,
    d_ids: list[np.ndarray],
    p_ids: list[np.ndarray],
    num_tokens: int | None,
    prefill_tokens: int | None,
) -> None:
    """vLLM's push writes D rank ``rank`` only from the P ranks whose TP mapping names it: refuse when some
    unit P computed for that D rank lives on another P rank (it would stay unwritten)."""
    local, d = pairing.local, pairing.remotes[rank]
    memo = memo_of(pairing).push_writers
    if rank not in memo:  # shape-only: the P ranks vLLM's mappings send to D rank ``rank``
        writers = set()
        for q in range(local.tp_size):
            m = compute_tp_mapping(
                q,
                local.tp_size,
                d.tp_size,
                local.num_kv_heads,
                local.is_mla,
                local.group_is_ssm,
                local.dcp_size,
                d.dcp_size,
            )
            every = local.is_mla and not local.has_ssm and pairing.tp_ratio < 0
            targets = dcp_handshake_targets(q, local.tp_size, local.dcp_size, d.tp_size, d.dcp_size)
            if rank in (targets if every else m.all_source_ranks):
                writers.add(q % local.dcp_size)
        memo[rank] = writers
    writers = memo[rank]
    for g, (c, p) in enumerate(zip(d_ids, p_ids)):
        if local.groups[g].is_ssm or not c.size or not p.size:
            continue
        u = _units(d, local, c, p, num_tokens, prefill_tokens, pairing.prefix_caching, g)
        lost = u["ok"] & ~np.isin(u["p_rank"], sorted(writers))
        if lost.any():
            raise UnsupportedError(
                f"block_ids[{g}]",
                f"vLLM 0.33.0's push writes D rank {rank} only from P ranks "
                f"{sorted(writers)}, so tokens {u['token'][lost][:4].tolist()}... P computed on other "
                "ranks would stay unwritten; kvgeom mode writes every D rank that needs them",
                local=sorted(writers),
                remote=rank,
            )


def _dcp_zero_rows(
    consumer: RankGeometry,
    producer: RankGeometry,
    lids: list[np.ndarray],
    rids: list[np.ndarray],
    num_tokens: int | None,
    prefill_tokens: int | None,
    prefix_caching: bool,
) -> np.ndarray:
    """kvgeom mode, DCP: zero every unit of the consumer's pages no producer rank holds (tokens P did not
    compute), in every page of the group's layers."""
    rows = [np.zeros((0, 3), dtype=np.int64)]
    for group, c_ids, p_ids in zip(consumer.groups, lids, rids):
        if group.is_ssm or not c_ids.size:
            continue
        u = _units(consumer, producer, c_ids, p_ids, num_tokens, prefill_tokens, prefix_caching, group.index)
        todo = ~u["ok"]
        if not todo.any():
            continue
        kernel, sub, unit = u["c_kernel"][todo], u["c_sub"][todo], int(u["unit"])
        for page in group_pages(consumer, group.index):
            per_head = page.length // page.heads
            tok = per_head // consumer.block_size
            starts = (kernel * page.stride + page.offset + sub * unit * tok)[:, None] + np.arange(page.heads)[
                None, :
            ] * per_head
            rows.append(
                np.stack(
                    [np.full(starts.size, page.region), starts.reshape(-1), np.full(starts.size, unit * tok)],
                    axis=1,
                )
            )
    return np.concatenate(rows).astype(np.int64)


def _vllm_pair(
    pairing: Pairing, lg: list[np.ndarray], rg: list[np.ndarray], rview: EngineView
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """vLLM's pairing of one source's lists: block-size-ratio map, then prefix trimming (B.3.5, B.3.6)."""
    local, kinds, bsr = pairing.local, pairing.local.group_is_ssm, pairing.bsr
    if bsr > 1:
        lg, rg = map_checked(lg, rg, bsr, kinds)
        if not lg or not any(x.size for x in lg):
            return [], []
    if not any(x.size for x in lg):
        return [], []
    if pairing.mode == "pull":
        return prefix_checked(lg, rg, local.ppl, rview.ppl, kinds)
    rg, lg = prefix_checked(rg, lg, rview.ppl, local.ppl, kinds)
    return lg, rg


def _same_tokens(
    lg: list[np.ndarray],
    rg: list[np.ndarray],
    el: list[np.ndarray],
    er: list[np.ndarray],
    kinds: Sequence[bool],
) -> None:
    """vLLM mode never reproduces a silent corruption: its count-based pairing of attention blocks must
    pair the same tokens as kvgeom's token alignment, else the request is refused."""
    for g, ssm in enumerate(kinds):
        if ssm:
            continue
        a = lg[g] if lg else np.zeros(0, np.int64)
        b = rg[g] if rg else np.zeros(0, np.int64)
        if a.size and not (np.array_equal(a, el[g]) and np.array_equal(b, er[g])):
            raise UnsupportedError(
                f"block_ids[{g}]",
                "vLLM 0.33.0 pairs these blocks by count and would move the wrong tokens "
                f"(local {a[:4].tolist()}... <- remote {b[:4].tolist()}..., by token: local {el[g][:4].tolist()}... "
                f"<- remote {er[g][:4].tolist()}...); kvgeom mode plans it",
                local=a.tolist()[:8],
                remote=b.tolist()[:8],
            )


def _sliding(group: Group) -> bool:
    return getattr(group.spec, "sliding_window", None) is not None


def _align_groups(
    consumer: RankGeometry,
    c_logical: list[np.ndarray],
    c_fine: list[np.ndarray],
    producer_block: int,
    p_logical: list[np.ndarray],
    p_fine: list[np.ndarray],
    fine_tokens: int,
    num_tokens: int | None,
    prefix_caching: bool,
    prefill_tokens: int | None = None,
) -> list[tuple[int, int, int]]:
    """Per group, ``(consumer position, producer position, count)`` of the fine units both hold (SSM and
    ring groups: ``(0, 0, 0)``, they are paired by slot)."""
    full = [
        g.index for g in consumer.groups if not g.one_block and not _sliding(g) and p_logical[g.index].size
    ]
    hint = p_logical[full[0]].size * producer_block if full else None  # where P's computed tokens end
    out = []
    for g, group in enumerate(consumer.groups):
        if group.one_block:
            out.append((0, 0, 0))
            continue
        c0, p0 = list_starts(
            c_logical[g].size,
            consumer.logical_block_size,
            p_logical[g].size,
            producer_block,
            num_tokens,
            prefix_caching,
            _sliding(group),
            g,
            prefill_tokens,
            p_end_hint=hint,
        )
        out.append(overlap(c0 // fine_tokens, c_fine[g].size, p0 // fine_tokens, p_fine[g].size))
    return out


def _aligned(
    pairing: Pairing,
    lids: list[np.ndarray],
    rids: list[np.ndarray],
    lk: list[np.ndarray],
    rk: list[np.ndarray],
    num_tokens: int | None,
    prefill_tokens: int | None = None,
) -> tuple[list[np.ndarray], list[np.ndarray], list[tuple[int, int, int]]]:
    """kvgeom mode: the local and remote fine ids of every group, paired by token (attention) or by
    state slot (SSM, vLLM's slot rule), and each attention group's coverage on the consumer."""
    local, kinds, bsr, pull = pairing.local, pairing.local.group_is_ssm, pairing.bsr, pairing.mode == "pull"
    remote = pairing.remotes[pairing.targets[0]]
    rview = pairing.remote_view(pairing.targets[0])
    lfine = [k if ssm else _expand(k, bsr) for k, ssm in zip(lk, kinds)]
    rblock = rview.block_size * rview.ppl  # the remote's logical block in tokens (unchanged by a rescale)
    if pull:
        spans = _align_groups(
            local,
            lids,
            lfine,
            rblock,
            rids,
            rk,
            rview.block_size,
            num_tokens,
            pairing.prefix_caching,
            prefill_tokens,
        )
    else:
        spans = _align_groups(
            remote,
            rids,
            rk,
            local.logical_block_size,
            lids,
            lfine,
            rview.block_size,
            num_tokens,
            pairing.prefix_caching,
            prefill_tokens,
        )
    empty = [x[:0] for x in lk]
    ssm_l, ssm_r = (_select(lk, kinds), _select(rk, kinds))
    if pull:
        ssm_l, ssm_r = prefix_checked(ssm_l, ssm_r, local.ppl, rview.ppl, kinds)
    else:
        ssm_r, ssm_l = prefix_checked(ssm_r, ssm_l, rview.ppl, local.ppl, kinds)
    lsel, rsel = list(empty), list(empty)
    for g, (ssm, (cpos, ppos, n)) in enumerate(zip(kinds, spans)):
        if ssm:
            lsel[g], rsel[g] = ssm_l[g], ssm_r[g]
        elif local.groups[g].one_block:  # a ring: the request's one block, whole
            lsel[g], rsel[g] = lk[g], rk[g]
        elif pull:
            lsel[g], rsel[g] = lfine[g][cpos : cpos + n], rk[g][ppos : ppos + n]
        else:
            lsel[g], rsel[g] = lfine[g][ppos : ppos + n], rk[g][cpos : cpos + n]
    return lsel, rsel, spans


def _regroups(
    consumer: RankGeometry,
    kernel_ids: list[np.ndarray],
    bsr: int,
    pages: Callable[[int], list[Page]] | None = None,
    permute: bool = False,
) -> tuple[Regroup, ...]:
    """Head-major blocks that arrived as ``bsr`` finer remote pages are regrouped per head (B.3.9), in the
    regions of each group's ``pages`` (default: every page of the group's layers) holding several heads.
    With ``permute`` (B.6.15) the token-major pages received as head-major bytes are regrouped into token
    order, at every ``bsr``."""
    out = []
    layout = KVLayout.TOKEN_MAJOR if permute else KVLayout.HEAD_MAJOR
    for group, L in zip(consumer.groups, kernel_ids):
        if group.one_block or not L.size or (bsr == 1 and not permute):
            continue
        where = pages(group.index) if pages is not None else group_pages(consumer, group.index)
        kinds: dict[tuple[str, int, int], list[int]] = {}
        for p in where:
            region = consumer.regions[p.region]
            heads = permuted_heads(consumer, p) if permute else p.heads
            if heads > 1 and p.region not in kinds.get((region.part, heads, p.length), []):
                kinds.setdefault((region.part, heads, p.length), []).append(p.region)
        for (_, heads, length), rs in sorted(kinds.items()):
            out.append(
                Regroup(
                    tuple(rs),
                    L.copy(),
                    bsr,
                    heads,
                    consumer.block_size,
                    length // (heads * consumer.block_size),
                    layout,
                )
            )
    return tuple(out)


def permuted_heads(consumer: RankGeometry, page: Page) -> int:
    """The local KV heads of the attention layer whose page ``page`` is (1 for a latent or a state): the
    heads a token-major page holds per token, which a permute regroups (B.6.15)."""
    region = consumer.regions[page.region]
    for _, name in region.members:
        if region.slot(name)[0] == page.offset:
            spec = consumer.layer_specs[name]
            if isinstance(spec, AttentionSpec):
                return int(spec.heads_per_rank(consumer.tp_size))
    return 1


def _zero_rows(
    consumer: RankGeometry,
    kernel_ids: list[np.ndarray],
    units: int,
    spans: list[tuple[int, int, int]],
    pages: Callable[[int], list[Page]] | None = None,
) -> np.ndarray:
    """Zero every byte of the consumer's attention blocks outside the units the transfer covered, in the
    pages of each group (``pages``; default: every page of the group's layers)."""
    rows = [np.zeros((0, 3), dtype=np.int64)]
    for group, L, (cpos, _, n) in zip(consumer.groups, kernel_ids, spans):
        if group.one_block or not L.size:
            continue
        where = pages(group.index) if pages is not None else group_pages(consumer, group.index)
        rows.append(consumer_zero_rows(where, L, units, cpos, n, consumer.block_size))
    return np.concatenate(rows)


def receive_step(
    consumer: RankGeometry,
    producer: RankGeometry,
    consumer_ids: BlockIds,
    producer_ids: BlockIds,
    num_tokens: int | None = None,
    prefix_caching: bool = False,
    prefill_tokens: int | None = None,
) -> tuple[tuple[Regroup, ...], np.ndarray]:
    """The post-receive step of a D rank that was written to (push): zero ranges of its own blocks,
        from D's and P's logical ids of the request, aligned by token like the writer's plan (``num_tokens``
        and ``prefill_tokens`` as in :func:`plan_request`: ``num_tokens`` is required whenever the consumer's list
    holds attention blocks). vLLM never zeroes in push (B.6.1 item 9); kvgeom
        does, so no D block holds stale bytes. A token-major D with ``permute_local_kv`` written by a head-major
        P (kvgeom mode's push permute, B.6.15) first regroups every attention block of the request into token
        order (each D block arrived as one head-major page); the zero ranges are then token-major."""
    kinds = consumer.group_is_ssm
    permute = (
        consumer.model.attention_spec is not None and consumer.engine.kv_layout != producer.engine.kv_layout
    )
    if permute:  # a pair the writer could plan: refuses any other layout difference, typed
        check_permute(producer, consumer, "push", "kvgeom")
    dl = as_group_ids(consumer_ids, kinds, "consumer_ids")
    pl = as_group_ids(producer_ids, kinds, "producer_ids")
    check_distinct(dl, "consumer_ids")
    _require_num_tokens(consumer, dl, num_tokens, "consumer_ids")
    if consumer.dcp_size > 1 or producer.dcp_size > 1:
        return (), _dcp_zero_rows(consumer, producer, dl, pl, num_tokens, prefill_tokens, prefix_caching)
    dk = logical_to_kernel(dl, consumer.ppl, kinds)
    pk = logical_to_kernel(pl, producer.ppl, kinds)
    if producer.block_size % consumer.block_size:
        raise PlanError(
            "block_size",
            "push needs P kernel blocks that are multiples of D's",
            local=consumer.block_size,
            remote=producer.block_size,
        )
    q = producer.block_size // consumer.block_size
    pfine = [k if ssm else get_mapped_blocks(k, q) for k, ssm in zip(pk, kinds)]
    spans = _align_groups(
        consumer,
        dl,
        dk,
        producer.logical_block_size,
        pl,
        pfine,
        consumer.block_size,
        num_tokens,
        prefix_caching,
        prefill_tokens,
    )
    return _regroups(consumer, dk, 1, permute=permute), _zero_rows(consumer, dk, 1, spans)


def post_receive(
    consumer: RankGeometry,
    producer: EngineView,
    consumer_kernel_ids: list[np.ndarray],
    producer_kernel_ids: list[np.ndarray],
    bsr: int,
    compat: str = "kvgeom",
    pages: Callable[[int], list[Page]] | None = None,
    permute: bool = False,
) -> tuple[tuple[Regroup, ...], np.ndarray]:
    """The consumer's post-receive step (vLLM B.3.9 / B.6.11): regroup head-major blocks that arrived as
    ``bsr`` finer remote pages (``permute``: token-major pages that arrived head-major, B.6.15), then zero
    what the transfer did not write.

    Per attention group ``g`` with kernel ids ``L`` (consumer) and ``R`` (the producer's full list):
    ``covered = min(|L| * bsr, |R|)`` remote-block units; the tokens past ``covered mod bsr`` units of
    block ``L[covered div bsr]`` and all of ``L[ceil(covered / bsr):]`` are zeroed, in the regions that
    hold a layer of group ``g`` (``pages``: the pages of a group, default :func:`~kvgeom.plan.align.group_pages`,
    which a planner caches). vLLM only runs this when ``bsr > 1``, it permutes, or the two ppl differ;
    ``compat="kvgeom"`` always runs it (it zeroes nothing when everything was covered).
    """
    if compat == "vllm" and bsr == 1 and consumer.ppl == producer.ppl and not permute:
        return (), np.zeros((0, 3), dtype=np.int64)
    spans = [(0, 0, min(L.size * bsr, R.size)) for L, R in zip(consumer_kernel_ids, producer_kernel_ids)]
    return (
        _regroups(consumer, consumer_kernel_ids, bsr, pages, permute),
        _zero_rows(consumer, consumer_kernel_ids, bsr, spans, pages),
    )


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
