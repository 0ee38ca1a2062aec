"""The test host and the demo of kvgeom's NIXL transport: a process launcher for multi-rank runs
(``procs``), P and D engines run end to end with faults and every byte checked (``cluster``), hosts as
network namespaces with an etcd member (``netns``), a userspace link impairer (``impair``), cross-host
fault scenarios (``hostrun``), UCX's own report of what carried the bytes (``ucxinfo``) and ``kvgeom
demo`` (``demo``, the core command line's ``demo`` plugin).

A leaf above the transport: it imports :mod:`kvgeom_nixl` and :mod:`kvgeom.testing` (the independent
layout model the checks use); the transport imports nothing of it. Importing this package is cheap
(``nixl`` and ``torch`` load in the rank processes). See ``docs/architecture.md`` and ``docs/testing.md``.
"""

from .procs import ChildFailed, Proc, ProcGroup, Result, spawn

__all__ = ["ChildFailed", "Proc", "ProcGroup", "Result", "spawn"]
