"""A small, authenticated, bounded TCP side channel for the handshake between two ranks.

NIXL's agent metadata lets a peer connect and check descriptors, but it does not tell Python *where*
the peer's regions are, nor which geometry they hold; and NIXL's own metadata listener hands the
metadata to anyone and fails silently when nobody listens. So each rank serves a small JSON *payload*
(engine id, rank, agent name, agent metadata, geometry card, region addresses, device id,
``generation``) on a TCP port, and a peer fetches it with retries until a deadline.

Wire format (protocol version 3, see :mod:`kvgeom_nixl.wire`): at accept the server sends a 48-byte
*greeting* (its random ``incarnation`` and a random per-connection ``challenge``). The client sends a
132-byte *preamble* (op, body length, timestamp, nonce, the greeting's incarnation and challenge, the
body's SHA-256, and an HMAC-SHA256 tag over all of it), then the body: UTF-8 JSON (an object), empty for
``get`` and ``generation``. The server checks the preamble (tag, destination, freshness, length) before it
reads or allocates the body, so a client without the secret costs it at most the preamble's bytes. The
reply is a 4-byte big-endian length ``n``, a 32-byte tag and ``n - 32`` bytes of JSON; its tag binds
``"rep"`` and the request's nonce, so a reply cannot be replayed to another request. A request is valid
for one connection of one server incarnation: replayed anywhere else (another server sharing the secret,
the same server again, or after a restart) it is refused with :class:`ReplayError`. Requests must also be
within ``replay_window_s`` of the server's clock, and each nonce is accepted once. ``bytes`` values travel
as ``{"$b64": "<base64>"}``.

=========================================  ==================================================
request (op, body)                         reply
=========================================  ==================================================
``get``, empty                             ``{"ok": true, "payload": {...}}``
``exchange``, ``{"payload": {...}}``       same; the server keeps the client's (sealed) payload
``generation``, empty                      ``{"ok": true, "generation": <int>}``
refused                                    ``{"ok": false, "error": "...", ["refused": field]}``
=========================================  ==================================================

Every deadline covers a whole message (not one ``recv``): a peer that sends one byte at a time cannot
stretch it. The server bounds connections, bytes per message and how long and how many exchanged
payloads it keeps. Payloads are *sealed* (:func:`seal_payload`): one tag over the whole payload, so the
card, the NIXL metadata and the region bases are bound together and to the deployment's secret.

``generation`` is an integer the rank increments whenever it re-registers memory; a peer asks for it
before posting (:func:`check_generation`) to detect stale metadata without refetching the payload.
"""

from __future__ import annotations

import base64
import errno
import hashlib
import json
import os
import selectors
import socket
import struct
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .auth import TAG_BYTES, Auth
from .errors import (
    AdapterError,
    AuthenticationError,
    HandshakeTimeout,
    PeerGone,
    PeerUnknown,
    ProtocolError,
    ReplayError,
    StaleMetadata,
)
from .wire import (
    GREETING_BYTES,
    PREAMBLE_BYTES,
    PROTOCOL_VERSION,
    Greeting,
    Preamble,
    check_preamble,
    make_request,
    new_greeting,
    parse_greeting,
    parse_preamble,
    send_greeting,
)

__all__ = [
    "PROTOCOL_VERSION",
    "MAX_MESSAGE_BYTES",
    "SideChannelServer",
    "make_payload",
    "seal_payload",
    "open_payload",
    "validate_payload",
    "fetch",
    "query_generation",
    "probe",
    "Liveness",
    "check_generation",
    "Session",
    "encode",
    "decode",
]

MAX_MESSAGE_BYTES = 16 << 20  # default bound of one message (TransportConfig.max_message_bytes)
_HEADER = struct.Struct(">I")
_B64 = "$b64"
_NO_TAG = bytes(TAG_BYTES)
MAX_REGIONS = 1 << 16
MAX_NAME = 256


# ----------------------------------------------------------------------------------------- encoding
def _default(obj: Any) -> Any:
    """What ``json.dumps`` cannot write itself: ``bytes`` as ``{"$b64": ...}``, other mappings as objects,
    numpy values as lists or numbers (without importing numpy here)."""
    if isinstance(obj, (bytes, bytearray, memoryview)):
        return {_B64: base64.b64encode(bytes(obj)).decode("ascii")}
    if isinstance(obj, Mapping):
        return dict(obj)
    if type(obj).__module__ == "numpy":
        return obj.tolist()
    raise TypeError(f"cannot encode a {type(obj).__name__} in a side-channel message")


def _b64_hook(obj: dict[str, Any]) -> Any:
    """``json.loads``' object hook: ``{"$b64": "..."}`` back to ``bytes`` (``ValueError`` if malformed)."""
    if len(obj) == 1 and _B64 in obj and isinstance(obj[_B64], str):
        return base64.b64decode(obj[_B64].encode("ascii"), validate=True)
    return obj


def _dumps(obj: Any) -> bytes:
    """Canonical JSON (sorted keys, no spaces, no NaN): what tags and seals are computed over. The walk is
    json's own (C) encoder; only bytes, mappings and numpy values reach :func:`_default`."""
    return json.dumps(obj, default=_default, separators=(",", ":"), allow_nan=False, sort_keys=True).encode(
        "utf-8"
    )


def encode(
    message: Mapping[str, Any],
    auth: Auth | None = None,
    bind: bytes = b"req",
    max_bytes: int = MAX_MESSAGE_BYTES,
) -> bytes:
    """One framed message: length prefix + tag + JSON (``bytes`` values as base64)."""
    body = _dumps(message)
    return _frame(body, auth, bind, max_bytes)


def _frame(body: bytes, auth: Auth | None, bind: bytes, max_bytes: int) -> bytes:
    if len(body) + TAG_BYTES > max_bytes:
        raise ValueError(f"message of {len(body)} bytes exceeds the limit of {max_bytes}")
    tag = auth.tag("sidechannel", bind, body) if auth is not None else _NO_TAG
    return _HEADER.pack(len(body) + TAG_BYTES) + tag + body


def decode(body: bytes) -> dict[str, Any]:
    """Inverse of :func:`encode` for the JSON body (without length prefix and tag)."""
    try:
        obj = json.loads(body.decode("utf-8"), object_hook=_b64_hook)
    except (UnicodeDecodeError, ValueError) as e:  # binascii.Error (base64) is a ValueError too
        raise ProtocolError(f"invalid JSON message or base64 field: {e}", stage="sidechannel") from None
    except RecursionError:
        raise ProtocolError("JSON message nested too deeply", stage="sidechannel") from None
    if not isinstance(obj, dict):
        raise ProtocolError(f"message is a {type(obj).__name__}, expected an object", stage="sidechannel")
    return obj


def _recv_exact(sock: socket.socket, n: int, deadline: float) -> bytes:
    """``n`` bytes before the absolute ``deadline`` (``TimeoutError`` otherwise), whatever the pace."""
    buf = bytearray()
    while len(buf) < n:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"message not complete at the deadline ({len(buf)} of {n} bytes)")
        sock.settimeout(left)
        chunk = sock.recv(min(n - len(buf), 1 << 20))
        if not chunk:
            raise ConnectionResetError(errno.ECONNRESET, f"peer closed after {len(buf)} of {n} bytes")
        buf += chunk
    return bytes(buf)


def _send_all(sock: socket.socket, data: bytes, deadline: float) -> None:
    view = memoryview(data)
    while view:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("deadline passed while sending")
        sock.settimeout(left)
        sent = sock.send(view[: 1 << 20])
        view = view[sent:]


def _recv_frame(sock: socket.socket, deadline: float, max_bytes: int) -> tuple[bytes, bytes]:
    """``(tag, body)`` of one message; the whole message must arrive before ``deadline``."""
    (n,) = _HEADER.unpack(_recv_exact(sock, _HEADER.size, deadline))
    if n > max_bytes:
        raise ProtocolError(
            f"announced message of {n} bytes exceeds the limit of {max_bytes}", stage="sidechannel"
        )
    if n < TAG_BYTES:
        raise ProtocolError(f"message of {n} bytes is shorter than its tag", stage="sidechannel")
    data = _recv_exact(sock, n, deadline)
    return data[:TAG_BYTES], data[TAG_BYTES:]


# ----------------------------------------------------------------------------------------- payload
def make_payload(
    *,
    engine_id: str,
    rank: int,
    agent_name: str,
    agent_metadata: bytes,
    card: Mapping[str, Any] | None = None,
    regions: Sequence[Sequence[int]] = (),
    device_id: int = 0,
    generation: int = 0,
    sidechannel: Sequence[Any] | None = None,
    incarnation: str = "",
    started: float = 0.0,
    **extra: Any,
) -> dict[str, Any]:
    """The handshake payload a rank serves. ``regions`` are ``(addr, nbytes, device_id)`` triples in the
    order the geometry numbers them; ``card`` is the rank's geometry card (opaque JSON object);
    ``sidechannel`` is ``(host, port)`` of the rank's side channel (for a peer that found the payload in
    etcd); ``incarnation`` (random per process) and ``started`` (its wall-clock start) order the records of
    one rank across restarts."""
    payload = {
        "engine_id": str(engine_id),
        "rank": int(rank),
        "agent_name": str(agent_name),
        "agent_metadata": bytes(agent_metadata),
        "card": dict(card) if card is not None else None,
        "regions": [[int(x) for x in r[:3]] for r in regions],
        "device_id": int(device_id),
        "generation": int(generation),
        "sidechannel": None if sidechannel is None else [str(sidechannel[0]), int(sidechannel[1])],
        "incarnation": str(incarnation),
        "started": float(started),
    }
    payload.update(extra)
    return payload


def seal_payload(payload: Mapping[str, Any], auth: Auth) -> dict[str, Any]:
    """``payload`` plus ``seal``: one tag over all its other fields (card, metadata, bases, generation,
    identity), so that none can be swapped for another payload's without the secret."""
    body = {k: v for k, v in payload.items() if k != "seal"}
    return dict(body, seal=auth.tag("payload", _dumps(body)))


def open_payload(payload: Any, auth: Auth, where: str | None = None) -> dict[str, Any]:
    """Check a received payload's ``seal``; returns the payload without it. :class:`AuthenticationError`
    if the seal is missing or wrong, :class:`ProtocolError` if it is not an object."""
    if not isinstance(payload, dict):
        raise ProtocolError(
            f"payload is a {type(payload).__name__}, expected an object", stage="handshake", peer=where
        )
    seal = payload.get("seal")
    body = {k: v for k, v in payload.items() if k != "seal"}
    if not isinstance(seal, bytes) or not auth.check("payload", seal, _dumps(body)):
        raise AuthenticationError(
            "handshake payload is not sealed with this deployment's secret", stage="handshake", peer=where
        )
    return body


def _need(cond: bool, field: str, value: Any, what: str, where: str | None) -> None:
    if not cond:
        text = repr(value)
        raise ProtocolError(
            f"payload field {field!r}: {what}, got {text[:120]}", stage="handshake", peer=where
        )


def _is_int(v: Any, lo: int, hi: int) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and lo <= v < hi


def _is_name(v: Any) -> bool:
    return isinstance(v, str) and 0 < len(v) <= MAX_NAME


def _is_region(r: Any) -> bool:
    return (
        isinstance(r, list)
        and len(r) == 3
        and _is_int(r[0], 1, 1 << 64)
        and _is_int(r[1], 1, 1 << 48)
        and _is_int(r[2], 0, 1 << 16)
        and r[0] + r[1] <= 1 << 64
    )


def _is_sidechannel(sc: Any) -> bool:
    return sc is None or (
        isinstance(sc, list) and len(sc) == 2 and _is_name(sc[0]) and _is_int(sc[1], 0, 1 << 16)
    )


def _is_started(v: Any) -> bool:
    return isinstance(v, float) and v >= 0 and v == v and v != float("inf")


def _type_name(v: Any) -> str:
    return type(v).__name__


def _metadata_shown(md: Any) -> str:
    return type(md).__name__ if not isinstance(md, bytes) else f"{len(md)} bytes"


def _same(v: Any) -> Any:
    return v


@dataclass(frozen=True)
class _Bounds:
    regions: int
    metadata_bytes: int


@dataclass(frozen=True)
class _Check:
    """One payload field's check: ``ok(value, bounds)``, else a :class:`ProtocolError` naming the field,
    ``shown(value)`` and ``what`` (formatted with ``max_regions`` and ``MAX_NAME``)."""

    field: str
    ok: Callable[[Any, _Bounds], bool]
    what: str
    shown: Callable[[Any], Any] = _same
    missing: Any = None  # the value of an absent field


#: every field of a payload, checked in this order; each region of ``regions`` right after it
_PAYLOAD_CHECKS = (
    _Check("engine_id", lambda v, b: _is_name(v), "expected a string of 1..{MAX_NAME} chars"),
    _Check("agent_name", lambda v, b: _is_name(v), "expected a string of 1..{MAX_NAME} chars"),
    _Check("rank", lambda v, b: _is_int(v, 0, 1 << 16), "expected an int in [0, 65536)"),
    _Check(
        "agent_metadata",
        lambda v, b: isinstance(v, bytes) and 0 < len(v) <= b.metadata_bytes,
        "expected non-empty bytes",
        _metadata_shown,
    ),
    _Check("card", lambda v, b: isinstance(v, dict), "expected an object", _type_name),
    _Check(
        "regions",
        lambda v, b: isinstance(v, list) and 0 < len(v) <= b.regions,
        "expected a list of 1..{max_regions} regions",
        lambda v: len(v) if isinstance(v, list) else v,
    ),
    _Check("device_id", lambda v, b: _is_int(v, 0, 1 << 16), "expected an int in [0, 65536)"),
    _Check("generation", lambda v, b: _is_int(v, 0, 1 << 63), "expected an int >= 0"),
    _Check(
        "sidechannel", lambda v, b: _is_sidechannel(v), "expected null or [host, port]", missing="missing"
    ),
    _Check(
        "incarnation", lambda v, b: isinstance(v, str) and len(v) <= 64, "expected a string of 0..64 chars"
    ),
    _Check("started", lambda v, b: _is_started(v), "expected a finite number >= 0"),
)
_REGION_WHAT = "expected [addr, nbytes, device_id] with 0 < addr, 0 < nbytes < 2**48, addr + nbytes <= 2**64"


def validate_payload(
    payload: Any,
    where: str | None = None,
    *,
    max_regions: int = MAX_REGIONS,
    max_metadata_bytes: int = MAX_MESSAGE_BYTES,
) -> dict[str, Any]:
    """Check every field's type and range before anything uses it (:data:`_PAYLOAD_CHECKS`, in order);
    :class:`ProtocolError` names the field and the value. Returns the payload."""
    _need(isinstance(payload, dict), "payload", type(payload).__name__, "expected an object", where)
    bounds = _Bounds(max_regions, max_metadata_bytes)
    for check in _PAYLOAD_CHECKS:
        v = payload.get(check.field, check.missing)
        what = check.what.format(max_regions=max_regions, MAX_NAME=MAX_NAME)
        _need(check.ok(v, bounds), check.field, check.shown(v), what, where)
        if check.field == "regions":
            for i, r in enumerate(v):
                _need(_is_region(r), f"regions[{i}]", r, _REGION_WHAT, where)
    return payload


# ----------------------------------------------------------------------------------------- server
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


class SideChannelServer:
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

    def _remember(self, pre: Preamble) -> None:
        """Accept each nonce once (within twice the replay window)."""
        now = time.monotonic()
        nonce = pre.nonce_hex
        with self._lock:
            while self._nonces and next(iter(self._nonces.values())) < now - 2 * self._window:
                self._nonces.popitem(last=False)
            if nonce in self._nonces:
                raise ReplayError(
                    f"request field 'nonce': {nonce} already used (replayed request)",
                    stage="sidechannel",
                    field="nonce",
                    expected=None,
                    seen=nonce,
                )
            self._nonces[nonce] = now
            while len(self._nonces) > 1 << 16:
                self._nonces.popitem(last=False)

    def _refuse(
        self, conn: socket.socket, err: AdapterError, nonce: str | None = None, key: str | None = None
    ) -> None:
        """Count ``err``, send its short reply (best effort, never blocking) and close."""
        self.refusals.append(err)
        if key is None:
            key = "broken"
            if isinstance(err, AuthenticationError):
                key = "refused_replay" if isinstance(err, ReplayError) else "refused_auth"
        self._count(key)
        try:
            conn.send(self._refusal(err, nonce))
        except OSError:
            pass
        conn.close()

    def _refusal(self, err: AdapterError, nonce: str | None) -> bytes:
        if nonce is not None:
            body: dict[str, Any] = {"ok": False, "error": str(err)[:300], "nonce": nonce}
            if isinstance(err, ReplayError):
                body["refused"] = err.field
            return self._reply(nonce, _dumps(body))
        auth = False if isinstance(err, AuthenticationError) else None
        return _frame(
            _dumps({"auth": auth, "error": str(err)[:200], "ok": False}), None, b"", self._max_bytes
        )

    # -- the authenticated phase (a handler thread per request)
    def _handle(self, conn: socket.socket, pre: Preamble) -> None:
        deadline = time.monotonic() + self._io_timeout_s
        got = self._slots.acquire(timeout=self._io_timeout_s)
        try:
            with conn:
                if not got:
                    self._refuse(conn, _busy(), pre.nonce_hex, "refused_busy")
                    return
                try:
                    body = _recv_exact(conn, pre.length, deadline) if pre.length else b""
                    if hashlib.sha256(body).digest() != pre.digest:
                        raise ProtocolError(
                            "request body does not match its preamble's digest", stage="sidechannel"
                        )
                    reply = self._answer(pre, decode(body) if body else {})
                    _send_all(conn, reply, deadline)
                    self._count("served")
                except (OSError, ProtocolError, ValueError, TypeError, RecursionError, MemoryError):
                    self._count("broken")  # a broken client must not disturb the server
        finally:
            if got:
                self._slots.release()
            with self._lock:
                self._handlers -= 1
                self._lock.notify_all()

    def _count(self, key: str) -> None:
        with self._lock:
            self.stats[key] += 1

    def _reply(self, nonce: str, body: bytes) -> bytes:
        return _frame(body, self._auth, b"rep" + nonce.encode(), self._max_bytes)

    def _error(self, nonce: str, text: str) -> bytes:
        return self._reply(nonce, _dumps({"ok": False, "error": text, "nonce": nonce}))

    def _answer(self, pre: Preamble, msg: dict[str, Any]) -> bytes:
        nonce, op = pre.nonce_hex, pre.op
        if op == "generation":
            with self._lock:
                gen = self._generation
            return self._reply(nonce, _dumps({"ok": True, "generation": gen, "nonce": nonce}))
        if op == "exchange":
            try:
                peer = validate_payload(
                    open_payload(msg.get("payload"), self._auth), max_metadata_bytes=self._max_bytes
                )
            except ProtocolError as e:
                return self._error(nonce, f"exchange refused: {e}")
            self._keep_peer(peer)
        with self._lock:
            payload = self._payload_json
        head = _dumps({"nonce": nonce, "ok": True})[:-1]
        return self._reply(nonce, head + b',"payload":' + payload + b"}")

    def _keep_peer(self, peer: dict[str, Any]) -> None:
        with self._lock:
            key = peer["agent_name"]
            self._peers.pop(key, None)
            self._peers[key] = (time.monotonic(), peer)
            self._expire()
            while len(self._peers) > self._max_peers:
                self._peers.popitem(last=False)
            self._lock.notify_all()


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


def _busy() -> ProtocolError:
    return ProtocolError("server busy: every handler is taken", stage="sidechannel")


# ----------------------------------------------------------------------------------------- client
_RETRYABLE = (ConnectionRefusedError, ConnectionResetError, ConnectionAbortedError, BrokenPipeError)


class _DeadlinePassed(TimeoutError):
    """The deadline passed before an attempt could start (keeps the previous attempt's error)."""


def _request(
    host: str,
    port: int,
    msg: Mapping[str, Any],
    deadline: float,
    auth: Auth,
    max_bytes: int = MAX_MESSAGE_BYTES,
) -> dict[str, Any]:
    """One connection, one request, one reply, all before the absolute ``deadline``: read the server's
    greeting, send a preamble tagged for it and the body (``msg`` without ``op``); the reply must be tagged
    for this request's nonce."""
    return _exchange(host, port, msg, deadline, auth, max_bytes)[0]


def _exchange(
    host: str,
    port: int,
    msg: Mapping[str, Any],
    deadline: float,
    auth: Auth,
    max_bytes: int = MAX_MESSAGE_BYTES,
) -> tuple[dict[str, Any], Greeting]:
    """:func:`_request`, also returning the server's greeting. The reply's tag binds the request's nonce,
    and the request's preamble binds the greeting's incarnation: an authenticated reply proves that a
    holder of the secret served this request as that incarnation."""
    where = f"{host}:{port}"
    rest = {k: v for k, v in msg.items() if k != "op"}
    body = _dumps(rest) if rest else b""
    if len(body) + PREAMBLE_BYTES > max_bytes:
        raise ValueError(f"message of {len(body)} bytes exceeds the limit of {max_bytes}")
    left = deadline - time.monotonic()
    if left <= 0:
        raise _DeadlinePassed("deadline passed")
    with socket.create_connection((host, port), timeout=left) as sock:
        greeting = parse_greeting(_recv_exact(sock, GREETING_BYTES, deadline), where)
        data, nonce = make_request(greeting, msg["op"], body, auth)
        _send_all(sock, data, deadline)
        tag, reply = _recv_frame(sock, deadline, max_bytes)
    return _check_reply(where, nonce.hex(), tag, reply, auth), greeting


def _check_reply(where: str, nonce: str, tag: bytes, body: bytes, auth: Auth) -> dict[str, Any]:
    """The decoded reply if it is tagged for ``nonce`` and says ``ok``; a typed error otherwise."""
    if not auth.check("sidechannel", tag, b"rep" + nonce.encode(), body):
        try:
            said = decode(body)
        except ProtocolError:
            said = {}
        if said.get("auth") is False or not said.get("error"):
            text = (
                "refused us: " + repr(said.get("error"))
                if said.get("error")
                else "sent a reply without a valid tag"
            )
            raise AuthenticationError(
                f"{where} {text} (do both sides have the same secret?)", stage="sidechannel", peer=where
            )
        raise ProtocolError(
            f"{where} refused the request: {said.get('error')!r}", stage="sidechannel", peer=where
        )
    reply = decode(body)
    if reply.get("auth") is False:  # (a client in the insecure mode accepts any tag)
        raise AuthenticationError(
            f"{where} refused us: {reply.get('error')!r} (do both sides have the same secret?)",
            stage="sidechannel",
            peer=where,
        )
    if reply.get("nonce") != nonce:
        raise AuthenticationError(
            f"{where} answered another request (nonce mismatch)", stage="sidechannel", peer=where
        )
    if isinstance(reply.get("refused"), str):
        raise ReplayError(
            f"{where} refused the request as not fresh: {reply.get('error')!r}",
            stage="sidechannel",
            peer=where,
            field=reply["refused"],
        )
    if reply.get("ok") is not True:
        raise ProtocolError(
            f"{where} refused the request: {reply.get('error')!r}", stage="sidechannel", peer=where
        )
    return reply


def fetch(
    host: str,
    port: int,
    my_payload: Mapping[str, Any] | None = None,
    timeout_s: float = 10.0,
    *,
    auth: Auth,
    retry_interval_s: float = 0.02,
    max_bytes: int = MAX_MESSAGE_BYTES,
) -> dict[str, Any]:
    """Get the peer's (sealed, checked) payload, and give it ``my_payload`` (sealed here) in the same
    round trip if given.

    Retries while the peer is not up yet (connection refused/reset) until ``timeout_s`` has passed,
    then raises :class:`HandshakeTimeout` naming ``host:port``. A peer that accepts but never answers,
    or answers one byte at a time, is bounded by the same deadline. A peer without the secret raises
    :class:`AuthenticationError` at once.
    """
    where = f"{host}:{port}"
    deadline = time.monotonic() + timeout_s
    msg: dict[str, Any] = {"op": "get"}
    if my_payload is not None:
        msg = {"op": "exchange", "payload": seal_payload(my_payload, auth)}
    attempts = 0
    last: BaseException | None = None
    pause = retry_interval_s
    while True:
        attempts += 1
        try:
            reply = _request(host, port, msg, deadline, auth, max_bytes)
        except _DeadlinePassed as e:
            last = last or e
            break
        except TimeoutError as e:  # connected (or connecting) but no whole answer before the deadline
            last = e
            break
        except _RETRYABLE as e:
            last = e
        except OSError as e:  # e.g. EHOSTUNREACH while an interface comes up: also retried
            last = e
        else:
            payload = open_payload(reply.get("payload"), auth, where)
            return validate_payload(payload, where, max_metadata_bytes=max_bytes)
        rem = deadline - time.monotonic()
        if rem <= 0:
            break
        time.sleep(min(pause, rem))
        pause = min(pause * 2, 0.25)
    raise HandshakeTimeout(
        f"side channel {where} did not answer within {timeout_s:.3g}s "
        f"({attempts} attempt(s), last error: {type(last).__name__}: {last})",
        stage="handshake",
        peer=where,
    )


def query_generation(host: str, port: int, timeout_s: float = 2.0, *, auth: Auth) -> int:
    """One cheap ``generation`` query, bounded as a whole by ``timeout_s``. Only positive evidence of
    death is :class:`PeerGone`: the connection refused (``ECONNREFUSED``: nothing listens on the port).
    Anything else that leaves us without an answer (a reset or an EOF before the reply, which a flooded
    server's accept-time close produces, a timeout, an unreachable route) is :class:`PeerUnknown`."""
    return probe(host, port, timeout_s, auth=auth).generation


@dataclass(frozen=True)
class Liveness:
    """An authenticated answer to a ``generation`` query: the peer's registration generation and the
    incarnation of the server that answered (a rank's server announces its process's incarnation)."""

    generation: int
    incarnation: bytes


def probe(host: str, port: int, timeout_s: float = 2.0, *, auth: Auth) -> Liveness:
    """:func:`query_generation`, with the answering server's authenticated incarnation: a different
    incarnation than the one a peer was known by is positive evidence that the process it knew is gone
    (another process serves its port). Errors as :func:`query_generation`."""
    where = f"{host}:{port}"
    try:
        reply, greeting = _exchange(host, port, {"op": "generation"}, time.monotonic() + timeout_s, auth)
    except ConnectionRefusedError as e:
        raise PeerGone(
            f"side channel {where} refused the connection ({e}): its process is gone",
            stage="generation",
            peer=where,
        ) from None
    except OSError as e:  # TimeoutError, ConnectionResetError, EOF, ENETUNREACH, ...: no evidence
        raise PeerUnknown(
            f"side channel {where} did not answer a generation query within {timeout_s:.3g}s "
            f"({type(e).__name__}: {e}); its process may be alive",
            stage="generation",
            peer=where,
            status=errno.errorcode.get(e.errno, None) if e.errno else None,
        ) from None
    gen = reply.get("generation")
    if isinstance(gen, bool) or not isinstance(gen, int):
        raise ProtocolError(f"{where} answered generation={gen!r}", stage="generation", peer=where)
    return Liveness(gen, greeting.incarnation)


def _liveness_errors(where: str, timeout_s: float, e: OSError) -> AdapterError:
    """What a failed connection tells (as :func:`probe`): refused is gone, anything else unknown."""
    if isinstance(e, ConnectionRefusedError):
        return PeerGone(
            f"side channel {where} refused the connection ({e}): its process is gone",
            stage="generation",
            peer=where,
        )
    return PeerUnknown(
        f"side channel {where} did not answer a generation query within {timeout_s:.3g}s "
        f"({type(e).__name__}: {e}); its process may be alive",
        stage="generation",
        peer=where,
        status=errno.errorcode.get(e.errno, None) if e.errno else None,
    )


class Session:
    """A kept-open, authenticated connection to one peer's side channel for its generation (the freshness
    check before each transfer): after the first query, each one is a 132-byte preamble and a short reply
    on the same connection, with no connect and no wait in the server's accept queue, so a flood of
    connections on the peer's port does not delay it. Each request names the challenge the server sent
    with its previous reply (and the server's incarnation), each reply is tagged for its request's nonce:
    as bound as a query on a new connection. Any error closes the session; the next query (or the rest of
    this one's deadline, if the session was old) opens a new one. Errors as :func:`probe`. Not
    thread-safe: one owner."""

    def __init__(self, host: str, port: int, auth: Auth) -> None:
        self.host, self.port, self.auth = host, int(port), auth
        self.where = f"{host}:{port}"
        self._sock: socket.socket | None = None
        self._greeting: Greeting | None = None
        self.opened = 0  # connections made (a new one after each failure)
        self.queries = 0
        self.answered_at: float | None = None  # monotonic time of the last authenticated answer

    def probe(self, timeout_s: float = 2.0) -> Liveness:
        """The peer's generation and incarnation, bounded as a whole by ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        if self._sock is not None:
            try:
                return self._ask(self._sock, self._greeting, deadline)
            except (OSError, AdapterError):  # a session the server closed (idle, evicted, restarted): renew
                self.close()
        try:
            sock = socket.create_connection(
                (self.host, self.port), timeout=max(deadline - time.monotonic(), 0.001)
            )
        except OSError as e:
            raise _liveness_errors(self.where, timeout_s, e) from None
        self.opened += 1
        self._sock = sock
        try:
            self._greeting = parse_greeting(_recv_exact(sock, GREETING_BYTES, deadline), self.where)
            return self._ask(sock, self._greeting, deadline)
        except OSError as e:
            self.close()
            raise _liveness_errors(self.where, timeout_s, e) from None
        except BaseException:
            self.close()
            raise

    def _ask(self, sock: socket.socket, greeting: Greeting | None, deadline: float) -> Liveness:
        if greeting is None:
            raise ProtocolError(
                f"{self.where}: session without a greeting", stage="generation", peer=self.where
            )
        data, nonce = make_request(greeting, "session", b"", self.auth)
        _send_all(sock, data, deadline)
        tag, body = _recv_frame(sock, deadline, MAX_MESSAGE_BYTES)
        reply = _check_reply(self.where, nonce.hex(), tag, body, self.auth)
        gen, challenge = reply.get("generation"), reply.get("challenge")
        if (
            isinstance(gen, bool)
            or not isinstance(gen, int)
            or not isinstance(challenge, bytes)
            or len(challenge) != 16
        ):
            raise ProtocolError(
                f"{self.where} answered a session query with generation={gen!r}, challenge={challenge!r}",
                stage="generation",
                peer=self.where,
            )
        self._greeting = Greeting(greeting.incarnation, challenge, greeting.started)
        self.queries += 1
        self.answered_at = time.monotonic()
        return Liveness(gen, greeting.incarnation)

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
        self._sock = self._greeting = None

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def check_generation(
    host: str,
    port: int,
    expected: int,
    timeout_s: float = 2.0,
    *,
    auth: Auth,
    session: Session | None = None,
) -> int:
    """Raise :class:`StaleMetadata` unless the peer still serves ``expected``; return it otherwise. With
    ``session`` (a :class:`Session` to ``host:port``), asked over it (no new connection once it is open)."""
    if session is not None:
        seen = session.probe(timeout_s).generation
    else:
        seen = query_generation(host, port, timeout_s, auth=auth)
    if seen != expected:
        raise StaleMetadata(
            f"peer {host}:{port} re-registered: generation {seen}, our metadata is of generation {expected}",
            stage="generation",
            peer=f"{host}:{port}",
            expected=expected,
            seen=seen,
        )
    return seen
