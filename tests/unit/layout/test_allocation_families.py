"""``rank_geometry`` chooses its allocation from ``ALLOCATION_FAMILIES``, a table of (name, applies, build):
the first row that applies lays the rank out, and every model and engine has one."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvgeom.errors import ConfigError
from kvgeom.layout.allocate import ALLOCATION_FAMILIES, AllocationFamily, rank_geometry
from kvgeom.layout.engine import EngineConfig
from kvgeom.model.csa import csa_linear_model
from kvgeom.model.layers import AttentionSpec, MambaSpec, MLASpec
from kvgeom.model.spec import ModelSpec

DENSE = ModelSpec.from_layers("dense", [AttentionSpec(num_kv_heads=4, head_size=16)] * 3)
MLA = ModelSpec.from_layers("mla", [MLASpec(latent_size=48)] * 2)
HYBRID = ModelSpec.from_layers(
    "hybrid",
    [AttentionSpec(num_kv_heads=4, head_size=16)]
    + [MambaSpec.mamba2(num_heads=4, head_dim=8, n_groups=1, state_size=8, conv_kernel=4)] * 3,
)
CSA = csa_linear_model()


def eng(**kw: object) -> EngineConfig:
    return EngineConfig(**{"tp_size": 1, "tp_rank": 0, "block_size": 64, "num_blocks": 8, **kw})  # type: ignore[arg-type]


def chosen(model: ModelSpec, engine: EngineConfig) -> str:
    return next(f.name for f in ALLOCATION_FAMILIES if f.applies(model, engine))


@pytest.mark.parametrize(
    ("model", "engine", "family"),
    [
        (DENSE, eng(), "a region per layer"),
        (DENSE, eng(kv_split=True), "a region per layer"),
        (MLA, eng(packed_rows=True), "a region per layer"),
        (HYBRID, eng(), "hybrid pages"),
        (CSA, eng(block_size=16), "explicit tensor sharing"),
        (CSA, eng(block_size=16, packed_rows=True), "packed CSA-linear rows"),
    ],
)
def test_each_model_gets_its_allocation_family(model: ModelSpec, engine: EngineConfig, family: str) -> None:
    assert chosen(model, engine) == family
    build = next(f.build for f in ALLOCATION_FAMILIES if f.name == family)
    held = frozenset(la.name for la in model.layers)
    assert build(model, engine, held) == rank_geometry(model, engine)


def test_the_last_family_takes_every_model() -> None:
    last = ALLOCATION_FAMILIES[-1]
    for model in (DENSE, MLA, HYBRID, CSA):
        assert last.applies(model, eng())


def test_a_uniform_model_has_a_region_per_layer_and_a_hybrid_one_a_region_per_group_index() -> None:
    dense = rank_geometry(DENSE, eng())
    assert [r.name for r in dense.regions] == [la.name for la in DENSE.layers]
    hybrid = rank_geometry(HYBRID, eng(block_size=128))
    assert len(hybrid.regions) == max(len(g.layers) for g in hybrid.groups)
    assert hybrid.ssm is not None and hybrid.ssm.region_indices


def test_a_family_is_a_row_of_data_its_build_called_with_the_stages_layers() -> None:
    seen: list[frozenset[str]] = []
    uniform = next(f for f in ALLOCATION_FAMILIES if f.name == "a region per layer")

    def build(model: ModelSpec, engine: EngineConfig, held: frozenset[str]):  # type: ignore[no-untyped-def]
        seen.append(held)
        return uniform.build(model, engine, held)

    row = replace(uniform, name="traced", build=build)
    assert isinstance(row, AllocationFamily)
    engine = eng()
    assert row.build(DENSE, engine, frozenset(la.name for la in DENSE.layers)) == rank_geometry(DENSE, engine)
    assert seen == [frozenset(la.name for la in DENSE.layers)]


def test_a_hybrid_with_split_kv_is_refused_naming_the_field() -> None:
    with pytest.raises(ConfigError) as info:
        rank_geometry(HYBRID, eng(block_size=128, kv_split=True))
    assert info.value.field == "kv_split"
