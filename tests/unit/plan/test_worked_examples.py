"""Worked examples computed by hand (numbers in the comments), end to end through the public API:
rank geometry -> pairing (TP mapping, tables) -> per-request plan -> byte moves.

Move rows are (src_rank, src_region, src_offset, dst_rank, dst_region, dst_offset, length).
"""

from __future__ import annotations

import numpy as np
import pytest

from kvgeom import KvgeomError, UnsupportedError
from kvgeom.layout.allocate import rank_geometry
from kvgeom.layout.engine import EngineConfig
from kvgeom.model.layers import AttentionSpec, MambaSpec, MLASpec
from kvgeom.model.spec import ModelSpec
from kvgeom.plan.pairing import Pairing
from kvgeom.plan.request import plan_request


def _pair(model, p: dict, d: dict, rank: int = 0, mode: str = "pull", compat: str = "kvgeom") -> Pairing:
    pe, de = EngineConfig(**p), EngineConfig(**d)
    local_eng, remote_eng = (de, pe) if mode == "pull" else (pe, de)
    local = rank_geometry(model, local_eng.with_rank(rank))
    remotes = [rank_geometry(model, remote_eng.with_rank(r)) for r in range(remote_eng.tp_size)]
    return Pairing.create(local, remotes, mode, compat)


def _tokens(pairing: Pairing, local_ids, remote_ids) -> int | None:
    """These examples have no prefix hit: D's attention lists hold the request's tokens (``None``: no
    attention block to place)."""
    d, ids = (
        (pairing.local, local_ids)
        if pairing.mode == "pull"
        else (pairing.remotes[pairing.targets[0]], remote_ids)
    )
    blocks = max(len(x) for x, one in zip(ids, d.group_one_block) if not one)
    return blocks * d.logical_block_size or None


def _plan(pairing: Pairing, local_ids, remote_ids):
    return plan_request(pairing, local_ids, remote_ids, num_tokens=_tokens(pairing, local_ids, remote_ids))


def _moves(pairing: Pairing, local_ids, remote_ids):
    plan = _plan(pairing, local_ids, remote_ids)
    return plan, sorted(map(tuple, plan.moves(pairing).tolist()))


GQA8 = ModelSpec.from_layers(
    "gqa8", [AttentionSpec(8, 4, "float16")]
)  # 8 KV heads of 4 fp16: 16 B/token-head
GQA2 = ModelSpec.from_layers("gqa2", [AttentionSpec(2, 4, "float16")])


def test_dense_gqa_p_tp1_to_d_tp4() -> None:
    # P page = 4 tokens x 8 heads x (4+4) x 2 B = 512 B; D rank holds 2 heads = 128 B per block.
    # D rank 1 reads heads 2,3: offset 2 heads x 4 tokens x 16 B = 128 inside each P block.
    pairing = _pair(
        GQA8, dict(tp_size=1, block_size=4, num_blocks=8), dict(tp_size=4, block_size=4, num_blocks=8), rank=1
    )
    assert pairing.tp_ratio == 4 and pairing.mapping.all_source_ranks == (0,)
    assert pairing.mapping.rank_offset_factor == 1
    plan, moves = _moves(pairing, [[2, 6]], [[3, 5]])
    assert plan.transfers[0].local_ids.tolist() == [2, 6] and plan.transfers[0].remote_ids.tolist() == [3, 5]
    assert moves == [(0, 0, 3 * 512 + 128, 1, 0, 2 * 128, 128), (0, 0, 5 * 512 + 128, 1, 0, 6 * 128, 128)]
    assert plan.expected_notifications == 4 and plan.transfers[0].notif == "req:4"
    assert len(plan.zero) == 0


def test_dense_gqa_p_tp4_to_d_tp1_with_replicated_heads() -> None:
    # 2 KV heads on 4 P ranks: P0,P1 hold head 0, P2,P3 head 1 (64 B pages). D (both heads, 128 B pages)
    # reads head 0 from P0 into slot 0 and head 1 from P2 into slot 1; P1 and P3 are only notified.
    pairing = _pair(
        GQA2, dict(tp_size=4, block_size=4, num_blocks=8), dict(tp_size=1, block_size=4, num_blocks=8)
    )
    assert pairing.mapping.all_source_ranks == (0, 2) and pairing.needs_split
    plan, moves = _moves(pairing, [[4]], [[1]])
    assert moves == [(0, 0, 64, 0, 0, 512, 64), (2, 0, 64, 0, 0, 576, 64)]
    assert plan.notify_only == (1, 3)
    with pytest.raises(Exception) as exc:  # vLLM refuses this pair
        _pair(
            GQA2,
            dict(tp_size=4, block_size=4, num_blocks=8),
            dict(tp_size=1, block_size=4, num_blocks=8),
            compat="vllm",
        )
    assert exc.value.field == "tp_size" and exc.value.values == {"local": 1, "remote": 4}


def test_mla_p_tp8_to_d_tp2_reads_once_and_notifies_the_rest() -> None:
    # Latent of 8 fp16 = 16 B/token on every rank; block 4 -> 64 B. D rank 1 reads P rank 1*8//2 = 4.
    model = ModelSpec.from_layers("mla", [MLASpec(8, "float16")])
    pairing = _pair(
        model,
        dict(tp_size=8, block_size=4, num_blocks=8),
        dict(tp_size=2, block_size=4, num_blocks=8),
        rank=1,
    )
    assert pairing.tp_ratio == -4 and pairing.mapping.all_source_ranks == (4,) and not pairing.needs_split
    plan, moves = _moves(pairing, [[7]], [[2]])
    assert moves == [(4, 0, 128, 1, 0, 448, 64)]
    assert plan.notify_only == (5, 6, 7)


MAMBA2 = ModelSpec.from_layers(
    "m2",
    [
        AttentionSpec(4, 2, "float16"),  # 4 KV heads of 2: 8 B per token-head
        MambaSpec.mamba2(
            num_heads=4, head_dim=2, n_groups=4, state_size=2, conv_kernel=3, conv_dtype="float16"
        ),
    ],
)


def test_mamba2_hybrid_p_tp4_to_d_tp1_with_block_ratio_2() -> None:
    # P (TP4): 1 head -> 8 B/token, block 4 -> 32 B page = state (conv 6 ch x 2 rows x 2 B + temporal 4 x 2 B).
    # D (TP1): 32 B/token, block 8 -> 256 B page; state 96 + 32 B. Kernel ratio 8 / 4 = 2.
    pairing = _pair(
        MAMBA2, dict(tp_size=4, block_size=4, num_blocks=8), dict(tp_size=1, block_size=8, num_blocks=4)
    )
    assert (pairing.tp_ratio, pairing.bsr) == (-4, 2) and pairing.mapping.all_source_ranks == (0, 1, 2, 3)
    plan, moves = _moves(pairing, [[3], [1]], [[5, 2], [7]])
    want = []
    for p in range(4):
        # attention: P block 5 -> sub-block 0 of D block 3, P block 2 -> sub-block 1; head slot p (32 B)
        want += [(p, 0, 160, 0, 0, 768 + 32 * p, 32), (p, 0, 64, 0, 0, 896 + 32 * p, 32)]
        # state slot 7 (P page 32 B) -> slot 1 (D page 256 B): x, B, C pieces 8 B each, temporal 8 B
        want += [
            (p, 0, 224, 0, 0, 256 + 8 * p, 8),
            (p, 0, 232, 0, 0, 288 + 8 * p, 8),
            (p, 0, 240, 0, 0, 320 + 8 * p, 8),
            (p, 0, 248, 0, 0, 352 + 8 * p, 8),
        ]
    assert moves == sorted(want)
    (rg,) = plan.regroup  # [2 sub-blocks, 4 heads, 4 tokens, 8 B] -> [4 heads, 8 tokens, 8 B]
    assert (rg.bsr, rg.heads, rg.tokens, rg.head_bytes, rg.blocks.tolist()) == (2, 4, 8, 8, [3])
    assert len(plan.zero) == 0  # 2 P blocks cover both halves of the D block
    with pytest.raises(UnsupportedError) as exc:
        _pair(
            MAMBA2,
            dict(tp_size=4, block_size=4, num_blocks=8),
            dict(tp_size=1, block_size=8, num_blocks=4),
            compat="vllm",
        )
    assert exc.value.field == "block_size" and exc.value.values == {"local": 8, "remote": 4}


def test_mamba2_partial_coverage_zeroes_the_token_tail() -> None:
    # Same pair, one P block only: D block 3 gets sub-block 0; tokens 4..7 of every head are zeroed
    # (after regroup: head h at 768 + h*64, tokens 4.. at +32, 32 B each).
    pairing = _pair(
        MAMBA2, dict(tp_size=4, block_size=4, num_blocks=8), dict(tp_size=1, block_size=8, num_blocks=4)
    )
    plan, _ = _moves(pairing, [[3], [1]], [[5], [7]])
    assert sorted(map(tuple, plan.zero.tolist())) == [(0, 768 + 64 * h + 32, 32) for h in range(4)]


GDN = ModelSpec.from_layers(
    "gdn",
    [
        AttentionSpec(1, 2, "float16"),  # 8 B/token
        MambaSpec.gdn(
            num_k_heads=1, k_head_dim=2, num_v_heads=1, v_head_dim=2, conv_kernel=2, conv_dtype="float16"
        ),
    ],
)


def test_gdn_hybrid_with_kernel_blocks_smaller_than_logical_on_p_only() -> None:
    # P: logical 16, kernel 8 (ppl 2), kernel page 64 B; D: logical 8 = kernel (ppl 1), page 64 B.
    # 12 tokens: P logical [2] -> kernel [4, 5]; D logical [1, 3]; front-trim keeps both -> 4->1, 5->3.
    # State (conv Q|K|V 4 B each, temporal 8 B) from P slot 6 (page 128 B) to D slot 0 (page 64 B).
    pairing = _pair(
        GDN,
        dict(tp_size=1, block_size=16, kernel_block_size=8, num_blocks=8),
        dict(tp_size=1, block_size=8, num_blocks=8),
    )
    assert (pairing.bsr, pairing.local.ppl, pairing.remotes[0].ppl) == (1, 1, 2)
    plan, moves = _moves(pairing, [[1, 3], [0]], [[2], [6]])
    assert moves == sorted(
        [
            (0, 0, 256, 0, 0, 64, 64),
            (0, 0, 320, 0, 0, 192, 64),
            (0, 0, 768, 0, 0, 0, 4),
            (0, 0, 772, 0, 0, 4, 4),
            (0, 0, 776, 0, 0, 8, 4),
            (0, 0, 780, 0, 0, 12, 8),
        ]
    )
    assert len(plan.zero) == 0


def test_mla_kda_hybrid_p_tp2_to_d_tp1() -> None:
    # MLA latent 2 fp16 = 4 B/token, block 16 -> 64 B page on both sides. KDA 2 heads x 2, conv rows 1:
    # TP1 conv Q|K|V 8 B each + temporal 2 x 4 fp32 = 32 B; TP2 halves. D reads MLA once from P0 and the
    # state from P0 and P1 (head p -> +4p in each conv piece, +16p in the temporal state).
    model = ModelSpec.from_layers(
        "mla-kda",
        [MLASpec(2, "float16"), MambaSpec.kda(num_heads=2, head_dim=2, conv_kernel=2, conv_dtype="float16")],
    )
    pairing = _pair(
        model, dict(tp_size=2, block_size=16, num_blocks=8), dict(tp_size=1, block_size=16, num_blocks=8)
    )
    assert pairing.mapping.source_ranks_per_group == ((0,), (0, 1)) and pairing.needs_split
    plan, moves = _moves(pairing, [[1], [2]], [[3], [5]])
    want = [(0, 0, 192, 0, 0, 64, 64)]
    for p in range(2):
        want += [
            (p, 0, 320, 0, 0, 128 + 4 * p, 4),
            (p, 0, 324, 0, 0, 136 + 4 * p, 4),
            (p, 0, 328, 0, 0, 144 + 4 * p, 4),
            (p, 0, 332, 0, 0, 152 + 16 * p, 16),
        ]
    assert moves == sorted(want)
    assert [len(t) for t in plan.transfers] == [5, 4]


def test_push_mirrors_pull_for_gqa() -> None:
    # P TP4 -> D TP1 push: P rank 2 (head 2 of 4, 32 B pages) writes its slot of D's 128 B block.
    model = ModelSpec.from_layers("gqa4", [AttentionSpec(4, 4, "float16")])
    pairing = _pair(
        model,
        dict(tp_size=4, block_size=2, num_blocks=8),
        dict(tp_size=1, block_size=2, num_blocks=8),
        rank=2,
        mode="push",
    )
    plan, moves = _moves(pairing, [[1]], [[6]])  # local = P ids, remote = D ids
    assert plan.op == "WRITE" and plan.transfers[0].notif == "req:4"
    assert moves == [(2, 0, 32, 0, 0, 6 * 128 + 2 * 32, 32)]
    assert np.array_equal(plan.moves(pairing)[:, 6], [32])


FALCON_LIKE = ModelSpec.from_layers(
    "m2-one-group",
    [
        AttentionSpec(2, 2, "float16"),
        MambaSpec.mamba2(
            num_heads=2, head_dim=2, n_groups=1, state_size=2, conv_kernel=2, conv_dtype="float16"
        ),
    ],
)


def test_mamba2_one_group_p_tp1_to_d_tp2_reads_the_replicated_b_and_c_whole() -> None:
    # TP1 page: x (0,8) B (8,4) C (12,4) temporal (16,16); TP2 page: x (0,4) B (4,4) C (8,4) temporal (12,8).
    # n_groups 1 < TP 2: both D ranks hold the whole B and C. D rank 1 reads x head 1 at 4, B at 8, C at 12,
    # temporal head 1 at 24 (vLLM would read P's C as B: issue 55208, refused in vllm mode).
    p, d = dict(tp_size=1, block_size=4, num_blocks=8), dict(tp_size=2, block_size=4, num_blocks=8)
    pairing = _pair(FALCON_LIKE, p, d, rank=1)
    _, moves = _moves(pairing, [[], [3]], [[], [5]])
    assert moves == [
        (0, 0, 5 * 64 + 4, 1, 0, 96 + 0, 4),
        (0, 0, 5 * 64 + 8, 1, 0, 96 + 4, 4),
        (0, 0, 5 * 64 + 12, 1, 0, 96 + 8, 4),
        (0, 0, 5 * 64 + 24, 1, 0, 96 + 12, 8),
    ]
    with pytest.raises(UnsupportedError) as exc:
        _pair(FALCON_LIKE, p, d, rank=1, compat="vllm")
    assert exc.value.field == "tp_size" and exc.value.values == {"local": 2, "remote": 1}


def test_mamba2_one_group_p_tp2_to_d_tp1_gathers_b_and_c_in_halves_from_identical_copies() -> None:
    # D (TP1) gathers from P0 and P1: x head p whole into +4p; B and C (held whole by both) in 2-byte
    # chunks, chunk p from P_p's copy; temporal head p into 16 + 8p.
    pairing = _pair(
        FALCON_LIKE, dict(tp_size=2, block_size=4, num_blocks=8), dict(tp_size=1, block_size=4, num_blocks=8)
    )
    _, moves = _moves(pairing, [[], [2]], [[], [6]])
    want = []
    for q in range(2):
        want += [
            (q, 0, 192 + 0, 0, 0, 128 + 4 * q, 4),
            (q, 0, 192 + 4 + 2 * q, 0, 0, 128 + 8 + 2 * q, 2),
            (q, 0, 192 + 8 + 2 * q, 0, 0, 128 + 12 + 2 * q, 2),
            (q, 0, 192 + 12, 0, 0, 128 + 16 + 8 * q, 8),
        ]
    assert moves == sorted(want)


def test_check_writes_accepts_plans_and_refuses_a_lying_remote() -> None:
    from kvgeom.plan.requestplan import check_writes

    pairing = _pair(
        MAMBA2, dict(tp_size=4, block_size=4, num_blocks=8), dict(tp_size=1, block_size=8, num_blocks=4)
    )
    plan = _plan(pairing, [[3], [1]], [[5, 2], [7]])
    check_writes(plan, pairing, [[3], [1]])
    with pytest.raises(KvgeomError) as exc:
        check_writes(plan, pairing, [[2], [1]])  # block 3 is not this request's
    assert exc.value.field == "destination" and exc.value.values == {"value": (0, 768, 32)}


def test_check_writes_names_the_first_move_outside_the_request() -> None:
    """Every P rank's attention move lands in D's block 3; with block 3 not the request's, the error
    names the first of them in the plan's move order (region, offset, length)."""
    from kvgeom.plan.requestplan import check_writes

    pairing = _pair(
        MAMBA2, dict(tp_size=4, block_size=4, num_blocks=8), dict(tp_size=1, block_size=8, num_blocks=4)
    )
    plan = _plan(pairing, [[3], [1]], [[5, 2], [7]])
    regions = pairing.local.regions
    outside = [
        (int(m[4]), int(m[5]), int(m[6]))
        for m in plan.moves(pairing)
        if int(m[5]) // regions[int(m[4])].block_stride == 3
    ]
    assert len(outside) >= 2
    with pytest.raises(KvgeomError) as info:
        check_writes(plan, pairing, [[2], [1]])
    assert info.value.values["value"] == outside[0]


def test_pull_with_p_blocks_larger_than_d_blocks_reads_p_blocks_in_halves() -> None:
    # MLA latent 2 fp16 = 4 B/token. P kernel block 32 tokens (128 B), D 16 (64 B): kvgeom mode reads each
    # P block as two 16-token halves (vLLM refuses: the ratio must be >= 1). 40 tokens: P blocks [3, 1]
    # -> halves [6, 7, 2, 3]; D blocks [5, 0, 7] take the first three halves, in token order.
    model = ModelSpec.from_layers("mla", [MLASpec(2, "float16")])
    p, d = dict(tp_size=1, block_size=32, num_blocks=8), dict(tp_size=1, block_size=16, num_blocks=8)
    pairing = _pair(model, p, d)
    assert (pairing.bsr, pairing.shape.remote_split) == (1, 2)
    plan, moves = _moves(pairing, [[5, 0, 7]], [[3, 1]])
    assert moves == sorted([(0, 0, 384, 0, 0, 320, 64), (0, 0, 448, 0, 0, 0, 64), (0, 0, 128, 0, 0, 448, 64)])
    assert len(plan.zero) == 0
    with pytest.raises(KvgeomError) as exc:
        _pair(model, p, d, compat="vllm")
    assert exc.value.field == "block_size" and exc.value.values == {"local": 16, "remote": 32}


def test_token_major_with_heterogeneous_tp_is_cut_per_token() -> None:
    # 2 KV heads of 2 fp16 (8 B per token-head), token-major pages: P TP1 [2 tokens, 2 heads, 8 B] = 32 B,
    # D TP2 rank 1 [2 tokens, 1 head, 8 B] = 16 B. Head 1 of token t is 8 B at t*16 + 8 in P's block:
    # one descriptor per token (vLLM refuses token-major layouts whose heads differ).
    model = ModelSpec.from_layers("gqa2-nhd", [AttentionSpec(2, 2, "float16")])
    p = dict(tp_size=1, block_size=2, num_blocks=8, kv_layout="token_major")
    d = dict(tp_size=2, block_size=2, num_blocks=8, kv_layout="token_major")
    pairing = _pair(model, p, d, rank=1)
    assert pairing.token_rows == 2
    plan, moves = _moves(pairing, [[5]], [[3]])
    assert moves == [(0, 0, 104, 1, 0, 80, 8), (0, 0, 120, 1, 0, 88, 8)]
    with pytest.raises(KvgeomError) as exc:
        _pair(model, p, d, rank=1, compat="vllm")
    assert exc.value.field == "kv_layout" and exc.value.values == {
        "local": "token_major",
        "remote": "token_major",
    }
