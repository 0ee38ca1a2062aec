"""kvgeom.pair.handshake, rule by rule: each refusal's class, field and values, and the acceptance right at each
boundary, in both compat modes. Geometries are tiny; expected ratios are derived in comments."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pytest

from kvgeom import EngineConfig, IncompatiblePairError, KvgeomError, RatioError
from kvgeom.errors import UnsupportedError
from kvgeom.layout.allocate import rank_geometry
from kvgeom.layout.geometry import RankGeometry
from kvgeom.model.layers import AttentionSpec, MambaSpec, MLASpec
from kvgeom.model.spec import ModelSpec
from kvgeom.pair.handshake import PairShape, block_size_ratio, check_pair
from kvgeom.pair.rules import check_csa_linear_tp_layout

DENSE2 = ModelSpec.from_layers("dense2", [AttentionSpec(2, 2, "float16")] * 2)  # 2 KV heads
DENSE4 = ModelSpec.from_layers("dense4", [AttentionSpec(4, 2, "float16")] * 2)  # 4 KV heads
MLA = ModelSpec.from_layers("mla", [MLASpec(8, "float16")] * 2)
DRAFT = ModelSpec.from_layers("mla+draft", [MLASpec(8, "float16")] * 2 + [AttentionSpec(4, 4, "float16")] * 2)
MAMBA1 = ModelSpec.from_layers("ssm", [MambaSpec.mamba1(4, 1, 2, "float16")])
HYBRID = ModelSpec.from_layers("h", [AttentionSpec(2, 2, "float16"), MambaSpec.mamba1(2, 1, 2, "float16")])


def geo(model: ModelSpec, tp: int = 1, block: int = 4, rank: int = 0, **kw: Any) -> RankGeometry:
    return rank_geometry(model, EngineConfig(tp_size=tp, tp_rank=rank, block_size=block, num_blocks=8, **kw))


def refused(cls: type[KvgeomError], field: str, fn: Callable[[], object], **values: object) -> KvgeomError:
    with pytest.raises(KvgeomError) as info:
        fn()
    err = info.value
    assert type(err) is cls, (type(err), err)
    assert err.field == field, err
    assert err.values == values, err.values
    return err


def ratios(shape: PairShape) -> tuple[int, int, int]:
    return (shape.tp_ratio, shape.bsr, shape.remote_split)


# ---- PairShape, compat, model --------------------------------------------------------------------------


def test_pair_shape_compares_and_prints_without_its_streams() -> None:
    shape = check_pair(geo(DENSE4), geo(DENSE4))
    assert shape.streams is not None
    assert shape == PairShape(1, 1, 1)
    assert "streams" not in repr(shape)
    assert PairShape(1, 1, 1).streams is None


def test_compat_must_be_known() -> None:
    g = geo(DENSE4)
    refused(IncompatiblePairError, "compat", lambda: check_pair(g, g, compat="VLLM"), value="VLLM")
    assert ratios(check_pair(g, g, compat="vllm")) == (1, 1, 1)
    assert ratios(check_pair(g, g, compat="kvgeom")) == (1, 1, 1)


def test_defaults_are_pull_kvgeom_without_prefix_caching() -> None:
    # token-major pages of 2 KV heads, D TP 1 against P TP 2: kvgeom cuts them per token, vllm refuses
    d, p = geo(DENSE2, kv_layout="token_major"), geo(DENSE2, tp=2, kv_layout="token_major")
    assert ratios(check_pair(d, p)) == (-2, 1, 1)
    # kernel 4 against 6 token-major: pull reads P's blocks as 3 pieces of gcd 2 -> (4 // 2, 6 // 2)
    d4, p6 = geo(DENSE4, kv_layout="token_major"), geo(DENSE4, block=6, kv_layout="token_major")
    assert ratios(check_pair(d4, p6)) == (1, 2, 3)
    refused(RatioError, "block_size", lambda: check_pair(d4, p6, mode="push"), local=4, remote=6)
    # a Mamba hybrid with 2 kernel blocks per block on one side: fine without prefix caching
    one, two = geo(HYBRID, block=8), geo(HYBRID, block=8, kernel_block_size=4)
    # (local kernel 8 against remote kernel 4: bsr 2)
    assert ratios(check_pair(one, two)) == (1, 2, 1)
    refused(
        IncompatiblePairError, "ppl", lambda: check_pair(one, two, prefix_caching=True), local=1, remote=2
    )


def test_different_models_are_refused_naming_the_first_difference() -> None:
    err = refused(
        IncompatiblePairError,
        "model",
        lambda: check_pair(geo(DENSE4), geo(DENSE2)),
        local="dense4",
        remote="dense2",
    )
    assert "model.layers[0].spec.num_kv_heads: 4 vs 2" in str(err)
    three = ModelSpec.from_layers("dense4", [AttentionSpec(4, 2, "float16")] * 3)
    err = refused(
        IncompatiblePairError,
        "model",
        lambda: check_pair(geo(DENSE4), geo(three)),
        local="dense4",
        remote="dense4",
    )
    assert "model.layers: 2 vs 3 cache-holding layers" in str(err)
    # the same specs at other layer indices: names differ ("layers.0.attn" vs "layers.1.attn")
    shifted = ModelSpec.from_layers(
        "dense4", [None, AttentionSpec(4, 2, "float16"), AttentionSpec(4, 2, "float16")]
    )
    err = refused(
        IncompatiblePairError,
        "model",
        lambda: check_pair(geo(DENSE4), geo(shifted)),
        local="dense4",
        remote="dense4",
    )
    assert "model.layers[0]: 'layers.0.attn' vs 'layers.1.attn'" in str(err)
    # the second layer differs
    mixed = ModelSpec.from_layers("dense4", [AttentionSpec(4, 2, "float16"), AttentionSpec(4, 4, "float16")])
    err = refused(
        IncompatiblePairError,
        "model",
        lambda: check_pair(geo(DENSE4), geo(mixed)),
        local="dense4",
        remote="dense4",
    )
    assert "model.layers[1].spec.head_size: 2 vs 4" in str(err)


def test_equal_models_under_other_names_pair() -> None:
    renamed = ModelSpec.from_layers("other", [AttentionSpec(4, 2, "float16")] * 2)
    assert ratios(check_pair(geo(DENSE4), geo(renamed))) == (1, 1, 1)


def test_vllm_needs_an_attention_group() -> None:
    g = geo(MAMBA1)
    refused(UnsupportedError, "model", lambda: check_pair(g, g, compat="vllm"), local="ssm", remote="ssm")
    assert ratios(check_pair(g, g)) == (1, 1, 1)
    h = geo(HYBRID, block=8)
    assert ratios(check_pair(h, h, compat="vllm")) == (1, 1, 1)


def test_tp_sizes_must_divide() -> None:
    refused(RatioError, "remote_tp", lambda: check_pair(geo(MLA, tp=2), geo(MLA, tp=3)), local=2, remote=3)
    refused(RatioError, "remote_tp", lambda: check_pair(geo(MLA, tp=3), geo(MLA, tp=2)), local=3, remote=2)


# ---- decode context parallelism ------------------------------------------------------------------------


def test_dcp_is_planned_for_mla_models_only() -> None:
    assert ratios(check_pair(geo(MLA, tp=2, dcp_size=2), geo(MLA))) == (2, 1, 1)
    assert ratios(check_pair(geo(MLA), geo(MLA, tp=2, dcp_size=2))) == (-2, 1, 1)
    refused(
        UnsupportedError,
        "dcp_size",
        lambda: check_pair(geo(DENSE2, tp=2, dcp_size=2), geo(DENSE2, tp=2)),
        local=2,
        remote=1,
    )
    refused(
        UnsupportedError,
        "dcp_size",
        lambda: check_pair(geo(DENSE2, tp=2), geo(DENSE2, tp=2, dcp_size=2)),
        local=1,
        remote=2,
    )
    refused(
        UnsupportedError,
        "dcp_size",
        lambda: check_pair(geo(DRAFT, tp=2, dcp_size=2), geo(DRAFT, tp=2)),
        local=2,
        remote=1,
    )
    refused(
        UnsupportedError,
        "dcp_size",
        lambda: check_pair(geo(MAMBA1, tp=2, dcp_size=2), geo(MAMBA1, tp=2, dcp_size=2)),
        local=2,
        remote=2,
    )


def test_dcp_kernel_blocks_must_divide_one_another() -> None:
    # 4 against 6: refused by the DCP rule (not the block-size rule, which would split them)
    refused(
        UnsupportedError,
        "block_size",
        lambda: check_pair(geo(MLA, tp=2, dcp_size=2), geo(MLA, block=6)),
        local=4,
        remote=6,
    )
    refused(
        UnsupportedError,
        "block_size",
        lambda: check_pair(geo(MLA, tp=2, dcp_size=2, block=6), geo(MLA, block=4)),
        local=6,
        remote=4,
    )
    assert ratios(check_pair(geo(MLA, tp=2, dcp_size=2, block=8), geo(MLA))) == (2, 2, 1)
    # DCP 2 against 3: TP 2 against 3 does not divide first
    refused(
        RatioError,
        "remote_tp",
        lambda: check_pair(geo(MLA, tp=2, dcp_size=2), geo(MLA, tp=3, dcp_size=3)),
        local=2,
        remote=3,
    )


# ---- block-size ratio ----------------------------------------------------------------------------------


def test_block_size_ratio_dividing() -> None:
    assert block_size_ratio(geo(DENSE4, block=8), geo(DENSE4), "pull") == (2, 1)
    assert block_size_ratio(geo(DENSE4, block=8), geo(DENSE4), "push") == (2, 1)
    assert block_size_ratio(geo(DENSE4), geo(DENSE4), "pull", "vllm") == (1, 1)


def test_block_size_ratio_splits_token_splittable_remotes_in_kvgeom_pulls() -> None:
    # gcd(4, 6) = 2: local 2 units, each remote block 3 units
    assert block_size_ratio(geo(MLA), geo(MLA, block=6), "pull", "kvgeom") == (2, 3)
    assert block_size_ratio(
        geo(DENSE4, kv_layout="token_major"), geo(DENSE4, block=6, kv_layout="token_major"), "pull", "kvgeom"
    ) == (2, 3)
    # head-major with one head per rank (4 heads at TP 4) splits by token too
    assert block_size_ratio(geo(DENSE4, tp=4), geo(DENSE4, tp=4, block=6), "pull", "kvgeom") == (2, 3)
    # local blocks larger than remote: 6 against 4 -> gcd 2: 3 local units, remote blocks in 2
    assert block_size_ratio(geo(MLA, block=6), geo(MLA), "pull", "kvgeom") == (3, 2)
    # the default compat is vllm: an MLA model without SSM does not split
    refused(
        RatioError,
        "block_size",
        lambda: block_size_ratio(geo(MLA), geo(MLA, block=6), "pull"),
        local=4,
        remote=6,
    )


def test_block_size_ratio_refusals() -> None:
    # head-major with 2 heads per rank: a page is not token-major
    refused(
        RatioError,
        "block_size",
        lambda: block_size_ratio(geo(DENSE4, tp=2), geo(DENSE4, tp=2, block=6), "pull", "kvgeom"),
        local=4,
        remote=6,
    )
    # push never splits
    refused(
        RatioError,
        "block_size",
        lambda: block_size_ratio(geo(MLA), geo(MLA, block=6), "push", "kvgeom"),
        local=4,
        remote=6,
    )
    # a draft's head-major pages (2 heads per rank at TP 2) do not split; at TP 4 (one head) they do
    refused(
        RatioError,
        "block_size",
        lambda: block_size_ratio(geo(DRAFT, tp=2), geo(DRAFT, tp=2, block=6), "pull", "kvgeom"),
        local=4,
        remote=6,
    )
    assert block_size_ratio(geo(DRAFT, tp=4), geo(DRAFT, tp=4, block=6), "pull", "kvgeom") == (2, 3)
    # packed rows (one row holds every layer's page of a block) do not split into evenly spaced blocks
    refused(
        RatioError,
        "block_size",
        lambda: block_size_ratio(geo(MLA), geo(MLA, block=6, packed_rows=True), "pull", "kvgeom"),
        local=4,
        remote=6,
    )
    assert block_size_ratio(geo(MLA, block=6, packed_rows=True), geo(MLA), "pull", "kvgeom") == (3, 2)


# ---- layouts and TP ------------------------------------------------------------------------------------


def test_kv_split_and_layouts_must_match() -> None:
    refused(
        IncompatiblePairError,
        "kv_layout",
        lambda: check_pair(geo(DENSE4), geo(DENSE4, kv_layout="token_major")),
        local="head_major",
        remote="token_major",
    )
    # MLA latents have no head layout
    assert ratios(check_pair(geo(MLA), geo(MLA, kv_layout="token_major"))) == (1, 1, 1)


def test_kv_split_must_match() -> None:
    for compat in ("vllm", "kvgeom"):
        refused(
            IncompatiblePairError,
            "kv_split",
            lambda compat=compat: check_pair(geo(MLA, kv_split=True), geo(MLA), compat=compat),
            local=True,
            remote=False,
        )
    # dense: split K/V doubles the regions (vllm) or is refused by the stream pairing (kvgeom)
    refused(
        IncompatiblePairError,
        "num_regions",
        lambda: check_pair(geo(DENSE4, kv_split=True), geo(DENSE4), compat="vllm"),
        local=4,
        remote=2,
    )
    assert ratios(check_pair(geo(DENSE4, kv_split=True), geo(DENSE4, kv_split=True))) == (1, 1, 1)


def test_vllm_token_major_across_tp_sizes() -> None:
    tm = {"kv_layout": "token_major"}
    # remote TP 2 <= 2 KV heads: refused (block 1: no head split matters, the TP rule alone)
    refused(
        IncompatiblePairError,
        "kv_layout",
        lambda: check_pair(geo(DENSE2, block=1, **tm), geo(DENSE2, tp=2, block=1, **tm), compat="vllm"),
        local="token_major",
        remote="token_major",
    )
    # remote TP 4 > 2 heads replicates; heads per rank 2 vs 1 differ; multi-token pages (2 tokens): refused
    refused(
        IncompatiblePairError,
        "kv_layout",
        lambda: check_pair(geo(DENSE2, block=2, **tm), geo(DENSE2, tp=4, block=2, **tm), compat="vllm"),
        local="token_major",
        remote="token_major",
    )
    # one-token pages are head-major too: the layout passes, the replicated-heads rule refuses
    refused(
        IncompatiblePairError,
        "tp_size",
        lambda: check_pair(geo(DENSE2, block=1, **tm), geo(DENSE2, tp=4, block=1, **tm), compat="vllm"),
        local=1,
        remote=4,
    )
    # remote TP 8 > 2, local TP 4: one head per rank on both sides: the layout passes; ratio 2 is fine
    assert ratios(check_pair(geo(DENSE2, tp=8, **tm), geo(DENSE2, tp=4, **tm), compat="vllm")) == (2, 1, 1)
    # equal TP passes in vllm; head-major passes; kvgeom passes
    assert ratios(check_pair(geo(DENSE2, **tm), geo(DENSE2, **tm), compat="vllm")) == (1, 1, 1)
    assert ratios(check_pair(geo(DENSE2), geo(DENSE2, tp=2), compat="vllm")) == (-2, 1, 1)
    assert ratios(check_pair(geo(DENSE2, **tm), geo(DENSE2, tp=2, **tm))) == (-2, 1, 1)
    # MLA: no heads to cut
    assert ratios(check_pair(geo(MLA, **tm), geo(MLA, tp=2, **tm), compat="vllm")) == (-2, 1, 1)


def test_vllm_fewer_ranks_cannot_read_replicated_heads() -> None:
    refused(
        IncompatiblePairError,
        "tp_size",
        lambda: check_pair(geo(DENSE2, tp=2), geo(DENSE2, tp=4), compat="vllm"),
        local=2,
        remote=4,
    )
    assert ratios(check_pair(geo(DENSE2, tp=2), geo(DENSE2, tp=4))) == (-2, 1, 1)  # kvgeom plans it
    assert ratios(check_pair(geo(DENSE2, tp=8), geo(DENSE2, tp=4), compat="vllm")) == (2, 1, 1)


def test_vllm_head_sharded_reads_from_more_ranks_need_equal_blocks() -> None:
    # D TP 1 block 8 reading P TP 2 block 4: bsr 2, ratio -2, heads 4 vs 2 per rank
    refused(
        UnsupportedError,
        "block_size",
        lambda: check_pair(geo(DENSE4, block=8), geo(DENSE4, tp=2), compat="vllm"),
        local=8,
        remote=4,
    )
    assert ratios(check_pair(geo(DENSE4, block=8), geo(DENSE4, tp=2))) == (-2, 2, 1)
    assert ratios(check_pair(geo(DENSE4, tp=2, block=8), geo(DENSE4), compat="vllm")) == (2, 2, 1)
    assert ratios(check_pair(geo(DENSE4), geo(DENSE4, tp=2), compat="vllm")) == (-2, 1, 1)
    assert ratios(check_pair(geo(MLA, block=8), geo(MLA, tp=2), compat="vllm")) == (-2, 2, 1)


def test_push_of_larger_head_major_blocks_is_refused() -> None:
    # P block 8 pushes into D block 4: bsr 2, head-major pages of 4 heads
    for compat in ("vllm", "kvgeom"):
        refused(
            UnsupportedError,
            "block_size",
            lambda compat=compat: check_pair(geo(DENSE4, block=8), geo(DENSE4), mode="push", compat=compat),
            local=8,
            remote=4,
        )
    assert ratios(check_pair(geo(DENSE4, block=8), geo(DENSE4), mode="pull")) == (1, 2, 1)
    # 2 heads per rank (TP 2 both sides) interleave too
    refused(
        UnsupportedError,
        "block_size",
        lambda: check_pair(geo(DENSE4, tp=2, block=8), geo(DENSE4, tp=2), mode="push"),
        local=8,
        remote=4,
    )
    assert ratios(check_pair(geo(DENSE4, tp=4, block=8), geo(DENSE4, tp=4), mode="push")) == (1, 2, 1)
    tm = {"kv_layout": "token_major"}
    assert ratios(check_pair(geo(DENSE4, block=8, **tm), geo(DENSE4, **tm), mode="push")) == (1, 2, 1)
    assert ratios(check_pair(geo(MLA, block=8), geo(MLA), mode="push")) == (1, 2, 1)
    assert ratios(check_pair(geo(DENSE4), geo(DENSE4), mode="push")) == (1, 1, 1)
    # a draft under MLA: its head-major pages count
    refused(
        UnsupportedError,
        "block_size",
        lambda: check_pair(geo(DRAFT, block=8), geo(DRAFT), mode="push"),
        local=8,
        remote=4,
    )


def test_csa_linear_tp_layout() -> None:
    check_csa_linear_tp_layout(1, 2, 4)  # both below 4 heads
    check_csa_linear_tp_layout(4, 8, 4)  # both at or above
    refused(IncompatiblePairError, "tp_size", lambda: check_csa_linear_tp_layout(2, 4, 4), local=2, remote=4)
    refused(IncompatiblePairError, "tp_size", lambda: check_csa_linear_tp_layout(4, 2, 4), local=4, remote=2)
    refused(IncompatiblePairError, "tp_size", lambda: check_csa_linear_tp_layout(8, 3, 4), local=8, remote=3)


# ---- drafts --------------------------------------------------------------------------------------------


def test_vllm_drafts_need_local_tp_at_least_remote() -> None:
    refused(
        UnsupportedError,
        "tp_size",
        lambda: check_pair(geo(DRAFT), geo(DRAFT, tp=2), compat="vllm"),
        local=1,
        remote=2,
    )
    refused(
        UnsupportedError,
        "tp_size",
        lambda: check_pair(geo(DRAFT, tp=2), geo(DRAFT), mode="push", compat="vllm"),
        local=2,
        remote=1,
    )
    assert ratios(check_pair(geo(DRAFT, tp=2), geo(DRAFT), compat="vllm")) == (2, 1, 1)
    assert ratios(check_pair(geo(DRAFT, tp=2), geo(DRAFT, tp=2), mode="push", compat="vllm")) == (1, 1, 1)
    assert ratios(check_pair(geo(DRAFT), geo(DRAFT, tp=2))) == (-2, 1, 1)


def test_vllm_draft_head_split_needs_head_major() -> None:
    tm = {"kv_layout": "token_major"}
    refused(
        IncompatiblePairError,
        "kv_layout",
        lambda: check_pair(geo(DRAFT, tp=2, **tm), geo(DRAFT, **tm), compat="vllm"),
        local="token_major",
        remote="token_major",
    )
    assert ratios(check_pair(geo(DRAFT, tp=2, **tm), geo(DRAFT, tp=2, **tm), compat="vllm")) == (1, 1, 1)


def test_vllm_draft_block_ratio_on_head_major_pages() -> None:
    refused(
        UnsupportedError,
        "block_size",
        lambda: check_pair(geo(DRAFT, block=8), geo(DRAFT), compat="vllm"),
        local=8,
        remote=4,
    )
    # 2 draft heads per rank (TP 2 both sides): still interleaved
    refused(
        UnsupportedError,
        "block_size",
        lambda: check_pair(geo(DRAFT, tp=2, block=8), geo(DRAFT, tp=2), compat="vllm"),
        local=8,
        remote=4,
    )
    # one draft head per rank (4 heads at TP 4): nothing to interleave
    assert ratios(check_pair(geo(DRAFT, tp=4, block=8), geo(DRAFT, tp=4), compat="vllm")) == (1, 2, 1)
    tm = {"kv_layout": "token_major"}
    assert ratios(check_pair(geo(DRAFT, block=8, **tm), geo(DRAFT, **tm), compat="vllm")) == (1, 2, 1)
    assert ratios(check_pair(geo(DRAFT, block=8), geo(DRAFT))) == (1, 2, 1)


# ---- regions grouped differently ------------------------------------------------------------------------


MLA4 = ModelSpec.from_layers("mla", [MLASpec(8, "float16")] * 4)
SEP = {"separate_group": ("layers.1.attn", "layers.3.attn")}


def test_regions_grouped_differently() -> None:
    assert ratios(check_pair(geo(MLA4), geo(MLA4, **SEP), compat="vllm")) == (1, 1, 1)
    assert ratios(check_pair(geo(MLA4), geo(MLA4, **SEP))) == (1, 1, 1)
    refused(
        UnsupportedError,
        "separate_group",
        lambda: check_pair(geo(MLA4), geo(MLA4, **SEP), mode="push"),
        local=[],
        remote=["layers.1.attn", "layers.3.attn"],
    )
    refused(
        UnsupportedError,
        "block_size",
        lambda: check_pair(geo(MLA4, block=8), geo(MLA4, **SEP)),
        local=8,
        remote=4,
    )
    # with DCP on either side (TP2 DCP2 against TP1: tp_ratio 2 from the sharded side, -2 towards it)
    for compat in ("vllm", "kvgeom"):
        assert ratios(check_pair(geo(MLA4, tp=2, dcp_size=2), geo(MLA4, **SEP), compat=compat)) == (2, 1, 1)
        assert ratios(check_pair(geo(MLA4), geo(MLA4, tp=2, dcp_size=2, **SEP), compat=compat)) == (-2, 1, 1)
        assert ratios(check_pair(geo(MLA4, tp=2, dcp_size=2, **SEP), geo(MLA4), compat=compat)) == (2, 1, 1)
    # vLLM refuses DCP region pulls unless every logical block is one kernel block (ppl 1) on both sides
    ppl2 = {"block": 8, "kernel_block_size": 4}
    for local, remote, ppls in (
        (geo(MLA4, tp=2, dcp_size=2, **ppl2), geo(MLA4, **SEP), (2, 1)),  # local DCP, local ppl 2
        (geo(MLA4), geo(MLA4, tp=2, dcp_size=2, **ppl2, **SEP), (1, 2)),  # remote DCP, remote ppl 2
    ):
        refused(
            UnsupportedError,
            "kernel_block_size",
            lambda local=local, remote=remote: check_pair(local, remote, compat="vllm"),
            local=ppls[0],
            remote=ppls[1],
        )
        assert ratios(check_pair(local, remote))[1:] == (1, 1)  # kvgeom mode plans it
    assert ratios(check_pair(geo(MLA4, **ppl2), geo(MLA4, **SEP), compat="vllm")) == (1, 1, 1)  # no DCP
    # a region viewed by both of D's groups (group id -1): no page position to pair it by with DCP (vLLM raises
    # NotImplementedError); without DCP vllm mode end-trims it
    sep = geo(MLA4, **SEP)
    regions = list(sep.regions)
    regions[0] = replace(regions[0], members=((0, "layers.0.attn"), (1, "layers.1.attn")))
    shared = replace(sep, regions=tuple(regions))
    for local, remote, ids in (
        (geo(MLA4, tp=2, dcp_size=2), shared, ([0] * 4, [-1, 1, 0, 1])),
        (shared, geo(MLA4, tp=2, dcp_size=2), ([-1, 1, 0, 1], [0] * 4)),
    ):
        refused(
            UnsupportedError,
            "separate_group",
            lambda local=local, remote=remote: check_pair(local, remote, compat="vllm"),
            local=ids[0],
            remote=ids[1],
        )
    assert ratios(check_pair(geo(MLA4), shared, compat="vllm")) == (1, 1, 1)
    d4 = ModelSpec.from_layers("d4", [AttentionSpec(4, 2, "float16")] * 4)
    refused(
        UnsupportedError,
        "separate_group",
        lambda: check_pair(geo(d4), geo(d4, **SEP), compat="vllm"),
        value="d4",
    )
    assert ratios(check_pair(geo(d4), geo(d4, **SEP))) == (1, 1, 1)


# ---- SSM -------------------------------------------------------------------------------------------------


def test_conv_layouts() -> None:
    refused(
        IncompatiblePairError,
        "conv_layout",
        lambda: check_pair(geo(MAMBA1), geo(MAMBA1, conv_layout="SD")),
        local="DS",
        remote="SD",
    )
    sd = {"conv_layout": "SD"}
    assert ratios(check_pair(geo(MAMBA1, **sd), geo(MAMBA1, **sd))) == (1, 1, 1)
    refused(
        IncompatiblePairError,
        "conv_layout",
        lambda: check_pair(geo(MAMBA1, tp=2, **sd), geo(MAMBA1, **sd)),
        local="SD",
        remote="SD",
    )
    assert ratios(check_pair(geo(MAMBA1, tp=2), geo(MAMBA1))) == (2, 1, 1)


# ---- MLA + SSM hybrids, and region lengths -------------------------------------------------------------

# MLA latent 2 fp16 = 4 B per token; a KDA state that fits one 16-token (64 B) page
MK = ModelSpec.from_layers(
    "mla-kda",
    [MLASpec(2, "float16"), MambaSpec.kda(num_heads=2, head_dim=2, conv_kernel=2, conv_dtype="float16")],
)


@pytest.mark.parametrize("compat", ["vllm", "kvgeom"])
def test_mla_ssm_hybrids_pair_non_dividing_kernel_blocks_in_pulls(compat: str) -> None:
    def pair(lk: int, rk: int) -> tuple[int, int, int]:
        local = geo(MK, block=max(lk, 16), kernel_block_size=lk)
        remote = geo(MK, block=max(rk, 16), kernel_block_size=rk)
        return ratios(check_pair(local, remote, compat=compat))

    assert pair(16, 8) == (1, 2, 1)  # 16 % 8 == 0: bsr 2
    assert pair(8, 16) == (1, 1, 2)  # gcd 8: 1 local unit, remote blocks in 2
    assert pair(24, 16) == (1, 3, 2)  # gcd 8: 3 local units, remote blocks in 2
    assert pair(16, 24) == (1, 2, 3)  # gcd 8: 2 local units, remote blocks in 3
    refused(
        RatioError,
        "block_size",
        lambda: check_pair(geo(MK, block=16), geo(MK, block=24), mode="push", compat=compat),
        local=16,
        remote=24,
    )


def _lie(g: RankGeometry, region: int, block_len: int) -> RankGeometry:
    """A remote rank whose region ``region`` advertises another length than its spec gives."""
    regions = list(g.regions)
    regions[region] = replace(regions[region], block_len=block_len)
    return replace(g, regions=tuple(regions))


@pytest.mark.parametrize("compat", ["vllm", "kvgeom"])
def test_region_lengths_must_follow_the_spec(compat: str) -> None:
    # D TP 1 (4 heads, 128 B) against P TP 2: P's page should be 128 * 2 // 4 = 64 B
    err = refused(
        IncompatiblePairError,
        "regions[0].block_len",
        lambda: check_pair(geo(DENSE4), _lie(geo(DENSE4, tp=2), 0, 32), compat=compat),
        local=128,
        remote=32,
    )
    assert "should be 64 B" in str(err)
    # a replicated latent: the same 64 B
    refused(
        IncompatiblePairError,
        "regions[1].block_len",
        lambda: check_pair(geo(MLA), _lie(geo(MLA), 1, 32), compat=compat),
        local=64,
        remote=32,
    )
    # MLA + SSM: lengths match up to the block ratio (local 64 B = remote 32 B x bsr 2)
    refused(
        IncompatiblePairError,
        "regions[0].block_len",
        lambda: check_pair(
            geo(MK, block=16), _lie(geo(MK, block=16, kernel_block_size=8), 0, 16), compat=compat
        ),
        local=64,
        remote=16,
    )
    err = refused(
        IncompatiblePairError,
        "regions[0].block_len",
        lambda: check_pair(geo(MK, block=16), _lie(geo(MK, block=16), 0, 32), compat=compat),
        local=64,
        remote=32,
    )


def _mamba2_hybrid(n_groups: int) -> ModelSpec:
    return ModelSpec.from_layers(
        f"mamba2-{n_groups}g",
        [
            AttentionSpec(2, 2, "float16"),
            MambaSpec.mamba2(
                num_heads=2, head_dim=2, n_groups=n_groups, state_size=2, conv_kernel=2, conv_dtype="float16"
            ),
        ],
    )


def _hybrid_pair(model: ModelSpec, local_tp: int, remote_tp: int) -> tuple[RankGeometry, RankGeometry]:
    from kvgeom.layout.geometry import align_hybrid_block_size

    lb, rb = align_hybrid_block_size(model, local_tp, 4), align_hybrid_block_size(model, remote_tp, 4)
    return geo(model, tp=local_tp, block=lb), geo(model, tp=remote_tp, block=rb)


def test_replicated_conv_pieces_across_tp_sizes() -> None:
    # one group at TP 2: B and C are whole on both remote ranks (2 ranks > 1 group), x is split
    one = _mamba2_hybrid(1)
    for local_tp, remote_tp in ((1, 2), (2, 1)):
        local, remote = _hybrid_pair(one, local_tp, remote_tp)
        err = refused(
            UnsupportedError,
            "tp_size",
            lambda local=local, remote=remote: check_pair(local, remote, compat="vllm"),
            local=local_tp,
            remote=remote_tp,
        )
        assert "conv pieces ['B', 'C']" in str(err)
        assert check_pair(local, remote).tp_ratio in (2, -2)  # kvgeom plans it
    # two groups at TP 2: nothing replicated, vLLM's scaling is right
    two = _mamba2_hybrid(2)
    local, remote = _hybrid_pair(two, 1, 2)
    assert check_pair(local, remote, compat="vllm").tp_ratio == -2
    # equal TP: no rule on replication
    local, remote = _hybrid_pair(one, 2, 2)
    assert ratios(check_pair(local, remote, compat="vllm")) == (1, 1, 1)


def test_mamba_prefix_caching_with_equal_ppl_pairs() -> None:
    h = geo(HYBRID, block=8)
    assert ratios(check_pair(h, h, prefix_caching=True)) == (1, 1, 1)
    assert ratios(check_pair(h, h, compat="vllm", prefix_caching=True)) == (1, 1, 1)


def test_a_model_difference_names_keys_of_either_spec() -> None:
    # attention against MLA: sorted keys dtype (equal), head_size (only the attention spec has it)
    a = ModelSpec.from_layers("m", [AttentionSpec(4, 2, "float16")])
    b = ModelSpec.from_layers("m", [MLASpec(8, "float16")])
    err = refused(IncompatiblePairError, "model", lambda: check_pair(geo(a), geo(b)), local="m", remote="m")
    assert "model.layers[0].spec.head_size: 2 vs None" in str(err)
    err = refused(IncompatiblePairError, "model", lambda: check_pair(geo(b), geo(a)), local="m", remote="m")
    assert "model.layers[0].spec.head_size: None vs 2" in str(err)


def test_vllm_cuts_a_block_into_at_most_128_pieces_on_either_side() -> None:
    def shape(lk: int, rk: int, compat: str) -> tuple[int, int, int]:
        return ratios(check_pair(geo(MK, block=lk), geo(MK, block=rk), compat=compat))

    # gcd(1024, 24) = 8: 128 local units, remote blocks in 3 (at the limit)
    assert shape(1024, 24, "vllm") == (1, 128, 3)
    # gcd(24, 1024) = 8: 3 local units, remote blocks in 128 (at the limit)
    assert shape(24, 1024, "vllm") == (1, 3, 128)
    # 129 pieces on either side: vllm refuses, kvgeom splits
    for lk, rk in ((1032, 16), (16, 1032)):
        refused(RatioError, "block_size", lambda lk=lk, rk=rk: shape(lk, rk, "vllm"), local=lk, remote=rk)
    assert shape(1032, 16, "kvgeom") == (1, 129, 2)
    assert shape(16, 1032, "kvgeom") == (1, 2, 129)


def test_ratios_are_ints() -> None:
    got = [
        *block_size_ratio(geo(DENSE4, block=8), geo(DENSE4), "pull"),
        *block_size_ratio(geo(MLA), geo(MLA, block=6), "pull", "kvgeom"),
        *ratios(check_pair(geo(MK, block=24), geo(MK, block=16))),
    ]
    assert got == [2, 1, 2, 3, 1, 3, 2] and all(isinstance(v, int) for v in got)


def test_mla_ssm_hybrids_need_equal_dcp_sizes() -> None:
    for (ltp, ldcp), (rtp, rdcp) in (((2, 2), (1, 1)), ((1, 1), (2, 2))):
        refused(
            IncompatiblePairError,
            "dcp_size",
            lambda ltp=ltp, ldcp=ldcp, rtp=rtp, rdcp=rdcp: check_pair(
                geo(MK, tp=ltp, dcp_size=ldcp, block=16), geo(MK, tp=rtp, dcp_size=rdcp, block=16)
            ),
            local=ldcp,
            remote=rdcp,
        )
    assert ratios(check_pair(geo(MK, tp=2, dcp_size=2, block=16), geo(MK, tp=2, dcp_size=2, block=16))) == (
        1,
        1,
        1,
    )


def test_regions_grouped_differently_on_either_side() -> None:
    # the local side keeps layers 1 and 3 apart: planned in kvgeom mode and in vllm mode (pure MLA)
    for compat in ("vllm", "kvgeom"):
        assert ratios(check_pair(geo(MLA4, **SEP), geo(MLA4), compat=compat)) == (1, 1, 1)
    # a draft under MLA: vLLM pairs differently grouped regions only for pure MLA models
    sep = {"separate_group": ("layers.2.attn", "layers.3.attn")}
    refused(
        UnsupportedError,
        "separate_group",
        lambda: check_pair(geo(DRAFT), geo(DRAFT, **sep), compat="vllm"),
        value="mla+draft",
    )
    assert ratios(check_pair(geo(DRAFT), geo(DRAFT, **sep))) == (1, 1, 1)


def test_remote_blocks_split_only_into_abutting_equal_pieces() -> None:
    # MLA kernel 4 against 6 (gcd 2: remote blocks in 3 pieces). The remote's 96 B pages (6 tokens x 16 B)
    # abut and cut in 3; a padded stride or a length not divisible by 3 does not split
    local, remote = geo(MLA), geo(MLA, block=6)
    assert block_size_ratio(local, remote, "pull", "kvgeom") == (2, 3)

    def with_region0(**kw: int) -> RankGeometry:
        regions = list(remote.regions)
        regions[0] = replace(regions[0], **kw)
        return replace(remote, regions=tuple(regions))

    for bad in (with_region0(block_stride=112), with_region0(block_len=97, block_stride=97)):
        refused(
            RatioError,
            "block_size",
            lambda bad=bad: block_size_ratio(local, bad, "pull", "kvgeom"),
            local=4,
            remote=6,
        )


def test_csa_linear_pairs_across_the_kv_head_count_name_tp_size() -> None:
    from kvgeom.pair.rules import check_csa_linear_tp_layout

    with pytest.raises(IncompatiblePairError) as err:  # 2 KV heads: TP1 shards them, TP4 replicates
        check_csa_linear_tp_layout(1, 4, 2)
    assert err.value.field == "tp_size"
