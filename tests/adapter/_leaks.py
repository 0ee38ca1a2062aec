"""Nothing an adapter test starts outlives it: every NIXL agent (``Endpoint``) it opens is closed and
every thread it starts has ended when the test returns.

An agent left open is destroyed at interpreter shutdown, after the modules its destructor needs are
gone, and a thread still inside NIXL or UCX then races the teardown: either can crash the test process
at exit, after every test has passed. So a leak is a test error here, named by the test that made it,
and the leaked agents are closed on the way (the run goes on clean).

``track_endpoints`` wraps ``Endpoint.__init__`` once per session to remember each agent weakly (the
transport itself keeps no registry: this is test tooling).
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Iterator
from typing import Any

_HELPERS = ("multiprocessing.resource_tracker", "multiprocessing.forkserver")  # they end with us
THREAD_GRACE_S = 10.0  # a thread a test ended (joined with a timeout, or closing) gets this long to go

_opened: weakref.WeakSet[Any] = weakref.WeakSet()


def track_endpoints() -> None:
    from kvgeom_nixl import agent

    init = agent.Endpoint.__init__
    if getattr(init, "_tracked", False):
        return

    def tracked(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        _opened.add(self)

    tracked._tracked = True  # type: ignore[attr-defined]
    agent.Endpoint.__init__ = tracked  # type: ignore[method-assign]


def open_endpoints() -> list[Any]:
    return [ep for ep in list(_opened) if not ep._closed]


def _new_threads(before: set[int]) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.ident not in before and t.is_alive()]


def leaks() -> Iterator[None]:
    """The body of the autouse fixture: yields to the test, then reports what it left running."""
    before = {t.ident for t in threading.enumerate()}
    had = set(map(id, open_endpoints()))
    yield
    left = [ep for ep in open_endpoints() if id(ep) not in had]
    for ep in left:
        ep.close()
    end = time.monotonic() + THREAD_GRACE_S
    while _new_threads(before) and time.monotonic() < end:
        time.sleep(0.05)
    threads = [t.name for t in _new_threads(before)]
    problems = []
    if left:
        problems.append(f"NIXL agent(s) left open: {[ep.name for ep in left]}")
    if threads:
        problems.append(f"thread(s) still running {THREAD_GRACE_S:.0f}s after the test: {threads}")
    if problems:
        raise RuntimeError("the test leaked: " + "; ".join(problems))


def _children() -> list[int]:
    """Our own child processes that are still running (Linux: /proc/self/task/*/children)."""
    import glob

    pids: list[int] = []
    for path in glob.glob("/proc/self/task/*/children"):
        try:
            with open(path) as f:
                pids += [int(x) for x in f.read().split()]
        except OSError:
            continue
    return pids


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f"{pid}: " + f.read().replace(b"\0", b" ").decode(errors="replace").strip()[:200]
    except OSError:
        return f"{pid}: (gone)"


def at_session_end() -> list[str]:
    """What is still alive when the session ends (module- and session-scoped fixtures included): agents
    are closed on the way; returns a line per leak for the run's report."""
    left = open_endpoints()
    for ep in left:
        ep.close()
    end = time.monotonic() + THREAD_GRACE_S
    main = threading.main_thread()
    while time.monotonic() < end and any(t is not main and t.is_alive() for t in threading.enumerate()):
        time.sleep(0.05)
    out = []
    if left:
        out.append(f"NIXL agent(s) open at the end of the session: {[ep.name for ep in left]}")
    threads = [t.name for t in threading.enumerate() if t is not main and t.is_alive()]
    if threads:
        out.append(f"thread(s) running at the end of the session: {threads}")
    kids = [k for k in _children() if not any(h in _cmdline(k) for h in _HELPERS)]
    if kids:
        out.append(f"child process(es) running at the end of the session: {[_cmdline(k) for k in kids]}")
    return out
