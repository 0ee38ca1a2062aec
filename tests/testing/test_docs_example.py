"""The worked example of ``docs/testing.md`` runs as written: its code block is executed here."""

from __future__ import annotations

import re
from pathlib import Path

DOC = Path(__file__).resolve().parents[2] / "docs" / "testing.md"


def _example() -> dict:
    text = DOC.read_text(encoding="utf-8")
    block = re.search(r"<!-- example:start -->\s*```python\n(.*?)```\s*<!-- example:end -->", text, re.S)
    assert block, "docs/testing.md lost its example markers"
    namespace: dict = {"__name__": "docs_testing_example"}
    exec(compile(block.group(1), str(DOC), "exec"), namespace)  # noqa: S102 - our own documentation
    return namespace


def test_docs_quick_start() -> None:
    text = DOC.read_text(encoding="utf-8")
    block = re.search(r"## Checking one request\s*```python\n(.*?)```", text, re.S)
    assert block, "docs/testing.md lost its quick start"
    exec(compile(block.group(1), str(DOC), "exec"), {"__name__": "docs_quick_start"})  # noqa: S102


def test_docs_example_worked_case() -> None:
    _example()["test_toy_connector_gqa_tp4_to_tp1"]()


def test_docs_example_property() -> None:
    _example()["test_toy_connector_moves_the_right_bytes"]()
