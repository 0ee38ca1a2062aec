"""kvgeom.layout.runs: the strided-runs layout value, checked against a byte-by-byte model."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvgeom import PlanError
from kvgeom.layout.runs import Runs, coalesce_moves


def elements(r: Runs) -> list[tuple[int, int]]:
    """The model: every element as (address, length), in id order, by two Python loops."""
    out = []
    for b, ln, s, c in zip(r.base.tolist(), r.length.tolist(), r.stride.tolist(), r.count.tolist()):
        out.extend((b + k * s, ln) for k in range(c))
    return out


def byte_set(r: Runs) -> set[int]:
    return {a + i for a, ln in elements(r) for i in range(ln)}


run = st.tuples(st.integers(0, 200), st.integers(0, 24), st.integers(-8, 40), st.integers(0, 5))
runs = st.lists(run, max_size=8).map(
    lambda rows: (
        Runs.of(*(np.asarray([r[i] for r in rows], dtype=np.int64) for i in range(4)))
        if rows
        else Runs.empty()
    )
)


@settings(max_examples=150, deadline=None)
@given(runs)
def test_expand_and_take_list_the_elements_in_id_order(r: Runs) -> None:
    want = elements(r)
    addr, length = r.expand()
    assert list(zip(addr.tolist(), length.tolist())) == want
    assert r.size == len(want)
    assert r.nbytes == sum(ln for _, ln in want)
    ids = np.arange(len(want))[::-1]
    a2, l2 = r.take(ids)
    assert list(zip(a2.tolist(), l2.tolist())) == [want[i] for i in ids]


@settings(max_examples=150, deadline=None)
@given(runs)
def test_joined_keeps_every_element_and_never_has_more_runs(r: Runs) -> None:
    j = r.joined()
    assert elements(j) == elements(r)
    assert len(j) <= len(r)


def test_joined_merges_runs_that_continue_one_another() -> None:
    r = Runs.of([0, 30, 60, 100], 10, 10, [3, 3, 1, 2])
    j = r.joined()
    assert (j.base.tolist(), j.count.tolist()) == ([0, 100], [7, 2])


@settings(max_examples=150, deadline=None)
@given(runs)
def test_coalesced_covers_the_same_bytes_with_disjoint_sorted_ranges(r: Runs) -> None:
    c = r.coalesced()
    assert byte_set(c) == byte_set(r)
    ends = c.base + c.length
    assert (c.count == 1).all() and (c.length > 0).all()
    assert (c.base[1:] > ends[:-1]).all()  # disjoint and not touching: the fewest ranges


@settings(max_examples=100, deadline=None)
@given(runs, st.integers(0, 6), st.integers(0, 6))
def test_slice_cuts_the_same_bytes_of_every_element(r: Runs, off: int, ln: int) -> None:
    fits = bool((off + ln <= r.length).all())
    if not fits:
        with pytest.raises(PlanError) as e:
            r.slice(off, ln)
        assert e.value.field == "slice"
        return
    got = elements(r.slice(off, ln))
    assert got == [(a + off, ln) for a, _ in elements(r)]


def test_units_take_a_token_range_of_every_row() -> None:
    # a page of 2 runs: 4 rows of 2-byte tokens, rows 64 bytes apart, then 1 row of 8-byte tokens
    page = Runs.of([0, 256], [2, 8], [64, 0], [4, 1])
    tokens = page.units(3, 2)  # tokens 3 and 4
    assert elements(tokens) == [(6, 4), (70, 4), (134, 4), (198, 4), (280, 16)]
    with pytest.raises(PlanError) as e:
        page.units(-1, 2)
    assert e.value.field == "units"


def test_compose_places_the_inner_runs_in_every_element() -> None:
    blocks = Runs.of(1000, 100, 100, 3)  # 3 blocks of 100 bytes
    inner = Runs.of([0, 50], [10, 20], [25, 0], [2, 1])  # two 10-byte rows 25 apart, then a 20-byte row
    got = elements(blocks.compose(inner))
    want = [(1000 + 100 * b + a, ln) for b in range(3) for a, ln in elements(inner)]
    assert got == want


def test_nixl_rows_round_trip_and_a_device_column() -> None:
    r = Runs.of([0, 64], [16, 32], [16, 64], [4, 2])
    rows = r.nixl(device=3)
    assert rows.tolist() == [[0, 16, 3, 16, 4], [64, 32, 3, 64, 2]]
    back = Runs.from_nixl(rows)
    assert elements(back) == elements(r)
    flat = Runs.from_nixl(np.asarray([[5, 7, 0], [40, 2, 0]]))
    assert elements(flat) == [(5, 7), (40, 2)]


def test_bad_columns_name_the_field() -> None:
    with pytest.raises(PlanError) as e:
        Runs.of([0, 1, 2], [1, 2])
    assert e.value.field == "length"
    with pytest.raises(PlanError) as e:
        Runs.of(0, -1)
    assert e.value.field == "runs.length"
    with pytest.raises(PlanError) as e:
        Runs.of(0, 4, 4, 2).take([2])
    assert e.value.field == "ids" and e.value.values == {"value": 2, "expected": 2}


moves = st.lists(st.tuples(st.integers(0, 6), st.integers(0, 6), st.integers(1, 3)), max_size=12)


@settings(max_examples=150, deadline=None)
@given(moves)
def test_coalesce_moves_keeps_every_byte_pairing_and_merges_both_sided_runs(m: list) -> None:
    # unit-aligned moves: src slot i*4, dst slot j*4, length n (<= 4, so no two moves overlap in a slot's)
    src = Runs.ranges([i * 4 for i, _, _ in m], [n for _, _, n in m]) if m else Runs.empty()
    dst = Runs.ranges([j * 4 for _, j, _ in m], [n for _, _, n in m]) if m else Runs.empty()
    s2, d2 = coalesce_moves(src, dst)

    def pairs(a: Runs, b: Runs) -> set[tuple[int, int]]:
        out = set()
        for (sa, ln), (da, _) in zip(elements(a), elements(b)):
            out.update((sa + k, da + k) for k in range(ln))
        return out

    assert pairs(s2, d2) == pairs(src, dst)
    assert len(s2) <= len(src)
    sa, sl = s2.expand()
    da, _ = d2.expand()
    order = np.lexsort((da, sa))
    sa, sl, da = sa[order], sl[order], da[order]
    # maximal: no two consecutive moves are contiguous on both sides
    assert not ((sa[1:] == sa[:-1] + sl[:-1]) & (da[1:] == da[:-1] + sl[:-1])).any()


def test_coalesce_moves_refuses_unequal_lengths() -> None:
    with pytest.raises(PlanError) as e:
        coalesce_moves(Runs.ranges([0], [4]), Runs.ranges([0], [5]))
    assert e.value.field == "moves"
