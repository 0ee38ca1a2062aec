"""NIXL transport for kvgeom: bounded, typed wrappers around a NIXL agent, an authenticated TCP side
channel for the handshake, discovery through etcd and fencing of failed transfers. The test host and the
demo (process launcher, clusters, network namespaces as hosts) live in ``kvgeom_lab``, which this
package does not import.

Importing this package is cheap: ``nixl`` and ``torch`` are imported only when an
:class:`Endpoint` is created or tensors are registered. See ``docs/adapter.md``.
"""

from .agent import Endpoint, Prepped, Region, Telemetry, Transfer, descs_from_regions
from .auth import Auth, Notice, decode_notice, encode_notice
from .config import TransportConfig
from .errors import (
    AdapterError,
    AuthenticationError,
    DiscoveryError,
    HandshakeTimeout,
    NotifTimeout,
    PeerGone,
    PeerUnknown,
    ProtocolError,
    QuarantinedBlockError,
    ReplayError,
    StaleMetadata,
    TransferError,
)
from .fence import Fence, Held
from .sidechannel import (
    Session,
    SideChannelServer,
    check_generation,
    fetch,
    make_payload,
    open_payload,
    query_generation,
    seal_payload,
    validate_payload,
)

__all__ = [
    "TransportConfig",
    "Auth",
    "Notice",
    "encode_notice",
    "decode_notice",
    "Fence",
    "Held",
    "seal_payload",
    "open_payload",
    "validate_payload",
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
    "Session",
    "AdapterError",
    "HandshakeTimeout",
    "ProtocolError",
    "AuthenticationError",
    "ReplayError",
    "TransferError",
    "NotifTimeout",
    "PeerGone",
    "PeerUnknown",
    "QuarantinedBlockError",
    "StaleMetadata",
    "DiscoveryError",
]
