"""Authentication: HMAC-SHA256 under keys derived from the deployment's shared secret.

Every side-channel message, every handshake payload (card, NIXL metadata, region bases, generation, as
one sealed object) and every notification carries a tag computed with :class:`Auth`. Tags are checked
with ``hmac.compare_digest`` (constant time). Purposes get separate keys (``HMAC(secret, purpose)``), so a
tag made for one kind of message is never valid for another. ``Auth.none()`` (``insecure=True``)
produces zero tags and accepts anything: only for local experiments.

Records stored in etcd are also encrypted (:meth:`Auth.encrypt`, AES-256-GCM from the ``cryptography``
package): etcd keeps them, and anyone with read access to the prefix would otherwise hold every rank's
NIXL metadata. What this does not do: encrypt the side channel (it is readable on the network path) or stop a process that
already holds a peer's NIXL metadata from using it; see docs/reliability.md.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from dataclasses import dataclass
from typing import Any

from .errors import AdapterError

__all__ = ["Auth", "Notice", "NOTICE_KINDS", "encode_notice", "decode_notice", "MAX_NOTICE_BYTES"]

TAG_BYTES = 32
GCM_NONCE_BYTES = 12


def _aesgcm(key: bytes) -> Any:
    """AES-256-GCM under ``key`` (imported on first use: only etcd discovery encrypts)."""
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    return AESGCM(key)


MAX_NOTICE_BYTES = 4096
_NOTICE_MAGIC = b"kvg1"
_NOTICE_TAG = 16  # bytes of the HMAC kept in a notification (128 bits)


class Auth:
    """Keys derived from one secret; ``secure`` is False for the explicit insecure mode."""

    __slots__ = ("secure", "_keys", "_secret")

    def __init__(self, secret: bytes | str | None) -> None:
        if isinstance(secret, str):
            secret = secret.encode()
        self.secure = secret is not None
        self._secret = bytes(secret) if secret is not None else b""
        self._keys: dict[str, bytes] = {}

    @classmethod
    def none(cls) -> Auth:
        """No authentication (``TransportConfig(insecure=True)``)."""
        return cls(None)

    @classmethod
    def from_config(cls, config: Any) -> Auth:
        """``Auth(config.secret)``; refuses a config with neither a secret nor ``insecure=True``."""
        if config.secret is not None:
            return cls(config.secret)
        if config.insecure:
            return cls.none()
        raise AdapterError(
            "no secret configured: set TransportConfig(secret=...) (or KVGEOM_NIXL_SECRET) to "
            "the deployment's shared secret, or insecure=True for a local experiment",
            stage="config",
        )

    def _key(self, purpose: str) -> bytes:
        key = self._keys.get(purpose)
        if key is None:
            key = self._keys[purpose] = hmac.new(
                self._secret, b"kvgeom-nixl/" + purpose.encode(), hashlib.sha256
            ).digest()
        return key

    def tag(self, purpose: str, *parts: bytes) -> bytes:
        """32-byte tag of ``parts`` (each length-prefixed, so that part boundaries count)."""
        if not self.secure:
            return bytes(TAG_BYTES)
        h = hmac.new(self._key(purpose), digestmod=hashlib.sha256)
        for part in parts:
            h.update(len(part).to_bytes(8, "big"))
            h.update(part)
        return h.digest()

    def encrypt(self, purpose: str, plain: bytes, aad: bytes) -> tuple[bytes, bytes]:
        """``(nonce, box)``: ``plain`` encrypted and authenticated with AES-256-GCM (the ``cryptography``
        package) under the purpose's key, ``aad`` authenticated with it, a fresh random 96-bit nonce. In the
        insecure mode ``box`` is ``plain`` and the nonce zeros (no encryption, like the zero tags)."""
        if not self.secure:
            return bytes(GCM_NONCE_BYTES), bytes(plain)
        nonce = os.urandom(GCM_NONCE_BYTES)
        return nonce, _aesgcm(self._key(purpose)).encrypt(nonce, bytes(plain), bytes(aad))

    def decrypt(self, purpose: str, nonce: bytes, box: bytes, aad: bytes) -> bytes | None:
        """The plaintext of :meth:`encrypt`'s ``box``, or ``None`` when the box, the nonce or ``aad`` were not
        the ones sealed under this deployment's secret."""
        if not self.secure:
            return bytes(box)
        if len(nonce) != GCM_NONCE_BYTES:
            return None
        from cryptography.exceptions import InvalidTag

        try:
            return _aesgcm(self._key(purpose)).decrypt(bytes(nonce), bytes(box), bytes(aad))
        except InvalidTag:
            return None

    def check(self, purpose: str, tag: bytes, *parts: bytes) -> bool:
        """Whether ``tag`` (or its first ``len(tag)`` bytes, at least 16) is ``parts``' tag."""
        if not self.secure:
            return True
        if len(tag) < 16:
            return False
        return hmac.compare_digest(self.tag(purpose, *parts)[: len(tag)], tag)

    def __repr__(self) -> str:
        return f"Auth(secure={self.secure})"


# ----------------------------------------------------------------------------------------- notices
NOTICE_KINDS = {
    "W": "the sender's WRITE of this attempt completed (every byte landed)",
    "D": "the sender is done reading this request (the producer may free its blocks)",
    "A": "the sender's transfer of this attempt ended without success, or was never posted: it writes no more",
}


@dataclass(frozen=True)
class Notice:
    """One authenticated notification: ``kind`` (see :data:`NOTICE_KINDS`) about attempt ``attempt`` of
    request ``request``, from rank ``rank`` of engine ``engine``; ``count`` is how many such notices the
    receiver expects for the request (informational)."""

    kind: str
    engine: str
    rank: int
    request: str
    attempt: int
    count: int = 1

    @property
    def token(self) -> tuple[str, int]:
        return (self.request, self.attempt)


def encode_notice(auth: Auth, notice: Notice, sender: str, receiver: str) -> bytes:
    """``kvg1`` + hex tag + JSON body; the tag covers sender and receiver agent names and the body."""
    body = json.dumps(
        [notice.kind, notice.engine, notice.rank, notice.request, notice.attempt, notice.count],
        separators=(",", ":"),
    ).encode()
    tag = auth.tag("notif", sender.encode(), receiver.encode(), body)[:_NOTICE_TAG]
    msg = _NOTICE_MAGIC + tag.hex().encode() + body
    if len(msg) > MAX_NOTICE_BYTES:
        raise ValueError(f"notification of {len(msg)} bytes exceeds {MAX_NOTICE_BYTES} (request id too long)")
    return msg


def decode_notice(auth: Auth, msg: bytes, sender: str, receiver: str) -> Notice | None:
    """The :class:`Notice` in ``msg`` if it is well formed and its tag is valid for ``sender`` ->
    ``receiver``; ``None`` otherwise (a forgery, another deployment's message, or garbage)."""
    head = len(_NOTICE_MAGIC) + 2 * _NOTICE_TAG
    if len(msg) > MAX_NOTICE_BYTES or len(msg) <= head or not msg.startswith(_NOTICE_MAGIC):
        return None
    try:
        tag = bytes.fromhex(msg[len(_NOTICE_MAGIC) : head].decode("ascii"))
    except (UnicodeDecodeError, ValueError):
        return None
    body = msg[head:]
    if not auth.check("notif", tag, sender.encode(), receiver.encode(), body):
        return None
    try:
        kind, engine, rank, request, attempt, count = json.loads(body)
    except (ValueError, TypeError, RecursionError):
        return None
    if (
        kind not in NOTICE_KINDS
        or not isinstance(engine, str)
        or not isinstance(request, str)
        or any(isinstance(x, bool) or not isinstance(x, int) for x in (rank, attempt, count))
    ):
        return None
    return Notice(kind, engine, rank, request, attempt, count)
