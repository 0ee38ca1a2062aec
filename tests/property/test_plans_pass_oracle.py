"""Every plan kvgeom makes for a pair it accepts passes the byte oracle (I1-I6), in pull and in push, in
``compat="kvgeom"`` and ``compat="vllm"`` mode; plus worked examples of the cases docs/vllm-behaviour.md names.

Cases kvgeom refuses (a :class:`~kvgeom.errors.KvgeomError` at handshake or plan time) are rejected, as
Profiles: ``conftest.py``.
"""

from __future__ import annotations

import pytest
from hypothesis import event, given, reject, settings
from hypothesis import strategies as st

from kvgeom import KvgeomError, UnsupportedError
from kvgeom.layout.allocate import rank_geometry
from kvgeom.layout.engine import EngineConfig
from kvgeom.layout.geometry import align_hybrid_block_size
from kvgeom.model.layers import AttentionSpec, MambaSpec, MLASpec
from kvgeom.model.spec import ModelSpec
from kvgeom.testing import Report, Request, run
from kvgeom.testing import strategies as kst


def _check(case: kst.Case, tell_num_tokens: bool = True) -> None:
    try:
        report = case.run(tell_num_tokens)
    except KvgeomError as exc:
        event(f"refused: {type(exc).__name__} {exc.field}")
        reject()
    for feature in _features(case):
        event(f"ran: {feature}")
    assert report.ok, f"{case}\n{report}"


def _features(case: kst.Case) -> list[str]:
    """What a case exercises (shown by ``pytest --hypothesis-show-statistics``)."""
    p, d = case.pair.p_engine, case.pair.d_engine
    out = [case.pair.model.name]
    if p.tp_size != d.tp_size:
        out.append("P_TP > D_TP" if p.tp_size > d.tp_size else "P_TP < D_TP")
    if p.kernel != d.kernel:
        out.append("kernel blocks differ")
    if p.block_size != d.block_size:
        out.append("logical blocks differ")
    if p.ppl > 1 or d.ppl > 1:
        out.append("kernel < logical block")
    if case.request.prefix_blocks:
        out.append("prefix hit")
    if case.request.p_tokens < case.request.num_tokens:
        out.append("N-1 flow")
    if p.dcp_size > 1 or d.dcp_size > 1:
        out.append("DCP")
    if p.kv_layout.value != "head_major" and case.pair.model.attention_spec is not None:
        out.append("token-major")
    if p.kv_split:
        out.append("split K/V")
    return out


@given(kst.cases(mode="pull", compat="kvgeom"))
def test_pull_plans_pass_oracle_kvgeom(case: kst.Case) -> None:
    _check(case)


@given(kst.cases(mode="pull", compat="vllm"))
def test_pull_plans_pass_oracle_vllm(case: kst.Case) -> None:
    _check(case)


@given(kst.cases(mode="push", compat="kvgeom"))
def test_push_plans_pass_oracle_kvgeom(case: kst.Case) -> None:
    _check(case)


@given(kst.cases(mode="push", compat="vllm"))
def test_push_plans_pass_oracle_vllm(case: kst.Case) -> None:
    _check(case)


# A connector that does not tell the planner the request's length: test_token_counts_required.py (refused
# wherever attention blocks are placed; elsewhere the plan the counts give).


# -- worked examples --------------------------------------------------------------------------------
def _engine(tp: int, block: int, kernel: int | None = None, blocks: int = 12) -> EngineConfig:
    return EngineConfig(tp_size=tp, block_size=block, kernel_block_size=kernel, num_blocks=blocks)


def _ok(
    model: ModelSpec, p: EngineConfig, d: EngineConfig, request: Request, mode: str, compat: str
) -> Report:
    report = run(model, p, d, request, mode, compat)
    assert report.ok, str(report)
    assert report.bytes_moved > 0
    return report


GQA = ModelSpec.from_layers("gqa-8", [AttentionSpec(8, 16, "bfloat16")] * 2)


@pytest.mark.parametrize("compat", ["kvgeom", "vllm"])
@pytest.mark.parametrize("mode", ["pull", "push"])
@pytest.mark.parametrize(("p_tp", "d_tp"), [(1, 4), (4, 1)])
def test_dense_gqa_8_kv_heads(p_tp: int, d_tp: int, mode: str, compat: str) -> None:
    p, d = _engine(p_tp, 16), _engine(d_tp, 16)
    request = Request(37, [[7, 2, 9]], [[4, 0, 11]])  # 3 blocks, the last one part-filled, shuffled ids
    report = _ok(GQA, p, d, request, mode, compat)
    per_token = 2 * 8 * 16 * 2 * 2  # layers * heads * (K + V) * head_size * bytes
    assert report.bytes_moved == 3 * 16 * per_token  # every token slot of every block, exactly once


MLA = ModelSpec.from_layers("mla", [MLASpec(576, "bfloat16")] * 2)


@pytest.mark.parametrize("compat", ["kvgeom", "vllm"])
def test_mla_p_tp8_to_d_tp2_pull(compat: str) -> None:
    report = _ok(MLA, _engine(8, 16), _engine(2, 16), Request(20, [[3, 5]], [[1, 6]]), "pull", compat)
    assert report.bytes_moved == 2 * 2 * 2 * 16 * 576 * 2  # D ranks * layers * blocks * tokens * latent bytes


def test_mla_p_tp8_to_d_tp2_push_with_larger_p_blocks() -> None:
    _ok(MLA, _engine(8, 32), _engine(2, 16), Request(40, [[3, 5]], [[1, 6, 2]]), "push", "kvgeom")


MAMBA2 = MambaSpec.mamba2(num_heads=4, head_dim=2, n_groups=4, state_size=4)
MAMBA2_HYBRID = ModelSpec.from_layers(
    "mamba2-hybrid", [AttentionSpec(2, 4, "bfloat16"), MAMBA2, MAMBA2, AttentionSpec(2, 4, "bfloat16")]
)


def test_mamba2_hybrid_p_tp4_to_d_tp1_block_ratio_2() -> None:
    p_block = align_hybrid_block_size(MAMBA2_HYBRID, 4, 8, 8)
    d_block = align_hybrid_block_size(MAMBA2_HYBRID, 1, 8, 8)
    assert (p_block, d_block) == (8, 16)  # per-rank KV heads make the aligned block TP-dependent
    request = Request(21, [[1, 4, 9], [2]], [[3, 5], [7]])  # 21 tokens: D's 2nd block part-filled
    p, d = _engine(4, p_block), _engine(1, d_block)
    report = _ok(MAMBA2_HYBRID, p, d, request, "pull", "kvgeom")
    assert report.regrouped_blocks > 0 and report.bytes_zeroed > 0
    with pytest.raises(UnsupportedError, match="Head-sharded"):  # vLLM refuses this composition (B.3.11)
        run(MAMBA2_HYBRID, p, d, request, "pull", "vllm")


def test_mamba2_hybrid_p_tp4_to_d_tp1_push_with_equal_kernels() -> None:
    request = Request(21, [[1, 4, 9], [2]], [[3, 5], [7]])
    _ok(MAMBA2_HYBRID, _engine(4, 8), _engine(1, 16, kernel=8), request, "push", "kvgeom")


GDN = MambaSpec.gdn(num_k_heads=2, k_head_dim=4, num_v_heads=4, v_head_dim=4)
GDN_HYBRID = ModelSpec.from_layers("gdn-hybrid", [GDN, GDN, GDN, AttentionSpec(2, 8, "bfloat16")])


@pytest.mark.parametrize("mode", ["pull", "push"])
@pytest.mark.parametrize("compat", ["kvgeom", "vllm"])
def test_gdn_hybrid_kernel_blocks_smaller_than_logical_on_one_side(mode: str, compat: str) -> None:
    block = align_hybrid_block_size(GDN_HYBRID, 2, 16)
    assert block % 4 == 0
    p, d = _engine(2, block, kernel=block // 4), _engine(2, block)  # P: 4 kernel blocks per logical block
    if mode == "push":
        p, d = _engine(2, block), _engine(2, block, kernel=block // 4)
    request = Request(
        block + 3, [[5, 2], [8], [0], [10]], [[1, 6], [3], [9], [11]]
    )  # 1 attention, 3 GDN groups
    _ok(GDN_HYBRID, p, d, request, mode, compat)


KDA = MambaSpec.kda(num_heads=4, head_dim=4)
MLA_KDA = ModelSpec.from_layers(
    "mla-kda", [MLASpec(32, "bfloat16"), KDA, KDA, MLASpec(32, "bfloat16"), KDA, KDA]
)


@pytest.mark.parametrize(("p_tp", "d_tp"), [(2, 1), (1, 2), (4, 2), (2, 4), (1, 4), (4, 1)])
def test_mla_kda_hybrid_pull_with_non_dividing_block_sizes(p_tp: int, d_tp: int) -> None:
    """Aligned to single tokens, the blocks are 9, 5 and 3 tokens at TP1, 2, 4: kvgeom reads both in
    gcd-sized units (vLLM B.6.7) and zeroes what the last unit leaves."""
    p_block = align_hybrid_block_size(MLA_KDA, p_tp, 1, 1)
    d_block = align_hybrid_block_size(MLA_KDA, d_tp, 1, 1)
    assert p_block != d_block  # 3, 5 or 9 tokens: often not dividing each other
    p, d = _engine(p_tp, p_block), _engine(d_tp, d_block)
    _ok(MLA_KDA, p, d, Request.simple(MLA_KDA, p, d, max(p_block, d_block) + 5), "pull", "kvgeom")


@pytest.mark.parametrize(("p_tp", "d_tp"), [(1, 2), (4, 2), (2, 4), (1, 4)])
def test_mla_kda_hybrid_push(p_tp: int, d_tp: int) -> None:
    p_block = align_hybrid_block_size(MLA_KDA, p_tp, 8, 8)
    d_block = align_hybrid_block_size(MLA_KDA, d_tp, 8, 8)
    p, d = _engine(p_tp, p_block), _engine(d_tp, d_block)
    _ok(MLA_KDA, p, d, Request.simple(MLA_KDA, p, d, 2 * max(p_block, d_block) - 3), "push", "kvgeom")


@st.composite
def _free_kernel_pulls(draw: st.DrawFn) -> kst.Case:
    """Pull pairs whose D kernel block is any divisor of D's block: P kernel blocks larger than D's, or
    sizes that do not divide (kvgeom reads P blocks in token pieces where its pages allow)."""
    pair = draw(kst.pd_pairs(mode="pull", compat="kvgeom"))
    d = pair.d_engine
    kernel = draw(st.sampled_from([k for k in range(1, d.block_size + 1) if d.block_size % k == 0][:8]))
    d = EngineConfig(**{**d.to_json(), "kernel_block_size": kernel})
    try:  # a kernel block that does not cut a hybrid's page evenly is refused by the geometry itself
        rank_geometry(pair.model, d)
    except KvgeomError:
        reject()
    pair = kst.PDPair(pair.model, pair.p_engine, d, "pull", "kvgeom", pair.prefix_caching)
    return kst.Case(pair, draw(kst.requests(pair)))


@given(_free_kernel_pulls())
@settings(max_examples=300)
def test_pulls_with_any_kernel_ratio_pass_the_oracle(case: kst.Case) -> None:
    _check(case)
