"""A small, authenticated, bounded TCP side channel for the handshake between two ranks.

NIXL's agent metadata lets a peer connect and check descriptors, but it does not tell Python *where*
the peer's regions are, nor which geometry they hold; and NIXL's own metadata listener hands the
metadata to anyone and fails silently when nobody listens. So each rank serves a small JSON *payload*
(engine id, rank, agent name, agent metadata, geometry card, region addresses, device id,
``generation``) on a TCP port, and a peer fetches it with retries until a deadline.

Wire format (protocol version 2): every message is a 4-byte big-endian length ``n``, a 32-byte tag and
``n - 32`` bytes of UTF-8 JSON (an object). The tag is HMAC-SHA256 (:class:`~kvgeom_nixl.auth.Auth`)
of the JSON: a request's tag binds ``"req"``, a reply's binds ``"rep"`` and the request's nonce, so a
reply cannot be replayed to another request. The server checks the tag *before* parsing anything.
Requests carry ``nonce`` (random, accepted once) and ``ts`` (seconds since the epoch, within
``replay_window_s`` of the server's clock). ``bytes`` values travel as ``{"$b64": "<base64>"}``.

=========================================  ==================================================
request                                    reply
=========================================  ==================================================
``{"op": "get"}``                          ``{"ok": true, "payload": {...}}``
``{"op": "exchange", "payload": {...}}``   same; the server keeps the client's (sealed) payload
``{"op": "generation"}``                   ``{"ok": true, "generation": <int>}``
anything else, or an unauthenticated one   ``{"ok": false, "error": "..."}``
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
import json
import os
import socket
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

from .auth import TAG_BYTES, Auth
from .errors import (
    AuthenticationError,
    HandshakeTimeout,
    PeerGone,
    PeerUnknown,
    ProtocolError,
    StaleMetadata,
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
    "check_generation",
    "encode",
    "decode",
]

PROTOCOL_VERSION = 2
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


def validate_payload(
    payload: Any,
    where: str | None = None,
    *,
    max_regions: int = MAX_REGIONS,
    max_metadata_bytes: int = MAX_MESSAGE_BYTES,
) -> dict[str, Any]:
    """Check every field's type and range before anything uses it; :class:`ProtocolError` names the
    field and the value. Returns the payload."""
    _need(isinstance(payload, dict), "payload", type(payload).__name__, "expected an object", where)
    for key in ("engine_id", "agent_name"):
        v = payload.get(key)
        _need(
            isinstance(v, str) and 0 < len(v) <= MAX_NAME,
            key,
            v,
            f"expected a string of 1..{MAX_NAME} chars",
            where,
        )
    _need(
        _is_int(payload.get("rank"), 0, 1 << 16),
        "rank",
        payload.get("rank"),
        "expected an int in [0, 65536)",
        where,
    )
    md = payload.get("agent_metadata")
    _need(
        isinstance(md, bytes) and 0 < len(md) <= max_metadata_bytes,
        "agent_metadata",
        type(md).__name__ if not isinstance(md, bytes) else f"{len(md)} bytes",
        "expected non-empty bytes",
        where,
    )
    _need(
        isinstance(payload.get("card"), dict),
        "card",
        type(payload.get("card")).__name__,
        "expected an object",
        where,
    )
    regions = payload.get("regions")
    _need(
        isinstance(regions, list) and 0 < len(regions) <= max_regions,
        "regions",
        len(regions) if isinstance(regions, list) else regions,
        f"expected a list of 1..{max_regions} regions",
        where,
    )
    for i, r in enumerate(regions):
        _need(
            isinstance(r, list)
            and len(r) == 3
            and _is_int(r[0], 1, 1 << 64)
            and _is_int(r[1], 1, 1 << 48)
            and _is_int(r[2], 0, 1 << 16)
            and r[0] + r[1] <= 1 << 64,
            f"regions[{i}]",
            r,
            "expected [addr, nbytes, device_id] with 0 < addr, 0 < nbytes < 2**48, addr + nbytes <= 2**64",
            where,
        )
    _need(
        _is_int(payload.get("device_id"), 0, 1 << 16),
        "device_id",
        payload.get("device_id"),
        "expected an int in [0, 65536)",
        where,
    )
    _need(
        _is_int(payload.get("generation"), 0, 1 << 63),
        "generation",
        payload.get("generation"),
        "expected an int >= 0",
        where,
    )
    sc = payload.get("sidechannel", "missing")
    _need(
        sc is None
        or (
            isinstance(sc, list)
            and len(sc) == 2
            and isinstance(sc[0], str)
            and 0 < len(sc[0]) <= MAX_NAME
            and _is_int(sc[1], 0, 1 << 16)
        ),
        "sidechannel",
        sc,
        "expected null or [host, port]",
        where,
    )
    inc = payload.get("incarnation")
    _need(
        isinstance(inc, str) and len(inc) <= 64, "incarnation", inc, "expected a string of 0..64 chars", where
    )
    started = payload.get("started")
    _need(
        isinstance(started, float) and started >= 0 and started == started and started != float("inf"),
        "started",
        started,
        "expected a finite number >= 0",
        where,
    )
    return payload


# ----------------------------------------------------------------------------------------- server
class SideChannelServer:
    """Serve ``payload`` (sealed here) to authenticated clients from a daemon thread, answer ``generation`` queries,
    and keep (for ``peer_ttl_s``, at most ``max_peers``) the sealed payloads clients send with
    ``exchange``. At most ``max_connections`` connections are served at once (more are closed at
    accept); each must deliver its whole request within ``io_timeout_s``.

    The socket is bound in the constructor (``port=0`` picks a free port; read :attr:`port`), the
    thread starts in :meth:`start` (or ``with``). ``auth`` is required: ``Auth(secret)``, or
    ``Auth.none()`` for the insecure mode.
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
    ) -> None:
        if not isinstance(auth, Auth):
            raise TypeError("auth: pass Auth(secret), or Auth.none() for the insecure mode")
        self._auth = auth
        self._lock = threading.Condition()
        self._io_timeout_s = float(io_timeout_s)
        self._max_bytes = int(max_message_bytes)
        self._max_peers = int(max_peers)
        self._peer_ttl_s = float(peer_ttl_s)
        self._window = float(replay_window_s)
        self._slots = threading.BoundedSemaphore(int(max_connections))
        self._peers: OrderedDict[str, tuple[float, dict[str, Any]]] = OrderedDict()
        self._nonces: OrderedDict[str, float] = OrderedDict()
        self.stats = {"served": 0, "refused_busy": 0, "refused_auth": 0, "refused_replay": 0, "broken": 0}
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None
        self._set_payload(dict(payload or {}))
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self._sock.bind((host, port))
            self._sock.listen(64)
            self._sock.settimeout(0.1)
        except BaseException:
            self._sock.close()
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
            self._thread = threading.Thread(target=self._serve, name=f"sidechannel:{self.port}", daemon=True)
            self._thread.start()
        return self

    def __enter__(self) -> SideChannelServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self, timeout_s: float = 1.0) -> None:
        """Stop accepting and close the socket (clients then get *connection refused*)."""
        self._closed.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout_s)
        try:
            self._sock.close()
        except OSError:
            pass

    def _serve(self) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                if self._closed.is_set():
                    break
                time.sleep(0.01)
                continue
            if not self._slots.acquire(blocking=False):
                self._count("refused_busy")
                conn.close()  # bounded: never more than max_connections handlers
                continue
            threading.Thread(target=self._handle, args=(conn,), daemon=True).start()
        try:
            self._sock.close()
        except OSError:
            pass

    def _handle(self, conn: socket.socket) -> None:
        deadline = time.monotonic() + self._io_timeout_s
        try:
            with conn:
                try:
                    tag, body = _recv_frame(conn, deadline, self._max_bytes)
                    if not self._auth.check("sidechannel", tag, b"req", body):
                        self._count("refused_auth")
                        reply = _frame(
                            b'{"auth":false,"error":"authentication failed: this side channel needs '
                            b'the deployment\'s secret","ok":false}',
                            None,
                            b"",
                            self._max_bytes,
                        )
                    else:
                        reply = self._answer(decode(body))
                    _send_all(conn, reply, deadline)
                    self._count("served")
                except (OSError, ProtocolError, ValueError, TypeError, RecursionError, MemoryError):
                    self._count("broken")  # a broken or hostile client must not disturb the server
        finally:
            self._slots.release()

    def _count(self, key: str) -> None:
        with self._lock:
            self.stats[key] += 1

    def _reply(self, nonce: str, body: bytes) -> bytes:
        return _frame(body, self._auth, b"rep" + nonce.encode(), self._max_bytes)

    def _error(self, nonce: str, text: str) -> bytes:
        return self._reply(nonce, _dumps({"ok": False, "error": text, "nonce": nonce}))

    def _fresh(self, nonce: str, ts: Any) -> str | None:
        """``None`` if the request is fresh (and remember its nonce), else why not."""
        if isinstance(ts, bool) or not isinstance(ts, (int, float)) or abs(time.time() - ts) > self._window:
            return f"request timestamp {ts!r} is outside the {self._window:.3g}s replay window"
        now = time.monotonic()
        with self._lock:
            while self._nonces and next(iter(self._nonces.values())) < now - 2 * self._window:
                self._nonces.popitem(last=False)
            if nonce in self._nonces:
                return "nonce already used (replayed request)"
            self._nonces[nonce] = now
            while len(self._nonces) > 1 << 16:
                self._nonces.popitem(last=False)
        return None

    def _answer(self, msg: dict[str, Any]) -> bytes:
        nonce = msg.get("nonce")
        if not isinstance(nonce, str) or not 16 <= len(nonce) <= 64:
            return _frame(
                _dumps({"ok": False, "error": "request without a nonce"}), None, b"", self._max_bytes
            )
        if msg.get("v") != PROTOCOL_VERSION:
            return self._error(
                nonce, f"unsupported protocol version {msg.get('v')!r} (this side speaks {PROTOCOL_VERSION})"
            )
        stale = self._fresh(nonce, msg.get("ts"))
        if stale:
            self._count("refused_replay")
            return self._error(nonce, stale)
        op = msg.get("op")
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
            with self._lock:
                key = peer["agent_name"]
                self._peers.pop(key, None)
                self._peers[key] = (time.monotonic(), peer)
                self._expire()
                while len(self._peers) > self._max_peers:
                    self._peers.popitem(last=False)
                self._lock.notify_all()
        if op in ("get", "exchange"):
            with self._lock:
                payload = self._payload_json
            head = _dumps({"nonce": nonce, "ok": True})[:-1]
            return self._reply(nonce, head + b',"payload":' + payload + b"}")
        return self._error(nonce, f"unknown op {op!r}")


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
    """One connection, one request, one reply, all before the absolute ``deadline``; the reply must be
    tagged for this request's nonce."""
    where = f"{host}:{port}"
    nonce = os.urandom(16).hex()
    data = encode(dict(msg, v=PROTOCOL_VERSION, nonce=nonce, ts=time.time()), auth, b"req", max_bytes)
    left = deadline - time.monotonic()
    if left <= 0:
        raise _DeadlinePassed("deadline passed")
    with socket.create_connection((host, port), timeout=left) as sock:
        _send_all(sock, data, deadline)
        tag, body = _recv_frame(sock, deadline, max_bytes)
    if not auth.check("sidechannel", tag, b"rep" + nonce.encode(), body):
        try:
            said = decode(body).get("error")
        except ProtocolError:
            said = None
        raise AuthenticationError(
            f"{where} {'refused us: ' + repr(said) if said else 'sent a reply without a valid tag'} (do both sides "
            "have the same secret?)",
            stage="sidechannel",
            peer=where,
        )
    reply = decode(body)
    if reply.get("auth") is False:
        raise AuthenticationError(
            f"{where} refused us: {reply.get('error')!r} (do both sides have the same secret?)",
            stage="sidechannel",
            peer=where,
        )
    if reply.get("nonce") != nonce:
        raise AuthenticationError(
            f"{where} answered another request (nonce mismatch)", stage="sidechannel", peer=where
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
    where = f"{host}:{port}"
    try:
        reply = _request(host, port, {"op": "generation"}, time.monotonic() + timeout_s, auth)
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
    return gen


def check_generation(host: str, port: int, expected: int, timeout_s: float = 2.0, *, auth: Auth) -> int:
    """Raise :class:`StaleMetadata` unless the peer still serves ``expected``; return it otherwise."""
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
