"""The oracle judges CSA-linear plans byte by byte: a ring block and the replicated state page are needed
whole (docs/vllm-behaviour.md B.6.14). Each test plants one bug in a correct plan of the default
``csa_linear_model()`` and checks the invariant and the coordinates the oracle names.

Request (``Request.simple``, 40 tokens, block 16): MLA blocks 1-3, ring block 4, GDN slot 5, PLE slot 6 on
both sides. Pages: MLA 256 B per block and region, ring 64 B, GDN state 144 + 64 B (TP1), PLE 48 B."""

from __future__ import annotations

import numpy as np
import pytest

from kvgeom.layout.engine import EngineConfig
from kvgeom.model.csa import csa_linear_model
from kvgeom.model.layers import MambaSpec
from kvgeom.testing import ZERO, Oracle, RankPlan, Report, Request, pull_plans, push_plans

SRC_REGION, SRC_OFF, DST_REGION, DST_OFF, LENGTH = 1, 2, 4, 5, 6
MODEL = csa_linear_model()
P1, P2, D1 = (EngineConfig(tp_size=t, block_size=16, num_blocks=8) for t in (1, 2, 1))
REQ = Request.simple(MODEL, P1, D1, 40)
RING, PLE = 4 * 256, 6 * 256  # byte offsets of the ring block and the PLE slot in their regions


def _run(p: EngineConfig, plans: list[RankPlan], mutate=None) -> Report:
    oracle = Oracle.for_engines(MODEL, p, D1, REQ)
    for rp in plans:
        moves = oracle.moves_of(rp)
        oracle.execute(mutate(moves) if mutate else moves, f"rank {rp.rank}")
        if rp.plan.mode == "pull":
            oracle.receive(rp.rank, rp.plan.regroup, rp.plan.zero)
    return oracle.report()


def test_request_holds_one_ring_block_and_one_replicated_slot() -> None:
    assert REQ.d_ids == ((1, 2, 3), (4,), (5,), (6,)) and REQ.p_ids == REQ.d_ids


@pytest.mark.parametrize("compat", ["vllm", "kvgeom"])
@pytest.mark.parametrize("p", [P1, P2])
def test_correct_plans_pass(compat: str, p: EngineConfig) -> None:
    report = _run(p, pull_plans(MODEL, p, D1, REQ, compat))
    assert report.ok, report
    # 3 MLA blocks x 2 regions x 256 + ring 2 x 256 + GDN 2 x 208 + PLE 48 (vLLM at P TP2: PLE from each P rank)
    extra = 48 if (compat, p) == ("vllm", P2) else 0
    assert report.bytes_moved == 1536 + 512 + 416 + 48 + extra


def test_push_plans_pass() -> None:
    report = _run(P1, push_plans(MODEL, P1, D1, REQ, "vllm"))
    assert report.ok and report.bytes_moved == 2512, report


def _is_ring(moves: np.ndarray) -> np.ndarray:
    return (moves[:, DST_OFF] == RING) & (moves[:, LENGTH] == 256)


def _is_ple(moves: np.ndarray) -> np.ndarray:
    return (moves[:, DST_REGION] == 0) & (moves[:, DST_OFF] == PLE)


def test_a_ring_block_left_behind() -> None:
    def drop(moves: np.ndarray) -> np.ndarray:
        assert _is_ring(moves).sum() == 2
        return moves[~(_is_ring(moves) & (moves[:, DST_REGION] == 1))]  # the second scratch region

    report = _run(P1, pull_plans(MODEL, P1, D1, REQ, "vllm"), drop)
    assert report.invariants == {"I3"}
    v = report.of("I3")[0]
    assert (v.region, v.start) == (1, RING) and "layers.2.ring ring entry 0" in v.expected


def test_a_ring_read_from_a_token_block() -> None:
    def wrong_block(moves: np.ndarray) -> np.ndarray:
        moves[_is_ring(moves), SRC_OFF] = 256  # P's MLA block 1, not its ring block 4
        return moves

    report = _run(P1, pull_plans(MODEL, P1, D1, REQ, "kvgeom"), wrong_block)
    assert "I2" in report.invariants
    v = report.of("I2")[0]
    assert "ring entry" in v.expected and "latent token" in v.found


def test_a_replicated_page_sharded_like_a_state() -> None:
    """Split handles that treat the replicated page as a sharded state: source ``p`` fills D's bytes
    ``[24p, 24p + 24)`` from the start of its own page (vLLM keeps the page whole in every split)."""

    def shard(moves: np.ndarray) -> np.ndarray:
        ple = np.flatnonzero(_is_ple(moves))
        assert ple.size == 2  # one from each P rank
        moves[ple, LENGTH:] = 24
        moves[ple, DST_OFF] += np.array([0, 24])
        return moves

    report = _run(P2, pull_plans(MODEL, P2, D1, REQ, "vllm"), shard)
    assert report.invariants == {"I2"}
    v = report.of("I2")[0]
    assert (v.region, v.start, v.stop) == (0, PLE + 24, PLE + 48)
    assert "ple state channel 4 row 0" in v.expected and "ple state channel 0 row 0" in v.found


def test_a_replicated_page_cut_short() -> None:
    def short(moves: np.ndarray) -> np.ndarray:
        moves[_is_ple(moves), LENGTH:] = 24  # source and destination lengths
        return moves

    report = _run(P1, pull_plans(MODEL, P1, D1, REQ, "kvgeom"), short)
    assert report.invariants == {"I3"}
    v = report.of("I3")[0]
    assert (v.region, v.start, v.stop) == (
        0,
        PLE + 24,
        PLE + 48,
    ) and "ple state channel 4 row 0" in v.expected


def test_a_replicated_page_from_the_wrong_region() -> None:
    def other_region(moves: np.ndarray) -> np.ndarray:
        moves[_is_ple(moves), SRC_REGION] = 1  # region 1 holds no PLE page: P's bytes there are no coordinate
        return moves

    report = _run(P1, pull_plans(MODEL, P1, D1, REQ, "vllm"), other_region)
    assert report.invariants == {"I2"}
    v = report.of("I2")[0]
    assert (v.region, v.start) == (0, PLE) and "ple state channel 0" in v.expected


@pytest.mark.parametrize("compat", ["vllm", "kvgeom"])
@pytest.mark.parametrize("mode", ["pull", "push"])
@pytest.mark.parametrize("tp", [1, 2])
def test_packed_rows_pass(compat: str, mode: str, tp: int) -> None:
    """vLLM's block-outermost allocation (kvgeom.layout.csarows): regions at row offsets 0 (MLA 256 B), 256 (MLA),
    64 (ring, 64 B) and 208 (GDN, 208 B; at TP2 104 at 104). Per D rank, vllm mode: the MLA groups read their 3
    blocks from every region (256 + 256 + 64 + 208 = 784 B, TP2 680 B, each), the ring its block from the
    scratch regions (256 + 64), the GDN state from regions 0 and 3 (2 x 208, TP2 2 x 104), the PLE page 48 B.
    kvgeom mode sends each group through its own pages only: the MLA blocks through regions 0 and 1 (512 B
    each), the ring's through its two 64-byte pages (128 B)."""
    p, d = (EngineConfig(tp_size=tp, block_size=16, num_blocks=8, packed_rows=True) for _ in "pd")
    req = Request.simple(MODEL, p, d, 40)
    make = pull_plans if mode == "pull" else push_plans
    oracle = Oracle.for_engines(MODEL, p, d, req)
    for rp in make(MODEL, p, d, req, compat):
        oracle.execute(oracle.moves_of(rp), f"rank {rp.rank}")
        if rp.plan.mode == "pull":
            oracle.receive(rp.rank, rp.plan.regroup, rp.plan.zero)
    report = oracle.report()
    tokens, ring = (784 if tp == 1 else 680, 320) if compat == "vllm" else (512, 128)
    per_rank = 3 * tokens + ring + (416 if tp == 1 else 208) + 48
    assert report.ok and report.bytes_moved == tp * per_rank, report


def test_packed_rows_missing_state_is_caught() -> None:
    """Packed rows (row 512 B): the GDN state of layer 3 has region 3 to itself; a plan that skips its slot-5
    moves (conv pieces Q, K, V of 48 B and the 64-byte temporal state) leaves bytes [5 x 512, 5 x 512 + 208)
    of D's region 3 unwritten (I3)."""
    p = EngineConfig(tp_size=1, block_size=16, num_blocks=8, packed_rows=True)
    req = Request.simple(MODEL, p, p, 40)
    oracle = Oracle.for_engines(MODEL, p, p, req)
    for rp in pull_plans(MODEL, p, p, req, "vllm"):
        moves = oracle.moves_of(rp)
        slot = (moves[:, DST_OFF] >= 5 * 512) & (moves[:, DST_OFF] < 5 * 512 + 208)
        keep = ~((moves[:, DST_REGION] == 3) & slot)
        assert moves[~keep, LENGTH].tolist() == [48, 48, 48, 64]
        oracle.execute(moves[keep], f"rank {rp.rank}")
        oracle.receive(rp.rank, rp.plan.regroup, rp.plan.zero)
    report = oracle.report()
    assert not report.ok
    assert {(v.invariant, v.region) for v in report.violations} == {("I3", 3)}
    assert report.violated_bytes["I3"] == 208


def _gqa_report(heads: int, gdn: MambaSpec | None, p_tp: int, d_tp: int, mode: str, compat: str) -> Report:
    model = csa_linear_model(main_kv_heads=heads, gdn=gdn)
    p, d = (EngineConfig(tp_size=t, block_size=16, num_blocks=16) for t in (p_tp, d_tp))
    req = Request.simple(model, p, d, 40)
    make = pull_plans if mode == "pull" else push_plans
    oracle = Oracle.for_engines(model, p, d, req)
    for rp in make(model, p, d, req, compat):
        oracle.execute(oracle.moves_of(rp), f"rank {rp.rank}")
        if rp.plan.mode == "pull":
            oracle.receive(rp.rank, rp.plan.regroup, rp.plan.zero)
    return oracle.report()


# Head-sharded main KV (``main_kv_heads``, B.6.14): 40 tokens, main-KV blocks 1-3 and MLA blocks 4-6; each token
# group reads its 3 blocks through every region (2 main-KV regions of 512 B per local head, 2 MLA regions of
# 256 B); rings 2 x 256, GDN 2 x its state, PLE 48 B. Per D rank, ``heads_d`` heads on D and GDN state ``gdn_b``:
# 6 x (2 x 512 x heads_d + 512) + 512 + 2 x gdn_b + 48.
GQA_CASES = [
    # K=2, default GDN(2, 4, 2, 4) (208 B at TP1, 104 B at TP2): equal TP 1 and 2
    (2, None, 1, 1, 6 * (2048 + 512) + 512 + 416 + 48),
    (2, None, 2, 2, 2 * (6 * (1024 + 512) + 512 + 208 + 48)),
    # K=2, GDN(4, 4, 4, 4) (104 B at TP4): P TP2 -> D TP4, each D rank one (replicated) head
    (2, MambaSpec.gdn(4, 4, 4, 4), 2, 4, 4 * (6 * (1024 + 512) + 512 + 208 + 48)),
    # K=4: P TP1 -> D TP2, two heads per D rank
    (4, None, 1, 2, 2 * (6 * (2048 + 512) + 512 + 208 + 48)),
]


@pytest.mark.parametrize("compat", ["vllm", "kvgeom"])
@pytest.mark.parametrize("mode", ["pull", "push"])
@pytest.mark.parametrize(("heads", "gdn", "p_tp", "d_tp", "total"), GQA_CASES)
def test_head_sharded_main_kv_plans_pass(
    heads: int, gdn: MambaSpec | None, p_tp: int, d_tp: int, total: int, mode: str, compat: str
) -> None:
    report = _gqa_report(heads, gdn, p_tp, d_tp, mode, compat)
    assert report.ok and report.bytes_moved == total, report


@pytest.mark.parametrize(
    ("compat", "total"),
    [
        ("vllm", 6 * (2 * 2 * 1024 + 2 * 2 * 256) + 2 * 2 * 256 + 2 * 208 + 2 * 48),
        ("kvgeom", 6 * (2 * 2 * 1024 + 2 * 256) + 2 * 256 + 2 * 208 + 48),
    ],
)
def test_head_sharded_main_kv_from_more_p_ranks(compat: str, total: int) -> None:
    """K=4, P TP2 -> D TP1 (pull): D's 4-head page takes 2 x 1024 B head slices per main-KV block. vLLM reads
    the MLA regions, the rings and the PLE page whole from both P ranks (identical copies): 32,256 B. kvgeom
    mode reads each 256-byte MLA or ring page as two 128-byte halves, one from each P rank, and the PLE page
    once: 28,624 B."""
    report = _gqa_report(4, None, 2, 1, "pull", compat)
    assert report.ok and report.bytes_moved == total, report


def test_head_sharded_main_kv_block_left_behind_is_caught() -> None:
    """A pull that skips D's main-KV block 2 in region 0 (1024 B at byte 2 x 1024) leaves it unwritten (I3)."""
    model = csa_linear_model(main_kv_heads=2)
    p = EngineConfig(tp_size=1, block_size=16, num_blocks=16)
    req = Request.simple(model, p, p, 40)
    oracle = Oracle.for_engines(model, p, p, req)
    for rp in pull_plans(model, p, p, req, "vllm"):
        moves = oracle.moves_of(rp)
        skip = (moves[:, DST_REGION] == 0) & (moves[:, DST_OFF] == 2 * 1024)
        assert moves[skip, LENGTH].tolist() == [1024]
        oracle.execute(moves[~skip], f"rank {rp.rank}")
        oracle.receive(rp.rank, rp.plan.regroup, rp.plan.zero)
    report = oracle.report()
    assert {(v.invariant, v.region) for v in report.violations} == {("I3", 0)}
    assert report.violated_bytes["I3"] == 1024


@pytest.mark.parametrize("compat", ["vllm", "kvgeom"])
@pytest.mark.parametrize("mode", ["pull", "push"])
@pytest.mark.parametrize("tp", [1, 2])
def test_packed_rows_with_main_kv_pass(compat: str, mode: str, tp: int) -> None:
    """Packed rows with a 2-head main KV (one token group: blocks 1-3; ring 4, GDN 5, PLE 6). Regions: 0 (main
    KV, 1024 B; TP2 512), 2048 (MLA 256), 1024 (main KV; TP2 at 512), 2304 (MLA; TP2 1280), 64 (ring, 64 B),
    208 (GDN, 208 B; TP2 104 at 104). Per D rank: the token group's 3 blocks through every region (TP1 2832 B,
    TP2 1704 B each), the ring block from scratch regions 0 and 4 (TP1 1024 + 64, TP2 512 + 64), the GDN state
    from regions 0 and 5 (2 x 208, TP2 2 x 104), the PLE page 48 B. kvgeom mode: the token blocks through the
    main-KV and MLA pages only (TP1 1024 + 256 + 1024 + 256 = 2560 B, TP2 1536 B), the ring's through its two
    64-byte pages."""
    model = csa_linear_model(main_kv_heads=2)
    p, d = (EngineConfig(tp_size=tp, block_size=16, num_blocks=8, packed_rows=True) for _ in "pd")
    req = Request.simple(model, p, d, 40)
    assert req.d_ids == ((1, 2, 3), (4,), (5,), (6,))
    make = pull_plans if mode == "pull" else push_plans
    oracle = Oracle.for_engines(model, p, d, req)
    for rp in make(model, p, d, req, compat):
        oracle.execute(oracle.moves_of(rp), f"rank {rp.rank}")
        if rp.plan.mode == "pull":
            oracle.receive(rp.rank, rp.plan.regroup, rp.plan.zero)
    report = oracle.report()
    if compat == "vllm":
        per_rank = 3 * 2832 + 1088 + 416 + 48 if tp == 1 else 3 * 1704 + 576 + 208 + 48
    else:
        per_rank = 3 * 2560 + 128 + 416 + 48 if tp == 1 else 3 * 1536 + 128 + 208 + 48
    assert report.ok and report.bytes_moved == tp * per_rank, report


def test_shared_rows_claim_and_zero_only_their_own_block() -> None:
    """Packed rows with a 2-head main KV at TP1 (rows of 2,560 B; regions start at row bytes 0, 2048, 1024,
    2304, 64 and 208). Region 5's view of block 6 is row bytes [6 x 2560 + 208, 7 x 2560): the 208 bytes
    after it are row 7's, not block 6's. N-1 flow, 33 tokens of which P computed 32: D's third token block
    (6) is D's own and starts zeroed; row 7 belongs to no group of the request and must stay outside it
    (a write there is I1), and the request's plan must pass with nothing of row 7 touched."""
    model = csa_linear_model(main_kv_heads=2)
    e = EngineConfig(tp_size=1, block_size=16, num_blocks=8, packed_rows=True)
    req = Request(33, ((1, 2), (3,), (4,), (5,)), ((1, 2, 6), (3,), (4,), (5,)), prefill_tokens=32)
    oracle = Oracle.for_engines(model, e, e, req)
    geom = oracle.d[0]
    assert [r.row_offset for r in geom.regions] == [0, 2048, 1024, 2304, 64, 208]
    row = 2560
    assert (oracle.d_images[0].role[0][7 * row : 8 * row] == 0).all()  # OUTSIDE
    assert (oracle.dst[0][0][6 * row : 7 * row] == ZERO).all()  # D's own block, zeroed through every region
    for rp in pull_plans(model, e, e, req, "kvgeom"):
        oracle.execute(oracle.moves_of(rp), f"rank {rp.rank}")
        oracle.receive(rp.rank, rp.plan.regroup, rp.plan.zero)
    assert oracle.report().ok
    oracle.execute(np.array([[0, 0, 1 * row, 0, 0, 7 * row, 8]]), "planted")  # 8 bytes into row 7
    report = oracle.report()
    assert {(v.invariant, v.region) for v in report.violations} == {("I1", 0)}
    assert report.violated_bytes["I1"] == 8
