"""Run vLLM's own NIXL connector tests through kvgeom: ``pytest -p kvgeom_vllm.pytest_plugin ...``.

Before any test module is imported, the plugin puts kvgeom's integration in place of vLLM's NIXL
geometry everywhere vLLM's modules hold it: the worker, scheduler, connector, topology, conv-split and
metadata classes become kvgeom_vllm's subclasses, and the module functions the tests import by name
(``compute_tp_mapping``, ``derive_mamba_conv_split``, ...) become kvgeom's counted adapters. A test
module's ``from x import y`` then binds kvgeom's object.

At the end it prints, per row of :data:`kvgeom_vllm.table.TABLE`, how many calls reached kvgeom (and how
many kvgeom refused), and the outcomes per test file. A row that vLLM's tests exercise and that got no
call fails the run: a pass must not come from vLLM's own code.
"""

from __future__ import annotations

from typing import Any

import pytest

from ._plugin_report import Outcomes, replace_everywhere, write_zero_rows, zero_rows
from .table import CALLS, EXERCISED, REFUSED, TABLE

_OUTCOMES = Outcomes()


def pytest_addoption(parser: Any) -> None:
    group = parser.getgroup("kvgeom_vllm")
    group.addoption(
        "--kvgeom-no-zero-check",
        action="store_true",
        help="do not fail the run when an exercised function got no call",
    )


def install() -> None:
    """Put kvgeom_vllm in place of vLLM's NIXL geometry (for vLLM's own tests; see the module doc)."""
    from .version import check_vllm_version

    check_vllm_version()
    import importlib

    from . import connector, metadata, worker
    from .answers import ORIGINAL_CONV_SPLIT_INFO

    for e in TABLE:  # module functions: the tests import them by name
        if e.kind == "function":
            mod = importlib.import_module(e.module)
            answer = worker.counted(e)
            if e.qualname in worker.DISPATCHERS:  # in the tests every call goes to kvgeom, whoever makes it
                replace_everywhere(worker.DISPATCHERS[e.qualname], answer)
            replace_everywhere(getattr(mod, e.attr), answer)
    classes = [
        (worker._TransferTopology, worker.KvgeomTransferTopology),
        (ORIGINAL_CONV_SPLIT_INFO, worker.KvgeomConvSplitInfo),
        (worker._BaseWorker, worker.KvgeomBaseWorker),
        (worker._PullWorker, worker.KvgeomPullConnectorWorker),
        (worker._PushWorker, worker.KvgeomPushConnectorWorker),
        (worker._PullScheduler, worker.KvgeomPullConnectorScheduler),
        (worker._PushScheduler, worker.KvgeomPushConnectorScheduler),
        (metadata.PlainAgentMetadata, metadata.KvgeomAgentMetadata),
        (connector._nixl.NixlPullConnector, connector.KvgeomNixlConnector),
        (connector._nixl.NixlPushConnector, connector.KvgeomNixlPushConnector),
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
    tr.section("kvgeom_vllm: calls that reached kvgeom, per vLLM geometry function")
    width = max(len(e.qualname) for e in TABLE)
    for e in TABLE:
        mark = "" if e.exercised else " (not reached by these tests)"
        tr.write_line(
            f"  {e.qualname:<{width}}  {CALLS[e.qualname]:>7} calls  {REFUSED[e.qualname]:>5} refused"
            f"   <- {e.kvgeom}{mark}"
        )
    tr.write_line(f"  total: {sum(CALLS[e.qualname] for e in TABLE)} calls reached kvgeom")
    from .metadata import CARDLESS, CARDLESS_EXAMPLE

    if CARDLESS:
        tr.write_line(
            "  ranks registered without a kvgeom card (vLLM-compatible mode pairs them on the numbers they "
            "advertise), by the field kvgeom could not describe:"
        )
        for field, n in CARDLESS.most_common():
            tr.write_line(f"    {field} x{n}, e.g. {CARDLESS_EXAMPLE[field][:160]}")
    _OUTCOMES.write(tr, "kvgeom_vllm: outcomes per test file")
    zero = _zero_rows()
    if zero and not config.getoption("--kvgeom-no-zero-check"):
        write_zero_rows(tr, zero)


def pytest_sessionfinish(session: Any, exitstatus: int) -> None:
    if _zero_rows() and not session.config.getoption("--kvgeom-no-zero-check") and session.testscollected:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
