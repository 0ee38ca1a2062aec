"""kvgeom.pair.route: the slices one local rank exchanges with one remote rank, derived by hand for small
geometries (head slices gathered from several sources, whole rows, replicated latents in chunks, SSM pieces),
in pulls and pushes, and each refusal's field and values."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from kvgeom import EngineConfig, KvgeomError
from kvgeom.errors import UnsupportedError
from kvgeom.layout.allocate import rank_geometry
from kvgeom.layout.geometry import RankGeometry
from kvgeom.model.layers import AttentionSpec, MambaSpec, MLASpec, Shard
from kvgeom.model.spec import ModelSpec
from kvgeom.pair.route import Route, _unit_slice, dcp_pages_differ, route

DENSE4 = ModelSpec.from_layers("dense4", [AttentionSpec(4, 2, "float16")] * 2)  # 8 B per token-head (K|V)
MLA = ModelSpec.from_layers("mla", [MLASpec(8, "float16")] * 2)  # 16 B per token
DRAFT = ModelSpec.from_layers("mla+draft", [MLASpec(8, "float16")] * 2 + [AttentionSpec(4, 4, "float16")] * 2)
M2 = ModelSpec.from_layers(
    "m2",
    [
        MambaSpec.mamba2(
            num_heads=2, head_dim=2, n_groups=1, state_size=2, conv_kernel=2, conv_dtype="float16"
        )
    ],
)


def geo(model: ModelSpec, tp: int = 1, block: int = 4, rank: int = 0, **kw: Any) -> RankGeometry:
    return rank_geometry(model, EngineConfig(tp_size=tp, tp_rank=rank, block_size=block, num_blocks=8, **kw))


def refused(cls: type[KvgeomError], field: str, fn: Callable[[], object], **values: object) -> None:
    with pytest.raises(KvgeomError) as info:
        fn()
    assert type(info.value) is cls, (type(info.value), info.value)
    assert info.value.field == field
    assert info.value.values == values


# ---- dcp_pages_differ ------------------------------------------------------------------------------------


def test_dcp_pages_differ() -> None:
    plain, plain8 = geo(MLA), geo(MLA, block=8)
    d2, d2b8 = geo(MLA, tp=2, dcp_size=2), geo(MLA, tp=2, dcp_size=2, block=8)
    assert not dcp_pages_differ(plain, plain8, "push")  # no DCP
    assert not dcp_pages_differ(d2, plain)  # DCP, equal pages, pull (the default)
    assert dcp_pages_differ(d2, plain, "push")
    assert dcp_pages_differ(plain8, d2, "pull")  # only the second side shards (DCP 2)
    assert dcp_pages_differ(d2b8, plain, "pull")  # only the first side
    assert not dcp_pages_differ(plain, d2, "pull")


# ---- attention rows ---------------------------------------------------------------------------------------


def test_pull_a_head_slice_from_a_wider_producer_rank() -> None:
    # D TP 2 rank 1 holds heads 2-3 (2 heads x 4 tokens x 8 B = 64 B); P TP 1 holds all 4 (128 B):
    # units of 32 B per head; D's heads start 2 units into P's page
    d = geo(DENSE4, tp=2, rank=1)
    assert route(d, geo(DENSE4), 0, "pull", 1, (128, 128)) == Route(
        0, (True,), ((0, 64, 64), (0, 64, 64)), None
    )
    d0 = geo(DENSE4, tp=2, rank=0)
    assert route(d0, geo(DENSE4), 0, "pull", 1, (128, 128)).fa == ((0, 0, 64), (0, 0, 64))


def test_pull_gathers_heads_from_two_producer_ranks() -> None:
    # D TP 1 (128 B: 4 heads) from P TP 2 (64 B each): rank 1 gives D's bytes 64-127 from its offset 0
    d = geo(DENSE4)
    assert route(d, geo(DENSE4, tp=2), 1, "pull", 1, (64, 64)) == Route(1, (True,), ((64, 0, 64),) * 2, None)
    assert route(d, geo(DENSE4, tp=2), 0, "pull", 1, (64, 64)).fa == ((0, 0, 64),) * 2


def test_push_writes_the_consumers_heads() -> None:
    # P TP 1 pushes to D TP 2 rank 1: D needs heads 2-3, at P offset 64: (local 64, remote 0, 64)
    p = geo(DENSE4)
    assert route(p, geo(DENSE4, tp=2), 1, "push", 1, (64, 64)).fa == ((64, 0, 64),) * 2
    # P TP 2 rank 1 pushes its 2 heads into D TP 1's page at 64
    p1 = geo(DENSE4, tp=2, rank=1)
    assert route(p1, geo(DENSE4), 0, "push", 1, (128, 128)).fa == ((0, 64, 64),) * 2


def test_whole_rows_and_local_rows() -> None:
    # equal heads: the row as it is; local block 8 cut in 2 rows of 128 B
    assert route(geo(DENSE4, block=8), geo(DENSE4), 0, "pull", 2, (128, 128)).fa == ((0, 0, 128),) * 2
    # per-stream lengths and kinds can be given instead of the regions'
    got = route(
        geo(DENSE4), geo(DENSE4), 0, "pull", 1, (40, 128), local_lens=(40, 128), local_is_mla=(True, False)
    )
    assert got.fa == ((0, 0, 40), (0, 0, 128))
    refused(
        UnsupportedError,
        "regions[1].block_len",
        lambda: route(geo(DENSE4), geo(DENSE4), 0, "pull", 1, (128, 100)),
        local=128,
        remote=100,
    )
    # a latent row: the shorter of the two, no length rule
    assert route(geo(MLA), geo(MLA), 0, "pull", 1, (32, 64)).fa == ((0, 0, 32), (0, 0, 64))
    assert route(geo(MLA), geo(MLA), 0, "pull", 1, (64, 64), local_lens=(48, 64)).fa == (
        (0, 0, 48),
        (0, 0, 64),
    )


def test_mla_reads_one_source_and_skips_the_others() -> None:
    # D TP 1 reads the latent from P rank 0 only; P rank 1 carries no group
    d = geo(MLA)
    assert route(d, geo(MLA, tp=2), 0, "pull", 1, (64, 64)) == Route(0, (True,), ((0, 0, 64),) * 2, None)
    assert route(d, geo(MLA, tp=2), 1, "pull", 1, (64, 64)).groups == (False,)


def test_dcp_pages_of_other_sizes_spread_over_every_producer() -> None:
    # D TP 2 DCP 2 rank 0 (block 8) against P TP 2 DCP 2 (block 4): D's tokens live on both P ranks
    d = geo(MLA, tp=2, dcp_size=2, block=8)
    assert route(d, geo(MLA, tp=2, dcp_size=2), 1, "pull", 2, (64, 64)).groups == (True,)
    # equal pages: rank 0 reads rank 0 only
    d4 = geo(MLA, tp=2, dcp_size=2)
    assert route(d4, geo(MLA, tp=2, dcp_size=2), 1, "pull", 1, (64, 64)).groups == (False,)
    assert route(d4, geo(MLA, tp=2, dcp_size=2), 0, "pull", 1, (64, 64)).groups == (True,)


# ---- a draft under MLA: latents in chunks -----------------------------------------------------------------


def test_draft_latents_are_gathered_in_chunks() -> None:
    # D TP 1 reads from P TP 2 ranks 0 and 1: the 64 B latent page (4 tokens x 16 B) in two 32 B chunks;
    # the draft's 4 heads (16 B per token-head: 256 B) from 2 heads (128 B) on each rank
    d = geo(DRAFT)
    rows = (64, 64, 128, 128)
    assert route(d, geo(DRAFT, tp=2), 1, "pull", 1, rows).fa == ((32, 32, 32),) * 2 + ((128, 0, 128),) * 2
    assert route(d, geo(DRAFT, tp=2), 0, "pull", 1, rows).fa == ((0, 0, 32),) * 2 + ((0, 0, 128),) * 2
    refused(
        UnsupportedError,
        "regions[0].block_len",
        lambda: route(d, geo(DRAFT, tp=2), 0, "pull", 1, (48, 64, 128, 128)),
        local=64,
        remote=48,
    )
    # an odd length cannot be cut in 2 equal chunks, even when both sides agree on it
    refused(
        UnsupportedError,
        "regions[0].block_len",
        lambda: route(d, geo(DRAFT, tp=2), 0, "pull", 1, (63, 64, 128, 128), local_lens=(63, 64, 256, 256)),
        local=63,
        remote=63,
    )
    # one source (equal TP): the latent whole
    assert route(d, geo(DRAFT), 0, "pull", 1, (64, 64, 256, 256)).fa == ((0, 0, 64),) * 2 + ((0, 0, 256),) * 2


# ---- SSM pieces -----------------------------------------------------------------------------------------


def test_ssm_pieces_gathered_from_two_producers() -> None:
    # Mamba2, 2 heads of 2, 1 group of state 2, conv kernel 2 (1 row), fp16. D TP 1 from P TP 2 rank r:
    # x: 2 B per channel, 2 channels per head: D [0, 8), P [0, 4): rank r gives D's bytes 4r..4r+4 from 0
    # B, C: 1 group replicated on P (4 B): 2 B chunks at 2r; D's B at 8, C at 12; P's B at 4, C at 8
    # temporal: 2 heads x 4 elems x 2 B: D [16, 32), P [12, 20): 8 B at D 16 + 8r from P 12
    d = geo(M2)
    r0 = route(d, geo(M2, tp=2), 0, "pull", 1, (d.regions[0].block_len,))
    r1 = route(d, geo(M2, tp=2), 1, "pull", 1, (d.regions[0].block_len,))
    assert r0.ssm == ((0, 0, 4), (8, 4, 2), (12, 8, 2), (16, 12, 8))
    assert r1.ssm == ((4, 0, 4), (10, 6, 2), (14, 10, 2), (24, 12, 8))
    assert r0.groups == r1.groups == (True,)
    # push from P TP 2 rank 1 into D TP 1: the same slices, local (P) offset first
    p1 = geo(M2, tp=2, rank=1)
    pushed = route(p1, geo(M2), 0, "push", 1, (d.regions[0].block_len,))
    assert pushed.ssm == ((0, 4, 4), (6, 10, 2), (10, 14, 2), (12, 24, 8))


def test_unit_slice_refusals_and_boundaries() -> None:
    heads = Shard(4, 1)
    # consumer TP 2 rank 1 (units 2-3) from producer TP 1 (units 0-3): 16 B at producer 16, ending at 32
    assert _unit_slice(heads, 8, 1, 2, 0, 1, 0, 1, "h") == (0, 16, 16)
    # consumer TP 1 (units 0-3) from producer TP 2 rank 1 (units 2-3) as its only source: not held
    refused(
        UnsupportedError,
        "h",
        lambda: _unit_slice(heads, 8, 0, 1, 1, 2, 0, 1, "h"),
        local=(0, 4),
        remote=(2, 2),
    )
    # consumer TP 2 rank 1 (units 2-3) from producer TP 2 rank 0 (units 0-1): past its end
    refused(
        UnsupportedError,
        "h",
        lambda: _unit_slice(heads, 8, 1, 2, 0, 2, 0, 1, "h"),
        local=(2, 2),
        remote=(0, 2),
    )
    # 4 units x 3 B = 12 B from 5 sources
    refused(UnsupportedError, "h", lambda: _unit_slice(heads, 3, 0, 1, 0, 1, 0, 5, "h"), value=12, expected=5)


def test_a_replicated_consumer_reads_every_dcp_shard() -> None:
    # P TP 2 DCP 2 holds every request's pages alternately on its 2 ranks: D TP 1 (DCP 1) reads both,
    # though for MLA without DCP it would read rank 0 only
    d = geo(MLA)
    for rank in (0, 1):
        assert route(d, geo(MLA, tp=2, dcp_size=2), rank, "pull", 1, (64, 64)).groups == (True,)
    assert route(d, geo(MLA, tp=2), 1, "pull", 1, (64, 64)).groups == (False,)


def test_slices_are_whole_bytes() -> None:
    # offsets and lengths index byte tables: Python ints, never floats that merely compare equal
    got = [
        _unit_slice(Shard(4, 1), 8, 1, 2, 0, 1, 0, 1, "h"),
        *route(geo(DENSE4), geo(DENSE4, tp=2), 1, "pull", 1, (64, 64)).fa,
        *route(geo(DRAFT), geo(DRAFT, tp=2), 1, "pull", 1, (64, 64, 128, 128)).fa,
        *(route(geo(M2), geo(M2, tp=2), 1, "pull", 1, (geo(M2).regions[0].block_len,)).ssm or ()),
    ]
    assert len(got) == 1 + 2 + 4 + 4
    assert all(isinstance(v, int) for s in got for v in s), got


def test_state_rows_of_an_attention_free_model_are_read_whole() -> None:
    # no attention group, so no attention source: a state page row pairs as it is, at the shorter length
    d, p = geo(M2), geo(M2, tp=2)
    dlen, plen = d.regions[0].block_len, p.regions[0].block_len
    assert dlen > plen
    got = route(d, p, 1, "pull", 1, (plen,))
    assert got.fa == ((0, 0, plen),) and got.groups == (True,)


DENSE = ModelSpec.from_layers("dense", [AttentionSpec(2, 4, "float16")])


def test_route_refuses_rows_of_different_lengths_naming_the_region() -> None:
    from kvgeom import UnsupportedError, rank_geometry
    from kvgeom.pair.route import route

    geom = rank_geometry(DENSE, EngineConfig(tp_size=1, block_size=4, num_blocks=4))
    rows = tuple(r.block_len for r in geom.regions)
    route(geom, geom, 0, "pull", 1, rows)  # equal rows pair whole
    with pytest.raises(UnsupportedError) as err:
        route(geom, geom, 0, "pull", 1, tuple(n // 2 for n in rows))
    assert err.value.field == "regions[0].block_len"


def test_route_refuses_a_replicated_latent_that_draft_sources_cannot_split_evenly() -> None:
    """A GQA draft under MLA targets, D TP1 reading P TP2: D's latent page is gathered in equal chunks
    from both draft sources; a remote latent row of another length is refused naming the region."""
    from kvgeom import UnsupportedError, rank_geometry
    from kvgeom.pair.route import route

    draft = ModelSpec.from_layers(
        "mla+draft", [MLASpec(8, "float16")] * 2 + [AttentionSpec(4, 4, "float16")] * 2
    )
    local = rank_geometry(draft, EngineConfig(tp_size=1, block_size=4, num_blocks=4))
    remote = rank_geometry(draft, EngineConfig(tp_size=2, block_size=4, num_blocks=4))
    rows = [r.block_len for r in remote.regions]
    route(local, remote, 0, "pull", 1, tuple(rows))
    mla = next(i for i, r in enumerate(local.regions) if r.is_mla)
    rows[mla] //= 2
    with pytest.raises(UnsupportedError) as err:
        route(local, remote, 0, "pull", 1, tuple(rows))
    assert err.value.field == f"regions[{mla}].block_len"
