"""End to end with real NIXL: P and D engines as separate processes (one agent per rank, loopback),
requests planned by kvgeom, moved by NIXL, every D byte checked against the oracle's layout model.
Then one test per failure: a killed P, metadata that never arrives, a transfer that ends in error, a
re-registered (stale) P -- each request fails within its bound with its blocks zeroed, and the next
request is served by a healthy P."""

from __future__ import annotations

import time

import pytest
from kvgeom_lab.cluster import run_cluster
from kvgeom_lab.demo import DEFAULT_SCENARIO

from kvgeom import AttentionSpec, MambaSpec, MLASpec, ModelSpec

pytestmark = pytest.mark.nixl

FAST = {
    "handshake_timeout_s": 3.0,
    "transfer_timeout_s": 10.0,
    "notif_timeout_s": 10.0,
    "secret": "kvgeom-e2e-test-secret-0123456789",
}


def _run(
    scenario: dict,
    tokens: list[int],
    engines: list[str] | None = None,
    faults: dict | None = None,
    request_engines: list[str] | None = None,
) -> dict:
    engines = engines or ["prefill"]
    reqs = [
        {"id": f"r{i}", "tokens": n, "engine": (request_engines or [engines[0]] * len(tokens))[i]}
        for i, n in enumerate(tokens)
    ]
    t0 = time.monotonic()
    out = run_cluster(
        {
            "scenario": scenario,
            "requests": reqs,
            "prefill_engines": engines,
            "config": FAST,
            "faults": faults or {},
        },
        timeout_s=120,
    )
    out["elapsed"] = time.monotonic() - t0
    return out


def _decode_reports(out: dict) -> list[dict]:
    reports = [v for k, v in out["results"].items() if k.startswith("decode")]
    for r in reports:
        assert "results" in r, r
    return reports


def _assert_all_ok(out: dict, n_requests: int) -> None:
    for name, v in out["results"].items():
        assert "error" not in v or "results" in v, f"{name}: {v.get('error')}\n{v.get('traceback')}"
    for rep in _decode_reports(out):
        assert rep["mismatches"] == [], rep["mismatches"]
        if "results" in rep:
            assert [r["ok"] for r in rep["results"]] == [True] * n_requests, rep["results"]


def test_mamba2_hybrid_p_tp2_to_d_tp1_pull_different_block_sizes() -> None:
    out = _run(DEFAULT_SCENARIO, [97, 1000, 31, 640])
    _assert_all_ok(out, 4)
    rows = _decode_reports(out)[0]["results"]
    assert sum(r["bytes_moved"] for r in rows) > 0 and sum(r["bytes_zeroed"] for r in rows) > 0
    producers = [v for k, v in out["results"].items() if k.startswith("prefill")]
    assert all(sorted(p["released"]) == ["r0", "r1", "r2", "r3"] for p in producers), producers


def test_mamba2_hybrid_p_tp2_to_d_tp1_push() -> None:
    out = _run(dict(DEFAULT_SCENARIO, mode="push"), [97, 1000, 31, 640])
    _assert_all_ok(out, 4)
    pushed = [r for k, v in out["results"].items() if k.startswith("prefill") for r in v["results"]]
    assert len(pushed) == 8 and all(r["ok"] for r in pushed)
    # kvgeom zeroes in push too (vLLM does not): D's last block is only partly covered by P's blocks
    assert sum(r["bytes_zeroed"] for r in _decode_reports(out)[0]["results"]) > 0


DENSE = {
    "model": ModelSpec.from_layers("dense-gqa", [AttentionSpec(4, 32, "bfloat16")] * 4).to_json(),
    "mode": "pull",
    "compat": "kvgeom",
    "prefill": {"tp_size": 1, "block_size": 16, "num_blocks": 256},
    "decode": {"tp_size": 2, "block_size": 16, "num_blocks": 256},
}


def test_dense_gqa_p_tp1_to_d_tp2() -> None:
    out = _run(DENSE, [50, 300, 16])
    _assert_all_ok(out, 3)
    assert len(_decode_reports(out)) == 2
    assert sorted(next(v for k, v in out["results"].items() if k.startswith("prefill"))["released"]) == [
        "r0",
        "r1",
        "r2",
    ]  # P frees after both D ranks read


PERMUTED = {
    **DENSE,
    "compat": "vllm",
    "prefill": {"tp_size": 1, "block_size": 8, "num_blocks": 256},
    "decode": {
        "tp_size": 2,
        "block_size": 16,
        "num_blocks": 256,
        "kv_layout": "token_major",
        "permute_local_kv": True,
    },
}


def test_head_major_p_tp1_into_token_major_d_tp2_permuted_on_receive() -> None:
    """vLLM's ``enable_permute_local_kv`` (B.6.15): D's token-major pages read as head-major remote pages of
    half its block size, then regrouped token-major on D's tensors; every D byte checked."""
    out = _run(PERMUTED, [50, 300, 16])
    _assert_all_ok(out, 3)
    assert len(_decode_reports(out)) == 2


PUSHED_PERMUTED = {
    **DENSE,
    "mode": "push",
    "compat": "kvgeom",
    "decode": {**PERMUTED["decode"], "tp_size": 2, "block_size": 16},
}


@pytest.mark.parametrize(
    "prefill",
    [{"tp_size": 1, "block_size": 16}, {"tp_size": 4, "block_size": 32}],
    ids=["p_tp1_bsr1", "p_tp4_bsr2"],
)
def test_head_major_p_pushed_into_token_major_d_tp2_permuted_on_receive(prefill: dict) -> None:
    """kvgeom mode's push permute (B.6.15; vLLM refuses it): P writes its head-major pages as into a
    head-major D (P TP 4: one head per rank, blocks twice D's), D's receive step regroups them token-major
    on its tensors; every D byte checked."""
    out = _run({**PUSHED_PERMUTED, "prefill": {**prefill, "num_blocks": 256}}, [50, 300, 16])
    _assert_all_ok(out, 3)
    assert len(_decode_reports(out)) == 2
    pushed = [r for k, v in out["results"].items() if k.startswith("prefill") for r in v["results"]]
    assert len(pushed) == 3 * prefill["tp_size"] and all(r["ok"] for r in pushed)


MLA_KDA = {
    "model": ModelSpec.from_layers(
        "mla-kda",
        [
            MambaSpec.kda(num_heads=4, head_dim=8, conv_kernel=4, conv_dtype="bfloat16"),
            MambaSpec.kda(num_heads=4, head_dim=8, conv_kernel=4, conv_dtype="bfloat16"),
            MLASpec(64, "bfloat16"),
            MLASpec(64, "bfloat16"),
        ],
    ).to_json(),
    "mode": "pull",
    "compat": "kvgeom",
    "prefill": {"tp_size": 2, "block_size": 16, "num_blocks": 256},
    "decode": {"tp_size": 1, "block_size": 32, "kernel_block_size": 16, "num_blocks": 128},
}


def test_mla_kda_hybrid_p_tp2_to_d_tp1() -> None:
    out = _run(MLA_KDA, [40, 200, 7])
    _assert_all_ok(out, 3)


# ------------------------------------------------------------------------------------------ faults
TWO = ["prefill", "healthy"]


def _rows(out: dict) -> list[dict]:
    return _decode_reports(out)[0]["results"]


def _assert_failed_then_recovered(out: dict, failed: list[str], bound_s: float) -> list[dict]:
    rows = {r["request_id"]: r for r in _rows(out)}
    for rid, r in rows.items():
        assert r["ok"] is (rid not in failed), (rid, r)
    for rid in failed:
        assert rows[rid]["seconds"] < bound_s, rows[rid]
    # failed requests' blocks were zeroed, every other byte is as the oracle expects
    assert _decode_reports(out)[0]["mismatches"] == []
    return [rows[r] for r in failed]


def test_killed_prefill_fails_the_request_and_a_healthy_peer_serves_the_next() -> None:
    out = _run(
        DEFAULT_SCENARIO,
        [300, 300, 300],
        engines=TWO,
        request_engines=["prefill", "prefill", "healthy"],
        faults={"kill": {"engine": "prefill", "after": "r0"}},
    )
    (r1,) = _assert_failed_then_recovered(out, ["r1"], bound_s=12.0)
    assert "PeerGone" in r1["error"] or "TransferError" in r1["error"] or "HandshakeTimeout" in r1["error"]


def test_metadata_that_never_arrives_times_out_and_the_next_request_is_served() -> None:
    out = _run(
        DEFAULT_SCENARIO,
        [300, 300],
        engines=["silent", "healthy"],
        request_engines=["silent", "healthy"],
        faults={"silent": "silent"},
    )
    (r0,) = _assert_failed_then_recovered(out, ["r0"], bound_s=FAST["handshake_timeout_s"] + 3)
    assert "HandshakeTimeout" in r0["error"]


def test_transfer_ending_in_error_fails_cleanly() -> None:
    out = _run(
        DEFAULT_SCENARIO,
        [300, 300],
        engines=["liar", "healthy"],
        request_engines=["liar", "healthy"],
        faults={"bad_regions": "liar"},
    )
    (r0,) = _assert_failed_then_recovered(out, ["r0"], bound_s=10.0)
    assert "NIXL_ERR_NOT_FOUND" in r0["error"]


def test_reregistered_prefill_is_detected_as_stale_then_reconnected() -> None:
    out = _run(
        DEFAULT_SCENARIO,
        [300, 300, 300],
        engines=TWO,
        request_engines=["prefill", "prefill", "prefill"],
        faults={"reregister": {"engine": "prefill", "after": "r0"}},
    )
    (r1,) = _assert_failed_then_recovered(out, ["r1"], bound_s=5.0)
    assert "StaleMetadata" in r1["error"]  # r2 re-handshakes with the new registration and succeeds


def test_incompatible_pair_fails_on_both_sides_with_the_same_readable_error() -> None:
    scenario = dict(DENSE, decode=dict(DENSE["decode"], kv_layout="token_major"))
    t0 = time.monotonic()
    out = _run(scenario, [50])
    assert time.monotonic() - t0 < 60
    rows = [rep["results"][0] for rep in _decode_reports(out)]
    assert len(rows) == 2
    for row in rows:
        assert not row["ok"] and "IncompatiblePairError" in row["error"] and "kv_layout" in row["error"]
    producer = next(v for k, v in out["results"].items() if k.startswith("prefill"))
    verdicts = list(producer["rejected"].values())  # P checked each D card it was sent: same rule, same words
    assert len(verdicts) == 2
    for verdict, row in zip(verdicts, rows):
        assert "kv_layout" in verdict and verdict.split(": ", 1)[1] in row["error"]


def _cpu_page(
    model: ModelSpec, p_block: int, d_block: int, tp: int, groups: list[list[str]] | None = None
) -> dict:
    """vLLM's CPU attention page (``head_kv_major``: per head K transposed, then V rows) on both sides."""
    side = {"tp_size": tp, "num_blocks": 64, "kv_layout": "head_kv_major"}
    return {
        "model": model.to_json(),
        "mode": "pull",
        "compat": "kvgeom",
        "prefill": {**side, "block_size": p_block},
        "decode": {**side, "block_size": d_block},
    }


CPU_DENSE = ModelSpec.from_layers("cpu-dense", [AttentionSpec(2, 64, "float32")] * 2)
CPU_HYBRID = ModelSpec.from_layers(
    "cpu-nemotron-h",
    [MambaSpec.mamba2(8, 32, 2, 16, 4, "float32", "float32"), AttentionSpec(2, 64, "float32"), None],
)


@pytest.mark.parametrize(
    "scenario",
    [
        _cpu_page(CPU_DENSE, 32, 64, 1),
        _cpu_page(CPU_DENSE, 64, 32, 2),
        _cpu_page(CPU_HYBRID, 32, 64, 1),
        _cpu_page(CPU_HYBRID, 64, 32, 1),
    ],
    ids=["dense-p32-d64-tp1", "dense-p64-d32-tp2", "hybrid-p32-d64", "hybrid-p64-d32"],
)
def test_cpu_attention_page_at_a_block_size_ratio_moves_every_byte_into_place(scenario: dict) -> None:
    """kvgeom mode cuts both sides' CPU pages by their token runs (each K row's token range, each V row
    range) at P 32 -> D 64 and P 64 -> D 32; real NIXL moves them between processes and every D byte is
    checked against the oracle's own model of the page."""
    out = _run(scenario, [40, 150, 1, 64])
    _assert_all_ok(out, 4)
    rows = [r for rep in _decode_reports(out) for r in rep["results"]]
    assert rows and all(r["bytes_moved"] > 0 for r in rows)
