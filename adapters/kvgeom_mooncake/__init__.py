"""kvgeom's plans over Mooncake's transfer engine: a second transport beside :mod:`kvgeom_nixl`.

Geometry comes only from the ``kvgeom`` facade (``plan_request``, ``RequestPlan.moves``, ``check_writes``,
``receive_step``, ``push_writers``); this package posts, waits, fences and zeroes (docs/mooncake.md). It
imports no other adapter. ``mooncake`` is imported lazily (:mod:`kvgeom_mooncake.engine`): extra
``kvgeom[mooncake]``.
"""

from .batches import Batch, batches, merge_runs
from .engine import Engine, available
from .errors import (
    MISSING_HINT,
    EngineInitError,
    MooncakeMissing,
    MooncakeTransportError,
    NotifTimeout,
    PeerRefused,
    QuarantinedBlockError,
    RegistrationError,
    TransferFailed,
    TransferTimeout,
)
from .rank import (
    Held,
    MooncakeConfig,
    MooncakeRank,
    MoonResult,
    allocate,
    apply_receive,
    block_spans,
    zero_rows,
)

__all__ = [
    "Batch",
    "Engine",
    "EngineInitError",
    "Held",
    "MISSING_HINT",
    "MoonResult",
    "MooncakeConfig",
    "MooncakeMissing",
    "MooncakeRank",
    "MooncakeTransportError",
    "NotifTimeout",
    "PeerRefused",
    "QuarantinedBlockError",
    "RegistrationError",
    "TransferFailed",
    "TransferTimeout",
    "allocate",
    "apply_receive",
    "available",
    "batches",
    "block_spans",
    "merge_runs",
    "zero_rows",
]
