"""Block ids are one list per KV-cache group; any other shape is a typed BlockIdError naming the argument."""

from __future__ import annotations

import numpy as np
import pytest

from kvgeom import BlockIdError, EngineConfig, KvgeomError, Pairing, card_of, plan_request, presets


@pytest.fixture(scope="module")
def pairing() -> Pairing:
    model = presets.load("nemotron-h-8b")  # 7 groups: 1 attention, 6 Mamba2
    d = card_of(
        "decode", model, EngineConfig(tp_size=1, block_size=2080, kernel_block_size=32, num_blocks=64)
    )
    p = [
        card_of(
            "prefill",
            model,
            EngineConfig(tp_size=2, tp_rank=r, block_size=1040, kernel_block_size=16, num_blocks=64),
        )
        for r in range(2)
    ]
    return Pairing.create(d, p, mode="pull")


GOOD_D = [[0], [1], [2], [3], [4], [5], [6]]
GOOD_P = [[0, 1], [2], [3], [4], [5], [6], [7]]


@pytest.mark.parametrize(
    ("local", "remote", "field"),
    [
        ([0, 1, 2, 3, 4, 5, 6], GOOD_P, "local_ids"),  # a flat list where groups are expected
        (GOOD_D, [0, 1, 2, 3, 4, 5, 6, 7], "remote_ids"),
        (np.arange(7), GOOD_P, "local_ids"),
        (5, GOOD_P, "local_ids"),
        ("0123456", GOOD_P, "local_ids"),
        (GOOD_D, None, "remote_ids"),
    ],
)
def test_wrong_shape_is_a_block_id_error(pairing: Pairing, local: object, remote: object, field: str) -> None:
    with pytest.raises(BlockIdError) as exc:
        plan_request(pairing, local, remote)  # type: ignore[arg-type]
    assert exc.value.field == field
    assert "one id list per KV-cache group (7 groups" in str(exc.value)


def test_group_count_and_good_shape(pairing: Pairing) -> None:
    with pytest.raises(KvgeomError) as exc:
        plan_request(pairing, GOOD_D[:3], GOOD_P)
    assert exc.value.field == "local_ids" and exc.value.values == {"value": 3, "expected": 7}
    plan = plan_request(pairing, GOOD_D, GOOD_P, num_tokens=2080)
    assert [t.remote_rank for t in plan.transfers] == [0, 1]
    assert plan_request(pairing, [], GOOD_P).transfers == ()  # nothing local: notification only
