"""Handshake rules on what a rank advertises, in plain numbers (no geometry card needed).

A NIXL handshake carries each side's registered regions as numbers: block lengths and strides, block
counts, region names and groups, block size, TP and DCP sizes, the KV layout and attention backend. A
peer that sends no :class:`~kvgeom.layout.card.GeometryCard` (a plain vLLM engine, or a rank kvgeom cannot
describe) can only be judged on those numbers. :func:`check_advertised_pair` applies vLLM 0.33.0's
handshake rules to them (``_validate_remote_agent_handshake``; docs/vllm-behaviour.md), every refusal a
:class:`~kvgeom.errors.IncompatiblePairError` (a pair that cannot work) or
:class:`~kvgeom.errors.UnsupportedError` (a pair vLLM does not support) naming the field and both values.

The rules, from the local side (region ``i`` of the remote pairs with the local region ``regions[i]``):

* context parallelism (:func:`kvgeom.pair.dcp.check_parallel_pair`); with DCP, different cache-group layouts
  need one kernel block per logical block on both sides;
* ``tp_ratio`` (:func:`kvgeom.pair.tp.tp_ratio`) and ``bsr`` (:func:`kvgeom.pair.blocksize.block_size_ratio`);
* a remote that replicates its KV heads cannot be read by fewer ranks (attention-only, non-MLA);
* a head-sharded draft under an MLA target needs local TP >= remote TP and no DCP (and equal TP in push);
* Mamba hybrids with different kernel blocks per logical block cannot use prefix caching;
* different block sizes cannot be staged through a host buffer;
* layouts: equal (or the one permute vLLM offers, LBHNC into LBNHC, without HMA); a head split across
  TP sizes needs a block-contiguous layout unless the KV is replicated or permuted; a draft's head split
  needs the same block-contiguous layout; NVFP4 pages cannot be re-sharded by heads;
* region lengths: hybrid MLA + SSM regions match up to ``bsr``; otherwise per region a replicated
  region (MLA, or replicated KV) matches up to ``bsr``, a split one scales with the heads each side holds
  (``remote = local * remote_heads // local_heads // bsr``), and P_TP > D_TP needs ``bsr == 1``;
* the advertised tables are consistent: as many regions as the local side transfers, strides no
  shorter than lengths, one entry per region in every per-region field, the same region names;
* regions sharing block rows (packed CSA-linear rows) start at the same byte of the row on both sides:
  vLLM copies every token group's blocks through every region, which lands on other layers' pages where a
  region starts elsewhere on the peer (a rule of kvgeom's, not vLLM's: vLLM moves the wrong bytes).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvgeom.errors import IncompatiblePairError, UnsupportedError
from kvgeom.model.layers import Shard
from kvgeom.pair.blocksize import block_size_ratio
from kvgeom.pair.dcp import check_parallel_pair
from kvgeom.pair.tp import tp_ratio as _tp_ratio

__all__ = ["Advertised", "LocalFacts", "AdvertisedPair", "check_advertised_pair"]


@dataclass(frozen=True)
class Advertised:
    """What one rank advertises at handshake (vLLM's ``NixlAgentMetadata`` fields, as numbers)."""

    tp_size: int
    block_size: int
    num_blocks: int
    block_lens: tuple[int, ...]
    block_strides: tuple[int, ...]
    kv_layout: str
    dcp_size: int = 1
    ppl: int = 1
    num_bases: int | None = None  # base addresses advertised (default: one per block length)
    region_num_blocks: tuple[int, ...] | None = None
    region_group_ids: tuple[int, ...] | None = None
    region_names: tuple[str, ...] | None = None
    region_mem_types: tuple[str, ...] | None = None
    attn_backend: str = ""
    row_offsets: tuple[int, ...] | None = None
    """Where each region starts in the block row it shares with the others (its base address minus the first
    region's: vLLM's packed CSA-linear rows, docs/vllm-behaviour.md B.6.14); ``None`` when regions do not
    share rows."""


@dataclass(frozen=True)
class LocalFacts:
    """What only the local rank knows: its model's kind and heads, which local region each remote region
    pairs with (``regions``), which regions are replicated, its configuration switches, and how it has
    paired the remote engine so far (its first block count, its region groups)."""

    is_mla: bool
    has_ssm: bool
    total_kv_heads: int
    regions: tuple[int, ...]
    region_replicated: tuple[bool, ...] = ()
    region_group_ids: tuple[int, ...] = ()
    expected_region_names: tuple[str, ...] | None = None
    draft_regions: frozenset[int] = field(default_factory=frozenset)
    draft_kv_heads: int | None = None
    block_contiguous: bool = True
    host_buffer: bool = False
    permute_allowed: bool = False
    hma: bool = False
    nvfp4: bool = False
    prefix_caching: bool = False
    first_num_blocks: int | None = None  # the block count first advertised by this remote engine
    paired_remote_group_ids: tuple[int, ...] = ()  # the remote's region groups as this rank pairs them
    mode: str = "pull"


@dataclass(frozen=True)
class AdvertisedPair:
    """A valid pair: its ratios, and the post-receive conversions vLLM turns on for it."""

    tp_ratio: int
    bsr: int
    permute_local_kv: bool = False
    heterogeneous_attn: bool = False


def _err(field: str, what: str, local: object, remote: object) -> IncompatiblePairError:
    return IncompatiblePairError(
        field, f"{what} (local {local!r}, remote {remote!r})", local=local, remote=remote
    )


def _unsupported(field: str, what: str, local: object, remote: object) -> UnsupportedError:
    return UnsupportedError(field, f"{what} (local {local!r}, remote {remote!r})", local=local, remote=remote)


def _heads(total: int, tp: int) -> int:
    return Shard(total, 1).units_per_rank(tp)


def check_advertised_pair(local: Advertised, remote: Advertised, facts: LocalFacts) -> AdvertisedPair:
    """Validate the local rank against one remote rank's advertised numbers; return the pair's ratios and
    conversions, or raise (see the module doc for the rules, in the order they apply)."""
    check_parallel_pair(1, local.dcp_size, 1, remote.dcp_size, facts.has_ssm)
    ratio = _tp_ratio(local.tp_size, remote.tp_size)
    bsr = block_size_ratio(local.block_size, remote.block_size)
    k = facts.total_kv_heads
    remote_replicated = Shard(k, 1).replicated(remote.tp_size)
    _check_replicated_remote(local, remote, facts, ratio, remote_replicated)
    drafts = _draft_heads(local, remote, facts, ratio)
    _check_kernel_blocks(local, remote, facts, bsr)
    permute = _permutes(local, remote, facts)
    hetero_attn = _repacks_attention(local, remote, facts)
    _check_head_split_layout(local, remote, facts, abs(ratio) != 1 and not remote_replicated and not permute)
    _check_draft_layout(local, remote, facts, drafts)
    heads = (_heads(k, local.tp_size), _heads(k, remote.tp_size))
    if not facts.is_mla and facts.nvfp4 and heads[0] != heads[1]:
        raise _unsupported(
            "tp_size",
            "NVFP4 pages keep every head's data before every head's scales: they cannot be "
            "re-sharded by heads; use equal TP sizes",
            local.tp_size,
            remote.tp_size,
        )
    _check_lens(local, remote, facts, ratio, bsr, remote_replicated, heads, drafts)
    _check_tables(remote, facts)
    _check_row_offsets(local, remote)
    return AdvertisedPair(ratio, bsr, permute, hetero_attn)


def _check_replicated_remote(
    local: Advertised, remote: Advertised, facts: LocalFacts, ratio: int, remote_replicated: bool
) -> None:
    """A remote that replicates its KV heads cannot be read by fewer ranks (attention-only, non-MLA)."""
    if not facts.is_mla and not facts.has_ssm and ratio < 0 and remote_replicated:
        raise _err(
            "tp_size",
            f"the remote replicates its KV ({remote.tp_size} ranks > {facts.total_kv_heads} KV heads): fewer "
            "ranks cannot read replicated heads",
            local.tp_size,
            remote.tp_size,
        )


def _draft_heads(local: Advertised, remote: Advertised, facts: LocalFacts, ratio: int) -> tuple[int, int]:
    """The draft's KV heads per rank on each side (1 and 1 without a head-sharded draft), checked: local TP
    >= remote TP and no DCP, and equal TP in push."""
    if not facts.draft_regions:
        return (1, 1)
    heads = facts.draft_kv_heads or 1
    drafts = (_heads(heads, local.tp_size), _heads(heads, remote.tp_size))
    if ratio < 0 or local.dcp_size > 1 or remote.dcp_size > 1:
        raise _unsupported(
            "tp_size",
            "a head-sharded draft under an MLA target needs local TP >= remote TP and no DCP",
            (local.tp_size, local.dcp_size),
            (remote.tp_size, remote.dcp_size),
        )
    if facts.mode == "push" and local.tp_size != remote.tp_size:
        raise _unsupported(
            "tp_size",
            "push cannot write a head-sharded draft under an MLA target across TP sizes; use pull",
            local.tp_size,
            remote.tp_size,
        )
    return drafts


def _check_kernel_blocks(local: Advertised, remote: Advertised, facts: LocalFacts, bsr: int) -> None:
    """Kernel blocks and block sizes: DCP across cache-group layouts needs one kernel block per block, a
    Mamba hybrid with different kernel blocks per block no prefix caching, a host buffer equal blocks."""
    if (
        (local.dcp_size > 1 or remote.dcp_size > 1)
        and facts.region_group_ids
        and tuple(facts.region_group_ids) != tuple(facts.paired_remote_group_ids)
        and (local.ppl != 1 or remote.ppl != 1)
    ):
        raise _unsupported(
            "ppl",
            "DCP pulls across different cache-group layouts need one kernel block per logical "
            "block on both sides",
            local.ppl,
            remote.ppl,
        )
    if facts.has_ssm and local.ppl != remote.ppl and facts.prefix_caching:
        raise _err(
            "ppl",
            "Mamba hybrids with different kernel blocks per logical block cannot use prefix "
            "caching: disable prefix caching",
            local.ppl,
            remote.ppl,
        )
    if bsr != 1 and facts.host_buffer:
        raise _unsupported(
            "block_size",
            "different block sizes cannot be staged through a host buffer",
            local.block_size,
            remote.block_size,
        )


def _permutes(local: Advertised, remote: Advertised, facts: LocalFacts) -> bool:
    """Whether D permutes a received cache into its own layout: equal layouts (or MLA) need none; the one
    permute vLLM offers is LBHNC into LBNHC, without hybrid cache groups."""
    if facts.is_mla or remote.kv_layout == local.kv_layout:
        return False
    if facts.permute_allowed and remote.kv_layout == "LBHNC" and local.kv_layout == "LBNHC":
        if facts.hma:
            raise _unsupported(
                "kv_layout",
                "permuting a received LBHNC cache into LBNHC is not available with hybrid cache groups",
                local.kv_layout,
                remote.kv_layout,
            )
        return True
    raise _err(
        "kv_layout",
        "both sides need the same KV cache layout (or enable_permute_local_kv for LBHNC into LBNHC)",
        local.kv_layout,
        remote.kv_layout,
    )


def _repacks_attention(local: Advertised, remote: Advertised, facts: LocalFacts) -> bool:
    """Whether a CPU-attention D repacks a received page of another backend (not with hybrid groups)."""
    if remote.attn_backend == local.attn_backend or local.attn_backend != "CPU_ATTN":
        return False
    if facts.hma:
        raise _unsupported(
            "attn_backend",
            "repacking for a different attention backend is not available with hybrid cache groups",
            local.attn_backend,
            remote.attn_backend,
        )
    return True


def _check_head_split_layout(local: Advertised, remote: Advertised, facts: LocalFacts, splits: bool) -> None:
    """Heads split across TP sizes (``splits``: not replicated, not permuted) need a block-contiguous layout."""
    if splits and not facts.is_mla and not facts.block_contiguous:
        raise _err(
            "kv_layout",
            "splitting heads across TP sizes needs a block-contiguous layout (e.g. LBHNC)",
            local.kv_layout,
            remote.kv_layout,
        )


def _check_draft_layout(
    local: Advertised, remote: Advertised, facts: LocalFacts, drafts: tuple[int, int]
) -> None:
    """A draft's heads split across TP sizes need the same block-contiguous layout on both sides."""
    if (
        facts.draft_regions
        and drafts[0] != drafts[1]
        and (remote.kv_layout != local.kv_layout or not facts.block_contiguous)
    ):
        raise _err(
            "kv_layout",
            "a head-sharded draft under an MLA target needs the same block-contiguous layout on both sides",
            local.kv_layout,
            remote.kv_layout,
        )


def _check_lens(
    local: Advertised,
    remote: Advertised,
    facts: LocalFacts,
    ratio: int,
    bsr: int,
    remote_replicated: bool,
    heads: tuple[int, int],
    draft_heads: tuple[int, int],
) -> None:
    lens, rlens = local.block_lens, remote.block_lens
    if facts.has_ssm and facts.is_mla:
        scaled = [x * bsr for x in rlens]
        if list(lens) != scaled:
            raise _err(
                "block_lens",
                f"hybrid MLA kernel-granularity block lengths must match up to the block-size ratio {bsr}",
                list(lens),
                list(rlens),
            )
        return
    if facts.has_ssm:
        return  # SSM state pages are checked through their sizes and conv offsets
    if len(facts.regions) != len(rlens):
        raise _err(
            "num_regions", "both sides must register the same KV layers", len(facts.regions), len(rlens)
        )
    model_replicated = facts.is_mla or remote_replicated
    for i, r in enumerate(facts.regions):
        mine, theirs = int(lens[r]), int(rlens[i])
        if r in facts.draft_regions:
            replicated, (lh, rh) = False, draft_heads
        else:
            replicated = model_replicated or (r < len(facts.region_replicated) and facts.region_replicated[r])
            lh, rh = heads
        if replicated:
            want = mine // bsr
        elif ratio < 0 and bsr != 1:
            raise _unsupported(
                "block_size",
                "different block sizes are not supported when P TP > D TP",
                local.block_size,
                remote.block_size,
            )
        else:
            want = mine * rh // lh // (bsr if ratio > 0 else 1)
        if theirs != want:
            raise _err(
                f"block_lens[{i}]",
                f"the remote block length should be {want} B for this pair ({lh} local, "
                f"{rh} remote heads per rank, block-size ratio {bsr}{', replicated' if replicated else ''})",
                mine,
                theirs,
            )


def _check_row_offsets(local: Advertised, remote: Advertised) -> None:
    if local.row_offsets is None and remote.row_offsets is None:
        return
    if (
        local.row_offsets is None
        or remote.row_offsets is None
        or len(local.row_offsets) != len(remote.row_offsets)
    ):
        raise _err(
            "row_offsets",
            "both sides must share block rows among the same number of regions (packed rows or not)",
            local.row_offsets,
            remote.row_offsets,
        )
    for i, (a, b) in enumerate(zip(local.row_offsets, remote.row_offsets)):
        if a != b:
            raise _unsupported(
                f"regions[{i}].row_offset",
                "this region starts at another byte of the shared block row on the peer: vLLM 0.33.0's copies of "
                "every token group through every region would land on other layers' pages (kvgeom mode pairs "
                "each group through its own pages)",
                a,
                b,
            )


def _check_tables(remote: Advertised, facts: LocalFacts) -> None:
    n = len(remote.block_lens)
    if facts.first_num_blocks is not None and facts.first_num_blocks != remote.num_blocks:
        raise _err(
            "num_blocks",
            "every rank of the remote engine must advertise the same block count",
            facts.first_num_blocks,
            remote.num_blocks,
        )
    bases = n if remote.num_bases is None else remote.num_bases
    if bases != len(facts.regions):
        raise _err(
            "kv_caches_base_addr", "one remote region per local transfer region", len(facts.regions), bases
        )
    for name, values in (
        ("region_num_blocks", remote.region_num_blocks),
        ("block_strides", remote.block_strides),
        ("region_group_ids", remote.region_group_ids),
        ("region_mem_types", remote.region_mem_types),
    ):
        if values is not None and len(values) != bases:
            raise _err(name, f"one entry per advertised region ({bases})", bases, len(values))
    short = [i for i, (s, b) in enumerate(zip(remote.block_strides, remote.block_lens)) if s < b]
    if short:
        i = short[0]
        raise _err(
            f"block_strides[{i}]",
            "a block stride shorter than its block",
            remote.block_lens[i],
            remote.block_strides[i],
        )
    if (
        remote.region_names is not None
        and facts.expected_region_names is not None
        and tuple(remote.region_names) != tuple(facts.expected_region_names)
    ):
        raise _err(
            "region_names",
            "both sides must name the same caches in the same order",
            list(facts.expected_region_names),
            list(remote.region_names),
        )
