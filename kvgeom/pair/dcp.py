"""Decode (and prefill) context parallelism: which remote ranks hold which pages of a request.

With DCP, the ``dcp`` ranks of an engine each hold a disjoint share of every request's KV cache: a
rank's block list is a list of *pages* (one logical block of ``B`` tokens each), and page ``j`` of DCP
rank ``d``'s list is the request's **global page** ``j * dcp + d`` (tokens ``[g * B, (g + 1) * B)``).
The scheduler's block spans ``dcp * B`` tokens, one page on every rank. vLLM's NIXL connector pairs
pages by global position (vLLM PR 39405 and its follow-ups); its P/D DCP interleave is the block
(``cp_kv_cache_interleave_size == block_size``), so a page holds whole consecutive tokens.

vLLM scopes DCP to MLA with ``dcp in (1, tp)`` on each side (a side is fully replicated or fully
sharded) and DCP sizes that divide each other; with PCP the transfer ranks are the PCP ranks (TP 1,
``pcp == dcp``). All functions here are pure and vectorised.
"""

from __future__ import annotations

import math

import numpy as np

from kvgeom.blocks import IdsLike, as_ids, check_positive_int
from kvgeom.errors import ConfigError, IncompatiblePairError, PlanError, RatioError

__all__ = [
    "dcp_rank",
    "transfer_rank",
    "dcp_source_ranks",
    "dcp_consumer_count",
    "check_parallel_pair",
    "global_pages",
    "apply_dcp_prefix_caching",
    "dcp_units",
]


def dcp_rank(tp_rank: int, dcp_size: int) -> int:
    """A rank's DCP rank: ``tp_rank % dcp_size`` (``dcp_size`` is 1 or the TP size)."""
    dcp_size = check_positive_int(dcp_size, "dcp_size", error=ConfigError)
    return check_positive_int(tp_rank, "tp_rank", 0, ConfigError) % dcp_size


def transfer_rank(
    tp_rank: int, tp_size: int, pcp_rank: int = 0, pcp_size: int = 1, dcp_size: int = 1
) -> tuple[int, int]:
    """``(rank, size)`` of this worker among the ranks that transfer KV: the PCP ranks when PCP and DCP
    both shard the cache (TP 1, vLLM ``pcp_dcp_sharded``), else the TP ranks."""
    if pcp_size > 1 and dcp_size > 1:
        if tp_size != 1 or dcp_size != pcp_size:
            raise ConfigError(
                "dcp_size",
                "PCP+DCP needs TP 1 with DCP spanning the whole PCP group",
                value=(tp_size, pcp_size, dcp_size),
            )
        return pcp_rank, pcp_size
    return tp_rank, tp_size


def _check_sizes(local_dcp: int, remote_dcp: int) -> tuple[int, int]:
    local_dcp = check_positive_int(local_dcp, "local_dcp_size", error=RatioError)
    remote_dcp = check_positive_int(remote_dcp, "remote_dcp_size", error=RatioError)
    if local_dcp % remote_dcp and remote_dcp % local_dcp:
        raise RatioError(
            "remote_dcp_size",
            f"DCP sizes must divide one another: local {local_dcp}, remote {remote_dcp}",
            local=local_dcp,
            remote=remote_dcp,
        )
    return local_dcp, remote_dcp


def dcp_source_ranks(
    local_dcp_rank: int, local_dcp_size: int, remote_tp_size: int, remote_dcp_size: int
) -> tuple[int, ...]:
    """Remote ranks whose pages overlap this rank's (vLLM ``TransferTopology.dcp_source_ranks``).

    Local DCP no larger than remote: every remote rank ``r < remote_tp`` with ``r % local_dcp ==
    local_dcp_rank`` (all of them when the local side is replicated); local finer: the one rank
    ``local_dcp_rank % remote_dcp``. Example: local TP1 (DCP 1), remote TP8 DCP8 -> ranks 0..7.
    """
    local_dcp, remote_dcp = _check_sizes(local_dcp_size, remote_dcp_size)
    remote_tp = check_positive_int(remote_tp_size, "remote_tp_size", error=RatioError)
    d = check_positive_int(local_dcp_rank, "local_dcp_rank", 0, ConfigError)
    if d >= local_dcp:
        raise ConfigError("local_dcp_rank", f"{d} outside [0, {local_dcp})", value=d, expected=local_dcp)
    if local_dcp <= remote_dcp:
        return tuple(range(d, remote_tp, local_dcp))
    return (d % remote_dcp,)


def dcp_consumer_count(
    local_tp_size: int, local_dcp_size: int, remote_tp_size: int, remote_dcp_size: int
) -> int:
    """Local ranks reading one remote rank, i.e. the notifications a producer waits for (vLLM
    ``TransferTopology.dcp_consumer_count``): remote sharded -> ``local_tp`` if the local side is
    replicated, else ``max(1, local_dcp // remote_dcp)``; remote replicated -> ``max(1, tp_ratio)``."""
    local_tp = check_positive_int(local_tp_size, "local_tp_size", error=RatioError)
    local_dcp, remote_dcp = _check_sizes(local_dcp_size, remote_dcp_size)
    remote_tp = check_positive_int(remote_tp_size, "remote_tp_size", error=RatioError)
    if remote_dcp > 1:
        return local_tp if local_dcp == 1 else max(1, local_dcp // remote_dcp)
    if local_tp >= remote_tp:
        if local_tp % remote_tp:
            raise RatioError(
                "remote_tp",
                f"local TP {local_tp} is not a multiple of remote TP {remote_tp}",
                local=local_tp,
                remote=remote_tp,
            )
        return local_tp // remote_tp
    if remote_tp % local_tp:
        raise RatioError(
            "remote_tp",
            f"remote TP {remote_tp} is not a multiple of local TP {local_tp}",
            local=local_tp,
            remote=remote_tp,
        )
    return 1


def check_parallel_pair(
    local_pcp_size: int,
    local_dcp_size: int,
    remote_pcp_size: int,
    remote_dcp_size: int,
    has_mamba: bool = False,
) -> None:
    """vLLM's handshake rules on context parallelism (``_validate_remote_parallel_config`` and the DCP
    asserts of ``_validate_remote_agent_handshake``): a PCP remote's DCP must be 1 or span its PCP group;
    replicated PCP (DCP 1) cannot pair with a DCP-sharded peer; DCP sizes divide one another; Mamba
    hybrids need equal DCP sizes. Refusals are :class:`IncompatiblePairError`."""
    lp, ld, rp, rd = (
        check_positive_int(v, n, error=IncompatiblePairError)
        for v, n in (
            (local_pcp_size, "local_pcp_size"),
            (local_dcp_size, "local_dcp_size"),
            (remote_pcp_size, "remote_pcp_size"),
            (remote_dcp_size, "remote_dcp_size"),
        )
    )
    if rp > 1 and rd not in (1, rp):
        raise IncompatiblePairError(
            "dcp_size",
            f"the remote's PCP+DCP does not span its PCP group (PCP {rp}, DCP {rd})",
            local=(lp, ld),
            remote=(rp, rd),
        )
    if (lp > 1 and ld == 1 and rd > 1) or (rp > 1 and rd == 1 and ld > 1):
        raise IncompatiblePairError(
            "dcp_size", "replicated PCP cannot pair with a DCP-sharded peer", local=(lp, ld), remote=(rp, rd)
        )
    if ld % rd and rd % ld:
        raise IncompatiblePairError(
            "dcp_size", f"DCP sizes must divide one another (local {ld}, remote {rd})", local=ld, remote=rd
        )
    if has_mamba and ld != rd:
        raise IncompatiblePairError(
            "dcp_size", f"Mamba hybrids need equal DCP sizes (local {ld}, remote {rd})", local=ld, remote=rd
        )


def global_pages(first: int, count: int, dcp_size: int, rank: int) -> np.ndarray:
    """Global page of list positions ``first .. first + count - 1`` of DCP rank ``rank``:
    ``position * dcp_size + rank``."""
    return (np.arange(first, first + count, dtype=np.int64) * dcp_size) + rank


def apply_dcp_prefix_caching(
    local_ids: IdsLike,
    remote_ids: IdsLike,
    remote_rank: int,
    local_dcp_size: int,
    local_dcp_rank: int,
    remote_dcp_size: int,
    local_num_computed_blocks: int,
    num_remote_blocks: int | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Pair one group's pages by global position (vLLM ``_apply_dcp_prefix_caching``, logical ids).

    ``local_ids`` are this rank's uncached pages (its list starts at position ``c =
    local_num_computed_blocks``), ``remote_ids`` remote rank ``remote_rank``'s whole list. Local page
    ``j`` is global ``(c + j) * Ld + d``, remote page ``i`` is ``i * Rd + remote_rank % Rd``; the result
    pairs the pages both hold, in order (equal lengths). With ``num_remote_blocks`` (the request's pages
    before DCP, without allocation padding) the local list is first cut to the pages that exist and a
    page the remote does not cover is a :class:`PlanError` (vLLM: ``ValueError``).
    """
    lo = as_ids(local_ids, "local_ids")
    ro = as_ids(remote_ids, "remote_ids")
    ld, rd = _check_sizes(local_dcp_size, remote_dcp_size)
    d = check_positive_int(local_dcp_rank, "local_dcp_rank", 0, ConfigError)
    if d >= ld:
        raise ConfigError("local_dcp_rank", f"{d} outside [0, {ld})", value=d, expected=ld)
    c = check_positive_int(local_num_computed_blocks, "local_num_computed_blocks", 0, PlanError)
    r = check_positive_int(remote_rank, "remote_rank", 0, ConfigError)
    if num_remote_blocks is not None:
        total = check_positive_int(num_remote_blocks, "num_remote_blocks", 0, PlanError)
        mine = math.ceil((total - d) / ld) if total > d else 0
        lo = lo[: max(0, mine - c)]
    if ld == rd:
        lsl, rsl = lo, ro[c:]
    elif ld < rd:
        k = rd // ld
        p = (r - d) // ld
        start_local = (p - c) % k
        start_remote = (c + start_local - p) // k
        lsl, rsl = lo[start_local::k], ro[start_remote:]  # Python slice semantics, as vLLM
    else:
        k = ld // rd
        cc = (d - r % rd) // rd
        start_remote = cc + c * k
        lsl, rsl = lo, ro[start_remote::k]
    n = min(lsl.size, rsl.size)
    if num_remote_blocks is not None and n < lsl.size:
        raise PlanError(
            "remote_ids",
            f"remote rank {r}'s {ro.size} pages do not cover the {lsl.size} local pages requested",
            local=int(lsl.size),
            remote=int(rsl.size),
        )
    return lsl[:n].copy(), rsl[:n].copy()


def dcp_units(
    c_ids: IdsLike,
    c_first: int,
    c_page: int,
    c_kernel: int,
    c_dcp: int,
    c_rank: int,
    p_ids: IdsLike,
    p_page: int,
    p_kernel: int,
    p_dcp: int,
    limit: int,
) -> dict[str, np.ndarray]:
    """Where every unit of a consumer rank's pages comes from, token by token (any page and kernel sizes).

    The consumer (D) rank ``c_rank`` of ``c_dcp`` holds list positions ``c_first ..`` of pages of ``c_page``
    tokens (ids ``c_ids``); the producer (P) engine's ``p_dcp`` ranks hold pages of ``p_page`` tokens, list
    positions from 0 (ids ``p_ids``, the same on every P rank). A **unit** is ``gcd(c_kernel, p_kernel)``
    tokens (one kernel block of the finer side when they divide). Unit ``k`` of consumer position ``j`` starts at token
    ``t = ((c_first + j) * c_dcp + c_rank) * c_page + k * unit``, which lives in producer global page
    ``t // p_page``: on P rank ``(t // p_page) % p_dcp``, list position ``(t // p_page) // p_dcp``. Returns
    arrays over the units (consumer list position, kernel id, sub-unit within it and ``fine`` id at unit
    granularity; the same for the producer with its rank; the unit's first token; ``held`` where the producer
    holds that page, ``ok`` where it also computed the unit: ``t < limit``)."""
    c = as_ids(c_ids, "consumer_ids")
    p = as_ids(p_ids, "producer_ids")
    unit = math.gcd(c_kernel, p_kernel)
    per_page = c_page // unit
    j = np.repeat(np.arange(c.size, dtype=np.int64), per_page)
    k = np.tile(np.arange(per_page, dtype=np.int64), c.size)
    t = ((c_first + j) * c_dcp + c_rank) * c_page + k * unit
    gp = t // p_page
    i = gp // p_dcp
    held = i < p.size
    ok = (t < limit) & held
    safe = np.minimum(i, max(p.size - 1, 0))
    p_kernel_id = (p[safe] if p.size else np.zeros_like(safe)) * (p_page // p_kernel) + (
        t % p_page
    ) // p_kernel
    c_kernel_id = c[j] * (c_page // c_kernel) + (k * unit) // c_kernel if c.size else j
    c_sub, p_sub = (k * unit % c_kernel) // unit, (t % p_kernel) // unit
    return {
        "c_pos": j,
        "c_kernel": c_kernel_id,
        "c_sub": c_sub,
        "c_fine": c_kernel_id * (c_kernel // unit) + c_sub,
        "p_rank": gp % p_dcp,
        "p_kernel": p_kernel_id,
        "p_sub": p_sub,
        "p_fine": p_kernel_id * (p_kernel // unit) + p_sub,
        "token": t,
        "ok": ok,
        "held": held,
        "unit": np.asarray(unit),
    }
