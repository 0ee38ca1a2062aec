"""A connector hands the planner what the scheduler exchanges: an SSM group's block list as the Mamba
manager allocates it (null placeholders and superseded states before the running state, speculative
scratch slots after it) clips to the running-state slot (:func:`kvgeom.plan.exchange.exchange_clipped_blocks`),
and the clipped request plans to bytes the oracle accepts."""

from __future__ import annotations

from hypothesis import given, reject, settings
from hypothesis import strategies as st

from kvgeom import KvgeomError
from kvgeom.plan.exchange import exchange_clipped_blocks
from kvgeom.testing import Request, engine_geometries
from kvgeom.testing import strategies as kst


@st.composite
def raw_lists(draw: st.DrawFn) -> tuple[kst.Case, list[list[int]], list[int | None]]:
    case = draw(kst.cases(mode="pull", models=kst.model_specs(families=("attn+ssm", "mla+ssm", "ssm"))))
    d_ids = [list(g) for g in case.request.d_ids]
    kinds = [g.is_ssm for g in engine_geometries(case.pair.model, case.pair.d_engine)[0].groups]
    spec_slots: list[int | None] = []
    raw = []
    for ids, ssm in zip(d_ids, kinds):
        if not ssm:
            raw.append(ids), spec_slots.append(None)
            continue
        n_spec = draw(st.integers(0, 3))
        before = draw(st.lists(st.just(-1), max_size=3))  # null placeholders / superseded states
        before = [10_100 + k for k in range(len(before))]
        # scratch slots come with the state; only a list holding nothing before the state may lack some
        scratch = [10_000 + k for k in range(n_spec if before else draw(st.integers(0, n_spec)))]
        raw.append(before + ids + scratch), spec_slots.append(n_spec)
    return case, raw, spec_slots


@settings(max_examples=300)
@given(raw_lists())
def test_clipped_ssm_lists_plan_to_correct_bytes(drawn: tuple) -> None:
    case, raw, spec_slots = drawn
    clipped = exchange_clipped_blocks(raw, [0] * len(raw), spec_slots)
    assert [c.tolist() for c in clipped] == [list(g) for g in case.request.d_ids]
    request = Request(
        case.request.num_tokens,
        case.request.p_ids,
        [c.tolist() for c in clipped],
        case.request.prefix_blocks,
        case.request.prefill_tokens,
    )
    try:
        report = case.pair.run(request)
    except KvgeomError:
        reject()
    assert report.ok, f"{case}\n{report}"
