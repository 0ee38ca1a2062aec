"""Make the repository's packages importable in checkouts where kvgeom is not installed (``kvgeom`` at the
root, ``kvgeom_nixl`` under ``adapters/``); spawned rank processes inherit this ``sys.path``."""

from __future__ import annotations

import sys
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[2]
for _p in (str(_ROOT / "adapters"), str(_ROOT)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

# the cross-host tests' fixtures (network namespaces, etcd, the per-test watchdog): see _hosts.py
from _hosts import etcd_lab, lab, no_leftovers, watchdog  # noqa: E402, F401
