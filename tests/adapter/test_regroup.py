"""The adapters' regroups on real torch tensors (kvgeom_nixl's post-receive step, kvgeom_vllm's
``regroup_blocks``): head-major and token-major targets (the LBHNC-into-LBNHC permute, B.6.15), hand-derived,
and against the byte oracle's per-element regroup on a planned permuted pull."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from kvgeom_nixl.kvrank import apply_post_receive
from kvgeom_vllm.devicebytes import ByteRegion, regroup_blocks

from kvgeom.layout.card import GeometryCard
from kvgeom.layout.engine import EngineConfig, KVLayout
from kvgeom.model.layers import AttentionSpec
from kvgeom.model.spec import ModelSpec
from kvgeom.plan.requestplan import Regroup
from kvgeom.testing import Oracle, Request, pull_plans

# 2 KV heads of head size 1 in float16: one head of one token is 4 bytes; 4 tokens: a 32-byte block, 2 blocks
CARD = GeometryCard("d", ModelSpec.from_layers("t", [AttentionSpec(2, 1, "float16")]), EngineConfig(1, 4, 2))
CHUNK = 4
# a block seen as [bsr 2, heads 2, n 2] chunks of 4 B; head-major [heads 2, tokens 4]: (h, t) <- (t // 2, h,
# t % 2): 0, 1, 4, 5, 2, 3, 6, 7; token-major [tokens 4, heads 2]: (t, h) <- same source: 0, 2, 1, 3, 4, 6, 5, 7
HEAD_MAJOR_BSR2 = [0, 1, 4, 5, 2, 3, 6, 7]
TOKEN_MAJOR_BSR2 = [0, 2, 1, 3, 4, 6, 5, 7]
# bsr 1 into token-major: [heads 2, tokens 4] -> [tokens 4, heads 2]: (t, h) <- h * 4 + t
TOKEN_MAJOR_BSR1 = [0, 4, 1, 5, 2, 6, 3, 7]


def _expected(block_perm: list[int] | None) -> list[int]:
    """The 64 bytes 0..63 after block 1's 4-byte chunks are permuted by ``block_perm``."""
    chunks = np.arange(64).reshape(16, CHUNK)
    if block_perm is not None:
        chunks[8:] = chunks[8:][block_perm]
    return chunks.reshape(-1).tolist()


CASES = [
    (2, KVLayout.HEAD_MAJOR, HEAD_MAJOR_BSR2),
    (2, KVLayout.TOKEN_MAJOR, TOKEN_MAJOR_BSR2),
    (1, KVLayout.TOKEN_MAJOR, TOKEN_MAJOR_BSR1),
    (1, KVLayout.HEAD_MAJOR, None),  # head-major at bsr 1: nothing moves
]


@pytest.mark.parametrize(("bsr", "layout", "perm"), CASES)
def test_kvgeom_nixl_applies_the_regroup(bsr: int, layout: KVLayout, perm: list[int] | None) -> None:
    tensor = torch.arange(64, dtype=torch.uint8)
    step = Regroup((0,), np.array([1]), bsr, 2, 4, CHUNK, layout)
    assert apply_post_receive([tensor], CARD, [step], np.zeros((0, 3), np.int64)) == 0
    assert tensor.tolist() == _expected(perm)


@pytest.mark.parametrize(("bsr", "layout", "perm"), CASES)
def test_kvgeom_vllm_applies_the_regroup(bsr: int, layout: KVLayout, perm: list[int] | None) -> None:
    tensor = torch.arange(64, dtype=torch.uint8)
    regroup_blocks(
        ByteRegion.at(tensor, tensor.data_ptr()),
        np.array([1]),
        32,
        bsr,
        2,
        4,
        CHUNK,
        token_major=layout is KVLayout.TOKEN_MAJOR,
    )
    assert tensor.tolist() == _expected(perm)


@pytest.mark.parametrize("setup", [(1, 1, 16), (1, 2, 8), (2, 4, 4), (2, 1, 16)])
def test_adapters_regroup_permuted_pulls_as_the_oracle_does(setup: tuple[int, int, int]) -> None:
    """A planned permuted pull (4 KV heads, head size 8, 37 tokens): every D rank's bytes after the moves, then
    the adapter's regroup on a torch tensor, equal the oracle's after its own per-element regroup."""
    p_tp, d_tp, p_block = setup
    model = ModelSpec.from_layers("m4", [AttentionSpec(4, 8, "float16")] * 2)
    p = EngineConfig(tp_size=p_tp, block_size=p_block, num_blocks=16)
    d = EngineConfig(
        tp_size=d_tp, block_size=16, num_blocks=16, kv_layout="token_major", permute_local_kv=True
    )
    request = Request.simple(model, p, d, 37)
    oracle = Oracle.for_engines(model, p, d, request)
    for rp in pull_plans(model, p, d, request, "vllm"):
        oracle.execute(oracle.moves_of(rp), f"rank {rp.rank}")
        assert bool(rp.plan.regroup) == (d_tp < 4)  # one head per rank: both layouts agree, no regroup
        assert all(s.layout is KVLayout.TOKEN_MAJOR for s in rp.plan.regroup)
        card = GeometryCard("d", model, d.with_rank(rp.rank))
        before = [torch.from_numpy(x.copy()) for x in oracle.dst[rp.rank]]
        mine = [x.clone() for x in before]
        apply_post_receive(mine, card, rp.plan.regroup, np.zeros((0, 3), np.int64))
        theirs = [x.clone() for x in before]
        for s in rp.plan.regroup:
            for r in s.regions:
                region = card.geometry.regions[r]
                flat = theirs[r].view(torch.uint8)
                regroup_blocks(
                    ByteRegion.at(flat, flat.data_ptr()),
                    s.blocks,
                    region.block_stride * 8,
                    s.bsr,
                    s.heads,
                    s.tokens,
                    s.head_bytes * 8,
                    token_major=True,
                )
        oracle.receive(rp.rank, rp.plan.regroup, np.zeros((0, 3), np.int64))
        for r, want in enumerate(oracle.dst[rp.rank]):
            assert np.array_equal(mine[r].numpy(), want), f"kvgeom_nixl, D rank {rp.rank} region {r}"
            assert np.array_equal(theirs[r].numpy(), want), f"kvgeom_vllm, D rank {rp.rank} region {r}"
        oracle.zero(rp.rank, rp.plan.zero)
    assert oracle.report().ok
