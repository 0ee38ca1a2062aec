"""CSA-linear models (rings overlaid on MLA pages, a sharded SSM state and a TP-replicated state page,
docs/vllm-behaviour.md B.6.14): every pair the strategies draw (equal block geometry, any TP sizes, pull and
push, both modes, prefix hits, the N-1 flow) is accepted at handshake, kvgeom mode plans every request, and
every plan passes the byte oracle (packed rows too, across TP sizes in kvgeom mode); vLLM mode may refuse a request where vLLM would move wrong bytes (the
N-1 flow after a prefix hit on a block boundary, support-matrix.md). Profiles: ``conftest.py`` (this test
runs a fifth of the profile's examples)."""

from __future__ import annotations

from hypothesis import event, given, reject, settings
from hypothesis import strategies as st

from kvgeom import KvgeomError
from kvgeom.testing import strategies as kst

_EXAMPLES = max(10, settings().max_examples // 5)


@settings(max_examples=_EXAMPLES)
@given(st.data())
def test_csa_linear_plans_pass_the_oracle(data: st.DataObject) -> None:
    case = data.draw(kst.cases(models=kst.model_specs(("csa-linear",))))
    pair, request = case.pair, case.request
    event(f"class: {kst.plannable_class(pair)}")
    event(f"{pair.mode}/{pair.compat} P TP{pair.p_engine.tp_size} -> D TP{pair.d_engine.tp_size}")
    if request.prefix_blocks:
        event("prefix hit")
    if request.p_tokens < request.num_tokens:
        event("N-1 flow")
    if pair.p_engine.ppl > 1:
        event("kernel < logical block")
    if pair.p_engine.packed_rows:
        event(
            f"packed rows ({'equal' if pair.p_engine.tp_size == pair.d_engine.tp_size else 'different'} TP)"
        )
    try:
        report = case.run()
    except KvgeomError as exc:
        if pair.compat == "kvgeom":
            raise
        event(f"vllm mode refused: {exc.field}")
        reject()
    assert report.ok, f"{case}\n{report}"
