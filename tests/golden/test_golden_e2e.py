"""End-to-end golden cases: a hybrid MLA + KDA pull recorded from vLLM 0.33.0 (``run_mla_kda_pull``).

Each case is rebuilt from kvgeom values (model spec, engine configs, cards) and planned in
``compat="vllm"`` mode; the transfers' descriptor ids, the resolved byte moves and the zeroed ranges
must equal vLLM's, and every case vLLM rejected must raise a kvgeom error.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from _golden import load_table  # tests/golden/_golden.py

from kvgeom import KvgeomError
from kvgeom.layout.allocate import rank_geometry
from kvgeom.layout.card import GeometryCard, card_of
from kvgeom.layout.engine import EngineConfig
from kvgeom.model.layers import LayerKind, MambaSpec, MLASpec, Shard
from kvgeom.model.spec import ModelSpec
from kvgeom.plan.pairing import Pairing
from kvgeom.plan.request import plan_request

CASES = load_table("e2e_pull", "run_mla_kda_pull")


def _model(inp: dict) -> ModelSpec:
    """MLA + two KDA groups, ``num_layers`` each, the KDA state given as per-rank shapes at local TP."""
    tp = inp["local_tp"]
    conv_dim, rows = inp["kda_conv_shape"]
    v = int(np.prod(inp["kda_temporal_shape"][:2]))  # v_heads_local * v_dim (vLLM's GDN decomposition)
    kd = (conv_dim - v) // 2
    temporal = int(np.prod(inp["kda_temporal_shape"]))
    kda = MambaSpec(
        LayerKind.KDA,
        (Shard(kd * tp, 1), Shard(kd * tp, 1), Shard(v * tp, 1)),
        Shard(temporal * tp, 1),
        rows + 1,
        inp["kda_conv_dtype"],
        inp["kda_temporal_dtype"],
    )
    mla = MLASpec(inp["mla_head_size"], "float16")
    n = inp["num_layers"]
    return ModelSpec.from_layers("mla-kda", [mla] * n + [kda] * (2 * n))


def _pairing(inp: dict) -> Pairing:
    model = _model(inp)
    local = rank_geometry(
        model,
        EngineConfig(
            tp_size=inp["local_tp"],
            tp_rank=inp["local_rank"],
            block_size=inp["local_block_size"],
            kernel_block_size=inp["kernel_block_size"],
            num_blocks=inp["num_logical_blocks"],
        ),
    )
    remotes = []
    for r in range(inp["remote_tp"]):
        card = card_of(
            "prefill",
            model,
            EngineConfig(
                tp_size=inp["remote_tp"],
                tp_rank=r,
                block_size=inp["remote_block_size"],
                kernel_block_size=inp["remote_kernel_block_size"],
                num_blocks=inp["remote_num_logical"],
            ),
        ).to_json()
        if inp["remote_block_lens"] is not None:  # what vLLM was told, through the card's advertised numbers
            for region, length in zip(card["derived"]["regions"], inp["remote_block_lens"]):
                region["block_len"] = region["block_stride"] = length
        remotes.append(GeometryCard.from_json(card))  # re-derives and checks what the card advertises
    return Pairing.create(local, remotes, mode="pull", compat="vllm")


def _overflows(inp: dict) -> bool:
    """The recorded P advertises a page smaller than its own Mamba state (conv + temporal)."""
    remote_page = inp["remote_block_size"] * inp["mla_head_size"] * 2
    return sum(inp["remote_ssm_sizes"]) > remote_page


def _unshardable(inp: dict) -> bool:
    """The recorded P's TP does not divide the (synthetic) KDA conv pieces: vLLM then splits bytes of
    2-byte elements (remote conv pieces of ``12 // 8 = 1`` byte at TP8)."""
    conv_dim = inp["kda_conv_shape"][0] * inp["local_tp"]
    v = inp["kda_temporal_shape"][0] * inp["kda_temporal_shape"][1] * inp["local_tp"]
    return any(units % inp["remote_tp"] for units in ((conv_dim - v) // 2, v))


def _ok_cases() -> list[dict]:
    return [
        c for c in CASES if "error" not in c and not _overflows(c["input"]) and not _unshardable(c["input"])
    ]


OVERFLOW = [c for c in CASES if "error" not in c and _overflows(c["input"])]
UNSHARDABLE = [c for c in CASES if "error" not in c and _unshardable(c["input"])]


def test_state_unshardable_over_remote_tp_is_refused_where_vllm_splits_elements() -> None:
    """``mla_hybrid_large_ppl`` records a TP8 P whose 2-channel fp16 conv pieces cannot be cut in 8: vLLM
    moves 1- and 3-byte slices of 2-byte elements; kvgeom refuses the pair instead."""
    assert UNSHARDABLE, "the recording holds such cases"
    for case in UNSHARDABLE:
        inp, out = case["input"], case["output"]
        mla_len = out["local"]["block_len_per_layer"][0]
        ssm_moves = [m for m in out["moves"] if m[5] != mla_len]
        assert any(m[5] % 2 for m in ssm_moves), "vLLM moves odd byte counts of fp16 conv state"
        with pytest.raises(KvgeomError, match="units|replicated"):
            _pairing(inp)


def test_state_overflowing_its_page_is_refused_where_vllm_reads_a_neighbour() -> None:
    """Some recorded P engines (remote block 4 tokens at TP2) have a 56-byte KDA state in a 48-byte page:
    no real engine is laid out so, and vLLM's moves read past the page into the next block. kvgeom
    refuses that geometry instead of reproducing the out-of-page read."""
    assert OVERFLOW, "the recording holds such cases"
    for case in OVERFLOW:
        inp, out = case["input"], case["output"]
        page = inp["remote_block_size"] * inp["mla_head_size"] * 2
        ssm_moves = [m for m in out["moves"] if m[8] == inp["remote_ssm_sizes"][1]]
        assert any((m[7] % page) + m[8] > page for m in ssm_moves), "vLLM reads past the remote page"
        with pytest.raises(KvgeomError, match="block size"):
            _pairing(inp)


def test_every_case_is_replayed() -> None:
    assert len(CASES) == 62 and len(_ok_cases()) + len(OVERFLOW) + len(UNSHARDABLE) == 62


def _variant(**changes: object) -> dict:
    base = dict(next(c["input"] for c in CASES if c["input"]["sweep"] == "hetero_ppl_token_alignment"))
    base.update(changes)
    return base


def test_rejected_block_split_is_refused() -> None:
    """vLLM's ``rejected_block_split`` sweep: local 257 vs remote 256 tokens is not divisible."""
    inp = _variant(
        local_block_size=257,
        kernel_block_size=257,
        remote_block_size=256,
        remote_kernel_block_size=256,
        num_logical_blocks=8,
        remote_num_logical=8,
        remote_tp=1,
    )
    with pytest.raises(KvgeomError, match="not divisible"):
        _pairing(inp)


def test_rejected_mla_kernel_page_is_refused() -> None:
    """vLLM's ``rejected_mla_kernel_page`` sweep: the remote advertises MLA block lengths [24, 24]."""
    inp = _variant(remote_block_lens=[24, 24])
    with pytest.raises(KvgeomError, match="block_len"):
        _pairing(inp)


def test_accepted_cases_match_vllm_bytes() -> None:
    failures = []
    for case in _ok_cases():
        inp, out = case["input"], case["output"]
        try:
            _compare(inp, out)
        except AssertionError as exc:  # collect, so one run reports every mismatching case
            failures.append((case["id"], inp["sweep"], str(exc)[:300]))
    assert not failures, f"{len(failures)} mismatching cases, first: {failures[:3]}"
    assert len(_ok_cases()) >= 45


def _num_tokens(inp: dict) -> int:
    """The request's tokens as vLLM's test gave them; its worked example gives none, and caches no prefix:
    D's attention list (group 0) starts at token 0, so its blocks hold the request."""
    if inp["num_tokens"] is not None:
        return int(inp["num_tokens"])
    return len(inp["local_block_ids"][0]) * inp["local_block_size"]


def _compare(inp: dict, out: dict) -> None:
    pairing = _pairing(inp)
    assert pairing.tp_ratio == out["tp_ratio"]
    assert pairing.local.num_blocks == out["local"]["num_blocks"]
    assert pairing.local.ppl == out["local"]["ppl"]
    assert list(pairing.local.ssm.conv_offsets) == [tuple(x) for x in out["local"]["local_conv_offsets"]]
    plan = plan_request(
        pairing,
        inp["local_block_ids"],
        inp["remote_block_ids"],
        "req",
        "prefill-req",
        num_tokens=_num_tokens(inp),
    )
    handles = {d["handle"]: d for d in out["dlists"]}
    want_transfers = out["transfers"]
    assert len(plan.transfers) == len(want_transfers), (len(plan.transfers), len(want_transfers))
    for got, want in zip(plan.transfers, want_transfers):
        assert got.notif == want["notif"], (got.notif, want["notif"])
        assert handles[want["remote_handle"]]["remote_rank"] == got.remote_rank
        assert got.local_ids.tolist() == want["local_ids"], (
            "local ids",
            got.local_ids.tolist(),
            want["local_ids"],
        )
        assert got.remote_ids.tolist() == want["remote_ids"], (
            "remote ids",
            got.remote_ids.tolist(),
            want["remote_ids"],
        )
        lrows = pairing.local_table(got.local_table).rows
        assert lrows[:, :3].tolist() == [r[:3] for r in handles[want["local_handle"]]["rows"]], "local table"
        rrows = pairing.remote_table(got.remote_rank).rows
        assert rrows[:, :3].tolist() == [r[:3] for r in handles[want["remote_handle"]]["rows"]], (
            "remote table"
        )
    moves = plan.moves(pairing)
    got_moves = Counter(tuple(int(x) for x in (m[4], m[5], m[6], m[1], m[2])) for m in moves)
    want_moves = Counter((m[3], m[4], m[5], m[6], m[7]) for m in out["moves"])
    assert got_moves == want_moves, "moves"
    assert sorted(map(tuple, plan.zero.tolist())) == sorted(map(tuple, out["zeroed"])) or _same_bytes(
        plan.zero, out["zeroed"]
    ), ("zeroed", plan.zero.tolist(), out["zeroed"])


def _same_bytes(rows: np.ndarray, want: list[list[int]]) -> bool:
    """Zero ranges compared as byte sets (vLLM reports maximal runs; kvgeom may split a run)."""

    def bytes_of(rs):
        s = set()
        for r, o, n in rs:
            s.update((r, o + i) for i in range(n))
        return s

    return bytes_of(rows.tolist()) == bytes_of(want)
