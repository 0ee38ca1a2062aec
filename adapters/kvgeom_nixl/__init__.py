"""NIXL transport for kvgeom: bounded, typed wrappers around a NIXL agent, a TCP side channel for the
handshake, and a process launcher for multi-rank runs and tests.

Importing this package is cheap: ``nixl`` and ``torch`` are imported only when an
:class:`Endpoint` is created or tensors are registered. See ``docs/adapter.md``.
"""

from .agent import Endpoint, Prepped, Region, Telemetry, Transfer, descs_from_regions
from .config import TransportConfig
from .errors import (
    AdapterError,
    HandshakeTimeout,
    NotifTimeout,
    PeerGone,
    ProtocolError,
    StaleMetadata,
    TransferError,
)
from .procs import ChildFailed, Proc, ProcGroup, Result, spawn
from .sidechannel import SideChannelServer, check_generation, fetch, make_payload, query_generation

__all__ = [
    "TransportConfig",
    "Endpoint",
    "Region",
    "Prepped",
    "Transfer",
    "Telemetry",
    "descs_from_regions",
    "SideChannelServer",
    "make_payload",
    "fetch",
    "query_generation",
    "check_generation",
    "spawn",
    "Proc",
    "ProcGroup",
    "Result",
    "ChildFailed",
    "AdapterError",
    "HandshakeTimeout",
    "ProtocolError",
    "TransferError",
    "NotifTimeout",
    "PeerGone",
    "StaleMetadata",
]
