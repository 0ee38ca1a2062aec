"""Specs, engine configs, rank geometry and cards: derived numbers, round trips, and every class of bad
input raising a typed kvgeom error that names the field (never an AssertionError)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvgeom import (
    BlockIdError,
    CardError,
    ConfigError,
    GroupMismatchError,
    IncompatiblePairError,
    KvgeomError,
    PlanError,
    RatioError,
    SpecError,
    presets,
)
from kvgeom.layout.allocate import rank_geometry
from kvgeom.layout.card import GeometryCard, card_of
from kvgeom.layout.engine import EngineConfig
from kvgeom.layout.geometry import align_hybrid_block_size
from kvgeom.model.layers import AttentionSpec, LayerKind, MambaSpec
from kvgeom.model.spec import ModelSpec
from kvgeom.plan.pairing import Pairing
from kvgeom.plan.request import plan_request


def test_nemotron_h_8b_geometry_matches_hand_numbers() -> None:
    m = presets.load("nemotron-h-8b")
    # Mamba2: 128 heads x 64, 8 groups x 128 state, conv 4 -> conv channels 8192 + 2*1024 = 10240,
    # 3 rows of bf16 = 61440 B; temporal 128 x 64 x 128 x 4 B (float32: vLLM's NemotronH default) = 4 MiB.
    # Attention: 8 KV heads x 128 x (K + V) x 2 B = 4096 B/token, so block 1040 (= 16 * ceil(4255744 /
    # (16*4096))) holds the state.
    assert align_hybrid_block_size(m, 1, 16) == 1040
    g = rank_geometry(m, EngineConfig(tp_size=1, block_size=1040, kernel_block_size=16, num_blocks=4))
    assert g.ssm.sizes == (61440, 4194304)
    assert g.ssm.conv_offsets == ((0, 49152), (49152, 6144), (55296, 6144))
    assert len(g.groups) == 7 and [gr.kind for gr in g.groups][:2] == [LayerKind.ATTENTION, LayerKind.MAMBA2]
    assert len(g.regions) == 4 and all(len(r.members) == 7 for r in g.regions)
    assert g.ppl == 65 and g.regions[0].block_len == 16 * 4096 and g.num_blocks == 260
    g4 = rank_geometry(m, EngineConfig(tp_size=4, block_size=1040, num_blocks=4))
    assert g4.ssm.sizes == (61440 // 4, 4194304 // 4)


def test_falcon_mamba2_with_one_group_replicates_b_and_c() -> None:
    spec = presets.load("falcon-h1-0.5b").ssm_spec
    # n_groups 1 < TP 2: each rank holds the whole B and C (128 channels each), x is halved.
    assert spec.piece_channels(2) == (768, 128, 128)
    assert spec.replicated_pieces(2) == (False, True, True)


def test_card_round_trip_and_digest_is_stable() -> None:
    card = card_of(
        "decode",
        presets.load("qwen3.5-0.8b"),
        EngineConfig(tp_size=2, tp_rank=1, block_size=544, num_blocks=16),
    )
    text = card.dumps()
    again = GeometryCard.from_json(text)
    assert again.dumps() == text and again.digest == card.digest
    assert again.geometry.regions == card.geometry.regions
    other = card_of("decode", card.model, card.engine.with_rank(0))
    assert other.digest != card.digest and other.model_digest == card.model_digest


@pytest.mark.parametrize(
    "path, value, field",
    [
        (("derived", "regions", 0, "block_len"), 1, "derived.regions[0].block_len"),
        (("derived", "ppl"), 2, "derived.ppl"),
        (("kvgeom_card",), 99, "kvgeom_card"),
        (("engine", "tp_rank"), 7, "tp_rank"),
        (("model", "layers", 0, "spec", "kind"), "lightning", "kind"),
    ],
)
def test_inconsistent_or_malformed_card_names_the_field(path, value, field) -> None:
    card = card_of(
        "p", presets.load("qwen3.5-0.8b"), EngineConfig(tp_size=2, block_size=544, num_blocks=4)
    ).to_json()
    target = card
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    with pytest.raises(KvgeomError) as exc:
        GeometryCard.from_json(json.dumps(card))
    assert exc.value.field == field or exc.value.field.endswith("." + field)
    assert isinstance(exc.value, (CardError, ConfigError, SpecError))


def test_card_that_is_not_json_is_refused() -> None:
    with pytest.raises(CardError) as exc:
        GeometryCard.from_json("{not json")
    assert exc.value.field == "card" and exc.value.values == {"value": "{not json"}


@pytest.mark.parametrize(
    "build, err, field",
    [
        (lambda: AttentionSpec(0, 64), SpecError, "num_kv_heads"),
        (lambda: AttentionSpec(8, 64, dtype="float12"), SpecError, "dtype"),
        (lambda: MambaSpec.mamba2(4, 2, 3, 2).check_tp(2), SpecError, "conv piece B"),
        (lambda: LayerKind.parse("lightning"), SpecError, "kind"),
        (lambda: EngineConfig(tp_size=2, tp_rank=2, block_size=16, num_blocks=4), ConfigError, "tp_rank"),
        (
            lambda: EngineConfig(tp_size=1, block_size=16, kernel_block_size=6, num_blocks=4),
            ConfigError,
            "kernel_block_size",
        ),
        (lambda: EngineConfig(tp_size=1, block_size=16, num_blocks=-1), ConfigError, "num_blocks"),
        (
            lambda: rank_geometry(
                presets.load("nemotron-h-8b"), EngineConfig(tp_size=1, block_size=16, num_blocks=4)
            ),
            ConfigError,
            "block_size",
        ),
        (
            lambda: rank_geometry(
                ModelSpec.from_layers("x", [AttentionSpec(3, 8)]),
                EngineConfig(tp_size=2, block_size=16, num_blocks=4),
            ),
            SpecError,
            "num_kv_heads",
        ),
    ],
)
def test_bad_specs_and_configs(build, err, field) -> None:
    with pytest.raises(err) as exc:
        build()
    assert exc.value.field == field or exc.value.field.endswith("." + field)
    assert isinstance(exc.value, ValueError)


GQA = ModelSpec.from_layers("gqa", [AttentionSpec(8, 4, "float16")] * 2)


def _geom(**kw) -> object:
    return rank_geometry(GQA, EngineConfig(**{"tp_size": 1, "block_size": 4, "num_blocks": 8, **kw}))


def test_pair_errors_name_both_sides() -> None:
    six = ModelSpec.from_layers("gqa6", [AttentionSpec(6, 4, "float16")])
    with pytest.raises(RatioError) as exc:  # TP sizes that do not divide
        Pairing.create(
            rank_geometry(six, EngineConfig(tp_size=3, block_size=4, num_blocks=8)),
            [
                rank_geometry(six, EngineConfig(tp_size=2, tp_rank=r, block_size=4, num_blocks=8))
                for r in range(2)
            ],
        )
    assert exc.value.field == "remote_tp" and exc.value.values == {"local": 3, "remote": 2}
    with pytest.raises(RatioError) as exc:  # block sizes that do not divide
        Pairing.create(_geom(block_size=6), [_geom(block_size=4)])
    assert exc.value.field == "block_size" and exc.value.values == {"local": 6, "remote": 4}
    with pytest.raises(IncompatiblePairError) as exc:
        Pairing.create(_geom(kv_layout="token_major"), [_geom()])
    assert exc.value.field == "kv_layout" and exc.value.values == {
        "local": "token_major",
        "remote": "head_major",
    }
    other = ModelSpec.from_layers("gqa", [AttentionSpec(8, 8, "float16")] * 2)
    with pytest.raises(IncompatiblePairError) as exc:
        Pairing.create(_geom(), [rank_geometry(other, EngineConfig(tp_size=1, block_size=4, num_blocks=8))])
    assert exc.value.field == "model" and exc.value.values == {"local": "gqa", "remote": "gqa"}


def test_request_errors() -> None:
    pairing = Pairing.create(_geom(), [_geom()])
    with pytest.raises(BlockIdError) as exc:
        plan_request(pairing, [[-1]], [[0]])
    assert exc.value.field == "local_ids[0]" and exc.value.values == {"value": -1}
    with pytest.raises(BlockIdError) as exc:
        plan_request(pairing, [[1]], [[8]])  # past the pool of 8
    assert exc.value.field == "remote_ids[0]" and exc.value.values == {"value": 8, "expected": 8}
    with pytest.raises(GroupMismatchError) as exc:
        plan_request(pairing, [[1]], [[1], [2]])  # two groups for a one-group model
    assert exc.value.field == "remote_ids" and exc.value.values == {"value": 2, "expected": 1}
    with pytest.raises(PlanError) as exc:  # P's one block cannot hold the 5 tokens it computed
        plan_request(pairing, [[1, 2]], [[3]], num_tokens=6, prefill_tokens=5)
    assert exc.value.field == "block_ids[0]" and exc.value.values == {"local": 2, "remote": 1}
    with pytest.raises(PlanError) as exc:  # P computed more tokens than D holds
        plan_request(pairing, [[1, 2]], [[3]], num_tokens=6, prefill_tokens=7)
    assert exc.value.field == "prefill_tokens" and exc.value.values == {"value": 7, "expected": 6}
    # P computed fewer tokens than D holds (D computes the rest): P's block is moved, D's second block zeroed
    plan = plan_request(pairing, [[1, 2]], [[3]], num_tokens=6, prefill_tokens=4)
    assert plan.num_descriptors == 2 and plan.zero.tolist() == [[0, 2 * 512, 512], [1, 2 * 512, 512]]


def test_no_assertion_error_escapes_for_garbage_cards() -> None:
    for bad in (
        [],
        {"kvgeom_card": 1},
        {"kvgeom_card": 1, "engine_id": "x", "model": {}, "engine": {}, "derived": {}},
        "[]",
    ):
        with pytest.raises(KvgeomError):
            GeometryCard.from_json(bad)


def test_import_kvgeom_pulls_neither_torch_nor_nixl() -> None:
    code = (
        "import sys, kvgeom, kvgeom.cli, kvgeom.tools.scenario, kvgeom.testing; "
        "bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'nixl', 'nixl_cu12', 'nixl_cu13')]; "
        "print(bad); sys.exit(1 if bad else 0)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


def test_package_docstring_example_runs() -> None:
    import doctest

    import kvgeom

    result = doctest.testmod(kvgeom)
    assert result.attempted > 0 and result.failed == 0
