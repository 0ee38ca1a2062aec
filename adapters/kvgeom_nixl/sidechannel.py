"""A tiny TCP side channel for the handshake between two ranks.

NIXL's agent metadata lets a peer connect and check descriptors, but it does not tell Python *where*
the peer's regions are, nor which geometry they hold; and NIXL's own metadata listener fails silently
when nobody listens. So each rank serves a small JSON *payload* (engine id, rank, agent name, agent
metadata, geometry card, region addresses, device id, ``generation``) on a loopback/TCP port, and a
peer fetches it with retries until a deadline.

Wire format: every message is a 4-byte big-endian length followed by that many bytes of UTF-8 JSON
(an object). ``bytes`` values anywhere in a payload travel as ``{"$b64": "<base64>"}`` and are
decoded back to ``bytes``. One request and one reply per connection:

=========================================  ==================================================
request                                    reply
=========================================  ==================================================
``{"v": 1, "op": "get"}``                  ``{"ok": true, "payload": {...}}``
``{"v": 1, "op": "exchange", "payload"}``  same; the server also keeps the client's payload
``{"v": 1, "op": "generation"}``           ``{"ok": true, "generation": <int>}`` (cheap)
anything else                              ``{"ok": false, "error": "..."}``
=========================================  ==================================================

``generation`` is an integer the rank increments whenever it re-registers memory; a peer asks for it
before posting (:func:`check_generation`) to detect stale metadata without refetching the payload.
"""

from __future__ import annotations

import base64
import errno
import json
import socket
import struct
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

from .errors import HandshakeTimeout, PeerGone, ProtocolError, StaleMetadata

__all__ = [
    "PROTOCOL_VERSION",
    "MAX_MESSAGE_BYTES",
    "SideChannelServer",
    "make_payload",
    "fetch",
    "query_generation",
    "check_generation",
    "encode",
    "decode",
]

PROTOCOL_VERSION = 1
MAX_MESSAGE_BYTES = 64 << 20
_HEADER = struct.Struct(">I")
_B64 = "$b64"


# ----------------------------------------------------------------------------------------- encoding
def _to_jsonable(obj: Any) -> Any:
    if isinstance(obj, (bytes, bytearray, memoryview)):
        return {_B64: base64.b64encode(bytes(obj)).decode("ascii")}
    if isinstance(obj, Mapping):
        out = {}
        for k, v in obj.items():
            if not isinstance(k, str):
                raise TypeError(f"payload keys must be str, got {k!r}")
            out[k] = _to_jsonable(v)
        return out
    if isinstance(obj, (list, tuple)):
        return [_to_jsonable(v) for v in obj]
    if type(obj).__module__ == "numpy":  # numpy scalars and arrays, without importing numpy here
        return _to_jsonable(obj.tolist())
    return obj


def _from_jsonable(obj: Any) -> Any:
    if isinstance(obj, dict):
        if len(obj) == 1 and _B64 in obj and isinstance(obj[_B64], str):
            return base64.b64decode(obj[_B64].encode("ascii"), validate=True)
        return {k: _from_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_from_jsonable(v) for v in obj]
    return obj


def encode(message: Mapping[str, Any]) -> bytes:
    """One framed message: length prefix + JSON (``bytes`` values as base64)."""
    body = json.dumps(_to_jsonable(message), separators=(",", ":"), allow_nan=False).encode("utf-8")
    if len(body) > MAX_MESSAGE_BYTES:
        raise ValueError(f"message of {len(body)} bytes exceeds MAX_MESSAGE_BYTES={MAX_MESSAGE_BYTES}")
    return _HEADER.pack(len(body)) + body


def decode(body: bytes) -> dict[str, Any]:
    """Inverse of :func:`encode` for the JSON body (without the length prefix)."""
    try:
        obj = json.loads(body.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise ProtocolError(f"invalid JSON message: {e}", stage="sidechannel") from None
    if not isinstance(obj, dict):
        raise ProtocolError(f"message is a {type(obj).__name__}, expected an object", stage="sidechannel")
    try:
        return _from_jsonable(obj)
    except ValueError as e:
        raise ProtocolError(f"invalid base64 field: {e}", stage="sidechannel") from None


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(min(n - len(buf), 1 << 20))
        if not chunk:
            raise ConnectionResetError(errno.ECONNRESET, f"peer closed after {len(buf)} of {n} bytes")
        buf += chunk
    return bytes(buf)


def _recv_message(sock: socket.socket) -> dict[str, Any]:
    (n,) = _HEADER.unpack(_recv_exact(sock, _HEADER.size))
    if n > MAX_MESSAGE_BYTES:
        raise ProtocolError(
            f"announced message of {n} bytes exceeds {MAX_MESSAGE_BYTES}", stage="sidechannel"
        )
    return decode(_recv_exact(sock, n))


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
    **extra: Any,
) -> dict[str, Any]:
    """The handshake payload a rank serves. ``regions`` are ``(addr, nbytes, device_id)`` triples in the
    order the geometry numbers them; ``card`` is the rank's geometry card (opaque JSON object)."""
    payload = {
        "engine_id": str(engine_id),
        "rank": int(rank),
        "agent_name": str(agent_name),
        "agent_metadata": bytes(agent_metadata),
        "card": dict(card) if card is not None else None,
        "regions": [[int(x) for x in r[:3]] for r in regions],
        "device_id": int(device_id),
        "generation": int(generation),
    }
    payload.update(extra)
    return payload


# ----------------------------------------------------------------------------------------- server
class SideChannelServer:
    """Serve ``payload`` to any client from a daemon thread, answer ``generation`` queries, and keep
    the payloads that clients send with ``exchange``.

    The socket is bound in the constructor (``port=0`` picks a free port; read :attr:`port`), the
    thread starts in :meth:`start` (or ``with``). Not meant for untrusted networks: there is no
    authentication; bind to loopback or a private interface.
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        payload: Mapping[str, Any] | None = None,
        *,
        io_timeout_s: float = 5.0,
    ) -> None:
        self._lock = threading.Condition()
        self._io_timeout_s = float(io_timeout_s)
        self._peers: dict[str, dict[str, Any]] = {}
        self._n_anon = 0
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
        reply = encode({"ok": True, "payload": payload})  # validates JSON-ability once
        with self._lock:
            self._payload = payload
            self._payload_reply = reply
            self._generation = gen
            self._gen_reply = encode({"ok": True, "generation": gen})

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
    def peers(self) -> dict[str, dict[str, Any]]:
        """Payloads received through ``exchange``, keyed by their ``agent_name`` (latest wins)."""
        with self._lock:
            return dict(self._peers)

    def wait_peer(self, agent_name: str | None = None, timeout_s: float = 10.0) -> dict[str, Any]:
        """Block until a client exchanged its payload (that of ``agent_name``, or any if ``None``)."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while True:
                if agent_name is None and self._peers:
                    return next(reversed(self._peers.values()))
                if agent_name is not None and agent_name in self._peers:
                    return self._peers[agent_name]
                left = deadline - time.monotonic()
                if left <= 0:
                    who = agent_name or "any peer"
                    raise HandshakeTimeout(
                        f"no exchange from {who} within {timeout_s:.3g}s", stage="handshake", peer=agent_name
                    )
                self._lock.wait(left)

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
            threading.Thread(target=self._handle, args=(conn,), daemon=True).start()
        try:
            self._sock.close()
        except OSError:
            pass

    def _handle(self, conn: socket.socket) -> None:
        with conn:
            try:
                conn.settimeout(self._io_timeout_s)
                msg = _recv_message(conn)
                conn.sendall(self._answer(msg))
            except (OSError, ProtocolError, ValueError):
                pass  # a broken client must not disturb the server

    def _answer(self, msg: dict[str, Any]) -> bytes:
        op = msg.get("op")
        if msg.get("v") != PROTOCOL_VERSION:
            return encode({"ok": False, "error": f"unsupported protocol version {msg.get('v')!r}"})
        if op == "generation":
            with self._lock:
                return self._gen_reply
        if op == "exchange":
            peer = msg.get("payload")
            if not isinstance(peer, dict):
                return encode({"ok": False, "error": "exchange needs a payload object"})
            with self._lock:
                key = peer.get("agent_name")
                if not isinstance(key, str) or not key:
                    self._n_anon += 1
                    key = f"anonymous-{self._n_anon}"
                self._peers.pop(key, None)
                self._peers[key] = peer
                self._lock.notify_all()
                return self._payload_reply
        if op == "get":
            with self._lock:
                return self._payload_reply
        return encode({"ok": False, "error": f"unknown op {op!r}"})


# ----------------------------------------------------------------------------------------- client
_RETRYABLE = (ConnectionRefusedError, ConnectionResetError, ConnectionAbortedError, BrokenPipeError)


class _DeadlinePassed(TimeoutError):
    """The deadline passed before an attempt could start (keeps the previous attempt's error)."""


def _request(host: str, port: int, msg: Mapping[str, Any], deadline: float) -> dict[str, Any]:
    """One connection, one request, one reply; socket timeouts follow the absolute ``deadline``."""
    data = encode(msg)

    def left() -> float:
        rem = deadline - time.monotonic()
        if rem <= 0:
            raise _DeadlinePassed("deadline passed")
        return rem

    with socket.create_connection((host, port), timeout=left()) as sock:
        sock.settimeout(left())
        sock.sendall(data)
        sock.settimeout(left())
        reply = _recv_message(sock)
    if reply.get("ok") is not True:
        raise ProtocolError(
            f"{host}:{port} refused the request: {reply.get('error')!r}",
            stage="sidechannel",
            peer=f"{host}:{port}",
        )
    return reply


def fetch(
    host: str,
    port: int,
    my_payload: Mapping[str, Any] | None = None,
    timeout_s: float = 10.0,
    *,
    retry_interval_s: float = 0.02,
) -> dict[str, Any]:
    """Get the peer's payload (and give it ``my_payload``, if any, in the same round trip).

    Retries while the peer is not up yet (connection refused/reset) until ``timeout_s`` has passed,
    then raises :class:`HandshakeTimeout` naming ``host:port``. A peer that accepts but never answers
    is bounded by the same deadline.
    """
    where = f"{host}:{port}"
    deadline = time.monotonic() + timeout_s
    msg: dict[str, Any] = {"v": PROTOCOL_VERSION, "op": "get"}
    if my_payload is not None:
        msg = {"v": PROTOCOL_VERSION, "op": "exchange", "payload": dict(my_payload)}
    attempts = 0
    last: BaseException | None = None
    pause = retry_interval_s
    while True:
        attempts += 1
        try:
            reply = _request(host, port, msg, deadline)
        except _DeadlinePassed as e:
            last = last or e
            break
        except TimeoutError as e:  # connected (or connecting) but no answer before the deadline
            last = e
            break
        except _RETRYABLE as e:
            last = e
        except OSError as e:  # e.g. EHOSTUNREACH while an interface comes up: also retried
            last = e
        else:
            payload = reply.get("payload")
            if not isinstance(payload, dict):
                raise ProtocolError(f"{where} sent no payload object", stage="handshake", peer=where)
            return payload
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


def query_generation(host: str, port: int, timeout_s: float = 2.0) -> int:
    """One cheap ``generation`` query. A peer that refuses the connection (its process is gone) raises
    :class:`PeerGone`; one that does not answer in time raises :class:`HandshakeTimeout`."""
    where = f"{host}:{port}"
    try:
        reply = _request(
            host, port, {"v": PROTOCOL_VERSION, "op": "generation"}, time.monotonic() + timeout_s
        )
    except TimeoutError:
        raise HandshakeTimeout(
            f"side channel {where} did not answer a generation query within {timeout_s:.3g}s",
            stage="generation",
            peer=where,
        ) from None
    except OSError as e:
        raise PeerGone(
            f"side channel {where} is gone ({type(e).__name__}: {e})", stage="generation", peer=where
        ) from None
    gen = reply.get("generation")
    if isinstance(gen, bool) or not isinstance(gen, int):
        raise ProtocolError(f"{where} answered generation={gen!r}", stage="generation", peer=where)
    return gen


def check_generation(host: str, port: int, expected: int, timeout_s: float = 2.0) -> int:
    """Raise :class:`StaleMetadata` unless the peer still serves ``expected``; return it otherwise."""
    seen = query_generation(host, port, timeout_s)
    if seen != expected:
        raise StaleMetadata(
            f"peer {host}:{port} re-registered: generation {seen}, our metadata is of generation {expected}",
            stage="generation",
            peer=f"{host}:{port}",
            expected=expected,
            seen=seen,
        )
    return seen
