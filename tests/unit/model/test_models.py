"""kvgeom.model.models pinned exactly: each TP sharding rule on both sides of its boundary, the rules a
model of each family gets, the accepted TP sizes worked out by hand, and every way ``resolve`` reads a
reference (with the exact error class, field and value of each refusal)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvgeom import presets
from kvgeom.errors import SpecError, UnsupportedError
from kvgeom.model.hfconfig import read_config
from kvgeom.model.layers import AttentionSpec, LayerKind, MambaSpec, MLASpec, Shard
from kvgeom.model.models import ModelRef, Sharding, TPRule, _heads, preset_ids, resolve
from kvgeom.model.spec import ModelSpec

D, R, U = Sharding.DIVIDES, Sharding.DIVIDES_OR_REPLICATES, Sharding.DIVIDES_UNLESS_ONE


def test_sharding_values() -> None:
    assert [s.value for s in Sharding] == ["divides", "divides_or_replicates", "divides_unless_one"]


@pytest.mark.parametrize(
    ("units", "sharding", "allowed", "refused"),
    [
        (8, D, (1, 2, 4, 8), (3, 16)),
        (1, D, (1,), (2,)),
        (4, R, (1, 2, 4, 8, 12), (3, 6)),
        (1, U, (1, 2, 3, 8), ()),
        (2, U, (1, 2), (4, 3)),
        (4, U, (2, 4), (8, 3)),
    ],
)
def test_tp_rule_allows(
    units: int, sharding: Sharding, allowed: tuple[int, ...], refused: tuple[int, ...]
) -> None:
    rule = TPRule("x", units, sharding)
    assert [rule.allows(t) for t in allowed] == [True] * len(allowed)
    assert [rule.allows(t) for t in refused] == [False] * len(refused)


def _ref(*specs: Any, heads: int | None = None) -> ModelRef:
    return ModelRef(ModelSpec.from_layers("m", list(specs)), "test", heads)


def _rules(ref: ModelRef) -> list[tuple[str, int, Sharding]]:
    return [(r.name, r.units, r.sharding) for r in ref.tp_rules]


def test_rules_of_each_kind() -> None:
    m2 = MambaSpec.mamba2(8, 4, 2, 16)
    assert _rules(_ref(m2, AttentionSpec(2, 8), AttentionSpec(2, 8), heads=12)) == [
        ("num_attention_heads", 12, D),
        ("Mamba2 heads", 8, D),
        ("Mamba2 groups (n_groups)", 2, U),
        ("num_key_value_heads", 2, R),
    ]
    # an SSM-only model: no query-head rule even when the count is known
    assert _rules(_ref(m2, heads=12)) == [("Mamba2 heads", 8, D), ("Mamba2 groups (n_groups)", 2, U)]
    assert _rules(_ref(MambaSpec.gdn(2, 8, 6, 4))) == [("GDN key heads", 2, D), ("GDN value heads", 6, D)]
    assert _rules(_ref(MambaSpec.kda(3, 8))) == [("KDA heads", 3, D)]
    assert _rules(_ref(MambaSpec.mamba1(6, 4))) == [("Mamba1 channels", 6, D)]
    assert _rules(_ref(MLASpec(8), heads=16)) == [("num_attention_heads", 16, D)]
    assert _rules(_ref(MLASpec(8))) == []
    # the first layer's count wins for a repeated name
    assert _rules(_ref(AttentionSpec(2, 8), AttentionSpec(4, 8))) == [("num_key_value_heads", 2, R)]


def test_tp_problem_and_accepted_tp() -> None:
    # 12 query heads, 2 KV heads, Mamba2 8 heads / 2 groups: TP must divide gcd(12, 8) = 4
    ref = _ref(MambaSpec.mamba2(8, 4, 2, 16), AttentionSpec(2, 8), heads=12)
    assert [ref.tp_problem(t) is None for t in (1, 2, 3, 4)] == [True, True, False, False]
    # TP 4: 2 groups are neither divided by 4 nor 1
    assert ref.accepted_tp(16) == [1, 2]
    assert ref.accepted_tp(1) == [1]
    plain = _ref(AttentionSpec(2, 8), heads=8)  # 8 query heads; 2 KV heads replicate at TP 4, 8
    assert plain.accepted_tp(16) == [1, 2, 4, 8]
    assert plain.accepted_tp(4) == [1, 2, 4]
    assert plain.tp_problem(8) is None and plain.tp_problem(3) is not None
    assert _ref(MLASpec(8)).accepted_tp(5) == [1, 2, 3, 4, 5]  # no strict rule: every size up to the limit
    assert _ref(AttentionSpec(4, 8)).accepted_tp(8) == [1, 2, 4, 8]  # no query-head count
    assert _ref(AttentionSpec(4, 8)).tp_problem(6) is not None


def test_tp_problem_from_the_specs_own_rule() -> None:
    """A spec whose pieces disagree with its rules: the spec's own check names the piece."""
    odd = MambaSpec(LayerKind.KDA, (Shard(4, 1), Shard(3, 1), Shard(4, 1)), Shard(4, 1), 2)
    ref = _ref(odd)
    assert _rules(ref) == [("KDA heads", 4, D)]
    problem = ref.tp_problem(2)
    assert problem is not None and problem.startswith("conv piece conv1: ")
    assert ref.tp_problem(1) is None
    assert ref.accepted_tp(4) == [1]


def test_heads() -> None:
    assert _heads({"num_attention_heads": 8}) == 8
    assert _heads({"num_attention_heads": 8, "text_config": {"num_attention_heads": 4}}) == 4
    assert _heads({"num_attention_heads": 8, "text_config": "x"}) == 8
    assert _heads({"num_attention_heads": 1}) == 1
    for bad in (0, -2, True, "8", 8.0, None):
        assert _heads({"num_attention_heads": bad}) is None
    assert _heads({}) is None


def test_preset_ids() -> None:
    ids = preset_ids()
    assert list(ids) == sorted(presets.names())
    assert ids["qwen3-8b"] == "Qwen/Qwen3-8B" and ids["zamba2-2.7b"] == "Zyphra/Zamba2-2.7B-Instruct-v2"


def test_resolve_presets() -> None:
    ref = resolve("qwen3-8b")
    assert ref.spec == presets.load("qwen3-8b") and ref.origin == "preset qwen3-8b"
    assert ref.num_attention_heads == 32
    assert resolve("QWEN/qwen3-8B") == ref  # the Hugging Face id, any case
    assert resolve("qwen3.5-0.8b").num_attention_heads == 8  # from the card's text_config
    with pytest.raises(UnsupportedError) as info:
        resolve("minimax-text-01")
    assert type(info.value) is UnsupportedError
    assert info.value.field == "model" and info.value.values == {"value": "minimax-text-01"}
    with pytest.raises(UnsupportedError) as info:
        resolve("MiniMaxAI/MiniMax-Text-01")
    assert info.value.values == {"value": "minimax-text-01"}


NEMO = {
    "model_type": "nemotron_h",
    "num_hidden_layers": 2,
    "hybrid_override_pattern": "M*",
    "hidden_size": 64,
    "num_attention_heads": 4,
    "mamba_num_heads": 8,
    "mamba_head_dim": 4,
    "n_groups": 2,
    "ssm_state_size": 16,
}


def test_resolve_objects() -> None:
    spec = ModelSpec.from_layers("s", [MLASpec(8)])
    ref = resolve(spec.to_json())
    assert ref == ModelRef(spec, "inline model spec", None)
    ref = resolve(NEMO)
    assert ref.origin == "inline config" and ref.num_attention_heads == 4
    assert ref.spec == read_config(NEMO) == resolve({"text_config": NEMO}).spec
    assert resolve({"text_config": NEMO}).num_attention_heads == 4
    bad = {k: 1 for k in "abcdefghij"}
    with pytest.raises(SpecError) as info:
        resolve(bad)
    assert type(info.value) is SpecError
    assert info.value.field == "model" and info.value.values == {"value": list("abcdefgh")}


@pytest.mark.parametrize("bad", ["", "  ", 5, None])
def test_resolve_refuses_non_names(bad: Any) -> None:
    with pytest.raises(SpecError) as info:
        resolve(bad)
    assert type(info.value) is SpecError
    assert info.value.field == "model" and info.value.values == {"value": bad}


def test_resolve_paths(tmp_path: Path) -> None:
    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(NEMO))
    ref = resolve(str(d))
    assert ref.origin == f"config {d}" and ref.num_attention_heads == 4 and ref.spec.name == "m"
    assert resolve("m", base=tmp_path).origin == f"config {d}"  # relative to base
    assert resolve(str(d), base=tmp_path / "elsewhere").origin == f"config {d}"  # absolute: base unused
    (tmp_path / "cfg").write_text(json.dumps(NEMO))  # an existing file without the .json suffix
    assert resolve("cfg", base=tmp_path).origin == f"config {tmp_path / 'cfg'}"
    # a .json path that does not exist is read (and refused as a file), not taken for a name
    with pytest.raises(SpecError) as info:
        resolve("nope.json", base=tmp_path)
    assert info.value.field == "model" and info.value.values == {"value": str(tmp_path / "nope.json")}
    with pytest.raises(SpecError) as info:
        resolve("nope", base=tmp_path)
    assert type(info.value) is SpecError
    assert info.value.field == "model" and info.value.values == {"value": "nope"}
    with pytest.raises(SpecError) as info:
        resolve("qwen3-8")  # a close match: still refused, on field model
    assert info.value.field == "model" and info.value.values == {"value": "qwen3-8"}
    assert "'qwen3-8b'" in str(info.value)


def test_tp_problem_messages() -> None:
    assert _ref(AttentionSpec(2, 8), heads=8).tp_problem(3) == (
        "TP 3 does not fit num_attention_heads 8 (TP must divide it)"
    )
    assert _ref(AttentionSpec(4, 8)).tp_problem(6) == (
        "TP 6 does not fit num_key_value_heads 4 (TP must divide it or be a multiple of it)"
    )
    assert _ref(MambaSpec.mamba2(8, 4, 2, 16)).tp_problem(4) == (
        "TP 4 does not fit Mamba2 groups (n_groups) 2 (TP must divide it unless it is 1)"
    )
    # the rule keeps the first layer's KV heads (2); the spec's own check names the layer with 3
    problem = _ref(AttentionSpec(2, 8), AttentionSpec(3, 8)).tp_problem(2)
    assert problem is not None and problem.startswith("layers.1.attn.num_kv_heads: ")


def test_ssm_rules_read_the_right_piece() -> None:
    """Generic specs whose pieces differ: the rule takes B (not C) for Mamba2 groups, Q (not K) for GDN."""
    m2 = MambaSpec(LayerKind.MAMBA2, (Shard(8, 1), Shard(2, 1), Shard(4, 1)), Shard(8, 1), 2)
    assert ("Mamba2 groups (n_groups)", 2, U) in _rules(_ref(m2))
    gdn = MambaSpec(LayerKind.GDN, (Shard(2, 1), Shard(4, 1), Shard(6, 1)), Shard(6, 1), 2)
    assert _rules(_ref(gdn)) == [("GDN key heads", 2, D), ("GDN value heads", 6, D)]


def test_unknown_names_hint(tmp_path: Path) -> None:
    def message(ref: str) -> str:
        with pytest.raises(SpecError) as info:
            resolve(ref, base=tmp_path)
        return str(info.value)

    # no close name: no hint
    assert message("zzzz").endswith("or a path to a config.json)")
    # "llama" vs "llama-3.1-70b": 2 x 5 / 18 = 0.56, above the 0.5 cutoff; every other name is below
    assert message("llama").endswith("; did you mean 'llama-3.1-70b'?")
    # "qwen3": 2 x 5 / 13 = 0.77 (qwen3-8b), / 15 = 0.67 (qwen3.5-4b), / 16 = 0.63 (qwen3.5-27b),
    # / 17 = 0.59 (qwen3.5-0.8b): the best three
    assert message("qwen3").endswith("; did you mean 'qwen3-8b', 'qwen3.5-4b', 'qwen3.5-27b'?")


def test_unsupported_preset_lists_the_others() -> None:
    with pytest.raises(UnsupportedError) as info:
        resolve("minimax-text-01")
    text = str(info.value)
    assert (
        "qwen3-8b" in text and "zamba2-2.7b" in text and text.count("minimax-text-01") == 1
    )  # not among the alternatives
