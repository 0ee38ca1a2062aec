"""What both pytest plugins (:mod:`kvgeom_vllm.pytest_plugin`, :mod:`kvgeom_vllm.mooncake.pytest_plugin`) share:
putting kvgeom's object in place of vLLM's in every loaded vLLM module, the outcomes per test file, and the
rule that a table row vLLM's tests exercise but no call reached fails the run."""

from __future__ import annotations

import sys
from collections import Counter, defaultdict
from collections.abc import Iterable
from typing import Any


def replace_everywhere(original: Any, replacement: Any) -> int:
    """Replace ``original`` by ``replacement`` in every loaded vLLM module that holds it; the number of places."""
    n = 0
    for name, mod in list(sys.modules.items()):
        if not name.startswith("vllm") or mod is None:
            continue
        for attr, value in list(vars(mod).items()):
            if value is original:
                setattr(mod, attr, replacement)
                n += 1
    return n


class Outcomes:
    """Test outcomes per file, as pytest reports them (a failed setup counts as the test's outcome)."""

    def __init__(self) -> None:
        self.by_file: dict[str, Counter[str]] = defaultdict(Counter)

    def record(self, report: Any) -> None:
        file = report.nodeid.split("::", 1)[0]
        if report.when == "call" or (report.when == "setup" and not report.passed):
            self.by_file[file][report.outcome] += 1

    def write(self, tr: Any, title: str) -> None:
        tr.section(title)
        for file in sorted(self.by_file):
            c = self.by_file[file]
            tr.write_line(
                f"  {file}: " + ", ".join(f"{c[k]} {k}" for k in ("passed", "failed", "skipped") if c[k])
            )


def zero_rows(exercised: Iterable[Any], calls: Counter[str]) -> list[str]:
    """The exercised rows no call reached."""
    return [e.qualname for e in exercised if calls[e.qualname] == 0]


def write_zero_rows(tr: Any, zero: list[str]) -> None:
    if zero:
        tr.write_line(
            f"  FAILED: no call reached kvgeom for {zero}: a pass there would come from vLLM's own code",
            red=True,
        )
