"""Exact behaviour of kvgeom.tools.scenario: the JSON form key by key (defaults, ranges at both ends, every
refusal's class, field and values), the request ids, the pools' limits, the plans and check_ranks."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvgeom import ConfigError
from kvgeom.errors import PlanError, SpecError
from kvgeom.layout.engine import ConvLayout, KVLayout
from kvgeom.model.layers import AttentionSpec, MambaSpec, MLASpec
from kvgeom.model.spec import ModelSpec
from kvgeom.plan.request import plan_request
from kvgeom.tools.scenario import MAX_BLOCK_SIZE, MAX_TP, Scenario, check_ranks, example, examples

# attention: 2 KV heads of 8, bf16 -> 2 * (8 + 8) * 2 = 64 B per token at TP1
ATTN = AttentionSpec(2, 8)
# Mamba2, 4 heads of 16, 1 group, state 16, kernel 4, bf16: conv (64 + 16 + 16) channels * 3 rows * 2 B
# = 576 B, temporal 4 * 16 * 16 * 2 B = 2048 B: 2624 B of state per request at TP1
MAMBA = MambaSpec.mamba2(4, 16, 1, 16)
ATTN_ONLY = ModelSpec.from_layers("tiny", [ATTN, ATTN]).to_json()
HYBRID = ModelSpec.from_layers("hyb", [ATTN, MAMBA]).to_json()
MLA_HYBRID = ModelSpec.from_layers("mlahyb", [MLASpec(576), MAMBA]).to_json()


def sc(model: Any = None, **kw: Any) -> Scenario:
    return Scenario.from_json({"model": ATTN_ONLY if model is None else model, **kw})


def refused(data: Any, cls: type = ConfigError) -> Any:
    with pytest.raises(cls) as info:
        Scenario.from_json(data)
    assert type(info.value) is cls
    return info.value


def test_engine_defaults() -> None:
    s = sc()
    for eng in (s.prefill, s.decode):
        assert eng.tp_size == 1
        assert eng.block_size == 16  # "auto" of an attention-only model: min_block_size 16
        assert eng.kernel_block_size == 16  # 'auto': the logical block
        assert eng.num_blocks == 64
        assert eng.kv_layout is KVLayout.HEAD_MAJOR
        assert eng.conv_layout is ConvLayout.DS
        assert eng.kv_split is False
        assert eng.tp_rank == 0
    assert s.mode == "pull" and s.compat == "kvgeom"
    assert s.source is not None and s.source.spec == s.model
    assert s.model.name == "tiny"


def test_engine_explicit_values() -> None:
    s = sc(
        prefill={
            "tp_size": 2,
            "block_size": 32,
            "kernel_block_size": 8,
            "num_blocks": 7,
            "kv_layout": "NHD" if "NHD" in [k.value for k in KVLayout] else KVLayout.TOKEN_MAJOR.value,
            "conv_layout": "SD",
            "kv_split": True,
            "_comment": "ignored",
        },
        decode={"min_block_size": 48, "kernel_block_size": "auto"},
        mode="push",
        compat="vllm",
    )
    p, d = s.prefill, s.decode
    assert (p.tp_size, p.block_size, p.kernel_block_size, p.num_blocks) == (2, 32, 8, 7)
    assert p.kv_layout is KVLayout.TOKEN_MAJOR and p.conv_layout is ConvLayout.SD and p.kv_split is True
    assert d.block_size == 48 and d.kernel_block_size == 48
    assert s.mode == "push" and s.compat == "vllm"
    assert sc(prefill={"block_size": 32, "kernel_block_size": None}).prefill.kernel_block_size == 32
    # kernel == block is the top of its range
    assert sc(prefill={"block_size": 16, "kernel_block_size": 16}).prefill.kernel_block_size == 16
    assert sc(prefill={"block_size": 16, "kernel_block_size": 1}).prefill.kernel_block_size == 1


def test_ranges_at_both_ends() -> None:
    assert sc(prefill={"num_blocks": 1}).prefill.num_blocks == 1
    assert sc(prefill={"num_blocks": 1 << 40}).prefill.num_blocks == 1 << 40
    assert sc(prefill={"block_size": 1}).prefill.block_size == 1
    assert sc(prefill={"block_size": MAX_BLOCK_SIZE}).prefill.block_size == MAX_BLOCK_SIZE
    assert sc(prefill={"min_block_size": 1}).prefill.block_size == 1
    assert sc(prefill={"min_block_size": 1, "kernel_alignment": 1}).prefill.block_size == 1
    for key, bad, lo, hi in [
        ("num_blocks", 0, 1, 1 << 40),
        ("num_blocks", (1 << 40) + 1, 1, 1 << 40),
        ("block_size", 0, 1, MAX_BLOCK_SIZE),
        ("block_size", MAX_BLOCK_SIZE + 1, 1, MAX_BLOCK_SIZE),
        ("min_block_size", 0, 1, MAX_BLOCK_SIZE),
        ("min_block_size", MAX_BLOCK_SIZE + 1, 1, MAX_BLOCK_SIZE),
        ("kernel_alignment", 0, 1, MAX_BLOCK_SIZE),
        ("kernel_alignment", MAX_BLOCK_SIZE + 1, 1, MAX_BLOCK_SIZE),
        ("tp_size", 0, 1, MAX_TP),
        ("tp_size", MAX_TP + 1, 1, MAX_TP),
    ]:
        err = refused({"model": ATTN_ONLY, "decode": {key: bad}})
        assert err.field == f"decode.{key}"
        assert err.values == {"value": bad, "expected": (lo, hi)}
    err = refused({"model": ATTN_ONLY, "prefill": {"block_size": 16, "kernel_block_size": 17}})
    assert err.field == "prefill.kernel_block_size"
    assert err.values == {"value": 17, "expected": (1, 16)}
    err = refused({"model": ATTN_ONLY, "prefill": {"block_size": 16, "kernel_block_size": 0}})
    assert err.values == {"value": 0, "expected": (1, 16)}


@pytest.mark.parametrize("bad", ["2", 2.0, True, False, None, [1]])
def test_not_an_integer(bad: Any) -> None:
    err = refused({"model": ATTN_ONLY, "prefill": {"num_blocks": bad}})
    assert err.field == "prefill.num_blocks"
    assert err.values == {"value": bad}


def test_tp_the_model_cannot_run() -> None:
    err = refused({"model": ATTN_ONLY, "decode": {"tp_size": 3}})  # 2 KV heads do not split over 3
    assert err.field == "decode.tp_size"
    assert err.values == {"value": 3}
    assert "accepted: 1, 2" in str(err)
    assert sc(decode={"tp_size": 2}).decode.tp_size == 2


def test_block_and_kernel_refusals() -> None:
    err = refused({"model": ATTN_ONLY, "prefill": {"block_size": "big"}})
    assert err.field == "prefill.block_size" and err.values == {"value": "big"}
    err = refused({"model": ATTN_ONLY, "prefill": {"block_size": 16, "kernel_block_size": "x"}})
    assert err.field == "prefill.kernel_block_size" and err.values == {"value": "x"}
    err = refused({"model": ATTN_ONLY, "prefill": {"block_size": 16, "kernel_block_size": 5}})
    assert err.field == "prefill.kernel_block_size" and err.values == {"value": 5, "expected": 16}
    # the accepted divisors of 16 are listed
    assert "[1, 2, 4, 8, 16]" in str(err)
    err = refused({"model": ATTN_ONLY, "decode": {"kv_split": 1}})
    assert err.field == "decode.kv_split" and err.values == {"value": 1}
    err = refused({"model": ATTN_ONLY, "decode": {"kv_layout": "XYZ"}})
    assert err.field == "decode.kv_layout" and err.values == {"value": "XYZ"}
    err = refused({"model": ATTN_ONLY, "decode": {"conv_layout": "XYZ"}})
    assert err.field == "decode.conv_layout" and err.values == {"value": "XYZ"}


def test_auto_block_size_of_a_hybrid() -> None:
    # A = max(kernel_alignment, min_block_size); block = A * ceil(2624 / (A * 64)), rounded up to a
    # multiple of kernel_alignment
    assert sc(HYBRID).prefill.block_size == 48  # A 16: 16 * ceil(2.5625) = 48
    assert sc(HYBRID, prefill={"min_block_size": 32}).prefill.block_size == 64  # 32 * ceil(1.28) = 64
    assert sc(HYBRID, prefill={"kernel_alignment": 24}).prefill.block_size == 48  # 24 * 2, multiple of 24
    # min 56 > alignment 16: 56 * ceil(0.73) = 56, rounded up to a multiple of 16: 64
    assert sc(HYBRID, prefill={"min_block_size": 56}).prefill.block_size == 64
    # alignment 56: 56, a multiple of 56
    assert sc(HYBRID, prefill={"kernel_alignment": 56}).prefill.block_size == 56
    # TP2: 1 KV head per rank (32 B/token); state: conv (32 + 16 + 16) * 3 * 2 = 384, temporal
    # 2 * 256 * 2 = 1024 -> 1408 B; 16 * ceil(1408 / 512) = 48
    assert sc(HYBRID, prefill={"tp_size": 2}).prefill.block_size == 48
    # an MLA hybrid aligns to at least 128 (vLLM 0.33.0): 1152 B/token holds the state in 128 tokens
    assert sc(MLA_HYBRID).prefill.block_size == 128


def test_object_checks() -> None:
    err = refused([1, 2])
    assert err.field == "scenario" and err.values == {"value": [1, 2]}
    err = refused({"model": ATTN_ONLY, "prefill": [1]})
    assert err.field == "prefill" and err.values == {"value": [1]}
    err = refused({"model": ATTN_ONLY, "decode": "x"})
    assert err.field == "decode" and err.values == {"value": "x"}
    # unknown keys: the first in sorted order, engine keys prefixed by the side
    err = refused({"model": ATTN_ONLY, "zeta": 1, "alpha": 2})
    assert err.field == "alpha" and err.values == {"value": "alpha"}
    err = refused({"model": ATTN_ONLY, "tp_size": 2})  # an engine key at the top level
    assert err.field == "tp_size"
    err = refused({"model": ATTN_ONLY, "decode": {"mode": "pull"}})  # a scenario key in an engine
    assert err.field == "decode.mode" and err.values == {"value": "mode"}
    err = refused({"model": ATTN_ONLY, "prefill": {"b": 1, "a": 2, "_c": 3}})
    assert err.field == "prefill.a"
    # comments anywhere are ignored
    assert sc(_note="x", prefill={"_x": 1}).prefill.tp_size == 1


def test_scenario_choices() -> None:
    err = refused({"prefill": {}})
    assert err.field == "model" and err.values == {"value": None}
    for key, bad in [("mode", "both"), ("compat", "COMPAT"), ("kv_cache_dtype", "int4")]:
        err = refused({"model": ATTN_ONLY, key: bad})
        assert err.field == key and err.values == {"value": bad}
    err = refused({"model": HYBRID, "mamba_ssm_cache_dtype": "fp8"})
    assert err.field == "mamba_ssm_cache_dtype" and err.values == {"value": "fp8"}
    err = refused({"model": "no-such-model-xyz"}, SpecError)
    assert err.field == "model"


def test_cache_dtypes() -> None:
    s = sc(HYBRID, kv_cache_dtype="fp8")
    assert s.model.layers[0].spec.dtype == "fp8"
    assert s.model.layers[1].spec.ssm_dtype == "bfloat16"
    assert s.source is not None and s.source.spec == s.model
    s = sc(HYBRID, mamba_ssm_cache_dtype="float32")
    assert s.model.layers[0].spec.dtype == "bfloat16"
    assert s.model.layers[1].spec.ssm_dtype == "float32"
    s = sc(HYBRID, kv_cache_dtype="auto", mamba_ssm_cache_dtype="auto")
    assert s.model == ModelSpec.from_json(HYBRID)
    # fp8 halves the attention page: 32 B/token; 16 * ceil(2624 / 512) = 96
    assert sc(HYBRID, kv_cache_dtype="fp8").prefill.block_size == 96


def test_load(tmp_path: Path) -> None:
    missing = tmp_path / "nope.json"
    with pytest.raises(ConfigError) as info:
        Scenario.load(missing)
    assert type(info.value) is ConfigError
    assert info.value.field == "scenario" and info.value.values == {"value": str(missing)}
    with pytest.raises(ConfigError) as info:
        Scenario.load(tmp_path)
    assert info.value.field == "scenario" and info.value.values == {"value": str(tmp_path)}
    assert "is a directory" in str(info.value)
    bad = tmp_path / "bad.json"
    bad.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(ConfigError) as info:
        Scenario.load(bad)
    assert info.value.field == "scenario" and info.value.values == {"value": str(bad)}
    assert "UnicodeDecodeError" in str(info.value)
    broken = tmp_path / "broken.json"
    broken.write_text('{"model":\n  }')
    with pytest.raises(ConfigError) as info:
        Scenario.load(broken)
    assert info.value.field == "scenario" and info.value.values == {"value": str(broken)}
    assert "line 2" in str(info.value)
    # a relative model path is taken from the scenario file's folder
    sub = tmp_path / "sub"
    sub.mkdir()
    (sub / "m.json").write_text(json.dumps(ATTN_ONLY))
    (tmp_path / "elsewhere").mkdir()
    good = tmp_path / "sub" / "s.json"
    good.write_text(json.dumps({"model": {"layers": ATTN_ONLY["layers"], "name": "tiny"}, "mode": "push"}))
    s = Scenario.load(str(good))
    assert s.mode == "push" and s.model.name == "tiny"


def test_ranks_and_sides() -> None:
    s = sc(prefill={"tp_size": 2}, decode={"tp_size": 1, "block_size": 32})
    assert s.engine("prefill") is s.prefill and s.engine("decode") is s.decode
    cards = s.cards("prefill")
    assert [c.engine.tp_rank for c in cards] == [0, 1]
    assert all(c.engine_id == "prefill" and c.mode == "pull" and c.model == s.model for c in cards)
    assert all(c.engine.block_size == 16 and c.engine.tp_size == 2 for c in cards)
    assert [c.engine.tp_rank for c in s.cards("decode")] == [0]
    assert s.local_side == "decode" and s.remote_side == "prefill"
    assert list(s.pairings) == [0]
    push = sc(mode="push", prefill={"tp_size": 2})
    assert push.local_side == "prefill" and push.remote_side == "decode"
    assert list(push.pairings) == [0, 1]


def test_max_tokens() -> None:
    # attention only, one group: num_blocks * block
    assert sc(prefill={"num_blocks": 10}, decode={"num_blocks": 20, "block_size": 32}).max_tokens() == 160
    # hybrid: (num_blocks - 1 state slot) // 1 attention group * block: P (10 - 1) * 48 = 432,
    # D (20 - 1) * 48 = 912 -> 432
    h = sc(HYBRID, prefill={"num_blocks": 10}, decode={"num_blocks": 20})
    assert h.max_tokens() == 432
    # a pool of one block holds no attention block next to the state slot: 0
    assert sc(HYBRID, prefill={"num_blocks": 1}).max_tokens() == 0
    # two attention groups: Jamba-like 3 attention + 1 Mamba... here: [attn, attn-sw]? keep one group
    only_ssm = ModelSpec.from_layers("ssm", [MAMBA]).to_json()
    assert sc(only_ssm, prefill={"num_blocks": 3}).max_tokens() == MAX_BLOCK_SIZE * 3


def test_request_ids() -> None:
    h = sc(HYBRID, prefill={"num_blocks": 10}, decode={"num_blocks": 20, "min_block_size": 96})
    # D block: A 96 -> 96 * ceil(2624 / 6144) = 96
    assert h.decode.block_size == 96
    r = h.request(100, seed=None)
    # P: ceil(100 / 48) = 3 attention blocks + 1 state slot, sequential; D: ceil(100 / 96) = 2 + 1
    assert r.num_tokens == 100
    assert r.prefill == ((0, 1, 2), (3,))
    assert r.decode == ((0, 1), (2,))
    assert h.request(1, seed=None).prefill == ((0,), (1,))
    assert h.request(48, seed=None).prefill == ((0,), (1,))
    assert h.request(49, seed=None).prefill == ((0, 1), (2,))
    r = h.request(np.int64(432), seed=None)
    assert r.num_tokens == 432 and isinstance(r.num_tokens, int)
    assert r.prefill == (tuple(range(9)), (9,))
    # seeded: distinct ids of the pool, reproducible; D uses seed + 1
    a, b = h.request(100, seed=5), h.request(100, seed=5)
    assert a == b
    flat = [i for g in a.prefill for i in g]
    assert len(set(flat)) == 4 and all(0 <= i < 10 for i in flat)
    assert [len(g) for g in a.prefill] == [3, 1] and [len(g) for g in a.decode] == [2, 1]
    assert a.prefill != h.request(100, seed=6).prefill
    same = sc(HYBRID, prefill={"num_blocks": 50}, decode={"num_blocks": 50})
    assert same.request(100, seed=7).decode == same.request(100, seed=8).prefill
    assert same.request(100).decode == same.request(100, seed=1).prefill  # default seed 0
    assert same.request(100) == same.request(100, seed=0)
    assert all(isinstance(i, int) for g in a.prefill for i in g)


@pytest.mark.parametrize("bad", [0, -1, True, 1.0, "3", None])
def test_request_refuses_bad_counts(bad: Any) -> None:
    h = sc(HYBRID, prefill={"num_blocks": 10}, decode={"num_blocks": 20})
    with pytest.raises(PlanError) as info:
        h.request(bad)
    assert type(info.value) is PlanError
    assert info.value.field == "num_tokens" and info.value.values == {"value": bad}


def test_request_refuses_too_many_tokens() -> None:
    h = sc(HYBRID, prefill={"num_blocks": 10}, decode={"num_blocks": 20})
    assert h.request(432, seed=None).prefill[0] == tuple(range(9))
    with pytest.raises(PlanError) as info:
        h.request(433)
    assert type(info.value) is PlanError
    assert info.value.field == "num_tokens" and info.value.values == {"value": 433, "expected": 432}


def _moves(plans: dict, pairings: dict) -> dict:
    return {r: p.moves(pairings[r]).tolist() for r, p in plans.items()}


def test_plans_pull_and_push() -> None:
    for mode in ("pull", "push"):
        s = sc(HYBRID, mode=mode, prefill={"tp_size": 2, "num_blocks": 40}, decode={"num_blocks": 40})
        req = s.request(100, seed=3)
        plans = s.plans(req, "r1")
        local, remote = (req.decode, req.prefill) if mode == "pull" else (req.prefill, req.decode)
        want = {r: plan_request(p, local, remote, "r1", num_tokens=100) for r, p in s.pairings.items()}
        assert list(plans) == list(want)
        assert _moves(plans, s.pairings) == _moves(want, s.pairings)
        assert all(p.request_id == "r1" and p.mode == mode for p in plans.values())
        assert all(p.request_id == "req" for p in s.plans(req).values())


def test_describe() -> None:
    s = sc(prefill={"tp_size": 2, "block_size": 32, "kernel_block_size": 16}, decode={"block_size": 64})
    assert s.describe() == (
        "tiny: P TP2 block 32 (kernel 16) -> D TP1 block 64 (kernel 64), pull, kvgeom mode"
    )


def test_check_ranks() -> None:
    check_ranks(sc(HYBRID))  # auto blocks: every rank has a geometry
    # 16-token blocks hold 16 * 64 = 1024 B < 2624 B of state: ceil(2624 / 64) = 41 tokens at least
    s = sc(HYBRID, decode={"block_size": 16})
    with pytest.raises(ConfigError) as info:
        check_ranks(s)
    assert type(info.value) is ConfigError
    assert info.value.field == "decode.block_size"
    assert "at least 41 tokens" in str(info.value)
    assert info.value.values["value"] == 16
    s = sc(HYBRID, prefill={"block_size": 16})
    with pytest.raises(ConfigError) as info:
        check_ranks(s)
    assert info.value.field == "prefill.block_size"
    # a hybrid cannot split K/V: the geometry's own refusal, with a pointer to the docs
    s = sc(HYBRID, prefill={"kv_split": True})
    with pytest.raises(ConfigError) as info:
        check_ranks(s)
    assert info.value.field == "prefill.kv_split"
    assert info.value.values == {"value": True}
    assert str(info.value).endswith("(accepted: see docs/cli.md)")
    assert str(info.value).count("prefill.kv_split") == 1


def test_divisor_lists_in_kernel_refusals() -> None:
    # 720 has 30 divisors: the last 12 are listed
    err = refused({"model": ATTN_ONLY, "prefill": {"block_size": 720, "kernel_block_size": 7}})
    assert "[45, 48, 60, 72, 80, 90, 120, 144, 180, 240, 360, 720]" in str(err)
    # divisors are searched up to 4096: of 8192, 2 ... 4096 are the last 12 (1 is the 13th)
    err = refused({"model": ATTN_ONLY, "prefill": {"block_size": 8192, "kernel_block_size": 3}})
    assert "[2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096]" in str(err)


def test_messages_list_what_is_accepted() -> None:
    engine_keys = "tp_size, block_size, min_block_size, kernel_block_size, kernel_alignment, num_blocks"
    scenario_keys = "model, prefill, decode, mode, compat, kv_cache_dtype, mamba_ssm_cache_dtype"
    assert engine_keys in str(refused({"model": ATTN_ONLY, "prefill": [1]}))
    assert engine_keys in str(refused({"model": ATTN_ONLY, "decode": {"x": 1}}))
    assert scenario_keys in str(refused([1]))
    assert scenario_keys in str(refused({"model": ATTN_ONLY, "x": 1}))


def test_source_of_a_model_file(tmp_path: Path) -> None:
    from kvgeom.model.models import resolve

    hf = Path(__file__).resolve().parents[2] / "data" / "hf" / "nvidia-nemotron-nano-9b-v2" / "config.json"
    (tmp_path / "cfg").mkdir()
    (tmp_path / "cfg" / "config.json").write_text(hf.read_text())
    (tmp_path / "s.json").write_text(json.dumps({"model": "cfg/config.json", "kv_cache_dtype": "fp8"}))
    s = Scenario.load(tmp_path / "s.json")  # the model path is taken from the scenario's folder
    want = resolve(str(tmp_path / "cfg" / "config.json"))
    assert s.source is not None
    assert s.source.origin == want.origin
    assert s.source.num_attention_heads == want.num_attention_heads
    assert s.source.num_attention_heads is not None
    assert s.model.name == want.spec.name
    assert sc().source.origin == "inline model spec"  # type: ignore[union-attr]


def test_seeded_ids_are_distinct_and_pairings_keep_compat() -> None:
    h = sc(HYBRID, prefill={"num_blocks": 10}, decode={"num_blocks": 20})
    r = h.request(432, seed=5)  # P needs all 10 blocks: 9 attention + 1 state slot
    assert sorted(i for g in r.prefill for i in g) == list(range(10))
    v = sc(compat="vllm", mode="push")
    assert all(p.compat == "vllm" and p.mode == "push" for p in v.pairings.values())
    assert all(p.compat == "kvgeom" and p.mode == "pull" for p in sc().pairings.values())


def test_check_ranks_keeps_the_geometry_message() -> None:
    with pytest.raises(ConfigError) as info:
        check_ranks(sc(HYBRID, decode={"block_size": 16}))
    text = str(info.value)
    assert text.startswith("decode.block_size: attention pages [1024] B do not all equal")
    assert "use block size 48" in text


def test_a_missing_scenario_file_names_the_path(tmp_path: Path) -> None:
    path = tmp_path / "nowhere.json"
    with pytest.raises(ConfigError) as err:
        Scenario.load(path)
    assert err.value.field == "scenario" and err.value.values == {"value": str(path)}


def test_every_shipped_example_loads_as_a_scenario_without_its_comments() -> None:
    shipped = examples()
    assert "demo-mamba2-hybrid_p2_d1_pull" in shipped
    for name, path in shipped.items():
        data = example(name)
        raw = json.loads(path.read_text())
        assert data == {k: v for k, v in raw.items() if not k.startswith("_")}
        assert Scenario.from_json(data).engine("prefill").tp_size == raw["prefill"]["tp_size"]


def test_an_unknown_example_names_the_shipped_ones() -> None:
    with pytest.raises(ConfigError) as err:
        example("no-such-pair")
    assert err.value.field == "example"
    assert err.value.values["value"] == "no-such-pair"
    assert set(err.value.values["expected"]) == set(examples())
