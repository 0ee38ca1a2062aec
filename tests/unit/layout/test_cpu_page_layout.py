"""vLLM's CPU attention page (``KVLayout.HEAD_KV_MAJOR``): per head its K half, then its V half, in a
``[blocks, heads, tokens, 2 x head_size]`` tensor (vLLM's ``CPU_ATTN`` backend,
vllm/v1/attention/backends/cpu_attn.py). Its kernel stores K transposed, ``[head_size, tokens]``, and V as
``[tokens, head_size]`` rows (measured on the real op: tests/serving/test_cpu_page.py).

The byte oracle places every coordinate by its own model of that page. Equal kernel blocks move whole pages
and are served in both modes; a block-size ratio cannot be regrouped by token ranges there, so vllm mode
refuses P block 32 -> D block 64 (naming why; kvgeom mode cuts the page by its token runs:
tests/unit/plan/test_cpu_page_cut.py), and vLLM's regroup -- planned for a head-major page, applied to this
one, what stock vLLM does -- is what the oracle finds wrong."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvgeom import EngineConfig, Pairing, rank_geometry
from kvgeom.errors import IncompatiblePairError
from kvgeom.layout.engine import KVLayout
from kvgeom.model.layers import AttentionSpec, MambaSpec
from kvgeom.model.spec import ModelSpec
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


def test_the_layout_is_head_contiguous() -> None:
    assert CPU.is_head_major and CPU.runs_per_head == 2
    assert KVLayout.HEAD_MAJOR.runs_per_head == 1 and not KVLayout.TOKEN_MAJOR.is_head_major
    # the same bytes per page as vLLM's head-major page: only their order differs
    cpu = rank_geometry(DENSE, engines(DENSE, 32, 32)[0])
    hm = rank_geometry(DENSE, engines(DENSE, 32, 32, KVLayout.HEAD_MAJOR)[0])
    assert [(r.block_len, r.block_stride) for r in cpu.regions] == [
        (r.block_len, r.block_stride) for r in hm.regions
    ]


@pytest.mark.parametrize("compat", ["kvgeom", "vllm"])
@pytest.mark.parametrize("model", [DENSE, HYBRID], ids=["dense", "hybrid"])
@pytest.mark.parametrize("block", [32, 64])
@pytest.mark.parametrize("num_tokens", [1, 40, 64, 150])
def test_equal_blocks_move_whole_cpu_pages(
    compat: str, model: ModelSpec, block: int, num_tokens: int
) -> None:
    p, d = engines(model, block, block)
    report = run_pull(model, p, d, Request.simple(model, p, d, num_tokens), compat=compat)
    assert report.ok, report


@pytest.mark.parametrize("model", [DENSE, HYBRID], ids=["dense", "hybrid"])
def test_vllm_mode_refuses_a_block_size_ratio_on_the_cpu_page(model: ModelSpec) -> None:
    """vLLM would regroup it as [heads, tokens, head_size]; kvgeom mode cuts the page by its token runs
    (tests/unit/plan/test_cpu_page_cut.py)."""
    p, d = engines(model, 32, 64)
    p_geom, d_geom = rank_geometry(model, p), rank_geometry(model, d)
    with pytest.raises(IncompatiblePairError) as info:
        Pairing.create(d_geom, [p_geom], mode="pull", compat="vllm")
    assert info.value.field == "kv_layout"
    assert info.value.values == {"local": "head_kv_major", "remote": "head_kv_major"}


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
    # the same plan is right where the pages are head-major
    right = run_plans(model, hm_p, hm_d, request, pull_plans(model, hm_p, hm_d, request, compat="kvgeom"))
    assert right.ok, right


@pytest.mark.parametrize("compat", ["kvgeom", "vllm"])
@pytest.mark.parametrize("num_tokens", [40, 64, 65, 150])
def test_the_hybrid_n_minus_1_flow_on_cpu_pages(compat: str, num_tokens: int) -> None:
    """P computes all but the last token (D recomputes it, vLLM's flow for Mamba hybrids): nothing zeroed or
    written inside a transposed K half but whole pages."""
    p, d = engines(HYBRID, 32, 32)
    request = Request.simple(HYBRID, p, d, num_tokens, prefill_tokens=num_tokens - 1)
    report = run_pull(HYBRID, p, d, request, compat=compat)
    assert report.ok, report
