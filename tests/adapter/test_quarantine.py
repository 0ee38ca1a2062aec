"""The quarantine's evidence, bound and guard (issue 22, findings 1 and 3), on real sockets and real NIXL
agents in this process.

* Death is positive evidence only: a generation probe that is refused (nothing listens) is
  :class:`PeerGone`; one reset, closed at accept (a flooded server), timed out or unroutable is
  :class:`PeerUnknown`, and ``settle()`` keeps holding on it (before: every ``OSError`` was ``PeerGone``
  and the blocks went back to the pool while the writer lived).
* The bound: an entry held past ``quarantine_bound_s`` is retired (reported, logged, counted), never
  handed back on time alone; positive evidence still returns it.
* The guard: the calls that take block ids refuse quarantined ones with a typed error."""

from __future__ import annotations

import errno
import logging
import socket
import struct
import threading
import time

import pytest

pytest.importorskip("torch")
pytest.importorskip("nixl")

from _inproc import AUTH, CONFIG, HOST, card  # noqa: E402
from _slack import SLACK_S, until  # noqa: E402
from kvgeom_nixl import (  # noqa: E402
    HandshakeTimeout,
    PeerGone,
    PeerUnknown,
    QuarantinedBlockError,
    SideChannelServer,
    query_generation,
)
from kvgeom_nixl.kvrank import KVRank  # noqa: E402

from kvgeom.errors import BlockIdError  # noqa: E402

pytestmark = pytest.mark.nixl

WRITER = ("prefill", 0)


class _Closer:
    """A listener that accepts each connection and closes it at once: with ``reset``, by an RST
    (``SO_LINGER`` 0), otherwise by a FIN (the client reads EOF)."""

    def __init__(self, reset: bool) -> None:
        self.sock = socket.socket()
        self.sock.bind((HOST, 0))
        self.sock.listen(16)
        self.sock.settimeout(0.05)
        self.port = self.sock.getsockname()[1]
        self.reset, self.accepted = reset, 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            self.accepted += 1
            if self.reset:
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            conn.close()

    def close(self) -> None:
        self.stop.set()
        self.thread.join(2.0)
        self.sock.close()


def _closed_port() -> int:
    s = socket.socket()
    s.bind((HOST, 0))
    port = s.getsockname()[1]
    s.close()  # never listened: a connect is refused
    return port


@pytest.mark.parametrize("reset", [False, True], ids=["eof", "reset"])
def test_a_probe_closed_or_reset_at_accept_is_unknown_not_gone(reset):
    closer = _Closer(reset)
    try:
        for _ in range(3):
            with pytest.raises(PeerUnknown) as ei:
                query_generation(HOST, closer.port, timeout_s=1.0, auth=AUTH)
            assert not isinstance(ei.value, PeerGone) and isinstance(ei.value, HandshakeTimeout)
            assert f"{HOST}:{closer.port}" in str(ei.value)
        assert closer.accepted >= 3
    finally:
        closer.close()


def test_only_a_refused_connection_is_gone():
    with pytest.raises(PeerGone, match="refused"):
        query_generation(HOST, _closed_port(), timeout_s=1.0, auth=AUTH)


def test_a_silent_server_is_unknown():
    """The kernel accepts, nobody answers (a stopped or overloaded process): the probe ends at its deadline
    as unknown, never gone. (A flooded side channel no longer closes newcomers at accept, see
    test_exposure.py; a server that does is the EOF/reset case above.)"""
    silent = socket.socket()
    silent.bind((HOST, 0))
    silent.listen(4)  # the kernel accepts, nobody answers
    try:
        t0 = time.monotonic()
        with pytest.raises(PeerUnknown):
            query_generation(HOST, silent.getsockname()[1], timeout_s=0.3, auth=AUTH)
        assert time.monotonic() - t0 < 2.0
    finally:
        silent.close()


_NO_ROUTE = """
import sys, time
sys.path.insert(0, sys.argv[1])
from kvgeom_nixl import Auth, PeerGone, PeerUnknown, query_generation
t0 = time.monotonic()
try:
    query_generation("10.77.9.9", 7000, timeout_s=2.0, auth=Auth(b"k" * 32))
except PeerUnknown as e:
    print("unknown", e.status, time.monotonic() - t0)
except PeerGone as e:
    print("gone", e.status, time.monotonic() - t0)
"""


def test_a_real_unreachable_route_is_unknown():
    """In a fresh network namespace (``unshare -n``: no interface up, so no packet leaves) every route is
    unreachable: ``connect`` fails with ENETUNREACH in about a millisecond. Before: PeerGone."""
    import subprocess
    import sys
    from pathlib import Path

    adapters = str(Path(__file__).resolve().parents[2] / "adapters")
    try:
        run = subprocess.run(
            ["unshare", "-n", sys.executable, "-c", _NO_ROUTE, adapters],
            capture_output=True,
            text=True,
            timeout=60,
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        pytest.skip(f"unshare -n unavailable: {e}")
    if run.returncode != 0 and "unshare" in run.stderr:
        pytest.skip(f"unshare -n not permitted here: {run.stderr.strip()[:200]}")
    verdict, status, seconds = run.stdout.split()
    assert (verdict, status) == ("unknown", "ENETUNREACH"), run.stdout + run.stderr
    assert float(seconds) < 1.0


@pytest.mark.parametrize("code", [errno.ENETUNREACH, errno.EHOSTUNREACH, errno.ECONNABORTED])
def test_an_unreachable_route_is_unknown(monkeypatch, code):
    """The route errors ``connect`` raises on a host whose route to the peer is gone, raised here
    without any traffic (the real one: above)."""

    def unreachable(*_a, **_k):
        raise OSError(code, "simulated route failure")

    monkeypatch.setattr(socket, "create_connection", unreachable)
    with pytest.raises(PeerUnknown) as ei:
        query_generation(HOST, 9, timeout_s=1.0, auth=AUTH)
    assert ei.value.status == errno.errorcode[code]


@pytest.fixture
def d_rank():
    kv = KVRank(card("decode", mode="push"), CONFIG)
    yield kv
    kv.close()


def _settle_until(kv: KVRank, cond, timeout_s: float) -> list:
    out: list = []
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        out += kv.settle()
        if cond(out):
            break
        time.sleep(0.02)
    return out


def test_settle_keeps_holding_while_the_writer_is_unknown_and_frees_on_refusal(d_rank):
    """Finding 1 at the rank: the writer's side channel closes every connection at accept (as a flooded
    server did), so every probe fails. Before: the failed probe was PeerGone and settle() returned the
    blocks at once. Now they stay held; once nothing listens on the port any more, they are returned,
    cleared by the writer's death."""
    kv = d_rank
    closer = _Closer(reset=True)
    kv.watch("prefill", {0: closer.port})
    kv.fence.hold(("r1", 1), [[3, 4, 5]], writers=[WRITER], reason="test")
    try:
        early = _settle_until(kv, lambda out: kv.stats["probes_unknown"] >= 3, 10.0)
        assert early == [] and kv.stats["probes_unknown"] >= 3, kv.stats
        assert [h.token for h in kv.quarantined()] == [("r1", 1)]
    finally:
        closer.close()
    out = _settle_until(kv, bool, 10.0)
    assert [(s.request_id, s.attempt, s.cleared_by) for s in out] == [("r1", 1, ("prefill:0 gone",))]
    assert kv.quarantined() == []


def test_another_incarnation_on_the_writers_port_is_evidence_and_the_same_one_is_not(d_rank):
    """A writer's process is gone when a holder of the secret answers on its port as another
    incarnation (a restarted rank on a fixed port): its blocks are returned. While the incarnation it was
    known by answers (alive, just late), they stay held, however often it is asked."""
    kv = d_rank
    first = SideChannelServer(HOST, 0, None, auth=AUTH, incarnation=b"A" * 16).start()
    port = first.port
    kv.watch("prefill", {0: port})
    kv.fence.hold(("r1", 1), [[3, 4, 5]], writers=[WRITER], reason="test")
    try:
        held = _settle_until(kv, lambda out: first.stats["served"] >= 3, 10.0)
        assert held == [] and first.stats["served"] >= 3, first.stats
        assert [h.token for h in kv.quarantined()] == [("r1", 1)]
        assert kv.stats["probes_new_incarnation"] == 0
    finally:
        first.close()
    second = SideChannelServer(HOST, port, None, auth=AUTH, incarnation=b"B" * 16).start()
    try:
        out = _settle_until(kv, bool, 10.0)
    finally:
        second.close()
    assert [(s.request_id, s.attempt, s.cleared_by) for s in out] == [("r1", 1, ("prefill:0 gone",))]
    # the server counts a reply after sending it: wait (bounded) for the probe's to be counted
    assert kv.stats["probes_new_incarnation"] == 1 and until(lambda: second.stats["served"] >= 1)
    assert kv.quarantined() == []


class _StuckTransfer:
    """A recording double of one of our transfers that never ends on its own: under load a READ of 708
    descriptors over UCX's TCP stayed ``PROC`` for the whole 120 s bound, its producer's death included
    (docs/reliability.md)."""

    def __init__(self, peer: str) -> None:
        self.peer, self.live, self.abandoned = peer, True, 0

    def poll(self) -> str:
        return "PROC"

    def abandon(self) -> None:
        self.live, self.abandoned = False, self.abandoned + 1


def test_our_transfer_ends_when_its_peer_is_proven_gone_and_not_before(d_rank):
    """A pulled attempt's READ that never ends: while its producer's side channel answers, the blocks
    stay held however often settle() runs; once the producer's port refuses (its process is gone), the
    READ towards it ends (released after a drain), the other peer's does not, and the blocks come back."""
    kv = d_rank
    srv = SideChannelServer(HOST, 0, None, auth=AUTH, incarnation=b"A" * 16).start()
    other = SideChannelServer(HOST, 0, None, auth=AUTH, incarnation=b"C" * 16).start()
    kv.watch("prefill", {0: srv.port, 1: other.port})
    dead, alive = _StuckTransfer("prefill-0-agent"), _StuckTransfer("prefill-1-agent")
    peers = {WRITER: "prefill-0-agent", ("prefill", 1): "prefill-1-agent"}
    kv.fence.hold(("r1", 1), [[3, 4, 5]], transfers=[dead], peers=peers, reason="test")
    kv.fence.hold(("r2", 1), [[6, 7]], transfers=[alive], peers=peers, reason="test")
    try:
        held = _settle_until(kv, lambda _: srv.stats["served"] >= 3, 10.0)
        assert held == [] and (dead.abandoned, alive.abandoned) == (0, 0)
        srv.close()
        out = _settle_until(kv, bool, 10.0)
        assert [(s.request_id, s.attempt, s.ids, s.cleared_by) for s in out] == [
            ("r1", 1, [[3, 4, 5]], ("prefill:0 gone",))
        ]
        assert (dead.abandoned, alive.abandoned) == (1, 0)
        assert [h.token for h in kv.quarantined()] == [("r2", 1)]
    finally:
        srv.close()
        other.close()


def test_a_rank_announces_its_process_incarnation_in_every_greeting():
    """What the evidence above rests on: a rank's side channel answers as the incarnation its sealed
    payload names, the same across a rebind of its server (same process), another for another process."""
    from kvgeom_nixl.sidechannel import probe

    a = KVRank(card("prefill"), CONFIG)
    b = KVRank(card("prefill"), CONFIG)
    try:
        seen = probe(HOST, a.port, timeout_s=5.0, auth=AUTH).incarnation
        assert seen == bytes.fromhex(a.payload()["incarnation"]) and len(seen) == 16
        assert probe(HOST, b.port, timeout_s=5.0, auth=AUTH).incarnation != seen
        a.rebind(HOST)  # a new server and agent, the same process
        assert probe(HOST, a.port, timeout_s=5.0, auth=AUTH).incarnation == seen
    finally:
        a.close()
        b.close()


def test_quarantined_ids_are_refused_where_they_enter(d_rank):
    kv = d_rank
    kv.fence.hold(("r1", 1), [[3, 4, 5]], writers=[WRITER], reason="test")
    producer = card("prefill", mode="push")
    calls = {
        "pull": lambda ids: kv.pull("prefill", ids, [[1, 2]], "r2", "r2", num_tokens=20),
        "wait_received": lambda ids: kv.wait_received(producer, ids, [[1, 2]], "r2", timeout_s=0.1),
        "invalidate": lambda ids: kv.invalidate(ids),
        "push": lambda ids: kv.push("prefill", ids, [[1, 2]], "r2", "r2", num_tokens=20),
    }
    for name, call in calls.items():
        with pytest.raises(QuarantinedBlockError) as ei:
            call([[9, 4]])
        err = ei.value
        assert isinstance(err, BlockIdError) and isinstance(err, ValueError)
        assert err.field == ("ids" if name == "invalidate" else "local_ids"), name
        assert err.values["ids"] == [4] and err.values["held_by"] == ("r1", 1), err.values
        assert "'r1'" in str(err) and "[4]" in str(err), str(err)
    assert kv.invalidate([[9, 10]]) > 0  # ids nobody holds pass
    assert [h.token for h in kv.quarantined()] == [("r1", 1)]  # a refusal quarantines nothing new
    assert kv.fence.owner([[3]])[1] == [3]


def test_an_entry_past_the_bound_is_retired_reported_and_returned_only_on_evidence(caplog):
    cfg = CONFIG.__class__(**{**CONFIG.__dict__, "quarantine_bound_s": 0.3})
    server = SideChannelServer(HOST, 0, None, auth=AUTH).start()  # the writer is alive and answers
    kv = KVRank(card("decode", mode="push"), cfg)
    try:
        kv.watch("prefill", {0: server.port})
        kv.fence.hold(("r1", 1), [[3, 4, 5]], writers=[WRITER], reason="NotifTimeout: test")
        with caplog.at_level(logging.WARNING, logger="kvgeom_nixl.kvrank"):
            out = _settle_until(kv, lambda _: kv.retired(), 10.0)
        assert out == [] and [h.token for h in kv.retired()] == [("r1", 1)]
        assert kv.stats["retired"] == 1 and kv.stats["retired_blocks"] == 3, kv.stats
        [rec] = [r for r in caplog.records if "retired 3 block(s)" in r.getMessage()]
        assert "'r1'" in rec.getMessage() and "prefill:0" in rec.getMessage()
        assert _settle_until(kv, bool, 1.0) == []  # time alone never hands them back
        with pytest.raises(QuarantinedBlockError, match="retired") as ei:
            kv.invalidate([[5]])
        assert ei.value.values["retired"] is True
        kv.fence.clear_writer(("r1", 1), WRITER, "late W")  # what the writer's late notice does
        [s] = _settle_until(kv, bool, 5.0)
        assert s.retired and s.cleared_by == ("prefill:0 late W",)
        assert kv.stats["retired_blocks"] == 0 and kv.stats["retired"] == 1
    finally:
        kv.close()
        server.close()


def _stop_listening(srv: SideChannelServer) -> None:
    """The server's port refuses fresh connects while its process, its accept thread and its sessions
    live on (``shutdown`` of a listening socket unhashes it; the port stays bound): what a live but
    flooded server was measured to do to some connects (docs/reliability.md)."""
    srv._sock.shutdown(socket.SHUT_RD)


def test_refusals_while_the_writers_session_answers_are_no_evidence(d_rank):
    """Issue 22, the refusals of a live, flooded server: fresh connects to the writer's port are refused,
    but the writer lives and its kept-open session answers. Before (a new connection per probe, one
    refusal = gone): the first probe after the refusals began released the blocks. Now the probes go over
    the session, and the blocks stay held however long the port refuses."""
    kv = d_rank
    srv = SideChannelServer(HOST, 0, None, auth=AUTH).start()
    kv.watch("prefill", {0: srv.port})
    kv.fence.hold(("r1", 1), [[3, 4, 5]], writers=[WRITER], reason="test")
    try:
        assert _settle_until(kv, lambda _: srv.stats["session_queries"] >= 2, 10.0) == []
        _stop_listening(srv)
        with pytest.raises(PeerGone):  # a fresh connection is refused now
            query_generation(HOST, srv.port, timeout_s=1.0, auth=AUTH)
        asked = srv.stats["session_queries"]
        held = _settle_until(kv, lambda _: srv.stats["session_queries"] >= asked + 6, 3 * 1.0 + 10.0)
        assert held == [] and srv.stats["session_queries"] >= asked + 6, srv.stats
        assert [h.token for h in kv.quarantined()] == [("r1", 1)]
        assert kv.stats["probes_refused"] == 0 and srv.stats["sessions_opened"] == 1, (kv.stats, srv.stats)
    finally:
        srv.close()


def test_a_refusal_is_gone_only_when_it_lasts_gone_refused_s(d_rank):
    """No session (the writer's port refuses from the start, then answers, then refuses for good): a
    streak of refusals shorter than ``gone_refused_s`` is no evidence, an answer ends it, and the blocks
    come back only after every probe for ``gone_refused_s`` (at least 3 probes) was refused."""
    kv = d_rank
    bound = kv.config.gone_refused_s
    hold = socket.socket()  # bound, not listening: every connect is refused, and the port stays ours
    hold.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    hold.bind((HOST, 0))
    port = hold.getsockname()[1]
    kv.watch("prefill", {0: port})
    kv.fence.hold(("r1", 1), [[3, 4, 5]], writers=[WRITER], reason="test")
    t0 = time.monotonic()
    early = _settle_until(kv, lambda _: time.monotonic() - t0 > bound / 2, 10.0)
    assert early == [] and kv.stats["probes_refused"] >= 1, kv.stats
    hold.close()
    srv = SideChannelServer(HOST, port, None, auth=AUTH).start()
    try:
        assert _settle_until(kv, lambda _: srv.stats["session_queries"] >= 1, 10.0) == []
        assert _settle_until(kv, bool, bound) == []  # the answer ended the streak: still held
    finally:
        srv.close()
    t_gone = time.monotonic()
    refused = kv.stats["probes_refused"]
    out = _settle_until(kv, bool, bound + 10.0)
    assert [(s.request_id, s.attempt, s.cleared_by) for s in out] == [("r1", 1, ("prefill:0 gone",))]
    assert bound <= time.monotonic() - t_gone < bound + 1.0 + SLACK_S
    assert kv.stats["probes_refused"] - refused >= 3, kv.stats
