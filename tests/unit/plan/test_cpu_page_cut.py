"""kvgeom mode at a block-size ratio on vLLM's CPU attention page (``head_kv_major``: per head K transposed,
``[head_size, tokens]``, then V rows): both sides' pages are cut by their token runs
(:mod:`kvgeom.layout.tokenruns`), so P block 32 -> D block 64 and P 64 -> D 32 move each K row's token
range and each V row range into place, and nothing is regrouped. The byte oracle (``kvgeom.testing``)
places every coordinate by its own model of the page."""

from __future__ import annotations

import numpy as np
import pytest

from kvgeom import EngineConfig, Pairing, plan_request, rank_geometry
from kvgeom.errors import IncompatiblePairError, RatioError, UnsupportedError
from kvgeom.layout.engine import KVLayout
from kvgeom.layout.tokenruns import page_token_runs, unit_runs
from kvgeom.model.layers import AttentionSpec, MambaSpec
from kvgeom.model.spec import ModelSpec
from kvgeom.testing import Request, run_pull

CPU = KVLayout.HEAD_KV_MAJOR
ATTN = AttentionSpec(num_kv_heads=2, head_size=64, dtype="float32")
ATTN1 = AttentionSpec(num_kv_heads=1, head_size=32, dtype="float32")
MAMBA = MambaSpec.mamba2(8, 32, 2, 16, 4, "float32", "float32")
DENSE = ModelSpec.from_layers("qwen3-tiny", [ATTN] * 4)
DENSE1 = ModelSpec.from_layers("one-kv-head", [ATTN1] * 2)
HYBRID = ModelSpec.from_layers("nemotron-h-tiny", [MAMBA, ATTN, MAMBA, None])
HYBRID_GROUPS = (("layers.0.mamba",), ("layers.2.mamba",), ("layers.1.attn",))


def engine(model: ModelSpec, block: int, tp: int = 1, layout: KVLayout = CPU) -> EngineConfig:
    groups = HYBRID_GROUPS if model is HYBRID else ()
    return EngineConfig(tp_size=tp, block_size=block, num_blocks=24, kv_layout=layout, kv_cache_groups=groups)


def pairing(model: ModelSpec, p: EngineConfig, d: EngineConfig, compat: str = "kvgeom") -> Pairing:
    return Pairing.create(rank_geometry(model, d), [rank_geometry(model, p)], mode="pull", compat=compat)


def test_the_cpu_page_token_runs_place_k_transposed_and_v_rows() -> None:
    # 2 heads, 4 tokens, head size 3 fp32: per head K^T [3, 4] (rows of 4 elements) then V [4, 3]
    runs = page_token_runs(CPU, 2, 4, 12, 12, 4)
    assert runs == ((0, 3, 16, 4), (48, 1, 0, 12), (96, 3, 16, 4), (144, 1, 0, 12))
    assert page_token_runs(KVLayout.HEAD_MAJOR, 2, 4, 12, 12, 4) == ((0, 1, 0, 24), (96, 1, 0, 24))
    assert page_token_runs(KVLayout.TOKEN_MAJOR, 2, 4, 12, 12, 4) == ((0, 1, 0, 48),)
    assert page_token_runs(CPU, 1, 4, 12, 12, 4, part="v") == ((0, 1, 0, 12),)


def test_units_of_a_coarse_block_are_the_token_ranges_of_the_fine_blocks() -> None:
    runs8 = page_token_runs(CPU, 1, 8, 8, 8, 4)  # one head, 8 tokens, head size 2
    fine = unit_runs(page_token_runs(CPU, 1, 4, 8, 8, 4), 4, 4)
    coarse = unit_runs(runs8, 8, 4)
    # fine block: K^T rows 0, 1 (4 elements each, 16 B apart), then V rows of 4 tokens
    assert fine.table().tolist() == [[0, 16, 16, 2], [32, 32, 32, 1]]
    # coarse block, chunk j: K^T row d at d * 32 + j * 16, V rows from 64 + j * 32
    assert coarse.table().tolist() == [[0, 16, 32, 2], [64, 32, 32, 1], [16, 16, 32, 2], [96, 32, 32, 1]]


CASES = [(32, 64), (64, 32), (32, 128), (128, 32)]


@pytest.mark.parametrize("model", [DENSE, HYBRID], ids=["dense", "hybrid"])
@pytest.mark.parametrize("blocks", CASES, ids=[f"p{a}-d{b}" for a, b in CASES])
@pytest.mark.parametrize("num_tokens", [1, 40, 64, 65, 150])
def test_kvgeom_mode_moves_the_cpu_page_at_a_block_size_ratio(
    model: ModelSpec, blocks: tuple[int, int], num_tokens: int
) -> None:
    p, d = engine(model, blocks[0]), engine(model, blocks[1])
    report = run_pull(model, p, d, Request.simple(model, p, d, num_tokens), compat="kvgeom")
    assert report.ok, report


@pytest.mark.parametrize("blocks", CASES[:2], ids=[f"p{a}-d{b}" for a, b in CASES[:2]])
@pytest.mark.parametrize("num_tokens", [33, 64, 65, 100])
def test_the_hybrid_n_minus_1_flow_at_a_ratio_zeroes_token_runs_only(
    blocks: tuple[int, int], num_tokens: int
) -> None:
    """P computes all but the last token: D zeroes the rest of its partly covered block run by run (a token
    range of a transposed K half is one short run per K row), never another token's bytes."""
    p, d = engine(HYBRID, blocks[0]), engine(HYBRID, blocks[1])
    request = Request.simple(HYBRID, p, d, num_tokens, prefill_tokens=num_tokens - 1)
    report = run_pull(HYBRID, p, d, request, compat="kvgeom")
    assert report.ok, report


@pytest.mark.parametrize(
    ("model", "p_tp", "d_tp"),
    [(DENSE, 2, 2), (DENSE1, 1, 2), (DENSE1, 2, 1), (DENSE1, 2, 2), (HYBRID, 2, 2)],
    ids=["dense-tp2-tp2", "one-head-tp1-tp2", "one-head-tp2-tp1", "one-head-tp2-tp2", "hybrid-tp2-tp2"],
)
@pytest.mark.parametrize("blocks", CASES[:2], ids=[f"p{a}-d{b}" for a, b in CASES[:2]])
def test_the_cut_pairs_ranks_holding_the_same_heads(
    model: ModelSpec, p_tp: int, d_tp: int, blocks: tuple[int, int]
) -> None:
    p, d = engine(model, blocks[0], p_tp), engine(model, blocks[1], d_tp)
    report = run_pull(model, p, d, Request.simple(model, p, d, 100), compat="kvgeom")
    assert report.ok, report


def test_no_regroup_is_planned_and_every_descriptor_is_one_token_range() -> None:
    p, d = engine(DENSE, 32), engine(DENSE, 64)
    pr = pairing(DENSE, p, d)
    plan = plan_request(pr, [[1, 2]], [[1, 2, 3]], num_tokens=100)
    assert plan.regroup == ()
    moves = plan.moves(pr)
    # per 32-token chunk and layer: 2 heads x (64 K rows of 32 fp32 + one V run of 32 x 64 fp32)
    assert pr.token_rows == 2 * 65 and pr.local_rows == 2 * pr.token_rows
    assert sorted(set(moves[:, 6].tolist())) == [32 * 4, 32 * 64 * 4]
    assert int(moves[:, 6].sum()) == 4 * 3 * 2 * 2 * 64 * 32 * 4  # 3 P blocks of 4 layers, K and V


@pytest.mark.parametrize("model", [DENSE, HYBRID], ids=["dense", "hybrid"])
@pytest.mark.parametrize("blocks", CASES[:2], ids=[f"p{a}-d{b}" for a, b in CASES[:2]])
def test_vllm_mode_refuses_the_ratio_it_would_corrupt(model: ModelSpec, blocks: tuple[int, int]) -> None:
    p, d = engine(model, blocks[0]), engine(model, blocks[1])
    if blocks == (64, 32):  # vLLM asserts that D's block divides by P's (HTTP 500 on a real engine)
        with pytest.raises(RatioError) as ratio:
            pairing(model, p, d, compat="vllm")
        assert ratio.value.field == "block_size"
        assert ratio.value.values == {"local": 32, "remote": 64}
        return
    with pytest.raises(IncompatiblePairError) as info:  # vLLM regroups as [heads, tokens, head_size]
        pairing(model, p, d, compat="vllm")
    assert info.value.field == "kv_layout"
    assert info.value.values == {"local": "head_kv_major", "remote": "head_kv_major"}


def test_different_heads_per_rank_are_refused_at_a_ratio() -> None:
    p, d = engine(DENSE, 32, 1), engine(DENSE, 64, 2)
    with pytest.raises(UnsupportedError) as info:
        pairing(DENSE, p, d)
    assert info.value.field == "tp_size"
    assert info.value.values == {"local": 1, "remote": 2}


def test_push_at_a_ratio_is_refused() -> None:
    p, d = engine(DENSE, 64), engine(DENSE, 32)
    with pytest.raises(UnsupportedError) as info:
        Pairing.create(rank_geometry(DENSE, p), [rank_geometry(DENSE, d)], mode="push", compat="kvgeom")
    assert info.value.field == "mode"
    assert info.value.values == {"local": "push", "remote": "pull"}


def test_equal_blocks_keep_whole_pages() -> None:
    p, d = engine(DENSE, 64), engine(DENSE, 64)
    pr = pairing(DENSE, p, d)
    assert pr.page_cut is None and pr.token_rows == 1
    moves = plan_request(pr, [[1, 2]], [[1, 2]], num_tokens=100).moves(pr)
    assert np.all(moves[:, 6] == 2 * 2 * 64 * 64 * 4)


def test_decode_context_parallelism_at_a_ratio_is_refused() -> None:
    p, d = (EngineConfig(tp_size=2, dcp_size=2, block_size=b, num_blocks=24, kv_layout=CPU) for b in (32, 64))
    with pytest.raises(UnsupportedError) as info:
        pairing(DENSE, p, d)
    assert info.value.field == "dcp_size"
    assert info.value.values == {"local": 2, "remote": 2}
