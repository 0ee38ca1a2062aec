"""The command line: every subcommand on the shipped example and presets, and a refusal's exit status."""

from __future__ import annotations

import pytest

from kvgeom.cli import main

EXAMPLE = "examples/nemotron-h-8b_p2_d1_pull.json"


def test_models_lists_presets(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["models"]) == 0
    out = capsys.readouterr().out
    assert "nemotron-h-8b" in out and "not supported" in out  # MiniMax lightning has no kvgeom spec


def test_check_explain_plan_draw_on_the_example(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", EXAMPLE]) == 0
    assert "decode rank 0: OK" in capsys.readouterr().out
    assert main(["explain", EXAMPLE]) == 0
    assert "region 0" in capsys.readouterr().out
    assert main(["plan", EXAMPLE, "--tokens", "1200", "--moves", "3"]) == 0
    out = capsys.readouterr().out
    assert "2 transfer(s)" in out and "src_rank src_region" in out
    assert main(["draw", "--model", "qwen3.5-0.8b", "--prefill", "tp=2,block=auto", "--decode", "tp=1,block=auto",
                 "--tokens", "600"]) == 0
    out = capsys.readouterr().out
    assert "|" in out and "0" in out and "1" in out


def test_refused_pair_exits_1_with_the_reason(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["check", "--model", "falcon-h1-0.5b", "--prefill", "tp=1,block=auto", "--decode",
                 "tp=2,block=auto", "--compat", "vllm"])
    assert code == 1
    assert "55208" in capsys.readouterr().err
