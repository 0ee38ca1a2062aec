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
import pytest  # noqa: E402
from _hosts import etcd_lab, lab, no_leftovers, watchdog  # noqa: E402, F401
from _leaks import at_session_end, leaks, track_endpoints  # noqa: E402

track_endpoints()


@pytest.fixture(autouse=True)
def _nothing_outlives_the_test():
    """Every NIXL agent and thread an adapter test starts has ended when it returns (see _leaks.py)."""
    yield from leaks()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Nothing is alive when the interpreter shuts down: a leak that no single test owns (a module or
    session fixture's) fails the run here, before shutdown, instead of crashing it after."""
    problems = at_session_end()
    if problems:
        print("\n" + "\n".join(f"leak: {p}" for p in problems))
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
