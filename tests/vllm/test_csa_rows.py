"""kvgeom.layout.csarows against vLLM 0.33.0's own KV-cache planner: for CSA-linear models, vLLM's packed grouping
(``_get_packed_kv_cache_groups``, block-outermost ``BLHNC``) chooses the groups, vLLM's
``get_kv_cache_config_from_groups`` lays them out, and every layer's page must start where kvgeom's
:func:`packed_registration` puts it, in a row of kvgeom's ``row_bytes`` (docs/vllm-behaviour.md B.6.14).

Sizes: the default hand-built model, and one at the sizes of vLLM's ``qwen4_exp`` defaults (transformers'
``Qwen4ExpTextConfig``: GDN with 16 key heads and 32 value heads of 128, conv kernel 4; the PLE state of
``hidden_size * hc_count`` = 2048 x 4 channels and ``(ple_conv_kernel_size - 1) * ngram_size`` = 9 rows) with
a compressed-key head of 128 and compress ratio 4 (no public CSA-linear qwen4_exp config: the default has no
indexer), where the PLE page is longer than the MLA page it overlays."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any
from unittest.mock import patch

import pytest
import torch
from _vllm_workers import cpu_runtime, vllm_config
from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker as bw
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_worker import NixlPullConnectorWorker
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
from vllm.v1.core import kv_cache_planning as planning
from vllm.v1.kv_cache_interface import CircularBufferSpec as VCircular
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheLayout, MLAAttentionSpec
from vllm.v1.kv_cache_interface import MambaSpec as VMamba

from kvgeom.layout.csarows import packed_groups, packed_registration
from kvgeom.layout.geometry import page_bytes_of
from kvgeom.model.csa import csa_linear_model
from kvgeom.model.layers import AttentionSpec, CircularBufferSpec, MambaSpec, MLASpec, ReplicatedStateSpec
from kvgeom.model.spec import ModelSpec

BF16 = torch.bfloat16


def _vllm_spec(spec: object, block_size: int, tp: int) -> object:
    """vLLM's spec of the same page (SSM states as one bfloat16 buffer of the state's bytes)."""
    if isinstance(spec, AttentionSpec):  # head-sharded main KV: the rank's heads
        return FullAttentionSpec(
            block_size=block_size, num_kv_heads=spec.heads_per_rank(tp), head_size=spec.head_size, dtype=BF16
        )
    if isinstance(spec, MLASpec):
        return MLAAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=spec.latent_size, dtype=BF16)
    if isinstance(spec, CircularBufferSpec):
        return VCircular(
            block_size=spec.capacity, num_kv_heads=1, head_size=spec.entry_size, head_size_v=0, dtype=BF16
        )
    if isinstance(spec, MambaSpec):
        # DS conv layout (channels, rows), then the temporal state (value heads, value dim, key dim): vLLM's
        # GDN spec, which its conv split reads
        rows = spec.conv_kernel - 1
        k_dim, v_dim = spec.conv_pieces[0].unit_elems, spec.conv_pieces[2].unit_elems
        heads = spec.temporal.units_per_rank(tp)
        return VMamba(
            block_size=block_size,
            shapes=((spec.conv_bytes(tp) // (2 * rows), rows), (heads, v_dim, k_dim)),
            dtypes=(BF16, BF16),
            mamba_type=MambaAttentionBackendEnum.GDN_ATTN,
        )
    assert isinstance(spec, ReplicatedStateSpec)
    return VMamba(
        block_size=block_size,
        shapes=((spec.state_bytes(tp) // 2,),),
        dtypes=(BF16,),
        tp_replicated=True,
    )


def _vllm_specs(model: ModelSpec, block_size: int, tp: int) -> dict[str, Any]:
    specs = {la.name: _vllm_spec(la.spec, block_size, tp) for la in model.layers}
    for la in model.layers:
        assert specs[la.name].page_size_bytes == page_bytes_of(la.spec, block_size, tp)  # type: ignore[attr-defined]
    return specs


def _vllm_config(model: ModelSpec, block_size: int, tp: int) -> tuple[list[list[str]], Any, dict[str, Any]]:
    """vLLM's groups and KV-cache config (4 blocks) for ``model``'s layers."""
    specs = _vllm_specs(model, block_size, tp)
    cfg = SimpleNamespace(
        attention_config=SimpleNamespace(hisparse_config=None),
        cache_config=SimpleNamespace(
            get_resolved_kv_cache_layout=lambda: KVCacheLayout.BLHNC,
            num_gpu_blocks_override=4,
            prefix_cache_retention_interval=None,
        ),
    )
    groups = planning._get_packed_kv_cache_groups(cfg, specs)
    assert groups is not None
    config = planning.get_kv_cache_config_from_groups(cfg, groups, 1 << 40)
    return [list(g.layer_names) for g in groups], config, specs


def _vllm_layout(model: ModelSpec, block_size: int, tp: int) -> tuple[list[list[str]], int, dict[str, int]]:
    """vLLM's groups, row and page starts for ``model``'s layers."""
    groups, config, _ = _vllm_config(model, block_size, tp)
    starts: dict[str, int] = {}
    rows = set()
    for t in config.kv_cache_tensors:
        rows.add(t.block_stride)
        for i, name in enumerate(t.layers):
            starts[name] = t.offset + i * t.layer_stride
    (row,) = rows
    return groups, row, starts


REAL = csa_linear_model(
    "qwen4-exp-sized",
    num_csa_layers=10,
    head_size=128,
    compress_ratio=4,
    speculative_tokens=3,
    gdn=MambaSpec.gdn(16, 128, 32, 128),
    ple_channels=2048 * 4,
    ple_conv_kernel=10,
)


GQA = csa_linear_model("gqa-main-kv", main_kv_heads=2)
"""Head-sharded main KV (2 KV heads) before each layer's compressed keys, as vLLM's ``Qwen4ExpQSAAttention``."""


@pytest.mark.parametrize(
    ("model", "block_size", "tp"),
    [
        (csa_linear_model(), 16, 1),
        (csa_linear_model(), 16, 2),
        (csa_linear_model(), 4, 1),
        (csa_linear_model(num_csa_layers=4), 8, 1),
        (REAL, 64, 1),
        (REAL, 256, 2),
        (GQA, 16, 1),
        (GQA, 16, 2),
    ],
    ids=[
        "small-tp1",
        "small-tp2",
        "small-b4",
        "four-layers-b8",
        "qwen4-exp-sized-b64",
        "qwen4-exp-sized-b256-tp2",
        "gqa-main-kv-tp1",
        "gqa-main-kv-tp2",
    ],
)
def test_rows_and_page_starts_are_vllms(model: ModelSpec, block_size: int, tp: int) -> None:
    groups, row, starts = _vllm_layout(model, block_size, tp)
    assert packed_groups(model, block_size, tp) == tuple(tuple(g) for g in groups)
    reg = packed_registration(model, groups, block_size=block_size, tp_size=tp)
    assert reg.row_bytes == row
    assert {v.name: v.offset for v in reg.views} == starts
    if model is REAL:
        # the replicated page (147456 B) is longer than the MLA page of the region it starts (block x 256 B)
        assert reg.ple is not None and reg.ple[1] == 8192 * 9 * 2
        assert reg.ple[1] > reg.regions[reg.ple[0]].block_len


class _Backend:
    """The attention backend the worker asks for its name and kernel block sizes (the logical block: one
    kernel block per block)."""

    sizes: list[int] = [16]

    @staticmethod
    def get_name() -> str:
        return "KVGEOM"

    @staticmethod
    def get_supported_kernel_block_sizes(spec: object = None) -> list[int]:
        return _Backend.sizes


NO_SSM = ModelSpec(
    "mla-rings",
    tuple(la for la in csa_linear_model().layers if not la.kind.is_ssm),
)


@pytest.mark.parametrize(
    ("model", "block_size"),
    [(csa_linear_model(), 16), (NO_SSM, 16), (REAL, 64), (GQA, 16)],
    ids=["small", "small-without-ssm-state", "qwen4-exp-sized-b64", "gqa-main-kv"],
)
def test_registration_is_vllms(model: ModelSpec, block_size: int) -> None:
    """vLLM's worker registers views of one block-outermost allocation (BLHNC, TP1): its regions (starts,
    lengths, strides, group ids, MLA flags) and scratch, SSM and PLE regions are kvgeom's."""
    worker = _registered(NixlPullConnectorWorker, model, block_size, 1)
    groups = _vllm_config(model, block_size, 1)[0]
    reg = packed_registration(model, groups, block_size=block_size)
    base = worker.kvgeom_test_raw.data_ptr()
    assert [a - base for a in worker.kv_caches_base_addr["csa"][0]] == [r.offset for r in reg.regions]
    assert worker.block_len_per_layer == [r.block_len for r in reg.regions]
    assert worker.block_stride_per_layer == [reg.row_bytes] * len(reg.regions)
    assert worker.region_group_ids == [r.group for r in reg.regions]
    assert worker._region_is_mla == [r.is_mla for r in reg.regions]
    assert tuple(worker._scratch_region_indices) == reg.scratch
    assert tuple(worker._ssm_region_indices) == reg.ssm
    ple = (worker._ple_region_index, worker._ple_block_len) if worker._ple_region_index is not None else None
    assert ple == reg.ple


def _registered(worker_class: type, model: ModelSpec, block_size: int, tp: int) -> Any:
    """A worker of ``worker_class`` that registered vLLM's block-outermost allocation of ``model``'s pages at
    TP ``tp`` (one rank's pages; the worker's own parallel configuration stays TP1)."""
    groups, config, specs = _vllm_config(model, block_size, tp)
    raw = torch.zeros(config.kv_cache_tensors[0].size, dtype=torch.int8)
    caches = {
        name: raw.as_strided(
            (config.num_blocks, specs[name].page_size_bytes),
            (t.block_stride, 1),
            t.offset + i * t.layer_stride,
        )
        for t in config.kv_cache_tensors
        for i, name in enumerate(t.layers)
    }
    vc = vllm_config(block_size)
    _Backend.sizes = [block_size]
    vc.cache_config.kv_cache_layout = "BLHNC"
    with cpu_runtime(), patch.object(bw, "get_current_attn_backends", return_value=[_Backend]):
        worker = worker_class(vc, "csa", config)
        worker.use_mla = model.attention_spec is None
        worker.register_kv_caches({la.name: caches[la.name] for la in model.layers})
    worker.kvgeom_test_raw = raw  # keep the allocation alive with the worker
    return worker


def test_the_drop_in_refuses_packed_rows_whose_regions_start_elsewhere_on_the_peer() -> None:
    """kvgeom_vllm's handshake (a CSA-linear rank has no geometry card, so the peer is judged on the numbers
    it advertises): the row offsets come from the registered base addresses. 2 KV heads and GDN(4, 4, 4, 4):
    at TP2 the GDN-only region starts at row byte 208, at TP4 at 104 (the GDN page before it halves), so
    the pair is refused; two TP2 registrations pair."""
    from kvgeom_vllm.answers.validate import _row_offsets
    from kvgeom_vllm.worker import KvgeomPullConnectorWorker

    from kvgeom.compat.vllm.advertised import Advertised, LocalFacts, check_advertised_pair
    from kvgeom.errors import UnsupportedError

    model = csa_linear_model(main_kv_heads=2, gdn=MambaSpec.gdn(4, 4, 4, 4))
    at = {tp: _registered(KvgeomPullConnectorWorker, model, 16, tp) for tp in (2, 4)}
    offsets = {tp: _row_offsets(w, w.kv_caches_base_addr["csa"][w.tp_rank]) for tp, w in at.items()}
    assert offsets == {2: (0, 1024, 512, 1280, 64, 208), 4: (0, 1024, 512, 1280, 64, 104)}

    def advertised(tp: int) -> Advertised:
        w = at[tp]
        return Advertised(
            tp_size=tp,
            block_size=16,
            num_blocks=int(w.num_blocks),
            block_lens=tuple(w.block_len_per_layer),
            block_strides=tuple(w.block_stride_per_layer),
            kv_layout="LBHNC",
            row_offsets=offsets[tp],
        )

    facts = LocalFacts(is_mla=False, has_ssm=True, total_kv_heads=2, regions=tuple(range(6)))
    with pytest.raises(UnsupportedError) as e:
        check_advertised_pair(advertised(4), advertised(2), facts)
    assert e.value.field == "regions[5].row_offset"
    assert (e.value.values["local"], e.value.values["remote"]) == (104, 208)
    assert check_advertised_pair(advertised(2), advertised(2), facts).tp_ratio == 1


@pytest.mark.parametrize(
    ("model", "block_size"),
    [(csa_linear_model(), 16), (GQA, 16), (REAL, 64), (NO_SSM, 16)],
    ids=["small", "gqa-main-kv", "qwen4-exp-sized-b64", "small-without-ssm-state"],
)
def test_the_drop_in_describes_packed_csa_linear_ranks(model: ModelSpec, block_size: int) -> None:
    """kvgeom_vllm's geometry card of a CSA-linear rank (vLLM's rings and PLE state become kvgeom's
    ``CircularBufferSpec`` and ``ReplicatedStateSpec``, the rows ``packed_rows``): kvgeom's geometry of the
    card is what vLLM's worker registered (the drop-in checks it) and kvgeom's own geometry of the model, so
    kvgeom mode can pair such ranks by their cards. Without SSM state (not modelled) there is no card."""
    from unittest.mock import patch as patch_method

    from kvgeom_vllm.worker import KvgeomPullConnectorWorker, install_dispatchers
    from vllm.config import ModelConfig

    from kvgeom.layout.allocate import rank_geometry
    from kvgeom.layout.engine import EngineConfig

    install_dispatchers()
    heads = model.attention_spec.num_kv_heads if model.attention_spec else 1
    with patch_method.object(ModelConfig, "get_total_num_kv_heads", return_value=heads):
        worker = _registered(KvgeomPullConnectorWorker, model, block_size, 1)
    if not model.has_ssm:
        assert worker.kvgeom_card is None and worker.kvgeom_card_error.field == "packed_rows"
        return
    assert worker.kvgeom_card is not None, worker.kvgeom_card_error
    geom = worker.kvgeom_card.geometry
    ours = rank_geometry(
        model,
        EngineConfig(tp_size=1, block_size=block_size, num_blocks=geom.engine.num_blocks, packed_rows=True),
    )
    assert [list(g.layers) for g in geom.groups] == [list(g.layers) for g in ours.groups]
    assert [(r.block_len, r.block_stride, r.row_offset) for r in geom.regions] == [
        (r.block_len, r.block_stride, r.row_offset) for r in ours.regions
    ]
    assert geom.scratch_region_indices == ours.scratch_region_indices
    assert geom.ple is not None and ours.ple is not None  # the page copied whole: its place and length
    assert (geom.ple.group, geom.ple.region, geom.ple.length) == (
        ours.ple.group,
        ours.ple.region,
        ours.ple.length,
    )
    assert [la.kind for la in geom.model.layers] == [la.kind for la in model.layers]
