"""A GQA draft under an MLA target, and P and D grouping the same regions differently, in both modes."""

from __future__ import annotations

import pytest

from kvgeom import (
    AttentionSpec,
    EngineConfig,
    KvgeomError,
    MLASpec,
    ModelSpec,
    Pairing,
    UnsupportedError,
    plan_request,
    rank_geometry,
)
from kvgeom.testing import Request, run

# two MLA target layers, then two layers of a draft with 4 KV heads of 4 (fp16)
DRAFT = ModelSpec.from_layers("mla+draft", [MLASpec(8, "float16")] * 2 + [AttentionSpec(4, 4, "float16")] * 2)
MLA4 = ModelSpec.from_layers("mla", [MLASpec(8, "float16")] * 4)


def _engine(tp: int, block: int = 4, blocks: int = 10, **kw: object) -> EngineConfig:
    return EngineConfig(tp_size=tp, block_size=block, num_blocks=blocks, **kw)


def test_a_draft_under_an_mla_target_is_one_group_of_per_layer_regions() -> None:
    geom = rank_geometry(DRAFT, _engine(2))
    assert len(geom.groups) == 1
    assert [r.is_mla for r in geom.regions] == [True, True, False, False]
    # MLA pages hold the whole latent on every rank; the draft's pages 2 of its 4 heads
    assert [r.block_len for r in geom.regions] == [4 * 8 * 2] * 2 + [4 * 2 * 8 * 2] * 2


def test_vllm_mode_reads_the_drafts_head_slice_with_the_drafts_mapping() -> None:
    """D TP2 rank 1 reads from P TP1: the MLA pages whole, the draft pages' heads 2-3 (offset 2 heads in)."""
    d = rank_geometry(DRAFT, _engine(2, tp_rank=1))
    pairing = Pairing.create(d, [rank_geometry(DRAFT, _engine(1))], "pull", "vllm")
    assert pairing.draft_mapping is not None and pairing.draft_mapping.rank_offset_factor == 1
    moves = plan_request(pairing, [[3]], [[5]], num_tokens=4).moves(pairing)
    head_block = 4 * 4 * 2 * 2  # tokens * (K+V) * head_size * fp16 bytes of one head
    by_region = {int(m[1]): (int(m[2]), int(m[6])) for m in moves}
    assert by_region[0] == (5 * 64, 64) and by_region[1] == (5 * 64, 64)  # whole latent pages of block 5
    assert by_region[2] == (5 * 4 * head_block + 2 * head_block, 2 * head_block)  # heads 2-3 of P's block 5
    for p_tp, d_tp in ((1, 2), (2, 4), (2, 2)):
        p, dd = _engine(p_tp), _engine(d_tp)
        assert run(DRAFT, p, dd, Request.simple(DRAFT, p, dd, 13), "pull", "vllm").ok


@pytest.mark.parametrize(
    ("p_tp", "d_tp", "mode"), [(2, 1, "pull"), (4, 1, "pull"), (1, 2, "push"), (2, 1, "push")]
)
def test_kvgeom_mode_plans_drafts_where_vllm_refuses(p_tp: int, d_tp: int, mode: str) -> None:
    p, d = _engine(p_tp), _engine(d_tp)
    request = Request.simple(DRAFT, p, d, 13)
    with pytest.raises(UnsupportedError) as err:
        run(DRAFT, p, d, request, mode, "vllm")
    assert err.value.field == "tp_size"
    report = run(DRAFT, p, d, request, mode, "kvgeom")
    assert report.ok and report.bytes_moved > 0


def test_vllm_mode_refuses_block_ratios_where_vllm_skips_the_drafts_regroup() -> None:
    """vLLM never regroups head-major pages in MLA models: a draft's pages received as finer remote blocks
    keep their heads interleaved (tests/vllm shows the bytes wrong); kvgeom mode regroups them."""
    p, d = _engine(1, block=2), _engine(1, block=4)
    request = Request.simple(DRAFT, p, d, 13)
    with pytest.raises(UnsupportedError) as err:
        run(DRAFT, p, d, request, "pull", "vllm")
    assert err.value.field == "block_size"
    assert run(DRAFT, p, d, request, "pull", "kvgeom").ok


def test_a_separate_group_pairs_regions_by_their_own_lists() -> None:
    """D keeps layers 1 and 3 in a group of their own: its region group ids [0, 1, 0, 1] against P's [0] * 4."""
    p, d = _engine(1), _engine(1, separate_group=("layers.1.attn", "layers.3.attn"))
    dg = rank_geometry(MLA4, d)
    assert [g.layers for g in dg.groups] == [
        ("layers.0.attn", "layers.2.attn"),
        ("layers.1.attn", "layers.3.attn"),
    ]
    pairing = Pairing.create(dg, [rank_geometry(MLA4, p)], "pull", "vllm")
    assert pairing.region_mapped
    plan = plan_request(pairing, [[2, 3], [6, 7]], [[4, 5]], num_tokens=8)
    (t,) = plan.transfers
    # per region its own list: regions 0 and 2 read D group 0's blocks, regions 1 and 3 group 1's, 10 blocks each
    assert t.local_ids.tolist() == [2, 3, 16, 17, 22, 23, 36, 37]
    assert t.remote_ids.tolist() == [4, 5, 14, 15, 24, 25, 34, 35]
    for compat in ("vllm", "kvgeom"):
        for n, prefix, computed in ((13, 0, None), (13, 1, None), (12, 1, 11)):
            assert run(
                MLA4, p, d, Request.simple(MLA4, p, d, n, prefix, prefill_tokens=computed), "pull", compat
            ).ok


def test_separate_groups_beyond_vllms_scope() -> None:
    dense = ModelSpec.from_layers("dense", [AttentionSpec(4, 4, "float16")] * 3)
    p, d = _engine(1), _engine(2, separate_group=("layers.2.attn",))
    request = Request.simple(dense, p, d, 9)
    with pytest.raises(UnsupportedError) as err:
        run(dense, p, d, request, "pull", "vllm")
    assert err.value.field == "separate_group"
    assert run(dense, p, d, request, "pull", "kvgeom").ok
    with pytest.raises(KvgeomError) as err:  # vLLM's push connector refuses it; kvgeom plans it in pulls
        run(
            MLA4,
            _engine(1),
            _engine(1, separate_group=("layers.0.attn",)),
            Request.simple(MLA4, _engine(1), _engine(1, separate_group=("layers.0.attn",)), 5),
            "push",
            "kvgeom",
        )
    assert err.value.field == "separate_group"


def test_kvgeom_mode_sends_a_separate_groups_ids_only_through_its_own_regions() -> None:
    """P and D both keep layers 1 and 3 in a group of their own: regions 0, 2 hold group 0, regions 1, 3
    group 1 (10 blocks each, id ``10 r + b``). Each group's 4 blocks go through its own 2 regions only:
    16 descriptor pairs, as vLLM posts; sending every group through every region (32 pairs) would double
    the bytes, into blocks the other group's layers never read."""
    sep = ("layers.1.attn", "layers.3.attn")
    p = d = _engine(1, separate_group=sep)
    for compat in ("vllm", "kvgeom"):
        pairing = Pairing.create(rank_geometry(MLA4, d), [rank_geometry(MLA4, p)], "pull", compat)
        plan = plan_request(
            pairing, [[1, 2, 3, 4], [5, 6, 7, 8]], [[1, 2, 3, 4], [5, 6, 7, 8]], num_tokens=13
        )
        (t,) = plan.transfers
        group0 = [1, 2, 3, 4, 21, 22, 23, 24]  # regions 0 and 2
        group1 = [15, 16, 17, 18, 35, 36, 37, 38]  # regions 1 and 3
        assert sorted(t.local_ids.tolist()) == sorted(group0 + group1), compat
        assert t.local_ids.tolist() == t.remote_ids.tolist(), compat
        for n, prefix in ((13, 0), (13, 1), (16, 0)):
            assert run(MLA4, p, d, Request.simple(MLA4, p, d, n, prefix), "pull", compat).ok


# a GQA draft (one attention layer) under an MLA target
MLA2_DRAFT1 = ModelSpec.from_layers(
    "mla+draft", [MLASpec(8, "float16"), MLASpec(8, "float16"), AttentionSpec(4, 4, "float16")]
)


@pytest.mark.parametrize(("p_tp", "d_tp"), [(1, 2), (2, 4)])
def test_vllm_mode_pulls_a_draft_with_local_tp_above_remote(p_tp: int, d_tp: int) -> None:
    """vLLM 0.33.0 maps a GQA draft under an MLA target when the local (D) TP is at least the remote's in
    a pull, not only at equal TP."""
    p, d = (
        EngineConfig(tp_size=p_tp, block_size=4, num_blocks=6),
        EngineConfig(tp_size=d_tp, block_size=4, num_blocks=6),
    )
    assert run(MLA2_DRAFT1, p, d, Request.simple(MLA2_DRAFT1, p, d, 7), "pull", "vllm").ok


def test_vllm_mode_refuses_a_draft_push_across_tp_sizes_naming_tp_size() -> None:
    p, d = (
        EngineConfig(tp_size=1, block_size=4, num_blocks=6),
        EngineConfig(tp_size=2, block_size=4, num_blocks=6),
    )
    with pytest.raises(KvgeomError) as err:
        run(MLA2_DRAFT1, p, d, Request.simple(MLA2_DRAFT1, p, d, 7), "push", "vllm")
    assert err.value.field == "tp_size"
    assert run(MLA2_DRAFT1, p, d, Request.simple(MLA2_DRAFT1, p, d, 7), "push", "kvgeom").ok


def test_vllm_mode_refuses_a_two_head_draft_read_as_finer_remote_blocks() -> None:
    """A draft with 2 KV heads per rank (head-major pages) under MLA targets, P blocks of 2 tokens read into
    D blocks of 4: vLLM never regroups such pages, so vllm mode refuses; kvgeom mode regroups them."""
    draft = ModelSpec.from_layers(
        "mla+draft", [MLASpec(8, "float16")] * 2 + [AttentionSpec(2, 4, "float16")] * 2
    )
    p = EngineConfig(tp_size=1, block_size=2, num_blocks=10)
    d = EngineConfig(tp_size=1, block_size=4, num_blocks=10)
    request = Request.simple(draft, p, d, 13)
    with pytest.raises(KvgeomError) as err:
        run(draft, p, d, request, "pull", "vllm")
    assert err.value.field == "block_size"
    assert run(draft, p, d, request, "pull", "kvgeom").ok
