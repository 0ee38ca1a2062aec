"""bench/bench_vs_vllm.py at tiny sizes: kvgeom's descriptor ids, recipe plans and tables are checked
equal to vLLM 0.33.0's (the script exits on a difference); no timing is asserted."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import bench_vs_vllm as bench  # noqa: E402


def test_requests_and_handshakes_match_vllm() -> None:
    sc = bench.scenario(64)
    side = bench.VllmSide(sc)
    bench.check_tables(sc, side)
    for tokens in (16, 3000):
        row = bench.request_row(sc, side, tokens, 0.001)
        assert row["pairs"] > 0 and row["runs"] <= row["pairs"]
    row = bench.handshake_row(100, 0.001)
    assert row["table_descriptors"] > row["table_runs"] > 0
