"""The modes a pairing is planned in, as values every stage reads (a foundation, like the errors)."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from kvgeom.errors import IncompatiblePairError

__all__ = ["Compat", "CompatLike", "Policy", "policy_of"]


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


@dataclass(frozen=True)
class Policy:
    """What a compat mode changes, as data. :func:`policy_of` is the one place a mode is read: every stage after
    this one reads these fields, never the mode, so a new mode (another engine's rules, another vLLM release)
    is a new value here, not a branch in the planner.

    * ``engine_refusals``: the pairing also refuses what vLLM 0.33.0 refuses or would silently corrupt (each
      such rule names vLLM and the kvgeom-mode alternative in its error);
    * ``routed``: descriptor tables, group masks, transfer ranks and streams come from kvgeom's routes (each
      piece from the rank that holds it); otherwise from vLLM 0.33.0's registration-time tables and source-rank
      mapping, so that descriptor ids are vLLM's;
    * ``by_tokens``: blocks pair by their token positions, and D zeroes what no source wrote; otherwise by block
      counts as vLLM does, cross-checked against the positions (refused where they differ);
    * ``token_cut``: pages whose block sizes do not divide are cut by token wherever they split by token (and
      token-major pages whose heads differ are cut per token); otherwise vLLM's rule (hybrid MLA + SSM only);
    * ``spread_dcp``: with decode context parallelism pages that differ between the sides are gathered from
      (or sent to) every remote rank that holds (or needs) their tokens; otherwise vLLM's handshake targets.
    """

    compat: Compat
    engine_refusals: bool
    routed: bool
    by_tokens: bool
    token_cut: bool
    spread_dcp: bool


_POLICIES = {
    Compat.VLLM: Policy(
        Compat.VLLM, engine_refusals=True, routed=False, by_tokens=False, token_cut=False, spread_dcp=False
    ),
    Compat.KVGEOM: Policy(
        Compat.KVGEOM, engine_refusals=False, routed=True, by_tokens=True, token_cut=True, spread_dcp=True
    ),
}


CompatLike = Compat | str | Policy  # what a function that takes a mode accepts


def policy_of(compat: CompatLike) -> Policy:
    """The policy of a mode (a :class:`Compat` member or its spelling; a :class:`Policy` is returned as is).
    A misspelt mode is refused with an :class:`~kvgeom.errors.IncompatiblePairError` on field ``compat``."""
    if isinstance(compat, Policy):
        return compat
    if compat is Compat.VLLM or compat is Compat.KVGEOM:  # a member: no spelling to look up
        return _POLICIES[compat]
    return _POLICIES[Compat.of(compat)]
