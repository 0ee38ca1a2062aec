"""bench/bench_vs_vllm.py at tiny sizes: kvgeom's descriptor ids, recipe plans, tables and new-length streams are checked
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
    for remotes in (1, 8):
        row = bench.handshake_row(64, 0.001, remotes)
        assert row["remotes"] == remotes and row["blocks"] == 60
        assert row["table_descriptors"] > row["table_runs"] > 0


def test_new_length_streams_match_vllm_in_both_modes() -> None:
    sc, ksc = bench.scenario(64), bench.scenario(64, "kvgeom")
    side = bench.VllmSide(sc)
    rows = bench.stream_rows({"vllm": (sc, side), "kvgeom": (ksc, side)}, 6, 3, 1, ((16, 100), (100, 5000)))
    assert [(r["compat"], r["requests"]) for r in rows] == [("vllm", 6), ("kvgeom", 6)] + [
        (m, 3) for _ in range(2) for m in ("vllm", "kvgeom")
    ]
    assert all(r["descriptor_pairs"] > 0 and r["vllm_us"] > 0 and r["kvgeom_us"] > 0 for r in rows)
