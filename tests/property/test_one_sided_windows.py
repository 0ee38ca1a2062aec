"""A sliding window on one side only (or windows of different sizes) is refused at the handshake, in
both directions, modes and compat settings: the two sides would hold different tokens of that layer.
(Mutation testing showed that dropping the sliding-window comparison changed no test's result.)"""

from __future__ import annotations

from dataclasses import replace

from hypothesis import event, given

from kvgeom import IncompatiblePairError, KvgeomError, Pairing, card_of
from kvgeom.spec import ModelSpec
from kvgeom.testing.strategies import PDPair, one_sided_windows


@given(one_sided_windows())
def test_a_window_on_one_side_only_is_refused(drawn: tuple[PDPair, ModelSpec, ModelSpec]) -> None:
    pair, p_model, d_model = drawn
    assert p_model != d_model
    local_role, remote_role = ("decode", "prefill") if pair.mode == "pull" else ("prefill", "decode")
    local_model, remote_model = (d_model, p_model) if pair.mode == "pull" else (p_model, d_model)
    local_engine, remote_engine = (
        (pair.d_engine, pair.p_engine) if pair.mode == "pull" else (pair.p_engine, pair.d_engine)
    )
    try:
        local = card_of(local_role, local_model, replace(local_engine, tp_rank=0), mode=pair.mode)
        remotes = {
            r: card_of(remote_role, remote_model, replace(remote_engine, tp_rank=r), mode=pair.mode)
            for r in range(remote_engine.tp_size)
        }
        for card in (local, *remotes.values()):
            card.geometry  # noqa: B018 - derived lazily: an invalid side fails here, on its own
    except KvgeomError:
        event("one side invalid on its own")
        return  # the other window makes one side's geometry invalid on its own: refused before any pairing
    try:
        Pairing.create(local, remotes, mode=pair.mode, compat=pair.compat, prefix_caching=pair.prefix_caching)
    except IncompatiblePairError as exc:
        event("refused at the handshake")
        assert exc.field == "model", exc
        assert "sliding_window" in str(exc) or "kind" in str(exc), exc
    else:
        raise AssertionError(f"accepted a pair whose sides differ in one layer's window: {pair}")
