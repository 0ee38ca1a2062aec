"""The values :mod:`kvgeom.testing.nixl_double` hands out, as NIXL's own (nixl 1.5.1): its two errors,
descriptor lists, prepared-list and transfer handles, the record of a posted transfer, and telemetry.
Import them from :mod:`kvgeom.testing.nixl_double`."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

__all__ = [
    "ExecutedTransfer",
    "PreppedDList",
    "XferDList",
    "XferHandle",
    "XferTelemetry",
    "nixlInvalidParamError",
    "nixlNotFoundError",
]


class nixlNotFoundError(Exception):  # noqa: N801 - NIXL's own class names
    """``NIXL_ERR_NOT_FOUND``: a descriptor outside the registered memory, or an unknown agent."""

    def __init__(self, detail: str) -> None:
        super().__init__(f"NIXL_ERR_NOT_FOUND ({detail})")


class nixlInvalidParamError(Exception):  # noqa: N801
    """``NIXL_ERR_INVALID_PARAM``: bad indices, unequal lengths, released or mismatched handles."""

    def __init__(self, detail: str) -> None:
        super().__init__(f"NIXL_ERR_INVALID_PARAM ({detail})")


@dataclass(frozen=True)
class XferDList:
    """A transfer descriptor list: N x 3 ``uint64`` ``(addr, len, dev)`` and its memory type."""

    descs: np.ndarray
    mem_type: str

    def __len__(self) -> int:
        return int(self.descs.shape[0])


@dataclass
class _Handle:
    owner: str
    released: bool = False

    def release(self) -> None:
        self.released = True


@dataclass
class PreppedDList(_Handle):
    """What ``prep_xfer_dlist`` returns: the descriptors, prepared for ``agent`` (local side: ``None``)."""

    agent: str | None = None
    dlist: XferDList | None = None


@dataclass
class XferHandle(_Handle):
    """What ``make_prepped_xfer`` / ``initialize_xfer`` return: paired descriptors of one request."""

    op: str = "READ"
    remote: str = ""
    local_descs: np.ndarray = field(default_factory=lambda: np.zeros((0, 3), np.uint64))
    remote_descs: np.ndarray = field(default_factory=lambda: np.zeros((0, 3), np.uint64))
    notif: bytes = b""
    posts: int = 0


@dataclass(frozen=True)
class ExecutedTransfer:
    """One posted transfer: ``local_descs[i]`` of ``initiator`` paired with ``remote_descs[i]`` of ``remote``."""

    op: str
    initiator: str
    remote: str
    local_descs: np.ndarray
    remote_descs: np.ndarray
    notif: bytes


@dataclass(frozen=True)
class XferTelemetry:
    """NIXL's telemetry fields the double can know: bytes and descriptors after merging contiguous pairs."""

    totalBytes: int  # noqa: N815 - NIXL's field names
    descCount: int  # noqa: N815
    startTime: int = 0  # noqa: N815
    postDuration: int = 0  # noqa: N815
    xferDuration: int = 0  # noqa: N815
