"""Fixtures for the cross-host tests: hosts are network namespaces (``kvgeom_lab.netns``), every test
runs under a watchdog, and nothing a test creates survives it.

* ``no_leftovers`` (session): fails the run if an earlier run left namespaces behind (a test process
  killed before it could clean up), and removes them, so that the next run starts clean.
* ``watchdog``: the test's overall bound; past it the test fails with ``TestTimeout`` (SIGALRM), and the
  fixtures below still clean up.
* ``lab`` / ``etcd_lab``: a :class:`kvgeom_lab.hostrun.Lab` (hosts p, b, d, e; with an etcd member on e),
  closed after the test, which then checks that its namespaces and processes are gone.

The tests need root and Debian's iproute2, ethtool, etcd-server and iperf3 (``make test`` installs them
with apt-get when they are missing, see the Makefile's ``host-deps``).
"""

from __future__ import annotations

import signal
from collections.abc import Iterator

import pytest
from kvgeom_lab.hostrun import Lab
from kvgeom_lab.netns import missing_tools, remove_leftovers

TEST_BOUND_S = 150.0


class TestTimeout(Exception):
    """The test ran past its overall bound."""


@pytest.fixture(scope="session")
def no_leftovers() -> None:
    missing = missing_tools()
    assert not missing, f"the cross-host tests need {missing} (as root: make host-deps)"
    left = remove_leftovers()
    assert not left, f"an earlier run left these network namespaces behind (removed now): {left}"


@pytest.fixture
def watchdog(request: pytest.FixtureRequest) -> Iterator[None]:
    bound = getattr(request.node.get_closest_marker("bound"), "args", (TEST_BOUND_S,))[0]

    def expired(signum: int, frame: object) -> None:
        raise TestTimeout(f"{request.node.name} ran past its bound of {bound:.0f}s")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, bound)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _closed(lab: Lab) -> None:
    procs = list(lab.net._procs)
    lab.close()
    assert lab.net.remaining() == [], f"namespaces left after the test: {lab.net.remaining()}"
    alive = [p.args for p in procs if p.poll() is None]
    assert not alive, f"processes left after the test: {alive}"


@pytest.fixture
def lab(no_leftovers: None, watchdog: None) -> Iterator[Lab]:
    with Lab(etcd=False, proto_logs=True) as the_lab:
        yield the_lab
        _closed(the_lab)


@pytest.fixture
def etcd_lab(no_leftovers: None, watchdog: None) -> Iterator[Lab]:
    with Lab(etcd=True, proto_logs=True) as the_lab:
        yield the_lab
        _closed(the_lab)
