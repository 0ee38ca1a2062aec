"""``bench/bench_e2e_vllm.py`` on a short request (real NIXL, a P and a D process, vLLM's own pull worker beside
kvgeom's KVRank, pull and push): both moved exactly the request's bytes, into equal D caches, and kvgeom posted the fewest
descriptors. No timing is asserted."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.nixl
ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(("op", "ids"), [("pull", "sequential"), ("pull", "shuffled"), ("push", "shuffled")])
def test_bench_e2e_vllm_moves_the_same_bytes_as_vllm_with_the_fewest_descriptors(tmp_path, op, ids):
    out = tmp_path / "e2e.json"
    cmd = [
        sys.executable,
        "bench/bench_e2e_vllm.py",
        "--op",
        op,
        "--tokens",
        "1024",
        "--reps",
        "1",
        "--ids",
        ids,
    ]
    proc = subprocess.run(
        cmd + ["--json", str(out), "--timeout", "200"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        start_new_session=True,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    row = json.loads(out.read_text())["results"][op]["1024"]
    assert row["vllm_bad_bytes"] == row["kvgeom_bad_bytes"] == 0 and row["same_d"]
    assert row["bytes"] == 1024 * 2 * 12 * 256  # 2 layers of 12 heads, K and V of 64 float16 per token
    assert row["plan_pairs"] == row["vllm_pairs"] == 32 * 2  # one pair per block and layer, as vLLM posts
    if ids == "sequential":
        assert row["kvgeom_posted"] == 2  # one run per layer's region
    else:
        assert 2 < row["kvgeom_posted"] < row["plan_pairs"]
    assert len(row["vllm_s"]) == len(row["kvgeom_s"]) == 1
