"""Typed errors. Every refusal in kvgeom is a :class:`KvgeomError` (a ``ValueError``) that names the
field at fault and, where two sides disagree, both values, so that a person can act on it."""

from __future__ import annotations

from typing import Any

__all__ = [
    "KvgeomError",
    "SpecError",
    "ConfigError",
    "CardError",
    "BlockIdError",
    "GroupMismatchError",
    "RatioError",
    "IncompatiblePairError",
    "UnsupportedError",
    "PlanError",
    "TokenCountError",
]


class KvgeomError(ValueError):
    """Base class of every error kvgeom raises on bad input.

    ``field`` names the input at fault; ``local`` / ``remote`` (or ``value`` / ``expected``) carry the
    values that disagree, so that callers can render their own messages.
    """

    def __init__(self, field: str, message: str, **values: Any) -> None:
        self.field = field
        self.values = values
        super().__init__(f"{field}: {message}")


class SpecError(KvgeomError):
    """A model or layer spec is inconsistent (unknown layer kind, sizes that do not decompose, ...)."""


class ConfigError(KvgeomError):
    """An engine configuration is inconsistent (TP rank out of range, block sizes that do not divide, ...)."""


class CardError(KvgeomError):
    """A geometry card is malformed, of an unknown version, or inconsistent with itself."""


class BlockIdError(KvgeomError):
    """A request's block ids are negative, out of range, or of the wrong shape."""


class GroupMismatchError(KvgeomError):
    """Two per-group inputs disagree in their number of groups, or a group has no region."""


class RatioError(KvgeomError):
    """TP sizes or block sizes that must divide one another do not."""


class IncompatiblePairError(KvgeomError):
    """A P/D pair fails a handshake rule: the two engines cannot exchange this request's bytes."""


class UnsupportedError(KvgeomError):
    """A combination kvgeom cannot (yet) plan correctly, refused rather than planned wrong."""


class PlanError(KvgeomError):
    """A per-request plan cannot be built from the given ids (unpairable counts, nothing to read, ...)."""


class TokenCountError(PlanError):
    """A request's token count is missing where its block lists alone do not place them on the token axis
    (``field`` names the count, ``values["value"]`` is what was given)."""
