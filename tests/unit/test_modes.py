"""The compat mode is a value: one enum whose members are their spellings, and every entry point that
takes a mode refuses a spelling that is neither, naming the field and the value."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from kvgeom import (
    Compat,
    EngineConfig,
    IncompatiblePairError,
    MambaSpec,
    ModelSpec,
    Pairing,
    UnsupportedError,
    card_of,
    check_pair,
    policy_of,
    post_receive,
    presets,
)
from kvgeom.plan.pairing import pair_targets, push_writers


@pytest.fixture(scope="module")
def cards() -> tuple[object, list[object]]:
    model = presets.load("llama-3.1-8b-instruct")
    d = card_of("decode", model, EngineConfig(tp_size=1, block_size=32, num_blocks=16))
    p = [
        card_of("prefill", model, EngineConfig(tp_size=2, tp_rank=r, block_size=32, num_blocks=16))
        for r in range(2)
    ]
    return d, p


@pytest.mark.parametrize("spelling", ["vllm", "kvgeom"])
def test_a_member_is_its_spelling(spelling: str) -> None:
    member = Compat.of(spelling)
    assert member.value == spelling and member == spelling and Compat.of(member) is member
    assert hash(member) == hash(spelling) and {spelling: 1}[member] == 1 and {member: 2}[spelling] == 2
    assert f"{member}" == spelling == str(member) and json.dumps({"compat": member}) == json.dumps(
        {"compat": spelling}
    )


@pytest.mark.parametrize("bad", ["vLLM", "kvgem", "", None, 1])
def test_a_spelling_that_is_no_member_is_refused_with_its_value(bad: object) -> None:
    with pytest.raises(IncompatiblePairError) as e:
        Compat.of(bad)
    assert e.value.field == "compat" and e.value.values == {"value": bad}


def test_a_pairing_keeps_the_member_whichever_spelling_it_was_given(cards) -> None:  # type: ignore[no-untyped-def]
    d, p = cards
    assert Pairing.create(d, p, "pull", "vllm").compat is Compat.VLLM
    assert Pairing.create(d, p, "pull", Compat.KVGEOM).compat is Compat.KVGEOM
    assert Pairing.create(d, p, "pull").compat is Compat.KVGEOM


@pytest.mark.parametrize(
    "call",
    [
        lambda d, p: Pairing.create(d, p, "pull", "kvgem"),
        lambda d, p: check_pair(d.geometry, p[0].geometry, "pull", "kvgem"),
        lambda d, p: pair_targets(d, p[0], "pull", "kvgem"),
        lambda d, p: push_writers(p[0], d, "kvgem"),
        lambda d, p: post_receive(d.geometry, None, [], [], 1, "kvgem"),
    ],
    ids=["Pairing.create", "check_pair", "pair_targets", "push_writers", "post_receive"],
)
def test_every_entry_point_refuses_a_misspelt_mode(cards, call) -> None:  # type: ignore[no-untyped-def]
    d, p = cards
    with pytest.raises(IncompatiblePairError) as e:
        call(d, p)
    assert e.value.field == "compat" and e.value.values == {"value": "kvgem"}


def test_each_mode_has_one_policy_and_a_policy_stands_for_itself() -> None:
    vllm, kvgeom = policy_of("vllm"), policy_of(Compat.KVGEOM)
    assert (vllm.compat, kvgeom.compat) == (Compat.VLLM, Compat.KVGEOM)
    assert policy_of(vllm) is vllm and policy_of(Compat.VLLM) is vllm
    assert (vllm.engine_refusals, vllm.routed, vllm.by_tokens, vllm.token_cut, vllm.spread_dcp) == (
        True,
        False,
        False,
        False,
        False,
    )
    assert (kvgeom.engine_refusals, kvgeom.routed, kvgeom.by_tokens, kvgeom.token_cut, kvgeom.spread_dcp) == (
        False,
        True,
        True,
        True,
        True,
    )
    with pytest.raises(IncompatiblePairError) as e:
        policy_of("kvgem")
    assert e.value.field == "compat" and e.value.values == {"value": "kvgem"}


def test_a_pairing_reads_its_policy_from_its_mode(cards) -> None:  # type: ignore[no-untyped-def]
    d, p = cards
    for mode in Compat:
        assert Pairing.create(d, p, "pull", mode).policy is policy_of(mode)


def test_check_pair_takes_a_policy_where_it_takes_a_mode(cards) -> None:  # type: ignore[no-untyped-def]
    d, p = cards
    for mode in Compat:
        assert check_pair(d.geometry, p[0].geometry, "pull", policy_of(mode)) == check_pair(
            d.geometry, p[0].geometry, "pull", mode
        )


def test_a_refusal_follows_the_policys_field_not_the_modes_name(cards) -> None:  # type: ignore[no-untyped-def]
    """vLLM refuses an attention-free model (its NIXL tables need an attention group); kvgeom plans it. The
    same refusal is switched by ``engine_refusals`` alone, on a policy that is otherwise kvgeom's."""
    model = ModelSpec.from_layers("ssm-only", [MambaSpec.mamba2(8, 4, 2, 16)] * 2)
    d = card_of("decode", model, EngineConfig(tp_size=1, block_size=32, num_blocks=16)).geometry
    p = card_of("prefill", model, EngineConfig(tp_size=1, block_size=32, num_blocks=16)).geometry
    check_pair(d, p, "pull", "kvgeom")
    strict = replace(policy_of("kvgeom"), engine_refusals=True)
    with pytest.raises(UnsupportedError) as e:
        check_pair(d, p, "pull", strict)
    assert e.value.field == "model"
    with pytest.raises(UnsupportedError):
        check_pair(d, p, "pull", "vllm")
