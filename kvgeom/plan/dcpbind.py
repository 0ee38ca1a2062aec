"""Binding a request with decode context parallelism: every unit of the consumer's pages matched with the
producer rank, page and kernel block holding it (:func:`dcp_units_of`, on :func:`kvgeom.pair.dcp.dcp_units`),
the per-rank block pairs, and the consumer's rows nothing wrote.
"""

from __future__ import annotations

import math

import numpy as np

from kvgeom.blocks import (
    apply_prefix_caching,
    logical_to_kernel,
    map_block_ids_for_block_size_ratio,
)
from kvgeom.errors import PlanError, UnsupportedError
from kvgeom.layout.geometry import RankGeometry
from kvgeom.pair.dcp import apply_dcp_prefix_caching, dcp_units
from kvgeom.plan.align import group_pages
from kvgeom.plan.bind import plan_of, select_groups, vllm_pairs
from kvgeom.plan.pairing import Pairing

__all__ = [
    "first_position",
    "dcp_units_of",
    "dcp_pairs",
    "pair_codes",
    "unpair_codes",
    "vllm_pull_covers",
    "vllm_push_covers",
    "dcp_zero_rows",
]


def first_position(
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


def dcp_units_of(
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
    first = first_position(consumer, c_ids.size, num_tokens, prefix_caching, group)
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


def dcp_pairs(
    pairing: Pairing,
    rank: int,
    lids: list[np.ndarray],
    rids: list[np.ndarray],
    num_tokens: int | None,
    prefill_tokens: int | None,
    names: tuple[int, ...] | None = None,
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """With decode context parallelism, what this rank exchanges with remote rank ``rank``, per group: local
    ids at the local table's granularity and remote kernel ids. Attention units pair by global token position
    (:mod:`kvgeom.pair.dcp`); SSM slots pair as without DCP. kvgeom mode takes the units P computed; vLLM mode
    pairs as vLLM does (pages by its closed form in pull, by counts in push) and refuses when that differs.
    ``names``: the group a refusal names, per group (default: its index)."""
    exact_l, exact_r, allowed = _dcp_token_pairs(pairing, rank, lids, rids, num_tokens, prefill_tokens, names)
    if pairing.policy.by_tokens:
        return exact_l, exact_r
    pull, kinds = pairing.mode == "pull", pairing.local.group_is_ssm
    lg, rg = (
        _vllm_dcp_pull_pairs(pairing, rank, lids, rids, num_tokens)
        if pull
        else _vllm_dcp_push_pairs(pairing, rank, lids, rids)
    )
    c_all, p_all = (lids, rids) if pull else (rids, lids)
    if not pull and c_all and any(x.size for x, ssm in zip(c_all, kinds) if not ssm):
        vllm_push_covers(pairing, rank, c_all, p_all, num_tokens, prefill_tokens)
    for g, ssm in enumerate(kinds):
        if not ssm:
            _check_vllm_dcp_group(g, rank, lg[g], rg[g], exact_l[g], exact_r[g], allowed[g])
    return lg, rg


def _dcp_token_pairs(
    pairing: Pairing,
    rank: int,
    lids: list[np.ndarray],
    rids: list[np.ndarray],
    num_tokens: int | None,
    prefill_tokens: int | None,
    names: tuple[int, ...] | None = None,
) -> tuple[list[np.ndarray], list[np.ndarray], list[np.ndarray]]:
    """Per group, the local and remote ids remote rank ``rank`` exchanges by global token position (the units
    P computed; SSM slots as without DCP), and the pair codes of every unit holding the same tokens on both
    sides (computed by P or not: what vLLM's pairing may also pair)."""
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
        name = g if names is None else names[g]
        u = dcp_units_of(
            consumer, producer, c_all[g], p_all[g], num_tokens, prefill_tokens, pairing.prefix_caching, name
        )
        rank_of = u["p_rank"] == producer.dcp_rank
        mine = u["ok"] & rank_of
        c_fine, p_fine = u["c_fine"], u["p_fine"]  # ids at the tables' granularity on both sides
        exact_l.append((c_fine if pull else p_fine)[mine])
        exact_r.append((p_fine if pull else c_fine)[mine])
        held = u["held"] & rank_of  # same tokens on both sides, computed by P or not
        allowed.append(pair_codes((c_fine if pull else p_fine)[held], (p_fine if pull else c_fine)[held]))
    ssm_l, ssm_r = select_groups(lk, kinds), select_groups(rk, kinds)
    if pull:
        ssm_l, ssm_r = apply_prefix_caching(ssm_l, ssm_r, local.ppl, remote.ppl, kinds)
    else:
        ssm_r, ssm_l = apply_prefix_caching(ssm_r, ssm_l, remote.ppl, local.ppl, kinds)
    exact_l = [s if ssm else e for s, e, ssm in zip(ssm_l, exact_l, kinds)]
    exact_r = [s if ssm else e for s, e, ssm in zip(ssm_r, exact_r, kinds)]
    return exact_l, exact_r, allowed


def _vllm_dcp_pull_pairs(
    pairing: Pairing, rank: int, lids: list[np.ndarray], rids: list[np.ndarray], num_tokens: int | None
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """vLLM's DCP pull pairing: its closed form on logical pages, then its block-size-ratio map."""
    local, remote, kinds = pairing.local, pairing.remotes[rank], pairing.local.group_is_ssm
    lg, rg = [], []
    for g, (lo, ro, ssm) in enumerate(zip(lids, rids, kinds)):
        if ssm or not lo.size:
            lg.append(lo)
            rg.append(ro if ssm else ro[:0])
            continue
        first = first_position(local, lo.size, num_tokens, pairing.prefix_caching, g)
        a, b = apply_dcp_prefix_caching(lo, ro, rank, local.dcp_size, local.dcp_rank, remote.dcp_size, first)
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
    return lg, rg


def _vllm_dcp_push_pairs(
    pairing: Pairing, rank: int, lids: list[np.ndarray], rids: list[np.ndarray]
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """vLLM's DCP push pairing: by counts, on kernel ids."""
    kinds = pairing.local.group_is_ssm
    lk = logical_to_kernel(lids, pairing.local.ppl, kinds)
    rk = logical_to_kernel(rids, pairing.remote_view(rank).ppl, kinds)
    lg, rg = vllm_pairs(pairing, lk, rk, pairing.remote_view(rank))
    if not lg:
        lg, rg = [x[:0] for x in lk], [x[:0] for x in rk]
    return lg, rg


def _check_vllm_dcp_group(
    g: int,
    rank: int,
    lg: np.ndarray,
    rg: np.ndarray,
    exact_l: np.ndarray,
    exact_r: np.ndarray,
    allowed: np.ndarray,
) -> None:
    """Refuse where vLLM's pairing of group ``g`` with remote rank ``rank`` would fail its count assert, pair
    other tokens than the token axis does, or leave tokens P computed unread."""
    if lg.size != rg.size:  # vLLM's descriptor-count assert would fail in _read_blocks
        raise UnsupportedError(
            f"block_ids[{g}]",
            f"with decode context parallelism vLLM 0.33.0 would pair "
            f"{lg.size} local with {rg.size} remote blocks of remote rank {rank} and fail; "
            "kvgeom mode pairs them by token",
            local=int(lg.size),
            remote=int(rg.size),
        )
    got, want = pair_codes(lg, rg), pair_codes(exact_l, exact_r)
    if not np.isin(got, allowed).all() or not np.isin(want, got).all():
        # other tokens paired, or tokens P computed left unread
        raise UnsupportedError(
            f"block_ids[{g}]",
            "with decode context parallelism vLLM 0.33.0 would pair other "
            f"pages ({unpair_codes(np.setdiff1d(got, allowed))[:4]}...) or leave pages P "
            f"computed unread ({unpair_codes(np.setdiff1d(want, got))[:4]}...); kvgeom mode pairs "
            "them by token",
            local=unpair_codes(got)[:8],
            remote=unpair_codes(want)[:8],
        )


def pair_codes(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Id pairs ``(a[i], b[i])`` as one sortable ``int64`` each (ids are below 2**31), over the shorter of the
    two lists (as ``zip`` pairs them: lists of unequal length pair their common prefix)."""
    n = min(len(a), len(b))
    return (np.asarray(a[:n], dtype=np.int64) << 32) | np.asarray(b[:n], dtype=np.int64)


def unpair_codes(x: np.ndarray) -> list[tuple[int, int]]:
    return [(int(v) >> 32, int(v) & 0xFFFFFFFF) for v in np.asarray(x)[:8]]


def vllm_pull_covers(
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
        u = dcp_units_of(local, remote, c, p, num_tokens, prefill_tokens, pairing.prefix_caching, g)
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


def vllm_push_covers(
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
    writers = plan_of(pairing).push_writers[rank]
    for g, (c, p) in enumerate(zip(d_ids, p_ids)):
        if local.groups[g].is_ssm or not c.size or not p.size:
            continue
        u = dcp_units_of(d, local, c, p, num_tokens, prefill_tokens, pairing.prefix_caching, g)
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


def dcp_zero_rows(
    consumer: RankGeometry,
    producer: RankGeometry,
    lids: list[np.ndarray],
    rids: list[np.ndarray],
    num_tokens: int | None,
    prefill_tokens: int | None,
    prefix_caching: bool,
    names: tuple[int, ...] | None = None,
) -> np.ndarray:
    """kvgeom mode, DCP: zero every unit of the consumer's pages no producer rank holds (tokens P did not
    compute), in every page of the group's layers (``names``: the group a refusal names, per group)."""
    rows = [np.zeros((0, 3), dtype=np.int64)]
    for group, c_ids, p_ids in zip(consumer.groups, lids, rids):
        if group.is_ssm or not c_ids.size:
            continue
        name = group.index if names is None else names[group.index]
        u = dcp_units_of(consumer, producer, c_ids, p_ids, num_tokens, prefill_tokens, prefix_caching, name)
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
