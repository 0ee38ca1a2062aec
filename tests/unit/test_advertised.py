"""kvgeom.compat.vllm.advertised: vLLM 0.33.0's handshake rules on the numbers a peer advertises (no card)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvgeom.compat.vllm.advertised import Advertised, LocalFacts, check_advertised_pair
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
    with pytest.raises(IncompatiblePairError, match="should be") as info:
        check_advertised_pair(side(tp=2, heads_per_rank=4), side(tp=1, heads_per_rank=4), facts())
    assert info.value.field == "block_lens[0]" and info.value.values == {
        "local": PAGE // 2,
        "remote": PAGE // 2,
    }


def test_block_sizes_pair_by_their_ratio_and_refuse_otherwise() -> None:
    d, p = side(block=32), side(block=16)
    assert check_advertised_pair(d, p, facts()).bsr == 2
    with pytest.raises(RatioError, match="not divisible"):
        check_advertised_pair(side(block=16), side(block=32), facts())


def test_p_tp_above_d_tp_needs_equal_block_sizes_for_head_sharded_regions() -> None:
    d, p = side(tp=1, block=32), side(tp=2, heads_per_rank=4, block=16)
    with pytest.raises(UnsupportedError, match="P TP > D TP"):
        check_advertised_pair(d, p, facts())
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
    with pytest.raises(IncompatiblePairError, match="replicates its KV") as info:
        check_advertised_pair(side(tp=2, heads_per_rank=1), side(tp=4, heads_per_rank=1), facts(heads=2))
    assert info.value.values == {"local": 2, "remote": 4}


def test_layouts_must_match_unless_the_permute_is_allowed() -> None:
    d, p = replace(side(), kv_layout="LBNHC"), side()
    with pytest.raises(IncompatiblePairError, match="same KV cache layout"):
        check_advertised_pair(d, p, facts(block_contiguous=False))
    pair = check_advertised_pair(d, p, facts(block_contiguous=False, permute_allowed=True))
    assert pair.permute_local_kv
    with pytest.raises(UnsupportedError, match="hybrid cache groups"):
        check_advertised_pair(d, p, facts(block_contiguous=False, permute_allowed=True, hma=True))


def test_a_head_split_needs_a_block_contiguous_layout() -> None:
    d, p = replace(side(tp=2, heads_per_rank=4), kv_layout="LBNHC"), replace(side(tp=1), kv_layout="LBNHC")
    with pytest.raises(IncompatiblePairError, match="block-contiguous"):
        check_advertised_pair(d, p, facts(block_contiguous=False))


def test_cpu_attention_backend_turns_on_repacking() -> None:
    d, p = replace(side(), attn_backend="CPU_ATTN"), replace(side(), attn_backend="FLASH_ATTN")
    assert check_advertised_pair(d, p, facts()).heterogeneous_attn


def test_context_parallel_and_draft_rules() -> None:
    with pytest.raises(IncompatiblePairError, match="divide one another"):
        check_advertised_pair(replace(side(), dcp_size=2), replace(side(), dcp_size=3), facts())
    mla = replace(
        facts(regions=1), is_mla=True, total_kv_heads=1, draft_regions=frozenset({0}), draft_kv_heads=8
    )
    d = Advertised(
        tp_size=1, block_size=16, num_blocks=32, block_lens=(PAGE,), block_strides=(PAGE,), kv_layout="LBHNC"
    )
    with pytest.raises(UnsupportedError, match="local TP >= remote TP"):
        check_advertised_pair(
            d, replace(d, tp_size=2, block_lens=(PAGE // 2,), block_strides=(PAGE // 2,)), mla
        )
    with pytest.raises(UnsupportedError, match="push"):
        check_advertised_pair(
            replace(d, tp_size=2, block_lens=(PAGE // 2,), block_strides=(PAGE // 2,)),
            d,
            replace(mla, mode="push"),
        )


def test_mamba_prefix_caching_and_host_buffer_rules() -> None:
    ssm = facts(has_ssm=True, prefix_caching=True)
    with pytest.raises(IncompatiblePairError, match="prefix caching"):
        check_advertised_pair(replace(side(), ppl=2), replace(side(), ppl=3), ssm)
    with pytest.raises(UnsupportedError, match="host buffer"):
        check_advertised_pair(side(block=32), side(block=16), facts(host_buffer=True))


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
    assert (
        check_advertised_pair(
            d, replace(d, block_size=16, block_lens=(32, 32), block_strides=(32, 32)), hybrid
        ).bsr
        == 2
    )
    with pytest.raises(IncompatiblePairError, match="hybrid MLA"):
        check_advertised_pair(d, replace(d, block_lens=(32, 64)), hybrid)


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
