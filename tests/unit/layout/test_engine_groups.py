"""The engine's own KV-cache group order (``EngineConfig.kv_cache_groups``), as a real vLLM engine registers
it: a NemotronH hybrid (Mamba2, attention, Mamba2, MLP; the tiny model of tests/serving) gets its groups
ordered by each spec's first layer, Mamba first -- ``[[layers.0.mamba], [layers.2.mamba],
[layers.1.attn]]`` (vLLM 0.32.0 on CPU, read from the engine's registration in tests/serving) -- where
kvgeom's own grouping puts attention first. The geometry must follow the engine's order (a request's block
lists come one per group in that order), the oracle must accept plans in it, and a grouping no engine could
have is refused field by field."""

from __future__ import annotations

import pytest

from kvgeom import EngineConfig, GeometryCard, rank_geometry
from kvgeom.errors import ConfigError, SpecError
from kvgeom.model.layers import AttentionSpec, LayerKind, MambaSpec
from kvgeom.model.spec import ModelSpec
from kvgeom.testing import Request, run_pull

ATTN = AttentionSpec(num_kv_heads=2, head_size=64, dtype="float32")
MAMBA = MambaSpec.mamba2(8, 32, 2, 16, 4, "float32", "float32")
MODEL = ModelSpec.from_layers("nemotron-h-tiny", [MAMBA, ATTN, MAMBA, None])
VLLM_ORDER = (("layers.0.mamba",), ("layers.2.mamba",), ("layers.1.attn",))


def engine(block: int = 64, **kw: object) -> EngineConfig:
    return EngineConfig(tp_size=1, block_size=block, num_blocks=32, **kw)  # type: ignore[arg-type]


def test_kvgeoms_own_grouping_puts_attention_first() -> None:
    geom = rank_geometry(MODEL, engine())
    assert [g.layers for g in geom.groups] == [("layers.1.attn",), ("layers.0.mamba",), ("layers.2.mamba",)]


def test_the_geometry_takes_the_engines_group_order() -> None:
    geom = rank_geometry(MODEL, engine(kv_cache_groups=VLLM_ORDER))
    assert [g.layers for g in geom.groups] == list(VLLM_ORDER)
    assert [g.index for g in geom.groups] == [0, 1, 2]
    assert [g.spec.kind for g in geom.groups] == [LayerKind.MAMBA2, LayerKind.MAMBA2, LayerKind.ATTENTION]
    # each hybrid region is viewed by one layer of every group, in the engine's group order
    assert [m for r in geom.regions for m in r.members] == [
        (0, "layers.0.mamba"),
        (1, "layers.2.mamba"),
        (2, "layers.1.attn"),
    ]
    # the same bytes as kvgeom's own grouping: only the order of the groups moved
    own = rank_geometry(MODEL, engine())
    assert [(r.block_len, r.block_stride, r.num_blocks) for r in geom.regions] == [
        (r.block_len, r.block_stride, r.num_blocks) for r in own.regions
    ]
    assert geom.ssm is not None and own.ssm is not None
    assert geom.ssm.conv_offsets == own.ssm.conv_offsets and geom.ssm.region_indices == own.ssm.region_indices


@pytest.mark.parametrize("num_tokens", [1, 63, 64, 150])
def test_the_oracle_checks_a_pull_in_the_engines_group_order(num_tokens: int) -> None:
    p = engine(kv_cache_groups=VLLM_ORDER)
    d = engine(kv_cache_groups=VLLM_ORDER)
    report = run_pull(MODEL, p, d, Request.simple(MODEL, p, d, num_tokens))
    assert report.ok, report


def test_the_card_carries_the_group_order() -> None:
    card = GeometryCard("e", MODEL, engine(kv_cache_groups=VLLM_ORDER), "pull")
    again = GeometryCard.loads(card.dumps())
    assert again.engine.kv_cache_groups == VLLM_ORDER
    assert [g.layers for g in again.geometry.groups] == list(VLLM_ORDER)
    plain = GeometryCard("e", MODEL, engine(), "pull")
    assert "kv_cache_groups" not in plain.dumps()  # cards of engines without it stay as they were


def test_a_group_of_two_specs_is_refused() -> None:
    with pytest.raises(SpecError) as info:
        rank_geometry(
            MODEL, engine(kv_cache_groups=(("layers.0.mamba", "layers.1.attn"), ("layers.2.mamba",)))
        )
    assert info.value.field == "kv_cache_groups[0]"
    assert info.value.values == {"local": MAMBA, "remote": ATTN}


def test_a_layer_in_no_group_or_two_groups_or_unknown_is_refused() -> None:
    with pytest.raises(ConfigError) as missing:
        rank_geometry(MODEL, engine(kv_cache_groups=VLLM_ORDER[:2]))
    assert missing.value.field == "kv_cache_groups" and missing.value.values["value"] == ["layers.1.attn"]
    with pytest.raises(ConfigError) as twice:
        rank_geometry(MODEL, engine(kv_cache_groups=VLLM_ORDER + (("layers.0.mamba",),)))
    assert twice.value.field == "kv_cache_groups[3]" and twice.value.values["expected"] == 0
    with pytest.raises(ConfigError) as unknown:
        rank_geometry(MODEL, engine(kv_cache_groups=VLLM_ORDER + (("layers.9.attn",),)))
    assert unknown.value.field == "kv_cache_groups[3]" and unknown.value.values["value"] == "layers.9.attn"


@pytest.mark.parametrize("bad", ["layers.0.mamba", [["layers.0.mamba"], []], [[1]]])
def test_a_malformed_group_list_is_refused(bad: object) -> None:
    with pytest.raises(ConfigError) as info:
        engine(kv_cache_groups=bad)
    assert info.value.field == "kv_cache_groups"
