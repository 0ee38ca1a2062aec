"""A plan made without the request's token counts never moves wrong bytes (issue 22, finding 6).

No block list tells where a prefix hit left D's list, and a pair made without prefix caching (the default)
is no proof that there was none: before, a call without ``num_tokens`` placed D's list at token 0 and, in
both modes, moved P's tokens into the wrong D slots (a prefix hit on D with a block-size ratio; P kernel
blocks that D's do not divide). Now every call whose local list holds attention blocks needs
``num_tokens`` and is refused without it, with a :class:`~kvgeom.errors.TokenCountError` naming it.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import event, given
from hypothesis import strategies as st

from kvgeom import KvgeomError, TokenCountError, UnsupportedError
from kvgeom.layout.engine import EngineConfig
from kvgeom.model.layers import AttentionSpec, MLASpec
from kvgeom.model.spec import ModelSpec
from kvgeom.testing import RankPlan, Request, engine_geometries, pull_plans, push_plans, run_plans
from kvgeom.testing import strategies as kst

GQA = ModelSpec.from_layers("gqa", [AttentionSpec(2, 2, "float16")] * 2)
MLA = ModelSpec.from_layers("mla", [MLASpec(4, "float16")])


def _engine(block: int, kernel: int | None = None) -> EngineConfig:
    return EngineConfig(tp_size=1, block_size=block, kernel_block_size=kernel, num_blocks=8)


# name -> (model, P engine, D engine, request, compat, what the with-counts plan does: "ok" or the error)
SILENT = {
    # D blocks of 8 from P blocks of 4 (block-size ratio 2); 17 tokens, D's first block cached, P computed
    # 16: D's list [1, 2] holds tokens 8..23, not 0..15
    "prefix hit on D with a block-size ratio": (
        GQA,
        _engine(4),
        _engine(8),
        Request(17, [[0, 1, 2, 3]], [[1, 2]], prefix_blocks=1, prefill_tokens=16),
        "kvgeom",
        "ok",
    ),
    "prefix hit on D with a block-size ratio (vllm)": (
        GQA,
        _engine(4),
        _engine(8),
        Request(17, [[0, 1, 2, 3]], [[1, 2]], prefix_blocks=1, prefill_tokens=16),
        "vllm",
        UnsupportedError,  # vLLM pairs these by count and would move the wrong tokens
    ),
    # P kernel blocks of 8 that D's kernel blocks of 4 do not divide: 16 tokens, D's first block cached
    "P kernel block that does not divide D's": (
        MLA,
        _engine(8),
        _engine(4),
        Request(16, [[0, 1]], [[1, 2, 3]], prefix_blocks=1),
        "kvgeom",
        "ok",
    ),
    # P logical blocks of 3 kernel blocks, D's of 2 (kernel 4 on both): 24 tokens, D's first block cached
    "prefix hit on D with other logical blocks": (
        MLA,
        _engine(12, 4),
        _engine(8, 4),
        Request(24, [[0, 1]], [[1, 2]], prefix_blocks=1),
        "kvgeom",
        "ok",
    ),
}


def _pull(name: str, request: Request | None = None, **tell: bool) -> list[RankPlan]:
    model, p, d, real, compat, _ = SILENT[name]
    return pull_plans(model, p, d, request or real, compat, prefix_caching=False, **tell)


@pytest.mark.parametrize("name", sorted(SILENT))
def test_a_pull_without_num_tokens_is_refused_naming_it(name: str) -> None:
    """The pair is made without prefix caching (the default), P's count is given, D's is not."""
    request = SILENT[name][3]
    with pytest.raises(TokenCountError) as err:
        _pull(name, tell_num_tokens=False, tell_prefill_tokens=True)
    assert err.value.field == "num_tokens"
    assert err.value.values == {"value": None, "group": 0, "blocks": len(request.d_ids[0])}
    with pytest.raises(TokenCountError):  # neither count given
        _pull(name, tell_num_tokens=False)


@pytest.mark.parametrize("name", sorted(SILENT))
def test_with_the_counts_kvgeom_plans_and_vllm_mode_refuses(name: str) -> None:
    model, p, d, request, _, outcome = SILENT[name]
    if outcome == "ok":
        report = run_plans(model, p, d, request, _pull(name))
        assert report.ok, str(report)
        assert report.bytes_moved > 0
    else:
        with pytest.raises(outcome) as err:
            _pull(name)
        assert err.value.field == "block_ids[0]"


@pytest.mark.parametrize("name", sorted(SILENT))
def test_the_placement_an_omitted_count_implied_moves_wrong_bytes(name: str) -> None:
    """What a call without ``num_tokens`` planned before: D's list read as starting at token 0, as if the
    request were the tokens D's list holds. Executed against the real request, P's tokens land in the wrong
    D slots (I2): the refusal above guards a real corruption, not a theoretical one."""
    model, p, d, real, _, _ = SILENT[name]
    held = len(real.d_ids[0]) * d.block_size
    implied = Request(held, real.p_ids, real.d_ids, 0, min(real.p_tokens, held))
    report = run_plans(model, p, d, real, _pull(name, implied))
    assert "I2" in report.invariants, str(report)


def _fields(plans: list[RankPlan]) -> list[tuple[bytes, bytes, list[tuple[list[int], int]]]]:
    return [
        (
            rp.plan.moves(rp.pairing).tobytes(),
            np.asarray(rp.plan.zero).tobytes(),
            [(r.blocks.tolist(), r.bsr) for r in rp.plan.regroup],
        )
        for rp in plans
    ]


def _places_attention(case: kst.Case) -> bool:
    """Whether the local side (D in pull, P in push) holds blocks of an attention group."""
    pull = case.pair.mode == "pull"
    geom = engine_geometries(case.pair.model, case.pair.d_engine if pull else case.pair.p_engine)[0]
    ids = case.request.d_ids if pull else case.request.p_ids
    return any(len(x) for x, one in zip(ids, geom.group_one_block) if not one)


@given(kst.cases(), st.booleans(), st.booleans())
def test_no_call_without_num_tokens_returns_another_plan(
    case: kst.Case, caching_told: bool, prefill_told: bool
) -> None:
    """Any pair, mode and request (prefix hits, the N-1 flow, block-size ratios, DCP, ...), the pair made
    with the request's prefix caching or without it (a caller that left the option out), P's count given
    or not: a call without ``num_tokens`` is refused with a TokenCountError exactly when the local list
    holds attention blocks; any plan it returns is the one the counts give, and passes the oracle."""
    pair, request = case.pair, case.request
    caching = pair.prefix_caching if caching_told else False
    make = pull_plans if pair.mode == "pull" else push_plans
    args = (pair.model, pair.p_engine, pair.d_engine, request, pair.compat, caching)
    omitted = {"tell_num_tokens": False, "tell_prefill_tokens": prefill_told}
    try:
        plans = make(*args, **omitted)
    except TokenCountError as exc:
        assert exc.field == "num_tokens" and exc.values["value"] is None
        assert _places_attention(case), f"{case}: refused, with no attention block to place"
        event("refused: num_tokens")
        return
    except KvgeomError as exc:  # refused for another reason: no bytes either
        event(f"refused: {type(exc).__name__} {exc.field}")
        return
    assert not _places_attention(case), f"{case}: planned attention blocks without num_tokens"
    assert _fields(plans) == _fields(make(*args)), f"{case}: another plan without num_tokens"
    report = run_plans(pair.model, pair.p_engine, pair.d_engine, request, plans, **omitted)
    assert report.ok, f"{case}\n{report}"
    event("planned: no attention block to place")
