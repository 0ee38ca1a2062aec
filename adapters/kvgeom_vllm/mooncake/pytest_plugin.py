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

from typing import Any

import pytest

from kvgeom_vllm._plugin_report import Outcomes, replace_everywhere, write_zero_rows, zero_rows

from .table import CALLS, EXERCISED, REFUSED, TABLE

_OUTCOMES = Outcomes()


def install() -> None:
    """Put kvgeom's Mooncake integration in place of vLLM's (for vLLM's own tests; see the module doc)."""
    from kvgeom_vllm import worker

    from . import connector

    mc = connector._mc
    for e in TABLE:
        if e.kind == "function":
            answer = connector.counted(e)
            replace_everywhere(connector.DISPATCHERS[e.qualname], answer)
    classes = [
        (worker._TransferTopology, worker.KvgeomTransferTopology),
        (mc.MooncakeConnectorWorker, connector.KvgeomMooncakeConnectorWorker),
        (mc.MooncakeConnectorScheduler, connector.KvgeomMooncakeConnectorScheduler),
        (mc.MooncakeConnector, connector.KvgeomMooncakeConnector),
    ]
    for original, replacement in classes:
        replace_everywhere(original, replacement)


def pytest_configure(config: Any) -> None:
    install()


def pytest_runtest_logreport(report: Any) -> None:
    _OUTCOMES.record(report)


def _zero_rows() -> list[str]:
    return zero_rows(EXERCISED, CALLS)


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: Any) -> None:
    tr = terminalreporter
    tr.section("kvgeom_vllm.mooncake: calls that reached kvgeom, per vLLM Mooncake geometry function")
    width = max(len(e.qualname) for e in TABLE)
    for e in TABLE:
        tr.write_line(
            f"  {e.qualname:<{width}}  {CALLS[e.qualname]:>7} calls  {REFUSED[e.qualname]:>5} refused   <- {e.kvgeom}"
        )
    tr.write_line(f"  total: {sum(CALLS[e.qualname] for e in TABLE)} calls reached kvgeom")
    _OUTCOMES.write(tr, "kvgeom_vllm.mooncake: outcomes per test file")
    zero = _zero_rows()
    if zero:
        write_zero_rows(tr, zero)


def pytest_sessionfinish(session: Any, exitstatus: int) -> None:
    if _zero_rows() and session.testscollected:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
