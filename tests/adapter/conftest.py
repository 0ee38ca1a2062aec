"""Make the repository root importable (``adapters`` is not installed as a package in every checkout;
spawned rank processes inherit this ``sys.path``)."""

from __future__ import annotations

import sys
from pathlib import Path

_ROOT = str(Path(__file__).resolve().parents[2])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)
