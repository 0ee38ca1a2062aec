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

from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, Protocol

import numpy as np

from kvgeom.blocks import (
    BlockIds,
    get_mapped_blocks,
    kernel_of,
)
from kvgeom.errors import PlanError
from kvgeom.plan.bind import (
    RankTables,
    check_ids,
    exact_pairs,
    filled_pages_of,
    fine_of,
    intake,
    lowered_vllm_pairs,
    plan_of,
    rank_tables,
    require_num_tokens,
    select_groups,
    sent_groups,
    vllm_pairs,
    zero_pages_of,
)
from kvgeom.plan.dcpbind import dcp_pairs, dcp_zero_rows, vllm_pull_covers
from kvgeom.plan.descids import apply_segments
from kvgeom.plan.pairing import Pairing
from kvgeom.plan.planmemo import memo_of
from kvgeom.plan.receive import post_receive, regroups, zero_rows
from kvgeom.plan.recipe import Recipe, trace
from kvgeom.plan.regionbind import BY_REGION, bound_by_region
from kvgeom.plan.requestplan import Regroup, RequestPlan, Transfer

__all__ = ["plan_request"]


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
    empty = (type(local_ids) is list or isinstance(local_ids, (Sequence, np.ndarray))) and len(local_ids) == 0
    lids = intake([[] for _ in kinds] if empty else local_ids, kinds, "local_ids")
    remote = pairing.remotes[pairing.targets[0]]
    rids = intake(remote_ids, remote.group_is_ssm, "remote_ids")
    check_ids(lids, local, "local")
    check_ids(rids, remote, "remote")
    require_num_tokens(local, lids, num_tokens, "local_ids")
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


class _Binding:
    """One request's blocks on the pairing's token axis, computed once for every transfer rank: the kernel
    ids of both sides, the pairs by token position where the policy pairs by tokens (or to cross-check
    vLLM's count pairing), and vLLM's count pairing, computed on first use. A region-mapped pull is bound
    on its pairing by region (``PairPlan.by_region``: every region a group, each side's lists one per
    region), with vLLM's rule for regions (:data:`~kvgeom.plan.regionbind.BY_REGION`) at the boundary."""

    __slots__ = (
        "pairing", "lids", "rids", "num_tokens", "prefill_tokens", "lk", "rk", "rview", "lfine", "exact",
        "aligned", "dcp", "vllm", "names", "grouped", "_counted",
    )  # fmt: skip

    def __init__(
        self,
        pairing: Pairing,
        lids: list[np.ndarray],
        rids: list[np.ndarray],
        num_tokens: int | None,
        prefill_tokens: int | None,
    ) -> None:
        self.grouped = (pairing, lids, rids)  # the request as named: by the pairing's groups
        self.vllm: _Rule = _BY_GROUP
        self.names: tuple[int, ...] | None = None  # the group an error names, per group bound on
        if plan_of(pairing).by_region is not None:
            pairing, lids, rids, self.names = bound_by_region(pairing, lids, rids)
            self.vllm = BY_REGION
        local, kinds = pairing.local, pairing.local.group_is_ssm
        self.pairing, self.lids, self.rids = pairing, lids, rids
        self.num_tokens, self.prefill_tokens = num_tokens, prefill_tokens
        self.rview = pairing.remote_view(pairing.targets[0])
        self.lk = kernel_of(lids, local.ppl, kinds)
        self.rk = kernel_of(rids, self.rview.ppl, kinds)
        self.dcp = pairing.dcp_active
        self.lfine = self.lk if self.dcp else fine_of(self.lk, pairing.bsr, kinds, lids, local.ppl)
        self.exact: Any = None  # the token axis's pairs (vLLM mode: what vLLM's rule is checked against)
        self._counted: tuple[list[np.ndarray], list[np.ndarray]] | None = None
        if pairing.policy.by_tokens:
            self.exact = (
                None
                if self.dcp
                else exact_pairs(
                    pairing, lids, rids, self.lk, self.rk, num_tokens, prefill_tokens, self.lfine
                )
            )
        else:
            self.exact = self.vllm.bind(self)
        self.aligned = self.exact if pairing.policy.by_tokens else None

    def counted(self) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """vLLM mode's pairs of every group sent, once (:meth:`_VllmRule.pairs`)."""
        if self._counted is None:
            self._counted = self.vllm.pairs(self)
        return self._counted

    def dcp_pairs(self, rank: int, rt: RankTables) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """The DCP pairs of transfer rank ``rank`` (:func:`~kvgeom.plan.dcpbind.dcp_pairs`), groups it carries."""
        keep, every = rt.keep, rt.every
        return dcp_pairs(
            self.pairing,
            rank,
            select_groups(self.lids, keep, every),
            select_groups(self.rids, keep, every),
            self.num_tokens,
            self.prefill_tokens,
            self.names,
        )

    def blocks_for(self, rank: int, rt: RankTables) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """The local and remote blocks paired for transfer rank ``rank``, per group it carries."""
        keep, every = rt.keep, rt.every
        if self.dcp:
            if not self.pairing.policy.by_tokens:
                return self.vllm.dcp_pairs(self, rank, rt)
            return self.dcp_pairs(rank, rt)
        if self.aligned is not None:
            la, ra = self.aligned[0], self.aligned[1]
        else:
            la, ra = self.counted()
            if not la:
                return [], []
        return select_groups(la, keep, every), select_groups(ra, keep, every)


class _Rule(Protocol):
    """vLLM's rule at the boundary of vLLM mode (:class:`_VllmRule`, :data:`~kvgeom.plan.regionbind.BY_REGION`)."""

    def bind(self, b: Any) -> Any: ...
    def pairs(self, b: Any) -> tuple[list[np.ndarray], list[np.ndarray]]: ...
    def dcp_pairs(self, b: Any, rank: int, rt: Any) -> tuple[list[np.ndarray], list[np.ndarray]]: ...
    def receive(self, b: Any) -> tuple[tuple[Regroup, ...], np.ndarray]: ...


class _VllmRule:
    """vLLM 0.33.0's rule where it pairs by counts, the boundary of vLLM mode (kvgeom mode never reads it):
    :meth:`bind` what the binding computes first (the token axis's pairs it is checked against, or the
    refusals it makes), :meth:`pairs` the pairs without DCP, :meth:`dcp_pairs` those of one remote rank with
    DCP, and :meth:`receive` the receive step (regroups, zero rows). This class is the rule of block lists
    paired group by group; :data:`~kvgeom.plan.regionbind.BY_REGION` pairs them region by region."""

    def bind(
        self, b: _Binding
    ) -> tuple[list[np.ndarray], list[np.ndarray], list[tuple[int, int, int]]] | None:
        pairing = b.pairing
        if b.dcp:
            if pairing.mode == "pull":
                vllm_pull_covers(pairing, b.lids, b.rids, b.num_tokens, b.prefill_tokens)
            return None
        return exact_pairs(pairing, b.lids, b.rids, b.lk, b.rk, b.num_tokens, b.prefill_tokens, b.lfine)

    def pairs(self, b: _Binding) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """The one plan's pairs by token position (state slots by vLLM's slot rule), lowered where vLLM's
        count-based pairing pairs the same blocks. vLLM's rule is the boundary check
        (:func:`~kvgeom.plan.bind.lowered_vllm_pairs`): a group it pairs otherwise is refused, a group it
        leaves empty moves nothing, as in vLLM."""
        pairing = b.pairing
        keep = sent_groups(pairing)
        every = all(keep)
        counted = vllm_pairs(
            pairing,
            select_groups(b.lk, keep, every),
            select_groups(b.rk, keep, every),
            b.rview,
            select_groups(b.lfine, keep, every),
        )
        if b.exact is not None and counted[0]:
            counted = lowered_vllm_pairs(
                counted,
                select_groups(b.exact[0], keep, every),
                select_groups(b.exact[1], keep, every),
                pairing.local.group_is_ssm,
            )
        return counted

    def dcp_pairs(self, b: _Binding, rank: int, rt: RankTables) -> tuple[list[np.ndarray], list[np.ndarray]]:
        return b.dcp_pairs(rank, rt)  # by group, vLLM's DCP pairing is :func:`dcp_pairs`' own policy branch

    def receive(self, b: _Binding) -> tuple[tuple[Regroup, ...], np.ndarray]:
        pairing = b.pairing
        return post_receive(
            pairing.local,
            b.rview,
            b.lk,
            b.rk,
            pairing.bsr,
            pairing.policy,
            pages=partial(zero_pages_of, pairing),
            permute=pairing.permute,
        )


_BY_GROUP = _VllmRule()


def _lowered(
    pairing: Pairing, rank: int, rt: RankTables, lg: list[np.ndarray], rg: list[np.ndarray], notif: str
) -> Transfer | None:
    """The paired blocks of transfer rank ``rank`` lowered to both sides' descriptor ids (``None``: no block
    travels), every id checked inside its table unless the pairing proved it."""
    if not lg or not any(x.size for x in lg):
        return None
    kinds = pairing.local.group_is_ssm
    for g, (a, b) in enumerate(zip(lg, rg)):
        if a.size != b.size:
            raise PlanError(
                f"block_ids[{g}]",
                f"{a.size} local and {b.size} remote blocks cannot be paired",
                local=int(a.size),
                remote=int(b.size),
            )
    rows = pairing.token_rows  # 1 unless kvgeom mode cuts token-major pages per token
    if rows > 1:  # every attention unit becomes its token rows
        lg = [x if ssm else get_mapped_blocks(x, rows) for x, ssm in zip(lg, kinds)]
        rg = [x if ssm else get_mapped_blocks(x, rows) for x, ssm in zip(rg, kinds)]
    r_desc = apply_segments(rt.remote, rg, checked=True)
    l_desc = apply_segments(rt.local, lg, checked=True)
    if r_desc.size != l_desc.size:
        raise PlanError(
            "descriptor ids",
            f"{l_desc.size} local ids vs {r_desc.size} remote ids",
            local=int(l_desc.size),
            remote=int(r_desc.size),
        )
    if pairing.dcp_active or not rt.bounded:  # else every id a checked request brings lies inside both
        for side, ids, n in (("local", l_desc, rt.local_rows), ("remote", r_desc, rt.remote_rows)):
            if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= n):
                raise PlanError(
                    f"{side} descriptor ids",
                    f"id outside the {n}-row table",
                    value=int(ids.max()),
                    expected=n,
                )
    return Transfer(rank, rt.key, l_desc, r_desc, notif)


def _consumer_step(b: _Binding) -> tuple[tuple[Regroup, ...], np.ndarray]:
    """What the consumer does after the bytes land: regroups, and the rows it zeroes (nothing wrote them)."""
    pairing = b.pairing
    local = pairing.local
    if b.dcp and pairing.policy.by_tokens:
        zero = dcp_zero_rows(
            local,
            pairing.remotes[pairing.targets[0]],
            b.lids,
            b.rids,
            b.num_tokens,
            b.prefill_tokens,
            pairing.prefix_caching,
            b.names,
        )
        return (), zero
    if b.aligned is not None:
        filled = partial(filled_pages_of, pairing)
        regroup = regroups(local, b.lk, pairing.bsr, filled, pairing.permute)
        return regroup, zero_rows(local, b.lk, pairing.bsr, b.aligned[2], filled)
    return b.vllm.receive(b)


def _plan(
    pairing: Pairing,
    lids: list[np.ndarray],
    rids: list[np.ndarray],
    request_id: str,
    remote_request_id: str | None,
    num_tokens: int | None,
    prefill_tokens: int | None,
) -> RequestPlan:
    """The general planner, on checked ids: the request bound on the token axis, its blocks paired and
    lowered per transfer rank, then the consumer's step."""
    local, mode = pairing.local, pairing.mode
    tag = remote_request_id if remote_request_id is not None else request_id
    # pull: P frees after the D ranks reading it have read (D_TP/P_TP, or DCP's count); push: D ends after P_TP
    expected = pairing.mapping.local_consumers
    notif = f"{tag}:{expected}" if mode == "pull" else f"{tag}:{local.tp_size}"
    # a request with no local block binds nothing, except in a region-mapped pull (its lists are placed on
    # the token axis and checked whatever D holds)
    binds = any(x.size for x in lids) or plan_of(pairing).by_region is not None
    bound = _Binding(pairing, lids, rids, num_tokens, prefill_tokens) if binds else None
    transfers = []
    for rank in pairing.transfer_ranks if bound is not None else ():
        rt = rank_tables(bound.pairing, rank)  # type: ignore[union-attr]
        lg, rg = bound.blocks_for(rank, rt)  # type: ignore[union-attr]
        t = _lowered(bound.pairing, rank, rt, lg, rg, notif)  # type: ignore[union-attr]
        if t is not None:
            transfers.append(t)
    sent = {t.remote_rank for t in transfers}
    regroup: tuple[Regroup, ...] = ()
    zero = np.zeros((0, 3), dtype=np.int64)
    if mode == "pull" and bound is not None:
        regroup, zero = _consumer_step(bound)
    return RequestPlan(
        request_id,
        mode,
        tuple(transfers),
        tuple(r for r in pairing.targets if r not in sent),
        expected,
        local.tp_rank if mode == "pull" else -1,
        regroup,
        zero,
    )
