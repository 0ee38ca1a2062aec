"""``bench/bench_descs.py`` end to end on a short request (real NIXL, a P and a D process): every byte of
each posting path checked, and kvgeom mode posting exactly the minimal contiguous runs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("nixl")

pytestmark = pytest.mark.nixl
ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("ids", ["sequential", "shuffled"])
def test_bench_descs_posts_the_minimal_runs_and_moves_every_byte(tmp_path, ids):
    out = tmp_path / "descs.json"
    cmd = [sys.executable, "bench/bench_descs.py", "--tokens", "1024", "--reps", "1", "--ids", ids]
    proc = subprocess.run(
        cmd + ["--json", str(out), "--timeout", "150"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
        start_new_session=True,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    res = json.loads(out.read_text())["results"]
    for op in ("pull", "push"):
        row = res[op]["1024"]
        assert row["runs"] < row["ids"]["pairs"]  # the pair has something to merge
        for path in ("initialize", "prep", "ids"):
            assert row[path]["bad_moves"] == 0, (op, path)
            assert row[path]["pairs"] == row["ids"]["pairs"]
        assert row["initialize"]["posted"] == row["prep"]["posted"] == row["runs"], (op, row)
        assert row["ids"]["posted"] >= row["runs"]
