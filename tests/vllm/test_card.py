"""kvgeom_vllm.card: a vLLM rank's KV-cache specs as kvgeom's geometry card, with vLLM's own state-shape
calculator producing the per-rank shapes (as vLLM's model code does)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from kvgeom_vllm.card import card_of_worker, vllm_state_shapes
from transformers import PretrainedConfig
from vllm.model_executor.layers.mamba.mamba_utils import MambaStateShapeCalculator
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec

from kvgeom.errors import SpecError
from kvgeom.model.layers import LayerKind

HF = Path(__file__).resolve().parents[1] / "data" / "hf"


def falcon_h1() -> dict[str, Any]:
    return json.loads((HF / "falcon-h1-0.5b" / "config.json").read_text())  # mamba_n_groups = 1


def worker(tp: int, rank: int, specs: dict[str, Any], hf: dict[str, Any] | None, kv_heads: int = 2) -> Any:
    """The worker state card derivation reads (a registered vLLM worker has all of it)."""
    # vLLM's model config holds the model's own PretrainedConfig subclass: to_dict() gives the config.json fields
    hf_config = SimpleNamespace(to_dict=lambda: dict(hf)) if hf is not None else PretrainedConfig()
    model_config = SimpleNamespace(model="m", hf_config=hf_config, get_total_num_kv_heads=lambda: kv_heads)
    return SimpleNamespace(
        kv_cache_config=SimpleNamespace(transfer_groups=[SimpleNamespace(host_resident=False)]),
        _layer_specs=specs,
        vllm_config=SimpleNamespace(model_config=model_config),
        model_config=model_config,
        world_size=tp,
        tp_rank=rank,
        kv_cache_layout="LBHNC",
        _physical_blocks_per_logical_kv_block=1,
        block_size=64,
        _logical_num_blocks=8,
        engine_id="E",
        _TRANSFER_MODE="pull",
    )


def mamba2_layer(tp: int, cfg: dict[str, Any], num_spec: int = 0) -> MambaSpec:
    heads, head_dim = cfg["mamba_n_heads"], cfg["mamba_d_head"]
    shapes = MambaStateShapeCalculator.mamba2_state_shape(
        tp,
        cfg["mamba_d_ssm"],
        cfg["mamba_n_groups"],
        heads,
        head_dim,
        cfg["mamba_d_state"],
        cfg["mamba_d_conv"],
        num_spec,
    )
    return MambaSpec(
        block_size=64,
        shapes=shapes,
        dtypes=(torch.bfloat16, torch.float32),
        mamba_type=MambaAttentionBackendEnum.MAMBA2,
    )


def attention(tp: int) -> FullAttentionSpec:
    return FullAttentionSpec(block_size=64, num_kv_heads=max(1, 2 // tp), head_size=64, dtype=torch.bfloat16)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_mamba2_groups_come_from_the_model_config_when_replicated_across_ranks(tp: int) -> None:
    cfg = falcon_h1()
    specs = {"model.layers.0.self_attn.attn": attention(tp), "model.layers.0.mamba": mamba2_layer(tp, cfg)}
    card = card_of_worker(worker(tp, 0, specs, cfg))
    state = card.model.ssm_spec
    assert state.kind is LayerKind.MAMBA2 and state.conv_pieces[1].units == cfg["mamba_n_groups"] == 1
    # B and C are replicated across TP ranks beyond one group; the per-rank shapes are vLLM's
    assert state.replicated_pieces(tp) == (False, tp > 1, tp > 1)
    assert vllm_state_shapes(state, tp) == tuple(tuple(s) for s in specs["model.layers.0.mamba"].shapes)


def test_mamba2_rows_for_speculative_tokens_are_part_of_the_page() -> None:
    cfg = falcon_h1()
    spec = mamba2_layer(2, cfg, num_spec=2)
    card = card_of_worker(
        worker(2, 1, {"model.layers.3.mamba": spec, "model.layers.3.attn": attention(2)}, cfg)
    )
    assert card.model.ssm_spec.conv_rows == cfg["mamba_d_conv"] - 1 + 2


def test_at_tp1_the_rank_shapes_are_the_global_sizes() -> None:
    cfg = falcon_h1()
    card = card_of_worker(worker(1, 0, {"layers.0.mamba": mamba2_layer(1, cfg)}, None))
    assert card.model.ssm_spec.conv_pieces[1].units == 1


def test_replicated_groups_cannot_be_read_from_one_rank_without_the_model_config() -> None:
    with pytest.raises(SpecError, match="n_groups") as info:
        card_of_worker(worker(2, 0, {"layers.0.mamba": mamba2_layer(2, falcon_h1())}, None))
    assert info.value.field == "kv_cache_spec" and "layers.0.mamba" in str(info.value)


def test_shapes_the_model_config_does_not_give_are_refused_naming_both() -> None:
    cfg = falcon_h1()
    other = dict(cfg, mamba_n_groups=4)  # the rank holds one group of B and C; four groups would give it two
    with pytest.raises(SpecError, match="per-rank shapes") as info:
        card_of_worker(worker(2, 0, {"layers.0.mamba": mamba2_layer(2, cfg)}, other))
    assert set(info.value.values) == {"local", "remote"}


@pytest.mark.parametrize(
    "shapes,dtypes,match",
    [
        (((16,), (16,)), (torch.float16,), "conv and a temporal shape"),
        (((8, 3), (1, 4, 4)), (torch.float16, torch.float32), "whole key heads"),
        (((8,), (1, 4, 4)), (torch.float16, torch.float32), "conv shape"),
    ],
)
def test_synthetic_states_are_refused_clearly(shapes: tuple, dtypes: tuple, match: str) -> None:
    spec = MambaSpec(
        block_size=16, shapes=shapes, dtypes=dtypes, mamba_type=MambaAttentionBackendEnum.GDN_ATTN
    )
    with pytest.raises(SpecError, match=match) as info:
        card_of_worker(worker(1, 0, {"kda.0": spec}, None))
    assert "'kda.0'" in str(info.value)


def test_a_spec_that_breaks_the_reader_is_a_typed_refusal() -> None:
    broken = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    w = worker(1, 0, {"layers.0.attn": broken}, None)
    w.model_config.get_total_num_kv_heads = lambda: None  # a model config without a head count
    with pytest.raises(SpecError, match="does not describe a layer kvgeom knows"):
        card_of_worker(w)
