"""The fixed-size parts of the side channel's wire format (protocol version 3).

A connection starts with the server's *greeting* (48 bytes, sent at accept): magic ``kvgS``, the protocol
version, the server's ``incarnation`` (16 random bytes drawn when the server starts), a ``challenge`` (16
random bytes drawn for this connection) and the server's start time. The client answers with a *preamble*
(132 bytes): magic ``kvgQ``, version, op, the body's length, a timestamp, a random nonce, the greeting's
incarnation and challenge (the request's *destination*), the SHA-256 of the body, and an HMAC-SHA256 tag
over all of it. Then the body (JSON, ``length`` bytes).

The server checks the preamble (tag first, then destination, then freshness) before it reads or allocates
anything of the body: a client without the secret costs it at most :data:`PREAMBLE_BYTES` of buffer. A
request captured on the wire is bound to one connection of one server incarnation: replayed to another
server sharing the secret, to the same server on a new connection, or to the same port after a restart,
it is refused (:class:`~kvgeom_nixl.errors.ReplayError`).
"""

from __future__ import annotations

import hashlib
import os
import socket
import struct
import time
from dataclasses import dataclass

from .auth import TAG_BYTES, Auth
from .errors import AuthenticationError, ProtocolError, ReplayError

__all__ = [
    "PROTOCOL_VERSION",
    "GREETING_BYTES",
    "PREAMBLE_BYTES",
    "OPS",
    "Greeting",
    "Preamble",
    "new_greeting",
    "parse_greeting",
    "make_request",
    "parse_preamble",
    "check_preamble",
]

PROTOCOL_VERSION = 3
_GREETING = struct.Struct(">4sB3x16s16sd")  # magic, version, incarnation, challenge, server start time
_GREET_MAGIC = b"kvgS"
_PREAMBLE = struct.Struct(">4sBBxxId16s16s16s32s")  # magic, version, op, length, ts, nonce, inc, chal, sha256
_PRE_MAGIC = b"kvgQ"
GREETING_BYTES = _GREETING.size
PREAMBLE_BYTES = _PREAMBLE.size + TAG_BYTES
OPS = {"get": 1, "exchange": 2, "generation": 3, "session": 4}
_OP_NAMES = {v: k for k, v in OPS.items()}
_PURPOSE = "sidechannel-request"


@dataclass(frozen=True)
class Greeting:
    """What a server announces on each connection: who it is (``incarnation``), this connection's
    ``challenge``, and when the server started (``started``, seconds since the epoch)."""

    incarnation: bytes
    challenge: bytes
    started: float

    def pack(self) -> bytes:
        return _GREETING.pack(_GREET_MAGIC, PROTOCOL_VERSION, self.incarnation, self.challenge, self.started)


@dataclass(frozen=True)
class Preamble:
    """A parsed request preamble (not yet checked)."""

    op: str | None
    length: int
    ts: float
    nonce: bytes
    incarnation: bytes
    challenge: bytes
    digest: bytes
    head: bytes
    tag: bytes

    @property
    def nonce_hex(self) -> str:
        return self.nonce.hex()


def new_greeting(incarnation: bytes, started: float) -> Greeting:
    """A greeting with a fresh random challenge."""
    return Greeting(bytes(incarnation), os.urandom(16), float(started))


def parse_greeting(data: bytes, where: str | None = None) -> Greeting:
    """The server's greeting; :class:`ProtocolError` (naming the field) if it is not one of this version."""
    magic, version, incarnation, challenge, started = _GREETING.unpack(data)
    if magic != _GREET_MAGIC:
        raise ProtocolError(
            f"greeting field 'magic': expected {_GREET_MAGIC!r}, got {magic!r} (not a kvgeom side channel, "
            f"or one older than protocol {PROTOCOL_VERSION})",
            stage="sidechannel",
            peer=where,
        )
    if version != PROTOCOL_VERSION:
        raise ProtocolError(
            f"greeting field 'version': expected {PROTOCOL_VERSION}, got {version}",
            stage="sidechannel",
            peer=where,
        )
    return Greeting(incarnation, challenge, started)


def make_request(
    greeting: Greeting,
    op: str,
    body: bytes,
    auth: Auth,
    *,
    nonce: bytes | None = None,
    ts: float | None = None,
) -> tuple[bytes, bytes]:
    """``(preamble + body, nonce)`` of one request to the server that sent ``greeting``."""
    nonce = os.urandom(16) if nonce is None else nonce
    ts = time.time() if ts is None else ts
    head = _PREAMBLE.pack(
        _PRE_MAGIC,
        PROTOCOL_VERSION,
        OPS[op],
        len(body),
        ts,
        nonce,
        greeting.incarnation,
        greeting.challenge,
        hashlib.sha256(body).digest(),
    )
    return head + auth.tag(_PURPOSE, head) + body, nonce


def parse_preamble(data: bytes) -> Preamble:
    """Split a :data:`PREAMBLE_BYTES` preamble into its fields (no check; ``op`` is ``None`` if unknown)."""
    head, tag = data[: _PREAMBLE.size], data[_PREAMBLE.size : PREAMBLE_BYTES]
    magic, version, op, length, ts, nonce, inc, chal, digest = _PREAMBLE.unpack(head)
    if magic != _PRE_MAGIC or version != PROTOCOL_VERSION:
        raise ProtocolError(
            f"request preamble fields 'magic', 'version': expected {_PRE_MAGIC!r}, {PROTOCOL_VERSION}, "
            f"got {magic!r}, {version}",
            stage="sidechannel",
        )
    return Preamble(_OP_NAMES.get(op), length, ts, nonce, inc, chal, digest, head, tag)


def _replay(field: str, expected: object, seen: object, why: str) -> ReplayError:
    return ReplayError(
        f"request field {field!r}: {why} (expected {expected!r}, got {seen!r})",
        stage="sidechannel",
        field=field,
        expected=expected,
        seen=seen,
    )


def check_preamble(
    pre: Preamble, auth: Auth, greeting: Greeting, window_s: float, max_bytes: int
) -> Preamble:
    """Refuse (typed) a preamble that is not authenticated, not for this destination and connection, not
    fresh, or announces an unknown op or a body over ``max_bytes``. Returns ``pre``."""
    if not auth.check(_PURPOSE, pre.tag, pre.head):
        raise AuthenticationError(
            "request preamble has no valid tag (this side channel needs the deployment's secret)",
            stage="sidechannel",
        )
    if pre.incarnation != greeting.incarnation:
        raise _replay(
            "incarnation",
            greeting.incarnation.hex(),
            pre.incarnation.hex(),
            "made for another server, or for this one before it restarted",
        )
    if pre.challenge != greeting.challenge:
        raise _replay(
            "challenge", greeting.challenge.hex(), pre.challenge.hex(), "made for another connection"
        )
    now = time.time()
    if not abs(now - pre.ts) <= window_s:
        raise _replay("ts", round(now, 3), pre.ts, f"outside the {window_s:.3g}s replay window")
    if pre.op is None:
        raise ProtocolError(f"request field 'op': unknown op in preamble {pre.head[5]}", stage="sidechannel")
    if pre.length + PREAMBLE_BYTES > max_bytes:
        raise ProtocolError(
            f"request field 'length': {pre.length} bytes exceeds the limit of {max_bytes}",
            stage="sidechannel",
        )
    return pre


def send_greeting(sock: socket.socket, greeting: Greeting) -> bool:
    """Send ``greeting`` on a non-blocking socket in one call; whether all of it went."""
    try:
        return sock.send(greeting.pack()) == GREETING_BYTES
    except OSError:
        return False


def serve_request(
    sock: socket.socket, deadline: float, max_bytes: int, incarnation: bytes | None = None
) -> tuple[Greeting, Preamble, bytes]:
    """For a hand-made server (tests, probes): send a greeting on the blocking ``sock``, then read one
    preamble and its body (nothing checked but the framing). Returns ``(greeting, preamble, body)``."""
    greeting = new_greeting(incarnation or os.urandom(16), time.time())
    sock.settimeout(max(deadline - time.monotonic(), 0.001))
    sock.sendall(greeting.pack())
    pre = parse_preamble(_recv(sock, PREAMBLE_BYTES, deadline))
    if pre.length + PREAMBLE_BYTES > max_bytes:
        raise ProtocolError(f"request field 'length': {pre.length} exceeds {max_bytes}", stage="sidechannel")
    return greeting, pre, _recv(sock, pre.length, deadline)


def _recv(sock: socket.socket, n: int, deadline: float) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        sock.settimeout(max(deadline - time.monotonic(), 0.001))
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionResetError(f"peer closed after {len(buf)} of {n} bytes")
        buf += chunk
    return bytes(buf)
