"""The modes a pairing is planned in, as values every stage reads (a foundation, like the errors)."""

from __future__ import annotations

from enum import Enum

from kvgeom.errors import IncompatiblePairError

__all__ = ["Compat"]


class Compat(str, Enum):
    """The rules a pairing follows. ``VLLM``: a pair is served exactly when vLLM 0.33.0 serves it, with the
    bytes and descriptor ids vLLM would use, except that what vLLM would silently corrupt is refused too.
    ``KVGEOM``: every pair the oracle proves safe is planned, pairs vLLM refuses included.

    A member is its string (``Compat.VLLM == "vllm"``, same hash, formatted and JSON-encoded as ``"vllm"``), so
    every function that takes a mode takes either spelling; :meth:`of` turns a spelling into the member, or
    refuses it with an :class:`~kvgeom.errors.IncompatiblePairError` on field ``compat``."""

    VLLM = "vllm"
    KVGEOM = "kvgeom"

    def __str__(self) -> str:
        return str(self.value)

    def __format__(self, spec: str) -> str:
        return format(str(self.value), spec)

    def __hash__(self) -> int:
        return hash(str(self.value))

    @classmethod
    def of(cls, value: object) -> Compat:
        """The member spelled ``value`` (a member, ``"vllm"`` or ``"kvgeom"``)."""
        for member in cls:
            if value is member or value == member.value:
                return member
        raise IncompatiblePairError(
            "compat", f"must be one of {[m.value for m in cls]}, got {value!r}", value=value
        )
