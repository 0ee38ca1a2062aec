"""The public strategies: what they draw is accepted and well-formed, and they shrink to small examples."""

from __future__ import annotations

import dataclasses
import math

import pytest
from hypothesis import HealthCheck, find, given, reject, settings
from hypothesis import strategies as st

from kvgeom import EngineConfig, KvgeomError
from kvgeom.layout.allocate import rank_geometry
from kvgeom.layout.engine import KVLayout
from kvgeom.layout.geometry import align_hybrid_block_size
from kvgeom.model.layers import AttentionSpec, MLASpec
from kvgeom.model.spec import ModelSpec
from kvgeom.testing import Oracle, pull_plans, push_plans
from kvgeom.testing import strategies as kst

FAST = settings(
    max_examples=100,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
FIND = settings(
    max_examples=2000, deadline=None, database=None, derandomize=True, suppress_health_check=list(HealthCheck)
)


@FAST
@given(kst.model_specs())
def test_models_have_a_geometry_at_every_valid_tp(model) -> None:
    assert 1 in kst.valid_tp_sizes(model)
    for tp in kst.valid_tp_sizes(model):
        block = align_hybrid_block_size(model, tp, 4, 4)  # the block itself for non-hybrid models
        rank_geometry(model, EngineConfig(tp_size=tp, tp_rank=tp - 1, block_size=block, num_blocks=2))


@FAST
@given(kst.model_specs().flatmap(lambda m: kst.engine_configs(m)))
def test_engine_configs_build(engine) -> None:
    assert engine.block_size % engine.kernel == 0


@FAST
@given(kst.cases())
def test_cases_are_accepted_and_requests_fit(case) -> None:
    case.pair.check()  # every local rank pairs
    Oracle.for_engines(
        case.pair.model, case.pair.p_engine, case.pair.d_engine, case.request
    )  # RequestError if not
    if case.request.prefix_blocks:
        assert case.pair.prefix_caching
        assert case.request.prefix_blocks < math.ceil(case.request.num_tokens / case.pair.d_engine.block_size)


@FAST
@given(kst.cases(equal_blocks=True))
def test_equal_blocks(case) -> None:
    assert case.pair.p_engine.block_size == case.pair.d_engine.block_size
    rank_geometry(case.pair.model, case.pair.p_engine)


def test_a_tp_change_shrinks_to_one_layer_and_tp_1_2() -> None:
    case = find(kst.cases(), lambda c: c.pair.p_engine.tp_size != c.pair.d_engine.tp_size, settings=FIND)
    assert len(case.pair.model.layers) == 1
    assert {case.pair.p_engine.tp_size, case.pair.d_engine.tp_size} == {1, 2}
    assert case.request.num_tokens <= 4 and case.request.prefix_blocks == 0


def test_a_hybrid_with_heterogeneous_tp_shrinks_small() -> None:
    def wanted(c: kst.Case) -> bool:
        return c.pair.model.has_ssm and c.pair.p_engine.tp_size != c.pair.d_engine.tp_size

    case = find(kst.cases(models=kst.model_specs(families=("attn+ssm",))), wanted, settings=FIND)
    assert len(case.pair.model.layers) == 2 and {case.pair.p_engine.tp_size, case.pair.d_engine.tp_size} == {
        1,
        2,
    }
    assert case.request.num_tokens == 1


@FAST
@given(kst.cases())
def test_the_oracle_resolves_plans_like_the_core(case) -> None:
    """``Oracle.moves_of`` (which reports bad ids instead of raising) agrees with ``RequestPlan.moves``."""
    make = pull_plans if case.pair.mode == "pull" else push_plans
    try:
        plans = make(
            case.pair.model,
            case.pair.p_engine,
            case.pair.d_engine,
            case.request,
            case.pair.compat,
            case.pair.prefix_caching,
        )
    except KvgeomError:
        reject()
    oracle = Oracle.for_engines(case.pair.model, case.pair.p_engine, case.pair.d_engine, case.request)
    for rp in plans:
        mine = oracle.moves_of(rp)
        assert (mine[:, 6] == mine[:, 7]).all()
        assert mine[:, :7].tolist() == rp.plan.moves(rp.pairing).tolist()


# the permute is drawn in pulls (both modes) and in kvgeom mode's pushes (vLLM refuses it in push)
PERMUTED = [("pull", None), ("push", "kvgeom")]


@pytest.mark.parametrize(("mode", "compat"), PERMUTED)
def test_permuted_pairs_are_drawn_across_tp_sizes(mode: str, compat: str | None) -> None:
    def wanted(c: kst.Case) -> bool:
        return c.pair.d_engine.permute_local_kv and c.pair.p_engine.tp_size != c.pair.d_engine.tp_size

    case = find(kst.cases(mode=mode, compat=compat), wanted, settings=FIND)
    assert case.pair.p_engine.kv_layout is KVLayout.HEAD_MAJOR
    assert case.pair.d_engine.kv_layout is KVLayout.TOKEN_MAJOR
    assert "permute" in str(case.pair)


@pytest.mark.parametrize(("mode", "compat"), PERMUTED)
@FAST
@given(data=st.data())
def test_permuted_pairs_pass_the_oracle(mode: str, compat: str | None, data: st.DataObject) -> None:
    cases = kst.cases(mode=mode, compat=compat, models=kst.model_specs(("dense",)))
    case = data.draw(cases.filter(lambda c: c.pair.d_engine.permute_local_kv))
    try:
        report = case.pair.run(case.request)
    except KvgeomError:
        assert kst.plannable_class(case.pair) is None
        reject()
    assert report.ok, f"{case}\n{report}"


def test_the_permuted_plannable_class() -> None:
    model = ModelSpec.from_layers("m4", [AttentionSpec(4, 8, "float16")] * 2)
    p = EngineConfig(tp_size=1, block_size=16, num_blocks=8)
    d = EngineConfig(tp_size=2, block_size=16, num_blocks=8, kv_layout="token_major", permute_local_kv=True)
    assert kst.plannable_class(kst.PDPair(model, p, d, "pull", "vllm")) == "dense attention, permuted"
    assert kst.plannable_class(kst.PDPair(model, p, d, "push", "vllm")) is None  # pulls only
    assert kst.plannable_class(kst.PDPair(model, p, d, "push", "kvgeom")) == "dense attention, permuted"
    small = dataclasses.replace(p, block_size=8, kernel_block_size=8)
    assert kst.plannable_class(kst.PDPair(model, small, d, "pull", "vllm")) is None  # blocks differ
    eight = dataclasses.replace(d, tp_size=8)  # 4 heads over 8 ranks: replicated
    assert kst.plannable_class(kst.PDPair(model, p, eight, "pull", "vllm")) is None
    mla = ModelSpec.from_layers("mla", [MLASpec(16, "float16")])
    assert kst.plannable_class(kst.PDPair(mla, p, d, "pull", "vllm")) is None
    unflagged = dataclasses.replace(d, permute_local_kv=False)  # two layouts without the permute
    assert kst.plannable_class(kst.PDPair(model, p, unflagged, "pull", "vllm")) is None


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
