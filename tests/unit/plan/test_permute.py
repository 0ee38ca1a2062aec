"""A head-major P pulled by a token-major D with ``permute_local_kv`` (vLLM's ``enable_permute_local_kv``,
docs/vllm-behaviour.md B.6.15): the engine option, the handshake rule and its refusals, the pairing, the
planned receive step (a token-major :class:`~kvgeom.plan.requestplan.Regroup`) and the picture of it. Expected values
are derived by hand in the comments.

The model ``M4``: one attention layer of 4 KV heads, head size 8 (K and V) in float16, so one head of one
token is ``(8 + 8) * 2 = 32`` bytes.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvgeom.cli._inputs import UsageError, parse_engine
from kvgeom.errors import ConfigError, IncompatiblePairError, UnsupportedError
from kvgeom.layout.allocate import rank_geometry
from kvgeom.layout.engine import EngineConfig, KVLayout
from kvgeom.layout.geometry import RankGeometry
from kvgeom.model.layers import AttentionSpec, MambaSpec, MLASpec
from kvgeom.model.spec import ModelSpec
from kvgeom.pair.handshake import check_pair
from kvgeom.pair.rules import check_permute
from kvgeom.plan.align import Page
from kvgeom.plan.pairing import Pairing
from kvgeom.plan.planmemo import memo_of
from kvgeom.plan.receive import permuted_heads, post_receive, receive_step
from kvgeom.plan.request import plan_request
from kvgeom.plan.requestplan import Regroup
from kvgeom.tools.scenario import Scenario
from kvgeom.tools.transfermap import _regroup

M4 = ModelSpec.from_layers("m4", [AttentionSpec(4, 8, "float16")])
HEAD_MAJOR, TOKEN_MAJOR = KVLayout.HEAD_MAJOR, KVLayout.TOKEN_MAJOR


def _geom(
    model: ModelSpec = M4,
    tp: int = 1,
    block: int = 16,
    layout: KVLayout = HEAD_MAJOR,
    permute: bool = False,
    rank: int = 0,
) -> RankGeometry:
    return rank_geometry(
        model,
        EngineConfig(
            tp_size=tp,
            tp_rank=rank,
            block_size=block,
            num_blocks=8,
            kv_layout=layout,
            permute_local_kv=permute,
        ),
    )


def _d(tp: int = 1, block: int = 16, model: ModelSpec = M4, permute: bool = True) -> RankGeometry:
    return _geom(model, tp, block, TOKEN_MAJOR, permute)


# -- the engine option ------------------------------------------------------------------------------------
def test_permute_local_kv_must_be_a_boolean() -> None:
    with pytest.raises(ConfigError) as e:
        EngineConfig(tp_size=1, block_size=16, num_blocks=8, permute_local_kv=1)  # type: ignore[arg-type]
    assert e.value.field == "permute_local_kv" and e.value.values == {"value": 1}


def test_permute_local_kv_in_json_only_when_set() -> None:
    off = EngineConfig(tp_size=1, block_size=16, num_blocks=8)
    on = EngineConfig(tp_size=1, block_size=16, num_blocks=8, permute_local_kv=True)
    assert off.permute_local_kv is False and "permute_local_kv" not in off.to_json()
    assert on.to_json()["permute_local_kv"] is True
    assert EngineConfig.from_json(on.to_json()) == on and on.with_rank(0) == on


# -- the handshake ------------------------------------------------------------------------------------------
def test_the_permute_pairs_a_head_major_remote_into_a_token_major_local_rank() -> None:
    assert check_pair(_d(), _geom(), "pull", "vllm").permute is True
    assert check_pair(_d(), _geom(), "pull", "kvgeom").permute is True
    # equal layouts: the flag changes nothing
    assert check_pair(_d(), _geom(layout=TOKEN_MAJOR), "pull", "vllm").permute is False
    assert check_pair(_geom(), _geom(), "pull", "vllm").permute is False


@pytest.mark.parametrize("compat", ["vllm", "kvgeom"])
def test_layouts_differ_without_the_flag(compat: str) -> None:
    with pytest.raises(IncompatiblePairError) as e:
        check_pair(_d(permute=False), _geom(), "pull", compat)
    assert e.value.field == "kv_layout" and "with permute_local_kv" in str(e.value)
    assert e.value.values == {"local": "token_major", "remote": "head_major"}


def test_the_permute_goes_only_from_head_major_into_token_major() -> None:
    local = _geom(layout=HEAD_MAJOR, permute=True)
    with pytest.raises(IncompatiblePairError) as e:
        check_pair(local, _geom(layout=TOKEN_MAJOR), "pull", "vllm")
    assert e.value.field == "kv_layout"
    assert e.value.values == {"local": "head_major", "remote": "token_major"}


def test_vllm_mode_refuses_the_permute_in_push_and_says_why() -> None:
    # push: P (local) head-major, D (remote) token-major with the flag; vLLM's P refuses D's LBNHC at its
    # handshake, and D's notification-only push handshake never marks D permuting
    with pytest.raises(UnsupportedError) as e:
        check_pair(_geom(), _d(), "push", "vllm")
    assert e.value.field == "kv_layout"
    assert e.value.values == {"local": "head_major", "remote": "token_major"}
    assert "notification-only" in str(e.value) and "P's handshake with D" in str(e.value)
    with pytest.raises(UnsupportedError) as e:
        check_permute(_geom(), _d(tp=2), "push", "vllm")
    assert e.value.field == "kv_layout"


def test_kvgeom_mode_pairs_the_permute_in_push() -> None:
    shape = check_pair(_geom(), _d(), "push", "kvgeom")
    assert (shape.tp_ratio, shape.bsr, shape.permute) == (1, 1, True)
    # P TP 1 writing into D TP 2: tp_ratio -2 seen from P (the local side in push)
    assert check_pair(_geom(), _d(tp=2), "push", "kvgeom").permute is True


@pytest.mark.parametrize("compat", ["vllm", "kvgeom"])
def test_the_push_permute_needs_the_flag_on_d_and_a_head_major_p(compat: str) -> None:
    with pytest.raises(IncompatiblePairError) as e:  # D without the flag
        check_pair(_geom(), _d(permute=False), "push", compat)
    assert e.value.field == "kv_layout" and "with permute_local_kv" in str(e.value)
    assert e.value.values == {"local": "head_major", "remote": "token_major"}
    with pytest.raises(IncompatiblePairError) as e:  # the flag on P (local in push) is not D's
        check_pair(_d(), _geom(), "push", compat)
    assert e.value.values == {"local": "token_major", "remote": "head_major"}
    with pytest.raises(IncompatiblePairError) as e:  # a token-major P into a head-major D with the flag
        check_pair(_geom(layout=TOKEN_MAJOR), _geom(permute=True), "push", compat)
    assert e.value.values == {"local": "token_major", "remote": "head_major"}


@pytest.mark.parametrize(
    "model",
    [
        ModelSpec.from_layers(
            "sw", [AttentionSpec(4, 8, "float16"), AttentionSpec(4, 8, "float16", None, 8)]
        ),
        ModelSpec.from_layers("hyb", [AttentionSpec(4, 8, "float16"), MambaSpec.gdn(4, 4, 4, 4)]),
    ],
    ids=["sliding-window", "ssm"],
)
@pytest.mark.parametrize("compat", ["vllm", "kvgeom"])
def test_the_permute_needs_a_model_without_the_hybrid_allocator(model: ModelSpec, compat: str) -> None:
    with pytest.raises(IncompatiblePairError) as e:
        check_pair(_d(model=model), _geom(model), "pull", compat)
    assert e.value.field == "kv_layout" and "hybrid memory allocator" in str(e.value)
    assert e.value.values == {"local": "token_major", "remote": "head_major"}
    if compat == "kvgeom":  # in push too (vllm mode refuses every push permute first)
        with pytest.raises(IncompatiblePairError) as e:
            check_pair(_geom(model), _d(model=model), "push", compat)
        assert e.value.field == "kv_layout" and "hybrid memory allocator" in str(e.value)
        assert e.value.values == {"local": "head_major", "remote": "token_major"}


def test_mla_pages_are_never_permuted() -> None:
    mla = ModelSpec.from_layers("mla", [MLASpec(16, "float16")])
    with pytest.raises(IncompatiblePairError) as e:
        check_permute(_d(model=mla), _geom(mla), "pull", "vllm")
    assert e.value.field == "kv_layout"
    with pytest.raises(IncompatiblePairError) as e:
        check_permute(_geom(mla), _d(model=mla), "push", "kvgeom")
    assert e.value.field == "kv_layout"


def test_vllm_mode_permutes_across_tp_sizes_a_token_major_layout_otherwise_refuses() -> None:
    # D TP 2 > P TP 1: 2 of 4 heads per D rank; with one token-major layout on both sides vLLM refuses
    with pytest.raises(IncompatiblePairError) as e:
        check_pair(_d(tp=2, permute=False), _geom(layout=TOKEN_MAJOR), "pull", "vllm")
    assert e.value.field == "kv_layout"
    shape = check_pair(_d(tp=2), _geom(), "pull", "vllm")
    assert (shape.tp_ratio, shape.bsr, shape.permute) == (2, 1, True)


# -- the pairing and the plan ---------------------------------------------------------------------------------
def test_kvgeom_mode_pulls_the_permute_as_head_major_pages_not_per_token() -> None:
    # 2 heads per D rank, 4 per P rank: a token-major pair would be cut per token (16 rows per block)
    cut = Pairing.create(_d(tp=2, permute=False), [_geom(layout=TOKEN_MAJOR)], "pull", "kvgeom")
    assert (cut.permute, cut.token_rows) == (False, 16)
    permuted = Pairing.create(_d(tp=2), [_geom()], "pull", "kvgeom")
    assert (permuted.permute, permuted.token_rows, permuted.local_rows) == (True, 1, 1)
    assert "permuted to token-major on receive" in permuted.describe()
    assert "permuted" not in cut.describe()


def _regroup_row(r: Regroup) -> tuple[object, ...]:
    return (r.regions, r.blocks.tolist(), r.bsr, r.heads, r.tokens, r.head_bytes, r.layout)


@pytest.mark.parametrize("compat", ["vllm", "kvgeom"])
def test_the_plan_permutes_every_received_block_at_bsr_1(compat: str) -> None:
    # D TP 2 (2 heads), both blocks 16: a block is 2 heads x 16 tokens x 32 B; D blocks 3 and 5 get P's 1, 2
    pairing = Pairing.create(_d(tp=2), [_geom()], "pull", compat)
    plan = plan_request(pairing, [[3, 5]], [[1, 2]], num_tokens=32)
    assert [_regroup_row(r) for r in plan.regroup] == [((0,), [3, 5], 1, 2, 16, 32, TOKEN_MAJOR)]
    assert plan.zero.shape == (0, 3)  # every byte covered


@pytest.mark.parametrize("compat", ["vllm", "kvgeom"])
def test_the_plan_converts_block_size_and_layout_in_one_step(compat: str) -> None:
    # P blocks of 8 tokens, D of 16: bsr 2; 20 tokens: D block 4 gets P's 6, 7; block 2 gets P's 5 (4 tokens)
    pairing = Pairing.create(_d(tp=1), [_geom(block=8)], "pull", compat)
    plan = plan_request(pairing, [[4, 2]], [[6, 7, 5]], num_tokens=20)
    assert [_regroup_row(r) for r in plan.regroup] == [((0,), [4, 2], 2, 4, 16, 32, TOKEN_MAJOR)]
    # after the permute block 2 is token-major: tokens 8..15 (one remote block of 8 never came) zeroed,
    # one run of 8 tokens x 4 heads x 32 B = 1024 B from byte 2048 + 8 * 128 (the block is 2048 B)
    assert plan.zero.tolist() == [[0, 2 * 2048 + 1024, 1024]]


def test_post_receive_in_vllm_mode_runs_for_the_permute_alone() -> None:
    d, p = _d(tp=1), _geom()
    ids = [np.array([1, 2])]
    regroups, zero = post_receive(d, p, ids, ids, 1, "vllm", permute=False)
    assert regroups == () and zero.shape == (0, 3)  # bsr 1, same ppl: vLLM skips it
    regroups, zero = post_receive(d, p, ids, ids, 1, "vllm", permute=True)
    assert [_regroup_row(r) for r in regroups] == [((0,), [1, 2], 1, 4, 16, 32, TOKEN_MAJOR)]
    assert zero.shape == (0, 3)


def test_permuted_heads_counts_the_layers_heads_per_rank() -> None:
    d = _d(tp=2)  # 4 heads over 2 ranks
    region = d.regions[0]
    page = Page(0, 0, region.block_len, region.block_stride, 1)
    assert permuted_heads(d, page) == 2
    assert permuted_heads(_d(tp=1), page) == 4
    assert permuted_heads(d, Page(0, 32, 32, region.block_stride, 1)) == 1  # no layer's page starts there
    mla = ModelSpec.from_layers("mla", [MLASpec(16, "float16")])
    assert permuted_heads(_geom(mla), page) == 1  # a latent: no heads


# -- the picture -------------------------------------------------------------------------------------------
def test_draw_moves_runs_where_a_token_major_regroup_puts_them() -> None:
    # one run of block 1 (stride 8): [bsr 2, heads 2, n 2] x 1 B -> [tokens 4, heads 2]: chunk c = (s, h, t)
    # goes to (s * 2 + t) * 2 + h: 0->0, 1->2, 2->1, 3->3, 4->4, 5->6, 6->5, 7->7
    runs = np.array([[0, 0, 100, 0, 0, 8, 8]], dtype=np.int64)
    step = Regroup((0,), np.array([1]), 2, 2, 4, 1, TOKEN_MAJOR)
    out = _regroup(runs, step, 0, np.array([8]))
    got = sorted((int(r[2]) - 100, int(r[5]) - 8, int(r[6])) for r in out)
    assert got == [(0, 0, 1), (1, 2, 1), (2, 1, 1), (3, 3, 1), (4, 4, 1), (5, 6, 1), (6, 5, 1), (7, 7, 1)]
    # head-major (as before): chunks of n * b = 2 B: (s, h) -> h * 2 + s: 0->0, 1->2, 2->1, 3->3
    out = _regroup(runs, Regroup((0,), np.array([1]), 2, 2, 4, 1), 0, np.array([8]))
    got = sorted((int(r[2]) - 100, int(r[5]) - 8, int(r[6])) for r in out)
    assert got == [(0, 0, 2), (2, 4, 2), (4, 2, 2), (6, 6, 2)]


def test_a_recipe_keeps_the_regroups_layout() -> None:
    # the third request of one shape is planned from a recipe (kvgeom.plan.recipe): the same regroup, its own blocks
    pairing = Pairing.create(_d(tp=2), [_geom()], "pull", "vllm")
    for local, remote in (([3, 5], [1, 2]), ([4, 6], [0, 3]), ([7, 1], [5, 6])):
        plan = plan_request(pairing, [local], [remote], num_tokens=32)
        assert [_regroup_row(r) for r in plan.regroup] == [((0,), local, 1, 2, 16, 32, TOKEN_MAJOR)]
    assert any(type(v).__name__ == "_Shape" for v in memo_of(pairing).shapes.values())


# -- scenarios and the CLI ---------------------------------------------------------------------------------
def test_a_scenario_asks_for_the_permute_on_decode() -> None:
    sc = Scenario.from_json(
        {
            "model": M4.to_json(),
            "prefill": {"block_size": 16},
            "decode": {"tp_size": 2, "block_size": 16, "kv_layout": "token_major", "permute_local_kv": True},
        }
    )
    assert sc.decode.permute_local_kv is True and sc.prefill.permute_local_kv is False
    assert sc.pairings[0].permute is True
    with pytest.raises(ConfigError) as e:
        Scenario.from_json({"model": M4.to_json(), "decode": {"permute_local_kv": "yes"}})
    assert e.value.field == "decode.permute_local_kv" and e.value.values == {"value": "yes"}


def test_the_cli_reads_permute_as_a_boolean() -> None:
    assert parse_engine("layout=token_major,permute=true", "--decode") == {
        "kv_layout": "token_major",
        "permute_local_kv": True,
    }
    assert parse_engine("permute=0", "--decode") == {"permute_local_kv": False}
    with pytest.raises(UsageError) as e:
        parse_engine("permute=maybe", "--decode")
    assert e.value.field == "--decode permute"


def test_the_cli_prints_the_permute_only_when_set() -> None:
    from kvgeom.cli._commands import _engine_json

    on = Scenario.from_json(
        {"model": M4.to_json(), "decode": {"kv_layout": "token_major", "permute_local_kv": True}}
    )
    assert _engine_json(on, "decode")["permute_local_kv"] is True
    assert "permute_local_kv" not in _engine_json(on, "prefill")


# -- kvgeom mode's push permute -----------------------------------------------------------------------------
def _push_moves(p_tp: int, p_block: int, d_tp: int, d_layout: KVLayout, p_ids, d_ids, n: int) -> list:
    """Every P rank's planned writes as sorted (P rank, P offset, D rank, D offset, length) rows."""
    out = []
    for rank in range(p_tp):
        d = [_geom(tp=d_tp, layout=d_layout, permute=d_layout is TOKEN_MAJOR, rank=r) for r in range(d_tp)]
        pairing = Pairing.create(_geom(tp=p_tp, block=p_block, rank=rank), d, "push", "kvgeom")
        plan = plan_request(pairing, [p_ids], [d_ids], num_tokens=n)
        assert plan.op == "WRITE" and plan.regroup == () and plan.zero.shape == (0, 3)
        out += [(int(m[0]), int(m[2]), int(m[3]), int(m[5]), int(m[6])) for m in plan.moves(pairing)]
    return sorted(out)


def test_kvgeom_mode_pushes_the_permute_as_the_head_major_writes() -> None:
    # P TP 1 (4 heads), D TP 2 (2 heads per rank), blocks of 16: a P block is [4 heads, 16, 32 B] = 2048 B
    # (head h at h * 512), a D block [2, 16, 32] = 1024 B; D rank r takes heads 2r, 2r + 1: P bytes
    # [r * 1024, +1024) of each block. P blocks 1, 2 -> D blocks 3, 5: 4 writes of 1024 B
    want = [(0, b * 2048 + r * 1024, r, d * 1024, 1024) for b, d in ((1, 3), (2, 5)) for r in (0, 1)]
    got = _push_moves(1, 16, 2, TOKEN_MAJOR, [1, 2], [3, 5], 32)
    assert got == sorted(want)
    assert got == _push_moves(1, 16, 2, HEAD_MAJOR, [1, 2], [3, 5], 32)  # as for a head-major D


def test_kvgeom_mode_pushes_the_permute_with_p_blocks_larger_than_ds() -> None:
    # P TP 4 (1 head per rank), blocks of 32: a P block is [1, 32, 32 B] = 1024 B; D TP 1 (4 heads), blocks of
    # 16: [4, 16, 32 B] = 2048 B, head h at h * 512. 40 tokens: P blocks 1, 2 -> D blocks 3, 5 (block 1's
    # halves) and 6 (block 2's first half). P rank r writes 512 B chunks into head r: 12 writes
    want = [
        (r, p * 1024 + half * 512, 0, d * 2048 + r * 512, 512)
        for r in range(4)
        for p, half, d in ((1, 0, 3), (1, 1, 5), (2, 0, 6))
    ]
    got = _push_moves(4, 32, 1, TOKEN_MAJOR, [1, 2], [3, 5, 6], 40)
    assert got == sorted(want)
    assert got == _push_moves(4, 32, 1, HEAD_MAJOR, [1, 2], [3, 5, 6], 40)


def test_the_push_permute_with_p_blocks_larger_than_ds_needs_one_head_per_p_rank() -> None:
    # P TP 1 holds 4 heads: a 16-token half of its [4, 32, 32 B] block holds heads 0-1 of every token
    with pytest.raises(UnsupportedError) as e:
        check_pair(_geom(block=32), _d(), "push", "kvgeom")
    assert e.value.field == "block_size" and e.value.values == {"local": 32, "remote": 16}
    assert check_pair(_geom(tp=4, block=32), _d(), "push", "kvgeom").bsr == 2


def test_the_push_receive_step_permutes_every_block_of_the_request() -> None:
    # D TP 2 rank 0 (2 heads, block 1024 B) written by P TP 1 (blocks of 16): every block [2, 16, 32 B]
    # arrived head-major; D's blocks 3, 5, 6 for 40 tokens, P computed 32 (blocks 1, 2): block 6 is D's own,
    # zeroed whole after the permute: one token-major run [6 * 1024, +1024)
    d, p = _d(tp=2), _geom()
    regroups, zero = receive_step(d, p, [[3, 5, 6]], [[1, 2]], num_tokens=40, prefill_tokens=32)
    assert [_regroup_row(r) for r in regroups] == [((0,), [3, 5, 6], 1, 2, 16, 32, TOKEN_MAJOR)]
    assert zero.tolist() == [[0, 6 * 1024, 1024]]
    # a head-major D: nothing to regroup (bsr 1), the same zero range
    regroups, zero_hm = receive_step(_geom(tp=2), p, [[3, 5, 6]], [[1, 2]], num_tokens=40, prefill_tokens=32)
    assert regroups == () and zero_hm.tolist() == zero.tolist()
    # P TP 4 blocks of 32 into D TP 1 blocks of 16 (4 heads per D block): each D block is one head-major page
    regroups, zero = receive_step(_d(), _geom(tp=4, block=32), [[3, 5, 6]], [[1, 2]], num_tokens=40)
    assert [_regroup_row(r) for r in regroups] == [((0,), [3, 5, 6], 1, 4, 16, 32, TOKEN_MAJOR)]
    assert zero.shape == (0, 3)


def test_the_push_receive_step_refuses_layouts_no_push_pairs() -> None:
    # a token-major D without the flag: the writer could not have planned it
    with pytest.raises(IncompatiblePairError) as e:
        receive_step(_d(permute=False), _geom(), [[3]], [[1]], num_tokens=16)
    assert e.value.field == "kv_layout" and e.value.values == {"local": "head_major", "remote": "token_major"}


def test_draw_shows_a_permuted_push_after_ds_receive_step() -> None:
    from kvgeom.tools.draw import transfer_map
    from kvgeom.tools.scenario import RequestIds

    sc = Scenario.from_json(
        {
            "model": M4.to_json(),
            "mode": "push",
            "prefill": {"tp_size": 1, "block_size": 16, "num_blocks": 8},
            "decode": {
                "tp_size": 2,
                "block_size": 16,
                "num_blocks": 8,
                "kv_layout": "token_major",
                "permute_local_kv": True,
            },
        }
    )
    tmap = transfer_map(sc, RequestIds(16, ((1,),), ((3,),)))
    assert tmap.regrouped
    # P block 1 = [4 heads, 16, 32 B] at 2048; D rank r's block 3 = [16 tokens, 2 heads, 32 B] at 3 * 1024:
    # head h, token t of P (offset 2048 + h * 512 + t * 32) lands on rank h // 2 at 3072 + (t * 2 + h % 2) * 32
    # (adjacent runs merged: none are, the permute interleaves them)
    want = sorted(
        (0, 0, 2048 + h * 512 + t * 32, h // 2, 0, 3072 + (t * 2 + h % 2) * 32, 32)
        for h in range(4)
        for t in range(16)
    )
    assert sorted(map(tuple, tmap.runs.tolist())) == want
    assert tmap.zero.shape == (0, 4)


def test_a_plan_describes_its_token_major_regroup_as_token_major() -> None:
    # D TP 2 (2 heads), P blocks of 8 into D blocks of 16: [bsr 2, 2 heads, 8 tokens, *] stored [16 tokens, 2, *]
    pairing = Pairing.create(_d(tp=2), [_geom(block=8)], "pull", "kvgeom")
    text = plan_request(pairing, [[3, 5]], [[1, 2, 4, 6]], num_tokens=32).describe(pairing)
    assert "regroup 2 block(s) in regions [0]... ([2,2,8,*] -> [16,2,*])" in text
