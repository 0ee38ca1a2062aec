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

from kvgeom.errors import IncompatiblePairError, RatioError, UnsupportedError
from kvgeom.layout.engine import KVLayout
from kvgeom.layout.geometry import RankGeometry, packed_csa_rows
from kvgeom.layout.view import EngineView
from kvgeom.model.layers import AttentionSpec
from kvgeom.modes import Compat, CompatLike, policy_of
from kvgeom.pair.rules import (
    check_csa_linear_pair,
    check_dcp,
    check_draft,
    check_packed_rows,
    check_permute,
    check_region_mapped,
    check_ssm,
    mismatch,
)
from kvgeom.pair.streams import pair_streams, region_mapped
from kvgeom.pair.tp import tp_ratio as _tp_ratio

__all__ = ["PairShape", "block_size_ratio", "check_pair"]


@dataclass(frozen=True)
class PairShape:
    """The ratios a valid pair is planned with, from the local side, and both sides' transfer streams
    (:mod:`kvgeom.pair.streams`; the remote's as seen from any rank of its stage)."""

    tp_ratio: int
    bsr: int
    remote_split: int  # > 1: the remote's blocks are read as this many finer blocks (vLLM B.6.7)
    streams: tuple[EngineView, EngineView] | None = field(default=None, compare=False, repr=False)
    permute: bool = False  # a head-major P moved into a token-major D page, permuted in D's receive step


def _token_splittable(geom: RankGeometry) -> bool:
    """Whether every kernel page of ``geom`` is token-major in bytes, so that a byte range of
    ``1/k`` of a page is ``1/k`` of its tokens: MLA latents, token-major layouts, one head per rank."""
    spec = geom.model.attention_spec
    if spec is None or geom.engine.kv_layout.value == "token_major":
        return True
    runs = spec.heads_per_rank(geom.tp_size) * geom.engine.kv_layout.runs_per_head
    return all(r.is_mla for r in geom.regions) or runs == 1


def block_size_ratio(
    local: RankGeometry, remote: RankGeometry, mode: str, compat: CompatLike = Compat.VLLM
) -> tuple[int, int]:
    """``(bsr, remote_split)`` for a pair: ``bsr = local kernel block // remote kernel block``.

    When the sizes do not divide, a pull may cut both to ``gcd`` units and read each remote block as
    ``remote_split`` pieces: vLLM does it for hybrid MLA + SSM models (B.6.7; at most 128 pieces);
    kvgeom mode for every remote whose pages split by token (:func:`_token_splittable`), which also
    covers P blocks larger than D's (Part C item 2). Everything else must divide.
    """
    policy = policy_of(compat)
    lbs, rbs = local.block_size, remote.block_size
    if lbs % rbs == 0:
        return lbs // rbs, 1
    u = math.gcd(lbs, rbs)
    split = rbs // u
    lens_ok = all(r.block_len % split == 0 and r.block_len == r.block_stride for r in remote.regions)
    if not policy.token_cut:
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
    compat: CompatLike = Compat.KVGEOM,
    prefix_caching: bool = False,
) -> PairShape:
    """Validate a local rank against one remote rank; return the pair's ratios or raise. ``compat``: the
    mode (or its :class:`~kvgeom.modes.Policy`) whose rules apply."""
    policy = policy_of(compat)
    diff = _first_model_difference(local, remote)
    if diff:
        raise IncompatiblePairError(
            "model", f"P and D run different models: {diff}", local=local.model.name, remote=remote.model.name
        )
    if policy.engine_refusals and all(local.group_is_ssm):
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
        check_dcp(local, remote, mode)
    bsr, split = block_size_ratio(local, remote, mode, policy)
    streams = pair_streams(local, remote, mode, policy)  # refuses different region counts (num_regions)
    if local.engine.kv_split != remote.engine.kv_split:
        raise mismatch("kv_split", "K/V split differs", local.engine.kv_split, remote.engine.kv_split)
    attn = local.model.attention_spec
    permute = attn is not None and local.engine.kv_layout != remote.engine.kv_layout
    if permute:
        check_permute(local, remote, mode, policy)
    head_split = attn is not None and _heads(attn, local.tp_size) != _heads(attn, remote.tp_size)
    k = local.num_kv_heads
    if attn is not None and not local.is_mla and abs(ratio) != 1:
        multi_token = max(local.block_size, remote.block_size) > 1  # a one-token page is head-major too
        if (
            not local.engine.kv_layout.is_head_major
            and not permute  # the pull treats the local page as head-major, then permutes (B.6.15)
            and policy.engine_refusals
            and (remote.tp_size <= k or (head_split and multi_token))
        ):
            # vLLM refuses it unless the remote replicates its KV heads, yet then still cuts the token-major page
            # into head slices when the heads per rank differ: refused too, the oracle finds those bytes wrong
            raise mismatch(
                "kv_layout",
                "vLLM 0.33.0 needs a head-major (block-contiguous) layout for heterogeneous TP: "
                "it cuts pages into head slices, which a token-major page does not hold (kvgeom mode cuts "
                "token-major pages per token)",
                local.engine.kv_layout.value,
                remote.engine.kv_layout.value,
            )
        if policy.engine_refusals and ratio < 0 and remote.tp_size > k and not local.has_ssm:
            raise mismatch(
                "tp_size",
                f"the remote replicates KV ({remote.tp_size} ranks > {k} KV heads): "
                "P_TP > D_TP cannot read replicated heads",
                local.tp_size,
                remote.tp_size,
            )
    if local.has_draft:
        check_draft(local, remote, mode, policy, ratio, bsr)
    if region_mapped(local, remote, streams):
        check_region_mapped(local, remote, mode, policy)
    elif len(local.groups) != len(remote.groups):
        raise mismatch(
            "separate_group",
            "P and D group the layers differently but this rank's regions cannot tell",
            list(local.engine.separate_group),
            list(remote.engine.separate_group),
        )
    if packed_csa_rows(local):
        check_packed_rows(local, remote, policy)
    else:
        _check_block_lens(local, remote, streams, bsr, split)
    if local.has_ssm:
        check_ssm(local, remote, ratio, policy, prefix_caching)
    kv_rows = KVLayout.HEAD_KV_MAJOR in (local.engine.kv_layout, remote.engine.kv_layout)
    if (bsr > 1 or split > 1) and kv_rows and attn is not None and not local.is_mla:
        raise mismatch(
            "kv_layout",
            f"vLLM's CPU attention page stores each head's K transposed ([head_size, tokens]) then its V "
            f"([tokens, head_size]): blocks received at a block-size ratio ({bsr}) cannot be regrouped by "
            "token ranges (vLLM regroups them as [heads, tokens, head_size] and moves the wrong bytes); "
            "use equal kernel block sizes",
            local.engine.kv_layout.value,
            remote.engine.kv_layout.value,
        )
    if policy.engine_refusals and ratio < 0 and bsr > 1 and head_split and not local.is_mla:
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
            raise mismatch(
                f"regions[{i}].block_len",
                "Hybrid MLA kernel-granularity block lengths must match between P and D",
                llen,
                rlen0,
            )
        if rlen != want:
            raise mismatch(
                f"regions[{i}].block_len",
                f"remote block length should be {want} B for this pair",
                llen,
                rlen0,
            )
