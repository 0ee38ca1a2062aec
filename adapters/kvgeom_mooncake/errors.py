"""Typed failures of the Mooncake transport.

Refusals of bad input are :class:`kvgeom.KvgeomError` subclasses (``ValueError``: ``field`` names the input,
``values`` carry both sides' values). Failures of the transfer engine or the peer are
:class:`MooncakeTransportError` subclasses (``RuntimeError``) with ``stage`` (``init``, ``register``,
``handshake``, ``post``, ``wait``, ``notif``), ``status`` (what Mooncake returned) and ``peer``.
"""

from __future__ import annotations

from typing import Any

from kvgeom import KvgeomError

__all__ = [
    "MISSING_HINT",
    "MooncakeMissing",
    "MooncakeTransportError",
    "EngineInitError",
    "RegistrationError",
    "PeerRefused",
    "TransferFailed",
    "TransferTimeout",
    "NotifTimeout",
    "QuarantinedBlockError",
]

MISSING_HINT = (
    "the Mooncake transport needs the transfer engine: pip install 'kvgeom[mooncake]' "
    "(mooncake-transfer-engine-non-cuda) and, on Debian, apt-get install libibverbs1 librdmacm1 "
    "(make host-deps as root)"
)


class MooncakeMissing(ImportError):
    """``mooncake.engine`` cannot be imported (the wheel or its shared libraries are missing)."""

    def __init__(self, cause: BaseException) -> None:
        self.cause = cause
        super().__init__(f"{MISSING_HINT}; import mooncake.engine failed: {type(cause).__name__}: {cause}")


class MooncakeTransportError(RuntimeError):
    """A transfer-engine or peer failure (not bad input)."""

    def __init__(self, message: str, *, stage: str, status: Any = None, peer: str | None = None) -> None:
        self.stage, self.status, self.peer = stage, status, peer
        super().__init__(message)


class EngineInitError(MooncakeTransportError):
    """``TransferEngine.initialize`` returned non-zero."""


class RegistrationError(MooncakeTransportError):
    """``register_memory`` returned non-zero."""


class PeerRefused(MooncakeTransportError):
    """A peer's handshake payload is unsealed, forged, of another rank, or disagrees with its card."""


class TransferFailed(MooncakeTransportError):
    """Mooncake reported a batch as failed (``transfer_check_status`` -1, or a submit that returned no
    batch). Mooncake reports one status per batch, not per descriptor: which of its bytes landed is
    unknown, so every byte the attempt could have written is zeroed."""


class TransferTimeout(MooncakeTransportError):
    """A batch was still pending at the deadline. Mooncake cannot cancel a posted batch: its blocks stay
    quarantined until :meth:`~kvgeom_mooncake.MooncakeRank.settle` sees the batch end."""


class NotifTimeout(MooncakeTransportError):
    """Push: not every producer rank's authenticated ``W`` notice arrived before the deadline."""


class QuarantinedBlockError(KvgeomError):
    """Block ids still held by a failed attempt whose batch may yet write them."""
