"""tests/mooncake: kvgeom's plans over Mooncake's transfer engine (kvgeom_mooncake), real engines in
separate processes. Without the transfer engine these tests fail, each with the install line: they are
not skipped (docs/testing.md)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

_ROOT = Path(__file__).resolve().parents[2]
# tests/transport: the rank harness both transports share (_transport_ranks.py, _transport_pair.py)
for _p in (str(_ROOT / "tests" / "transport"), str(_ROOT / "adapters"), str(_ROOT)):
    if _p not in sys.path:
        sys.path.insert(0, _p)


@pytest.fixture
def mooncake_engine() -> None:
    """Fail (not skip) with how to install the transfer engine when it does not load here."""
    from kvgeom_mooncake import available

    why = available()
    if why is not None:
        pytest.fail(why, pytrace=False)
