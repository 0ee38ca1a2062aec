"""Who talks to whom (kvgeom.plan.pairing.pair_targets) and who writes to a decode rank in push
(kvgeom.plan.pairing.push_writers): worked by hand for DCP pairs, and equal to what ``Pairing.create`` pairs."""

from __future__ import annotations

import pytest

from kvgeom import GeometryCard
from kvgeom.layout.allocate import rank_geometry
from kvgeom.layout.engine import EngineConfig
from kvgeom.layout.geometry import RankGeometry
from kvgeom.model.layers import MLASpec
from kvgeom.model.spec import ModelSpec
from kvgeom.plan.pairing import Pairing, pair_targets, push_writers

MLA = ModelSpec.from_layers("mla", [MLASpec(8, "float16")] * 2)


def engine(tp: int, dcp: int) -> list[RankGeometry]:
    return [
        rank_geometry(MLA, EngineConfig(tp_size=tp, tp_rank=r, block_size=4, num_blocks=32, dcp_size=dcp))
        for r in range(tp)
    ]


# P TP4 sharded by DCP 4 -> D TP2 sharded by DCP 2: P rank p holds global pages p, p+4, ...; vLLM sends
# them to D rank p % 2 (its DCP source rule); kvgeom mode in push pairs every P rank with every D rank.
@pytest.mark.parametrize(
    ("compat", "targets", "writers"),
    [
        ("vllm", [(0,), (1,), (0,), (1,)], [(0, 2), (1, 3)]),
        ("kvgeom", [(0, 1)] * 4, [(0, 1, 2, 3)] * 2),
    ],
)
def test_push_writers_of_a_dcp_pair(compat: str, targets: list, writers: list) -> None:
    ps, ds = engine(4, 4), engine(2, 2)
    assert [pair_targets(p, ds[0], "push", compat) for p in ps] == targets
    assert [Pairing.create(p, ds, "push", compat).targets for p in ps] == targets  # the core pairs so
    assert [push_writers(ps[3], d, compat) for d in ds] == writers  # any producer rank stands for its engine
    # without DCP's widening (TP alone: D rank d <- P ranks 2d, 2d+1) D would wait for other writers
    assert writers != [(0, 1), (2, 3)]


@pytest.mark.parametrize(
    ("p_tp", "p_dcp", "d_tp", "d_dcp"), [(4, 4, 2, 2), (4, 1, 2, 2), (2, 2, 2, 1), (4, 1, 2, 1), (2, 1, 4, 1)]
)
@pytest.mark.parametrize("compat", ["kvgeom", "vllm"])
def test_the_writers_are_the_ranks_whose_pairing_names_the_decode_rank(
    p_tp: int, p_dcp: int, d_tp: int, d_dcp: int, compat: str
) -> None:
    ps, ds = engine(p_tp, p_dcp), engine(d_tp, d_dcp)
    paired = [Pairing.create(p, ds, "push", compat).targets for p in ps]
    for d in ds:
        assert push_writers(ps[0], d, compat) == tuple(p for p in range(p_tp) if d.tp_rank in paired[p])
    pulled = [Pairing.create(d, ps, "pull", compat).targets for d in ds]
    assert [pair_targets(d, ps[0], "pull", compat) for d in ds] == pulled


def test_without_dcp_the_writers_follow_the_tp_ratio() -> None:
    ps, ds = engine(4, 1), engine(2, 1)
    assert [push_writers(ps[0], d) for d in ds] == [(0, 1), (2, 3)]
    ps, ds = engine(2, 1), engine(4, 1)
    assert [push_writers(ps[1], d, "vllm") for d in ds] == [(0,), (0,), (1,), (1,)]
    assert pair_targets(ps[0], ds[0], "push", local_rank=1) == (2, 3)  # another rank than the card's


def test_cards_stand_for_their_geometry() -> None:
    p = GeometryCard(
        "p", MLA, EngineConfig(tp_size=4, tp_rank=1, block_size=4, num_blocks=32, dcp_size=4), "push"
    )
    d = GeometryCard(
        "d", MLA, EngineConfig(tp_size=2, tp_rank=1, block_size=4, num_blocks=32, dcp_size=2), "push"
    )
    assert pair_targets(p, d, "push", "vllm") == (1,)
    assert push_writers(p, d, "vllm") == (1, 3)
