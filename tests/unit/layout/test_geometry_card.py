"""kvgeom.layout.card: the exact card a rank sends, its canonical form and digests, the limits checked before
parsing (at each boundary), and every refusal's field and values."""

from __future__ import annotations

import copy
import hashlib
import json
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from kvgeom import CardError, EngineConfig, KvgeomError, Pairing, card_of
from kvgeom.layout.allocate import rank_geometry
from kvgeom.layout.card import CARD_VERSION, DEFAULT_LIMITS, CardLimits, GeometryCard
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
    refused("card.block_size", lambda: GeometryCard.from_json(d), value=0)
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


# Lying and mismatched cards.
#
# * every number of a card's ``derived`` block, changed, is refused naming its path;
# * a derived list with an extra or a missing entry (an extra region, a missing conv offset) is refused;
# * the digest covers every part of the card: engine id, mode, model, engine and derived numbers;
# * remote ranks of one engine that disagree (block count, block size, model, conv layout) are refused at
#   handshake (found here: only the first remote rank's card was checked against the local one, so a rank
#   with another conv layout or SSM dtype was accepted and planned with rank 0's geometry).


MODEL = ModelSpec.from_layers(
    "attn+mamba2", [AttentionSpec(2, 4, "float16"), MambaSpec.mamba2(4, 2, 2, 2, 4, "float16")]
)

BLOCK = 28  # a block whose attention page holds the Mamba2 state at TP1 and TP2 (checked below)


def _card(tp: int = 2, rank: int = 0, **engine: Any) -> GeometryCard:
    return card_of(
        "prefill", MODEL, EngineConfig(tp_size=tp, tp_rank=rank, block_size=BLOCK, num_blocks=8, **engine)
    )


def _leaves(node: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[tuple[Any, ...], Any]]:
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _leaves(v, (*path, k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _leaves(v, (*path, i))
    else:
        yield path, node


def _lie(value: Any) -> Any:
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value + 1
    return f"{value}x"


def _set(data: dict[str, Any], path: tuple[Any, ...], value: Any) -> None:
    node: Any = data
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value


def _dotted(path: tuple[Any, ...]) -> str:
    return "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path).lstrip(".")


def test_the_model_and_block_fit() -> None:
    for tp in (1, 2):
        GeometryCard.from_json(_card(tp).dumps())


DERIVED = [p for p, _ in _leaves(_card().to_json()["derived"], ("derived",))]


@pytest.mark.parametrize("path", DERIVED, ids=_dotted)
def test_every_derived_number_that_lies_is_refused_naming_it(path: tuple[Any, ...]) -> None:
    data = _card().to_json()
    value = data
    for key in path:
        value = value[key]
    _set(data, path, _lie(value))
    with pytest.raises(CardError) as err:
        GeometryCard.from_json(json.dumps(data))
    assert err.value.field == _dotted(path)


@pytest.mark.parametrize("key", ["regions", "conv_offsets", "group_kinds", "ssm_region_indices", "ssm_sizes"])
def test_derived_lists_with_an_entry_too_many_or_too_few_are_refused(key: str) -> None:
    data = _card().to_json()
    for change in ("extra", "missing"):
        lied = copy.deepcopy(data)
        items = lied["derived"][key]
        lied["derived"][key] = [*items, items[-1]] if change == "extra" else items[:-1]
        with pytest.raises(CardError) as err:
            GeometryCard.from_json(json.dumps(lied))
        assert err.value.field == f"derived.{key}", change


@pytest.mark.parametrize("key", ["regions", "conv_offsets", "ssm_sizes"])
def test_a_card_without_a_derived_entry_is_refused(key: str) -> None:
    data = _card().to_json()
    del data["derived"][key]
    with pytest.raises(CardError) as err:
        GeometryCard.from_json(json.dumps(data))
    assert err.value.field == f"derived.{key}"


def test_the_digest_covers_every_part_of_the_card() -> None:
    base = _card()
    others = [
        card_of("decode", base.model, base.engine, base.mode),  # engine id
        card_of(base.engine_id, base.model, base.engine, "push"),  # mode
        card_of(
            base.engine_id,
            ModelSpec.from_layers("other", list(la.spec for la in MODEL.layers)),
            base.engine,
            base.mode,
        ),  # model
        _card(rank=1),  # engine
        _card(conv_layout="SD"),  # engine option
    ]
    digests = {c.digest for c in others}
    assert base.digest not in digests and len(digests) == len(others)
    data = base.to_json()
    data["derived"]["num_blocks"] += 1  # the derived block is part of the hashed text too
    import hashlib

    text = json.dumps(data, sort_keys=True, separators=(",", ":"))
    assert hashlib.sha256(text.encode()).hexdigest()[:16] != base.digest


@pytest.mark.parametrize(
    "change",
    [dict(num_blocks=9), dict(block_size=2 * BLOCK), dict(conv_layout="SD")],
    ids=["num_blocks", "block_size", "conv_layout"],
)
def test_remote_ranks_that_disagree_are_refused(change: dict[str, Any]) -> None:
    d = card_of("decode", MODEL, EngineConfig(tp_size=1, block_size=BLOCK, num_blocks=8))
    p0 = _card(rank=0)
    p1 = card_of("prefill", MODEL, EngineConfig(**{**_card(rank=1).engine.to_json(), **change}))
    Pairing.create(d, [p0, _card(rank=1)], mode="pull")  # the agreeing pair is accepted
    with pytest.raises(KvgeomError) as err:
        Pairing.create(d, [p0, p1], mode="pull")
    assert err.value.field.startswith("remotes[1]")


def test_remote_ranks_of_another_model_are_refused() -> None:
    d = card_of("decode", MODEL, EngineConfig(tp_size=1, block_size=BLOCK, num_blocks=8))
    other = ModelSpec.from_layers(
        "attn+mamba2", [AttentionSpec(2, 4, "float16"), MambaSpec.mamba2(4, 2, 2, 2, 4, "bfloat16")]
    )
    p1 = card_of("prefill", other, _card(rank=1).engine)
    with pytest.raises(KvgeomError) as err:
        Pairing.create(d, [_card(rank=0), p1], mode="pull")
    assert err.value.field == "remotes[1].model"


def _ranks(model: ModelSpec, tp: int) -> list[dict[str, Any]]:
    eng = EngineConfig(tp_size=tp, block_size=8, kernel_block_size=4, num_blocks=10)
    return [copy.deepcopy(card_of("p", model, eng.with_rank(r)).to_json()) for r in range(tp)]


@pytest.mark.parametrize("model", [DENSE, MAMBA1])
def test_many_cards_parse_to_the_cards_and_geometries_of_each_alone(model: ModelSpec) -> None:
    raw = _ranks(model, 2) + [data()]  # two ranks of one engine, then another engine
    many = GeometryCard.from_json_many([json.dumps(d) for d in raw])
    alone = [GeometryCard.from_json(d) for d in raw]
    assert many == alone
    assert [c.engine.tp_rank for c in many] == [0, 1, 0]
    assert [c.geometry for c in many] == [rank_geometry(c.model, c.engine) for c in alone]
    assert [c.to_json() for c in many] == raw


def test_many_cards_refuse_a_later_rank_whose_model_differs_only_in_a_number_type() -> None:
    raw = _ranks(DENSE, 2)
    raw[1]["model"]["layers"][0]["spec"]["num_kv_heads"] = 4.0  # equal to 4, but not an integer
    err = refused("card.num_kv_heads", lambda: GeometryCard.from_json_many(raw), value=4.0)
    assert type(err) is CardError
    refused("card.num_kv_heads", lambda: GeometryCard.from_json(raw[1]), value=4.0)


def test_many_cards_refuse_a_later_rank_whose_derived_numbers_lie() -> None:
    raw = _ranks(DENSE, 2)
    raw[1]["derived"]["num_blocks"] = 21
    refused("derived.num_blocks", lambda: GeometryCard.from_json_many(raw), card=21, derived=20)


def test_a_model_with_repeated_layer_specs_parses_to_the_layers_it_lists() -> None:
    spec = DENSE.to_json()
    spec["layers"][1]["spec"]["head_size"] = 4  # the second layer's spec differs from the first's
    parsed = ModelSpec.from_json(spec)
    assert [la.spec.head_size for la in parsed.layers] == [2, 4]
    assert ModelSpec.from_json(DENSE.to_json()) == DENSE
