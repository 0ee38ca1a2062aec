"""The N-1 flow: a Mamba hybrid's P computes ``N - 1`` of a request's ``N`` tokens and D recomputes the
last one, so P's block list can end a block before D's. These requests are valid (vLLM serves them); a
planner that infers the tokens from block counts refused about 4% of random pulls. Regression tests of
the exact reported examples, in both modes, checked by the byte oracle or by hand, and the refusals that
name the argument to pass when a count is missing."""

from __future__ import annotations

import numpy as np
import pytest

from kvgeom import (
    EngineConfig,
    Pairing,
    PlanError,
    TokenCountError,
    UnsupportedError,
    card_of,
    plan_request,
    presets,
)
from kvgeom.layout.allocate import rank_geometry
from kvgeom.layout.geometry import align_hybrid_block_size
from kvgeom.model.layers import AttentionSpec, MambaSpec
from kvgeom.model.spec import ModelSpec
from kvgeom.plan.align import list_starts
from kvgeom.plan.exchange import prefill_backoff, prefill_tokens
from kvgeom.testing import Request, run

TINY = ModelSpec.from_layers(
    "tiny-hybrid",
    [
        AttentionSpec(1, 8, "bfloat16"),
        MambaSpec.mamba2(2, 2, 1, 4),
        AttentionSpec(1, 8, "bfloat16"),
        MambaSpec.mamba2(2, 2, 1, 4),
    ],
)


def test_tiny_hybrid_blocks_are_16_tokens() -> None:
    assert align_hybrid_block_size(TINY, 1, 16) == 16


@pytest.mark.parametrize("compat", ["kvgeom", "vllm"])
@pytest.mark.parametrize("mode", ["pull", "push"])
def test_tp1_block16_n17(compat: str, mode: str) -> None:
    """D block 16 <- P block 16 at TP1, N = 17: D holds 2 blocks, P computed 16 tokens in 1 block."""
    engine = EngineConfig(tp_size=1, block_size=16, num_blocks=6)
    computed = prefill_tokens(17, prefill_backoff(has_mamba=True))
    request = Request(17, [[3], [1]], [[2, 5], [0]], prefill_tokens=computed)
    assert computed == 16 and len(request.p_ids[0]) == 1 and len(request.d_ids[0]) == 2
    report = run(TINY, engine, engine, request, mode, compat)
    assert report.ok, str(report)
    geom = rank_geometry(TINY, engine)
    regions, streams = len(geom.regions), len(geom.ssm_region_indices) * (geom.ssm.num_pieces + 1)
    assert report.descriptors == regions * 1 + streams  # P's one block in every region, then the state


def test_tp1_block16_n17_descriptor_ids_are_vllms() -> None:
    """vLLM front-trims D's list to P's one block: D block 2 <- P block 3, then the state slot 0 <- 1."""
    engine = EngineConfig(tp_size=1, block_size=16, num_blocks=6)
    geom = rank_geometry(TINY, engine)
    pairing = Pairing.create(geom, [geom], "pull", "vllm")
    plan = plan_request(pairing, [[2, 5], [0]], [[3], [1]], num_tokens=17, prefill_tokens=16)
    (t,) = plan.transfers
    nb, nbl = geom.num_blocks, geom.logical_num_blocks
    streams = np.arange(len(geom.ssm_region_indices) * (geom.ssm.num_pieces + 1))
    fa = 2 * nb  # attention descriptors of the two regions come first
    assert t.local_ids.tolist() == [2, nb + 2] + (fa + streams * nbl + 0).tolist()
    assert t.remote_ids.tolist() == [3, nb + 3] + (fa + streams * nbl + 1).tolist()
    assert len(plan.zero) == 0  # vLLM zeroes nothing here: D's second block is its own, zeroed at allocation


def test_nemotron_readme_pair_n2081() -> None:
    """The README's nemotron-h-8b pair (D TP1 block 2080/kernel 32 <- P TP2 block 1040/kernel 16), N = 2081:
    P computed 2080 tokens (2 blocks of 1040), D holds 2 blocks of 2080. Planned by hand: 130 units of 16
    tokens in each of the 4 regions from each P rank, the 6 SSM groups' states, and D's second block
    (kernel blocks 65..129) zeroed."""
    model = presets.load("nemotron-h-8b")
    d = card_of(
        "decode", model, EngineConfig(tp_size=1, block_size=2080, kernel_block_size=32, num_blocks=64)
    )
    p = [
        card_of(
            "prefill",
            model,
            EngineConfig(tp_size=2, tp_rank=r, block_size=1040, kernel_block_size=16, num_blocks=64),
        )
        for r in range(2)
    ]
    pairing = Pairing.create(d, p, mode="pull")
    groups = d.geometry.groups
    d_ids = [[0, 1] if not g.is_ssm else [2 + g.index] for g in groups]
    p_ids = [[0, 1] if not g.is_ssm else [2 + g.index] for g in groups]
    with pytest.raises(TokenCountError) as err:  # D's list could start past a prefix hit: N is needed
        plan_request(pairing, d_ids, p_ids)
    assert err.value.values == {"value": None, "group": 0, "blocks": 2}
    for counts in ({"num_tokens": 2081}, {"num_tokens": 2081, "prefill_tokens": 2080}):
        plan = plan_request(pairing, d_ids, p_ids, **counts)
        assert [t.remote_rank for t in plan.transfers] == [0, 1]
        regions = len(d.geometry.regions)
        ssm_groups = sum(g.is_ssm for g in groups)
        per_rank = regions * 130 + regions * ssm_groups * 4  # 130 units per region; 4 streams per state
        assert [len(t) for t in plan.transfers] == [per_rank, per_rank]
        kernel_blocks_zeroed = sorted(set((plan.zero[:, 1] // d.geometry.regions[0].block_stride).tolist()))
        assert kernel_blocks_zeroed == list(range(65, 130)) and len(plan.zero) == 65 * regions


def test_nemotron_shaped_pair_passes_the_oracle() -> None:
    """The same shape on a small model: D TP1 block 16/kernel 8 <- P TP2 block 8/kernel 4, N = 17 (P
    computed 16 tokens in 2 blocks, D holds 2 blocks). vLLM refuses this pair itself (head-sharded reads
    with P_TP > D_TP and different kernel blocks); kvgeom mode plans it."""
    model = ModelSpec.from_layers(
        "small-h", [AttentionSpec(2, 4, "bfloat16"), MambaSpec.mamba2(4, 2, 2, 2)] * 2
    )
    assert align_hybrid_block_size(model, 1, 8, 8) == align_hybrid_block_size(model, 2, 8, 8) == 8
    d = EngineConfig(tp_size=1, block_size=16, kernel_block_size=8, num_blocks=6)
    p = EngineConfig(tp_size=2, block_size=8, kernel_block_size=4, num_blocks=8)
    request = Request.simple(model, p, d, 17, prefill_tokens=16)
    assert [len(x) for x in request.p_ids] == [2, 1] and [len(x) for x in request.d_ids] == [2, 1]
    report = run(model, p, d, request, "pull", "kvgeom")
    assert report.ok and report.bytes_zeroed > 0, str(report)
    with pytest.raises(UnsupportedError, match="Head-sharded"):
        run(model, p, d, request, "pull", "vllm")


def test_prefix_hit_in_the_n1_flow_is_refused_in_vllm_mode() -> None:
    """With a prefix hit of 1 block and N - 1 on a block boundary, D's list (blocks 1..2 of tokens 16..47)
    and P's (blocks 0..1) have equal counts: vLLM would pair them as they are, D block 1 <- P block 0,
    the wrong tokens. kvgeom mode pairs by token; vllm mode refuses."""
    engine = EngineConfig(tp_size=1, block_size=16, num_blocks=8)
    request = Request(33, [[3, 4], [1]], [[5, 6], [0]], prefix_blocks=1, prefill_tokens=32)
    assert run(TINY, engine, engine, request, "pull", "kvgeom").ok
    with pytest.raises(UnsupportedError, match="wrong tokens"):
        run(TINY, engine, engine, request, "pull", "vllm")


def test_missing_counts_are_named() -> None:
    # D's list after a prefix hit: its start needs num_tokens.
    with pytest.raises(PlanError) as info:
        list_starts(1, 16, 2, 16, None, True, False, 0)
    assert info.value.field == "num_tokens"
    # a sliding window's P list without a full-attention group: its end needs prefill_tokens.
    with pytest.raises(PlanError) as info:
        list_starts(1, 16, 1, 16, 40, False, True, 0)
    assert info.value.field == "prefill_tokens"
    # with both counts everything is placed: D holds tokens [16, 48), P computed [0, 32)
    assert list_starts(2, 16, 2, 16, 33, True, False, 0, 32) == (16, 0)
    assert list_starts(1, 16, 2, 16, 33, False, True, 0, 32) == (32, 0)
    # D holds fewer tokens than P computed without a prefix hit: placing it needs num_tokens
    with pytest.raises(PlanError) as info:
        list_starts(1, 16, 3, 16, None, False, False, 0)
    assert info.value.field == "num_tokens"
