"""The command line: every command on the shipped examples and presets, --json output, models by name, id
or config.json, and bad input: one line naming the field and what is accepted, exit status 2, never a
traceback (a table of bad inputs plus a hypothesis fuzz of engine flags)."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvgeom
from kvgeom.cli import SCHEMA_VERSION, build_parser, main

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = "examples/nemotron-h-8b_p2_d1_pull.json"
NANO = str(ROOT / "tests" / "data" / "hf" / "nvidia-nemotron-3-nano-30b-a3b" / "config.json")


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def _json(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, dict[str, Any]]:
    code, out, _ = _run(capsys, *argv, "--json")
    data = json.loads(out)
    assert data["schema_version"] == SCHEMA_VERSION and data["kvgeom_version"] == kvgeom.__version__
    assert data["exit_status"] == code and data["ok"] == (code == 0)
    return code, data


# -- commands ----------------------------------------------------------------------------------------------
def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.strip() == f"kvgeom {kvgeom.__version__}"


def test_models_lists_presets_with_their_ids(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run(capsys, "models")
    assert code == 0
    assert "nemotron-h-8b" in out and "Qwen/Qwen3-8B" in out and "not supported" in out  # MiniMax lightning
    code, data = _json(capsys, "models")
    rows = {m["name"]: m for m in data["models"]}
    # Qwen3-8B: 32 query heads (TP divides them), 8 KV heads (replicated past TP8)
    assert rows["qwen3-8b"]["hf_id"] == "Qwen/Qwen3-8B" and rows["qwen3-8b"]["tp_sizes"] == [
        1,
        2,
        4,
        8,
        16,
        32,
    ]
    # Nemotron-H 8B: 8 Mamba2 groups must be divided by TP (vLLM replicates only a single group)
    assert rows["nemotron-h-8b"]["tp_sizes"] == [1, 2, 4, 8]
    assert rows["minimax-text-01"]["supported"] is False and "lightning" in rows["minimax-text-01"]["reason"]


def test_examples_are_installed_and_usable_by_name(capsys: pytest.CaptureFixture[str]) -> None:
    code, data = _json(capsys, "examples")
    names = {e["name"]: e for e in data["examples"]}
    assert {"nemotron-h-8b_p2_d1_pull", "demo-mamba2-hybrid_p2_d1_pull"} <= set(names)
    assert all(Path(e["path"]).is_file() for e in names.values())
    assert _run(capsys, "check", "demo-mamba2-hybrid_p2_d1_pull")[0] == 0


def test_demo_example_is_the_demos_default_pair() -> None:
    from kvgeom_lab.demo import DEFAULT_SCENARIO

    data = json.loads((ROOT / "kvgeom" / "examples" / "demo-mamba2-hybrid_p2_d1_pull.json").read_text())
    data.pop("_comment")
    assert data == DEFAULT_SCENARIO


def test_check_explain_plan_draw_on_the_example(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run(capsys, "check", EXAMPLE)
    assert code == 0 and "decode rank 0: OK" in out
    code, out, _ = _run(capsys, "explain", EXAMPLE)
    assert code == 0 and "region 0" in out and "[prefill]" in out
    code, out, _ = _run(capsys, "plan", EXAMPLE, "--tokens", "1200", "--moves", "3")
    assert code == 0 and "2 transfer(s)" in out and "src_rank" in out
    code, out, _ = _run(
        capsys, "draw", "--model", "qwen3.5-0.8b", "--prefill", "tp=2", "--decode", "tp=1", "--tokens", "600"
    )
    assert code == 0 and "D rank 0:" in out and "|" in out


def test_json_payloads(capsys: pytest.CaptureFixture[str]) -> None:
    code, data = _json(capsys, "check", EXAMPLE)
    assert code == 0 and data["command"] == "check"
    assert data["ranks"] == [
        {
            "side": "decode",
            "rank": 0,
            "ok": True,
            "summary": data["ranks"][0]["summary"],
            "tp_ratio": -2,
            "block_size_ratio": 2,
            "targets": [0, 1],
        }
    ]
    code, data = _json(capsys, "plan", EXAMPLE, "--tokens", "1200", "--moves", "2")
    (rank,) = data["ranks"]
    assert [t["remote_rank"] for t in rank["transfers"]] == [0, 1]
    assert rank["bytes"] == sum(t["bytes"] for t in rank["transfers"]) and len(rank["moves"]) == 2
    # 1200 tokens: D (block 2080) holds 1 attention block + 6 state slots; P (block 1040) 2 + 6
    assert [len(g) for g in data["request"]["decode_ids"]] == [1, 1, 1, 1, 1, 1, 1]
    assert [len(g) for g in data["request"]["prefill_ids"]] == [2, 1, 1, 1, 1, 1, 1]
    code, data = _json(capsys, "explain", EXAMPLE)
    assert data["rank0"]["prefill"]["block_size"] == 16 and data["rank0"]["decode"]["ppl"] == 65
    code, data = _json(capsys, "draw", EXAMPLE, "--tokens", "100")
    assert data["format"] == "text" and data["d_tp"] == 1 and data["runs"]


def test_plan_one_rank_and_seeded_ids(capsys: pytest.CaptureFixture[str]) -> None:
    code, data = _json(
        capsys,
        "plan",
        "--model",
        "qwen3-8b",
        "--prefill",
        "tp=1",
        "--decode",
        "tp=4",
        "--rank",
        "3",
        "--seed",
        "5",
    )
    assert code == 0 and [r["rank"] for r in data["ranks"]] == [3]
    assert data["request"]["decode_ids"] != [list(range(7))]  # drawn from the pool, not sequential


@pytest.mark.parametrize(
    "ref",
    [
        "qwen3-8b",
        "Qwen/Qwen3-8B",
        "qwen/qwen3-8b",
        "tests/data/hf/qwen3-8b/config.json",
        "tests/data/hf/qwen3-8b",
    ],
)
def test_model_by_preset_name_hf_id_or_config(capsys: pytest.CaptureFixture[str], ref: str) -> None:
    code, data = _json(capsys, "check", "--model", ref, "--prefill", "tp=2", "--decode", "tp=1")
    assert code == 0 and data["scenario"]["model"] == "Qwen/Qwen3-8B"


def test_nemotron3_nano_fp8_blocks_through_the_cli(capsys: pytest.CaptureFixture[str]) -> None:
    """vLLM issue 41037: --block-size 32, fp8 KV cache -> 4192-token blocks at TP1/TP2, 2112 at TP4."""
    code, data = _json(
        capsys,
        "explain",
        "--model",
        NANO,
        "--kv-cache-dtype",
        "fp8",
        "--prefill",
        "tp=2,min_block=32",
        "--decode",
        "tp=4,min_block=32",
    )
    assert code == 0
    assert (
        data["scenario"]["prefill"]["block_size"] == 4192 and data["scenario"]["decode"]["block_size"] == 2112
    )
    code, data = _json(
        capsys, "explain", "--model", NANO, "--kv-cache-dtype", "fp8", "--prefill", "tp=1,min_block=32"
    )
    assert data["scenario"]["prefill"]["block_size"] == 4192


def test_refused_pair_exits_1_with_the_reason(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["check", "--model", "falcon-h1-0.5b", "--prefill", "tp=1", "--decode", "tp=2", "--compat", "vllm"]
    code, _, err = _run(capsys, *argv)
    assert code == 1 and "55208" in err and err.startswith("kvgeom: refused: ") and err.count("\n") == 1
    code, data = _json(capsys, *argv)
    assert data["error"]["kind"] == "refused" and "55208" in data["error"]["message"]


def test_draw_pictures(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    for suffix in ("png", "svg"):
        path = tmp_path / f"pair.{suffix}"
        code, out, _ = _run(
            capsys, "draw", "demo-mamba2-hybrid_p2_d1_pull", "--tokens", "90", "-o", str(path)
        )
        assert code == 0 and str(path) in out
    assert (tmp_path / "pair.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    svg = (tmp_path / "pair.svg").read_text()
    assert svg.lstrip().startswith("<?xml") and "<svg" in svg


def test_draw_without_matplotlib_names_the_plot_extra(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    code, _, err = _run(capsys, "draw", EXAMPLE, "-o", str(tmp_path / "x.png"))
    assert code == 2 and "pip install 'kvgeom[plot]'" in err and err.count("\n") == 1
    code, out, _ = _run(capsys, "draw", EXAMPLE, "--tokens", "50")  # the text picture needs nothing
    assert code == 0 and "D rank 0:" in out


def test_demo_without_the_nixl_extra_says_so_at_once(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import kvgeom_lab.cluster

    def never(*args: object, **kwargs: object) -> None:
        raise AssertionError("no process may start without the extra")

    monkeypatch.setattr(kvgeom_lab.cluster, "run_cluster", never)
    monkeypatch.setitem(sys.modules, "nixl", None)
    code, out, err = _run(capsys, "demo")
    assert code == 2 and out == ""
    assert err.startswith("kvgeom: error: demo: needs the nixl extra: pip install 'kvgeom[nixl]'")
    assert "nixl" in err and err.count("\n") == 1


def test_demo_without_a_demo_plugin_names_the_extra_to_install(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import importlib.metadata

    from kvgeom.cli import _commands

    assert [
        ep.value for ep in importlib.metadata.entry_points(group=_commands.PLUGIN_GROUP, name="demo")
    ] == ["kvgeom_lab.demo"]
    monkeypatch.setattr(importlib.metadata, "entry_points", lambda **kw: [])
    assert _commands.demo_plugin()[0] is None
    code, out, err = _run(capsys, "demo", "--json")
    error = json.loads(out)["error"]
    assert code == 2 and (error["kind"], error["type"], error["field"]) == ("usage", "UsageError", "demo")
    assert (
        _commands.NIXL_EXTRA in error["message"] and error["accepted"] == "an environment with the nixl extra"
    )
    assert err.count("\n") == 1  # one line, no traceback


def test_every_option_has_help() -> None:
    parser = build_parser()
    subs = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for name, sub in subs.choices.items():
        for action in sub._actions:
            assert action.help, f"{name} {action.option_strings or action.dest} has no help"
    assert all(a.help for a in parser._actions)


# -- bad input -----------------------------------------------------------------------------------------------
def _bad_files(tmp: Path) -> dict[str, str]:
    files = {
        "malformed.json": "{not json",
        "list.json": "[1, 2]",
        "string.json": '"model"',
        "unknown.json": json.dumps({"model": "qwen3-8b", "prefil": {}}),
        "badmode.json": json.dumps({"model": "qwen3-8b", "mode": "pul"}),
        "badtp.json": json.dumps({"model": "qwen3-8b", "prefill": {"tp_size": "two"}}),
        "badengine.json": json.dumps({"model": "qwen3-8b", "decode": [1]}),
        "nomodel.json": json.dumps({"prefill": {}}),
        "binary.json": "\udcff",
    }
    for name, text in files.items():
        (tmp / name).write_text(text, errors="surrogateescape")
    return {name: str(tmp / name) for name in files}


BAD = [
    # (argv, field named in the one-line error)
    (["check", "@malformed"], "scenario"),
    (["check", "@list"], "scenario"),
    (["check", "@string"], "scenario"),
    (["check", "@unknown"], "prefil"),
    (["check", "@badmode"], "mode"),
    (["check", "@badtp"], "prefill.tp_size"),
    (["check", "@badengine"], "decode"),
    (["check", "@nomodel"], "model"),
    (["check", "@binary"], "scenario"),
    (["check", "/no/such/file.json"], "scenario"),
    (["check", "@tmp"], "scenario"),
    (["plan"], "model"),
    (["check", "--model", "qwen3-8b", "--prefill", "tp=two"], "--prefill tp"),
    (["check", "--model", "qwen3-8b", "--prefill", "blok=16"], "--prefill blok"),
    (["check", "--model", "qwen3-8b", "--prefill", "tp=2,tp=4"], "--prefill tp"),
    (["check", "--model", "qwen3-8b", "--prefill", "tp"], "--prefill"),
    (["check", "--model", "qwen3-8b", "--prefill", "tp=99999999999999999999"], "--prefill tp"),
    (["check", "--model", "qwen3-8b", "--prefill", "tp=1024"], "--prefill tp"),
    (["check", "--model", "qwen3-8b", "--prefill", "tp=3"], "--prefill tp"),
    (["check", "--model", "qwen3-8b", "--prefill", "tp=0"], "--prefill tp"),
    (["check", "--model", "qwen3-8b", "--prefill", "tp=-2"], "--prefill tp"),
    (["plan", "--model", "qwen3-8b", "--prefill", "blocks=1e15"], "--prefill blocks"),
    (["plan", "--model", "qwen3-8b", "--prefill", "blocks=1000000000000000"], "--prefill blocks"),
    (["plan", "--model", "qwen3-8b", "--prefill", "blocks=1000000000"], "--prefill blocks"),
    (["check", "--model", "qwen3-8b", "--prefill", "blocks=1000000000000"], "--prefill blocks"),
    (["draw", "--model", "nemotron-h-8b", "--decode", "blocks=1000000000000"], "--decode blocks"),
    (["plan", "--model", "qwen3-8b", "--decode", "block=32,kernel=12"], "--decode kernel"),
    (["plan", "--model", "qwen3-8b", "--decode", "block=big"], "--decode block"),
    (["plan", "--model", "qwen3-8b", "--decode", "split=maybe"], "--decode split"),
    (["plan", "--model", "qwen3-8b", "--decode", "layout=diagonal"], "--decode layout"),
    (["plan", "--model", "nemotron-h-8b", "--decode", "block=16"], "--decode block"),
    (["plan", "--model", "qwen3-8b", "--tokens", "0"], "--tokens"),
    (["plan", "--model", "qwen3-8b", "--tokens", "100000"], "--tokens"),
    (["plan", "--model", "qwen3-8b", "--tokens", "ten"], "--tokens"),
    (["plan", "--model", "qwen3-8b", "--seed", "-1"], "--seed"),
    (["plan", "--model", "qwen3-8b", "--moves", "lots"], "--moves"),
    (["plan", "--model", "qwen3-8b", "--decode", "tp=2", "--rank", "2"], "--rank"),
    (["draw", "--model", "qwen3-8b", "--width", "0"], "--width"),
    (["draw", "--model", "qwen3-8b", "--width", "100000"], "--width"),
    (["draw", "--model", "qwen3-8b", "--format", "png"], "--output"),
    (["draw", "--model", "qwen3-8b", "-o", "picture.txt"], "--output"),
    (["draw", "--model", "qwen3-8b", "-o", "/no/such/dir/p.png"], "--output"),
    (["check", "--model", "qwen9-8b"], "model"),
    (["check", "--model", "Qwen/Qwen3-9B"], "model"),
    (["check", "--model", "/no/such/config.json"], "model"),
    (["check", "--model", "minimax-text-01"], "model"),
    (["check", "--model", "qwen3-8b", "--mode", "sideways"], "--mode"),
    (["check", "--model", "qwen3-8b", "--kv-cache-dtype", "fp4"], "--kv-cache-dtype"),
    (["check", "--model", "qwen3-8b", "--bogus"], "arguments"),
    (["frobnicate"], "COMMAND"),
    ([], "COMMAND"),
    (["demo", "--tokens", "0"], "--tokens"),
    (["demo", "--tokens", "100000"], "--tokens"),
    (["demo", "--tokens", "5000", "5000", "5000", "5000"], "--tokens"),
    (["demo", "--timeout", "0"], "--timeout"),
    (["demo", "--prefill", "blocks=100000000"], "--prefill blocks"),
]


@pytest.mark.parametrize(("argv", "field"), BAD, ids=[" ".join(a) or "(nothing)" for a, _ in BAD])
def test_bad_input_is_one_line_exit_2(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, argv: list[str], field: str
) -> None:
    files = {**_bad_files(tmp_path), "tmp.json": str(tmp_path)}
    argv = [files[a[1:] + ".json"] if a.startswith("@") else a for a in argv]
    code, out, err = _run(capsys, *argv)
    assert code == 2, err
    assert out == "" and err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith(f"kvgeom: error: {field}: "), err
    assert "(accepted: " in err
    code, out, err = _run(capsys, *argv, "--json") if argv and argv[0] != "frobnicate" else (2, "{}", "")
    if out != "{}":
        data = json.loads(out)
        assert data["ok"] is False and data["exit_status"] == 2 and data["error"]["field"] == field


def test_the_installed_entry_point_never_shows_a_traceback(tmp_path: Path) -> None:
    files = _bad_files(tmp_path)
    for argv in (
        ["check", files["malformed.json"]],
        ["plan", "--model", "qwen3-8b", "--prefill", "tp=two"],
        ["draw", "--model", "qwen3-8b", "--width", "0"],
        ["check", "--model", "qwen3-8b", "--prefill", "tp=99999999999999999999"],
    ):
        proc = subprocess.run(
            [sys.executable, "-m", "kvgeom", *argv], capture_output=True, text=True, timeout=60, cwd=ROOT
        )
        assert proc.returncode == 2 and proc.stdout == ""
        assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("kvgeom: error: ")


_KEYS = st.sampled_from(
    [
        "tp",
        "block",
        "min_block",
        "kernel",
        "align",
        "blocks",
        "layout",
        "conv",
        "split",
        "rank",
        "tp_size",
        "num_blocks",
        "",
        "x",
    ]
)
_VALUES = st.one_of(
    st.integers(-3, 70000).map(str),
    st.sampled_from(["auto", "", "1e3", "0x10", "true", "DS", "head_major", "token_major", "9" * 25]),
    st.text(max_size=6),
)


@st.composite
def _engine_flags(draw: st.DrawFn) -> str:
    items = draw(st.lists(st.tuples(_KEYS, _VALUES), max_size=4))
    return ",".join(f"{k}={v}" if draw(st.booleans()) or not k else k for k, v in items)


@given(
    p=_engine_flags(),
    d=_engine_flags(),
    cmd=st.sampled_from(["check", "plan", "draw", "explain"]),
    tokens=st.one_of(st.integers(-5, 5000).map(str), st.text(max_size=4)),
    model=st.sampled_from(["qwen3-8b", "nemotron-h-8b", "qwen3.5-0.8b", "deepseek-v2-lite"]),
)
@settings(
    max_examples=150,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
def test_fuzzed_engine_flags_never_escape(
    capsys: pytest.CaptureFixture[str], p: str, d: str, cmd: str, tokens: str, model: str
) -> None:
    argv = [cmd, "--model", model, f"--prefill={p}", f"--decode={d}"]
    if cmd in ("plan", "draw"):
        argv.append(f"--tokens={tokens}")
    code, out, err = _run(capsys, *argv)
    assert code in (0, 1, 2) and "Traceback" not in err
    if code:
        assert err.count("\n") == 1 and out == ""
        assert err.startswith("kvgeom: error: " if code == 2 else "kvgeom: refused: ")
