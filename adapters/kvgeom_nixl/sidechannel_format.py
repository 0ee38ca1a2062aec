"""The side channel's messages (:mod:`kvgeom_nixl.sidechannel`): JSON bodies with ``bytes`` as ``{"$b64": ...}``, length-prefixed tagged frames read and written within a deadline, and the handshake payload: made, sealed (one tag over all of it), opened and checked field by field."""

from __future__ import annotations

import base64
import errno
import json
import socket
import struct
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .auth import TAG_BYTES, Auth
from .errors import AuthenticationError, ProtocolError

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
