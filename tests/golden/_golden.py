"""Loader of the golden cases recorded from vLLM 0.33.0 (see tests/data/golden/SOURCE.md)."""

from __future__ import annotations

import gzip
import json
from functools import cache
from pathlib import Path
from typing import Any

GOLDEN_DIR = Path(__file__).resolve().parents[1] / "data" / "golden"


@cache
def load_section(stem: str) -> dict[str, Any]:
    """The whole golden file ``<stem>.json.gz`` (envelope with ``tables``), loaded once per session."""
    with gzip.open(GOLDEN_DIR / f"{stem}.json.gz", "rt", encoding="utf-8") as fh:
        data: dict[str, Any] = json.load(fh)
    assert data["schema_version"] == 1 and data["vllm_version"] == "0.33.0", (stem, data.get("vllm_version"))
    return data


def load_table(stem: str, table: str) -> list[dict[str, Any]]:
    """The cases of one table, checked against the counts the file declares."""
    entry = load_section(stem)["tables"][table]
    cases: list[dict[str, Any]] = entry["cases"]
    assert len(cases) == entry["count"], (stem, table, len(cases), entry["count"])
    assert sum("error" in c for c in cases) == entry["errors"], (stem, table)
    return cases


def all_tables() -> set[tuple[str, str]]:
    """Every ``(file stem, table)`` present in the golden directory."""
    found: set[tuple[str, str]] = set()
    for path in sorted(GOLDEN_DIR.glob("*.json.gz")):
        stem = path.name.removesuffix(".json.gz")
        found |= {(stem, table) for table in load_section(stem)["tables"]}
    return found
