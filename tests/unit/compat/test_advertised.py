"""kvgeom.compat.vllm.advertised: vLLM 0.33.0's handshake rules on the numbers a peer advertises (no card)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pytest

from kvgeom.compat.vllm.advertised import Advertised, AdvertisedPair, LocalFacts, check_advertised_pair
from kvgeom.errors import IncompatiblePairError, KvgeomError, RatioError, UnsupportedError

PAGE = 16 * 8 * 256  # 16 tokens x 8 heads x 256 bytes per token-head


def side(tp: int = 1, heads_per_rank: int = 8, block: int = 16, regions: int = 4, **kw: object) -> Advertised:
    page = block * heads_per_rank * 256
    return Advertised(
        tp_size=tp,
        block_size=block,
        num_blocks=32,
        block_lens=(page,) * regions,
        block_strides=(page,) * regions,
        kv_layout="LBHNC",
        **kw,
    )  # type: ignore[arg-type]


def facts(regions: int = 4, heads: int = 8, **kw: object) -> LocalFacts:
    base: dict[str, object] = dict(is_mla=False, has_ssm=False, first_num_blocks=32)
    return LocalFacts(total_kv_heads=heads, regions=tuple(range(regions)), **{**base, **kw})  # type: ignore[arg-type]


def test_equal_sides_pair_with_unit_ratios() -> None:
    pair = check_advertised_pair(side(), side(), facts())
    assert (pair.tp_ratio, pair.bsr, pair.permute_local_kv, pair.heterogeneous_attn) == (1, 1, False, False)


def test_split_regions_scale_with_the_heads_each_side_holds() -> None:
    # D TP2 holds 4 of 8 heads per rank; P TP1 holds 8: P's page is twice D's
    assert check_advertised_pair(side(tp=2, heads_per_rank=4), side(tp=1), facts()).tp_ratio == 2
    with pytest.raises(IncompatiblePairError) as info:
        check_advertised_pair(side(tp=2, heads_per_rank=4), side(tp=1, heads_per_rank=4), facts())
    assert info.value.field == "block_lens[0]" and info.value.values == {"local": 16384, "remote": 16384}
    assert info.value.field == "block_lens[0]" and info.value.values == {
        "local": PAGE // 2,
        "remote": PAGE // 2,
    }


def test_block_sizes_pair_by_their_ratio_and_refuse_otherwise() -> None:
    d, p = side(block=32), side(block=16)
    assert check_advertised_pair(d, p, facts()).bsr == 2
    with pytest.raises(RatioError) as exc:
        check_advertised_pair(side(block=16), side(block=32), facts())
    assert exc.value.field == "block_size" and exc.value.values == {"local": 16, "remote": 32}


def test_p_tp_above_d_tp_needs_equal_block_sizes_for_head_sharded_regions() -> None:
    d, p = side(tp=1, block=32), side(tp=2, heads_per_rank=4, block=16)
    with pytest.raises(UnsupportedError) as exc:
        check_advertised_pair(d, p, facts())
    assert exc.value.field == "block_size" and exc.value.values == {"local": 32, "remote": 16}
    # replicated (MLA) regions only need the block-size ratio
    mla = replace(facts(), is_mla=True, total_kv_heads=1)
    latent = Advertised(
        tp_size=1,
        block_size=32,
        num_blocks=32,
        block_lens=(32 * 576,),
        block_strides=(32 * 576,),
        kv_layout="LBHNC",
    )
    remote = replace(latent, tp_size=2, block_size=16, block_lens=(16 * 576,), block_strides=(16 * 576,))
    assert check_advertised_pair(latent, remote, replace(mla, regions=(0,))).bsr == 2


def test_fewer_ranks_cannot_read_a_remote_that_replicates_heads() -> None:
    with pytest.raises(IncompatiblePairError) as info:
        check_advertised_pair(side(tp=2, heads_per_rank=1), side(tp=4, heads_per_rank=1), facts(heads=2))
    assert info.value.field == "tp_size" and info.value.values == {"local": 2, "remote": 4}
    assert info.value.values == {"local": 2, "remote": 4}


def test_layouts_must_match_unless_the_permute_is_allowed() -> None:
    d, p = replace(side(), kv_layout="LBNHC"), side()
    with pytest.raises(IncompatiblePairError) as exc:
        check_advertised_pair(d, p, facts(block_contiguous=False))
    assert exc.value.field == "kv_layout" and exc.value.values == {"local": "LBNHC", "remote": "LBHNC"}
    pair = check_advertised_pair(d, p, facts(block_contiguous=False, permute_allowed=True))
    assert pair.permute_local_kv
    with pytest.raises(UnsupportedError) as exc:
        check_advertised_pair(d, p, facts(block_contiguous=False, permute_allowed=True, hma=True))
    assert exc.value.field == "kv_layout" and exc.value.values == {"local": "LBNHC", "remote": "LBHNC"}


def test_cpu_attention_backend_turns_on_repacking() -> None:
    d, p = replace(side(), attn_backend="CPU_ATTN"), replace(side(), attn_backend="FLASH_ATTN")
    assert check_advertised_pair(d, p, facts()).heterogeneous_attn


def test_context_parallel_and_draft_rules() -> None:
    with pytest.raises(IncompatiblePairError) as exc:
        check_advertised_pair(replace(side(), dcp_size=2), replace(side(), dcp_size=3), facts())
    assert exc.value.field == "dcp_size" and exc.value.values == {"local": 2, "remote": 3}
    mla = replace(
        facts(regions=1), is_mla=True, total_kv_heads=1, draft_regions=frozenset({0}), draft_kv_heads=8
    )
    d = Advertised(
        tp_size=1, block_size=16, num_blocks=32, block_lens=(PAGE,), block_strides=(PAGE,), kv_layout="LBHNC"
    )
    with pytest.raises(UnsupportedError) as exc:
        check_advertised_pair(
            d, replace(d, tp_size=2, block_lens=(PAGE // 2,), block_strides=(PAGE // 2,)), mla
        )
    assert exc.value.field == "tp_size" and exc.value.values == {"local": (1, 1), "remote": (2, 1)}
    with pytest.raises(UnsupportedError) as exc:
        check_advertised_pair(
            replace(d, tp_size=2, block_lens=(PAGE // 2,), block_strides=(PAGE // 2,)),
            d,
            replace(mla, mode="push"),
        )
    assert exc.value.field == "tp_size" and exc.value.values == {"local": 2, "remote": 1}


def test_mamba_prefix_caching_and_host_buffer_rules() -> None:
    ssm = facts(has_ssm=True, prefix_caching=True)
    with pytest.raises(IncompatiblePairError) as exc:
        check_advertised_pair(replace(side(), ppl=2), replace(side(), ppl=3), ssm)
    assert exc.value.field == "ppl" and exc.value.values == {"local": 2, "remote": 3}
    with pytest.raises(UnsupportedError) as exc:
        check_advertised_pair(side(block=32), side(block=16), facts(host_buffer=True))
    assert exc.value.field == "block_size" and exc.value.values == {"local": 32, "remote": 16}


@pytest.mark.parametrize(
    "change,field",
    [
        (dict(num_blocks=31), "num_blocks"),
        (dict(num_bases=3), "kv_caches_base_addr"),
        (dict(region_num_blocks=(32,) * 3), "region_num_blocks"),
        (dict(block_strides=(PAGE - 1,) + (PAGE,) * 3), "block_strides[0]"),
        (dict(region_names=("a", "b", "c", "e")), "region_names"),
        (dict(region_mem_types=("VRAM",)), "region_mem_types"),
    ],
)
def test_inconsistent_tables_are_refused_naming_the_field(change: dict, field: str) -> None:
    remote = replace(side(), **change)
    with pytest.raises(KvgeomError) as info:
        check_advertised_pair(side(), remote, facts(expected_region_names=("a", "b", "c", "d")))
    assert info.value.field == field


def test_shared_rows_must_start_each_region_at_the_same_row_byte() -> None:
    """Packed CSA-linear rows (a hybrid with a head-sharded main KV: SSM lengths are not compared): the GDN-only
    region starts at row byte 208 at TP2 and 104 at TP4 (docs/vllm-behaviour.md B.6.14); equal offsets pair."""
    ssm = facts(regions=6, heads=2, has_ssm=True)
    at_tp2 = (0, 1024, 512, 1280, 64, 208)
    at_tp4 = (0, 1024, 512, 1280, 64, 104)
    mine, theirs = side(tp=4, regions=6, row_offsets=at_tp4), side(tp=2, regions=6, row_offsets=at_tp2)
    with pytest.raises(UnsupportedError) as e:
        check_advertised_pair(mine, theirs, ssm)
    assert e.value.field == "regions[5].row_offset"
    assert (e.value.values["local"], e.value.values["remote"]) == (104, 208)
    assert check_advertised_pair(mine, replace(theirs, row_offsets=at_tp4), ssm).tp_ratio == 2


@pytest.mark.parametrize(("local", "remote"), [((0, 64), None), (None, (0, 64)), ((0, 64), (0, 64, 128))])
def test_shared_rows_on_one_side_only_are_refused(
    local: tuple[int, ...] | None, remote: tuple[int, ...] | None
) -> None:
    with pytest.raises(IncompatiblePairError) as e:
        check_advertised_pair(side(row_offsets=local), side(row_offsets=remote), facts())
    assert e.value.field == "row_offsets"
    assert (e.value.values["local"], e.value.values["remote"]) == (local, remote)


def test_regions_of_their_own_have_no_row_offsets_to_compare() -> None:
    assert check_advertised_pair(side(), side(), facts()).tp_ratio == 1  # row_offsets None on both sides


# kvgeom.compat.vllm.advertised, rule by rule: every refusal's class, field and values, and acceptance right at each
# boundary.
#
# Pages here are ``block tokens x heads per rank x 8 bytes``; expected lengths are derived in comments.


B = 8  # bytes per token-head


def small_side(tp: int = 1, hpr: int = 8, block: int = 16, regions: int = 2, **kw: Any) -> Advertised:
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


def small_facts(regions: int = 2, heads: int = 8, **kw: Any) -> LocalFacts:
    base: dict[str, Any] = dict(is_mla=False, has_ssm=False)
    return LocalFacts(total_kv_heads=heads, regions=tuple(range(regions)), **{**base, **kw})


def mla_side(tp: int = 1, block: int = 16, regions: int = 1, **kw: Any) -> Advertised:
    return small_side(tp=tp, hpr=1, block=block, regions=regions, **kw)  # a latent page: one "head"


def mla_facts(regions: int = 1, **kw: Any) -> LocalFacts:
    return small_facts(regions=regions, heads=1, **{"is_mla": True, **kw})


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


def test_fewer_ranks_cannot_read_replicated_heads() -> None:
    # 2 KV heads: remote TP 4 replicates them (4 > 2), local TP 2 reads with ratio -2
    refused(
        IncompatiblePairError,
        "tp_size",
        lambda: check_advertised_pair(small_side(tp=2, hpr=1), small_side(tp=4, hpr=1), small_facts(heads=2)),
        local=2,
        remote=4,
    )


def test_remote_tp_equal_to_the_heads_is_not_replicated() -> None:
    # 4 heads, remote TP 4: one head per rank (4 > 4 is false); local TP 2 holds 2 heads per rank.
    # ratio -2, bsr 1: remote length = local 2*16*8 * 1 // 2 = 16*8
    assert pair(small_side(tp=2, hpr=2), small_side(tp=4, hpr=1), small_facts(heads=4)) == (
        -2,
        1,
        False,
        False,
    )


def test_replicated_remote_is_readable_by_mla_ssm_equal_or_more_ranks() -> None:
    # MLA: latents are replicated anyway
    assert pair(mla_side(tp=2), mla_side(tp=4), mla_facts())[0] == -2
    # SSM hybrids skip the rule (their lengths are not checked here)
    assert pair(small_side(tp=2, hpr=1), small_side(tp=4, hpr=1), small_facts(heads=2, has_ssm=True))[0] == -2
    # equal TP 4 with 2 heads: replicated, ratio 1; replicated region lengths match as they are
    assert pair(small_side(tp=4, hpr=1), small_side(tp=4, hpr=1), small_facts(heads=2)) == (
        1,
        1,
        False,
        False,
    )
    # local TP 8 reading remote TP 4 (both replicate 2 heads): ratio 2, replicated lengths equal
    assert pair(small_side(tp=8, hpr=1), small_side(tp=4, hpr=1), small_facts(heads=2)) == (
        2,
        1,
        False,
        False,
    )


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


def test_mamba_prefix_caching_needs_equal_ppl() -> None:
    f = small_facts(has_ssm=True, prefix_caching=True)
    refused(
        IncompatiblePairError,
        "ppl",
        lambda: check_advertised_pair(small_side(ppl=2), small_side(ppl=4), f),
        local=2,
        remote=4,
    )
    assert pair(small_side(ppl=2), small_side(ppl=2), f)[0] == 1
    assert pair(small_side(ppl=2), small_side(ppl=4), small_facts(has_ssm=True))[0] == 1
    assert pair(small_side(ppl=2), small_side(ppl=4), small_facts(prefix_caching=True))[0] == 1


def test_host_buffer_needs_equal_block_sizes() -> None:
    # local block 32, remote 16: bsr 2; ratio 1, so remote length = 32*8*8 // 2 = 16*8*8
    refused(
        UnsupportedError,
        "block_size",
        lambda: check_advertised_pair(
            small_side(block=32), small_side(block=16), small_facts(host_buffer=True)
        ),
        local=32,
        remote=16,
    )
    assert pair(small_side(block=32), small_side(block=16), small_facts()) == (1, 2, False, False)
    assert pair(small_side(), small_side(), small_facts(host_buffer=True)) == (1, 1, False, False)


def test_block_sizes_must_divide() -> None:
    refused(
        RatioError,
        "block_size",
        lambda: check_advertised_pair(small_side(block=16), small_side(block=32), small_facts()),
        local=16,
        remote=32,
    )


def test_layouts_must_match_or_be_the_one_permute() -> None:
    nh, hn = replace(small_side(), kv_layout="LBNHC"), small_side()
    refused(
        IncompatiblePairError,
        "kv_layout",
        lambda: check_advertised_pair(nh, hn, small_facts()),
        local="LBNHC",
        remote="LBHNC",
    )
    # the permute goes only from a remote LBHNC into a local LBNHC
    refused(
        IncompatiblePairError,
        "kv_layout",
        lambda: check_advertised_pair(hn, nh, small_facts(permute_allowed=True)),
        local="LBHNC",
        remote="LBNHC",
    )
    other = replace(small_side(), kv_layout="XYZ")
    refused(
        IncompatiblePairError,
        "kv_layout",
        lambda: check_advertised_pair(nh, other, small_facts(permute_allowed=True)),
        local="LBNHC",
        remote="XYZ",
    )
    assert pair(nh, hn, small_facts(permute_allowed=True)) == (1, 1, True, False)
    refused(
        UnsupportedError,
        "kv_layout",
        lambda: check_advertised_pair(nh, hn, small_facts(permute_allowed=True, hma=True)),
        local="LBNHC",
        remote="LBHNC",
    )
    # MLA latents have no head layout to differ in
    assert pair(replace(mla_side(), kv_layout="LBNHC"), mla_side(), mla_facts()) == (1, 1, False, False)


def test_a_cpu_attention_backend_repacks_unless_hybrid() -> None:
    cpu, flash = small_side(attn_backend="CPU_ATTN"), small_side(attn_backend="FLASH_ATTN")
    assert pair(cpu, flash, small_facts()) == (1, 1, False, True)
    assert pair(flash, cpu, small_facts()) == (1, 1, False, False)
    assert pair(cpu, cpu, small_facts(hma=True)) == (1, 1, False, False)
    refused(
        UnsupportedError,
        "attn_backend",
        lambda: check_advertised_pair(cpu, flash, small_facts(hma=True)),
        local="CPU_ATTN",
        remote="FLASH_ATTN",
    )


def test_a_head_split_needs_a_block_contiguous_layout() -> None:
    nbc = small_facts(block_contiguous=False)
    # the refusal names the layout both sides advertise, whichever it is
    d, p = replace(side(tp=2, heads_per_rank=4), kv_layout="LBNHC"), replace(side(tp=1), kv_layout="LBNHC")
    refused(
        IncompatiblePairError,
        "kv_layout",
        lambda: check_advertised_pair(d, p, facts(block_contiguous=False)),
        local="LBNHC",
        remote="LBNHC",
    )
    # local TP 2 (4 heads per rank) against remote TP 1 (8): remote length = 16*4*8 * 8 // 4 = 16*8*8
    refused(
        IncompatiblePairError,
        "kv_layout",
        lambda: check_advertised_pair(small_side(tp=2, hpr=4), small_side(tp=1), nbc),
        local="LBHNC",
        remote="LBHNC",
    )
    # ratio -2 too (local TP 1 against remote TP 2)
    refused(
        IncompatiblePairError,
        "kv_layout",
        lambda: check_advertised_pair(small_side(tp=1), small_side(tp=2, hpr=4), nbc),
        local="LBHNC",
        remote="LBHNC",
    )
    assert pair(small_side(), small_side(), nbc)[0] == 1  # no head split at equal TP
    assert pair(small_side(tp=2, hpr=4), small_side(tp=1), small_facts())[0] == 2  # block-contiguous
    assert pair(mla_side(tp=2), mla_side(tp=1), mla_facts(block_contiguous=False))[0] == 2
    # a remote that replicates (2 heads, remote TP 4) read by more ranks (TP 8)
    assert (
        pair(small_side(tp=8, hpr=1), small_side(tp=4, hpr=1), small_facts(heads=2, block_contiguous=False))[
            0
        ]
        == 2
    )
    # the permute makes the received cache block-contiguous
    nh = replace(small_side(tp=2, hpr=4), kv_layout="LBNHC")
    assert pair(nh, small_side(tp=1), small_facts(block_contiguous=False, permute_allowed=True)) == (
        2,
        1,
        True,
        False,
    )


def test_nvfp4_pages_cannot_be_resharded() -> None:
    refused(
        UnsupportedError,
        "tp_size",
        lambda: check_advertised_pair(small_side(tp=2, hpr=4), small_side(tp=1), small_facts(nvfp4=True)),
        local=2,
        remote=1,
    )
    assert pair(small_side(tp=2, hpr=4), small_side(tp=2, hpr=4), small_facts(nvfp4=True))[0] == 1
    assert pair(mla_side(tp=2), mla_side(tp=1), mla_facts(nvfp4=True))[0] == 2
    # 2 heads at TP 4 and TP 8: one head per rank on both sides (replicated), so no re-shard
    assert pair(small_side(tp=8, hpr=1), small_side(tp=4, hpr=1), small_facts(heads=2, nvfp4=True))[0] == 2


def test_hybrid_mla_lengths_match_up_to_the_block_ratio() -> None:
    hybrid = replace(facts(regions=2), is_mla=True, has_ssm=True, total_kv_heads=1)
    d = Advertised(
        tp_size=1,
        block_size=32,
        num_blocks=32,
        block_lens=(64, 64),
        block_strides=(64, 64),
        kv_layout="LBHNC",
    )
    assert pair(d, replace(d, block_size=16, block_lens=(32, 32), block_strides=(32, 32)), hybrid)[1] == 2
    refused(
        IncompatiblePairError,
        "block_lens",
        lambda: check_advertised_pair(d, replace(d, block_lens=(32, 64)), hybrid),
        local=[64, 64],
        remote=[32, 64],
    )
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
    local = small_side(regions=2)
    remote = replace(small_side(regions=2), block_lens=(7, 9))
    assert pair(local, remote, small_facts(has_ssm=True)) == (1, 1, False, False)


def test_region_count_must_match() -> None:
    refused(
        IncompatiblePairError,
        "num_regions",
        lambda: check_advertised_pair(small_side(regions=3), small_side(regions=3), small_facts(regions=2)),
        local=2,
        remote=3,
    )


def test_region_lengths_follow_the_local_region_map() -> None:
    # remote region 0 pairs with local region 1 and vice versa; local lengths differ per region
    local = replace(small_side(), block_lens=(100, 200), block_strides=(100, 200))
    f = replace(small_facts(), regions=(1, 0))
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
    f = small_facts(region_replicated=(True,))
    local = replace(small_side(tp=2, block=32), block_lens=(1000, 1000), block_strides=(1000, 1000))
    remote = replace(small_side(tp=1, block=16), block_lens=(500, 1000), block_strides=(500, 1000))
    assert pair(local, remote, f) == (2, 2, False, False)
    refused(
        IncompatiblePairError,
        "block_lens[0]",
        lambda: check_advertised_pair(local, replace(remote, block_lens=(1000, 1000)), f),
        local=1000,
        remote=1000,
    )
    # an explicit False is not replicated: region 0 wants 1000
    f2 = small_facts(region_replicated=(False, True))
    assert pair(local, replace(remote, block_lens=(1000, 500), block_strides=(1000, 500)), f2)[1] == 2


def test_split_lengths_by_ratio_and_block_ratio() -> None:
    # ratio 1, bsr 2: 16*32*8 // 2 == 16*16*8... with 8 heads both sides: want = L * 8 // 8 // 2
    assert pair(small_side(block=32), small_side(block=16), small_facts())[1] == 2
    # ratio -2, bsr 1: local TP 1 (8 heads) against TP 2 (4 heads): want = L * 4 // 8 (no bsr division)
    assert pair(small_side(tp=1), small_side(tp=2, hpr=4), small_facts()) == (-2, 1, False, False)
    # ratio 2, bsr 2: local TP 2 block 32 (4 heads) -> 32*4*8 * 8 // 4 // 2 = 32*4*8
    local = small_side(tp=2, hpr=4, block=32)
    remote = replace(small_side(tp=1, hpr=8, block=16))
    assert remote.block_lens[0] == local.block_lens[0]
    assert pair(local, remote, small_facts()) == (2, 2, False, False)
    # ratio -2 with bsr 2 on split regions: refused
    refused(
        UnsupportedError,
        "block_size",
        lambda: check_advertised_pair(
            small_side(tp=1, block=32), small_side(tp=2, hpr=4, block=16), small_facts()
        ),
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
        lambda: check_advertised_pair(small_side(tp=2, hpr=4), small_side(tp=1, hpr=4), small_facts()),
        local=512,
        remote=512,
    )


def test_every_remote_rank_advertises_the_first_block_count() -> None:
    refused(
        IncompatiblePairError,
        "num_blocks",
        lambda: check_advertised_pair(
            small_side(), replace(small_side(), num_blocks=11), small_facts(first_num_blocks=10)
        ),
        local=10,
        remote=11,
    )
    assert pair(small_side(), small_side(), small_facts(first_num_blocks=10))[0] == 1
    assert pair(small_side(), replace(small_side(), num_blocks=11), small_facts())[0] == 1


def test_one_base_address_per_local_region() -> None:
    refused(
        IncompatiblePairError,
        "kv_caches_base_addr",
        lambda: check_advertised_pair(small_side(), replace(small_side(), num_bases=3), small_facts()),
        local=2,
        remote=3,
    )
    # SSM hybrids skip the length rules, so the table rule sees 3 lengths for 2 regions
    refused(
        IncompatiblePairError,
        "kv_caches_base_addr",
        lambda: check_advertised_pair(small_side(), small_side(regions=3), small_facts(has_ssm=True)),
        local=2,
        remote=3,
    )
    # an explicit base count overrides the number of lengths
    page = 16 * 8 * B
    two_bases = replace(small_side(regions=3), num_bases=2, block_strides=(page, page))
    assert pair(small_side(), two_bases, small_facts(has_ssm=True))[0] == 1


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
    assert pair(small_side(), replace(small_side(), **{name: good}), small_facts())[0] == 1
    refused(
        IncompatiblePairError,
        name,
        lambda: check_advertised_pair(small_side(), replace(small_side(), **{name: bad}), small_facts()),
        local=2,
        remote=len(bad),
    )


def test_strides_no_shorter_than_lengths() -> None:
    page = 16 * 8 * B
    assert pair(small_side(), replace(small_side(), block_strides=(page, page + 1)), small_facts())[0] == 1
    refused(
        IncompatiblePairError,
        "block_strides[1]",
        lambda: check_advertised_pair(
            small_side(), replace(small_side(), block_strides=(page, page - 1)), small_facts()
        ),
        local=page,
        remote=page - 1,
    )
    three = small_side(regions=3)
    refused(
        IncompatiblePairError,
        "block_strides[0]",
        lambda: check_advertised_pair(
            three, replace(three, block_strides=(page - 2, page, page - 1)), small_facts(regions=3)
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
            small_side(),
            replace(small_side(), region_names=("v", "k")),
            small_facts(expected_region_names=names),
        ),
        local=["k", "v"],
        remote=["v", "k"],
    )
    assert (
        pair(
            small_side(), replace(small_side(), region_names=names), small_facts(expected_region_names=names)
        )[0]
        == 1
    )
    assert pair(small_side(), small_side(), small_facts(expected_region_names=names))[0] == 1
    assert pair(small_side(), replace(small_side(), region_names=("x", "y")), small_facts())[0] == 1


def test_expected_lengths_use_integer_division() -> None:
    # vLLM compares with integer division: a replicated 1001-byte page at bsr 2 wants 1001 // 2 = 500
    local = replace(mla_side(block=32), block_lens=(1001,), block_strides=(1001,))
    remote = replace(mla_side(block=16), block_lens=(500,), block_strides=(500,))
    assert pair(local, remote, mla_facts()) == (1, 2, False, False)
    # split: 3 KV heads, local TP 3 (1 head) against remote TP 1 (3 heads), bsr 2: 101 * 3 // 1 // 2 = 151
    local = replace(small_side(tp=3, hpr=1, block=32, regions=1), block_lens=(101,), block_strides=(101,))
    remote = replace(small_side(tp=1, hpr=3, block=16, regions=1), block_lens=(151,), block_strides=(151,))
    assert pair(local, remote, small_facts(regions=1, heads=3)) == (3, 2, False, False)
