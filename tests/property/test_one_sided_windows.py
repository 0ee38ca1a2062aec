"""A sliding window on one side only (or windows of different sizes) is refused at the handshake, in
both directions, modes and compat settings: the two sides would hold different tokens of that layer.
(Mutation testing showed that dropping the sliding-window comparison changed no test's result.)"""

from __future__ import annotations

from hypothesis import event, given

from kvgeom import IncompatiblePairError, KvgeomError
from kvgeom.model.spec import ModelSpec
from kvgeom.testing import engine_geometries
from kvgeom.testing.strategies import PDPair, check_geometries, one_sided_windows


@given(one_sided_windows())
def test_a_window_on_one_side_only_is_refused(drawn: tuple[PDPair, ModelSpec, ModelSpec]) -> None:
    pair, p_model, d_model = drawn
    assert p_model != d_model
    try:
        p_geoms, d_geoms = (
            engine_geometries(p_model, pair.p_engine),
            engine_geometries(d_model, pair.d_engine),
        )
    except KvgeomError:
        event("one side invalid on its own")
        return  # the other window makes one side's geometry invalid on its own: refused before any pairing
    try:
        check_geometries(p_geoms, d_geoms, pair.mode, pair.compat, pair.prefix_caching)
    except IncompatiblePairError as exc:
        event("refused at the handshake")
        assert exc.field == "model", exc
        assert "sliding_window" in str(exc) or "kind" in str(exc), exc
    else:
        raise AssertionError(f"accepted a pair whose sides differ in one layer's window: {pair}")
