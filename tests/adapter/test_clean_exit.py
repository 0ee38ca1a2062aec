"""The test process exits 0 after NIXL agents lived in it: a pytest session that opens agents in its own
process (an Endpoint on its own, a P and a D rank with a progress pump and side-channel servers) ends
with exit status 0 and no fatal-error report, with the fault handler on through interpreter shutdown.

This is the failure CI met once: every test passed, then the process died at exit with a segmentation
fault (an agent or a thread inside UCX still alive while the interpreter tore its modules down).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("nixl")
pytestmark = pytest.mark.nixl

ROOT = Path(__file__).resolve().parents[2]
SESSION = [
    "tests/adapter/test_endpoint.py",
    "tests/adapter/test_hostile.py::test_byte_drip_cannot_stretch_a_deadline",
    "tests/adapter/test_hostile.py::test_reconnects_collisions_and_notices_do_not_leak",
]


def test_a_session_with_in_process_agents_exits_zero():
    env = dict(os.environ, PYTHONFAULTHANDLER="1")
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-o", "addopts=", "-q", "-p", "no:cacheprovider", *SESSION],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    report = out.stdout[-3000:] + out.stderr[-3000:]
    assert out.returncode == 0, report
    assert "Fatal Python error" not in out.stderr, report
    assert " passed" in out.stdout and " failed" not in out.stdout, report
