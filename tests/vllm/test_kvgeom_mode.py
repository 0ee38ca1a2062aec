"""kvgeom mode serves P/D pairs that vLLM 0.33.0 refuses, through vLLM's own worker code and real NIXL.

Each pair is first shown refused in vLLM-compatible mode (vLLM's handshake rules, answered by kvgeom).
Then P and D run as separate processes (``_nixl_pairs``): vLLM's NIXL workers in kvgeom mode with real
NIXL agents, registering real CPU caches; D pulls one request through vLLM's ``start_load_kv`` and
``get_transfer_results``. The caches start from kvgeom's byte oracle (``kvgeom.testing.Oracle``): every
P byte encodes the token coordinate (or, outside the request, the location) the oracle gives it, every
D byte its location or POISON. The descriptor pairs D's worker posted are replayed on the oracle with
kvgeom's post-receive step, which must find no violation of I1-I6; and every byte of D's caches after
the real transfer must equal the oracle's result (so NIXL moved exactly those bytes, and the
post-receive step ran on the tensors as the oracle ran it).
"""

from __future__ import annotations

import re

import numpy as np
import pytest
from _nixl_pairs import HEAD_BYTES as HEAD_BYTES_
from _nixl_pairs import HEADS, consumer_main, make_worker, producer_main
from _vllm_workers import RecordingNixl
from kvgeom_lab.procs import ProcGroup

from kvgeom import GeometryCard
from kvgeom.plan.requestplan import contiguous_runs
from kvgeom.testing import POISON, ZERO, Oracle, Request

pytestmark = pytest.mark.nixl

TIMEOUT_S = 240.0


def project(tags: np.ndarray) -> np.ndarray:
    """The byte a tag is stored as: 0 for ZERO, else a hash of the tag in 1..255 (POISON included)."""
    h = (tags.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)) >> np.uint64(56)
    out = (np.uint64(1) + h % np.uint64(255)).astype(np.uint8)
    out[tags == ZERO] = 0
    return out


def _metadata(worker: object) -> object:
    import msgspec
    from kvgeom_vllm.handshake import KvgeomAgentMetadata

    return msgspec.msgpack.decode(
        worker.xfer_handshake_metadata.agent_metadata_bytes, type=KvgeomAgentMetadata
    )


def refused_in_vllm_mode(p: dict, d: dict) -> str:
    """vLLM-compatible D rank 0 handshaking with P's first target: the refusal's text (or '')."""
    producers = {
        r: make_worker("P", p["tp"], r, p["block_size"], p["num_blocks"], p["layout"], "vllm", RecordingNixl)
        for r in range(p["tp"])
    }
    consumer = make_worker(
        "D",
        d["tp"],
        0,
        d["block_size"],
        d["num_blocks"],
        d["layout"],
        "vllm",
        RecordingNixl,
        permute=d.get("permute", False),
    )
    try:
        for target in consumer.transfer_topo.handshake_target_ranks(p["tp"]):
            consumer.add_remote_agent(
                _metadata(producers[target]), remote_tp_rank=target, remote_tp_size=p["tp"]
            )
    except (AssertionError, RuntimeError, NotImplementedError, ValueError) as e:
        return str(e)
    return ""


def serve(p: dict, d: dict, num_tokens: int, prefix_blocks: int = 0) -> tuple[Oracle, dict, dict]:
    """Run one request from P's ranks to D's in separate processes; the oracle replays what D posted."""
    with ProcGroup() as group:
        up, to_p, to_d = group.queue(), group.queue(), group.queue()
        group.spawn(producer_main, (p, up, to_p), "P")
        group.spawn(consumer_main, (d, up, to_d), "D")
        hello = {}
        while len(hello) < 2:
            who, cards, meta = up.get(timeout=TIMEOUT_S)
            hello[who] = ([GeometryCard.loads(c) for c in cards], meta)
        p_cards, p_meta = hello["P"]
        d_cards = hello["D"][0]
        model = p_cards[0].model
        request = Request.simple(model, p_cards[0].engine, d_cards[0].engine, num_tokens, prefix_blocks)
        oracle = Oracle(model, [c.geometry for c in p_cards], [c.geometry for c in d_cards], request)
        to_p.put(([[project(a) for a in rank] for rank in oracle.src], "req-P"))
        assert up.get(timeout=TIMEOUT_S)[:2] == ("P", "filled")
        to_d.put(
            (
                [[project(a) for a in rank] for rank in oracle.dst],
                len(p_cards),
                p_meta,
                {
                    "p_ids": request.p_ids,
                    "d_ids": request.d_ids,
                    "p_tokens": request.p_tokens,
                    "prefix_blocks": prefix_blocks,
                },
            )
        )
        results = group.collect(timeout_s=TIMEOUT_S)
    return oracle, results["P"].unwrap(), results["D"].unwrap()


def check(oracle: Oracle, produced: dict, consumed: dict) -> None:
    ranks = consumed["ranks"]
    assert all("refused" not in r for r in ranks), ranks
    assert all(s == ["req-P"] for s in produced["finished_sending"]), produced  # every P rank was released
    for rank, r in enumerate(ranks):
        assert len(r["moves"]), f"D rank {rank} read nothing"
        oracle.execute(r["moves"], f"D rank {rank}'s reads")
        oracle.receive(rank, r["regroup"], r["zero"], f"D rank {rank}'s post-receive step")
    report = oracle.report()
    assert report.ok, report.violations[:5]
    assert report.bytes_moved > 0
    for rank, r in enumerate(ranks):
        for region, (got, want) in enumerate(zip(r["bytes"], oracle.dst[rank], strict=True)):
            bad = np.flatnonzero(got != project(want))
            assert not bad.size, (
                f"D rank {rank} region {region}: {bad.size} bytes differ from the oracle, first at {bad[0]}"
            )
        assert all((w != POISON).all() for w in oracle.dst[rank])  # no destination byte left unwritten


def posts_the_fewest_descriptors(consumed: dict) -> bool:
    """kvgeom mode: every D rank posted per-request lists, one descriptor per maximal run contiguous on both
    sides (the count ``contiguous_runs`` gives for the bytes it moved)."""
    ranks = consumed["ranks"]
    return all(
        r["merged"] and all(r["merged"]) and len(r["moves"]) == contiguous_runs(r["moves"][:, :7])
        for r in ranks
    )


# vLLM's CPU attention backend takes kernel blocks of multiples of 32 tokens
HEAD_MAJOR_P = {"tp": 2, "block_size": 32, "num_blocks": 8, "layout": "LBHNC", "compat": "kvgeom"}
HEAD_MAJOR_D = {"tp": 1, "block_size": 64, "num_blocks": 5, "layout": "LBHNC", "compat": "kvgeom"}


def test_p_tp_above_d_tp_with_a_block_size_ratio_is_refused_by_vllm_and_served_by_kvgeom() -> None:
    # vLLM 0.33.0: head-sharded reads with P_TP > D_TP need equal block sizes
    why = refused_in_vllm_mode({**HEAD_MAJOR_P, "compat": "vllm"}, {**HEAD_MAJOR_D, "compat": "vllm"})
    assert re.search(r"P.TP > D.TP", why) and "block sizes" in why, why
    oracle, produced, consumed = serve(HEAD_MAJOR_P, HEAD_MAJOR_D, num_tokens=150)
    check(oracle, produced, consumed)
    assert posts_the_fewest_descriptors(consumed)
    assert oracle.result.regrouped_blocks > 0  # D's head-major blocks arrived as two P pages each


TOKEN_MAJOR_P = {"tp": 1, "block_size": 64, "num_blocks": 5, "layout": "LBNHC", "compat": "kvgeom"}
TOKEN_MAJOR_D = {"tp": 2, "block_size": 32, "num_blocks": 8, "layout": "LBNHC", "compat": "kvgeom"}


def test_p_blocks_larger_than_ds_across_tp_sizes_are_refused_by_vllm_and_served_by_kvgeom() -> None:
    # vLLM 0.33.0: D's block must be a multiple of P's (and a head split needs a block-contiguous layout)
    why = refused_in_vllm_mode({**TOKEN_MAJOR_P, "compat": "vllm"}, {**TOKEN_MAJOR_D, "compat": "vllm"})
    assert "not divisible" in why, why
    oracle, produced, consumed = serve(TOKEN_MAJOR_P, TOKEN_MAJOR_D, num_tokens=150, prefix_blocks=1)
    check(oracle, produced, consumed)
    assert posts_the_fewest_descriptors(consumed)


def test_vllm_compatible_card_pairs_are_planned_by_kvgeom_byte_for_byte() -> None:
    # a pair vLLM serves (D TP2 reads half of P TP1's heads, two P blocks per D block): with cards on both
    # sides the vLLM-compatible path is kvgeom's plan too, and its bytes are right
    p = {"tp": 1, "block_size": 32, "num_blocks": 8, "layout": "LBHNC", "compat": "vllm"}
    d = {"tp": 2, "block_size": 64, "num_blocks": 5, "layout": "LBHNC", "compat": "vllm"}
    assert refused_in_vllm_mode(p, d) == ""
    oracle, produced, consumed = serve(p, d, num_tokens=150)
    check(oracle, produced, consumed)
    assert oracle.result.regrouped_blocks > 0
    # vLLM-compatible mode posts vLLM's descriptor ids into the prepared lists, not merged runs
    assert all(r["merged"] and not any(r["merged"]) for r in consumed["ranks"])


@pytest.mark.parametrize("compat", ["vllm", "kvgeom"])
def test_head_major_p_pulled_into_a_token_major_d_that_permutes(compat: str) -> None:
    # vLLM's enable_permute_local_kv on D (B.6.15): D TP2 reads half of P TP1's heads, two P blocks per D block,
    # into its token-major pages as if head-major, then kvgeom's token-major regroup; without the setting refused
    p = {"tp": 1, "block_size": 32, "num_blocks": 8, "layout": "LBHNC", "compat": compat}
    d = {"tp": 2, "block_size": 64, "num_blocks": 5, "layout": "LBNHC", "compat": compat, "permute": True}
    assert "enable_permute_local_kv" in refused_in_vllm_mode(p, {**d, "permute": False})
    assert refused_in_vllm_mode(p, d) == ""
    oracle, produced, consumed = serve(p, d, num_tokens=150)
    check(oracle, produced, consumed)
    assert oracle.result.regrouped_blocks > 0
    assert posts_the_fewest_descriptors(consumed) == (compat == "kvgeom")


def test_a_request_vllm_would_move_to_the_wrong_tokens_fails_instead() -> None:
    # the same vLLM-served pair, but D holds the first block already: vLLM pairs P's and D's blocks by count
    # and would write P's first block into D's second; with cards kvgeom refuses that request, which fails
    # like a failed transfer (D recomputes it), with nothing posted
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import NixlConnectorMetadata

    p = make_worker("P", 1, 0, 32, 8, "LBHNC", "vllm", RecordingNixl)
    d = make_worker("D", 2, 0, 64, 5, "LBHNC", "vllm", RecordingNixl)
    d._remote_agents["P"][(0, 0)] = d.add_remote_agent(_metadata(p), remote_tp_rank=0, remote_tp_size=1)
    meta = NixlConnectorMetadata()
    meta.add_new_req_to_recv(
        "req",
        [[2, 3]],
        {
            "remote_block_ids": [[1, 2, 3, 4, 5]],
            "remote_engine_id": "P",
            "remote_request_id": "req-P",
            "remote_host": "localhost",
            "remote_port": 0,
            "tp_size": 1,
            "remote_num_tokens": 150,
        },
        local_num_computed_blocks=(1,),
        awaiting_kvs=True,
    )
    d.start_load_kv(meta)
    assert d.nixl_wrapper.xfers == []
    result = d.get_transfer_results()
    assert result.failed_recving == {"req"} and result.finished_recving == {"req"}


def test_push_across_tp_sizes_on_a_token_major_layout_is_refused_by_vllm_and_written_by_kvgeom() -> None:
    # vLLM 0.33.0 splits heads across TP sizes only on block-contiguous layouts; kvgeom mode writes a token-major
    # page per token. P's workers post the WRITEs of kvgeom's plan (recorded, then replayed on the oracle).
    from _nixl_pairs import _moves

    def engines(compat: str) -> tuple[list, object]:
        d = make_worker("D", 1, 0, 32, 6, "LBNHC", compat, RecordingNixl, push=True)
        ps = [make_worker("P", 2, r, 32, 6, "LBNHC", compat, RecordingNixl, push=True) for r in range(2)]
        return ps, d

    ps, d = engines("vllm")
    with pytest.raises(RuntimeError, match="block-contiguous"):
        ps[0].add_remote_agent(_metadata(d), remote_tp_rank=0, remote_tp_size=1)
    ps, d = engines("kvgeom")
    model = ps[0].kvgeom_card.model
    request = Request.simple(model, ps[0].kvgeom_card.engine, d.kvgeom_card.engine, num_tokens=70)
    oracle = Oracle(model, [p.kvgeom_card.geometry for p in ps], [d.kvgeom_card.geometry], request)
    d_regions = [
        [
            (b, n * s)
            for b, n, s in zip(d.kv_caches_base_addr["D"][0], d.region_num_blocks, d.block_stride_per_layer)
        ]
    ]
    for rank, p in enumerate(ps):
        for target in p.transfer_topo.handshake_target_ranks(1):
            p._remote_agents["D"][(0, target)] = p.add_remote_agent(
                _metadata(d), remote_tp_rank=target, remote_tp_size=1
            )
        registration = {
            "request_id": "req-D",
            "decode_engine_id": "D",
            "decode_host": "",
            "decode_port": 0,
            "decode_tp_size": 1,
            "local_block_ids": [list(g) for g in request.d_ids],
            "kvgeom_num_tokens": request.num_tokens,
        }  # what D's push scheduler registers
        p._do_start_push_kv(
            "req", [list(g) for g in request.p_ids], registration
        )  # vLLM's code, then kvgeom's
        assert [x[0] for x in p.nixl_wrapper.xfers] == ["WRITE"] and p._sending_transfers["req"]
        assert p.nixl_wrapper.xfers[0][5] == b"req-D:2"  # D counts a notification from each of P's two ranks
        moves = _moves(p, rank, d_regions, op="WRITE")
        assert p.nixl_wrapper.xfers[0][1] in p.nixl_wrapper.per_request and len(moves) == contiguous_runs(
            moves[:, :7]
        )  # merged runs
        oracle.execute(moves, f"P rank {rank}'s writes")
    report = oracle.report()
    assert report.ok, report.violations[:5]
    # every token slot of D's 3 blocks of 32 (70 tokens) in every layer, each from the P rank holding its head
    assert report.bytes_moved == 12 * 3 * 32 * HEADS * HEAD_BYTES_


@pytest.mark.parametrize("compat", ["vllm", "kvgeom"])
def test_head_major_p_pushed_into_a_token_major_d_that_permutes_is_refused_by_the_drop_in(
    compat: str,
) -> None:
    # B.6.15 in push: vLLM's P refuses D's LBNHC at its handshake; vllm mode refuses it too. kvgeom's core plans
    # it (kvgeom.plan.receive.receive_step permutes on D), but the drop-in's push D runs no receive step yet, so its P
    # refuses the pair at the handshake, typed, instead of leaving head-major pages in D's token-major cache
    d = make_worker("D", 2, 0, 32, 6, "LBNHC", compat, RecordingNixl, push=True, permute=True)
    p = make_worker("P", 1, 0, 32, 6, "LBHNC", compat, RecordingNixl, push=True)
    with pytest.raises(RuntimeError, match="kv_layout") as e:
        p.add_remote_agent(_metadata(d), remote_tp_rank=0, remote_tp_size=2)
    why = "notification-only" if compat == "vllm" else "does not run D's receive step in push"
    assert why in str(e.value) and "'head_major'" in str(e.value) and "'token_major'" in str(e.value)
    assert p.nixl_wrapper.xfers == []
