"""Random pulls between engines whose attention pages are vLLM's CPU page (``head_kv_major``: per head K
transposed, then V rows) at a block-size ratio: kvgeom mode cuts both pages by their token runs, and the
byte oracle (its own per-element model of the page) finds every needed byte in place, nothing else changed,
for dense and Mamba2-hybrid models, both directions of the ratio, TP pairs whose ranks hold the same KV
heads, the N-1 flow and prefix hits on D."""

from __future__ import annotations

import math

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvgeom import EngineConfig
from kvgeom.layout.engine import KVLayout
from kvgeom.model.layers import AttentionSpec, MambaSpec
from kvgeom.model.spec import ModelSpec
from kvgeom.testing import Request, run_pull

ATTN = AttentionSpec(num_kv_heads=2, head_size=16, dtype="float32")
ATTN1 = AttentionSpec(num_kv_heads=1, head_size=8, dtype="bfloat16", head_size_v=16)
MAMBA = MambaSpec.mamba2(4, 8, 2, 4, 4, "float32", "float32")
MODELS = {
    "dense": (ModelSpec.from_layers("dense", [ATTN] * 2), ((1, 1), (2, 2))),
    "one-kv-head": (ModelSpec.from_layers("one-kv-head", [ATTN1] * 2), ((1, 1), (1, 2), (2, 1), (2, 2))),
    "hybrid": (ModelSpec.from_layers("hybrid", [MAMBA, ATTN, MAMBA, None]), ((1, 1), (2, 2))),
}


@st.composite
def pulls(draw: st.DrawFn) -> tuple[ModelSpec, EngineConfig, EngineConfig, Request, bool]:
    name = draw(st.sampled_from(sorted(MODELS)))
    model, tps = MODELS[name]
    p_tp, d_tp = draw(st.sampled_from(tps))
    p_block, d_block = draw(st.sampled_from([(32, 64), (64, 32), (32, 128), (128, 32), (64, 128), (128, 64)]))
    p, d = (
        EngineConfig(tp_size=tp, block_size=b, num_blocks=24, kv_layout=KVLayout.HEAD_KV_MAJOR)
        for tp, b in ((p_tp, p_block), (d_tp, d_block))
    )
    n = draw(st.integers(1, 600))
    prefill = n - 1 if model.has_ssm and n > 1 and draw(st.booleans()) else None
    caching = not model.has_ssm and draw(st.booleans())
    prefix = draw(st.integers(0, max(0, math.ceil(n / d_block) - 1))) if caching else 0
    request = Request.simple(model, p, d, n, prefix_blocks=prefix, prefill_tokens=prefill)
    return model, p, d, request, caching


@given(pulls())
@settings(
    max_examples=60,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
def test_kvgeom_mode_pulls_the_cpu_page_at_any_block_size_ratio(
    pull: tuple[ModelSpec, EngineConfig, EngineConfig, Request, bool],
) -> None:
    model, p, d, request, caching = pull
    report = run_pull(model, p, d, request, compat="kvgeom", prefix_caching=caching)
    assert report.ok, report
