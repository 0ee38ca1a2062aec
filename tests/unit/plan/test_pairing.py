"""kvgeom.plan.pairing.Pairing: which remote ranks a local rank pairs with, each refusal of ``create`` (class,
field, values), and the per-pairing numbers the tables are cut with."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from kvgeom import EngineConfig, IncompatiblePairError, KvgeomError, Pairing, card_of
from kvgeom.errors import UnsupportedError
from kvgeom.layout.allocate import rank_geometry
from kvgeom.layout.geometry import RankGeometry
from kvgeom.model.layers import AttentionSpec, MambaSpec, MLASpec
from kvgeom.model.spec import ModelSpec

DENSE4 = ModelSpec.from_layers("dense4", [AttentionSpec(4, 2, "float16")] * 2)
MLA = ModelSpec.from_layers("mla", [MLASpec(8, "float16")] * 2)
DRAFT = ModelSpec.from_layers("mla+draft", [MLASpec(8, "float16")] * 2 + [AttentionSpec(4, 4, "float16")] * 2)
HYBRID = ModelSpec.from_layers("h", [AttentionSpec(2, 2, "float16"), MambaSpec.mamba1(2, 1, 2, "float16")])


def eng(tp: int = 1, rank: int = 0, block: int = 4, **kw: Any) -> EngineConfig:
    return EngineConfig(tp_size=tp, tp_rank=rank, block_size=block, num_blocks=kw.pop("num_blocks", 8), **kw)


def geo(model: ModelSpec, tp: int = 1, rank: int = 0, block: int = 4, **kw: Any) -> RankGeometry:
    return rank_geometry(model, eng(tp, rank, block, **kw))


def engine_ranks(model: ModelSpec, tp: int, **kw: Any) -> list[RankGeometry]:
    return [geo(model, tp, r, **kw) for r in range(tp)]


def refused(cls: type[KvgeomError], field: str, fn: Callable[[], object], **values: object) -> None:
    with pytest.raises(KvgeomError) as info:
        fn()
    assert type(info.value) is cls, (type(info.value), info.value)
    assert info.value.field == field, info.value
    assert info.value.values == values, info.value.values


# ---- create: arguments ---------------------------------------------------------------------------------


def test_mode_must_be_pull_or_push() -> None:
    g = geo(DENSE4)
    refused(IncompatiblePairError, "mode", lambda: Pairing.create(g, [g], "pul"), value="pul")
    assert Pairing.create(g, [g], "push").mode == "push"
    p = Pairing.create(g, [g])
    assert (p.mode, p.compat, p.prefix_caching) == ("pull", "kvgeom", False)


def test_cards_must_be_for_the_pairs_mode() -> None:
    push_card = card_of("d", DENSE4, eng(), "push")
    pull_card = card_of("p", DENSE4, eng())
    refused(
        IncompatiblePairError,
        "mode",
        lambda: Pairing.create(push_card, [pull_card], "pull"),
        local="pull",
        remote="push",
    )
    refused(
        IncompatiblePairError,
        "mode",
        lambda: Pairing.create(pull_card, [push_card], "pull"),
        local="pull",
        remote="push",
    )
    p = Pairing.create(pull_card, [pull_card])
    assert p.local == pull_card.geometry and p.remotes[0] == pull_card.geometry
    assert Pairing.create(push_card, {0: push_card}, "push").targets == (0,)


def test_remotes_must_be_given() -> None:
    g = geo(DENSE4)
    refused(IncompatiblePairError, "remotes", lambda: Pairing.create(g, []), value=0)
    refused(IncompatiblePairError, "remotes", lambda: Pairing.create(g, {}), value=0)


def test_remote_ranks_must_agree() -> None:
    d = geo(DENSE4)
    r0 = geo(DENSE4, tp=2)
    refused(
        IncompatiblePairError,
        "remotes[1]",
        lambda: Pairing.create(d, [r0, geo(DENSE4, tp=4, rank=1)]),
        local=(2, 8),
        remote=(4, 8),
    )
    refused(
        IncompatiblePairError,
        "remotes[1]",
        lambda: Pairing.create(d, [r0, geo(DENSE4, tp=2, rank=1, num_blocks=9)]),
        local=(2, 8),
        remote=(2, 9),
    )
    refused(
        IncompatiblePairError,
        "remotes[0].tp_rank",
        lambda: Pairing.create(d, [geo(DENSE4, tp=2, rank=1), r0]),
        local=0,
        remote=1,
    )
    refused(
        IncompatiblePairError,
        "remotes[3].tp_rank",
        lambda: Pairing.create(d, {3: geo(DENSE4, tp=4, rank=2)}),
        local=3,
        remote=2,
    )
    other = ModelSpec.from_layers("dense4", [AttentionSpec(4, 4, "float16")] * 2)
    with pytest.raises(IncompatiblePairError) as info:
        Pairing.create(d, [r0, geo(other, tp=2, rank=1)])
    err = info.value
    assert type(err) is IncompatiblePairError and err.field == "remotes[1].model"
    assert err.values == {"local": DENSE4.dumps()[:200], "remote": other.dumps()[:200]}
    assert len(DENSE4.dumps()) > 200 and len(err.values["local"]) == 200
    tm = geo(DENSE4, tp=2, rank=1, kv_layout="token_major")
    refused(
        IncompatiblePairError,
        "remotes[1].engine",
        lambda: Pairing.create(d, [r0, tm]),
        local=r0.engine.to_json(),
        remote=tm.engine.to_json(),
    )


def test_create_passes_mode_compat_and_prefix_caching_to_the_handshake() -> None:
    tm = {"kv_layout": "token_major"}
    refused(
        IncompatiblePairError,
        "kv_layout",
        lambda: Pairing.create(geo(DENSE4, **tm), engine_ranks(DENSE4, 2, **tm), compat="vllm"),
        local="token_major",
        remote="token_major",
    )
    one, two = geo(HYBRID, block=8), geo(HYBRID, block=8, kernel_block_size=4)
    assert Pairing.create(one, [two]).bsr == 2
    refused(
        IncompatiblePairError,
        "ppl",
        lambda: Pairing.create(one, [two], prefix_caching=True),
        local=1,
        remote=2,
    )
    p = Pairing.create(geo(DENSE4), [geo(DENSE4)], "pull", "vllm", True)
    assert (p.compat, p.prefix_caching) == ("vllm", True)
    refused(
        UnsupportedError,
        "block_size",
        lambda: Pairing.create(geo(DENSE4, block=8), [geo(DENSE4)], "push"),
        local=8,
        remote=4,
    )


# ---- create: targets -----------------------------------------------------------------------------------


def test_handshake_targets_must_all_be_given() -> None:
    # D TP 1 reads from P TP 2 ranks 0 and 1
    refused(
        IncompatiblePairError,
        "remotes",
        lambda: Pairing.create(geo(DENSE4), {0: geo(DENSE4, tp=2)}),
        value=[1],
        expected=[0, 1],
    )
    p = Pairing.create(geo(DENSE4), engine_ranks(DENSE4, 2))
    assert p.targets == (0, 1) and p.remote_tp == 2 and p.tp_ratio == -2


def test_only_the_targets_are_kept() -> None:
    # equal TP: D rank 1 pairs with P rank 1 only
    p = Pairing.create(geo(DENSE4, tp=2, rank=1), engine_ranks(DENSE4, 2))
    assert p.targets == (1,) and list(p.remotes) == [1]
    assert p.transfer_ranks == (1,)


def test_dcp_pages_of_other_sizes_pair_with_every_remote_rank() -> None:
    d = geo(MLA, tp=2, dcp_size=2, block=8)
    refused(
        IncompatiblePairError,
        "remotes",
        lambda: Pairing.create(d, {0: geo(MLA, tp=2, dcp_size=2)}),
        value=[1],
        expected=[0, 1],
    )
    p = Pairing.create(d, engine_ranks(MLA, 2, dcp_size=2))
    assert p.targets == (0, 1) and p.mapping.local_consumers == 2
    assert p.dcp_active and p.remote_dcp == 2
    # equal page sizes: DCP rank 0 pairs with remote DCP rank 0 only
    q = Pairing.create(geo(MLA, tp=2, dcp_size=2), engine_ranks(MLA, 2, dcp_size=2))
    assert q.targets == (0,)
    assert q.mapping.local_consumers == 1  # dcp_consumer_count: max(1, 2 // 2)
    # vllm mode keeps vLLM's targets
    v = Pairing.create(d, {0: geo(MLA, tp=2, dcp_size=2)}, compat="vllm")
    assert v.targets == (0,)


def test_dcp_active_either_side() -> None:
    assert Pairing.create(geo(MLA, tp=2, dcp_size=2), [geo(MLA)]).dcp_active
    assert Pairing.create(geo(MLA), engine_ranks(MLA, 2, dcp_size=2)).dcp_active
    p = Pairing.create(geo(MLA), [geo(MLA)])
    assert not p.dcp_active and p.remote_dcp == 1


def test_draft_mapping_only_for_drafts() -> None:
    assert Pairing.create(geo(MLA), [geo(MLA)]).draft_mapping is None
    p = Pairing.create(geo(DRAFT, tp=2, rank=1), [geo(DRAFT)], compat="vllm")
    assert p.draft_mapping is not None
    # the draft's 4 heads: D TP 2 rank 1 reads heads 2-3 of P TP 1's page (offset factor 1, 1 source)
    assert p.draft_mapping.rank_offset_factor == 1
    assert p.draft_mapping.source_ranks_per_group == ((0,),)


# ---- per-pairing numbers -------------------------------------------------------------------------------


def test_token_rows_for_token_major_pages_whose_heads_differ() -> None:
    tm = {"kv_layout": "token_major"}
    # kvgeom mode cuts P TP 2's 4-token pages per token: 4 rows per remote block, times bsr 1
    p = Pairing.create(geo(DENSE4, **tm), engine_ranks(DENSE4, 2, **tm))
    assert (p.token_rows, p.local_rows, p.local_key(1)) == (4, 4, (4, 1))
    # one row per token: 2 regions x 8 kernel blocks x 4 tokens on both sides (vLLM's tables: one per block)
    assert len(p.remote_table(0)) == len(p.local_table(p.local_key(0))) == 2 * 8 * 4
    # local block 8: bsr 2 -> 8 local rows
    p8 = Pairing.create(geo(DENSE4, block=8, **tm), engine_ranks(DENSE4, 2, **tm))
    assert (p8.token_rows, p8.local_rows) == (4, 8)
    assert Pairing.create(geo(DENSE4), engine_ranks(DENSE4, 2)).token_rows == 1  # head-major
    assert Pairing.create(geo(DENSE4, **tm), [geo(DENSE4, **tm)]).token_rows == 1  # same heads
    assert Pairing.create(geo(MLA, **tm), engine_ranks(MLA, 2, **tm)).token_rows == 1  # no heads


def test_local_keys_in_vllm_mode() -> None:
    # P TP 2 > D TP 1: one split table per source rank (vLLM B.3.3)
    p = Pairing.create(geo(DENSE4, block=8), engine_ranks(DENSE4, 2, block=8), compat="vllm")
    assert p.needs_split and p.local_key(1) == (1, 1)
    q = Pairing.create(geo(DENSE4, tp=2, block=8), [geo(DENSE4, block=4)], compat="vllm")
    assert not q.needs_split and q.local_key(0) == (2, -1)
    assert Pairing.create(geo(DENSE4, block=8), [geo(DENSE4)]).local_key(0) == (2, 0)


def test_transfer_ranks_and_group_masks() -> None:
    # MLA: D TP 1 reads the latent from P rank 0 only; rank 1 is only notified
    p = Pairing.create(geo(MLA), engine_ranks(MLA, 2))
    assert p.targets == (0, 1) and p.transfer_ranks == (0,)
    assert p.group_mask(0) == (True,) and p.group_mask(1) == (False,)
    v = Pairing.create(geo(MLA), engine_ranks(MLA, 2), compat="vllm")
    assert v.transfer_ranks == (0,) and v.group_mask(1) == (False,)
    # vLLM pushes the replicated latent into every D rank (P TP 1 to D TP 2)
    push = Pairing.create(geo(MLA), engine_ranks(MLA, 2), "push", "vllm")
    assert push.transfer_ranks == (0, 1) and push.group_mask(1) == (True,)
    # dense pull: both ranks
    assert Pairing.create(geo(DENSE4), engine_ranks(DENSE4, 2), compat="vllm").transfer_ranks == (0, 1)


def test_describe_names_the_ratios_and_tables() -> None:
    p = Pairing.create(geo(MLA), [geo(MLA, block=6)])
    text = p.describe()
    assert "pull pairing: local TP1 rank 0 <-> remote TP1 (tp_ratio 1, block-size ratio 2" in text
    assert "remote blocks read in 3 parts" in text
    assert "remote tables: rank 0:" in text
    assert "read in" not in Pairing.create(geo(MLA), [geo(MLA)]).describe()


def _m2(n_groups: int) -> ModelSpec:
    return ModelSpec.from_layers(
        f"mamba2-{n_groups}g",
        [
            AttentionSpec(2, 2, "float16"),
            MambaSpec.mamba2(
                num_heads=2, head_dim=2, n_groups=n_groups, state_size=2, conv_kernel=2, conv_dtype="float16"
            ),
        ],
    )


def _hybrid(model: ModelSpec, tp: int, rank: int = 0) -> RankGeometry:
    from kvgeom.layout.geometry import align_hybrid_block_size

    return geo(model, tp, rank, align_hybrid_block_size(model, tp, 4))


def test_vllm_ssm_reads_scale_pieces_by_the_tp_ratio() -> None:
    # Mamba2, 2 heads of 2, 2 groups of state 2, conv kernel 2 (1 row), fp16: at TP 2 each piece holds
    # 2 channels = 4 B, the temporal state 1 head x 4 x 2 B = 8 B; at TP 1 twice that (conv page 24 B).
    m = _m2(2)
    for rank in (0, 1):
        # D TP 2 from P TP 1 (ratio 2): piece k at sum of 2 x 4 B before it + rank x 4 B; temporal after
        # P's 24 conv bytes, at rank x 8 B
        p = Pairing.create(_hybrid(m, 2, rank), [_hybrid(m, 1)], compat="vllm")
        got = p._vllm_ssm_pieces(p.remote_view(0))
        assert got == ((4 * rank, 4), (8 + 4 * rank, 4), (16 + 4 * rank, 4), (24 + 8 * rank, 8))
    # D TP 1 from P TP 2 (ratio -2): P's page read whole, pieces of 8 // 2 B; temporal after P's 12 B
    p = Pairing.create(_hybrid(m, 1), [_hybrid(m, 2, r) for r in range(2)], compat="vllm")
    assert p._vllm_ssm_pieces(p.remote_view(1)) == ((0, 4), (4, 4), (8, 4), (12, 8))
    # equal TP 2, rank 1: no offset
    p = Pairing.create(_hybrid(m, 2, 1), [_hybrid(m, 2, r) for r in range(2)], compat="vllm")
    assert p._vllm_ssm_pieces(p.remote_view(1)) == ((0, 4), (4, 4), (8, 4), (12, 8))
    # no SSM: nothing to read
    d = Pairing.create(geo(DENSE4), [geo(DENSE4)], compat="vllm")
    assert d._vllm_ssm_pieces(d.remote_view(0)) is None


def test_a_card_for_the_other_mode_is_named() -> None:
    push_card = card_of("d", DENSE4, eng(), "push")
    pull_card = card_of("p", DENSE4, eng())
    with pytest.raises(IncompatiblePairError) as info:
        Pairing.create(push_card, [pull_card], "pull")
    assert "local card is for push, the pair is planned for pull" in str(info.value)
    with pytest.raises(IncompatiblePairError) as info:
        Pairing.create(pull_card, {0: push_card}, "pull")
    assert "remote rank 0 card is for push" in str(info.value)


def test_remote_ranks_agree_apart_from_their_rank_and_stage() -> None:
    # ranks of the remote engine seen from different pipeline stages: the same configuration otherwise
    remotes = [geo(MLA, 2, 0, pp_size=2, pp_rank=0), geo(MLA, 2, 1, pp_size=2, pp_rank=1)]
    assert Pairing.create(geo(MLA), remotes).targets == (0, 1)
    other = geo(MLA, 2, 1, pp_size=2, pp_rank=1, kv_layout="token_major")
    with pytest.raises(IncompatiblePairError) as info:
        Pairing.create(geo(MLA), [remotes[0], other])
    assert info.value.field == "remotes[1].engine"


def test_every_target_gets_the_kvgeom_table_even_when_only_notified() -> None:
    # 2 KV heads, token-major: D TP 1 reads head 0 from P rank 0 and head 1 from P rank 2 (P TP 4 replicates
    # each head on 2 ranks); ranks 1 and 3 are only notified. kvgeom cuts every remote table per token:
    # 2 regions x 8 kernel blocks x 4 tokens, the notified ranks' too (vLLM's tables: one row per block)
    d2 = ModelSpec.from_layers("d2", [AttentionSpec(2, 2, "float16")] * 2)
    tm = {"kv_layout": "token_major"}
    p = Pairing.create(geo(d2, **tm), engine_ranks(d2, 4, **tm))
    assert p.targets == (0, 1, 2, 3) and p.transfer_ranks == (0, 2)
    assert [len(p.remote_table(r)) for r in (1, 3)] == [64, 64]
    assert "rank 1: 64, rank 2: 64, rank 3: 64" in p.describe()


def test_whole_rows_of_a_notified_rank_are_int_lengths() -> None:
    # D TP 1 (2 heads, 64 B token-major pages in 4 token rows of 16 B) and P TP 4 rank 1 (1 head: 32 B pages,
    # rows of 8 B): a rank D does not read from keeps whole rows, the shorter length
    d2 = ModelSpec.from_layers("d2", [AttentionSpec(2, 2, "float16")] * 2)
    tm = {"kv_layout": "token_major"}
    p = Pairing.create(geo(d2, **tm), engine_ranks(d2, 4, **tm))
    fa = p.route(1).fa
    assert fa == ((0, 0, 8), (0, 0, 8)) and all(isinstance(v, int) for s in fa for v in s)


def test_vllm_push_of_an_mla_ssm_hybrid_into_more_ranks() -> None:
    # P TP 1 pushes to D TP 2: vLLM writes the replicated latent to every D rank, and each D rank needs
    # its half of the state heads: both groups travel to both ranks
    mk = ModelSpec.from_layers(
        "mla-kda",
        [MLASpec(2, "float16"), MambaSpec.kda(num_heads=2, head_dim=2, conv_kernel=2, conv_dtype="float16")],
    )
    p = Pairing.create(geo(mk, block=16), [geo(mk, 2, r, block=16) for r in range(2)], "push", "vllm")
    assert p.transfer_ranks == (0, 1)
    assert p.group_mask(0) == p.group_mask(1) == (True, True)


DENSE = ModelSpec.from_layers("dense", [AttentionSpec(2, 4, "float16")])


@pytest.mark.parametrize("which", ["local", "remote"])
def test_a_card_for_the_other_mode_is_refused_naming_both_modes(which: str) -> None:
    e = EngineConfig(tp_size=1, block_size=4, num_blocks=4)
    d = card_of("d", DENSE, e, "push" if which == "local" else "pull")
    p = card_of("p", DENSE, e, "push" if which == "remote" else "pull")
    with pytest.raises(IncompatiblePairError) as err:
        Pairing.create(d, [p], mode="pull")
    assert err.value.field == "mode" and err.value.values == {"local": "pull", "remote": "push"}
    assert ("local card" if which == "local" else "remote rank 0 card") in str(err.value)
