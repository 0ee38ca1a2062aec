"""kvgeom.testing: check any KV/SSM transfer plan byte by byte.

* :mod:`~kvgeom.testing.oracle` -- the byte oracle (docs/vllm-behaviour.md Part D): :class:`Request`, :func:`run_pull`,
  :func:`run_push`, :func:`check_moves`, :class:`Oracle`, :class:`Report`;
* :mod:`~kvgeom.testing.nixl_double` -- a recording stand-in for ``nixl_agent`` whose transfers
  resolve into byte moves for the oracle;
* :mod:`~kvgeom.testing.strategies` -- hypothesis strategies of models, engine pairs and requests
  (imported on first use: hypothesis is needed only there).
"""

from __future__ import annotations

from typing import Any

from kvgeom.testing._coords import POISON, ZERO, CoordSpace, describe_tag
from kvgeom.testing._layout import LayoutError
from kvgeom.testing._report import INVARIANTS, Report, Violation
from kvgeom.testing.nixl_double import NixlFabric, RecordingAgent, fake_bases
from kvgeom.testing.oracle import (
    Oracle,
    RankPlan,
    Request,
    RequestError,
    check_moves,
    engine_geometries,
    pull_plans,
    push_plans,
    run,
    run_plans,
    run_pull,
    run_push,
)

__all__ = [
    "CoordSpace",
    "INVARIANTS",
    "LayoutError",
    "NixlFabric",
    "Oracle",
    "POISON",
    "RankPlan",
    "RecordingAgent",
    "Report",
    "Request",
    "RequestError",
    "Violation",
    "ZERO",
    "check_moves",
    "describe_tag",
    "engine_geometries",
    "fake_bases",
    "pull_plans",
    "push_plans",
    "run",
    "run_plans",
    "run_pull",
    "run_push",
    "strategies",
]


def __getattr__(name: str) -> Any:
    if name == "strategies":  # lazy: hypothesis is only needed by the strategies
        import importlib

        return importlib.import_module(".strategies", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
