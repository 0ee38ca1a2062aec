"""Lying and mismatched cards (issue 12: mutants that dropped a card check survived).

* every number of a card's ``derived`` block, changed, is refused naming its path;
* a derived list with an extra or a missing entry (an extra region, a missing conv offset) is refused;
* the digest covers every part of the card: engine id, mode, model, engine and derived numbers;
* remote ranks of one engine that disagree (block count, block size, model, conv layout) are refused at
  handshake (found here: only the first remote rank's card was checked against the local one, so a rank
  with another conv layout or SSM dtype was accepted and planned with rank 0's geometry).
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from typing import Any

import pytest

from kvgeom import CardError, EngineConfig, KvgeomError, Pairing, card_of
from kvgeom.layout.card import GeometryCard
from kvgeom.model.layers import AttentionSpec, MambaSpec
from kvgeom.model.spec import ModelSpec

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
