"""Set-up of the serving tests (collected only with ``KVGEOM_SERVING_TESTS=1``, see ``tests/conftest.py``):
the tiny models (written once per session into a temporary folder), the per-model reference completions,
and the results table printed at the end (case, connector, mode, prompts, tokens equal, bytes moved, time).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from _models import build_model
from _servers import RESULTS


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {name: build_model(name, root / name) for name in ("dense", "nemotron_h")}


@pytest.fixture(scope="session")
def logs_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    keep = os.environ.get("KVGEOM_SERVING_LOGS")
    if keep:
        path = Path(keep)
        path.mkdir(parents=True, exist_ok=True)
        return path
    return tmp_path_factory.mktemp("logs")


@pytest.fixture(scope="session")
def references() -> dict[str, dict[str, list[int]]]:
    """model -> prompt -> the greedy token ids of one engine computing the prompt alone (filled by the first
    pair of each model, from its D engine before any transfer; every later D must agree)."""
    return {}


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if not RESULTS:
        return
    tr = terminalreporter
    tr.section("serving results")
    cols = (
        "case",
        "connector",
        "mode",
        "prompts",
        "tokens equal",
        "bytes moved",
        "failed",
        "errors",
        "time s",
    )
    tr.write_line("| " + " | ".join(cols) + " |")
    tr.write_line("|" + " --- |" * len(cols))
    for r in RESULTS:
        tr.write_line(
            f"| {r['case']} | {r['connector']} | {r['mode']} | {r['prompts']} | {r['equal']} of {r['prompts']}"
            f" | {r['bytes']:,} | {r['failed']} | {r.get('errors', 0)} | {r['time_s']:.1f} |"
        )
    starts = {
        f"{r['connector']} {r['mode']} {r['case'].split()[0]}": r.get("engines_start_s") for r in RESULTS
    }
    for name, s in starts.items():
        if s:
            tr.write_line(f"engines (A32, B32, C64) of {name}: started in {s:.0f} s")
    out = os.environ.get("KVGEOM_SERVING_RESULTS")
    if out:
        Path(out).write_text(json.dumps(RESULTS, indent=1))
