"""Side channel alone: in-process server threads and clients, no NIXL. Every call is authenticated
with ``AUTH``; the attacks on the side channel (issue 8 items 3, 8, 9) are in ``test_hostile.py``."""

from __future__ import annotations

import os
import socket
import threading
import time

import numpy as np
import pytest
from _slack import until
from kvgeom_nixl import (
    AdapterError,
    Auth,
    AuthenticationError,
    HandshakeTimeout,
    PeerGone,
    ProtocolError,
    ReplayError,
    Session,
    SideChannelServer,
    StaleMetadata,
    check_generation,
    fetch,
    make_payload,
    query_generation,
    seal_payload,
)
from kvgeom_nixl.sidechannel import MAX_MESSAGE_BYTES, _check_reply, _dumps, _recv_frame, decode, encode
from kvgeom_nixl.wire import (
    GREETING_BYTES,
    PREAMBLE_BYTES,
    make_request,
    parse_greeting,
    parse_preamble,
    serve_request,
)

HOST = "127.0.0.1"
AUTH = Auth(b"side-channel-test-secret-0123")


def _payload(name: str = "P", gen: int = 1, md: bytes = b"\x00md\xff" * 10) -> dict:
    return make_payload(
        engine_id="eng-" + name,
        rank=3,
        agent_name=name,
        agent_metadata=md,
        card={"version": 1, "layers": [{"kind": "attn", "heads": 8}]},
        regions=[(2**47 + 4096, 1 << 30, 0), (2**63 + 5, 7, 1)],
        device_id=1,
        generation=gen,
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def test_encode_decode_roundtrip_bytes_nested_and_numpy():
    msg = {"a": b"\x00\x01", "b": [b"x", {"c": b""}], "n": np.int64(5), "arr": np.arange(3, dtype=np.uint64)}
    frame = encode(msg, AUTH)
    assert int.from_bytes(frame[:4], "big") == len(frame) - 4
    assert decode(frame[4 + 32 :]) == {"a": b"\x00\x01", "b": [b"x", {"c": b""}], "n": 5, "arr": [0, 1, 2]}


def test_decode_rejects_garbage():
    with pytest.raises(ProtocolError):
        decode(b"\xff\xfe")
    with pytest.raises(ProtocolError):
        decode(b"[1, 2]")
    with pytest.raises(ProtocolError):
        decode(b'{"x": {"$b64": "!!!"}}')


def test_get_exchange_and_generation():
    mine = _payload("D", gen=4, md=b"decode-md")
    with SideChannelServer(HOST, 0, _payload(), auth=AUTH) as server:
        got = fetch(HOST, server.port, timeout_s=2, auth=AUTH)
        assert got == _payload()
        assert got["regions"][1][0] == 2**63 + 5  # 64-bit addresses survive JSON
        assert query_generation(HOST, server.port, auth=AUTH) == 1
        assert fetch(HOST, server.port, mine, timeout_s=2, auth=AUTH) == _payload()
        assert server.wait_peer("D", timeout_s=1) == mine
        assert server.peers() == {"D": mine}
        assert check_generation(HOST, server.port, 1, auth=AUTH) == 1
        server.update(_payload(gen=2, md=b"new"))
        assert server.generation == 2
        with pytest.raises(StaleMetadata) as ei:
            check_generation(HOST, server.port, 1, auth=AUTH)
        assert (ei.value.expected, ei.value.seen) == (1, 2)
        assert fetch(HOST, server.port, timeout_s=2, auth=AUTH)["agent_metadata"] == b"new"


def test_many_concurrent_clients():
    with SideChannelServer(HOST, 0, _payload(), auth=AUTH) as server:
        out: list = []

        def client(i: int) -> None:
            out.append(fetch(HOST, server.port, _payload(f"D{i}"), timeout_s=5, auth=AUTH)["agent_name"])

        threads = [threading.Thread(target=client, args=(i,)) for i in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        assert out == ["P"] * 16
        assert set(server.peers()) == {f"D{i}" for i in range(16)}


def test_fetch_retries_until_peer_comes_up():
    port = _free_port()
    box: dict = {}

    def late_server() -> None:
        time.sleep(0.4)
        box["server"] = SideChannelServer(HOST, port, _payload(), auth=AUTH).start()

    t = threading.Thread(target=late_server)
    t.start()
    try:
        t0 = time.monotonic()
        assert fetch(HOST, port, timeout_s=5, auth=AUTH)["agent_name"] == "P"
        assert 0.3 < time.monotonic() - t0 < 3
    finally:
        t.join(5)
        if "server" in box:
            box["server"].close()


def test_nothing_listening_times_out_naming_the_address():
    port = _free_port()
    t0 = time.monotonic()
    with pytest.raises(HandshakeTimeout) as ei:
        fetch(HOST, port, timeout_s=0.5, auth=AUTH)
    assert 0.45 < time.monotonic() - t0 < 1.5
    assert f"{HOST}:{port}" in str(ei.value) and "ConnectionRefusedError" in str(ei.value)
    assert isinstance(ei.value, AdapterError) and isinstance(ei.value, RuntimeError)


@pytest.mark.parametrize("accepting", [False, True])
def test_peer_that_never_answers_times_out(accepting: bool):
    """A socket that listens but never accepts (backlog), or accepts and stays silent."""
    lsock = socket.socket()
    lsock.bind((HOST, 0))
    lsock.listen(8)
    port = lsock.getsockname()[1]
    held: list = []
    stop = threading.Event()

    def accept_and_hold() -> None:
        lsock.settimeout(0.05)
        while not stop.is_set():
            try:
                held.append(lsock.accept()[0])
            except OSError:
                pass

    t = threading.Thread(target=accept_and_hold, daemon=True)
    if accepting:
        t.start()
    try:
        t0 = time.monotonic()
        with pytest.raises(HandshakeTimeout):
            fetch(HOST, port, _payload("D"), timeout_s=0.6, auth=AUTH)
        assert 0.55 < time.monotonic() - t0 < 1.5
        with pytest.raises(HandshakeTimeout):
            query_generation(HOST, port, timeout_s=0.3, auth=AUTH)
    finally:
        stop.set()
        if accepting:
            t.join(2)
        for c in held:
            c.close()
        lsock.close()


def test_closed_server_means_peer_gone():
    server = SideChannelServer(HOST, 0, _payload(), auth=AUTH).start()
    port = server.port
    assert query_generation(HOST, port, auth=AUTH) == 1
    server.close()
    with pytest.raises(PeerGone):
        query_generation(HOST, port, timeout_s=1, auth=AUTH)


def test_bad_replies_are_protocol_errors():
    lsock = socket.socket()
    lsock.bind((HOST, 0))
    lsock.listen(8)
    port = lsock.getsockname()[1]
    replies = [b"\x00\x00\x00\x03abc", (MAX_MESSAGE_BYTES + 1).to_bytes(4, "big"), None]

    def serve() -> None:
        for r in replies:
            c, _ = lsock.accept()
            with c:
                if r is None:  # not a greeting of this protocol
                    c.sendall(b"\x00" * GREETING_BYTES)
                    continue
                serve_request(c, time.monotonic() + 2, 1 << 20)
                c.sendall(r)

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    try:
        for _ in replies:
            with pytest.raises(ProtocolError):
                fetch(HOST, port, timeout_s=2, auth=AUTH)
    finally:
        t.join(2)
        lsock.close()


def _raw(port: int, op: str, body: dict | None = None, auth: Auth = AUTH, **kw) -> dict:
    """One hand-made request (``kw``: ``nonce``, ``ts``); the decoded reply."""
    with socket.create_connection((HOST, port), timeout=2) as s:
        greeting = parse_greeting(s.recv(GREETING_BYTES, socket.MSG_WAITALL))
        data, _ = make_request(greeting, op, _dumps(body) if body is not None else b"", auth, **kw)
        s.sendall(data)
        _, reply = _recv_frame(s, time.monotonic() + 2, 1 << 20)
    return decode(reply)


def test_server_refuses_bad_requests_and_stays_up():
    with SideChannelServer(HOST, 0, _payload(), auth=AUTH) as server:
        for op, body, kw in (
            ("exchange", {"payload": 3}, {}),
            ("get", None, {"ts": time.time() - 3600}),
        ):
            reply = _raw(server.port, op, body, **kw)
            assert reply["ok"] is False and reply["error"], (op, kw)
        assert server.refusals[-1].field == "ts"
        # a client that sends garbage and hangs up does not disturb the server
        with socket.create_connection((HOST, server.port), timeout=2) as s:
            s.sendall(b"\xff\xff")
        with socket.create_connection((HOST, server.port), timeout=2) as s:  # a v2 request: not a preamble
            s.recv(GREETING_BYTES, socket.MSG_WAITALL)
            s.sendall(
                encode({"v": 2, "op": "get", "nonce": os.urandom(16).hex(), "ts": time.time()}, AUTH) * 2
            )
            s.settimeout(2)
            assert decode(_recv_frame(s, time.monotonic() + 2, 1 << 20)[1])["ok"] is False
        assert query_generation(HOST, server.port, auth=AUTH) == 1


def test_server_rejects_bad_payloads():
    with pytest.raises(TypeError):
        SideChannelServer(HOST, 0, {"generation": "1"}, auth=AUTH)
    with pytest.raises(TypeError):
        SideChannelServer(HOST, 0, {"x": object()}, auth=AUTH)
    with SideChannelServer(HOST, 0, _payload(), auth=AUTH) as server:
        with pytest.raises(TypeError):
            server.update({"generation": 1.5})
        assert server.generation == 1
        with pytest.raises(HandshakeTimeout):
            server.wait_peer("nobody", timeout_s=0.1)


# ------------------------------------------------------------------------------ replays (issue 22, finding 2)
def _capture(port: int, op: str, body: dict | None = None) -> tuple[bytes, dict]:
    """A genuine request to ``port`` as it went on the wire, and the reply it got."""
    with socket.create_connection((HOST, port), timeout=2) as s:
        greeting = parse_greeting(s.recv(GREETING_BYTES, socket.MSG_WAITALL))
        data, _ = make_request(greeting, op, _dumps(body) if body is not None else b"", AUTH)
        s.sendall(data)
        _, reply = _recv_frame(s, time.monotonic() + 2, 1 << 20)
    return data, decode(reply)


def _replay(port: int, data: bytes) -> tuple[bytes, bytes]:
    """Send captured bytes to ``port`` (after its greeting); the reply's ``(tag, body)``."""
    with socket.create_connection((HOST, port), timeout=2) as s:
        s.recv(GREETING_BYTES, socket.MSG_WAITALL)
        s.sendall(data)
        return _recv_frame(s, time.monotonic() + 2, 1 << 20)


def _refused(port: int, data: bytes, field: str) -> ReplayError:
    """Replay ``data`` to ``port``; the reply must refuse it for ``field``, as the client reads it too."""
    tag, body = _replay(port, data)
    nonce = parse_preamble(data[:PREAMBLE_BYTES]).nonce_hex
    with pytest.raises(ReplayError) as ei:
        _check_reply(f"{HOST}:{port}", nonce, tag, body, AUTH)
    assert ei.value.field == field and decode(body)["refused"] == field
    return ei.value


def test_request_replayed_to_another_server_sharing_the_secret_is_refused():
    """Issue 22, finding 2: a captured ``exchange`` (or ``generation``) request, refused by the server it
    was sent to, was accepted by another server with the same secret, which kept the stale payload as a
    peer. The tag now covers the destination (the server's incarnation and the connection's challenge)."""
    mine = _payload("D", gen=4, md=b"decode-md")
    with (
        SideChannelServer(HOST, 0, _payload("A"), auth=AUTH) as a,
        SideChannelServer(HOST, 0, _payload("B"), auth=AUTH) as b,
    ):
        exchange, reply = _capture(a.port, "exchange", {"payload": seal_payload(mine, AUTH)})
        generation, gen_reply = _capture(a.port, "generation")
        assert reply["ok"] is True and gen_reply["generation"] == 1 and set(a.peers()) == {"D"}
        for data in (exchange, generation):
            _refused(b.port, data, "incarnation")
            _refused(a.port, data, "challenge")  # and to the same server, on a new connection
        assert b.peers() == {} and set(a.peers()) == {"D"}
        err = b.refusals[-1]
        assert isinstance(err, ReplayError) and isinstance(err, AuthenticationError)
        assert (err.field, err.expected, err.seen) == (
            "incarnation",
            b.incarnation.hex(),
            a.incarnation.hex(),
        )
        assert (b.stats["refused_replay"], a.stats["refused_replay"], b.stats["served"]) == (2, 2, 0)


def test_request_captured_before_a_restart_is_refused_after_it():
    """Issue 22, finding 2: the used-nonce set lives in the process, so a server restarted on the same
    port (an empty set, inside the 60 s window) accepted a request captured before. A new server has a
    new incarnation: everything made for the old one is refused, whatever its nonce set holds."""
    old = SideChannelServer(HOST, 0, _payload("P"), auth=AUTH).start()
    port = old.port
    try:
        exchange, reply = _capture(port, "exchange", {"payload": seal_payload(_payload("D"), AUTH)})
        generation, _ = _capture(port, "generation")
        assert reply["ok"] is True
    finally:
        old.close()
    with SideChannelServer(HOST, port, _payload("P", gen=2), auth=AUTH) as new:
        assert new.incarnation != old.incarnation and new.started >= old.started
        for data in (exchange, generation):
            err = _refused(port, data, "incarnation")
        assert new.peers() == {} and new.stats["served"] == 0 and new.stats["refused_replay"] == 2
        assert (new.refusals[-1].expected, new.refusals[-1].seen) == (
            new.incarnation.hex(),
            old.incarnation.hex(),
        )
        assert query_generation(HOST, port, auth=AUTH) == 2  # a fresh request is served
    assert err.stage == "sidechannel"


def test_a_session_answers_every_freshness_check_on_one_connection():
    """What was left of issue 22 finding 1: the freshness check before each transfer opened a new
    connection, which a flood makes wait in the server's accept queue past its deadline. A :class:`Session`
    keeps one authenticated connection: later queries need no connect, see a new generation at once, and
    a session to a server that is gone reports :class:`PeerGone` (a new connection, refused)."""
    with SideChannelServer(HOST, 0, _payload("P", gen=3), auth=AUTH) as srv:
        with Session(HOST, srv.port, AUTH) as s:
            for _ in range(20):
                assert check_generation(HOST, srv.port, 3, 1.0, auth=AUTH, session=s) == 3
            srv.update(_payload("P", gen=4))
            with pytest.raises(StaleMetadata) as e:
                check_generation(HOST, srv.port, 3, 1.0, auth=AUTH, session=s)
            assert (e.value.expected, e.value.seen) == (3, 4)
            assert s.probe(1.0).incarnation == srv.incarnation
            assert (s.opened, s.queries) == (1, 22)
            # the server counts a query after sending its reply: wait (bounded) for it to count the last
            until(lambda: srv.stats["session_queries"] >= 22)
            assert (srv.stats["sessions_opened"], srv.stats["session_queries"]) == (1, 22)
            assert srv.stats["peak_pending"] == 1  # one connection ever waited for its preamble
            port = srv.port
        s = Session(HOST, port, AUTH)
        assert s.probe(1.0).generation == 4
    with pytest.raises(PeerGone):  # its connection is closed, and a new one is refused
        s.probe(1.0)
    s.close()


def test_a_session_request_is_good_once_and_only_with_the_secret():
    """Each session request names the challenge of the server's previous reply: a captured one, sent again
    on the same session or on a new connection, is refused (and the session closed); a session request
    without the secret is refused like any other; the server keeps at most ``max_sessions`` (least recently
    used closed first) and closes idle ones, and a :class:`Session` whose connection the server closed
    opens a new one within the same query."""
    with SideChannelServer(HOST, 0, _payload("P"), auth=AUTH, max_sessions=2, session_idle_s=0.5) as srv:
        with socket.create_connection((HOST, srv.port), timeout=2.0) as c:
            c.settimeout(2.0)
            greeting = parse_greeting(c.recv(GREETING_BYTES, socket.MSG_WAITALL))
            first, nonce = make_request(greeting, "session", b"", AUTH)
            c.sendall(first)
            tag, body = _recv_frame(c, time.monotonic() + 2.0, MAX_MESSAGE_BYTES)
            reply = _check_reply("srv", nonce.hex(), tag, body, AUTH)
            assert reply["generation"] == 1 and len(reply["challenge"]) == 16
            c.sendall(first)  # replayed on its own session: the challenge moved on
            assert c.recv(4096) == b""  # refused: the session is closed
        err = srv.refusals[-1]
        assert isinstance(err, ReplayError) and err.field == "challenge"
        _refused(srv.port, first, "challenge")  # and on a new connection
        with pytest.raises(AuthenticationError):
            Session(HOST, srv.port, Auth(os.urandom(32))).probe(1.0)
        sessions = [Session(HOST, srv.port, AUTH) for _ in range(3)]
        for s in sessions:
            s.probe(1.0)
        assert srv.stats["sessions_evicted"] == 1  # the third closed the least recently used
        assert sessions[0].probe(1.0).generation == 1 and sessions[0].opened == 2  # reopened at once
        deadline = time.monotonic() + 10.0
        while srv.stats["sessions_idle"] == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert srv.stats["sessions_idle"] >= 1
        for s in sessions:
            assert s.probe(1.0).generation == 1
            s.close()
