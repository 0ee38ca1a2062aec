"""Pairs vLLM 0.33.0 refuses, refused alike by ``compat="vllm"`` (a typed error naming the field and both
values) and planned by ``compat="kvgeom"`` where the byte oracle proves the plan right. The vLLM side of
each claim is checked against vLLM's own code by tests/vllm/test_e2e_differential.py."""

from __future__ import annotations

import pytest

from kvgeom import IncompatiblePairError, UnsupportedError
from kvgeom.layout.engine import EngineConfig
from kvgeom.model.layers import AttentionSpec, MambaSpec, MLASpec
from kvgeom.model.spec import ModelSpec
from kvgeom.testing import Request, run

MAMBA1 = ModelSpec.from_layers("ssm", [MambaSpec.mamba1(4, 1, 2, "float16")])
DENSE2 = ModelSpec.from_layers("dense", [AttentionSpec(2, 2, "float16")])
MLA = ModelSpec.from_layers("mla", [MLASpec(8, "float16")] * 2)


def test_attention_free_models() -> None:
    """vLLM builds its attention tables from the first attention group and fails at handshake without one."""
    e = EngineConfig(tp_size=1, block_size=1, num_blocks=3)
    request = Request(1, [[1]], [[2]])
    with pytest.raises(UnsupportedError) as info:
        run(MAMBA1, e, e, request, "pull", "vllm")
    assert info.value.field == "model"
    assert run(MAMBA1, e, e, request, "pull", "kvgeom").ok


@pytest.mark.parametrize(("p_tp", "d_tp", "vllm_refuses"), [(2, 1, True), (1, 2, True), (4, 2, False)])
def test_token_major_layouts_across_tp_sizes(p_tp: int, d_tp: int, vllm_refuses: bool) -> None:
    """Token-major (LBNHC) pages across TP sizes: vLLM refuses unless the remote replicates its KV heads
    (P TP 4 > 2 KV heads when D pulls); kvgeom mode cuts the pages per token."""
    p = EngineConfig(tp_size=p_tp, block_size=4, num_blocks=4, kv_layout="token_major")
    d = EngineConfig(tp_size=d_tp, block_size=4, num_blocks=4, kv_layout="token_major")
    request = Request(6, [[1, 2]], [[3, 0]])
    if vllm_refuses:
        with pytest.raises(IncompatiblePairError) as info:
            run(DENSE2, p, d, request, "pull", "vllm")
        assert info.value.field == "kv_layout"
    else:
        with pytest.raises(IncompatiblePairError) as info:  # vLLM's other rule: P_TP > KV heads > D_TP
            run(DENSE2, p, d, request, "pull", "vllm")
        assert info.value.field == "tp_size" and info.value.values == {"local": 2, "remote": 4}
    assert run(DENSE2, p, d, request, "pull", "kvgeom").ok


def test_dcp_with_pages_of_other_sizes_or_in_push_pairs_by_token() -> None:
    """Decode context parallelism with pages of other sizes on the two sides: vLLM pairs pages by index, which
    then hold other tokens (P's page 1 holds tokens 4-7 on rank 1, D's page 1 tokens 8-15): vllm mode refuses,
    kvgeom mode pairs every unit by its global token. In push vLLM pairs by counts, right only when both sides
    shard alike."""
    p = EngineConfig(tp_size=2, block_size=4, num_blocks=4, dcp_size=2)
    d = EngineConfig(tp_size=1, block_size=8, kernel_block_size=4, num_blocks=4)
    request = Request.simple(MLA, p, d, 9)
    with pytest.raises(UnsupportedError) as info:
        run(MLA, p, d, request, "pull", "vllm")
    assert info.value.field == "block_ids[0]"
    report = run(MLA, p, d, request, "pull", "kvgeom")
    assert (
        report.ok and report.bytes_moved == 2 * 3 * 4 * 8 * 2
    )  # 2 layers x 3 four-token units of fp16 latents
    alike = EngineConfig(tp_size=2, block_size=4, num_blocks=8, dcp_size=2)
    for compat in ("vllm", "kvgeom"):
        assert run(MLA, p, alike, Request.simple(MLA, p, alike, 9), "push", compat).ok
    replicated = EngineConfig(tp_size=4, block_size=4, num_blocks=8, dcp_size=4)
    request = Request.simple(MLA, EngineConfig(tp_size=1, block_size=4, num_blocks=8), replicated, 9)
    with pytest.raises(UnsupportedError):
        run(MLA, EngineConfig(tp_size=1, block_size=4, num_blocks=8), replicated, request, "push", "vllm")
    assert run(
        MLA, EngineConfig(tp_size=1, block_size=4, num_blocks=8), replicated, request, "push", "kvgeom"
    ).ok


ONE_GROUP = ModelSpec.from_layers(
    "mamba2-1g",
    [
        AttentionSpec(2, 2, "float16"),
        MambaSpec.mamba2(
            num_heads=2, head_dim=2, n_groups=1, state_size=2, conv_kernel=2, conv_dtype="float16"
        ),
    ],
)


def test_replicated_b_and_c_across_tp_sizes() -> None:
    """Mamba2 with one group at TP 2: B and C are whole on every rank; scaling them by the TP ratio (vLLM
    issue 55208) reads P's C as B. vllm mode refuses the pair, kvgeom mode plans it from the sharding rule."""
    from kvgeom.layout.geometry import align_hybrid_block_size

    p_block, d_block = align_hybrid_block_size(ONE_GROUP, 1, 4), align_hybrid_block_size(ONE_GROUP, 2, 4)
    p = EngineConfig(tp_size=1, block_size=p_block, num_blocks=4)
    d = EngineConfig(tp_size=2, block_size=d_block, num_blocks=4)
    request = Request.simple(ONE_GROUP, p, d, 3)
    with pytest.raises(UnsupportedError) as info:
        run(ONE_GROUP, p, d, request, "pull", "vllm")
    assert info.value.field == "tp_size" and info.value.values == {"local": 2, "remote": 1}
    assert run(ONE_GROUP, p, d, request, "pull", "kvgeom").ok


@pytest.mark.parametrize("compat", ["vllm", "kvgeom"])
def test_mamba_hybrid_with_different_ppl_refuses_prefix_caching(compat: str) -> None:
    block = 8
    p = EngineConfig(tp_size=1, block_size=block, kernel_block_size=block // 2, num_blocks=4)
    d = EngineConfig(tp_size=1, block_size=block, num_blocks=4)
    model = ModelSpec.from_layers("h", [AttentionSpec(2, 2, "float16"), MambaSpec.mamba1(2, 1, 2, "float16")])
    with pytest.raises(IncompatiblePairError) as info:
        run(model, p, d, Request.simple(model, p, d, 9), "pull", compat, prefix_caching=True)
    assert info.value.field == "ppl" and info.value.values == {"local": 1, "remote": 2}
