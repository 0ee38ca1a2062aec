"""The handshake's rules by feature, each refusing with the field and both sides' values: different KV layouts
(the permute), regions grouped differently, a GQA draft under an MLA target, decode context parallelism,
CSA-linear pairs, packed rows, SSM state (:func:`~kvgeom.pair.handshake.check_pair` applies them in order).
"""

from __future__ import annotations

from typing import cast

from kvgeom.errors import IncompatiblePairError, UnsupportedError
from kvgeom.layout.engine import KVLayout
from kvgeom.layout.geometry import RankGeometry
from kvgeom.model.layers import AttentionSpec, MLASpec
from kvgeom.modes import CompatLike, policy_of
from kvgeom.pair.dcp import check_parallel_pair
from kvgeom.pair.streams import hma_required, region_group_ids

__all__ = [
    "check_permute",
    "check_csa_linear_tp_layout",
    "check_csa_linear_pair",
    "mismatch",
    "check_region_mapped",
    "check_draft",
    "check_dcp",
    "check_packed_rows",
    "check_ssm",
    "check_head_kv_ratio",
]


def mismatch(field: str, what: str, local: object, remote: object) -> IncompatiblePairError:
    return IncompatiblePairError(
        field, f"{what} (local {local!r}, remote {remote!r})", local=local, remote=remote
    )


def check_permute(local: RankGeometry, remote: RankGeometry, mode: str, compat: CompatLike) -> None:
    """Different KV layouts on the two sides (B.6.15): only vLLM's ``enable_permute_local_kv`` pairs them, a
    head-major P moved into a token-major D (``permute_local_kv`` on D: the local rank in pull, the remote one
    in push) of a model with one full-attention KV-cache group (vLLM asserts it without its hybrid memory
    allocator). The transfer moves head-major pages; D permutes them in its receive step. vLLM does it in
    pulls only (its push P refuses D's token-major layout, and D's notification-only push handshake never
    marks D permuting): vllm mode refuses pushes, kvgeom mode plans them (kvgeom mode's per-token cut needs
    one layout on both sides, so it plans the same head-major path)."""
    policy = policy_of(compat)
    lay, ray = local.engine.kv_layout.value, remote.engine.kv_layout.value
    d = local if mode == "pull" else remote
    if not d.engine.permute_local_kv or d.engine.kv_layout.value != "token_major" or d.is_mla:
        raise mismatch(
            "kv_layout",
            "KV layouts differ; only a head-major P moved into a token-major D with permute_local_kv "
            "(vLLM's enable_permute_local_kv, set on D) is planned",
            lay,
            ray,
        )
    if mode != "pull" and policy.engine_refusals:
        raise UnsupportedError(
            "kv_layout",
            "vLLM 0.33.0 permutes only in pulls: in push, P's handshake with D compares its LBHNC with D's "
            "LBNHC and refuses (its permute accepts only an LBHNC remote into an LBNHC local), and D's "
            "notification-only handshake with P never validates P's layout nor marks D permuting; kvgeom "
            f"mode plans the push (local {lay!r}, remote {ray!r})",
            local=lay,
            remote=ray,
        )
    if hma_required(d):
        raise mismatch(
            "kv_layout",
            "vLLM 0.33.0 permutes received blocks only without its hybrid memory allocator (a model whose "
            "layers are all full attention); this model has sliding-window or SSM layers",
            lay,
            ray,
        )


def check_region_mapped(local: RankGeometry, remote: RankGeometry, mode: str, compat: CompatLike) -> None:
    """P and D group the same regions differently (:mod:`kvgeom.plan.regionmap`): block lists pair region by region.
    vLLM 0.33.0 does it in pulls of pure MLA models with equal kernel block sizes (with DCP: logical blocks of one
    kernel block on both sides); kvgeom in pulls of regions of one group each with equal kernel block sizes (a
    separate group is modelled for models of one attention or MLA group, so with DCP: pure MLA)."""
    policy = policy_of(compat)
    if mode != "pull":
        raise UnsupportedError(
            "separate_group",
            "P and D grouping the same regions differently is planned for pulls "
            "(vLLM 0.33.0's push connector refuses it)",
            local=list(local.engine.separate_group),
            remote=list(remote.engine.separate_group),
        )
    if local.block_size != remote.block_size:
        raise UnsupportedError(
            "block_size",
            "regions grouped differently pair page by page: equal kernel block sizes needed",
            local=local.block_size,
            remote=remote.block_size,
        )
    if policy.engine_refusals and (not local.is_mla or local.has_ssm or local.has_draft):
        raise UnsupportedError(
            "separate_group",
            "vLLM 0.33.0 pairs differently grouped regions only for pure MLA models; kvgeom mode plans it",
            value=local.model.name,
        )
    if (
        policy.engine_refusals
        and (local.dcp_size > 1 or remote.dcp_size > 1)
        and (local.ppl > 1 or remote.ppl > 1)
    ):
        raise UnsupportedError(
            "kernel_block_size",
            "vLLM 0.33.0 refuses (NotImplementedError) differently grouped regions with decode context "
            "parallelism unless both sides' logical blocks are their kernel blocks; kvgeom mode plans it",
            local=local.ppl,
            remote=remote.ppl,
        )
    groups = (region_group_ids(local), region_group_ids(remote))
    if (local.dcp_size > 1 or remote.dcp_size > 1) and (-1 in groups[0] or -1 in groups[1]):
        raise UnsupportedError(
            "separate_group",
            "a region viewed by several groups has no page positions to pair by with decode context parallelism "
            "(vLLM 0.33.0: NotImplementedError)",
            local=list(groups[0]),
            remote=list(groups[1]),
        )
    if policy.by_tokens and (-1 in region_group_ids(local) or -1 in region_group_ids(remote)):
        raise UnsupportedError(
            "separate_group",
            "a region viewed by several groups has no single token order to pair by",
            value=local.model.name,
        )


def check_draft(
    local: RankGeometry, remote: RankGeometry, mode: str, compat: CompatLike, ratio: int, bsr: int
) -> None:
    """Head-sharded attention layers next to MLA layers (a GQA draft under an MLA target): vLLM 0.33.0 maps
    them with their own heads only when the local TP is at least the remote's, without DCP (push: equal TP),
    on the same head-major layout when the heads differ. kvgeom plans every TP pair (MLA pages gathered in
    chunks from the draft's sources), not with DCP (:func:`check_dcp` refuses it first: a draft is not MLA).
    Equal layouts on both sides are checked before (:func:`check_pair`)."""
    if not policy_of(compat).engine_refusals:
        return
    if ratio < 0 or (mode == "push" and ratio != 1):
        raise UnsupportedError(
            "tp_size",
            "vLLM 0.33.0 maps a GQA draft under an MLA target only with local TP >= "
            "remote TP (push: equal TP); kvgeom mode plans it",
            local=local.tp_size,
            remote=remote.tp_size,
        )
    spec = cast("AttentionSpec", local.model.attention_spec)  # has_draft: never None
    if (
        spec.heads_per_rank(local.tp_size) != spec.heads_per_rank(remote.tp_size)
        and not local.engine.kv_layout.is_head_major
    ):
        raise mismatch(
            "kv_layout",
            "vLLM 0.33.0 slices a draft's heads only on the same head-major layout on both "
            "sides (kvgeom mode cuts token-major pages per token)",
            local.engine.kv_layout.value,
            remote.engine.kv_layout.value,
        )
    if (
        mode == "pull"
        and bsr > 1
        and spec.heads_per_rank(local.tp_size) > 1
        and local.engine.kv_layout.is_head_major
    ):
        raise UnsupportedError(
            "block_size",
            "vLLM 0.33.0 skips its block-size regroup in MLA models, so a draft's "
            f"head-major pages received as {bsr} finer remote blocks would keep their heads "
            "interleaved; kvgeom mode regroups them",
            local=local.block_size,
            remote=remote.block_size,
        )


def check_dcp(local: RankGeometry, remote: RankGeometry, mode: str) -> None:
    """Decode context parallelism (:mod:`kvgeom.pair.dcp`): vLLM scopes it to MLA (with equal DCP sizes for
    MLA + SSM hybrids); kvgeom pairs every unit by its global token position (any page and kernel sizes whose
    kernel blocks divide one another), pulls and pushes alike."""
    check_parallel_pair(1, local.dcp_size, 1, remote.dcp_size, local.has_ssm)
    attn = [la for la in local.model.layers if not la.kind.is_ssm]
    if not attn or not all(isinstance(la.spec, MLASpec) for la in attn):
        raise UnsupportedError(
            "dcp_size",
            "decode context parallelism is planned for MLA models (with or without "
            "SSM layers), as vLLM scopes it",
            local=local.dcp_size,
            remote=remote.dcp_size,
        )
    big, small = max(local.block_size, remote.block_size), min(local.block_size, remote.block_size)
    if big % small:
        raise UnsupportedError(
            "block_size",
            "with decode context parallelism kernel blocks must divide one another",
            local=local.block_size,
            remote=remote.block_size,
        )


def check_csa_linear_tp_layout(local_tp: int, remote_tp: int, total_kv_heads: int) -> None:
    """CSA-linear models transfer their shared pages as whole blocks, so both sides must lay out the main
    KV pages alike: both TP sizes below the KV head count (several heads per page) or both at or above it
    (one head per page). vLLM ``_validate_csa_linear_tp_layout``; a pair across the boundary is an
    :class:`IncompatiblePairError`."""
    if (local_tp < total_kv_heads) != (remote_tp < total_kv_heads):
        raise IncompatiblePairError(
            "tp_size",
            f"CSA-linear pairs need both TP sizes on the same side of the KV-head "
            f"sharding boundary ({total_kv_heads} KV heads)",
            local=local_tp,
            remote=remote_tp,
        )


def check_csa_linear_pair(local: RankGeometry, remote: RankGeometry) -> None:
    """A CSA-linear pair (both modes): vLLM's TP-layout rule (:func:`check_csa_linear_tp_layout`), then what
    kvgeom models: equal logical and kernel block sizes (a ring's one block holds a state, not tokens, so it
    cannot be cut into the other side's blocks; the replicated page must be equally long, vLLM's handshake
    rule), the same allocation on both sides (packed rows or not) and no decode context parallelism (pages
    by global token position do not apply to a ring)."""
    check_csa_linear_tp_layout(local.tp_size, remote.tp_size, local.num_kv_heads)
    if local.engine.packed_rows != remote.engine.packed_rows:
        raise IncompatiblePairError(
            "packed_rows",
            "a CSA-linear pair needs the same allocation on both sides (vLLM's packed rows, or not)",
            local=local.engine.packed_rows,
            remote=remote.engine.packed_rows,
        )
    here = (local.logical_block_size, local.block_size)
    there = (remote.logical_block_size, remote.block_size)
    if here != there:
        raise UnsupportedError(
            "block_size",
            "CSA-linear pairs need the same (block, kernel block) sizes on both sides: a ring block holds "
            "the request's latest entries, not tokens at fixed positions",
            local=here,
            remote=there,
        )
    if local.dcp_size > 1 or remote.dcp_size > 1:
        raise UnsupportedError(
            "dcp_size",
            "CSA-linear pairs are modelled without decode context parallelism",
            local=local.dcp_size,
            remote=remote.dcp_size,
        )


def check_packed_rows(local: RankGeometry, remote: RankGeometry, compat: CompatLike) -> None:
    """Packed CSA-linear rows (:mod:`kvgeom.layout.csarows`): both sides register regions viewed by the same layers,
    each region as long as its kind says (:attr:`~kvgeom.layout.geometry.RankGeometry.region_tp_scaling`: a
    head-sharded main-KV page by the heads each side holds, compressed keys, rings and the replicated page
    alike; SSM states by :func:`check_ssm`). vLLM-compatible mode also refuses what vLLM 0.33.0 gets wrong
    or asserts against: without a head-sharded main KV (``use_mla``) every region must be equally long; with
    one, vLLM copies every token group's blocks through every region at that region's offset, so where a
    region starts at another byte of the row on the peer (TP sizes differ: pages before it differ) those
    copies land on other layers' pages. kvgeom mode sends each group's blocks through its own pages only
    (:mod:`kvgeom.pair.streams`)."""
    here = [tuple(n for _, n in r.members) for r in local.regions]
    there = [tuple(n for _, n in r.members) for r in remote.regions]
    if here != there:
        raise IncompatiblePairError(
            "regions",
            "the two sides' packed rows register regions viewed by different layers (their pages line up "
            "differently at these TP sizes)",
            local=here[:8],
            remote=there[:8],
        )
    attn = local.model.attention_spec
    lh = attn.heads_per_rank(local.tp_size) if attn else 1
    rh = attn.heads_per_rank(remote.tp_size) if attn else 1
    for i, (a, b, kind) in enumerate(zip(local.regions, remote.regions, local.region_tp_scaling)):
        want = a.block_len * rh // lh if kind == "heads" else a.block_len
        if kind == "state" or b.block_len == want:
            continue
        raise mismatch(
            f"regions[{i}].block_len",
            f"remote block length should be {want} B for this pair",
            a.block_len,
            b.block_len,
        )
    if not policy_of(compat).engine_refusals:
        return
    for i, (a, b) in enumerate(zip(local.regions, remote.regions)):
        if local.is_mla and a.block_len != b.block_len:
            raise mismatch(
                f"regions[{i}].block_len",
                "Hybrid MLA kernel-granularity block lengths must match between P and D (vLLM 0.33.0 asserts "
                "it for CSA-linear rows without a head-sharded main KV; kvgeom mode plans the pair)",
                a.block_len,
                b.block_len,
            )
        if a.row_offset != b.row_offset:
            raise UnsupportedError(
                f"regions[{i}].row_offset",
                "vLLM 0.33.0 copies every token group's blocks through every region of a packed CSA-linear "
                "row; this region starts at another byte of the row on the peer, so those copies would land on "
                "other layers' pages (kvgeom mode sends each group through its own pages)",
                local=a.row_offset,
                remote=b.row_offset,
            )


def check_ssm(
    local: RankGeometry, remote: RankGeometry, ratio: int, compat: CompatLike, prefix_caching: bool
) -> None:
    spec = local.model.ssm_spec
    if spec is None:
        return
    if local.ppl != remote.ppl and prefix_caching:
        raise mismatch(
            "ppl",
            "Mamba hybrids with different kernel blocks per logical block cannot use prefix "
            "caching: disable prefix caching",
            local.ppl,
            remote.ppl,
        )
    if local.engine.conv_layout is not remote.engine.conv_layout:
        raise mismatch(
            "conv_layout",
            "P and D must lay out the conv state alike (a DS page copied into an SD page "
            "puts each byte at another (channel, position)), at any TP sizes",
            local.engine.conv_layout.value,
            remote.engine.conv_layout.value,
        )
    if ratio != 1:
        if local.engine.conv_layout.value != "DS" or remote.engine.conv_layout.value != "DS":
            raise mismatch(
                "conv_layout",
                "heterogeneous TP needs the DS (channel-major) conv layout on both sides",
                local.engine.conv_layout.value,
                remote.engine.conv_layout.value,
            )
        lrep = spec.replicated_pieces(local.tp_size)
        rrep = spec.replicated_pieces(remote.tp_size)
        replicated = any(lrep) or any(rrep) or spec.temporal.replicated(max(local.tp_size, remote.tp_size))
        if replicated and policy_of(compat).engine_refusals:
            names = [n for n, a, b in zip(spec.piece_names, lrep, rrep) if a or b]
            raise UnsupportedError(
                "tp_size",
                f"conv pieces {names} are replicated across ranks at this TP (e.g. Mamba2 n_groups < TP); "
                "scaling them by the TP ratio would read the wrong bytes (vLLM issue 55208); vLLM-compatible mode "
                "refuses the pair, kvgeom mode plans it from the sharding rule",
                local=local.tp_size,
                remote=remote.tp_size,
            )


def check_head_kv_ratio(
    local: RankGeometry, remote: RankGeometry, mode: str, compat: CompatLike, bsr: int, split: int
) -> None:
    """vLLM's CPU attention page (``HEAD_KV_MAJOR``: per head K transposed, ``[head_size, tokens]``, then V
    rows) at a block-size ratio (``bsr`` or ``split`` > 1). vLLM regroups received blocks as if the page were
    ``[heads, tokens, head_size]`` (its post-process, the same in 0.32.0 and 0.33.0) and moves the wrong
    bytes, silently: vllm mode refuses. kvgeom mode cuts both sides' pages by their token runs
    (:mod:`kvgeom.layout.tokenruns`: each finer block's K rows and V rows become descriptors at their token
    range of the coarser block, so nothing is regrouped): in pulls, with the same layout and the same heads
    on both sides, one page per region, no decode context parallelism."""
    spec = local.model.attention_spec
    layouts = (local.engine.kv_layout, remote.engine.kv_layout)
    if (bsr == 1 and split == 1) or spec is None or local.is_mla or KVLayout.HEAD_KV_MAJOR not in layouts:
        return
    lay, ray = (x.value for x in layouts)
    if policy_of(compat).engine_refusals:
        raise mismatch(
            "kv_layout",
            f"vLLM's CPU attention page stores each head's K transposed ([head_size, tokens]) then its V "
            f"([tokens, head_size]): blocks received at a block-size ratio ({max(bsr, split)}) cannot be "
            "regrouped by token ranges (vLLM regroups them as [heads, tokens, head_size] and moves the wrong "
            "bytes); use equal kernel block sizes, or kvgeom mode, which cuts the page by its token runs",
            lay,
            ray,
        )
    why, field, a, b = "", "", cast(object, None), cast(object, None)
    if mode != "pull":
        why, field, a, b = "in pulls only", "mode", mode, "pull"
    elif layouts[0] is not layouts[1]:
        why, field, a, b = "with one layout on both sides", "kv_layout", lay, ray
    elif spec.heads_per_rank(local.tp_size) != spec.heads_per_rank(remote.tp_size):
        why, field = "with the same KV heads per rank on both sides", "tp_size"
        a, b = spec.heads_per_rank(local.tp_size), spec.heads_per_rank(remote.tp_size)
    elif local.dcp_size > 1 or remote.dcp_size > 1:
        why, field, a, b = "without decode context parallelism", "dcp_size", local.dcp_size, remote.dcp_size
    elif any(r.is_packed for g in (local, remote) for r in g.regions):
        why, field, a, b = "with one page per region (no packed rows)", "packed_rows", True, False
    if why:
        raise UnsupportedError(
            field,
            f"kvgeom mode cuts the CPU attention page (head_kv_major) by its token runs at a block-size "
            f"ratio {why}",
            local=a,
            remote=b,
        )
