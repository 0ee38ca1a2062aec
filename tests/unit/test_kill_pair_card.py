"""kvgeom.layout.card: the exact card a rank sends, its canonical form and digests, the limits checked before
parsing (at each boundary), and every refusal's field and values (issue 12)."""

from __future__ import annotations

import copy
import hashlib
from collections.abc import Callable
from typing import Any

import pytest

from kvgeom.errors import CardError, KvgeomError
from kvgeom.layout.allocate import rank_geometry
from kvgeom.layout.card import CARD_VERSION, DEFAULT_LIMITS, CardLimits, GeometryCard, card_of
from kvgeom.layout.engine import EngineConfig
from kvgeom.model.layers import AttentionSpec, MambaSpec
from kvgeom.model.spec import ModelSpec

DENSE = ModelSpec.from_layers("dense", [AttentionSpec(4, 2, "float16")] * 2)
ENGINE = EngineConfig(tp_size=1, block_size=8, kernel_block_size=4, num_blocks=10)
MAMBA1 = ModelSpec.from_layers("ssm", [MambaSpec.mamba1(4, 1, 2, "float16")])


def card(**kw: Any) -> GeometryCard:
    return card_of("e0", DENSE, ENGINE, **kw)


def data(**kw: Any) -> dict[str, Any]:
    return copy.deepcopy(card(**kw).to_json())


def refused(field: str, fn: Callable[[], object], **values: object) -> CardError:
    with pytest.raises(KvgeomError) as info:
        fn()
    err = info.value
    assert type(err) is CardError, (type(err), err)
    assert err.field == field, err
    assert err.values == values, err.values
    return err


def test_the_derived_numbers_of_a_small_card() -> None:
    # 4 KV heads x head size 2 x (K + V) x fp16 = 32 B per token; kernel block 4 tokens: 128 B pages.
    # Logical block 8 = 2 kernel blocks (ppl 2), 10 logical = 20 kernel blocks per region.
    page = 4 * 4 * 2 * 2 * 2
    region = {"block_len": page, "block_stride": page, "num_blocks": 20, "is_mla": False, "groups": [0]}
    assert card().to_json()["derived"] == {
        "block_size": 4,
        "logical_block_size": 8,
        "ppl": 2,
        "num_blocks": 20,
        "logical_num_blocks": 10,
        "num_kv_heads": 4,
        "is_mla": False,
        "group_kinds": ["attention"],
        "regions": [{"name": "layers.0.attn", **region}, {"name": "layers.1.attn", **region}],
        "ssm_sizes": None,
        "conv_offsets": None,
        "ssm_region_indices": [],
    }


def test_an_ssm_card_carries_its_state_sizes() -> None:
    geom = rank_geometry(MAMBA1, EngineConfig(tp_size=1, block_size=4, num_blocks=3))
    derived = card_of("s", MAMBA1, geom.engine).to_json()["derived"]
    assert geom.ssm is not None
    assert derived["ssm_sizes"] == list(geom.ssm.sizes) and len(derived["ssm_sizes"]) == 2
    assert derived["conv_offsets"] == [list(o) for o in geom.ssm.conv_offsets]
    assert derived["ssm_region_indices"] == [0]
    assert derived["group_kinds"] == ["mamba1"]


def test_to_json_and_round_trips() -> None:
    c = card(mode="push")
    d = c.to_json()
    assert set(d) == {"kvgeom_card", "engine_id", "mode", "model", "engine", "derived"}
    assert (d["kvgeom_card"], d["engine_id"], d["mode"]) == (1, "e0", "push")
    assert d["model"] == DENSE.to_json() and d["engine"] == ENGINE.to_json()
    assert GeometryCard.from_json(d) == c
    assert GeometryCard.from_json(c.dumps()) == c
    assert GeometryCard.from_json(c.dumps().encode()) == c  # bytes too
    assert GeometryCard.loads(c.dumps()) == c
    assert CARD_VERSION == 1
    assert card().mode == "pull" and GeometryCard("e", DENSE, ENGINE).mode == "pull"


def test_dumps_is_canonical_and_digests_hash_it() -> None:
    c = card()
    text = c.dumps()
    assert text.startswith('{"derived":{"block_size":4,"conv_offsets":null,')  # sorted keys, no spaces
    assert ", " not in text and ": " not in text
    assert (
        text.index('"engine"')
        < text.index('"engine_id"')
        < text.index('"kvgeom_card"')
        < text.index('"mode"')
    )
    assert c.digest == hashlib.sha256(text.encode()).hexdigest()[:16] and len(c.digest) == 16
    assert card(mode="push").digest != c.digest
    assert c.model_digest == hashlib.sha256(DENSE.dumps().encode()).hexdigest()[:16]
    assert card(mode="push").model_digest == c.model_digest and len(c.model_digest) == 16


def test_mode_must_be_pull_or_push() -> None:
    refused("mode", lambda: card(mode="PULL"), value="PULL")
    d = data()
    d["mode"] = "sideways"
    refused("mode", lambda: GeometryCard.from_json(d), value="sideways")  # not re-wrapped as card.mode
    del d["mode"]
    assert GeometryCard.from_json(d).mode == "pull"


def test_malformed_json_and_versions() -> None:
    bad = "{" + "x" * 100
    refused("card", lambda: GeometryCard.from_json(bad), value=bad[:80])
    refused("card", lambda: GeometryCard.from_json("[1, 2]"), value=[1, 2])
    d = data()
    d["kvgeom_card"] = 2
    refused("kvgeom_card", lambda: GeometryCard.from_json(d), card=2, expected=1)
    del d["kvgeom_card"]
    refused("kvgeom_card", lambda: GeometryCard.from_json(d), card=None, expected=1)


@pytest.mark.parametrize("key", ["engine_id", "model", "engine", "derived"])
def test_required_keys(key: str) -> None:
    d = data()
    del d[key]
    refused(key, lambda: GeometryCard.from_json(d), value=None)


def test_spec_errors_are_card_errors_naming_the_field() -> None:
    d = data()
    d["engine"]["block_size"] = 0
    err = refused("card.block_size", lambda: GeometryCard.from_json(d), value=0)
    assert "block_size: must be a positive integer, got 0" in str(err)  # the spec's own message, kept
    d = data()
    d["engine"] = "x"
    refused("card.engine", lambda: GeometryCard.from_json(d), value="x")


# ---- derived numbers against the spec's own --------------------------------------------------------------


def test_derived_numbers_that_disagree_name_the_path() -> None:
    d = data()
    d["derived"]["ppl"] = 3
    refused("derived.ppl", lambda: GeometryCard.from_json(d), card=3, derived=2)
    d = data()
    del d["derived"]["ppl"]
    refused("derived.ppl", lambda: GeometryCard.from_json(d), card=None, derived=2)
    d = data()
    d["derived"]["regions"][1]["block_len"] = 64
    refused("derived.regions[1].block_len", lambda: GeometryCard.from_json(d), card=64, derived=128)
    d = data()
    want = copy.deepcopy(d["derived"]["regions"])
    d["derived"]["regions"] = want[:1]
    refused("derived.regions", lambda: GeometryCard.from_json(d), card=want[:1], derived=want)
    d = data()
    d["derived"]["group_kinds"] = "attention"
    refused("derived.group_kinds", lambda: GeometryCard.from_json(d), card="attention", derived=["attention"])
    d = data()
    derived = copy.deepcopy(d["derived"])
    d["derived"] = [1]
    refused("derived", lambda: GeometryCard.from_json(d), card=[1], derived=derived)
    d = data()
    d["derived"]["regions"][0] = 7
    refused("derived.regions[0]", lambda: GeometryCard.from_json(d), card=7, derived=want[0])


# ---- limits --------------------------------------------------------------------------------------------


def test_default_limits() -> None:
    assert DEFAULT_LIMITS == CardLimits() == CardLimits(1024, 1 << 22, 1 << 25)
    d = data()
    d["model"]["layers"] = d["model"]["layers"] * 513  # 1026 layers
    refused("model.layers", lambda: GeometryCard.from_json(d), value=1026, expected=1024)


def test_layer_limit_boundary() -> None:
    d = data()  # 2 layers
    assert GeometryCard.from_json(d, CardLimits(max_layers=2)) == card()
    refused("model.layers", lambda: GeometryCard.from_json(d, CardLimits(max_layers=1)), value=2, expected=1)


def test_region_limit_is_the_layer_limit() -> None:
    d = data()
    regions = d["derived"]["regions"]
    d["derived"]["regions"] = regions * 3  # 6 regions
    refused(
        "derived.regions", lambda: GeometryCard.from_json(d, CardLimits(max_layers=5)), value=6, expected=5
    )
    # 6 regions within a limit of 6: parsed, then refused by the comparison with the spec
    refused(
        "derived.regions",
        lambda: GeometryCard.from_json(d, CardLimits(max_layers=6)),
        card=regions * 3,
        derived=regions,
    )
    # 4 regions for 2 layers within a limit of 5: the limit is the layer limit, not the layer count
    d["derived"]["regions"] = regions * 2
    refused(
        "derived.regions",
        lambda: GeometryCard.from_json(d, CardLimits(max_layers=5)),
        card=regions * 2,
        derived=regions,
    )


def test_kernel_block_limit_boundary() -> None:
    d = data()  # 10 blocks of 2 kernel blocks: 20
    assert GeometryCard.from_json(d, CardLimits(max_kernel_blocks=20)) == card()
    refused(
        "engine.num_blocks",
        lambda: GeometryCard.from_json(d, CardLimits(max_kernel_blocks=19)),
        value=10,
        expected=19,
    )
    # one kernel block per block: 10
    one = card_of("e0", DENSE, EngineConfig(tp_size=1, block_size=4, num_blocks=10)).to_json()
    assert GeometryCard.from_json(one, CardLimits(max_kernel_blocks=10)).engine.num_blocks == 10
    refused(
        "engine.num_blocks",
        lambda: GeometryCard.from_json(one, CardLimits(max_kernel_blocks=9)),
        value=10,
        expected=9,
    )
    # one-token blocks
    tiny = card_of("e0", DENSE, EngineConfig(tp_size=1, block_size=1, num_blocks=10)).to_json()
    refused(
        "engine.num_blocks",
        lambda: GeometryCard.from_json(tiny, CardLimits(max_kernel_blocks=9)),
        value=10,
        expected=9,
    )
    # a card without a kernel block size uses the block size
    d = data()
    d["engine"]["kernel_block_size"] = None
    refused(
        "engine.num_blocks",
        lambda: GeometryCard.from_json(d, CardLimits(max_kernel_blocks=9)),
        value=10,
        expected=9,
    )


def test_table_row_limit_boundary() -> None:
    d = data()  # 20 kernel blocks x 2 layers = 40 rows
    assert GeometryCard.from_json(d, CardLimits(max_table_rows=40)) == card()
    refused(
        "engine.num_blocks",
        lambda: GeometryCard.from_json(d, CardLimits(max_table_rows=39)),
        value=40,
        expected=39,
    )
    # no layers: counted as one
    d["model"]["layers"] = []
    refused(
        "engine.num_blocks",
        lambda: GeometryCard.from_json(d, CardLimits(max_table_rows=19)),
        value=0,
        expected=19,
    )


def test_malformed_engine_numbers_are_left_to_the_engine_config() -> None:
    strict = CardLimits(max_kernel_blocks=1, max_table_rows=1)
    for key, value in (("num_blocks", True), ("num_blocks", "10"), ("block_size", None), ("block_size", 0)):
        d = data()
        d["engine"][key] = value
        with pytest.raises(CardError) as info:
            GeometryCard.from_json(d, strict)
        assert info.value.field == f"card.{key}", (key, value, info.value)
    d = data()
    d["engine"]["kernel_block_size"] = -4
    with pytest.raises(CardError) as info:
        GeometryCard.from_json(d, strict)
    assert info.value.field == "card.kernel_block_size"
    d = data()
    d["engine"] = "x"
    with pytest.raises(CardError) as info:
        GeometryCard.from_json(d, strict)
    assert info.value.field == "card.engine"


def test_malformed_parts_reach_their_own_checks_not_a_crash() -> None:
    # a model that is not an object: no layers to count, the model spec refuses it
    d = data()
    d["model"] = "x"
    refused("card.model", lambda: GeometryCard.from_json(d), value="str")
    # layers that are not a list count as none (a limit of 0 layers holds), the model spec refuses them
    d = data()
    d["model"]["layers"] = "x"
    del d["derived"]["regions"]
    with pytest.raises(CardError) as info:
        GeometryCard.from_json(d, CardLimits(max_layers=0))
    assert info.value.field.startswith("card.layers")
    # derived numbers without regions: no region count to limit, the comparison names what is missing
    d = data()
    regions = d["derived"].pop("regions")
    refused("derived.regions", lambda: GeometryCard.from_json(d), card=None, derived=regions)
    # a kernel block that does not divide the block: 10 x (8 // 3 = 2) = 20 kernel blocks fit a limit of 20,
    # then the engine config refuses the kernel block
    d = data()
    d["engine"]["kernel_block_size"] = 3
    refused(
        "card.kernel_block_size",
        lambda: GeometryCard.from_json(d, CardLimits(max_kernel_blocks=20)),
        value=3,
        expected=8,
    )
