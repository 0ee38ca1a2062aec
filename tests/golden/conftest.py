"""Fixtures over the golden cases recorded from vLLM 0.33.0 (loader: ``_golden.py``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from _golden import all_tables, load_table


@pytest.fixture(scope="session")
def golden() -> Callable[[str, str], list[dict[str, Any]]]:
    """``golden(stem, table)`` -> that table's cases."""
    return load_table


@pytest.fixture(scope="session")
def golden_tables() -> set[tuple[str, str]]:
    """Every ``(file stem, table)`` of the golden files."""
    return all_tables()
