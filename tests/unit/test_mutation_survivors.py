"""Tests written for mutants that survived ``make mutate`` (docs/testing.md): each pins a behaviour no test
looked at (the field an error names and the values it carries, a request with the wrong id count, an
oracle coordinate out of range)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kvgeom import ConfigError, EngineConfig, IncompatiblePairError, KvgeomError, Pairing, RatioError, card_of
from kvgeom.model.layers import AttentionSpec, MLASpec
from kvgeom.model.spec import ModelSpec
from kvgeom.pair.dcp import dcp_source_ranks
from kvgeom.testing import CoordSpace, Request, RequestError, run
from kvgeom.tools.scenario import Scenario

DENSE = ModelSpec.from_layers("dense", [AttentionSpec(2, 4, "float16")])


def test_a_missing_scenario_file_names_the_path(tmp_path: Path) -> None:
    path = tmp_path / "nowhere.json"
    with pytest.raises(ConfigError) as err:
        Scenario.load(path)
    assert err.value.field == "scenario" and err.value.values == {"value": str(path)}


def test_packed_rows_must_be_a_boolean() -> None:
    with pytest.raises(ConfigError) as err:
        EngineConfig(tp_size=1, block_size=4, num_blocks=4, packed_rows="yes")  # type: ignore[arg-type]
    assert err.value.field == "packed_rows" and err.value.values == {"value": "yes"}


@pytest.mark.parametrize("which", ["local", "remote"])
def test_a_card_for_the_other_mode_is_refused_naming_both_modes(which: str) -> None:
    e = EngineConfig(tp_size=1, block_size=4, num_blocks=4)
    d = card_of("d", DENSE, e, "push" if which == "local" else "pull")
    p = card_of("p", DENSE, e, "push" if which == "remote" else "pull")
    with pytest.raises(IncompatiblePairError) as err:
        Pairing.create(d, [p], mode="pull")
    assert err.value.field == "mode" and err.value.values == {"local": "pull", "remote": "push"}
    assert ("local card" if which == "local" else "remote rank 0 card") in str(err.value)


@pytest.mark.parametrize(
    ("local", "remote", "field"),
    [(0, 1, "local_dcp_size"), (1, 0, "remote_dcp_size"), (2, 3, "remote_dcp_size")],
)
def test_dcp_sizes_name_the_side_at_fault(local: int, remote: int, field: str) -> None:
    with pytest.raises(RatioError) as err:
        dcp_source_ranks(0, local, 4, remote)
    assert err.value.field == field


def test_a_request_with_the_wrong_d_id_count_is_refused_naming_d_ids() -> None:
    e = EngineConfig(tp_size=1, block_size=4, num_blocks=4)
    with pytest.raises(RequestError, match=r"^d_ids"):
        run(DENSE, e, e, Request(5, [[0, 1]], [[0]]), "pull", "kvgeom")
    with pytest.raises(RequestError, match=r"^p_ids"):
        run(DENSE, e, e, Request(5, [[0]], [[0, 1]]), "pull", "kvgeom")


def test_oracle_coordinates_outside_their_extent_are_refused() -> None:
    space = CoordSpace(DENSE, 8)
    layer = DENSE.layers[0].name
    ok = space.tag(layer, "kv", 0, 0, 0, 0)
    assert np.asarray(ok).size == 1
    for bad in ((8, 0, 0, 0), (0, -1, 0, 0), (0, 0, 2, 0)):  # token < 8, head < 2, K or V
        with pytest.raises(ValueError, match="index outside"):
            space.tag(layer, "kv", *bad)


def _qwen3(**extra: object) -> dict[str, object]:
    return {
        "model_type": "qwen3",
        "num_hidden_layers": 4,
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "sliding_window": 8,
        "max_window_layers": 2,
        "torch_dtype": "bfloat16",
        **extra,
    }


def test_qwen_sliding_windows_only_when_the_config_asks() -> None:
    from kvgeom.model.hfconfig import read_config

    def windows(config: dict[str, object]) -> list[int | None]:
        return [la.spec.sliding_window for la in read_config(config).layers]

    assert windows(_qwen3()) == [None] * 4  # no use_sliding_window: full attention everywhere
    assert windows(_qwen3(use_sliding_window=True)) == [None, None, 8, 8]


def test_attention_head_size_from_the_attention_hidden_size() -> None:
    """Zamba2-style configs size attention by ``attention_hidden_size`` (here 2 x hidden) when no head
    dimension is given: 128 / 4 heads = 32 elements per head."""
    from kvgeom.model.hfconfig import read_config

    config = _qwen3(attention_hidden_size=128)
    del config["head_dim"]
    assert {la.spec.head_size for la in read_config(config).layers} == {32}


def test_mamba2_inner_size_from_mamba_expand() -> None:
    """Mamba2 without a head dimension: inner = mamba_expand x hidden (here 4 x 64 = 256, 8 heads of 32)."""
    from kvgeom.model.hfconfig import read_config

    config = {
        "model_type": "nemotron_h",
        "num_hidden_layers": 2,
        "hybrid_override_pattern": "M*",
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "mamba_num_heads": 8,
        "n_groups": 2,
        "ssm_state_size": 4,
        "conv_kernel": 4,
        "mamba_expand": 4,
        "torch_dtype": "bfloat16",
    }
    ssm = read_config(config).ssm_spec
    assert ssm is not None and ssm.temporal.units * ssm.temporal.unit_elems == 8 * 32 * 4


def test_region_capacities_of_the_wrong_count_name_both_counts() -> None:
    from kvgeom import GroupMismatchError
    from kvgeom.plan.descids import desc_segments

    with pytest.raises(GroupMismatchError) as err:
        desc_segments(1, 8, 2, None, 1, [False], region_num_blocks=[8, 8, 8])
    assert err.value.field == "region_num_blocks" and err.value.values == {"value": 3, "expected": 2}


def test_tp_mapping_json_without_local_consumers_means_one() -> None:
    from kvgeom.pair.tp import TPMapping, compute_tp_mapping

    mapping = compute_tp_mapping(0, 2, 1, 2, False, [False])
    data = mapping.to_json()
    del data["local_consumers"]
    assert TPMapping.from_json(data).local_consumers == 1
    assert TPMapping.from_json(mapping.to_json()) == mapping


def test_plan_describe_lists_each_remote_rank() -> None:
    from kvgeom import plan_request

    d = card_of("d", DENSE, EngineConfig(tp_size=1, block_size=4, num_blocks=4))
    p = [
        card_of("p", DENSE, EngineConfig(tp_size=2, tp_rank=r, block_size=4, num_blocks=4)) for r in range(2)
    ]
    pairing = Pairing.create(d, p, mode="pull")
    text = pairing and plan_request(pairing, [[1]], [[2]], num_tokens=3).describe(pairing)
    assert "rank 0:" in text and "rank 1:" in text


# a GQA draft (one attention layer) under an MLA target
DRAFT = ModelSpec.from_layers(
    "mla+draft", [MLASpec(8, "float16"), MLASpec(8, "float16"), AttentionSpec(4, 4, "float16")]
)


@pytest.mark.parametrize(("p_tp", "d_tp"), [(1, 2), (2, 4)])
def test_vllm_mode_pulls_a_draft_with_local_tp_above_remote(p_tp: int, d_tp: int) -> None:
    """vLLM 0.33.0 maps a GQA draft under an MLA target when the local (D) TP is at least the remote's in
    a pull, not only at equal TP."""
    p, d = (
        EngineConfig(tp_size=p_tp, block_size=4, num_blocks=6),
        EngineConfig(tp_size=d_tp, block_size=4, num_blocks=6),
    )
    assert run(DRAFT, p, d, Request.simple(DRAFT, p, d, 7), "pull", "vllm").ok


def test_vllm_mode_refuses_a_draft_push_across_tp_sizes_naming_tp_size() -> None:
    p, d = (
        EngineConfig(tp_size=1, block_size=4, num_blocks=6),
        EngineConfig(tp_size=2, block_size=4, num_blocks=6),
    )
    with pytest.raises(KvgeomError) as err:
        run(DRAFT, p, d, Request.simple(DRAFT, p, d, 7), "push", "vllm")
    assert err.value.field == "tp_size"
    assert run(DRAFT, p, d, Request.simple(DRAFT, p, d, 7), "push", "kvgeom").ok


def test_run_plans_builds_its_own_oracle() -> None:
    from kvgeom.testing import pull_plans, run_plans

    p, d = (
        EngineConfig(tp_size=2, block_size=4, num_blocks=4),
        EngineConfig(tp_size=1, block_size=4, num_blocks=4),
    )
    request = Request.simple(DENSE, p, d, 6)
    report = run_plans(DENSE, p, d, request, pull_plans(DENSE, p, d, request))
    assert (
        report.ok and report.bytes_moved == 2 * 4 * 32
    )  # 2 blocks of 4 slots, 2 heads x (K, V) x 4 x 2 B a token


def test_recording_agents_default_to_no_engine_label() -> None:
    from kvgeom.testing import NixlFabric

    agent = NixlFabric().agent("a")
    assert agent.engine == "" and agent.rank == 0


def test_oracle_names_temporal_state_elements() -> None:
    from kvgeom.model.layers import MambaSpec

    model = ModelSpec.from_layers("ssm", [MambaSpec.mamba1(4, 1, 2, "float16")])
    space = CoordSpace(model, 4)
    assert "element 3" in space.describe(int(space.tag("layers.0.mamba", "temporal", 3, 0)))


def test_falcon_inner_size_that_disagrees_with_the_heads_is_refused_with_its_value() -> None:
    from kvgeom.errors import SpecError
    from kvgeom.model.hfconfig import read_config

    config = {
        "model_type": "falcon_h1",
        "num_hidden_layers": 1,
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "mamba_n_heads": 8,
        "mamba_d_head": 16,
        "mamba_n_groups": 1,
        "mamba_d_state": 4,
        "mamba_d_conv": 4,
        "mamba_d_ssm": 100,
        "torch_dtype": "bfloat16",
    }
    with pytest.raises(SpecError) as err:
        read_config(config)
    assert err.value.field == "mamba_d_ssm" and err.value.values["value"] == 100


# ---------------------------------------------------------------------- survivors of the CI sample (reformatted code)
def test_desc_segments_with_the_wrong_number_of_group_kinds_names_both_counts() -> None:
    from kvgeom import GroupMismatchError
    from kvgeom.plan.descids import desc_segments

    with pytest.raises(GroupMismatchError) as err:
        desc_segments(2, 8, 2, None, 1, [False])
    assert err.value.field == "group_is_ssm" and err.value.values == {"value": 1, "expected": 2}


def test_csa_linear_pairs_across_the_kv_head_count_name_tp_size() -> None:
    from kvgeom.pair.rules import check_csa_linear_tp_layout

    with pytest.raises(IncompatiblePairError) as err:  # 2 KV heads: TP1 shards them, TP4 replicates
        check_csa_linear_tp_layout(1, 4, 2)
    assert err.value.field == "tp_size"


def test_vllm_mode_refuses_a_two_head_draft_read_as_finer_remote_blocks() -> None:
    """A draft with 2 KV heads per rank (head-major pages) under MLA targets, P blocks of 2 tokens read into
    D blocks of 4: vLLM never regroups such pages, so vllm mode refuses; kvgeom mode regroups them."""
    draft = ModelSpec.from_layers(
        "mla+draft", [MLASpec(8, "float16")] * 2 + [AttentionSpec(2, 4, "float16")] * 2
    )
    p = EngineConfig(tp_size=1, block_size=2, num_blocks=10)
    d = EngineConfig(tp_size=1, block_size=4, num_blocks=10)
    request = Request.simple(draft, p, d, 13)
    with pytest.raises(KvgeomError) as err:
        run(draft, p, d, request, "pull", "vllm")
    assert err.value.field == "block_size"
    assert run(draft, p, d, request, "pull", "kvgeom").ok


def test_route_refuses_rows_of_different_lengths_naming_the_region() -> None:
    from kvgeom import UnsupportedError, rank_geometry
    from kvgeom.pair.route import route

    geom = rank_geometry(DENSE, EngineConfig(tp_size=1, block_size=4, num_blocks=4))
    rows = tuple(r.block_len for r in geom.regions)
    route(geom, geom, 0, "pull", 1, rows)  # equal rows pair whole
    with pytest.raises(UnsupportedError) as err:
        route(geom, geom, 0, "pull", 1, tuple(n // 2 for n in rows))
    assert err.value.field == "regions[0].block_len"


def test_a_negative_block_id_is_named_with_its_value_even_after_a_zero() -> None:
    from kvgeom import BlockIdError
    from kvgeom.blocks import as_ids

    with pytest.raises(BlockIdError) as err:
        as_ids([0, 5, -3], "ids")
    assert err.value.values == {"value": -3} and "at position 2" in str(err.value)


def test_route_refuses_a_replicated_latent_that_draft_sources_cannot_split_evenly() -> None:
    """A GQA draft under MLA targets, D TP1 reading P TP2: D's latent page is gathered in equal chunks
    from both draft sources; a remote latent row of another length is refused naming the region."""
    from kvgeom import UnsupportedError, rank_geometry
    from kvgeom.pair.route import route

    draft = ModelSpec.from_layers(
        "mla+draft", [MLASpec(8, "float16")] * 2 + [AttentionSpec(4, 4, "float16")] * 2
    )
    local = rank_geometry(draft, EngineConfig(tp_size=1, block_size=4, num_blocks=4))
    remote = rank_geometry(draft, EngineConfig(tp_size=2, block_size=4, num_blocks=4))
    rows = [r.block_len for r in remote.regions]
    route(local, remote, 0, "pull", 1, tuple(rows))
    mla = next(i for i, r in enumerate(local.regions) if r.is_mla)
    rows[mla] //= 2
    with pytest.raises(UnsupportedError) as err:
        route(local, remote, 0, "pull", 1, tuple(rows))
    assert err.value.field == f"regions[{mla}].block_len"


def test_each_stage_pairing_regroups_only_its_own_layers_pages() -> None:
    """P in two pipeline stages (one layer each), D one stage with blocks twice P's (bsr 2), head-major
    with 2 KV heads: every received block is regrouped per head (B.3.9). Each stage's pairing must regroup
    only the pages its own layer fills; regrouping every page of the group would permute the other
    stage's layer twice (once per pairing), which the oracle reports as I2."""
    from kvgeom import AttentionSpec, EngineConfig, ModelSpec
    from kvgeom.testing import Request
    from kvgeom.testing.oracle import run_pull

    m = ModelSpec.from_layers("pp", [AttentionSpec(2, 2, "float16")] * 2)
    p = EngineConfig(tp_size=1, block_size=2, num_blocks=8, pp_size=2)
    d = EngineConfig(tp_size=1, block_size=4, num_blocks=8)
    for n in (5, 7, 8):
        report = run_pull(m, p, d, Request.simple(m, p, d, n), compat="kvgeom")
        assert report.ok, report
        # 2 layers x n tokens x K and V x 2 heads x 2 elements x 2 B, whole blocks of 2 tokens from P
        assert report.bytes_moved == 2 * (2 * -(-n // 2)) * 2 * 2 * 2 * 2


def test_testing_strategies_is_loaded_on_first_access() -> None:
    """``kvgeom.testing.strategies`` is imported lazily (hypothesis is needed only there): reached through
    the package's ``__getattr__`` when it is not loaded yet; any other missing name is an AttributeError."""
    import sys

    import pytest

    import kvgeom.testing as t

    saved = sys.modules.pop("kvgeom.testing.strategies", None)
    had = t.__dict__.pop("strategies", None)
    try:
        assert t.__getattr__("strategies").__name__ == "kvgeom.testing.strategies"
        with pytest.raises(AttributeError):
            t.__getattr__("no_such_thing")
    finally:
        if saved is not None:
            sys.modules["kvgeom.testing.strategies"] = saved
        if had is not None:
            t.strategies = had  # type: ignore[attr-defined]


def test_csa_linear_model_names_its_replicated_page_ple() -> None:
    from kvgeom.model.csa import csa_linear_model

    ple = [la for la in csa_linear_model().layers if la.spec.kind.value == "replicated_state"]
    assert [(la.name, la.index, la.shares) for la in ple] == [("ple", 0, "layers.0.attn")]


def test_region_mapped_pull_passes_prefill_tokens_on() -> None:
    """Region-mapped pull (D keeps layers 1 and 3 in a group of their own) in the N-1 flow: D holds 9 tokens
    (3 blocks of 4), P computed 8 (2 blocks) and sent 2 blocks per group. Told ``prefill_tokens=8`` both
    modes plan it and the oracle passes (P's shorter list is not refused, D's third block is zeroed)."""
    from kvgeom import EngineConfig, MLASpec, ModelSpec
    from kvgeom.testing import Request
    from kvgeom.testing.oracle import run

    mla4 = ModelSpec.from_layers("mla", [MLASpec(8, "float16")] * 4)
    p = EngineConfig(tp_size=1, block_size=4, num_blocks=10)
    d = EngineConfig(
        tp_size=1, block_size=4, num_blocks=10, separate_group=("layers.1.attn", "layers.3.attn")
    )
    request = Request.simple(mla4, p, d, 9, 0, prefill_tokens=8)
    assert [len(x) for x in request.d_ids] == [3, 3] and [len(x) for x in request.p_ids] == [2]
    for compat in ("vllm", "kvgeom"):
        report = run(mla4, p, d, request, "pull", compat)
        assert report.ok, (compat, report)
        assert report.bytes_moved == 4 * 8 * 16  # 4 layers x 8 computed tokens x 16 B of latent
