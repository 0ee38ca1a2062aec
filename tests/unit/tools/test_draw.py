"""Pictures of a transfer: the map accounts for every byte the plans move and zero, the text picture shows
every D rank and names P ranks past 9, the matplotlib picture stays small, the core imports without it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kvgeom.tools import draw
from kvgeom.tools.scenario import Scenario

ROOT = Path(__file__).resolve().parents[3]


def _map(data: dict, tokens: int) -> tuple[Scenario, draw.TransferMap]:
    sc = Scenario.from_json(data)
    return sc, draw.transfer_map(sc, sc.request(tokens, seed=None))


def _covered(tmap: draw.TransferMap, d: int, region: int) -> tuple[np.ndarray, np.ndarray]:
    """Byte masks of D rank ``d``'s request segments in ``region``: written by a run, and zeroed."""
    seg = tmap.segments[
        (tmap.segments[:, 0] == 1) & (tmap.segments[:, 1] == d) & (tmap.segments[:, 2] == region)
    ]
    end = int((seg[:, 3] + seg[:, 4]).max())
    written, zeroed = np.zeros(end, np.int32), np.zeros(end, np.int32)
    for r in tmap.runs[(tmap.runs[:, 3] == d) & (tmap.runs[:, 4] == region)]:
        written[r[5] : r[5] + r[6]] += 1
    for z in tmap.zero[(tmap.zero[:, 0] == d) & (tmap.zero[:, 1] == region)]:
        zeroed[z[2] : z[2] + z[3]] += 1
    inside = np.zeros(end, bool)
    for s in seg:
        inside[s[3] : s[3] + s[4]] = True
    return written[inside], zeroed[inside]


@pytest.mark.parametrize(
    ("data", "tokens"),
    [
        (
            {"model": "qwen3.5-0.8b", "prefill": {"tp_size": 4}, "decode": {"tp_size": 1}},
            600,
        ),  # 4 -> 1, regrouped
        (
            {"model": "nemotron-h-8b", "prefill": {"tp_size": 4}, "decode": {"tp_size": 1}, "mode": "push"},
            3000,
        ),
        ({"model": "qwen3-8b", "prefill": {"tp_size": 1}, "decode": {"tp_size": 4, "block_size": 32}}, 100),
    ],
)
def test_map_accounts_for_every_byte(data: dict, tokens: int) -> None:
    sc, tmap = _map(data, tokens)
    moved = sum(
        int(p.moves(sc.pairings[r])[:, 6].sum()) for r, p in sc.plans(sc.request(tokens, seed=None)).items()
    )
    assert int(tmap.runs[:, 6].sum()) == moved  # merging and regrouping keep every byte
    assert len(tmap.runs) < moved  # and merge
    for d in range(tmap.d_tp):
        for region in range(len(tmap.region_names)):
            written, zeroed = _covered(tmap, d, region)
            assert written.max() <= 1 and not (written & zeroed).any()
            assert np.all(written + zeroed >= 0)
    # every region is drawn in one class or another
    assert sorted(r for c in tmap.classes for r in c) == list(range(len(tmap.region_names)))


def test_qwen35_four_to_one_after_regroup() -> None:
    """Qwen3.5-0.8B has 2 KV heads: at P TP4, ranks 0-1 hold head 0 and ranks 2-3 head 1; D reads each head
    once, from the first rank holding it (P0, P2). After the regroup D's first block is head 0 then head 1."""
    _, tmap = _map({"model": "qwen3.5-0.8b", "prefill": {"tp_size": 4}, "decode": {"tp_size": 1}}, 600)
    text = draw.ascii_art(tmap, 64).splitlines()
    first = next(line for line in text if line.strip().startswith("block") and line.split()[1] == "0")
    assert first.split("|")[1] == "0" * 32 + "2" * 32
    second = next(line for line in text if line.strip().startswith("block") and line.split()[1] == "1")
    # 600 tokens: D block 1 holds tokens 544-1087; P block 2 (tokens 544-815) fills the first half of each
    # head, the rest is zeroed
    assert second.split("|")[1] == "0" * 16 + "." * 16 + "2" * 16 + "." * 16
    assert tmap.regrouped


def test_text_shows_every_d_rank_and_p_ranks_past_9() -> None:
    """Granite-4.0-H-small at P TP16 -> D TP2: 8 KV heads, so P ranks pair up on a head (rank r holds head
    r // 2) and D rank 1 (heads 4-7) reads them from P ranks 8, 10, 12, 14; its Mamba2 state (128 heads, one
    group) comes from P ranks 8-15."""
    _, tmap = _map(
        {"model": "granite-4.0-h-small", "prefill": {"tp_size": 16}, "decode": {"tp_size": 2}}, 300
    )
    text = draw.ascii_art(tmap, 128)
    assert "D rank 0:" in text and "D rank 1:" in text and "a-z = 10-35" in text
    d1 = text.split("D rank 1:")[1]
    blocks = {c for line in d1.splitlines() if line.strip().startswith("block") for c in line.split("|")[1]}
    states = {c for line in d1.splitlines() if line.strip().startswith("state") for c in line.split("|")[1]}
    assert blocks - {" ", "."} == set("8ace")
    assert states - {" ", "."} == set("89abcdef")


def test_figure_bands_stay_few_and_files_are_written(tmp_path: Path) -> None:
    from matplotlib.collections import (
        PolyCollection,
    )  # the test extra brings matplotlib (test_cli: its absence)

    sc, tmap = _map(
        {
            "model": "nemotron-h-8b",
            "prefill": {"tp_size": 2, "block_size": 1040, "kernel_block_size": 16},
            "decode": {"tp_size": 1, "block_size": 2080, "kernel_block_size": 32},
        },
        3000,
    )
    fig = draw.figure(tmap)
    polys = sum(
        len(c.get_paths()) for ax in fig.axes for c in ax.collections if isinstance(c, PolyCollection)
    )
    # 6,528 byte runs after the regroup (head slices of 16-token pieces) merge into far fewer bands
    assert polys < len(tmap.runs) / 2
    assert len(tmap.classes) == 1  # the 4 regions are alike
    png = draw.save(tmap, tmp_path / "p.png")
    svg = draw.save(tmap, tmp_path / "p.svg")
    assert png.read_bytes()[:4] == b"\x89PNG" and "D0" in svg.read_text() and "P1" in svg.read_text()
    with pytest.raises(Exception) as exc:
        draw.save(tmap, tmp_path / "p.gif")
    assert exc.value.field == "output" and exc.value.values == {"value": "gif"}


def test_the_readme_picture_is_small() -> None:
    from matplotlib.collections import PolyCollection

    sc = Scenario.load(ROOT / "examples" / "demo-mamba2-hybrid_p2_d1_pull.json")
    tmap = draw.transfer_map(sc, sc.request(90, seed=None))
    fig = draw.figure(tmap)
    polys = sum(
        len(c.get_paths()) for ax in fig.axes for c in ax.collections if isinstance(c, PolyCollection)
    )
    assert len(fig.axes) == 1 and polys < 200
    assert len(tmap.zero) and set(tmap.zero[:, 0]) == {0}  # the last D block's tail is zeroed


def test_core_imports_without_matplotlib() -> None:
    code = (
        "import sys; sys.modules['matplotlib'] = None\n"
        "import kvgeom, kvgeom.tools.draw, kvgeom.cli, kvgeom.tools.scenario, kvgeom.model.hfconfig\n"
        "from kvgeom.tools.scenario import Scenario\n"
        "sc = Scenario.from_json({'model': 'qwen3-8b', 'decode': {'tp_size': 2}})\n"
        "print(kvgeom.tools.draw.ascii_art(kvgeom.tools.draw.transfer_map(sc, sc.request(40)), 16).splitlines()[-1])\n"
        "assert 'matplotlib' not in [m for m in sys.modules if sys.modules[m] is not None]\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().endswith("|")
