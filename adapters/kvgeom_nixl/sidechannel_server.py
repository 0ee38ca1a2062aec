"""The side channel's server (:mod:`kvgeom_nixl.sidechannel`): one socket, an accept thread that reads preambles without blocking and admits only authenticated requests, handler threads, and (mixed in) the session thread and the answers."""

from __future__ import annotations

import os
import selectors
import socket
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Mapping
from typing import Any

from .auth import Auth
from .errors import AdapterError, AuthenticationError, HandshakeTimeout, ProtocolError, ReplayError
from .sidechannel_answers import _Answers, _busy
from .sidechannel_format import MAX_MESSAGE_BYTES, _dumps, seal_payload
from .sidechannel_sessions import _Pending, _Session, _SessionThread
from .wire import (
    PREAMBLE_BYTES,
    Greeting,
    Preamble,
    check_preamble,
    new_greeting,
    parse_preamble,
    send_greeting,
)


class SideChannelServer(_SessionThread, _Answers):
    """Serve ``payload`` (sealed here) to authenticated clients, answer ``generation`` queries, and keep
    (for ``peer_ttl_s``, at most ``max_peers``) the sealed payloads clients send with ``exchange``.

    One thread accepts connections and reads their fixed-size preambles without blocking: at most
    ``max_pending`` unauthenticated connections are held (the oldest is dropped for a new one), each with
    at most :data:`~kvgeom_nixl.wire.PREAMBLE_BYTES` of buffer, and each is dropped if its preamble is not
    complete ``preamble_timeout_s`` after accept. Only an authenticated request, for this server and this
    connection, gets a handler thread (at most ``max_connections`` at once; the body and the reply must
    fit in ``io_timeout_s``). So a flood or a slow drip without the secret cannot take the handlers away
    from the deployment's peers.

    A ``session`` request (authenticated like any other, empty body) is answered like ``generation``, with
    a fresh challenge, and its connection stays open: each later ``session`` preamble on it must name that
    challenge (and is answered with the next one), so a peer's freshness checks and liveness probes need
    no new connection. Sessions are served by their *own* thread with its own selector (the accept thread
    hands an authenticated session over and never touches it again), so a flood that keeps the accept
    thread busy, or fills the accept queue, cannot delay them: the session thread sleeps in ``select`` on
    the sessions alone and, woken by a session's bytes, waits at most one interpreter switch interval for
    the GIL. At most ``max_sessions`` are kept (the least recently used is closed for a new one), each
    closed after ``session_idle_s`` unused; only secret holders can open one.

    The socket is bound in the constructor (``port=0`` picks a free port; read :attr:`port`), the
    thread starts in :meth:`start` (or ``with``). ``auth`` is required: ``Auth(secret)``, or
    ``Auth.none()`` for the insecure mode. ``incarnation`` (16 bytes, random by default) names this server
    in every greeting; a request made for another incarnation is refused.
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        payload: Mapping[str, Any] | None = None,
        *,
        auth: Auth,
        io_timeout_s: float = 5.0,
        max_connections: int = 32,
        max_message_bytes: int = MAX_MESSAGE_BYTES,
        max_peers: int = 256,
        peer_ttl_s: float = 600.0,
        replay_window_s: float = 60.0,
        max_pending: int = 512,
        preamble_timeout_s: float = 1.0,
        incarnation: bytes | None = None,
        max_sessions: int = 256,
        session_idle_s: float = 60.0,
    ) -> None:
        if not isinstance(auth, Auth):
            raise TypeError("auth: pass Auth(secret), or Auth.none() for the insecure mode")
        self._auth = auth
        self._lock = threading.Condition()
        self._io_timeout_s = float(io_timeout_s)
        self._preamble_s = min(float(preamble_timeout_s), self._io_timeout_s)
        self._max_bytes = int(max_message_bytes)
        self._max_peers = int(max_peers)
        self._peer_ttl_s = float(peer_ttl_s)
        self._window = float(replay_window_s)
        self._max_pending = int(max_pending)
        self._max_handlers = int(max_connections)
        self._slots = threading.BoundedSemaphore(self._max_handlers)
        self._max_sessions = int(max_sessions)
        self._session_idle_s = float(session_idle_s)
        self.incarnation = os.urandom(16) if incarnation is None else bytes(incarnation)
        self.started = time.time()
        self._init_state()
        self._set_payload(dict(payload or {}))
        self._bind(host, port)

    def _init_state(self) -> None:
        """The server's bookkeeping, empty: connections, sessions, peers, nonces, counters, threads."""
        self._handlers = 0
        self._buffered = 0  # bytes in the pending connections' buffers
        self._pending: OrderedDict[int, _Pending] = OrderedDict()
        self._sessions: OrderedDict[int, _Session] = OrderedDict()  # least recently used first
        self._peers: OrderedDict[str, tuple[float, dict[str, Any]]] = OrderedDict()
        self._nonces: OrderedDict[str, float] = OrderedDict()
        self.stats = dict.fromkeys(_STATS, 0)
        self.refusals: deque[AdapterError] = deque(maxlen=64)
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None
        self._session_thread: threading.Thread | None = None
        # authenticated sessions handed from the accept thread to the session thread, and its wake-up pair
        self._handoff: deque[tuple[socket.socket, Greeting, Preamble]] = deque()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)

    def _bind(self, host: str, port: int) -> None:
        """Bind and listen (non-blocking); on failure nothing stays open."""
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self._sock.bind((host, port))
            self._sock.listen(1024)
            self._sock.setblocking(False)
        except BaseException:
            self._sock.close()
            self._close_wake()
            raise
        self.host, self.port = self._sock.getsockname()[:2]

    # -- payload
    def _set_payload(self, payload: dict[str, Any]) -> None:
        gen = payload.get("generation", 0)
        if isinstance(gen, bool) or not isinstance(gen, int):
            raise TypeError(f"payload['generation'] must be an int, got {gen!r}")
        body = _dumps(seal_payload(payload, self._auth))  # sealed and encoded once; spliced into replies
        with self._lock:
            self._payload = payload
            self._payload_json = body
            self._generation = gen

    def update(self, payload: Mapping[str, Any]) -> None:
        """Replace the served payload (e.g. after re-registering, with ``generation`` + 1)."""
        self._set_payload(dict(payload))

    @property
    def payload(self) -> dict[str, Any]:
        with self._lock:
            return dict(self._payload)

    @property
    def generation(self) -> int:
        with self._lock:
            return self._generation

    @property
    def address(self) -> tuple[str, int]:
        return self.host, self.port

    @property
    def pending_bytes(self) -> int:
        """Bytes buffered now for connections that have not authenticated (at most
        ``max_pending * PREAMBLE_BYTES``); ``stats["peak_pending_bytes"]`` is the most ever."""
        with self._lock:
            return self._buffered

    # -- peers that introduced themselves
    def _expire(self) -> None:
        old = time.monotonic() - self._peer_ttl_s
        while self._peers and next(iter(self._peers.values()))[0] < old:
            self._peers.popitem(last=False)

    def peers(self) -> dict[str, dict[str, Any]]:
        """Payloads received through ``exchange`` and not yet expired, keyed by ``agent_name``."""
        with self._lock:
            self._expire()
            return {k: v for k, (_, v) in self._peers.items()}

    def wait_peer(self, agent_name: str | None = None, timeout_s: float = 10.0) -> dict[str, Any]:
        """Block until a client exchanged its payload (that of ``agent_name``, or any if ``None``)."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while True:
                self._expire()
                if agent_name is None and self._peers:
                    return next(reversed(self._peers.values()))[1]
                if agent_name is not None and agent_name in self._peers:
                    return self._peers[agent_name][1]
                left = deadline - time.monotonic()
                if left <= 0:
                    who = agent_name or "any peer"
                    raise HandshakeTimeout(
                        f"no exchange from {who} within {timeout_s:.3g}s", stage="handshake", peer=agent_name
                    )
                self._lock.wait(min(left, 1.0))

    # -- thread
    def start(self) -> SideChannelServer:
        if self._thread is None:
            self._session_thread = threading.Thread(
                target=self._serve_sessions, name=f"sidechannel-sessions:{self.port}", daemon=True
            )
            self._session_thread.start()
            self._thread = threading.Thread(target=self._serve, name=f"sidechannel:{self.port}", daemon=True)
            self._thread.start()
        return self

    def __enter__(self) -> SideChannelServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self, timeout_s: float = 1.0) -> None:
        """Stop accepting and close the socket (clients then get *connection refused*); wait up to
        ``timeout_s`` for the accept thread and for handlers still answering."""
        self._closed.set()
        self._wake()
        deadline = time.monotonic() + timeout_s
        for t in (self._thread, self._session_thread):
            if t is not None and t is not threading.current_thread():
                t.join(max(deadline - time.monotonic(), 0.001))
        if self._thread is None:
            self._close_socket()
            self._close_wake()
        with self._lock:
            while self._handlers and time.monotonic() < deadline:
                self._lock.wait(max(deadline - time.monotonic(), 0.001))

    def _close_socket(self) -> None:
        try:
            self._sock.close()
        except OSError:
            pass

    def _close_wake(self) -> None:
        for s in (self._wake_r, self._wake_w):
            try:
                s.close()
            except OSError:
                pass

    def _wake(self) -> None:
        """Wake the session thread (a byte on its wake-up pair; a full pair is already awake)."""
        try:
            self._wake_w.send(b"\0")
        except OSError:  # BlockingIOError: bytes are waiting already; closed: the thread is gone
            pass

    def _serve(self) -> None:
        sel = selectors.DefaultSelector()
        sel.register(self._sock, selectors.EVENT_READ, None)
        try:
            while not self._closed.is_set():
                for key, _ in sel.select(0.05):
                    if key.data is None:
                        self._accept(sel)
                    elif isinstance(key.data, _Session):
                        self._read_session(sel, key.data)
                    else:
                        self._read_preamble(sel, key.data)
                self._drop_late(sel)
        finally:
            for p in list(self._pending.values()):
                self._drop(sel, p, None)
            sel.close()
            self._close_socket()
            self._wake()

    # -- the unauthenticated phase (the accept thread; nothing here blocks)
    def _accept(self, sel: selectors.BaseSelector) -> None:
        for _ in range(64):
            try:
                conn, _ = self._sock.accept()
            except BlockingIOError:
                return
            except OSError:  # e.g. EMFILE: make room, try again on the next round
                if self._pending:
                    self._drop(sel, next(iter(self._pending.values())), "evicted")
                time.sleep(0.005)
                return
            self._hold(sel, conn)

    def _hold(self, sel: selectors.BaseSelector, conn: socket.socket) -> None:
        conn.setblocking(False)
        greeting = new_greeting(self.incarnation, self.started)
        if not send_greeting(conn, greeting):
            conn.close()
            self._count("broken")
            return
        while len(self._pending) >= self._max_pending:  # the oldest makes room: a new peer is not starved
            self._drop(sel, next(iter(self._pending.values())), "evicted")
        p = _Pending(conn, greeting, time.monotonic() + self._preamble_s)
        with self._lock:
            self._pending[conn.fileno()] = p
            self.stats["peak_pending"] = max(self.stats["peak_pending"], len(self._pending))
        sel.register(conn, selectors.EVENT_READ, p)

    def _drop(self, sel: selectors.BaseSelector, p: _Pending, why: str | None) -> None:
        with self._lock:
            if self._pending.pop(p.conn.fileno(), None) is not None:
                self._buffered -= len(p.buf)
        try:
            sel.unregister(p.conn)
        except (KeyError, ValueError):
            pass
        p.conn.close()
        if why:
            self._count(why)

    def _drop_late(self, sel: selectors.BaseSelector) -> None:
        now = time.monotonic()
        while self._pending:
            p = next(iter(self._pending.values()))  # oldest first: deadlines are in accept order
            if p.deadline > now:
                return
            self._drop(sel, p, "dropped_slow")

    def _read_preamble(self, sel: selectors.BaseSelector, p: _Pending) -> None:
        try:
            chunk = p.conn.recv(PREAMBLE_BYTES - len(p.buf))
        except BlockingIOError:
            return
        except OSError:
            chunk = b""
        if not chunk:
            self._drop(sel, p, "broken")
            return
        p.buf += chunk
        with self._lock:
            self._buffered += len(chunk)
            self.stats["peak_pending_bytes"] = max(self.stats["peak_pending_bytes"], self._buffered)
        if len(p.buf) < PREAMBLE_BYTES:
            return
        with self._lock:
            self._pending.pop(p.conn.fileno(), None)
            self._buffered -= len(p.buf)
        sel.unregister(p.conn)
        self._admit(sel, p)

    def _admit(self, sel: selectors.BaseSelector, p: _Pending) -> None:
        """A complete preamble: refuse it (a short reply, then close) or give it a handler thread."""
        try:
            pre = parse_preamble(bytes(p.buf))
        except ProtocolError as e:
            self._refuse(p.conn, e)
            return
        try:
            check_preamble(pre, self._auth, p.greeting, self._window, self._max_bytes)
            self._remember(pre)
        except AdapterError as e:  # a replay or an over-long body is answered for the request's nonce
            tagged = not isinstance(e, AuthenticationError) or isinstance(e, ReplayError)
            self._refuse(p.conn, e, pre.nonce_hex if tagged else None)
            return
        if pre.op == "session":  # the session thread owns it from here on
            self._handoff.append((p.conn, p.greeting, pre))
            self._wake()
            return
        with self._lock:
            busy = self._handlers >= 4 * self._max_handlers
            if not busy:
                self._handlers += 1
        if busy:
            self._refuse(p.conn, _busy(), pre.nonce_hex, "refused_busy")
            return
        try:
            threading.Thread(target=self._handle, args=(p.conn, pre), daemon=True).start()
        except RuntimeError:  # no thread to be had: refused like a busy server
            with self._lock:
                self._handlers -= 1
            self._refuse(p.conn, _busy(), pre.nonce_hex, "refused_busy")


_STATS = (
    "served",
    "refused_busy",
    "refused_auth",
    "refused_replay",
    "broken",
    "dropped_slow",
    "evicted",
    "peak_pending",
    "peak_pending_bytes",
    "sessions_opened",
    "session_queries",
    "sessions_evicted",
    "sessions_idle",
)
