"""The oracle's token-major regroup (the LBHNC-into-LBNHC permute, docs/vllm-behaviour.md B.6.15): applied per
element from its documented meaning (hand-derived permutations), and it judges permuted pulls: kvgeom's plans
pass, the same plans without the permute, or with a head-major regroup instead, are caught; and kvgeom mode's
permuted pushes (P writes head-major pages, D's receive step permutes them)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from kvgeom.layout.engine import EngineConfig, KVLayout
from kvgeom.model.layers import AttentionSpec
from kvgeom.model.spec import ModelSpec
from kvgeom.plan.receive import receive_step
from kvgeom.plan.requestplan import Regroup
from kvgeom.testing import Oracle, Request, pull_plans, push_plans, run_pull, run_push

TM = KVLayout.TOKEN_MAJOR
M1 = ModelSpec.from_layers("t", [AttentionSpec(1, 1, "float16")])
E1 = EngineConfig(tp_size=1, block_size=2, num_blocks=4)  # 4 blocks of 8 bytes: 32 bytes per region
REQ = Request(3, [[1, 2]], [[3, 0]])


def _world() -> Oracle:
    o = Oracle.for_engines(M1, E1, E1, REQ)
    o.dst[0][0][:] = np.arange(32)
    return o


def test_token_major_regroup_per_its_documented_meaning() -> None:
    # heads 2, tokens 4, bsr 2, 1 byte: n = 2; the block viewed as [bsr 2, heads 2, n 2] is stored as
    # [tokens 4, heads 2]: dest (t, h) <- source (t // 2, h, t % 2) = ((t // 2) * 2 + h) * 2 + t % 2:
    # t 0: 0, 2; t 1: 1, 3; t 2: 4, 6; t 3: 5, 7
    o = _world()
    o.regroup(0, Regroup((0,), np.array([1, 3]), 2, 2, 4, 1, TM))
    perm = [0, 2, 1, 3, 4, 6, 5, 7]
    want = list(range(8)) + [8 + i for i in perm] + list(range(16, 24)) + [24 + i for i in perm]
    assert o.dst[0][0].tolist() == want
    assert o.result.regrouped_blocks == 2 and o.result.ok


def test_token_major_regroup_at_bsr_1_transposes_heads_and_tokens() -> None:
    # heads 2, tokens 4, bsr 1, 1 byte: [heads 2, tokens 4] -> [tokens 4, heads 2]: dest (t, h) <- h * 4 + t
    o = _world()
    o.regroup(0, Regroup((0,), [2], 1, 2, 4, 1, TM))
    assert o.dst[0][0][16:24].tolist() == [16 + i for i in (0, 4, 1, 5, 2, 6, 3, 7)]
    # heads 2, tokens 2, bsr 1, 2 bytes: [2, 2, 2] -> dest (t, h, x) <- (h * 2 + t) * 2 + x
    o = _world()
    o.regroup(0, Regroup((0,), [0], 1, 2, 2, 2, TM))
    assert o.dst[0][0][:8].tolist() == [0, 1, 4, 5, 2, 3, 6, 7]
    # one head: the layouts agree, nothing moves
    o = _world()
    o.regroup(0, Regroup((0,), [0, 1, 2, 3], 2, 1, 4, 2, TM))
    assert o.dst[0][0].tolist() == list(range(32)) and o.result.regrouped_blocks == 4


M4 = ModelSpec.from_layers("m4", [AttentionSpec(4, 8, "float16")] * 2)


def _pair(p_tp: int, d_tp: int, p_block: int) -> tuple[EngineConfig, EngineConfig, Request]:
    p = EngineConfig(tp_size=p_tp, block_size=p_block, num_blocks=16)
    d = EngineConfig(tp_size=d_tp, block_size=16, num_blocks=16, kv_layout=TM, permute_local_kv=True)
    return p, d, Request.simple(M4, p, d, 37)


@pytest.mark.parametrize("compat", ["vllm", "kvgeom"])
@pytest.mark.parametrize("setup", [(1, 1, 16), (1, 2, 8), (2, 4, 4), (4, 2, 16), (2, 1, 16)])
def test_permuted_pulls_pass_the_oracle(setup: tuple[int, int, int], compat: str) -> None:
    p, d, request = _pair(*setup)
    assert run_pull(M4, p, d, request, compat).ok


def _judge(p: EngineConfig, d: EngineConfig, request: Request, change) -> list[str]:
    oracle = Oracle.for_engines(M4, p, d, request)
    for rp in pull_plans(M4, p, d, request, "vllm"):
        oracle.execute(oracle.moves_of(rp), f"rank {rp.rank}")
        oracle.receive(rp.rank, change(rp.plan.regroup), rp.plan.zero)
    return sorted({v.invariant for v in oracle.report().violations})


@pytest.mark.parametrize("setup", [(1, 2, 8), (1, 1, 16)])
def test_the_oracle_catches_a_missing_or_head_major_permute(setup: tuple[int, int, int]) -> None:
    p, d, request = _pair(*setup)
    assert _judge(p, d, request, lambda steps: steps) == []
    assert "I2" in _judge(p, d, request, lambda steps: ())
    head_major = _judge(
        p, d, request, lambda steps: tuple(dataclasses.replace(s, layout=KVLayout.HEAD_MAJOR) for s in steps)
    )
    assert "I2" in head_major


# -- kvgeom mode's push permute: P writes head-major pages, D's receive step permutes them ------------------
PUSH_SETUPS = [  # P TP, D TP, P block (D blocks are 16)
    (1, 1, 16),
    (1, 2, 16),
    (2, 4, 16),
    (4, 2, 16),
    (2, 1, 16),
    (4, 1, 32),  # bsr 2: one head per P rank
    (4, 2, 64),  # bsr 4
    (8, 2, 32),  # P replicates the KV heads
]


@pytest.mark.parametrize("setup", PUSH_SETUPS)
def test_permuted_pushes_pass_the_oracle_in_kvgeom_mode(setup: tuple[int, int, int]) -> None:
    p, d, request = _pair(*setup)
    assert run_push(M4, p, d, request, "kvgeom").ok


@pytest.mark.parametrize("setup", [(1, 2, 16), (4, 1, 32)])
def test_permuted_pushes_pass_the_oracle_with_a_prefix_hit_and_the_n_minus_1_flow(setup) -> None:
    p, d, _ = _pair(*setup)
    # D holds 3 blocks of 16 for 40 tokens, its first one cached (2 listed); P computed 39 (D recomputes
    # the last): ceil(39 / P block) blocks
    p_ids = [list(range(1, 1 + -(-39 // p.block_size)))]
    request = Request(40, p_ids, [[3, 5]], prefix_blocks=1, prefill_tokens=39)
    assert run_push(M4, p, d, request, "kvgeom", prefix_caching=True).ok


@pytest.mark.parametrize("setup", [(1, 1, 16), (4, 2, 16), (4, 1, 32)])
def test_the_oracle_catches_a_push_without_the_receive_permute(setup: tuple[int, int, int]) -> None:
    p, d, request = _pair(*setup)
    oracle = Oracle.for_engines(M4, p, d, request)
    for rp in push_plans(M4, p, d, request, "kvgeom"):
        oracle.execute(oracle.moves_of(rp), f"rank {rp.rank}")
    for rank in range(d.tp_size):
        geom = oracle.d[rank]
        steps, zero = receive_step(geom, oracle.p[0], request.d_ids, request.p_ids, request.num_tokens)
        assert steps and all(s.layout is KVLayout.TOKEN_MAJOR for s in steps)
        oracle.receive(geom.global_rank, (), zero)  # the permute left out
    assert "I2" in {v.invariant for v in oracle.report().violations}
