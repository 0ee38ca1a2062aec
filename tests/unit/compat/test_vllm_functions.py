"""Hand-computed examples of the vLLM-compatible functions (docs/vllm-behaviour.md Part B) and their
input validation."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from kvgeom.blocks import (
    apply_prefix_caching,
    get_mapped_blocks,
    logical_to_kernel,
    map_block_ids_for_block_size_ratio,
)
from kvgeom.errors import (
    BlockIdError,
    GroupMismatchError,
    KvgeomError,
    PlanError,
    RatioError,
    SpecError,
    UnsupportedError,
)
from kvgeom.layout.conv import ConvSplit, derive_conv_split, physical_blocks_per_logical, remote_conv_offsets
from kvgeom.pair.tp import (
    TPMapping,
    compute_tp_mapping,
    consumers_per_producer,
    handshake_targets,
    head_offset,
    needs_split_local_handles,
    tp_ratio,
)
from kvgeom.plan.descids import compute_desc_ids
from kvgeom.plan.splits import build_local_splits, expand_strided


def lists(groups: Any) -> Any:
    return [np.asarray(g).tolist() for g in groups]


# --- block ids ---------------------------------------------------------------------------------------


def test_logical_to_kernel_b1_example() -> None:
    assert lists(logical_to_kernel([[1], [2, 3]], 2, [False, False])) == [[2, 3], [4, 5, 6, 7]]


def test_logical_to_kernel_keeps_ssm_groups() -> None:
    out = logical_to_kernel([[1], [7]], 3, [False, True])
    assert lists(out) == [[3, 4, 5], [7]]
    assert all(g.dtype == np.int64 for g in out)


def test_get_mapped_blocks_sparse_unsorted() -> None:
    assert get_mapped_blocks([3, 1], 2).tolist() == [6, 7, 2, 3]


def test_map_block_ids_clips_attention_to_remote_length() -> None:
    # D block = 2 P blocks; the last local block is only half covered by the 3 remote blocks.
    local, remote = map_block_ids_for_block_size_ratio([[3, 4], [9]], [[10, 11, 12], [5]], 2, [False, True])
    assert lists(local) == [[6, 7, 8], [9]]
    assert lists(remote) == [[10, 11, 12], [5]]


def test_map_block_ids_notify_only_and_full_prefix_hit() -> None:
    local, remote = map_block_ids_for_block_size_ratio([], [[1, 2]], 2, [False])
    assert local == [] and lists(remote) == [[1, 2]]
    local, _ = map_block_ids_for_block_size_ratio([[4], []], [[], []], 2, [False, False])
    assert local == []


def test_prefix_caching_b36_hetero_ppl() -> None:
    # 640 tokens, kernel 64: prefill ppl 10 -> kernel ids 0..9, decode ppl 6 -> 0..11; both trimmed to 10.
    decode, prefill = apply_prefix_caching(
        [list(range(12)), [7]], [list(range(10)), [3]], 6, 10, [False, True]
    )
    assert lists(decode) == [list(range(10)), [7]]
    assert lists(prefill) == [list(range(10)), [3]]
    # Reversed: prefill ppl 6 (2 logical blocks -> 12 kernel ids), decode ppl 10 (1 -> 10): both 10.
    decode, prefill = apply_prefix_caching(
        [list(range(10))], [list(range(12))], 10, 6, [False], has_mamba=True
    )
    assert lists(decode) == [list(range(10))] and lists(prefill) == [list(range(10))]


def test_prefix_caching_end_trim_and_quirk() -> None:
    decode, prefill = apply_prefix_caching([[8, 9]], [[1, 2, 3, 4]], 1, 1, [False])
    assert lists(decode) == [[8, 9]] and lists(prefill) == [[3, 4]]
    # vLLM's prefill[-0:] keeps the whole list when D has no uncomputed block.
    _, prefill = apply_prefix_caching([[]], [[1, 2, 3]], 1, 1, [False])
    assert lists(prefill) == [[1, 2, 3]]


def test_prefix_caching_ssm_slots() -> None:
    decode, prefill = apply_prefix_caching([[5, 6]], [[1]], 1, 1, [True])
    assert lists(decode) == [[5]] and lists(prefill) == [[1]]
    with pytest.raises(PlanError) as exc:
        apply_prefix_caching([[5, 6, 7]], [[1]], 1, 1, [True])
    assert exc.value.field == "decode_ids[0]" and exc.value.values == {"value": 3, "expected": 1}


def test_prefix_caching_refusals() -> None:
    with pytest.raises(PlanError) as info:
        apply_prefix_caching([[1, 2, 3]], [[1]], 1, 1, [False])
    assert info.value.field == "decode_ids[0]"
    with pytest.raises(PlanError) as exc:
        apply_prefix_caching([list(range(30)), [0]], [[1], [0]], 1, 10, [False, True])
    assert exc.value.field == "decode_ids[0]" and exc.value.values == {"value": 30, "expected": 1}


# --- descriptor ids ----------------------------------------------------------------------------------


def test_desc_ids_b34_fast_path() -> None:
    out = compute_desc_ids([[1, 2], [5]], 10, 2, None, 1, [False, False])
    assert out.tolist() == [1, 2, 5, 11, 12, 15] and out.dtype == np.int64


def test_desc_ids_hybrid_path() -> None:
    # R=2 regions of NB'=8 (4 blocks x bsr 2); region 1 holds SSM state (Mamba2: 3 conv pieces + temporal),
    # NBL = 4 // ppl 2 = 2 logical blocks per stream, nfa = 16.
    out = compute_desc_ids([[3], [1]], 4, 2, 2, 2, [False, True], ssm_region_indices=[1])
    assert out.tolist() == [3, 11, 17, 19, 21, 23]


def test_desc_ids_region_group_mapping() -> None:
    # Region 0 belongs to group 1, region 1 is shared (-1), region 2 to group 0; NB = 5.
    out = compute_desc_ids([[1], [2]], 5, 3, None, 1, [False, False], region_group_ids=[1, -1, 0])
    assert out.tolist() == [6, 11, 2, 7]
    with pytest.raises(GroupMismatchError) as info:  # group 1 has ids but no region of its own or shared
        compute_desc_ids([[1], [2]], 5, 3, None, 1, [False, False], region_group_ids=[0, 0, 2])
    assert info.value.field == "block_ids[1]"


def test_desc_ids_capacities() -> None:
    out = compute_desc_ids([[0, 2]], 8, 3, None, 1, [False], region_num_blocks=[3, 3, 4])
    assert out.tolist() == [0, 2, 3, 5, 6, 8]
    # Block 1 does not exist in region 1 (capacity 1): vLLM's arithmetic would give id 4, region 2's
    # block 0, and move another region's bytes; kvgeom refuses the id.
    with pytest.raises(BlockIdError) as bad:
        compute_desc_ids([[0, 1]], 8, 3, None, 1, [False], region_num_blocks=[3, 1, 4])
    assert bad.value.values == {"value": 1, "expected": 1}
    with pytest.raises(GroupMismatchError) as info:
        compute_desc_ids([[0]], 8, 3, None, 1, [False], region_num_blocks=[3, 1])
    assert info.value.field == "region_num_blocks"


# --- TP mapping --------------------------------------------------------------------------------------


def test_tp_mapping_8_heads_p_tp1_to_d_tp4() -> None:
    # Pull: D (local) TP4 reads from P (remote) TP1; each D rank reads its quarter of P's 8 heads.
    for rank in range(4):
        m = compute_tp_mapping(rank, 4, 1, 8, False, [False])
        assert m.source_ranks_per_group == ((0,),) and m.all_source_ranks == (0,)
        assert m.rank_to_attention_slot == ((0, 0),)
        assert m.rank_offset_factor == rank and m.local_consumers == 4
        assert head_offset(rank, 4, 1, 8) == rank
        assert handshake_targets(rank, 4, 1) == (0,)
        assert not needs_split_local_handles(tp_ratio(4, 1), m, use_mla=False)
    assert consumers_per_producer(1, 4) == 4


def test_tp_mapping_8_heads_p_tp4_to_d_tp1() -> None:
    m = compute_tp_mapping(0, 1, 4, 8, False, [False])
    assert m.source_ranks_per_group == ((0, 1, 2, 3),)
    assert m.rank_to_attention_slot == ((0, 0), (1, 1), (2, 2), (3, 3))
    assert m.rank_offset_factor == 0 and m.local_consumers == 1
    assert tp_ratio(1, 4) == -4 and handshake_targets(0, 1, 4) == (0, 1, 2, 3)
    assert needs_split_local_handles(-4, m, use_mla=False)
    assert consumers_per_producer(4, 1) == 1


def test_tp_mapping_mla_p_tp8_to_d_tp2() -> None:
    m0 = compute_tp_mapping(0, 2, 8, 1, True, [False])
    m1 = compute_tp_mapping(1, 2, 8, 1, True, [False])
    assert m0.all_source_ranks == (0,) and m1.all_source_ranks == (4,)
    assert handshake_targets(1, 2, 8) == (4, 5, 6, 7)
    assert not needs_split_local_handles(-4, m1, use_mla=True)  # the latent is read once, whole
    hybrid = compute_tp_mapping(1, 2, 8, 1, True, [False, True])  # MLA + SSM: the state is sharded
    assert hybrid.source_ranks_per_group == ((4,), (4, 5, 6, 7))
    assert hybrid.rank_to_attention_slot == ((4, 0), (5, 0), (6, 0), (7, 0))
    assert needs_split_local_handles(-4, hybrid, use_mla=True)


def test_tp_mapping_gqa_dedup_and_local_replication() -> None:
    m = compute_tp_mapping(0, 1, 4, 2, False, [False, True])  # P ranks 0,1 hold head 0; 2,3 head 1
    assert m.source_ranks_per_group == ((0, 2), (0, 1, 2, 3))
    assert m.rank_to_attention_slot == ((0, 0), (1, 0), (2, 1), (3, 1))
    assert [compute_tp_mapping(r, 4, 1, 2, False, [False]).rank_offset_factor for r in range(4)] == [
        0,
        0,
        1,
        1,
    ]
    assert m.slot_of(3) == 1
    assert TPMapping.from_json(m.to_json()) == m
    with pytest.raises(PlanError):
        m.slot_of(9)


# --- conv split --------------------------------------------------------------------------------------


def test_conv_split_mamba2_falcon_h1_05b() -> None:
    # I = 24 heads * 64 = 1536, n_groups 1, state 128: conv dim 1536 + 2*128, kernel 4 -> 3 rows, bf16.
    split = derive_conv_split("mamba2", [1792, 3], [24, 64, 128], 1, "bfloat16", "bfloat16")
    assert split == ConvSplit(
        local_proj_dims=(1536, 128, 128),
        proj_bytes=(9216, 768, 768),
        local_conv_offsets=((0, 9216), (9216, 768), (9984, 768)),
        ssm_sizes=(10752, 393216),
        conv_rows=3,
        conv_dtype_size=2,
    )


def test_conv_split_gdn_and_kda() -> None:
    gdn = derive_conv_split("gdn", [64, 1], [6, 8, 32], 1, "float16", "float16")
    assert gdn.local_proj_dims == (8, 8, 48) and gdn.local_conv_offsets == ((0, 16), (16, 16), (32, 96))
    kda = derive_conv_split("kda", [384, 4], [4, 32, 32], 4, "float16", "float32")
    assert kda.local_proj_dims == (128, 128, 128) and kda.ssm_sizes == (3072, 16384)


def test_remote_conv_offsets_both_directions() -> None:
    # D TP2 rank 0 reading from P TP1 (ratio 2), Falcon-H1-0.5B local dims (768, 128, 128), 3 rows, bf16:
    # vLLM assumes every P piece is twice the local one (B.6.1 item 1: wrong for n_groups < TP).
    assert remote_conv_offsets([768, 128, 128], 3, 2, 0, 2) == ((0, 4608), (9216, 768), (10752, 768))
    assert remote_conv_offsets([768, 128, 128], 3, 2, 1, 2) == ((4608, 4608), (9984, 768), (11520, 768))
    # D TP1 reading P TP2 (ratio -2): the P page is read whole, in halves of the local pieces.
    assert remote_conv_offsets([1536, 128, 128], 3, 2, 0, -2) == ((0, 4608), (4608, 384), (4992, 384))


def test_physical_blocks_per_logical_nemotron() -> None:
    assert physical_blocks_per_logical([2_000_000, 134_016], 8192) == 261
    assert physical_blocks_per_logical([500_000, 33_504], 4096) == 131
    assert physical_blocks_per_logical([4096, 4096], 4096) == 2


def test_conv_split_refusals() -> None:
    with pytest.raises(SpecError) as exc:
        derive_conv_split("mamba2", [192, 3], [3, 64, 128], 1, "float32", "float32")
    assert exc.value.field == "conv_shape" and exc.value.values == {"value": 192, "expected": 192}
    with pytest.raises(SpecError) as info:
        derive_conv_split("mamba1", [256, 2], [264, 4], 4, "bfloat16", "float32")
    assert info.value.field == "temporal_shape"
    with pytest.raises(SpecError):
        derive_conv_split("mamba3", [8, 1], [8, 1], 1, "float32", "float32")


# --- split handles -----------------------------------------------------------------------------------


def test_expand_strided() -> None:
    rows = np.array([[100, 8, 0, 32, 3], [7, 4, 1, 4, 1]])
    assert expand_strided(rows).tolist() == [[100, 8, 0], [132, 8, 0], [164, 8, 0], [7, 4, 1]]
    assert expand_strided(np.zeros((0, 5), dtype=np.int64)).shape == (0, 3)


def test_build_local_splits_head_split_and_ssm() -> None:
    # D TP1 <- P TP2, 8 KV heads, FA + SSM: one FA run of 4 blocks (128 B), one conv piece and one
    # temporal run of 2 logical blocks; FA halves by head slot, SSM halves by source index.
    m = compute_tp_mapping(0, 1, 2, 8, False, [False, True])
    descs = np.array([[0x1000, 128, 0, 128, 4], [0x9000, 64, 0, 256, 2], [0x9040, 192, 0, 256, 2]])
    out = build_local_splits(descs, m, 4, 1, [False, True])
    assert [o.tolist() for o in out] == [
        [[0x1000, 64, 0, 128, 4], [0x9000, 32, 0, 256, 2], [0x9040, 96, 0, 256, 2]],
        [[0x1040, 64, 0, 128, 4], [0x9020, 32, 0, 256, 2], [0x90A0, 96, 0, 256, 2]],
    ]
    # An MLA region is replicated: its rows pass through whole.
    out = build_local_splits(descs, m, 4, 1, [False, True], region_is_mla=[True], region_num_blocks=[4])
    assert out[1][0].tolist() == [0x1000, 128, 0, 128, 4]


def test_build_local_splits_refusals() -> None:
    m = compute_tp_mapping(0, 1, 2, 8, False, [False])
    descs = [[0x1000, 64, 0], [0x1040, 64, 0]]
    with pytest.raises(UnsupportedError) as info:
        build_local_splits(descs, m, 2, 2, [False])
    assert info.value.field == "block_size_ratio"
    assert len(build_local_splits(descs, m, 2, 2, [False], allow_sharded_ratio=True)) == 2
    with pytest.raises(PlanError):
        build_local_splits(descs, m, 3, 1, [False])
    with pytest.raises(GroupMismatchError) as exc:
        build_local_splits(descs, m, 2, 1, [False], region_is_mla=[False], region_num_blocks=[3])
    assert exc.value.field == "region_num_blocks" and exc.value.values == {"value": 3, "expected": 2}


# --- invalid input classes ---------------------------------------------------------------------------


def check_field(exc: KvgeomError, field: str) -> None:
    assert exc.field == field


def test_negative_block_id_is_refused() -> None:
    with pytest.raises(BlockIdError) as info:
        logical_to_kernel([[1], [2, -3]], 2, [False, False])
    check_field(info.value, "block_ids[1]")
    assert info.value.values == {"value": -3}
    with pytest.raises(BlockIdError) as info:
        compute_desc_ids([[-1]], 4, 1, None, 1, [False])
    check_field(info.value, "block_ids[0]")
    with pytest.raises(BlockIdError) as info:
        get_mapped_blocks([0, -1], 2)
    check_field(info.value, "ids")


def test_out_of_range_block_id_is_refused() -> None:
    with pytest.raises(BlockIdError) as info:
        compute_desc_ids([[8]], 4, 1, 2, 1, [False])
    check_field(info.value, "block_ids[0]")


def test_group_count_mismatch_is_refused() -> None:
    with pytest.raises(GroupMismatchError) as info:
        logical_to_kernel([[1]], 2, [False, True])
    check_field(info.value, "block_ids")
    assert info.value.values == {"value": 1, "expected": 2}
    with pytest.raises(GroupMismatchError) as info:
        map_block_ids_for_block_size_ratio([[1]], [[1], [2]], 2, [False, False])
    check_field(info.value, "local_ids")
    with pytest.raises(GroupMismatchError) as info:
        apply_prefix_caching([[1], [2]], [[1]], 1, 1, [False, False])
    check_field(info.value, "prefill_ids")
    with pytest.raises(GroupMismatchError) as info:
        compute_desc_ids([[1], [2]], 4, 1, None, 1, [False])
    check_field(info.value, "block_ids")


@pytest.mark.parametrize(
    "call, field",
    [
        (lambda: tp_ratio(3, 2), "remote_tp"),
        (lambda: tp_ratio(4, 6), "remote_tp"),
        (lambda: compute_tp_mapping(0, 2, 3, 8, False, [False]), "remote_tp"),
        (lambda: consumers_per_producer(3, 2), "consumer_tp"),
        (lambda: get_mapped_blocks([1], 0), "ratio"),
        (lambda: logical_to_kernel([[1]], -1, [False]), "ppl"),
        (lambda: map_block_ids_for_block_size_ratio([[1]], [[1]], 0, [False]), "ratio"),
        (lambda: apply_prefix_caching([[1]], [[1]], 0, 1, [False]), "decode_ppl"),
        (lambda: compute_desc_ids([[1]], 4, 1, 0, 1, [False]), "block_size_ratio"),
        (lambda: tp_ratio(0, 2), "local_tp"),
    ],
)
def test_non_dividing_or_non_positive_ratio_is_refused(call: Any, field: str) -> None:
    with pytest.raises(RatioError) as info:
        call()
    check_field(info.value, field)


def test_errors_are_value_errors_never_assertions() -> None:
    with pytest.raises(ValueError):
        tp_ratio(3, 2)
