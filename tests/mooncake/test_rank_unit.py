"""MooncakeRank's checks and failure paths on a recording engine (no transfer engine, no network): sealed
payloads, typed refusals naming the field, a failed batch zeroing the request's blocks and nothing else,
a late batch quarantining them until it ends."""

from __future__ import annotations

from concurrent.futures import Future

import kvgeom_mooncake.rank as rank_mod
import numpy as np
import pytest
from _transport_ranks import scenario
from kvgeom_mooncake import (
    MooncakeConfig,
    MooncakeRank,
    PeerRefused,
    QuarantinedBlockError,
    TransferFailed,
    TransferTimeout,
    block_spans,
)

from kvgeom import KvgeomError
from kvgeom.tools.scenario import Scenario

SECRET = "kvgeom-rank-unit-secret-0123456789"


class _Engine:
    """Records batches; each returns ``status`` at once, or stays running until ``finish()``."""

    status = 0
    hold = False
    running: list[Future] = []
    n = 0

    def __init__(self, host: str = "127.0.0.1", protocol: str = "tcp") -> None:
        _Engine.n += 1
        self.session = f"{host}:{30000 + _Engine.n}"
        self.registered: list[tuple[int, int]] = []
        self.posted = self.descriptors = 0

    def register(self, addr: int, nbytes: int) -> None:
        self.registered.append((addr, nbytes))

    def start(self, op, session, local, remote, lengths, notify=None) -> Future:
        f: Future = Future()
        if _Engine.hold:
            _Engine.running.append(f)
        else:
            f.set_result(_Engine.status)
        return f

    def notifications(self) -> list:
        return []

    def close(self) -> None:
        pass

    @staticmethod
    def finish(result: int = 0) -> None:
        for f in _Engine.running:
            f.set_result(result)
        _Engine.running = []


@pytest.fixture
def ranks(monkeypatch):
    monkeypatch.setattr(rank_mod, "Engine", _Engine)
    _Engine.status, _Engine.hold, _Engine.running = 0, False, []
    sc = Scenario.from_json(scenario("pull"))
    cfg = MooncakeConfig(secret=SECRET, transfer_timeout_s=0.2)
    ps = [MooncakeRank(c, cfg) for c in sc.cards("prefill")]
    d = MooncakeRank(sc.cards("decode")[0], cfg)
    return sc, d, ps


def _ids(sc: Scenario, tokens: int = 300):
    from _transport_ranks import Blocks

    b = Blocks(sc, seed=11)
    return b.take("decode", tokens), b.take("prefill", tokens)


def _seal(rank: MooncakeRank, body: dict) -> dict:
    body = {k: v for k, v in body.items() if k != "tag"}
    return {**body, "tag": rank._tag(rank_mod._canon(body))}


def test_a_secret_is_required() -> None:
    with pytest.raises(KvgeomError) as e:
        MooncakeConfig().key()
    assert e.value.field == "secret"
    assert MooncakeConfig(insecure=True).key()


def test_payloads_are_checked(ranks) -> None:
    sc, d, ps = ranks
    good = {p.rank: p.payload() for p in ps}
    forged = {**good, 1: dict(good[1], session="10.0.0.9:1")}  # changed after sealing
    with pytest.raises(PeerRefused):
        d.connect("prefill", forged)
    other = MooncakeRank(sc.cards("prefill")[0], MooncakeConfig(secret="another-deployment-secret-000"))
    with pytest.raises(PeerRefused):
        d.connect("prefill", {**good, 0: other.payload()})
    swapped = {0: good[1], 1: good[0]}
    with pytest.raises(PeerRefused):
        d.connect("prefill", swapped)
    lying = {**good, 0: _seal(d, dict(good[0], regions=[[a, n - 1] for a, n in good[0]["regions"]]))}
    with pytest.raises(PeerRefused):
        d.connect("prefill", lying)
    assert "prefill" not in d.pairings  # nothing of a refused handshake is kept
    d.connect("prefill", good)
    assert set(d.links["prefill"]) == {0, 1}


def test_a_failed_batch_zeroes_the_requests_blocks_only(ranks) -> None:
    sc, d, ps = ranks
    d.connect("prefill", {p.rank: p.payload() for p in ps})
    d_ids, p_ids = _ids(sc)
    for a in d.arrays:
        a[:] = 7
    _Engine.status = -1
    with pytest.raises(TransferFailed) as e:
        d.pull("prefill", d_ids, p_ids, "r1", num_tokens=300)
    assert e.value.stage == "wait" and e.value.status == -1
    inside = [np.zeros(a.size, bool) for a in d.arrays]
    for r, o, n in block_spans(d.card.geometry, d_ids).tolist():
        inside[r][o : o + n] = True
    for a, m in zip(d.arrays, inside):
        assert (a[m] == 0).all() and (a[~m] == 7).all()
    assert d.quarantined() == []  # nothing still running: free at once


def test_a_late_batch_holds_its_blocks_until_it_ends(ranks) -> None:
    sc, d, ps = ranks
    d.connect("prefill", {p.rank: p.payload() for p in ps})
    d_ids, p_ids = _ids(sc)
    _Engine.hold = True
    with pytest.raises(TransferTimeout):
        d.pull("prefill", d_ids, p_ids, "r2", num_tokens=300)
    assert [h.token for h in d.quarantined()] == [("r2", 1)]
    with pytest.raises(QuarantinedBlockError) as e:
        d.pull("prefill", d_ids, p_ids, "r3", num_tokens=300)
    assert e.value.field == "local_ids" and e.value.values["held_by"] == ("r2", 1)
    assert d.settle() == []
    for a in d.arrays:
        a[:] = 9  # late bytes land
    _Engine.finish(0)
    assert [h.token for h in d.settle()] == [("r2", 1)]
    for r, o, n in block_spans(d.card.geometry, d_ids).tolist():
        assert not d.arrays[r][o : o + n].any()  # zeroed again when given back
    _Engine.hold = False
    assert d.pull("prefill", d_ids, p_ids, "r3", num_tokens=300).ok


def test_bad_input_is_a_typed_error(ranks) -> None:
    sc, d, ps = ranks
    d.connect("prefill", {p.rank: p.payload() for p in ps})
    d_ids, p_ids = _ids(sc)
    with pytest.raises(KvgeomError) as e:
        d.pull("prefill", d_ids, p_ids, "", num_tokens=300)
    assert e.value.field == "request_id"
    with pytest.raises(KvgeomError) as e:
        d.pull("prefill", d_ids, p_ids, "r4")  # attention blocks without num_tokens
    assert e.value.field == "num_tokens"
    with pytest.raises(KvgeomError) as e:
        d.invalidate([[10**6]] + [[0]] * (len(d_ids) - 1))
    assert e.value.field == "ids"


def _push_pair(monkeypatch):
    monkeypatch.setattr(rank_mod, "Engine", _Engine)
    _Engine.status, _Engine.hold, _Engine.running = 0, False, []
    sc = Scenario.from_json(scenario("push", p_kernel=16))
    cfg = MooncakeConfig(secret=SECRET, transfer_timeout_s=0.2, notif_timeout_s=0.3)
    ps = [MooncakeRank(c, cfg) for c in sc.cards("prefill")]
    d = MooncakeRank(sc.cards("decode")[0], cfg)
    return sc, d, ps


def test_push_notices_are_authenticated(monkeypatch) -> None:
    sc, d, ps = _push_pair(monkeypatch)
    d.watch("prefill", {p.rank: p.payload() for p in ps})
    d_ids, p_ids = _ids(sc)
    sent: list[tuple[str, str]] = []
    for p in ps:
        p.connect("decode", {0: d.payload()}, mode="push")
        plan, bs = p.plan("decode", p_ids, d_ids, "r5", 300)
        assert [b.remote_rank for b in bs] == [0]
        sent.append((p.session, p._notice("W", "r5", 1, plan.expected_notifications, d.session)))
    forged = [(ps[0].session, sent[0][1][:-1] + ("0" if sent[0][1][-1] != "0" else "1"))]  # one tag digit off
    impostor = [("10.0.0.9:1", sent[1][1])]  # rank 1's notice from a session its payload did not announce
    inbox = forged + impostor
    monkeypatch.setattr(d.engine, "notifications", lambda: [inbox.pop(0)] if inbox else [])
    producer = sc.cards("prefill")[0]
    with pytest.raises(rank_mod.NotifTimeout):
        d.wait_received(producer, d_ids, p_ids, "r5", num_tokens=300)
    assert d.stats["rejected_notices"] == 2
    assert [h.token for h in d.quarantined()] == [("r5", 1)]  # a writer may still write: held
    assert d.settle() == []  # no batch of ours: only release() gives them back
    assert d.release("r5", 1).token == ("r5", 1) and d.quarantined() == []
    # the next attempt, with both writers' genuine notices: received, then the receive step
    inbox[:] = [(p.session, p._notice("W", "r5", 2, 1, d.session)) for p in ps]
    res = d.wait_received(producer, d_ids, p_ids, "r5", num_tokens=300, attempt=2)
    assert res.ok and res.attempt == 2 and d.stats["rejected_notices"] == 2


def test_hostile_notices_and_payloads_are_refused_not_raised(monkeypatch) -> None:
    sc, d, ps = _push_pair(monkeypatch)
    with pytest.raises(PeerRefused):
        d.watch("prefill", {0: {"tag": "é"}})  # no fields, a non-ASCII tag
    body = "W|prefill|x|r6|y|1"
    inbox = [
        ("s", "not a notice"),
        ("s", "W|a|b"),
        ("s", body + "|" + "ü" * 32),
        (
            "s",
            body + "|" + d._tag(f"{body}|{d.session}".encode())[:32],
        ),  # tagged, rank and attempt not numbers
    ]
    monkeypatch.setattr(d.engine, "notifications", lambda: [inbox.pop(0)] if inbox else [])
    d_ids, p_ids = _ids(sc)
    with pytest.raises(rank_mod.NotifTimeout):  # none of them counted as a writer's notice
        d.wait_received(sc.cards("prefill")[0], d_ids, p_ids, "r6", num_tokens=300)
    assert d.stats["rejected_notices"] == 4


def test_a_late_notice_of_a_held_attempt_clears_its_writer(monkeypatch) -> None:
    """Push, D: rank 1's W notice comes after D's deadline. Before: counted and dropped, the blocks held
    until the deployment's release(); now the notice (delivered after the batch's bytes) clears rank 1,
    and settle() gives the blocks back zeroed. A notice of the attempt from the rank that had already
    notified clears nothing; a writer that stays silent keeps the blocks held."""
    sc, d, ps = _push_pair(monkeypatch)
    d.watch("prefill", {p.rank: p.payload() for p in ps})
    d_ids, p_ids = _ids(sc)
    note = {p.rank: (p.session, p._notice("W", "r7", 1, 1, d.session)) for p in ps}
    inbox = [note[0]]  # rank 0 notifies in time, rank 1 does not
    monkeypatch.setattr(d.engine, "notifications", lambda: [inbox.pop(0)] if inbox else [])
    producer = sc.cards("prefill")[0]
    with pytest.raises(rank_mod.NotifTimeout):
        d.wait_received(producer, d_ids, p_ids, "r7", num_tokens=300)
    (held,) = d.quarantined()
    assert held.token == ("r7", 1) and held.writers == {("prefill", 1)}
    for a in d.arrays:
        a[:] = 7  # the late WRITE's bytes land in the held blocks
    inbox[:] = [note[0]]  # rank 0 again: not an awaited writer
    assert d.settle() == [] and d.stats["late_notices"] == 1
    inbox[:] = [note[1]]
    (back,) = d.settle()
    assert back.token == ("r7", 1) and back.cleared_by == ["prefill:1 late W"]
    assert d.quarantined() == [] and d.stats["late_notices"] == 2
    rows = block_spans(sc.cards("decode")[0].geometry, d_ids)
    assert len(rows) and all(not d.arrays[r][o : o + n].any() for r, o, n in rows.tolist())  # zeroed again
    with pytest.raises(rank_mod.NotifTimeout):  # attempt 2: rank 1 silent, nothing clears it
        d.wait_received(producer, d_ids, p_ids, "r7", num_tokens=300, attempt=2, timeout_s=0.05)
    assert d.settle() == [] and [h.token for h in d.quarantined()] == [("r7", 2)]
