"""vLLM's CPU attention page (``KVLayout.HEAD_KV_MAJOR``): ``[heads, K|V, tokens, head_size]``, each head's
K rows of every token then its V rows (vLLM's ``CPU_ATTN`` backend: a ``[blocks, heads, tokens, 2 x
head_size]`` tensor read as ``[heads, 2 x tokens, head_size]``, vllm/v1/attention/backends/cpu_attn.py).

The byte oracle places every coordinate by its own model of that page; kvgeom mode must then serve P
block 32 -> D block 64 (D's blocks regrouped per K and V run), dense and hybrid; vLLM-compatible mode must
refuse it (vLLM regroups such blocks as ``[heads, tokens, head_size]``), and that regroup -- planned for a
head-major page, applied to this one -- is exactly what the oracle finds wrong."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvgeom import EngineConfig, Pairing, rank_geometry
from kvgeom.engine import KVLayout
from kvgeom.errors import IncompatiblePairError
from kvgeom.spec import AttentionSpec, MambaSpec, ModelSpec
from kvgeom.testing import Request, pull_plans, run_plans, run_pull

ATTN = AttentionSpec(num_kv_heads=2, head_size=64, dtype="float32")
MAMBA = MambaSpec.mamba2(8, 32, 2, 16, 4, "float32", "float32")
DENSE = ModelSpec.from_layers("qwen3-tiny", [ATTN] * 4)
HYBRID = ModelSpec.from_layers("nemotron-h-tiny", [MAMBA, ATTN, MAMBA, None])
HYBRID_GROUPS = (("layers.0.mamba",), ("layers.2.mamba",), ("layers.1.attn",))
CPU = KVLayout.HEAD_KV_MAJOR


def engines(model: ModelSpec, p_block: int, d_block: int, layout: KVLayout = CPU) -> tuple[EngineConfig, ...]:
    groups = HYBRID_GROUPS if model is HYBRID else ()
    return tuple(
        EngineConfig(tp_size=1, block_size=b, num_blocks=32, kv_layout=layout, kv_cache_groups=groups)
        for b in (p_block, d_block)
    )


def test_the_layout_is_head_major_with_two_runs_per_head() -> None:
    assert CPU.is_head_major and CPU.runs_per_head == 2
    assert KVLayout.HEAD_MAJOR.runs_per_head == 1 and not KVLayout.TOKEN_MAJOR.is_head_major
    # the same bytes per page as vLLM's head-major page: only their order differs
    cpu = rank_geometry(DENSE, engines(DENSE, 32, 32)[0])
    hm = rank_geometry(DENSE, engines(DENSE, 32, 32, KVLayout.HEAD_MAJOR)[0])
    assert [(r.block_len, r.block_stride) for r in cpu.regions] == [
        (r.block_len, r.block_stride) for r in hm.regions
    ]


@pytest.mark.parametrize("model", [DENSE, HYBRID], ids=["dense", "hybrid"])
@pytest.mark.parametrize("p_block, d_block", [(32, 32), (32, 64), (64, 64)])
@pytest.mark.parametrize("num_tokens", [1, 40, 64, 150])
def test_kvgeom_mode_serves_the_cpu_page(
    model: ModelSpec, p_block: int, d_block: int, num_tokens: int
) -> None:
    p, d = engines(model, p_block, d_block)
    report = run_pull(model, p, d, Request.simple(model, p, d, num_tokens), compat="kvgeom")
    assert report.ok, report


@pytest.mark.parametrize("model", [DENSE, HYBRID], ids=["dense", "hybrid"])
def test_vllm_compatible_mode_refuses_a_block_size_ratio_on_the_cpu_page(model: ModelSpec) -> None:
    p, d = engines(model, 32, 64)
    p_geom, d_geom = rank_geometry(model, p), rank_geometry(model, d)
    with pytest.raises(IncompatiblePairError) as info:
        Pairing.create(d_geom, [p_geom], mode="pull", compat="vllm")
    assert info.value.field == "kv_layout"
    assert info.value.values == {"local": "head_kv_major", "remote": "head_kv_major"}
    # equal blocks move whole pages: served in both modes
    p32, d32 = engines(model, 32, 32)
    report = run_pull(model, p32, d32, Request.simple(model, p32, d32, 70), compat="vllm")
    assert report.ok, report


@pytest.mark.parametrize("model", [DENSE, HYBRID], ids=["dense", "hybrid"])
def test_vllms_regroup_of_the_cpu_page_is_wrong(model: ModelSpec) -> None:
    """What stock vLLM does on the CPU backend at P 32 -> D 64: plan as if the pages were head-major
    ``[heads, tokens, head_size]`` (which is what vLLM's post-process assumes), run it on the real page."""
    p, d = engines(model, 32, 64)
    hm_p, hm_d = (replace(e, kv_layout=KVLayout.HEAD_MAJOR) for e in (p, d))
    request = Request.simple(model, p, d, 100)
    wrong = run_plans(model, p, d, request, pull_plans(model, hm_p, hm_d, request, compat="kvgeom"))
    assert not wrong.ok
    assert "I2" in str(wrong)  # D's bytes hold other coordinates than its page expects
    right = run_plans(model, p, d, request, pull_plans(model, p, d, request, compat="kvgeom"))
    assert right.ok, right
