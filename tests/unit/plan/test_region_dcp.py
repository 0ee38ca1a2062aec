"""Region-mapped pulls with decode context parallelism (D keeps MLA layer 1 of 3 in a group of its own), in both
modes. Values are derived by hand in the comments: a 3-layer MLA model with a latent of 8 fp16 values holds 16 B
per token, so a 4-token page is 64 B; descriptor ids are region-major (``region * num_blocks + block``)."""

from __future__ import annotations

import pytest

from kvgeom import (
    EngineConfig,
    MLASpec,
    ModelSpec,
    Pairing,
    PlanError,
    TokenCountError,
    plan_request,
    rank_geometry,
)
from kvgeom.testing import Request, run

MLA3 = ModelSpec.from_layers("mla", [MLASpec(8, "float16")] * 3)
SEP = ("layers.1.attn",)  # D's regions belong to groups [0, 1, 0]; P's to [0, 0, 0]


def _engine(
    tp: int,
    dcp: int = 1,
    rank: int = 0,
    block: int = 4,
    kernel: int | None = None,
    blocks: int = 8,
    **kw: object,
) -> EngineConfig:
    return EngineConfig(
        tp_size=tp,
        tp_rank=rank,
        block_size=block,
        kernel_block_size=kernel,
        num_blocks=blocks,
        dcp_size=dcp,
        **kw,
    )


def _pairing(p: EngineConfig, d: EngineConfig, compat: str, prefix_caching: bool = False) -> Pairing:
    pairing = Pairing.create(
        rank_geometry(MLA3, d),
        [rank_geometry(MLA3, p.with_rank(r)) for r in range(p.tp_size)],
        "pull",
        compat,
        prefix_caching=prefix_caching,
    )
    assert pairing.region_mapped and pairing.dcp_active
    return pairing


@pytest.mark.parametrize("compat", ["vllm", "kvgeom"])
def test_a_sharded_d_reads_its_global_pages_region_by_region(compat: str) -> None:
    """20 tokens = global pages 0-4 on P TP1; D TP2 DCP2 rank 1 holds pages 1, 3 and 5 (past the end) at list
    positions 0-2. Group 0 (regions 0, 2) has D ids [1, 2, 3], group 1 (region 1) [4, 5, 6]; P's list is
    [1, 2, 3, 4, 5] (page g on P is id g + 1). Pages 1 and 3 come from P ids 2 and 4; D's third page holds no
    token and is zeroed (64 B at block 3 of regions 0, 2, block 6 of region 1). Two D ranks read P: 'req:2'."""
    d = _engine(2, 2, rank=1, separate_group=SEP)
    pairing = _pairing(_engine(1), d, compat)
    plan = plan_request(
        pairing, [[1, 2, 3], [4, 5, 6]], [[1, 2, 3, 4, 5]], "req", "P-req", num_tokens=20, prefill_tokens=20
    )
    (t,) = plan.transfers
    assert t.remote_rank == 0 and t.notif == "P-req:2"  # P's request id
    assert t.local_ids.tolist() == [1, 2, 8 + 4, 8 + 5, 16 + 1, 16 + 2]
    assert t.remote_ids.tolist() == [2, 4, 8 + 2, 8 + 4, 16 + 2, 16 + 4]
    assert plan.zero.tolist() == [[0, 3 * 64, 64], [1, 6 * 64, 64], [2, 3 * 64, 64]]
    # rank 0 holds pages 0, 2, 4 (P ids 1, 3, 5): nothing to zero
    plan0 = plan_request(
        _pairing(_engine(1), _engine(2, 2, separate_group=SEP), compat),
        [[1, 2, 3], [4, 5, 6]],
        [[1, 2, 3, 4, 5]],
        num_tokens=20,
        prefill_tokens=20,
    )
    assert plan0.transfers[0].remote_ids.tolist() == [1, 3, 5, 8 + 1, 8 + 3, 8 + 5, 16 + 1, 16 + 3, 16 + 5]
    assert plan0.zero.shape == (0, 3)


@pytest.mark.parametrize("compat", ["vllm", "kvgeom"])
def test_a_replicated_d_reads_every_sharded_p_rank_after_its_prefix_hit(compat: str) -> None:
    """D TP1 caches page 0; its lists hold pages 1-4 (group 0: D ids [1, 2, 3, 4], group 1: [5, 6, 7, 8]). P TP2
    DCP2 (P ids [1, 2, 3] on both ranks): rank 0 holds pages 0, 2, 4 at positions 0-2, rank 1 pages 1, 3. So rank
    0 sends pages 2, 4 (P ids 2, 3) into D's 2nd and 4th ids, rank 1 pages 1, 3 (P ids 1, 2) into the 1st and
    3rd; D has 10 blocks per region, P 8. One D rank reads each P rank: 'req:1'."""
    p = _engine(2, 2)
    d = EngineConfig(tp_size=1, block_size=4, num_blocks=10, separate_group=SEP)
    pairing = _pairing(p, d, compat, prefix_caching=True)
    plan = plan_request(pairing, [[1, 2, 3, 4], [5, 6, 7, 8]], [[1, 2, 3]], num_tokens=20, prefill_tokens=20)
    t0, t1 = plan.transfers
    assert (t0.remote_rank, t1.remote_rank, t0.notif) == (0, 1, "req:1")
    assert t0.local_ids.tolist() == [2, 4, 10 + 6, 10 + 8, 20 + 2, 20 + 4]
    assert t0.remote_ids.tolist() == [2, 3, 8 + 2, 8 + 3, 16 + 2, 16 + 3]
    assert t1.local_ids.tolist() == [1, 3, 10 + 5, 10 + 7, 20 + 1, 20 + 3]
    assert t1.remote_ids.tolist() == [1, 2, 8 + 1, 8 + 2, 16 + 1, 16 + 2]
    assert plan.zero.shape == (0, 3)


@pytest.mark.parametrize("compat", ["vllm", "kvgeom"])
def test_a_remote_rank_without_pages_is_only_notified(compat: str) -> None:
    """4 tokens are page 0, on P TP2 DCP2 rank 0 only: D TP1 reads it from rank 0 and notifies rank 1."""
    pairing = _pairing(_engine(2, 2), _engine(1, separate_group=SEP), compat)
    plan = plan_request(pairing, [[1], [2]], [[1]], num_tokens=4, prefill_tokens=4)
    (t,) = plan.transfers
    assert (t.remote_rank, plan.notify_only) == (0, (1,))
    assert t.local_ids.tolist() == [1, 8 + 2, 16 + 1] and t.remote_ids.tolist() == [1, 8 + 1, 16 + 1]


@pytest.mark.parametrize("compat", ["vllm", "kvgeom"])
def test_nothing_to_read_notifies_every_source(compat: str) -> None:
    # vllm mode asks for no token count then: vLLM pairs nothing and only notifies
    pairing = _pairing(_engine(2, 2), _engine(1, separate_group=SEP), compat)
    plan = plan_request(pairing, [[], []], [[1, 2]])
    assert (plan.transfers, plan.notify_only, plan.zero.shape) == ((), (0, 1), (0, 3))


def test_vllm_mode_needs_the_tokens_p_computed() -> None:
    """vLLM pairs by page position from P's token count (remote_num_tokens); kvgeom mode places the pages with
    D's count alone."""
    p, d = _engine(1), _engine(2, 2, rank=1, separate_group=SEP)
    with pytest.raises(PlanError) as err:
        plan_request(_pairing(p, d, "vllm"), [[1, 2, 3], [4, 5, 6]], [[1, 2, 3, 4, 5]], num_tokens=20)
    assert type(err.value) is PlanError
    assert (err.value.field, err.value.values) == ("prefill_tokens", {"value": None})
    plan = plan_request(_pairing(p, d, "kvgeom"), [[1, 2, 3], [4, 5, 6]], [[1, 2, 3, 4, 5]], num_tokens=20)
    assert plan.transfers[0].remote_ids.tolist() == [2, 4, 8 + 2, 8 + 4, 16 + 2, 16 + 4]


def test_vllm_mode_places_d_by_num_tokens() -> None:
    """D's cached pages come from num_tokens (20: none cached, D rank 1's pages 1, 3 and 5); without it the
    plan is refused, with prefix caching or without."""
    p, d = _engine(1), _engine(2, 2, rank=1, separate_group=SEP)
    ids = ([[1, 2, 3], [4, 5, 6]], [[1, 2, 3, 4, 5]])
    plan = plan_request(_pairing(p, d, "vllm"), *ids, num_tokens=20, prefill_tokens=20)
    assert plan.transfers[0].remote_ids.tolist() == [2, 4, 8 + 2, 8 + 4, 16 + 2, 16 + 4]
    for caching in (False, True):
        with pytest.raises(TokenCountError) as err:
            plan_request(_pairing(p, d, "vllm", prefix_caching=caching), *ids, prefill_tokens=20)
        assert (err.value.field, err.value.values) == ("num_tokens", {"value": None, "group": 0, "blocks": 3})


@pytest.mark.parametrize("compat", ["vllm", "kvgeom"])
def test_pages_past_the_tokens_p_computed_are_zeroed_not_read(compat: str) -> None:
    """P computed 16 tokens (pages 0-3) but hands a 5-page list: D rank 0's pages 0, 2 come from P ids 1, 3, its
    page 4 (tokens 16-19) is D's to compute and zeroed (D id 3 in regions 0, 2; id 6 in region 1)."""
    pairing = _pairing(_engine(1), _engine(2, 2, separate_group=SEP), compat)
    plan = plan_request(pairing, [[1, 2, 3], [4, 5, 6]], [[1, 2, 3, 4, 5]], num_tokens=20, prefill_tokens=16)
    (t,) = plan.transfers
    assert t.local_ids.tolist() == [1, 2, 8 + 4, 8 + 5, 16 + 1, 16 + 2]
    assert t.remote_ids.tolist() == [1, 3, 8 + 1, 8 + 3, 16 + 1, 16 + 3]
    assert plan.zero.tolist() == [[0, 3 * 64, 64], [1, 6 * 64, 64], [2, 3 * 64, 64]]


@pytest.mark.parametrize("compat", ["vllm", "kvgeom"])
def test_d_lists_longer_than_the_tokens_need_or_unplaced_are_refused(compat: str) -> None:
    """20 tokens on D TP2 DCP2 need ceil(20 / 8) = 3 list entries: 4 are refused, naming the group; with prefix
    caching D's cached pages come from num_tokens, which must be passed."""
    ids = ([[1, 2, 3, 4], [5, 6, 7, 0]], [[1, 2, 3, 4, 5]])
    with pytest.raises(PlanError) as err:
        pairing = _pairing(_engine(1), _engine(2, 2, separate_group=SEP), compat)
        plan_request(pairing, *ids, num_tokens=20, prefill_tokens=20)
    assert (err.value.field, err.value.values) == ("block_ids[0]", {"value": 4})
    with pytest.raises(PlanError) as err:
        plan_request(
            _pairing(_engine(1), _engine(2, 2, separate_group=SEP), compat, prefix_caching=True),
            [[1, 2, 3], [4, 5, 6]],
            [[1, 2, 3, 4, 5]],
            prefill_tokens=20,
        )
    assert (type(err.value), err.value.field) == (TokenCountError, "num_tokens")
    assert err.value.values == {"value": None, "group": 0, "blocks": 3}


def test_kvgeom_mode_pairs_kernel_pages_by_token_where_vllm_refuses() -> None:
    """Blocks of 8 tokens in kernel blocks of 4 (vLLM refuses DCP region pulls then; its kernel-page positions
    would pair D's kernel 2 with P's kernel 3, tokens 8-11 with 4-7). 20 tokens = logical pages 0-2 on P TP1 (ids
    [1, 2, 3], kernels 2-7); D TP2 DCP2 rank 1 holds page 1 (tokens 8-15) and page 3 (past the end) in ids
    [1, 2] (kernels 2-5). D kernels 2, 3 get P page 1 = P id 2 = kernels 4, 5; D kernels 4, 5 are zeroed. 16
    kernel blocks per region; a kernel page is 64 B."""
    p = _engine(1, block=8, kernel=4)
    d = _engine(2, 2, rank=1, block=8, kernel=4, separate_group=SEP)
    plan = plan_request(_pairing(p, d, "kvgeom"), [[1, 2], [3, 4]], [[1, 2, 3]], num_tokens=20)
    (t,) = plan.transfers
    assert t.local_ids.tolist() == [2, 3, 16 + 6, 16 + 7, 32 + 2, 32 + 3]  # group 1's ids [3, 4]: kernels 6-9
    assert t.remote_ids.tolist() == [4, 5, 16 + 4, 16 + 5, 32 + 4, 32 + 5]
    assert plan.zero.tolist() == [
        [0, 256, 64],
        [0, 320, 64],
        [1, 512, 64],
        [1, 576, 64],
        [2, 256, 64],
        [2, 320, 64],
    ]


@pytest.mark.parametrize(
    ("p_tp", "p_dcp", "d_tp", "d_dcp"), [(1, 1, 2, 2), (2, 2, 1, 1), (4, 4, 2, 2), (2, 2, 4, 4), (2, 1, 2, 2)]
)
@pytest.mark.parametrize(("tokens", "prefix", "computed"), [(37, 0, None), (37, 1, None), (37, 0, 36)])
def test_every_rank_pull_passes_the_oracle(
    p_tp: int, p_dcp: int, d_tp: int, d_dcp: int, tokens: int, prefix: int, computed: int | None
) -> None:
    p, d = _engine(p_tp, p_dcp, blocks=24), _engine(d_tp, d_dcp, blocks=24, separate_group=SEP)
    request = Request.simple(MLA3, p, d, tokens, prefix, prefill_tokens=computed)
    for compat in ("vllm", "kvgeom"):
        report = run(MLA3, p, d, request, "pull", compat, prefix > 0)
        assert report.ok and report.bytes_moved > 0, (compat, report)
