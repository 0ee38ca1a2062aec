"""Run ranks in separate processes, collect what they return, and never leave one behind.

Children are started with the ``spawn`` start method (a fresh interpreter: no inherited NIXL/UCX or
CUDA state, no forked threads). A child's return value or exception comes back through a queue as
data: a :class:`Result` with the pickled value, or the exception's ``repr`` and traceback text. A
child that dies without reporting (SIGKILL, segfault) is noticed through its exit code, so
:meth:`ProcGroup.collect` does not wait for it until the deadline.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue as queue_mod
import signal
import time
import traceback
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from kvgeom_nixl.errors import AdapterError

__all__ = ["Result", "ChildFailed", "Proc", "ProcGroup", "spawn"]

_CTX = mp.get_context("spawn")


class ChildFailed(AdapterError):
    """Raised by :meth:`Result.unwrap` for a child that raised, died or timed out."""


@dataclass(frozen=True)
class Result:
    """What a child process produced. ``ok`` is ``True`` with ``value`` set, or ``False`` with
    ``error`` (``repr`` of the exception, or why there is no result), ``error_type`` (qualified class
    name), ``traceback`` (text) and, for a dead child, ``exitcode`` (negative: killed by that signal)."""

    name: str
    ok: bool
    value: Any = None
    error: str | None = None
    error_type: str | None = None
    traceback: str | None = None
    exitcode: int | None = None
    elapsed_s: float | None = None

    def unwrap(self) -> Any:
        if self.ok:
            return self.value
        detail = f"\n--- child traceback ---\n{self.traceback}" if self.traceback else ""
        raise ChildFailed(f"child {self.name!r} failed: {self.error}{detail}", stage="child", peer=self.name)


def _child_main(
    target: Callable[..., Any], args: tuple, kwargs: dict, name: str, results: Any, netns: str | None = None
) -> None:
    t0 = time.monotonic()

    def failure(err: str, exc: BaseException) -> tuple:
        cls = type(exc)
        etype = f"{cls.__module__}.{cls.__qualname__}"
        return (name, False, None, err, etype, traceback.format_exc(), time.monotonic() - t0)

    try:
        if netns is not None:  # first thing, while this process is single-threaded
            from .netns import enter_netns

            enter_netns(netns)
        value = target(*args, **kwargs)
    except BaseException as e:  # report everything, including SystemExit/KeyboardInterrupt
        msg = failure(repr(e), e)
    else:
        try:  # pickle here, not in the queue's feeder thread, so that a failure is reported
            msg = (name, True, pickle.dumps(value), None, None, None, time.monotonic() - t0)
        except Exception as e:
            msg = failure(f"cannot send result: {e!r}", e)
    _flush_c_stdio()  # before reporting: the parent may end this process as soon as the result arrives
    results.put(msg)
    results.close()
    results.join_thread()  # make sure the message left this process before it exits


def _flush_c_stdio() -> None:
    """``fflush(NULL)``: a spawn child ends with ``os._exit``, which drops what C libraries (UCX's log file,
    ``UCX_LOG_FILE``) still buffer."""
    try:
        import ctypes

        ctypes.CDLL(None).fflush(None)
    except Exception:
        pass


class Proc:
    """A started child process (``spawn`` context)."""

    def __init__(self, process: Any, name: str) -> None:
        self.process = process
        self.name = name

    @property
    def pid(self) -> int | None:
        return self.process.pid

    @property
    def exitcode(self) -> int | None:
        return self.process.exitcode

    def is_alive(self) -> bool:
        return self.process.is_alive()

    def join(self, timeout_s: float | None = None) -> int | None:
        self.process.join(timeout_s)
        return self.process.exitcode

    def terminate(self) -> None:
        if self.process.is_alive():
            self.process.terminate()

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` (default SIGKILL) if the process is still running."""
        if self.process.is_alive() and self.process.pid is not None:
            try:
                os.kill(self.process.pid, sig)
            except ProcessLookupError:
                pass

    def __repr__(self) -> str:
        return f"Proc({self.name!r}, pid={self.pid}, alive={self.is_alive()}, exitcode={self.exitcode})"


def spawn(
    target: Callable[..., Any],
    args: Sequence[Any] = (),
    name: str | None = None,
    *,
    kwargs: dict[str, Any] | None = None,
    results: Any = None,
    daemon: bool = True,
    netns: str | None = None,
) -> Proc:
    """Start ``target(*args, **kwargs)`` in a fresh ``spawn`` process. ``target`` must be importable
    by name (a module-level function). Its outcome is put on ``results`` (a queue from
    :meth:`ProcGroup.queue` or ``multiprocessing.get_context("spawn").Queue()``) if given. With ``netns``
    the child first enters that network namespace (a host of a :class:`~kvgeom_lab.netns.VirtualNet`):
    its sockets, and UCX's view of network devices, are that host's."""
    name = name or getattr(target, "__name__", "child")
    if results is None:
        results = _CTX.Queue()
    p = _CTX.Process(
        target=_child_main,
        args=(target, tuple(args), dict(kwargs or {}), name, results, netns),
        name=name,
        daemon=daemon,
    )
    p.start()
    return Proc(p, name)


class ProcGroup:
    """Start child processes, collect their results with a deadline, and end every one of them.

    On exit (normal or by exception) each survivor gets SIGTERM, then SIGKILL after ``term_grace_s``,
    with joins bounded by ``join_timeout_s``::

        with ProcGroup() as g:
            g.spawn(prefill_main, (cfg,), "P")
            g.spawn(decode_main, (cfg,), "D")
            results = g.collect(timeout_s=30)   # {"P": Result, "D": Result}
    """

    def __init__(self, *, term_grace_s: float = 1.0, join_timeout_s: float = 3.0) -> None:
        self.ctx = _CTX
        self.term_grace_s = term_grace_s
        self.join_timeout_s = join_timeout_s
        self._results_q = _CTX.Queue()
        self._queues: list[Any] = [self._results_q]
        self.procs: dict[str, Proc] = {}
        self.results: dict[str, Result] = {}
        self._t0: dict[str, float] = {}

    def queue(self) -> Any:
        """A fresh ``spawn``-context queue for coordination between parent and children (closed on exit)."""
        q = _CTX.Queue()
        self._queues.append(q)
        return q

    def spawn(
        self,
        target: Callable[..., Any],
        args: Sequence[Any] = (),
        name: str | None = None,
        *,
        kwargs: dict[str, Any] | None = None,
        netns: str | None = None,
    ) -> Proc:
        name = name or getattr(target, "__name__", "child")
        if name in self.procs:
            raise ValueError(f"a child named {name!r} already exists in this group")
        proc = spawn(target, args, name, kwargs=kwargs, results=self._results_q, netns=netns)
        self.procs[name] = proc
        self._t0[name] = time.monotonic()
        return proc

    def start(self, specs: Iterable[tuple[Callable[..., Any], Sequence[Any], str]]) -> list[Proc]:
        """Start N children from ``(target, args, name)`` triples."""
        return [self.spawn(t, a, n) for t, a, n in specs]

    def _record(self, msg: tuple) -> None:
        name, ok, blob, err, etype, tb, elapsed = msg
        if ok:
            try:
                value = pickle.loads(blob)
            except Exception as e:
                self.results[name] = Result(
                    name,
                    False,
                    error=f"cannot unpickle result: {e!r}",
                    error_type=type(e).__qualname__,
                    elapsed_s=elapsed,
                )
                return
            self.results[name] = Result(name, True, value=value, elapsed_s=elapsed)
        else:
            self.results[name] = Result(
                name, False, error=err, error_type=etype, traceback=tb, elapsed_s=elapsed
            )

    def _drain(self, timeout_s: float) -> bool:
        try:
            msg = (
                self._results_q.get(timeout=max(0.0, timeout_s))
                if timeout_s > 0
                else self._results_q.get_nowait()
            )
        except queue_mod.Empty:
            return False
        self._record(msg)
        return True

    def collect(
        self, timeout_s: float, names: Iterable[str] | None = None, *, dead_grace_s: float = 0.3
    ) -> dict[str, Result]:
        """Wait up to ``timeout_s`` for the results of ``names`` (default: every child). A child that
        exited without a result (after ``dead_grace_s`` for its message to arrive) and one still
        running at the deadline get an ``ok=False`` result saying so. Never raises for child failures."""
        wanted = list(self.procs) if names is None else list(names)
        for n in wanted:
            if n not in self.procs:
                raise KeyError(f"no child named {n!r}")
        deadline = time.monotonic() + timeout_s
        dead_since: dict[str, float] = {}
        while True:
            pending = [n for n in wanted if n not in self.results]
            if not pending:
                break
            now = time.monotonic()
            for n in pending:
                p = self.procs[n]
                if p.is_alive():
                    continue
                first = dead_since.setdefault(n, now)
                if now - first >= dead_grace_s:
                    self.results[n] = Result(
                        n,
                        False,
                        error=f"exited with code {p.exitcode} without a result",
                        exitcode=p.exitcode,
                        elapsed_s=now - self._t0[n],
                    )
            if now >= deadline:
                for n in pending:
                    if n not in self.results:
                        self.results[n] = Result(
                            n,
                            False,
                            error=f"no result within {timeout_s:.3g}s (still running)",
                            elapsed_s=now - self._t0[n],
                        )
                break
            self._drain(min(0.05, deadline - now))
        out = {}
        for n in wanted:
            r = self.results[n]
            if r.exitcode is None and not self.procs[n].is_alive():
                r = replace(r, exitcode=self.procs[n].exitcode)
            out[n] = r
        return out

    def close(self) -> None:
        """End every child: SIGTERM, bounded join, SIGKILL, bounded join. Idempotent."""
        alive = [p for p in self.procs.values() if p.is_alive()]
        for p in alive:
            p.terminate()
        end = time.monotonic() + self.term_grace_s
        for p in alive:
            p.join(max(0.0, end - time.monotonic()))
        for p in alive:
            if p.is_alive():
                p.kill()
        end = time.monotonic() + self.join_timeout_s
        for p in alive:
            p.join(max(0.0, end - time.monotonic()))
        for q in self._queues:
            try:
                q.cancel_join_thread()
                q.close()
            except Exception:
                pass
        self._queues = []

    def __enter__(self) -> ProcGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
