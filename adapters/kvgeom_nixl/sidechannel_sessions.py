"""Kept-open sessions of the side channel's server (:class:`~kvgeom_nixl.sidechannel_server.SideChannelServer`): the pending and session connection records, and the thread that serves sessions apart from the accept thread."""

from __future__ import annotations

import selectors
import socket
import time

from .errors import AdapterError, AuthenticationError, ProtocolError, ReplayError
from .sidechannel_format import _dumps
from .wire import PREAMBLE_BYTES, Greeting, Preamble, check_preamble, new_greeting, parse_preamble


class _Pending:
    """A connection that has not authenticated yet: its greeting, deadline and the preamble bytes so far
    (never more than :data:`PREAMBLE_BYTES`)."""

    __slots__ = ("conn", "greeting", "deadline", "buf")

    def __init__(self, conn: socket.socket, greeting: Greeting, deadline: float) -> None:
        self.conn, self.greeting, self.deadline, self.buf = conn, greeting, deadline, bytearray()


class _Session:
    """An authenticated connection kept open for ``session`` queries: the destination its next request must
    name (the server's incarnation and the challenge sent with the last reply), the preamble bytes so far,
    and when it was last used."""

    __slots__ = ("conn", "greeting", "buf", "used")

    def __init__(self, conn: socket.socket, greeting: Greeting) -> None:
        self.conn, self.greeting, self.buf, self.used = conn, greeting, bytearray(), time.monotonic()


class _SessionThread:
    """The session thread of :class:`~kvgeom_nixl.sidechannel_server.SideChannelServer` (a mixin over its state): authenticated connections kept open for ``session`` queries, served on their own selector."""

    # -- sessions (their own thread and selector; nothing here blocks)
    def _serve_sessions(self) -> None:
        sel = selectors.DefaultSelector()
        sel.register(self._wake_r, selectors.EVENT_READ, None)
        try:
            while not self._closed.is_set():
                for key, _ in sel.select(0.25):
                    if key.data is None:
                        self._take_handoffs(sel)
                    else:
                        self._read_session(sel, key.data)
                self._drop_idle(sel)
        finally:
            while self._handoff:
                self._handoff.popleft()[0].close()
            for sess in list(self._sessions.values()):
                self._end_session(sel, sess, None)
            sel.close()
            self._close_wake()

    def _take_handoffs(self, sel: selectors.BaseSelector) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except OSError:  # BlockingIOError: drained
            pass
        while self._handoff:
            conn, greeting, pre = self._handoff.popleft()
            self._open_session(sel, conn, greeting, pre)

    def _open_session(
        self, sel: selectors.BaseSelector, conn: socket.socket, greeting: Greeting, pre: Preamble
    ) -> None:
        if pre.length:
            self._refuse(conn, ProtocolError("a session request has no body", stage="sidechannel"))
            return
        while len(self._sessions) >= self._max_sessions:
            self._end_session(sel, next(iter(self._sessions.values())), "sessions_evicted")
        sess = _Session(conn, greeting)
        self._sessions[conn.fileno()] = sess
        self._count("sessions_opened")
        sel.register(conn, selectors.EVENT_READ, sess)
        self._session_reply(sel, sess, pre)

    def _session_reply(self, sel: selectors.BaseSelector, sess: _Session, pre: Preamble) -> None:
        """Answer a session query (the generation) with the challenge its next request must name."""
        nonce = pre.nonce_hex
        sess.greeting = new_greeting(self.incarnation, self.started)
        with self._lock:
            gen = self._generation
        body = {"ok": True, "generation": gen, "nonce": nonce, "challenge": sess.greeting.challenge}
        reply = self._reply(nonce, _dumps(body))
        try:
            sent = sess.conn.send(reply)  # a small reply into an idle socket: all of it goes at once
        except OSError:
            sent = -1
        if sent != len(reply):
            self._end_session(sel, sess, "broken")
            return
        sess.used = time.monotonic()
        self._sessions.move_to_end(sess.conn.fileno())
        self._count("served")
        self._count("session_queries")

    def _read_session(self, sel: selectors.BaseSelector, sess: _Session) -> None:
        try:
            chunk = sess.conn.recv(PREAMBLE_BYTES - len(sess.buf))
        except BlockingIOError:
            return
        except OSError:
            chunk = b""
        if not chunk:  # the peer closed its session
            self._end_session(sel, sess, None)
            return
        sess.buf += chunk
        if len(sess.buf) < PREAMBLE_BYTES:
            return
        data, sess.buf = bytes(sess.buf), bytearray()
        try:
            pre = check_preamble(
                parse_preamble(data), self._auth, sess.greeting, self._window, self._max_bytes
            )
            self._remember(pre)
            if pre.op != "session" or pre.length:
                raise ProtocolError(
                    f"request field 'op': a session carries only empty 'session' requests, got {pre.op!r}",
                    stage="sidechannel",
                )
        except AdapterError as e:  # closed without a reply: the peer opens a new session
            self.refusals.append(e)
            key = "broken"
            if isinstance(e, AuthenticationError):
                key = "refused_replay" if isinstance(e, ReplayError) else "refused_auth"
            self._end_session(sel, sess, key)
            return
        self._session_reply(sel, sess, pre)

    def _end_session(self, sel: selectors.BaseSelector, sess: _Session, why: str | None) -> None:
        self._sessions.pop(sess.conn.fileno(), None)
        try:
            sel.unregister(sess.conn)
        except (KeyError, ValueError):
            pass
        sess.conn.close()
        if why:
            self._count(why)

    def _drop_idle(self, sel: selectors.BaseSelector) -> None:
        old = time.monotonic() - self._session_idle_s
        while self._sessions:
            sess = next(iter(self._sessions.values()))  # least recently used first
            if sess.used > old:
                return
            self._end_session(sel, sess, "sessions_idle")
