"""Handshake validation: can this local rank exchange a request's bytes with that remote engine?

:func:`check_pair` applies vLLM's handshake rules (docs/vllm-behaviour.md B.3.2, B.6.8) plus the checks kvgeom adds
where vLLM would silently corrupt (replicated Mamba2 B/C, SD conv layouts across TP sizes). Every
refusal is an :class:`~kvgeom.errors.IncompatiblePairError` (or ``UnsupportedError`` for cases kvgeom
refuses on purpose) naming the field and both sides' values, and both sides reach the same verdict
because every rule is symmetric in the data it reads.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from kvgeom.errors import IncompatiblePairError, RatioError, UnsupportedError
from kvgeom.layout.engine import KVLayout
from kvgeom.layout.geometry import RankGeometry, packed_csa_rows
from kvgeom.layout.view import EngineView
from kvgeom.model.layers import AttentionSpec
from kvgeom.modes import Compat, CompatLike, Policy, policy_of
from kvgeom.pair.rules import (
    check_csa_linear_pair,
    check_dcp,
    check_draft,
    check_head_kv_ratio,
    check_packed_rows,
    check_permute,
    check_region_mapped,
    check_ssm,
    mismatch,
)
from kvgeom.pair.streams import pair_streams, region_mapped
from kvgeom.pair.tp import tp_ratio as _tp_ratio

__all__ = ["PAIR_RULES", "PairFacts", "PairShape", "block_size_ratio", "check_pair"]


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
    ``1/k`` of a page is ``1/k`` of its tokens: MLA latents, token-major layouts, one head per rank; or
    cut by its token runs in kvgeom mode (vLLM's CPU page, :func:`~kvgeom.pair.rules.check_head_kv_ratio`)."""
    spec = geom.model.attention_spec
    if spec is None or geom.engine.kv_layout in (KVLayout.TOKEN_MAJOR, KVLayout.HEAD_KV_MAJOR):
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


@dataclass(frozen=True)
class PairFacts:
    """What the pairing rules read about one pair, computed once by :func:`check_pair` before its rules run."""

    local: RankGeometry
    remote: RankGeometry
    mode: str
    policy: Policy
    prefix_caching: bool
    ratio: int
    bsr: int
    split: int
    streams: tuple[EngineView, EngineView]
    permute: bool  # the KV layouts differ: a head-major P moved into a token-major D, permuted there
    head_split: bool  # the two sides hold different numbers of KV heads per rank

    @property
    def attn(self) -> AttentionSpec | None:
        return self.local.model.attention_spec


Rule = Callable[[PairFacts], None]


def check_pair(
    local: RankGeometry,
    remote: RankGeometry,
    mode: str = "pull",
    compat: CompatLike = Compat.KVGEOM,
    prefix_caching: bool = False,
) -> PairShape:
    """Validate a local rank against one remote rank; return the pair's ratios or raise. ``compat``: the
    mode (or its :class:`~kvgeom.modes.Policy`) whose rules apply.

    Three rules run before the ratios can be computed (same model; vLLM's attention group; CSA-linear and
    DCP pairs); the rest are :data:`PAIR_RULES`, in order, each reading the pair's :class:`PairFacts`."""
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
    attn = local.model.attention_spec
    facts = PairFacts(
        local,
        remote,
        mode,
        policy,
        prefix_caching,
        ratio,
        bsr,
        split,
        streams,
        permute=attn is not None and local.engine.kv_layout != remote.engine.kv_layout,
        head_split=attn is not None and _heads(attn, local.tp_size) != _heads(attn, remote.tp_size),
    )
    for rule in PAIR_RULES:
        rule(facts)
    return PairShape(ratio, bsr, split, streams, facts.permute)


def _kv_split(f: PairFacts) -> None:
    if f.local.engine.kv_split != f.remote.engine.kv_split:
        raise mismatch("kv_split", "K/V split differs", f.local.engine.kv_split, f.remote.engine.kv_split)


def _permute(f: PairFacts) -> None:
    if f.permute:
        check_permute(f.local, f.remote, f.mode, f.policy)


def _heterogeneous_tp_heads(f: PairFacts) -> None:
    """Head-sharded attention at different TP sizes: vLLM's layout and replication limits."""
    local, remote, attn = f.local, f.remote, f.attn
    if attn is None or local.is_mla or abs(f.ratio) == 1 or not f.policy.engine_refusals:
        return
    k = local.num_kv_heads
    multi_token = max(local.block_size, remote.block_size) > 1  # a one-token page is head-major too
    if (
        not local.engine.kv_layout.is_head_major
        and not f.permute  # the pull treats the local page as head-major, then permutes (B.6.15)
        and (remote.tp_size <= k or (f.head_split and multi_token))
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
    if f.ratio < 0 and remote.tp_size > k and not local.has_ssm:
        raise mismatch(
            "tp_size",
            f"the remote replicates KV ({remote.tp_size} ranks > {k} KV heads): "
            "P_TP > D_TP cannot read replicated heads",
            local.tp_size,
            remote.tp_size,
        )


def _draft(f: PairFacts) -> None:
    if f.local.has_draft:
        check_draft(f.local, f.remote, f.mode, f.policy, f.ratio, f.bsr)


def _grouping(f: PairFacts) -> None:
    local, remote = f.local, f.remote
    if region_mapped(local, remote, f.streams):
        check_region_mapped(local, remote, f.mode, f.policy)
    elif len(local.groups) != len(remote.groups):
        raise mismatch(
            "separate_group",
            "P and D group the layers differently but this rank's regions cannot tell",
            list(local.engine.separate_group),
            list(remote.engine.separate_group),
        )


def _block_lens(f: PairFacts) -> None:
    if packed_csa_rows(f.local):
        check_packed_rows(f.local, f.remote, f.policy)
    else:
        _check_block_lens(f.local, f.remote, f.streams, f.bsr, f.split)


def _ssm(f: PairFacts) -> None:
    if f.local.has_ssm:
        check_ssm(f.local, f.remote, f.ratio, f.policy, f.prefix_caching)


def _cpu_page_ratio(f: PairFacts) -> None:
    if f.attn is not None:
        check_head_kv_ratio(f.local, f.remote, f.mode, f.policy, f.bsr, f.split)


def _fewer_heads_finer_blocks(f: PairFacts) -> None:
    if f.policy.engine_refusals and f.ratio < 0 and f.bsr > 1 and f.head_split and not f.local.is_mla:
        raise UnsupportedError(
            "block_size",
            "Head-sharded attention reads with P_TP > D_TP and heterogeneous block sizes are not supported "
            f"in vLLM-compatible mode (bsr {f.bsr}, tp_ratio {f.ratio}); kvgeom mode plans it",
            local=f.local.block_size,
            remote=f.remote.block_size,
        )


def _push_into_finer_blocks(f: PairFacts) -> None:
    local, attn = f.local, f.attn
    if (
        f.mode == "push"
        and f.bsr > 1
        and (not local.is_mla or local.has_draft)
        and attn is not None
        and local.engine.kv_layout.is_head_major
        and _heads(attn, local.tp_size) * local.engine.kv_layout.runs_per_head > 1
    ):
        raise UnsupportedError(
            "block_size",
            f"push with P kernel blocks larger than D's (ratio {f.bsr}) on a head-major layout would "
            "interleave heads in D's blocks; use equal kernel block sizes or pull",
            local=local.block_size,
            remote=f.remote.block_size,
        )


#: the pairing rules after the ratios, in the order they are checked (the first that fails names the error)
PAIR_RULES: tuple[Rule, ...] = (
    _kv_split,
    _permute,
    _heterogeneous_tp_heads,
    _draft,
    _grouping,
    _block_lens,
    _ssm,
    _cpu_page_ratio,
    _fewer_heads_finer_blocks,
    _push_into_finer_blocks,
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
