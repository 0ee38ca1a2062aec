"""The oracle's model of regions that share rows (vLLM's packed CSA-linear rows, ``Region.row_offset``):
``region_arrays`` (views of one array per rank), ``byte_places`` (a byte named by its place in region 0's
rows), ``reported_bytes`` (each row byte judged once), and a planted move that aliases onto another layer's
page.

Hand-derived from ``csa_linear_model(main_kv_heads=2, gdn=MambaSpec.gdn(4, 4, 4, 4))``, block 16, 8 blocks,
packed rows. Pages per rank (TP2 and TP4 alike except the GDN state): main KV 16 tokens x 1 head x (8 + 8)
x 2 B = 512 B, MLA 16 x 8 x 2 B = 256 B, ring 64 B, GDN state 208 B at TP2 and 104 B at TP4, PLE 48 B.
vLLM's groups each start at byte 0 of the 1,536-byte row (512 + 512 + 256 + 256: kv0, kv2, attn0, attn2):
rings at 0 and 64, GDN states at 0 and 208 (TP4: 104), PLE at 0. Regions, one per distinct page start in
layer order: 0 kv0 @0 (512 B; also ring0, gdn1, ple), 1 attn0 @1024 (256), 2 kv2 @512 (512), 3 attn2 @1280
(256), 4 ring2 @64 (64), 5 gdn3 @208 (208; TP4 @104, 104 B). Each region is 8 x 1,536 = 12,288 B long, so
the rank's array is 1,280 + 12,288 = 13,568 B (the last region starts latest)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from kvgeom.layout.allocate import rank_geometry
from kvgeom.layout.engine import EngineConfig
from kvgeom.layout.geometry import RankGeometry
from kvgeom.model.csa import csa_linear_model
from kvgeom.model.layers import MambaSpec
from kvgeom.testing import Oracle, Request, pull_plans
from kvgeom.testing._layout import OUTSIDE, RankImage, byte_places, region_arrays, reported_bytes

MODEL = csa_linear_model(main_kv_heads=2, gdn=MambaSpec.gdn(4, 4, 4, 4))
ROW = 1536
OFFSETS = [0, 1024, 512, 1280, 64, 208]
LENS = [512, 256, 512, 256, 64, 208]


def packed(tp: int) -> EngineConfig:
    return EngineConfig(tp_size=tp, block_size=16, num_blocks=8, packed_rows=True)


def geom(tp: int) -> RankGeometry:
    return rank_geometry(MODEL, packed(tp))


def test_the_packed_geometry_is_as_derived() -> None:
    g = geom(2)
    assert [r.row_offset for r in g.regions] == OFFSETS
    assert [r.block_len for r in g.regions] == LENS
    assert {r.block_stride for r in g.regions} == {ROW} and {r.nbytes for r in g.regions} == {8 * ROW}
    assert [r.row_offset for r in geom(4).regions] == [0, 1024, 512, 1280, 64, 104]


# ---- region_arrays --------------------------------------------------------------------------------------


def test_region_arrays_alias_shared_rows() -> None:
    arrays = region_arrays(geom(2), 7, np.int64)
    assert len(arrays) == 6 and all(a.size == 8 * ROW and a.dtype == np.int64 for a in arrays)
    assert all((a == 7).all() for a in arrays)
    assert {a.dtype for a in region_arrays(geom(2), 0, np.int8)} == {
        np.dtype(np.int8)
    }  # not numpy's default int
    base = arrays[0].base
    assert base is not None and base.size == 1280 + 8 * ROW  # 13,568
    assert all(a.base is base for a in arrays)
    # a write through region 4 (row byte 64) is region 0's byte 64
    arrays[4][0] = 11
    assert arrays[0][64] == 11 and arrays[0][63] == 7 and arrays[0][65] == 7
    # region 5 starts at row byte 208; region 1 (1024) sits 512 bytes into region 2 (512)
    arrays[5][ROW + 3] = 12
    assert arrays[0][ROW + 208 + 3] == 12
    arrays[1][5] = 13
    assert arrays[2][512 + 5] == 13 and arrays[0][1024 + 5] == 13
    # the last byte of region 3 (1,280 + 12,287) is the last byte of the rank's array
    arrays[3][-1] = 14
    assert base[-1] == 14 and base[1280 + 8 * ROW - 1] == 14


def test_region_arrays_of_regions_of_their_own_are_separate() -> None:
    g = rank_geometry(MODEL, EngineConfig(tp_size=2, block_size=16, num_blocks=8))
    assert all(r.row_offset is None for r in g.regions)
    arrays = region_arrays(g, -1, np.int8)
    assert [a.size for a in arrays] == [r.nbytes for r in g.regions]
    assert all(a.dtype == np.int8 and (a == -1).all() for a in arrays)
    arrays[0][:] = 3
    assert all((a == -1).all() for a in arrays[1:])
    assert not any(np.shares_memory(arrays[0], a) for a in arrays[1:])


# ---- byte_places ----------------------------------------------------------------------------------------


def test_byte_places_name_region_zeros_row_bytes() -> None:
    g = geom(2)
    for r, off in enumerate(OFFSETS):
        region, places = byte_places(g, r)
        assert region == 0 and places.dtype == np.int64 and places.size == 8 * ROW
        assert places[0] == off and places[-1] == off + 8 * ROW - 1
        assert (np.diff(places) == 1).all()
    plain = rank_geometry(MODEL, EngineConfig(tp_size=2, block_size=16, num_blocks=8))
    region, places = byte_places(plain, 2)
    assert region == 2 and places.tolist() == list(range(plain.regions[2].nbytes))


# ---- reported_bytes -------------------------------------------------------------------------------------


def test_reported_bytes_judge_each_row_byte_once() -> None:
    """Shortest region first (64: r4, 208: r5, 256: r1 then r3, 512: r0 then r2), each claiming the unclaimed
    bytes of its blocks: row bytes [64, 128) r4, [208, 416) r5, [1024, 1280) r1, [1280, 1536) r3, [512, 1024)
    r2, and r0 the rest of its page: [0, 64), [128, 208), [416, 512)."""
    mine = reported_bytes(geom(2))
    assert mine is not None and len(mine) == 6
    assert all(m.dtype == bool and m.size == 8 * ROW for m in mine)

    def runs(mask: np.ndarray) -> list[tuple[int, int]]:
        edges = np.flatnonzero(np.diff(np.concatenate(([0], mask[:ROW].astype(np.int8), [0]))))
        return list(zip(edges[0::2].tolist(), edges[1::2].tolist()))

    # within block 0, in each region's own offsets (row byte - row offset)
    assert runs(mine[0]) == [(0, 64), (128, 208), (416, 512)]
    assert runs(mine[1]) == [(0, 256)]
    assert runs(mine[2]) == [(0, 512)]
    assert runs(mine[3]) == [(0, 256)]
    assert runs(mine[4]) == [(0, 64)]
    assert runs(mine[5]) == [(0, 208)]
    # every block alike: 8 x (64 + 80 + 96) = 1,920 B for r0, 8 x 256 for r1 and r3, ...; plus the 1,280 B
    # past the last row (below): 1,024 for r1, 256 for r3. Every byte of the array is judged exactly once.
    assert [int(m.sum()) for m in mine] == [1920, 2048 + 1024, 4096, 2048 + 256, 512, 1664]
    assert sum(int(m.sum()) for m in mine) == 8 * ROW + 1280
    # block 7 of region 0, row byte 416: r0's; of region 5, its 207th byte (row byte 415): r5's
    assert mine[0][7 * ROW + 416] and not mine[0][7 * ROW + 415] and mine[5][7 * ROW + 207]
    assert not mine[5][7 * ROW + 208]


def test_reported_bytes_the_shorter_region_keeps_an_overlap() -> None:
    """TP4: region 5 (104 B at row byte 104) overlaps region 4 ([64, 128)): the shorter region 4 keeps
    [104, 128); region 5 reports [128, 208), its offsets [24, 104)."""
    mine = reported_bytes(geom(4))
    assert mine is not None
    assert np.flatnonzero(mine[5][:ROW]).tolist() == list(range(24, 104))
    assert np.flatnonzero(mine[4][:ROW]).tolist() == list(range(64))


def test_reported_bytes_ties_go_to_the_lower_index() -> None:
    """A made-up overlap of two equally long regions: region 4 widened to 208 B covers row bytes [64, 272),
    region 5 [208, 416). Both 208 B long: region 4 (the lower index) keeps the shared [208, 272); region 5
    reports [272, 416), its offsets [64, 208)."""
    g = geom(2)
    wide = replace(g, regions=(*g.regions[:4], replace(g.regions[4], block_len=208), g.regions[5]))
    mine = reported_bytes(wide)
    assert mine is not None
    assert np.flatnonzero(mine[4][:ROW]).tolist() == list(range(208))
    assert np.flatnonzero(mine[5][:ROW]).tolist() == list(range(64, 208))
    # region 4 widened to 512 B ([64, 576)) ties with region 0 (and 2): region 0 keeps [64, 208) and [416, 512)
    # (region 5 the shorter [208, 416)), region 2 [512, 576); region 4 reports nothing of block 0
    wider = replace(g, regions=(*g.regions[:4], replace(g.regions[4], block_len=512), g.regions[5]))
    mine = reported_bytes(wider)
    assert mine is not None
    assert not mine[4][:ROW].any()
    assert np.flatnonzero(mine[0][:ROW]).tolist() == [*range(208), *range(416, 512)]


def test_reported_bytes_of_regions_of_their_own_is_none() -> None:
    assert reported_bytes(rank_geometry(MODEL, EngineConfig(tp_size=2, block_size=16, num_blocks=8))) is None


# ---- the oracle catches aliasing corruption -------------------------------------------------------------

SRC_REGION, SRC_OFF, DST_REGION, DST_OFF, LENGTH = 1, 2, 4, 5, 6


def test_a_token_block_through_the_state_region_lands_on_the_main_kv_page() -> None:
    """kvgeom mode, P TP2 -> D TP4 (pull), 40 tokens: token group 0 (main KV + MLA) blocks 1-3, ring 4, GDN 5,
    PLE 6. Each D rank reads per token block its main-KV and MLA pages (512 + 256 + 512 + 256 = 1,536 B), its
    two 64-byte ring pages, its two 104-byte GDN states, its 48-byte PLE page: 4,608 + 128 + 208 + 48 = 4,992 B.

    Planted on D rank 0 after its correct moves: vLLM's copy of token block 1 through region 5, P rank 0's
    (row byte 1,536 + 208) to D rank 0's (row byte 1,536 + 104), 208 B. On P that is bytes [208, 416) of the
    block-1 kv0 page; on D it lands on bytes [104, 312) of the block-1 kv0 page, which the correct move wrote
    with P's [104, 312) (D rank 0 holds P rank 0's head): every byte differs (I5, D rank 0 region 5 bytes
    [1,536, 1,744)). In the report those row bytes [104, 312) are judged once: [104, 128) by region 4 (its
    offsets 1,536 + 40..64), [128, 208) by region 5 (1,536 + 24..104), [208, 312) by region 0
    (1,536 + 208..312), all I2 (a coordinate, the wrong one): 24 + 80 + 104 = 208 B."""
    p, d = packed(2), packed(4)
    req = Request.simple(MODEL, p, d, 40)
    assert req.d_ids == ((1, 2, 3), (4,), (5,), (6,))
    oracle = Oracle.for_engines(MODEL, p, d, req)
    for rp in pull_plans(MODEL, p, d, req, "kvgeom"):
        moves = oracle.moves_of(rp)
        if rp.rank == 0:
            moves = np.vstack([moves, [[0, 5, ROW, 0, 5, ROW, 208, 208]]])
        oracle.execute(moves, f"rank {rp.rank}")
        oracle.receive(rp.rank, rp.plan.regroup, rp.plan.zero)
    report = oracle.report()
    assert report.bytes_moved == 4 * 4992 + 208
    assert dict(report.violated_bytes) == {"I5": 208, "I2": 208}
    got = sorted((v.invariant, v.rank, v.region, v.start, v.stop) for v in report.violations)
    assert got == [
        ("I2", 0, 0, ROW + 208, ROW + 312),
        ("I2", 0, 4, ROW + 40, ROW + 64),
        ("I2", 0, 5, ROW + 24, ROW + 104),
        ("I5", 0, 5, ROW, ROW + 208),
    ]


def test_the_correct_plan_of_that_pair_passes() -> None:
    p, d = packed(2), packed(4)
    req = Request.simple(MODEL, p, d, 40)
    oracle = Oracle.for_engines(MODEL, p, d, req)
    for rp in pull_plans(MODEL, p, d, req, "kvgeom"):
        oracle.execute(oracle.moves_of(rp), f"rank {rp.rank}")
        oracle.receive(rp.rank, rp.plan.regroup, rp.plan.zero)
    report = oracle.report()
    assert report.ok and report.bytes_moved == 4 * 4992, report


def test_bytes_past_the_last_row_are_judged_by_the_regions_reaching_them() -> None:
    """The rank's array runs 1,280 B past its 8 rows (region 3 starts at row byte 1,280 and is 12,288 B
    long). Those bytes lie in no region's block and outside region 0's view: region 1 (its offsets
    [11,264, 12,288), array bytes [12,288, 13,312)) and region 3 (its offsets [12,032, 12,288), array bytes
    [13,312, 13,568)) report them."""
    mine = reported_bytes(geom(2))
    assert mine is not None
    assert np.flatnonzero(mine[1][8 * ROW - 1024 :]).tolist() == list(range(1024))
    assert np.flatnonzero(mine[3][8 * ROW - 1280 :]).tolist() == list(range(1024, 1280))
    assert not mine[2][8 * ROW - 512 :].any() and not mine[4][8 * ROW - 64 :].any()


def test_a_write_past_the_last_row_is_caught() -> None:
    """Regression: a move inside region 3's bounds but past the rank's last row (D rank 0 region 3 bytes
    [11,008, 11,264): array bytes [12,288, 12,544), beyond the 8 rows) was judged by no region and passed.
    Region 1 now reports those bytes (its offsets [11,264, 11,520)): they must keep their resident tags (I1,
    256 B)."""
    p = packed(2)
    req = Request.simple(MODEL, p, p, 40)
    oracle = Oracle.for_engines(MODEL, p, p, req)
    for rp in pull_plans(MODEL, p, p, req, "kvgeom"):
        moves = oracle.moves_of(rp)
        if rp.rank == 0:
            moves = np.vstack([moves, [[0, 3, ROW, 0, 3, 11008, 256, 256]]])
        oracle.execute(moves, f"rank {rp.rank}")
        oracle.receive(rp.rank, rp.plan.regroup, rp.plan.zero)
    report = oracle.report()
    assert dict(report.violated_bytes) == {"I1": 256}
    assert [(v.invariant, v.rank, v.region, v.start, v.stop) for v in report.violations] == [
        ("I1", 0, 1, 11264, 11520)
    ]


def test_an_empty_rank_image_aliases_too() -> None:
    """``RankImage.empty``: tags (int64, -1: none) and roles (int8, 0: OUTSIDE) as views of one row array each."""
    img = RankImage.empty(geom(2))
    assert img.rank == 0 and len(img.tags) == len(img.role) == 6
    assert all(t.dtype == np.int64 and (t == -1).all() for t in img.tags)
    assert all(r.dtype == np.int8 and (r == OUTSIDE).all() for r in img.role)
    img.tags[4][0] = 5
    img.role[5][0] = 2
    assert img.tags[0][64] == 5 and img.role[0][208] == 2
