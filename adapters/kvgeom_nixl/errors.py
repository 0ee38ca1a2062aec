"""Typed errors of the NIXL adapter.

Every failure the transport layer reports is an :class:`AdapterError` (a ``RuntimeError``: these are
failures of the environment or of a peer, not of the caller's input geometry). Each error names what
it was doing (``stage``), towards whom (``peer``), and keeps NIXL's status name where there is one, so
callers can decide to retry, re-handshake or give up without parsing messages.
"""

from __future__ import annotations

from kvgeom.errors import BlockIdError

__all__ = [
    "AdapterError",
    "HandshakeTimeout",
    "PeerUnknown",
    "ProtocolError",
    "AuthenticationError",
    "ReplayError",
    "TransferError",
    "NotifTimeout",
    "PeerGone",
    "StaleMetadata",
    "DiscoveryError",
    "QuarantinedBlockError",
]


class AdapterError(RuntimeError):
    """Base class of every error raised by ``kvgeom_nixl``.

    Attributes: ``stage`` (e.g. ``"prep_remote"``, ``"post"``, ``"wait"``, ``"handshake"``),
    ``peer`` (agent name or ``host:port``, or ``None``), ``status`` (NIXL status name such as
    ``"NIXL_ERR_NOT_FOUND"``, or ``None``).
    """

    def __init__(
        self,
        message: str,
        *,
        stage: str | None = None,
        peer: str | None = None,
        status: str | None = None,
    ) -> None:
        self.stage = stage
        self.peer = peer
        self.status = status
        parts = [p for p in (stage, f"peer={peer}" if peer else None, status) if p]
        prefix = f"[{' '.join(parts)}] " if parts else ""
        super().__init__(prefix + message)


class HandshakeTimeout(AdapterError):
    """A peer's side channel did not answer (refused, silent or too slow) before the deadline."""


class PeerUnknown(HandshakeTimeout):
    """A peer's side channel did not answer, and that is no evidence that its process is gone: the
    connection was reset or closed before a reply (a busy or flooded server closes connections at
    accept), it timed out, or the route is unreachable. Only a refused connection is
    :class:`PeerGone`. A :class:`HandshakeTimeout`, so that code waiting for an answer treats both alike."""


class ProtocolError(AdapterError):
    """A side-channel peer answered with something that is not a valid message of the protocol."""


class AuthenticationError(ProtocolError):
    """A peer did not prove that it holds the deployment's secret: its side-channel message, handshake
    payload or notification has no valid HMAC (wrong or missing secret, or a forgery), or it reused a
    nonce. Nothing it sent was used."""


class ReplayError(AuthenticationError):
    """A side-channel request carries a valid tag but is not fresh for this server: it was made for
    another destination (``field="incarnation"``: another server, or this one before a restart), for
    another connection (``field="challenge"``: a replay to the same server), outside the replay window
    (``field="ts"``) or reuses a nonce (``field="nonce"``). ``expected`` and ``seen`` hold the server's
    value and the request's (hex for byte fields)."""

    def __init__(
        self, message: str, *, field: str, expected: object = None, seen: object = None, **kw
    ) -> None:
        self.field = field
        self.expected = expected
        self.seen = seen
        super().__init__(message, **kw)


class TransferError(AdapterError):
    """A transfer could not be prepared, posted or completed: NIXL refused descriptors or indices,
    reported an error state, raised, or the transfer did not complete before its deadline."""


class NotifTimeout(TransferError):
    """The expected notifications did not arrive before the deadline."""


class PeerGone(TransferError):
    """The peer is gone, on positive evidence only: NIXL reports a remote disconnect, or the peer's side
    channel refuses the connection (``ECONNREFUSED``: nothing listens on its port any more, the process
    has exited). A reset, an EOF, a timeout or an unreachable route is :class:`PeerUnknown`. A
    :class:`TransferError`, so that ``except TransferError`` covers everything a transfer can raise."""


class StaleMetadata(AdapterError):
    """The peer re-registered its memory (its ``generation`` changed) since we loaded its metadata,
    or a prepared handle refers to metadata that has since been replaced. Re-handshake, re-prepare."""

    def __init__(self, message: str, *, expected: int | None = None, seen: int | None = None, **kw) -> None:
        self.expected = expected
        self.seen = seen
        super().__init__(message, **kw)


class DiscoveryError(AdapterError):
    """The discovery service (etcd) could not be reached, or refused a request, before the deadline.
    Nothing read from it was used."""


class QuarantinedBlockError(BlockIdError):
    """Block ids given to a call are quarantined (or retired) by a failed attempt whose transfers may
    still write them: the caller's scheduler must not hand them to a request before
    :meth:`~kvgeom_nixl.kvrank.KVRank.settle` returns them. A :class:`~kvgeom.errors.BlockIdError` (a
    ``ValueError``: bad input). ``field`` names the argument; ``values`` carry ``ids`` (the offending
    ids), ``held_by`` (the attempt's ``(request id, attempt)``) and ``retired``."""
