"""Run vLLM's own Mooncake connector tests through kvgeom: ``pytest -p kvgeom_vllm.mooncake.pytest_plugin``.

Before any test module is imported, the plugin puts kvgeom's Mooncake integration in place of vLLM's
everywhere vLLM's modules hold it: the worker, scheduler and connector classes become
:mod:`kvgeom_vllm.mooncake.connector`'s subclasses, vLLM's ``TransferTopology`` kvgeom_vllm's, and the
module functions the tests import by name (``_compute_sender_transfer_plan``, ...) kvgeom's counted
adapters. At the end it prints, per row of :data:`kvgeom_vllm.mooncake.table.TABLE`, the calls that
reached kvgeom, and the outcomes per file; a row that got no call fails the run (a pass must not come
from vLLM's own code).
"""

from __future__ import annotations

import sys
from collections import Counter, defaultdict
from typing import Any

import pytest

from .table import CALLS, EXERCISED, REFUSED, TABLE

_OUTCOMES: dict[str, Counter[str]] = defaultdict(Counter)


def _replace_everywhere(original: Any, replacement: Any) -> int:
    n = 0
    for name, mod in list(sys.modules.items()):
        if not name.startswith("vllm") or mod is None:
            continue
        for attr, value in list(vars(mod).items()):
            if value is original:
                setattr(mod, attr, replacement)
                n += 1
    return n


def install() -> None:
    """Put kvgeom's Mooncake integration in place of vLLM's (for vLLM's own tests; see the module doc)."""
    from kvgeom_vllm import worker

    from . import connector

    mc = connector._mc
    for e in TABLE:
        if e.kind == "function":
            answer = connector.counted(e)
            _replace_everywhere(connector.DISPATCHERS[e.qualname], answer)
    classes = [
        (worker._TransferTopology, worker.KvgeomTransferTopology),
        (mc.MooncakeConnectorWorker, connector.KvgeomMooncakeConnectorWorker),
        (mc.MooncakeConnectorScheduler, connector.KvgeomMooncakeConnectorScheduler),
        (mc.MooncakeConnector, connector.KvgeomMooncakeConnector),
    ]
    for original, replacement in classes:
        _replace_everywhere(original, replacement)


def pytest_configure(config: Any) -> None:
    install()


def pytest_runtest_logreport(report: Any) -> None:
    file = report.nodeid.split("::", 1)[0]
    if report.when == "call" or (report.when == "setup" and not report.passed):
        _OUTCOMES[file][report.outcome] += 1


def _zero_rows() -> list[str]:
    return [e.qualname for e in EXERCISED if CALLS[e.qualname] == 0]


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: Any) -> None:
    tr = terminalreporter
    tr.section("kvgeom_vllm.mooncake: calls that reached kvgeom, per vLLM Mooncake geometry function")
    width = max(len(e.qualname) for e in TABLE)
    for e in TABLE:
        tr.write_line(
            f"  {e.qualname:<{width}}  {CALLS[e.qualname]:>7} calls  {REFUSED[e.qualname]:>5} refused   <- {e.kvgeom}"
        )
    tr.write_line(f"  total: {sum(CALLS[e.qualname] for e in TABLE)} calls reached kvgeom")
    tr.section("kvgeom_vllm.mooncake: outcomes per test file")
    for file in sorted(_OUTCOMES):
        c = _OUTCOMES[file]
        tr.write_line(
            f"  {file}: " + ", ".join(f"{c[k]} {k}" for k in ("passed", "failed", "skipped") if c[k])
        )
    zero = _zero_rows()
    if zero:
        tr.write_line(
            f"  FAILED: no call reached kvgeom for {zero}: a pass there would come from vLLM's own code",
            red=True,
        )


def pytest_sessionfinish(session: Any, exitstatus: int) -> None:
    if _zero_rows() and session.testscollected:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
