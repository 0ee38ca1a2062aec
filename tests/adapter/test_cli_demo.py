"""`kvgeom demo --json` end to end: real NIXL agents in separate processes, one JSON object with the verdict."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.nixl
def test_demo_json_passes() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "kvgeom", "demo", "--json", "--tokens", "97", "640", "--timeout", "200"],
        capture_output=True,
        text=True,
        timeout=260,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = json.loads(proc.stdout)
    assert data["ok"] and data["command"] == "demo" and data["requests"] == [97, 640]
    assert data["scenario"]["model"] == "demo-mamba2-hybrid"
    assert any(line.strip().startswith("verification") and "PASS" in line for line in data["report"])
