"""Exact plans and refusals with decode context parallelism through :func:`kvgeom.plan.request.plan_request` and
:func:`kvgeom.plan.request.receive_step`.

MLA model, one layer, latent 8 fp16 = 16 B per token: a 4-token page is 64 B (block ``b`` at ``64 b``).
With DCP the scheduler's block is ``dcp`` pages and global page ``j * dcp + rank`` is rank ``rank``'s
list entry ``j`` (:mod:`kvgeom.pair.dcp`)."""

from __future__ import annotations

import pytest

from kvgeom import EngineConfig, MLASpec, ModelSpec, Pairing, rank_geometry
from kvgeom.errors import PlanError, TokenCountError, UnsupportedError
from kvgeom.plan.receive import receive_step
from kvgeom.plan.request import plan_request

MLA = ModelSpec.from_layers("mla", [MLASpec(8, "float16")])


def _g(tp: int, rank: int = 0, block: int = 4, dcp: int = 1, kernel: int | None = None):  # type: ignore[no-untyped-def]
    e = EngineConfig(
        tp_size=tp, tp_rank=rank, block_size=block, num_blocks=16, dcp_size=dcp, kernel_block_size=kernel
    )
    return rank_geometry(MLA, e)


def _d1_from_p1(compat: str, pc: bool = False) -> Pairing:
    """D TP2 DCP2 rank 1 (pages 1, 3, ...: tokens 4..7, 12..15) pulls from P TP1 (4-token blocks)."""
    pairing = Pairing.create(_g(2, 1, dcp=2), [_g(1)], "pull", compat, prefix_caching=pc)
    assert pairing.dcp_active
    return pairing


def _t(plan) -> list[tuple[int, list[int], list[int], str]]:  # type: ignore[no-untyped-def]
    return [(t.remote_rank, t.local_ids.tolist(), t.remote_ids.tolist(), t.notif) for t in plan.transfers]


@pytest.mark.parametrize("compat", ["kvgeom", "vllm"])
def test_pull_reads_the_pages_of_this_rank(compat: str) -> None:
    # 12 tokens: D rank 1's list [5, 6] = pages 1 (tokens 4..7) and 3 (12..15, past the request).
    # P's [3, 4, 7] hold tokens 0..3, 4..7, 8..11: D block 5 <- P block 4. Both D ranks read P: "req:2".
    plan = plan_request(_d1_from_p1(compat), [[5, 6]], [[3, 4, 7]], num_tokens=12)
    assert _t(plan) == [(0, [5], [4], "req:2")]
    assert plan.expected_notifications == 2 and plan.consumer_rank == 1 and plan.notify_only == ()
    # kvgeom mode zeroes D block 6 (nothing computed it); vLLM mode zeroes nothing
    assert plan.zero.tolist() == ([[0, 384, 64]] if compat == "kvgeom" else [])


@pytest.mark.parametrize("compat", ["kvgeom", "vllm"])
def test_num_tokens_places_the_list(compat: str) -> None:
    # one D block with num_tokens = 12: ceil(12 / 8) - 1 = 1 cached scheduler block, so block 5 is
    # page 3 (tokens 12..15): nothing to read, block 5 zeroed (kvgeom)
    plan = plan_request(_d1_from_p1(compat), [[5]], [[3, 4, 7]], num_tokens=12)
    assert plan.transfers == () and plan.notify_only == (0,)
    assert plan.zero.tolist() == ([[0, 320, 64]] if compat == "kvgeom" else [])
    # without num_tokens the list is not placed, even in a pair without prefix caching
    with pytest.raises(TokenCountError) as err:
        plan_request(_d1_from_p1(compat), [[5]], [[3, 4, 7]])
    assert err.value.field == "num_tokens" and err.value.values == {"value": None, "group": 0, "blocks": 1}
    # 8 tokens: no cached block, the list starts at page 1 (tokens 4..7) <- P block 4
    plan = plan_request(_d1_from_p1(compat), [[5]], [[3, 4]], num_tokens=8)
    assert _t(plan) == [(0, [5], [4], "req:2")] and plan.zero.shape == (0, 3)
    # P computed 7 tokens in 2 blocks: D's page 3 is past them
    plan = plan_request(_d1_from_p1(compat), [[5]], [[3, 4]], num_tokens=12, prefill_tokens=7)
    assert plan.transfers == ()
    # with prefix caching the list is the uncached tail: num_tokens places it
    plan = plan_request(_d1_from_p1(compat, pc=True), [[5]], [[7]], num_tokens=12)
    assert plan.transfers == () and plan.notify_only == (0,)


@pytest.mark.parametrize("compat", ["kvgeom", "vllm"])
def test_pull_refusals_name_the_argument(compat: str) -> None:
    with pytest.raises(PlanError) as err:
        plan_request(_d1_from_p1(compat, pc=True), [[5]], [[3, 4, 7]])
    assert type(err.value) is TokenCountError
    assert err.value.field == "num_tokens" and err.value.values == {"value": None, "group": 0, "blocks": 1}
    # 12 tokens need 2 scheduler blocks of 8: 3 are too many
    with pytest.raises(PlanError) as err:
        plan_request(_d1_from_p1(compat), [[5, 6, 8]], [[7]], num_tokens=12)
    assert type(err.value) is PlanError
    assert err.value.field == "block_ids[0]" and err.value.values == {"value": 3}
    # 2 blocks for 8 tokens (1 needed): too many; exactly 2 for 9 tokens is fine
    with pytest.raises(PlanError) as err:
        plan_request(_d1_from_p1(compat), [[5, 6]], [[3, 4]], num_tokens=8)
    assert err.value.values == {"value": 2}
    plan_request(_d1_from_p1(compat), [[5, 6]], [[3, 4, 7]], num_tokens=9)


def test_push_writes_every_d_rank_its_pages() -> None:
    # P TP1 [3, 4, 7] (tokens 0..11) pushes to D TP2 DCP2: rank 0's [5, 6] = pages 0 and 2 (tokens 0..3,
    # 8..11) <- P 3, 7; rank 1's [5, 6] = pages 1, 3 (4..7, 12..15) <- P 4. D waits for P_TP = 1 writer.
    pairing = Pairing.create(_g(1), [_g(2, 0, dcp=2), _g(2, 1, dcp=2)], "push", "kvgeom")
    plan = plan_request(pairing, [[3, 4, 7]], [[5, 6]], num_tokens=12)
    assert _t(plan) == [(0, [3, 7], [5, 6], "req:1"), (1, [4], [5], "req:1")]
    assert plan.consumer_rank == -1 and plan.zero.shape == (0, 3)
    # vLLM pushes by count: P's last two [4, 7] -> D rank 0's [5, 6]: other tokens than the token axis
    pairing = Pairing.create(_g(1), [_g(2, 0, dcp=2), _g(2, 1, dcp=2)], "push", "vllm")
    with pytest.raises(UnsupportedError) as err:
        plan_request(pairing, [[3, 4, 7]], [[5, 6]], num_tokens=12)
    assert type(err.value) is UnsupportedError and err.value.field == "block_ids[0]"
    assert err.value.values == {"local": [(4, 5), (7, 6)], "remote": [(3, 5), (7, 6)]}


def test_receive_step_with_dcp_zeroes_pages_p_did_not_send() -> None:
    # D rank 1 [5, 6] = pages 1, 3 (tokens 4..7, 12..15); P sent only tokens 0..3: both zeroed
    regroup, zero = receive_step(_g(2, 1, dcp=2), _g(1), [[5, 6]], [[3]], num_tokens=12)
    assert regroup == () and zero.tolist() == [[0, 320, 64], [0, 384, 64]]
    # P sent 0..11: page 1 is written, page 3 (past the request) zeroed
    _, zero = receive_step(_g(2, 1, dcp=2), _g(1), [[5, 6]], [[3, 4, 7]], num_tokens=12)
    assert zero.tolist() == [[0, 384, 64]]
    # the producer's DCP alone also takes this path: D TP1 [1, 2, 3] (tokens 0..11) from P TP2 DCP2
    # blocks of 4 (pages 0, 1 of 4 tokens on ranks 0, 1: tokens 0..7): D block 3 zeroed
    _, zero = receive_step(_g(1), _g(2, 0, dcp=2), [[1, 2, 3]], [[4]], num_tokens=12)
    assert zero.tolist() == [[0, 192, 64]]


def test_vllm_pull_refuses_where_its_receive_step_zeroes_what_it_read() -> None:
    # D TP1 (4-token blocks [1..4], 16 tokens) from P TP2 DCP2 with 8-token blocks of two 4-token kernel
    # pages (ppl 2): vLLM counts P's whole list, min(4 x 1, 1 x 2) = 2 units, and zeroes units 2, 3
    # (tokens 8 and 12 on) though P rank 1 wrote them
    ps = [_g(2, r, block=8, dcp=2, kernel=4) for r in range(2)]
    pairing = Pairing.create(_g(1), ps, "pull", "vllm")
    with pytest.raises(UnsupportedError) as err:
        plan_request(pairing, [[1, 2, 3, 4]], [[2]], num_tokens=16)
    assert type(err.value) is UnsupportedError
    assert err.value.field == "block_ids[0]" and err.value.values == {"local": 4, "remote": 1}
    assert "tokens [8, 12]" in str(err.value)
    plan = plan_request(Pairing.create(_g(1), ps, "pull", "kvgeom"), [[1, 2, 3, 4]], [[2]], num_tokens=16)
    assert plan.num_descriptors == 4 and plan.zero.shape == (0, 3)


def test_vllm_pull_refuses_units_on_ranks_it_does_not_read() -> None:
    # D TP2 DCP2 rank 0: pages 0, 2 = tokens 0..3, 8..11; P TP2 DCP2 with 8-token pages: tokens 8..15
    # are P rank 1's, but vLLM reads D rank 0 only from P rank 0
    ps = [_g(2, r, block=8, dcp=2, kernel=4) for r in range(2)]
    pairing = Pairing.create(_g(2, 0, dcp=2), ps, "pull", "vllm")
    with pytest.raises(UnsupportedError) as err:
        plan_request(pairing, [[1, 2]], [[2]], num_tokens=16)
    assert type(err.value) is UnsupportedError
    assert err.value.field == "block_ids[0]" and err.value.values == {"local": [0], "remote": [1]}
    assert "tokens [8]" in str(err.value)


def test_vllm_pull_refuses_unequal_page_counts() -> None:
    # D TP2 DCP2 (4-token pages, 8-token scheduler blocks: 2 for 16 tokens) from P TP1 with 8-token
    # blocks of 4-token kernel pages: vLLM's closed form pairs 1 local page with 2 remote kernel pages
    pairing = Pairing.create(_g(2, 0, dcp=2), [_g(1, block=8, kernel=4)], "pull", "vllm")
    with pytest.raises(UnsupportedError) as err:
        plan_request(pairing, [[1, 2]], [[3, 4]], num_tokens=16)
    assert type(err.value) is UnsupportedError
    assert err.value.field == "block_ids[0]" and err.value.values == {"local": 1, "remote": 2}


def test_vllm_push_refuses_units_its_mapping_never_writes() -> None:
    # P TP2 DCP2 with 8-token pages pushes to D TP2 DCP2 with 4-token pages: D rank 0's tokens 8..11
    # are on P rank 1, but vLLM writes D rank 0 only from P rank 0
    ds = [_g(2, r, dcp=2) for r in range(2)]
    pairing = Pairing.create(_g(2, 0, block=8, dcp=2, kernel=4), ds, "push", "vllm")
    with pytest.raises(UnsupportedError) as err:
        plan_request(pairing, [[2]], [[1, 2]], num_tokens=16)
    assert type(err.value) is UnsupportedError
    assert err.value.field == "block_ids[0]" and err.value.values == {"local": [0], "remote": 0}
    assert "tokens [8]" in str(err.value)


def test_pull_into_larger_dcp_pages_reads_sub_pages() -> None:
    """D TP2 DCP2 rank 1 with 8-token pages (128 B; scheduler block 16 tokens: entry 0 = page 1 = tokens
    8..15, entry 1 = page 3 = tokens 24..31) from P TP1 with 4-token blocks (bsr 2). 24 tokens: D block 5's
    halves (table ids 10, 11) <- P's entries 2, 3 (blocks 3, 4: tokens 8..15); D block 6 (tokens 24..31,
    past the request) is zeroed in kvgeom mode, per 4-token unit: 768 and 832, 64 B each."""
    pairing = Pairing.create(_g(2, 1, block=8, dcp=2), [_g(1)], "pull", "kvgeom")
    assert pairing.bsr == 2
    for kw in ({}, {"prefill_tokens": 20}):
        plan = plan_request(
            pairing, [[5, 6]], [[1, 2, 3, 4, 7, 8][: 6 if not kw else 5]], num_tokens=24, **kw
        )  # type: ignore[arg-type]
        assert _t(plan) == [(0, [10, 11], [3, 4], "req:2")]
        assert plan.zero.tolist() == [[0, 768, 64], [0, 832, 64]]
    plan = plan_request(pairing, [[5]], [[1, 2, 3, 4]], num_tokens=16)
    assert _t(plan) == [(0, [10, 11], [3, 4], "req:2")] and plan.zero.shape == (0, 3)
    # vLLM's closed form pairs other P pages here: refused, naming the token axis's pairs (local, remote)
    pairing = Pairing.create(_g(2, 1, block=8, dcp=2), [_g(1)], "pull", "vllm")
    with pytest.raises(UnsupportedError) as err:
        plan_request(pairing, [[5, 6]], [[1, 2, 3, 4, 7, 8]], num_tokens=24)
    assert err.value.field == "block_ids[0]" and err.value.values["remote"] == [(10, 3), (11, 4)]
    assert err.value.values["local"] != err.value.values["remote"]


def test_prefill_tokens_decide_whether_the_last_page_is_read() -> None:
    # 16 tokens: D rank 1's [5, 6] = pages 1 (tokens 4..7) and 3 (12..15); P's [3, 4, 7, 8] = tokens 0..15.
    # P computed 13 (or all) tokens: token 12 is on page 3, so D 6 <- P 8; P computed 12: page 3 holds none
    # of them, so kvgeom mode zeroes D block 6 (384) instead; vLLM mode reads P 8 either way
    for compat in ("kvgeom", "vllm"):
        for pt in (None, 16, 13):
            plan = plan_request(
                _d1_from_p1(compat), [[5, 6]], [[3, 4, 7, 8]], num_tokens=16, prefill_tokens=pt
            )
            assert _t(plan) == [(0, [5, 6], [4, 8], "req:2")] and plan.zero.shape == (0, 3)
    plan = plan_request(_d1_from_p1("kvgeom"), [[5, 6]], [[3, 4, 7, 8]], num_tokens=16, prefill_tokens=12)
    assert _t(plan) == [(0, [5], [4], "req:2")] and plan.zero.tolist() == [[0, 384, 64]]
    plan = plan_request(_d1_from_p1("vllm"), [[5, 6]], [[3, 4, 7, 8]], num_tokens=16, prefill_tokens=12)
    assert _t(plan) == [(0, [5, 6], [4, 8], "req:2")]


def test_vllm_pull_refusal_counts_only_tokens_p_computed() -> None:
    # the receive-step refusal above with prefill_tokens = 9: of the units vLLM would zero (tokens 8 and
    # 12 on), only the one at token 8 holds a token P computed
    ps = [_g(2, r, block=8, dcp=2, kernel=4) for r in range(2)]
    pairing = Pairing.create(_g(1), ps, "pull", "vllm")
    with pytest.raises(UnsupportedError) as err:
        plan_request(pairing, [[1, 2, 3, 4]], [[2]], num_tokens=16, prefill_tokens=9)
    assert err.value.values == {"local": 4, "remote": 1}
    assert "tokens [8]..." in str(err.value)
