"""bench/bench_mooncake.py runs: a short request through both transports, every byte of its first pull
checked, the numbers it reports consistent (both transports moved the plan's bytes; NIXL was handed the
plan's descriptor pairs, Mooncake at most as many after merging)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.usefixtures("mooncake_engine")


def test_bench_mooncake_smoke(tmp_path: Path) -> None:
    out = tmp_path / "b.json"
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "bench_mooncake.py"),
            "--tokens",
            "300",
            "--reps",
            "1",
            "--timeout",
            "240",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={"GLOG_minloglevel": "2", "PATH": "/usr/bin:/bin"},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["bad_bytes"] == {"nixl": 0, "mooncake": 0}
    assert res["bytes"] > 0
    assert res["nixl"]["bytes"] == res["mooncake"]["bytes"] == res["bytes"]
    assert res["nixl"]["descriptors"] == res["mooncake"]["descriptors"] == res["plan_descriptors"]
    assert 0 < res["mooncake"]["posted"] <= res["plan_descriptors"]
    assert res["mooncake"]["batches"] == 2  # one per P rank
    for k in ("nixl", "mooncake", "process_vm_readv", "memcpy"):
        assert res[k]["seconds"] > 0 and res[k]["gbps"] > 0
