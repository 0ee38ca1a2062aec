"""kvgeom.compat.vllm.advertised, rule by rule: every refusal's class, field and values, and acceptance right at each
boundary (issue 12: the mutation score of the handshake rules on advertised numbers).

Pages here are ``block tokens x heads per rank x 8 bytes``; expected lengths are derived in comments."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pytest

from kvgeom.compat.vllm.advertised import Advertised, AdvertisedPair, LocalFacts, check_advertised_pair
from kvgeom.errors import IncompatiblePairError, KvgeomError, RatioError, UnsupportedError

B = 8  # bytes per token-head


def side(tp: int = 1, hpr: int = 8, block: int = 16, regions: int = 2, **kw: Any) -> Advertised:
    page = block * hpr * B
    return Advertised(
        tp_size=tp,
        block_size=block,
        num_blocks=10,
        block_lens=(page,) * regions,
        block_strides=(page,) * regions,
        kv_layout="LBHNC",
        **kw,
    )


def facts(regions: int = 2, heads: int = 8, **kw: Any) -> LocalFacts:
    base: dict[str, Any] = dict(is_mla=False, has_ssm=False)
    return LocalFacts(total_kv_heads=heads, regions=tuple(range(regions)), **{**base, **kw})


def mla_side(tp: int = 1, block: int = 16, regions: int = 1, **kw: Any) -> Advertised:
    return side(tp=tp, hpr=1, block=block, regions=regions, **kw)  # a latent page: one "head"


def mla_facts(regions: int = 1, **kw: Any) -> LocalFacts:
    return facts(regions=regions, heads=1, **{"is_mla": True, **kw})


def refused(cls: type[KvgeomError], field: str, fn: Callable[[], object], **values: object) -> KvgeomError:
    with pytest.raises(KvgeomError) as info:
        fn()
    err = info.value
    assert type(err) is cls, (type(err), err)
    assert err.field == field, err
    assert err.values == values, err.values
    return err


def pair(local: Advertised, remote: Advertised, f: LocalFacts) -> tuple[int, int, bool, bool]:
    p = check_advertised_pair(local, remote, f)
    assert isinstance(p, AdvertisedPair)
    return (p.tp_ratio, p.bsr, p.permute_local_kv, p.heterogeneous_attn)


# ---- context parallelism -------------------------------------------------------------------------------


def test_dcp_sizes_that_divide_pair_either_way_without_ssm() -> None:
    # local PCP 1 and remote PCP 1 are passed: DCP 1 against DCP 2 is fine both ways
    assert pair(mla_side(dcp_size=1), mla_side(dcp_size=2), mla_facts()) == (1, 1, False, False)
    assert pair(mla_side(dcp_size=2), mla_side(dcp_size=1), mla_facts()) == (1, 1, False, False)


def test_dcp_sizes_that_do_not_divide_are_refused() -> None:
    refused(
        IncompatiblePairError,
        "dcp_size",
        lambda: check_advertised_pair(mla_side(dcp_size=2), mla_side(dcp_size=3), mla_facts()),
        local=2,
        remote=3,
    )


def test_mamba_hybrids_need_equal_dcp_sizes() -> None:
    f = mla_facts(has_ssm=True)
    refused(
        IncompatiblePairError,
        "dcp_size",
        lambda: check_advertised_pair(mla_side(dcp_size=2), mla_side(dcp_size=1), f),
        local=2,
        remote=1,
    )
    assert pair(mla_side(dcp_size=2), mla_side(dcp_size=2), f) == (1, 1, False, False)


# ---- replicated remote KV -------------------------------------------------------------------------------


def test_fewer_ranks_cannot_read_replicated_heads() -> None:
    # 2 KV heads: remote TP 4 replicates them (4 > 2), local TP 2 reads with ratio -2
    refused(
        IncompatiblePairError,
        "tp_size",
        lambda: check_advertised_pair(side(tp=2, hpr=1), side(tp=4, hpr=1), facts(heads=2)),
        local=2,
        remote=4,
    )


def test_remote_tp_equal_to_the_heads_is_not_replicated() -> None:
    # 4 heads, remote TP 4: one head per rank (4 > 4 is false); local TP 2 holds 2 heads per rank.
    # ratio -2, bsr 1: remote length = local 2*16*8 * 1 // 2 = 16*8
    assert pair(side(tp=2, hpr=2), side(tp=4, hpr=1), facts(heads=4)) == (-2, 1, False, False)


def test_replicated_remote_is_readable_by_mla_ssm_equal_or_more_ranks() -> None:
    # MLA: latents are replicated anyway
    assert pair(mla_side(tp=2), mla_side(tp=4), mla_facts())[0] == -2
    # SSM hybrids skip the rule (their lengths are not checked here)
    assert pair(side(tp=2, hpr=1), side(tp=4, hpr=1), facts(heads=2, has_ssm=True))[0] == -2
    # equal TP 4 with 2 heads: replicated, ratio 1; replicated region lengths match as they are
    assert pair(side(tp=4, hpr=1), side(tp=4, hpr=1), facts(heads=2)) == (1, 1, False, False)
    # local TP 8 reading remote TP 4 (both replicate 2 heads): ratio 2, replicated lengths equal
    assert pair(side(tp=8, hpr=1), side(tp=4, hpr=1), facts(heads=2)) == (2, 1, False, False)


# ---- a head-sharded draft under an MLA target ----------------------------------------------------------


def draft_facts(**kw: Any) -> LocalFacts:
    # region 0: the MLA latent, region 1: the draft's KV (8 heads)
    return mla_facts(regions=2, draft_regions=frozenset({1}), draft_kv_heads=8, **kw)


def draft_side(tp: int, dcp: int = 1, layout: str = "LBHNC") -> Advertised:
    latent, draft = 16 * 1 * B, 16 * (8 // tp) * B
    return Advertised(
        tp_size=tp,
        block_size=16,
        num_blocks=10,
        block_lens=(latent, draft),
        block_strides=(latent, draft),
        kv_layout=layout,
        dcp_size=dcp,
    )


def test_draft_heads_scale_region_lengths() -> None:
    # local TP 2 holds 4 draft heads, remote TP 1 holds 8: remote draft length = 16*4*8 * 8 // 4 = 16*8*8
    assert pair(draft_side(2), draft_side(1), draft_facts()) == (2, 1, False, False)
    # without draft heads given, the draft has one head: one per rank on both sides, lengths equal
    one = replace(draft_facts(), draft_kv_heads=None)
    d = replace(draft_side(2), block_lens=(16 * B, 16 * B), block_strides=(16 * B, 16 * B))
    assert pair(d, d, one) == (1, 1, False, False)
    assert pair(d, replace(d, tp_size=1), one) == (2, 1, False, False)
    # a wrong draft length names the remote region index
    bad = replace(draft_side(1), block_lens=(16 * B, 16 * 4 * B))
    refused(
        IncompatiblePairError,
        "block_lens[1]",
        lambda: check_advertised_pair(draft_side(2), bad, draft_facts()),
        local=16 * 4 * B,
        remote=16 * 4 * B,
    )


def test_draft_needs_local_tp_at_least_remote_and_no_dcp() -> None:
    refused(
        UnsupportedError,
        "tp_size",
        lambda: check_advertised_pair(draft_side(1), draft_side(2), draft_facts()),
        local=(1, 1),
        remote=(2, 1),
    )
    refused(
        UnsupportedError,
        "tp_size",
        lambda: check_advertised_pair(draft_side(2, dcp=2), draft_side(2), draft_facts()),
        local=(2, 2),
        remote=(2, 1),
    )
    refused(
        UnsupportedError,
        "tp_size",
        lambda: check_advertised_pair(draft_side(2), draft_side(2, dcp=2), draft_facts()),
        local=(2, 1),
        remote=(2, 2),
    )
    assert pair(draft_side(2), draft_side(2), draft_facts()) == (1, 1, False, False)


def test_push_writes_a_draft_only_at_equal_tp() -> None:
    push = draft_facts(mode="push")
    refused(
        UnsupportedError,
        "tp_size",
        lambda: check_advertised_pair(draft_side(2), draft_side(1), push),
        local=2,
        remote=1,
    )
    assert pair(draft_side(2), draft_side(2), push) == (1, 1, False, False)


def test_draft_head_split_needs_the_same_block_contiguous_layout() -> None:
    # draft heads differ per rank (4 vs 8): layouts must be equal and block-contiguous
    refused(
        IncompatiblePairError,
        "kv_layout",
        lambda: check_advertised_pair(draft_side(2), draft_side(1, layout="LBNHC"), draft_facts()),
        local="LBHNC",
        remote="LBNHC",
    )
    refused(
        IncompatiblePairError,
        "kv_layout",
        lambda: check_advertised_pair(draft_side(2), draft_side(1), draft_facts(block_contiguous=False)),
        local="LBHNC",
        remote="LBHNC",
    )
    # equal draft heads per rank (TP 2 both): any layouts
    assert pair(draft_side(2), draft_side(2, layout="LBNHC"), draft_facts(block_contiguous=False))[0] == 1


# ---- DCP across different cache-group layouts -----------------------------------------------------------


def dcp_groups(**kw: Any) -> LocalFacts:
    return mla_facts(region_group_ids=(0, 1), paired_remote_group_ids=(1, 0), regions=2, **kw)


@pytest.mark.parametrize("ld,rd,lp,rp", [(2, 2, 2, 1), (2, 2, 1, 2), (2, 1, 2, 1), (1, 2, 1, 2)])
def test_dcp_across_group_layouts_needs_one_kernel_block_per_block(
    ld: int, rd: int, lp: int, rp: int
) -> None:
    local, remote = mla_side(regions=2, dcp_size=ld, ppl=lp), mla_side(regions=2, dcp_size=rd, ppl=rp)
    refused(
        UnsupportedError,
        "ppl",
        lambda: check_advertised_pair(local, remote, dcp_groups()),
        local=lp,
        remote=rp,
    )


def test_dcp_across_group_layouts_acceptances() -> None:
    two = mla_side(regions=2, dcp_size=2, ppl=2)
    # one kernel block per block on both sides
    assert pair(mla_side(regions=2, dcp_size=2), mla_side(regions=2, dcp_size=2), dcp_groups())[0] == 1
    # no DCP
    assert pair(mla_side(regions=2, ppl=2), mla_side(regions=2, ppl=2), dcp_groups())[0] == 1
    # the same group layout
    same = mla_facts(region_group_ids=(0, 1), paired_remote_group_ids=(0, 1), regions=2)
    assert pair(two, two, same)[0] == 1
    # no group ids known
    assert pair(two, two, mla_facts(paired_remote_group_ids=(1, 0), regions=2))[0] == 1


# ---- Mamba prefix caching, host buffer -----------------------------------------------------------------


def test_mamba_prefix_caching_needs_equal_ppl() -> None:
    f = facts(has_ssm=True, prefix_caching=True)
    refused(
        IncompatiblePairError,
        "ppl",
        lambda: check_advertised_pair(side(ppl=2), side(ppl=4), f),
        local=2,
        remote=4,
    )
    assert pair(side(ppl=2), side(ppl=2), f)[0] == 1
    assert pair(side(ppl=2), side(ppl=4), facts(has_ssm=True))[0] == 1
    assert pair(side(ppl=2), side(ppl=4), facts(prefix_caching=True))[0] == 1


def test_host_buffer_needs_equal_block_sizes() -> None:
    # local block 32, remote 16: bsr 2; ratio 1, so remote length = 32*8*8 // 2 = 16*8*8
    refused(
        UnsupportedError,
        "block_size",
        lambda: check_advertised_pair(side(block=32), side(block=16), facts(host_buffer=True)),
        local=32,
        remote=16,
    )
    assert pair(side(block=32), side(block=16), facts()) == (1, 2, False, False)
    assert pair(side(), side(), facts(host_buffer=True)) == (1, 1, False, False)


def test_block_sizes_must_divide() -> None:
    refused(
        RatioError,
        "block_size",
        lambda: check_advertised_pair(side(block=16), side(block=32), facts()),
        local=16,
        remote=32,
    )


# ---- layouts ---------------------------------------------------------------------------------------------


def test_layouts_must_match_or_be_the_one_permute() -> None:
    nh, hn = replace(side(), kv_layout="LBNHC"), side()
    refused(
        IncompatiblePairError,
        "kv_layout",
        lambda: check_advertised_pair(nh, hn, facts()),
        local="LBNHC",
        remote="LBHNC",
    )
    # the permute goes only from a remote LBHNC into a local LBNHC
    refused(
        IncompatiblePairError,
        "kv_layout",
        lambda: check_advertised_pair(hn, nh, facts(permute_allowed=True)),
        local="LBHNC",
        remote="LBNHC",
    )
    other = replace(side(), kv_layout="XYZ")
    refused(
        IncompatiblePairError,
        "kv_layout",
        lambda: check_advertised_pair(nh, other, facts(permute_allowed=True)),
        local="LBNHC",
        remote="XYZ",
    )
    assert pair(nh, hn, facts(permute_allowed=True)) == (1, 1, True, False)
    refused(
        UnsupportedError,
        "kv_layout",
        lambda: check_advertised_pair(nh, hn, facts(permute_allowed=True, hma=True)),
        local="LBNHC",
        remote="LBHNC",
    )
    # MLA latents have no head layout to differ in
    assert pair(replace(mla_side(), kv_layout="LBNHC"), mla_side(), mla_facts()) == (1, 1, False, False)


def test_a_cpu_attention_backend_repacks_unless_hybrid() -> None:
    cpu, flash = side(attn_backend="CPU_ATTN"), side(attn_backend="FLASH_ATTN")
    assert pair(cpu, flash, facts()) == (1, 1, False, True)
    assert pair(flash, cpu, facts()) == (1, 1, False, False)
    assert pair(cpu, cpu, facts(hma=True)) == (1, 1, False, False)
    refused(
        UnsupportedError,
        "attn_backend",
        lambda: check_advertised_pair(cpu, flash, facts(hma=True)),
        local="CPU_ATTN",
        remote="FLASH_ATTN",
    )


def test_a_head_split_needs_a_block_contiguous_layout() -> None:
    nbc = facts(block_contiguous=False)
    # local TP 2 (4 heads per rank) against remote TP 1 (8): remote length = 16*4*8 * 8 // 4 = 16*8*8
    refused(
        IncompatiblePairError,
        "kv_layout",
        lambda: check_advertised_pair(side(tp=2, hpr=4), side(tp=1), nbc),
        local="LBHNC",
        remote="LBHNC",
    )
    # ratio -2 too (local TP 1 against remote TP 2)
    refused(
        IncompatiblePairError,
        "kv_layout",
        lambda: check_advertised_pair(side(tp=1), side(tp=2, hpr=4), nbc),
        local="LBHNC",
        remote="LBHNC",
    )
    assert pair(side(), side(), nbc)[0] == 1  # no head split at equal TP
    assert pair(side(tp=2, hpr=4), side(tp=1), facts())[0] == 2  # block-contiguous
    assert pair(mla_side(tp=2), mla_side(tp=1), mla_facts(block_contiguous=False))[0] == 2
    # a remote that replicates (2 heads, remote TP 4) read by more ranks (TP 8)
    assert pair(side(tp=8, hpr=1), side(tp=4, hpr=1), facts(heads=2, block_contiguous=False))[0] == 2
    # the permute makes the received cache block-contiguous
    nh = replace(side(tp=2, hpr=4), kv_layout="LBNHC")
    assert pair(nh, side(tp=1), facts(block_contiguous=False, permute_allowed=True)) == (2, 1, True, False)


def test_nvfp4_pages_cannot_be_resharded() -> None:
    refused(
        UnsupportedError,
        "tp_size",
        lambda: check_advertised_pair(side(tp=2, hpr=4), side(tp=1), facts(nvfp4=True)),
        local=2,
        remote=1,
    )
    assert pair(side(tp=2, hpr=4), side(tp=2, hpr=4), facts(nvfp4=True))[0] == 1
    assert pair(mla_side(tp=2), mla_side(tp=1), mla_facts(nvfp4=True))[0] == 2
    # 2 heads at TP 4 and TP 8: one head per rank on both sides (replicated), so no re-shard
    assert pair(side(tp=8, hpr=1), side(tp=4, hpr=1), facts(heads=2, nvfp4=True))[0] == 2


# ---- region lengths ------------------------------------------------------------------------------------


def test_hybrid_mla_lengths_match_up_to_the_block_ratio() -> None:
    f = mla_facts(regions=2, has_ssm=True)
    local = Advertised(
        tp_size=1, block_size=32, num_blocks=10, block_lens=(64, 96), block_strides=(64, 96), kv_layout="L"
    )
    remote = replace(local, block_size=16, block_lens=(32, 48), block_strides=(32, 48))
    assert pair(local, remote, f) == (1, 2, False, False)
    bad = replace(remote, block_lens=(32, 96), block_strides=(32, 96))
    refused(
        IncompatiblePairError,
        "block_lens",
        lambda: check_advertised_pair(local, bad, f),
        local=[64, 96],
        remote=[32, 96],
    )


def test_ssm_hybrids_without_mla_skip_the_length_rules() -> None:
    # lengths that fit no rule, and a remote region count other than the local one
    local = side(regions=2)
    remote = replace(side(regions=2), block_lens=(7, 9))
    assert pair(local, remote, facts(has_ssm=True)) == (1, 1, False, False)


def test_region_count_must_match() -> None:
    refused(
        IncompatiblePairError,
        "num_regions",
        lambda: check_advertised_pair(side(regions=3), side(regions=3), facts(regions=2)),
        local=2,
        remote=3,
    )


def test_region_lengths_follow_the_local_region_map() -> None:
    # remote region 0 pairs with local region 1 and vice versa; local lengths differ per region
    local = replace(side(), block_lens=(100, 200), block_strides=(100, 200))
    f = replace(facts(), regions=(1, 0))
    assert pair(local, replace(local, block_lens=(200, 100), block_strides=(200, 200)), f)[0] == 1
    refused(
        IncompatiblePairError,
        "block_lens[1]",
        lambda: check_advertised_pair(local, replace(local, block_lens=(200, 200)), f),
        local=100,
        remote=200,
    )


def test_replicated_regions_scale_by_the_block_ratio_only() -> None:
    # local TP 2 (4 heads) block 32 against remote TP 1 (8 heads) block 16: ratio 2, bsr 2.
    # region 0 replicated: 1000 // 2 = 500; region 1 split: 1000 * 8 // 4 // 2 = 1000
    f = facts(region_replicated=(True,))
    local = replace(side(tp=2, block=32), block_lens=(1000, 1000), block_strides=(1000, 1000))
    remote = replace(side(tp=1, block=16), block_lens=(500, 1000), block_strides=(500, 1000))
    assert pair(local, remote, f) == (2, 2, False, False)
    refused(
        IncompatiblePairError,
        "block_lens[0]",
        lambda: check_advertised_pair(local, replace(remote, block_lens=(1000, 1000)), f),
        local=1000,
        remote=1000,
    )
    # an explicit False is not replicated: region 0 wants 1000
    f2 = facts(region_replicated=(False, True))
    assert pair(local, replace(remote, block_lens=(1000, 500), block_strides=(1000, 500)), f2)[1] == 2


def test_split_lengths_by_ratio_and_block_ratio() -> None:
    # ratio 1, bsr 2: 16*32*8 // 2 == 16*16*8... with 8 heads both sides: want = L * 8 // 8 // 2
    assert pair(side(block=32), side(block=16), facts())[1] == 2
    # ratio -2, bsr 1: local TP 1 (8 heads) against TP 2 (4 heads): want = L * 4 // 8 (no bsr division)
    assert pair(side(tp=1), side(tp=2, hpr=4), facts()) == (-2, 1, False, False)
    # ratio 2, bsr 2: local TP 2 block 32 (4 heads) -> 32*4*8 * 8 // 4 // 2 = 32*4*8
    local = side(tp=2, hpr=4, block=32)
    remote = replace(side(tp=1, hpr=8, block=16))
    assert remote.block_lens[0] == local.block_lens[0]
    assert pair(local, remote, facts()) == (2, 2, False, False)
    # ratio -2 with bsr 2 on split regions: refused
    refused(
        UnsupportedError,
        "block_size",
        lambda: check_advertised_pair(side(tp=1, block=32), side(tp=2, hpr=4, block=16), facts()),
        local=32,
        remote=16,
    )
    # ... but replicated (MLA) regions only divide by bsr: 32*8 // 2 = 16*8
    assert pair(mla_side(tp=1, block=32), mla_side(tp=2, block=16), mla_facts()) == (-2, 2, False, False)


def test_a_wrong_split_length_names_both_lengths() -> None:
    # ratio 2, bsr 1: want = 16*4*8 * 8 // 4 = 1024; the remote advertises 512
    refused(
        IncompatiblePairError,
        "block_lens[0]",
        lambda: check_advertised_pair(side(tp=2, hpr=4), side(tp=1, hpr=4), facts()),
        local=512,
        remote=512,
    )


# ---- tables ----------------------------------------------------------------------------------------------


def test_every_remote_rank_advertises_the_first_block_count() -> None:
    refused(
        IncompatiblePairError,
        "num_blocks",
        lambda: check_advertised_pair(side(), replace(side(), num_blocks=11), facts(first_num_blocks=10)),
        local=10,
        remote=11,
    )
    assert pair(side(), side(), facts(first_num_blocks=10))[0] == 1
    assert pair(side(), replace(side(), num_blocks=11), facts())[0] == 1


def test_one_base_address_per_local_region() -> None:
    refused(
        IncompatiblePairError,
        "kv_caches_base_addr",
        lambda: check_advertised_pair(side(), replace(side(), num_bases=3), facts()),
        local=2,
        remote=3,
    )
    # SSM hybrids skip the length rules, so the table rule sees 3 lengths for 2 regions
    refused(
        IncompatiblePairError,
        "kv_caches_base_addr",
        lambda: check_advertised_pair(side(), side(regions=3), facts(has_ssm=True)),
        local=2,
        remote=3,
    )
    # an explicit base count overrides the number of lengths
    page = 16 * 8 * B
    two_bases = replace(side(regions=3), num_bases=2, block_strides=(page, page))
    assert pair(side(), two_bases, facts(has_ssm=True))[0] == 1


@pytest.mark.parametrize(
    "name,good,bad",
    [
        ("region_num_blocks", (10, 10), (10,)),
        ("block_strides", (1024, 1024), (1024, 1024, 1024)),
        ("region_group_ids", (0, 0), (0,)),
        ("region_mem_types", ("DRAM", "DRAM"), ("DRAM",) * 3),
    ],
)
def test_per_region_tables_have_one_entry_per_region(name: str, good: tuple, bad: tuple) -> None:
    assert pair(side(), replace(side(), **{name: good}), facts())[0] == 1
    refused(
        IncompatiblePairError,
        name,
        lambda: check_advertised_pair(side(), replace(side(), **{name: bad}), facts()),
        local=2,
        remote=len(bad),
    )


def test_strides_no_shorter_than_lengths() -> None:
    page = 16 * 8 * B
    assert pair(side(), replace(side(), block_strides=(page, page + 1)), facts())[0] == 1
    refused(
        IncompatiblePairError,
        "block_strides[1]",
        lambda: check_advertised_pair(side(), replace(side(), block_strides=(page, page - 1)), facts()),
        local=page,
        remote=page - 1,
    )
    three = side(regions=3)
    refused(
        IncompatiblePairError,
        "block_strides[0]",
        lambda: check_advertised_pair(
            three, replace(three, block_strides=(page - 2, page, page - 1)), facts(regions=3)
        ),
        local=page,
        remote=page - 2,
    )


def test_region_names_must_agree_when_both_are_known() -> None:
    names = ("k", "v")
    refused(
        IncompatiblePairError,
        "region_names",
        lambda: check_advertised_pair(
            side(), replace(side(), region_names=("v", "k")), facts(expected_region_names=names)
        ),
        local=["k", "v"],
        remote=["v", "k"],
    )
    assert pair(side(), replace(side(), region_names=names), facts(expected_region_names=names))[0] == 1
    assert pair(side(), side(), facts(expected_region_names=names))[0] == 1
    assert pair(side(), replace(side(), region_names=("x", "y")), facts())[0] == 1


def test_expected_lengths_use_integer_division() -> None:
    # vLLM compares with integer division: a replicated 1001-byte page at bsr 2 wants 1001 // 2 = 500
    local = replace(mla_side(block=32), block_lens=(1001,), block_strides=(1001,))
    remote = replace(mla_side(block=16), block_lens=(500,), block_strides=(500,))
    assert pair(local, remote, mla_facts()) == (1, 2, False, False)
    # split: 3 KV heads, local TP 3 (1 head) against remote TP 1 (3 heads), bsr 2: 101 * 3 // 1 // 2 = 151
    local = replace(side(tp=3, hpr=1, block=32, regions=1), block_lens=(101,), block_strides=(101,))
    remote = replace(side(tp=1, hpr=3, block=16, regions=1), block_lens=(151,), block_strides=(151,))
    assert pair(local, remote, facts(regions=1, heads=3)) == (3, 2, False, False)
