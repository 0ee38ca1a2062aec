"""D in push waits for the writers the core names (kvgeom.plan.pairing.push_writers), DCP's widening included:
``KVRank._writers`` on a stand-in rank (it reads only the rank's card). No NIXL needed."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from kvgeom_nixl.kvrank import KVRank

from kvgeom import GeometryCard
from kvgeom.layout.engine import EngineConfig
from kvgeom.model.layers import MLASpec
from kvgeom.model.spec import ModelSpec
from kvgeom.plan.pairing import Pairing, push_writers

MLA = ModelSpec.from_layers("mla", [MLASpec(8, "float16")] * 2)


def card(engine_id: str, tp: int, rank: int, dcp: int) -> GeometryCard:
    cfg = EngineConfig(tp_size=tp, tp_rank=rank, block_size=4, num_blocks=32, dcp_size=dcp)
    return GeometryCard(engine_id, MLA, cfg, "push")


@pytest.mark.parametrize(("compat", "expected"), [("vllm", [{0, 2}, {1, 3}]), ("kvgeom", [{0, 1, 2, 3}] * 2)])
def test_the_writers_of_a_dcp_pair_are_the_cores(compat: str, expected: list) -> None:
    producer = card("prefill", 4, 0, 4)  # P TP4 DCP4 -> D TP2 DCP2
    decode = [card("decode", 2, r, 2) for r in range(2)]
    got = [KVRank._writers(SimpleNamespace(card=d), producer, compat) for d in decode]  # type: ignore[arg-type]
    assert got == [{("prefill", p) for p in ranks} for ranks in expected]
    assert [{p for _, p in w} for w in got] == [set(push_writers(producer, d, compat)) for d in decode]
    # and they are the P ranks whose pairing (the producer's side) names the D rank
    ps = [card("prefill", 4, p, 4) for p in range(4)]
    paired = [Pairing.create(p, decode, "push", compat).targets for p in ps]
    assert [{p for p in range(4) if d.engine.tp_rank in paired[p]} for d in decode] == expected
    assert KVRank._writers(SimpleNamespace(card=decode[0]), producer) == {("prefill", p) for p in range(4)}
