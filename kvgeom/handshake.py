"""Handshake validation: can this local rank exchange a request's bytes with that remote engine?

:func:`check_pair` applies vLLM's handshake rules (docs/vllm-behaviour.md B.3.2, B.6.8) plus the checks kvgeom adds
where vLLM would silently corrupt (replicated Mamba2 B/C, SD conv layouts across TP sizes). Every
refusal is an :class:`~kvgeom.errors.IncompatiblePairError` (or ``UnsupportedError`` for cases kvgeom
refuses on purpose) naming the field and both sides' values, and both sides reach the same verdict
because every rule is symmetric in the data it reads.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import cast

from .dcp import check_parallel_pair
from .dlist import EngineView
from .engine import KVLayout
from .errors import IncompatiblePairError, RatioError, UnsupportedError
from .geometry import RankGeometry, packed_csa_rows
from .spec import AttentionSpec, MLASpec
from .streams import hma_required, pair_streams, region_group_ids, region_mapped
from .tp import tp_ratio as _tp_ratio

__all__ = [
    "Compat",
    "PairShape",
    "check_pair",
    "block_size_ratio",
    "check_csa_linear_tp_layout",
    "check_csa_linear_pair",
    "check_permute",
]

Compat = str  # "vllm" (refuse what vLLM 0.33.0 refuses) or "kvgeom" (lift refusals the oracle proves safe)


@dataclass(frozen=True)
class PairShape:
    """The ratios a valid pair is planned with, from the local side, and both sides' transfer streams
    (:mod:`kvgeom.streams`; the remote's as seen from any rank of its stage)."""

    tp_ratio: int
    bsr: int
    remote_split: int  # > 1: the remote's blocks are read as this many finer blocks (vLLM B.6.7)
    streams: tuple[EngineView, EngineView] | None = field(default=None, compare=False, repr=False)
    permute: bool = False  # a head-major P moved into a token-major D page, permuted in D's receive step


def _err(field: str, what: str, local: object, remote: object) -> IncompatiblePairError:
    return IncompatiblePairError(
        field, f"{what} (local {local!r}, remote {remote!r})", local=local, remote=remote
    )


def _token_splittable(geom: RankGeometry) -> bool:
    """Whether every kernel page of ``geom`` is token-major in bytes, so that a byte range of
    ``1/k`` of a page is ``1/k`` of its tokens: MLA latents, token-major layouts, one head per rank."""
    spec = geom.model.attention_spec
    if spec is None or geom.engine.kv_layout.value == "token_major":
        return True
    runs = spec.heads_per_rank(geom.tp_size) * geom.engine.kv_layout.runs_per_head
    return all(r.is_mla for r in geom.regions) or runs == 1


def block_size_ratio(
    local: RankGeometry, remote: RankGeometry, mode: str, compat: str = "vllm"
) -> tuple[int, int]:
    """``(bsr, remote_split)`` for a pair: ``bsr = local kernel block // remote kernel block``.

    When the sizes do not divide, a pull may cut both to ``gcd`` units and read each remote block as
    ``remote_split`` pieces: vLLM does it for hybrid MLA + SSM models (B.6.7; at most 128 pieces);
    kvgeom mode for every remote whose pages split by token (:func:`_token_splittable`), which also
    covers P blocks larger than D's (Part C item 2). Everything else must divide.
    """
    lbs, rbs = local.block_size, remote.block_size
    if lbs % rbs == 0:
        return lbs // rbs, 1
    u = math.gcd(lbs, rbs)
    split = rbs // u
    lens_ok = all(r.block_len % split == 0 and r.block_len == r.block_stride for r in remote.regions)
    if compat == "vllm":
        ok = local.is_mla and local.has_ssm and all(local.region_is_mla) and max(split, lbs // u) <= 128
    else:  # a packed row's pages do not split into evenly spaced finer blocks
        ok = _token_splittable(remote) and not any(r.is_packed for r in remote.regions)
    if mode == "pull" and ok and lens_ok:
        return lbs // u, split
    raise RatioError(
        "block_size",
        f"Local block size {lbs} is not divisible by remote block size {rbs} (kernel tokens; "
        f"{'P' if mode == 'push' else 'D'} is local); pick kernel block sizes that divide",
        local=lbs,
        remote=rbs,
    )


def _first_model_difference(local: RankGeometry, remote: RankGeometry) -> str | None:
    if local.model is remote.model or local.model == remote.model:  # equal values: no JSON form needed
        return None
    a, b = local.model.to_json(), remote.model.to_json()
    if len(a["layers"]) != len(b["layers"]):
        return f"model.layers: {len(a['layers'])} vs {len(b['layers'])} cache-holding layers"
    for i, (x, y) in enumerate(zip(a["layers"], b["layers"])):
        if x != y:
            for key in sorted(set(x["spec"]) | set(y["spec"])):
                if x["spec"].get(key) != y["spec"].get(key):
                    return f"model.layers[{i}].spec.{key}: {x['spec'].get(key)!r} vs {y['spec'].get(key)!r}"
            return f"model.layers[{i}]: {x['name']!r} vs {y['name']!r}"
    return None


def check_pair(
    local: RankGeometry,
    remote: RankGeometry,
    mode: str = "pull",
    compat: Compat = "kvgeom",
    prefix_caching: bool = False,
) -> PairShape:
    """Validate a local rank against one remote rank; return the pair's ratios or raise."""
    if compat not in ("vllm", "kvgeom"):
        raise IncompatiblePairError("compat", f"must be 'vllm' or 'kvgeom', got {compat!r}", value=compat)
    diff = _first_model_difference(local, remote)
    if diff:
        raise IncompatiblePairError(
            "model", f"P and D run different models: {diff}", local=local.model.name, remote=remote.model.name
        )
    if compat == "vllm" and all(local.group_is_ssm):
        raise UnsupportedError(
            "model",
            "vLLM 0.33.0's NIXL connector needs an attention group (it builds its "
            "attention tables from the first one and fails at handshake without); kvgeom mode "
            "plans attention-free models",
            local=local.model.name,
            remote=remote.model.name,
        )
    ratio = _tp_ratio(local.tp_size, remote.tp_size)
    if local.is_csa_linear:
        check_csa_linear_pair(local, remote)
    if local.dcp_size > 1 or remote.dcp_size > 1:
        _check_dcp(local, remote, mode)
    bsr, split = block_size_ratio(local, remote, mode, compat)
    streams = pair_streams(local, remote, mode, compat)  # refuses different region counts (num_regions)
    if local.engine.kv_split != remote.engine.kv_split:
        raise _err("kv_split", "K/V split differs", local.engine.kv_split, remote.engine.kv_split)
    attn = local.model.attention_spec
    permute = attn is not None and local.engine.kv_layout != remote.engine.kv_layout
    if permute:
        check_permute(local, remote, mode, compat)
    head_split = attn is not None and _heads(attn, local.tp_size) != _heads(attn, remote.tp_size)
    k = local.num_kv_heads
    if attn is not None and not local.is_mla and abs(ratio) != 1:
        multi_token = max(local.block_size, remote.block_size) > 1  # a one-token page is head-major too
        if (
            not local.engine.kv_layout.is_head_major
            and not permute  # the pull treats the local page as head-major, then permutes (B.6.15)
            and compat == "vllm"
            and (remote.tp_size <= k or (head_split and multi_token))
        ):
            # vLLM refuses it unless the remote replicates its KV heads, yet then still cuts the token-major page
            # into head slices when the heads per rank differ: refused too, the oracle finds those bytes wrong
            raise _err(
                "kv_layout",
                "vLLM 0.33.0 needs a head-major (block-contiguous) layout for heterogeneous TP: "
                "it cuts pages into head slices, which a token-major page does not hold (kvgeom mode cuts "
                "token-major pages per token)",
                local.engine.kv_layout.value,
                remote.engine.kv_layout.value,
            )
        if compat == "vllm" and ratio < 0 and remote.tp_size > k and not local.has_ssm:
            raise _err(
                "tp_size",
                f"the remote replicates KV ({remote.tp_size} ranks > {k} KV heads): "
                "P_TP > D_TP cannot read replicated heads",
                local.tp_size,
                remote.tp_size,
            )
    if local.has_draft:
        _check_draft(local, remote, mode, compat, ratio, bsr)
    if region_mapped(local, remote, streams):
        _check_region_mapped(local, remote, mode, compat)
    elif len(local.groups) != len(remote.groups):
        raise _err(
            "separate_group",
            "P and D group the layers differently but this rank's regions cannot tell",
            list(local.engine.separate_group),
            list(remote.engine.separate_group),
        )
    if packed_csa_rows(local):
        _check_packed_rows(local, remote, compat)
    else:
        _check_block_lens(local, remote, streams, bsr, split)
    if local.has_ssm:
        _check_ssm(local, remote, ratio, compat, prefix_caching)
    kv_rows = KVLayout.HEAD_KV_MAJOR in (local.engine.kv_layout, remote.engine.kv_layout)
    if (bsr > 1 or split > 1) and kv_rows and attn is not None and not local.is_mla:
        raise _err(
            "kv_layout",
            f"vLLM's CPU attention page stores each head's K transposed ([head_size, tokens]) then its V "
            f"([tokens, head_size]): blocks received at a block-size ratio ({bsr}) cannot be regrouped by "
            "token ranges (vLLM regroups them as [heads, tokens, head_size] and moves the wrong bytes); "
            "use equal kernel block sizes",
            local.engine.kv_layout.value,
            remote.engine.kv_layout.value,
        )
    if compat == "vllm" and ratio < 0 and bsr > 1 and head_split and not local.is_mla:
        raise UnsupportedError(
            "block_size",
            "Head-sharded attention reads with P_TP > D_TP and heterogeneous block sizes are not supported "
            f"in vLLM-compatible mode (bsr {bsr}, tp_ratio {ratio}); kvgeom mode plans it",
            local=local.block_size,
            remote=remote.block_size,
        )
    if (
        mode == "push"
        and bsr > 1
        and (not local.is_mla or local.has_draft)
        and attn is not None
        and local.engine.kv_layout.is_head_major
        and _heads(attn, local.tp_size) * local.engine.kv_layout.runs_per_head > 1
    ):
        raise UnsupportedError(
            "block_size",
            f"push with P kernel blocks larger than D's (ratio {bsr}) on a head-major layout would "
            "interleave heads in D's blocks; use equal kernel block sizes or pull",
            local=local.block_size,
            remote=remote.block_size,
        )
    return PairShape(ratio, bsr, split, streams, permute)


def check_permute(local: RankGeometry, remote: RankGeometry, mode: str, compat: Compat) -> None:
    """Different KV layouts on the two sides (B.6.15): only vLLM's ``enable_permute_local_kv`` pairs them, a
    head-major P moved into a token-major D (``permute_local_kv`` on D: the local rank in pull, the remote one
    in push) of a model with one full-attention KV-cache group (vLLM asserts it without its hybrid memory
    allocator). The transfer moves head-major pages; D permutes them in its receive step. vLLM does it in
    pulls only (its push P refuses D's token-major layout, and D's notification-only push handshake never
    marks D permuting): vllm mode refuses pushes, kvgeom mode plans them (kvgeom mode's per-token cut needs
    one layout on both sides, so it plans the same head-major path)."""
    lay, ray = local.engine.kv_layout.value, remote.engine.kv_layout.value
    d = local if mode == "pull" else remote
    if not d.engine.permute_local_kv or d.engine.kv_layout.value != "token_major" or d.is_mla:
        raise _err(
            "kv_layout",
            "KV layouts differ; only a head-major P moved into a token-major D with permute_local_kv "
            "(vLLM's enable_permute_local_kv, set on D) is planned",
            lay,
            ray,
        )
    if mode != "pull" and compat == "vllm":
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
        raise _err(
            "kv_layout",
            "vLLM 0.33.0 permutes received blocks only without its hybrid memory allocator (a model whose "
            "layers are all full attention); this model has sliding-window or SSM layers",
            lay,
            ray,
        )


def _check_region_mapped(local: RankGeometry, remote: RankGeometry, mode: str, compat: Compat) -> None:
    """P and D group the same regions differently (:mod:`kvgeom.regionmap`): block lists pair region by region.
    vLLM 0.33.0 does it in pulls of pure MLA models with equal kernel block sizes (with DCP: logical blocks of one
    kernel block on both sides); kvgeom in pulls of regions of one group each with equal kernel block sizes (a
    separate group is modelled for models of one attention or MLA group, so with DCP: pure MLA)."""
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
    if compat == "vllm" and (not local.is_mla or local.has_ssm or local.has_draft):
        raise UnsupportedError(
            "separate_group",
            "vLLM 0.33.0 pairs differently grouped regions only for pure MLA models; kvgeom mode plans it",
            value=local.model.name,
        )
    if compat == "vllm" and (local.dcp_size > 1 or remote.dcp_size > 1) and (local.ppl > 1 or remote.ppl > 1):
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
    if compat == "kvgeom" and (-1 in region_group_ids(local) or -1 in region_group_ids(remote)):
        raise UnsupportedError(
            "separate_group",
            "a region viewed by several groups has no single token order to pair by",
            value=local.model.name,
        )


def _check_draft(
    local: RankGeometry, remote: RankGeometry, mode: str, compat: Compat, ratio: int, bsr: int
) -> None:
    """Head-sharded attention layers next to MLA layers (a GQA draft under an MLA target): vLLM 0.33.0 maps
    them with their own heads only when the local TP is at least the remote's, without DCP (push: equal TP),
    on the same head-major layout when the heads differ. kvgeom plans every TP pair (MLA pages gathered in
    chunks from the draft's sources), not with DCP (:func:`_check_dcp` refuses it first: a draft is not MLA).
    Equal layouts on both sides are checked before (:func:`check_pair`)."""
    if compat != "vllm":
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
        raise _err(
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


def _check_dcp(local: RankGeometry, remote: RankGeometry, mode: str) -> None:
    """Decode context parallelism (:mod:`kvgeom.dcp`): vLLM scopes it to MLA (with equal DCP sizes for
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


def _heads(spec: AttentionSpec, tp: int) -> int:
    return spec.heads_per_rank(tp)


def _check_block_lens(
    local: RankGeometry, remote: RankGeometry, streams: tuple[EngineView, EngineView], bsr: int, split: int
) -> None:
    """Per stream (region, or a layer's page), the remote length must be the local one scaled by the heads
    each side holds and the block-size ratio (replicated latents: by the ratio only)."""
    attn = local.model.attention_spec
    lh = attn.heads_per_rank(local.tp_size) if attn else 1
    rh = attn.heads_per_rank(remote.tp_size) if attn else 1
    if attn is None and not local.is_mla:
        return  # an attention-free (pure SSM) model: state pages scale with TP, no length rule applies
    lview, rview = streams
    for i, (llen, rlen0, mla) in enumerate(zip(lview.block_lens, rview.block_lens, lview.region_is_mla)):
        rlen = rlen0 // split
        want = (llen if mla or not attn else llen * rh // lh) // bsr
        if local.is_mla and local.has_ssm and llen != rlen * bsr:
            raise _err(
                f"regions[{i}].block_len",
                "Hybrid MLA kernel-granularity block lengths must match between P and D",
                llen,
                rlen0,
            )
        if rlen != want:
            raise _err(
                f"regions[{i}].block_len",
                f"remote block length should be {want} B for this pair",
                llen,
                rlen0,
            )


def _check_packed_rows(local: RankGeometry, remote: RankGeometry, compat: Compat) -> None:
    """Packed CSA-linear rows (:mod:`kvgeom.csarows`): both sides register regions viewed by the same layers,
    each region as long as its kind says (:attr:`~kvgeom.geometry.RankGeometry.region_tp_scaling`: a
    head-sharded main-KV page by the heads each side holds, compressed keys, rings and the replicated page
    alike; SSM states by :func:`_check_ssm`). vLLM-compatible mode also refuses what vLLM 0.33.0 gets wrong
    or asserts against: without a head-sharded main KV (``use_mla``) every region must be equally long; with
    one, vLLM copies every token group's blocks through every region at that region's offset, so where a
    region starts at another byte of the row on the peer (TP sizes differ: pages before it differ) those
    copies land on other layers' pages. kvgeom mode sends each group's blocks through its own pages only
    (:mod:`kvgeom.streams`)."""
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
        raise _err(
            f"regions[{i}].block_len",
            f"remote block length should be {want} B for this pair",
            a.block_len,
            b.block_len,
        )
    if compat != "vllm":
        return
    for i, (a, b) in enumerate(zip(local.regions, remote.regions)):
        if local.is_mla and a.block_len != b.block_len:
            raise _err(
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


def _check_ssm(
    local: RankGeometry, remote: RankGeometry, ratio: int, compat: Compat, prefix_caching: bool
) -> None:
    spec = local.model.ssm_spec
    if spec is None:
        return
    if local.ppl != remote.ppl and prefix_caching:
        raise _err(
            "ppl",
            "Mamba hybrids with different kernel blocks per logical block cannot use prefix "
            "caching: disable prefix caching",
            local.ppl,
            remote.ppl,
        )
    if local.engine.conv_layout is not remote.engine.conv_layout:
        raise _err(
            "conv_layout",
            "P and D must lay out the conv state alike (a DS page copied into an SD page "
            "puts each byte at another (channel, position)), at any TP sizes",
            local.engine.conv_layout.value,
            remote.engine.conv_layout.value,
        )
    if ratio != 1:
        if local.engine.conv_layout.value != "DS" or remote.engine.conv_layout.value != "DS":
            raise _err(
                "conv_layout",
                "heterogeneous TP needs the DS (channel-major) conv layout on both sides",
                local.engine.conv_layout.value,
                remote.engine.conv_layout.value,
            )
        lrep = spec.replicated_pieces(local.tp_size)
        rrep = spec.replicated_pieces(remote.tp_size)
        replicated = any(lrep) or any(rrep) or spec.temporal.replicated(max(local.tp_size, remote.tp_size))
        if replicated and compat == "vllm":
            names = [n for n, a, b in zip(spec.piece_names, lrep, rrep) if a or b]
            raise UnsupportedError(
                "tp_size",
                f"conv pieces {names} are replicated across ranks at this TP (e.g. Mamba2 n_groups < TP); "
                "scaling them by the TP ratio would read the wrong bytes (vLLM issue 55208); vLLM-compatible mode "
                "refuses the pair, kvgeom mode plans it from the sharding rule",
                local=local.tp_size,
                remote=remote.tp_size,
            )
