"""docs/mutation-equivalents.md lists exactly the recorded equivalent mutants (it is generated from the
JSON files by ``tests/mutation/mutate.py --write-docs``; a stale page would hide or invent a reason)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _mutate():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("kvgeom_mutate", ROOT / "tests" / "mutation" / "mutate.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_equivalents_page_is_generated_from_the_json_files() -> None:
    mutate = _mutate()
    entries = mutate.load_equivalents()
    page = (ROOT / "docs" / "mutation-equivalents.md").read_text()
    assert page == mutate.equivalents_doc(entries)
    # every entry carries a reason and names a module and function; none is recorded twice
    keys = [(e["module"], e["function"], e["before"], e["after"]) for e in entries]
    assert len(keys) == len(set(keys))
    assert all(e["reason"].strip() and e["module"] and e["function"] for e in entries)
    files = [
        ROOT / "tests" / "mutation" / "equivalents.json",
        *sorted((ROOT / "tests/mutation/equivalents").glob("*.json")),
    ]
    assert len(entries) == sum(len(json.loads(f.read_text())["equivalents"]) for f in files)


def test_every_recorded_equivalent_names_a_function_that_holds_its_line() -> None:
    # an entry whose code moved or is gone would hide nothing (or a different mutant): the redesign's moves
    # re-key them and its removals drop them, with `mutate.py --fix-stale`
    mutate = _mutate()
    stale = mutate.stale_equivalents(mutate.load_equivalents())
    assert [(e["module"], e["function"], e["before"], new) for e, new in stale] == []


def test_a_moved_line_is_found_in_the_function_that_now_holds_it() -> None:
    mutate = _mutate()
    moved = {
        "module": "plan.descids",
        "function": "x_desc_segments",
        "before": "grid = np.asarray(attn, dtype=np.int64)",
    }
    gone = {**moved, "before": "grid = np.asarray(attn, dtype=np.int32)"}
    kept = {**moved, "function": "x__attention_segments"}
    assert mutate.stale_equivalents([moved, gone, kept]) == [(moved, "x__attention_segments"), (gone, None)]
