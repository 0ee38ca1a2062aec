"""The adapter's zeroing (post-receive ranges, failed requests) against a byte-by-byte reference."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from kvgeom_nixl import zeroing
from kvgeom_nixl.kvrank import _zero_rows, block_rows, zero_runs

from kvgeom.errors import PlanError


def _reference(sizes: list[int], rows: np.ndarray) -> list[np.ndarray]:
    out = [np.full(n, 7, dtype=np.uint8) for n in sizes]
    for region, offset, length in rows.tolist():
        out[region][offset : offset + length] = 0
    return out


@pytest.mark.parametrize("seed", range(6))
def test_zero_rows_match_the_reference(seed: int) -> None:
    rng = np.random.default_rng(seed)
    sizes = [4096 * int(rng.integers(2, 9)) for _ in range(3)]
    rows = []
    for _ in range(int(rng.integers(1, 40))):
        region = int(rng.integers(0, 3))
        length = int(rng.choice([1, 3, 64, 512, 4096]))  # unaligned, aligned and whole-page lengths
        offset = int(rng.integers(0, sizes[region] - length + 1))
        if rng.random() < 0.5:
            offset -= offset % length
        rows.append((region, offset, length))
    arr = np.asarray(rows, dtype=np.int64)
    tensors = [torch.full((n,), 7, dtype=torch.uint8) for n in sizes]
    zeroed = _zero_rows(tensors, arr)
    want = _reference(sizes, arr)
    for t, w in zip(tensors, want):
        assert np.array_equal(t.numpy(), w)
    assert zeroed == int(arr[:, 2].sum())


def test_zero_rows_write_through_a_strided_tensor() -> None:
    # a tensor viewing every other byte of its storage: the zeroed bytes are its own, never a copy's
    base = torch.full((64, 2), 7, dtype=torch.uint8)
    t = base[:, 0]
    assert _zero_rows([t], np.asarray([[0, 8, 8], [0, 21, 3]], dtype=np.int64)) == 11
    want = np.full(64, 7, dtype=np.uint8)
    want[8:16] = 0
    want[21:24] = 0
    assert np.array_equal(t.numpy(), want)
    assert (base[:, 1] == 7).all()


def test_bench_zero_smoke() -> None:
    # bench/bench_zero.py at a tiny size: its byte-by-byte check passes and it reports both cases
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    out = subprocess.run(
        [
            sys.executable,
            str(root / "bench" / "bench_zero.py"),
            "--tokens",
            "100",
            "300",
            "--reps",
            "1",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=root,
    )
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout.strip().splitlines()[-1])
    cases = data["cases"]
    assert {c["kind"] for c in cases} == {"failure", "post-receive"}
    assert {c["pair"] for c in cases} == {"kimi-linear", "demo-mamba2-hybrid", "llama-3.1-8b"}
    assert all(c["bytes"] > 0 and c["kvgeom_s"] > 0 and c["memset_s"] > 0 for c in cases)
    assert all(0 < c["runs"] <= c["rows"] for c in cases)


def _random_rows(rng: np.random.Generator, sizes: list[int], n: int) -> np.ndarray:
    """Rows of every shape zeroing meets: unaligned, aligned, empty, adjacent (one ending where the next
    starts, also at a region's end and the next region's start), overlapping and duplicated."""
    rows: list[tuple[int, int, int]] = []
    while len(rows) < n:
        region = int(rng.integers(0, len(sizes)))
        kind = rng.random()
        length = int(rng.choice([0, 1, 3, 7, 8, 64, 100, 512, 4096, 20000]))
        length = min(length, sizes[region])
        offset = int(rng.integers(0, sizes[region] - length + 1))
        if kind < 0.3:
            offset -= offset % max(length, 1)  # aligned to its own length
        rows.append((region, offset, length))
        if kind > 0.7 and offset + 2 * length <= sizes[region]:
            rows.append((region, offset + length, length))  # adjacent
        elif kind > 0.6 and length > 1:
            rows.append((region, offset + length // 2, length))  # overlapping
            rows[-1] = (region, min(rows[-1][1], sizes[region] - length), length)
        elif kind > 0.55:
            rows.append(rows[-1])  # duplicated
    if rng.random() < 0.3:  # touching across a region boundary: never one run
        rows += [(0, sizes[0] - 5, 5), (1, 0, 5)]
    order = rng.permutation(len(rows))
    return np.asarray(rows, dtype=np.int64)[order].reshape(-1, 3)


# every path _zero_rows has, on CPU tensors:
# (_FEW_ROWS, _WINDOW_MIN_RUNS, _WINDOW_MAX_BYTES, _VEC_MIN_RUNS, _LOOP_MIN_BYTES, _MAX_CHUNKS_PER_RUN, host)
_PATHS = {
    "as-is": None,
    "few rows, merged in Python": (10**9, 4, 1 << 20, 64, 16384, 4, True),
    "merged, one memset per run": (0, 10**9, 1 << 20, 64, 16384, 4, True),
    "merged, one host write per length": (0, 2, 10**9, 64, 16384, 4, True),
    "merged, a host write even for one run": (0, 1, 10**9, 64, 16384, 4, True),
    "torch only, zero_ per run": (0, 4, 1 << 20, 10**9, 0, 4, False),
    "torch only, index_fill_": (0, 4, 1 << 20, 1, 10**9, 4, False),
    "torch only, few rows": (10**9, 4, 1 << 20, 64, 16384, 4, False),
}
_KNOBS = (
    "_FEW_ROWS",
    "_WINDOW_MIN_RUNS",
    "_WINDOW_MAX_BYTES",
    "_VEC_MIN_RUNS",
    "_LOOP_MIN_BYTES",
    "_MAX_CHUNKS_PER_RUN",
)


def _force(monkeypatch: pytest.MonkeyPatch, path: str) -> None:
    """Set zeroing's thresholds (and whether tensors count as host memory) so that ``path`` is taken."""
    if _PATHS[path] is None:
        return
    *knobs, host = _PATHS[path]
    for name, value in zip(_KNOBS, knobs):
        monkeypatch.setattr(zeroing, name, value)
    if not host:
        monkeypatch.setattr(zeroing, "_host", lambda t: False)


@pytest.mark.parametrize("path", list(_PATHS))
@pytest.mark.parametrize("seed", range(12))
def test_zero_rows_every_path_matches_the_reference(
    path: str, seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # random range sets against one slice per row; bytes outside the rows keep their value
    _force(monkeypatch, path)
    rng = np.random.default_rng(seed)
    sizes = [int(rng.integers(1, 40)) * 1024 + int(rng.integers(0, 9)) for _ in range(3)]
    rows = _random_rows(rng, sizes, int(rng.choice([1, 5, 70, 300])))
    tensors = [torch.from_numpy(rng.integers(1, 256, n, dtype=np.uint8)) for n in sizes]
    want = [t.numpy().copy() for t in tensors]
    for region, offset, length in rows.tolist():
        want[region][offset : offset + length] = 0
    assert _zero_rows(tensors, rows) == int(rows[:, 2].sum())
    for t, w in zip(tensors, want):
        assert np.array_equal(t.numpy(), w)


def _strided_tails(regions: int, count: int, length: int, stride: int, first: int) -> list[list[int]]:
    """``count`` tails of ``length`` bytes every ``stride`` bytes from ``first``, in every region: what a
    short receive leaves to zero (the same pattern in each region)."""
    return [[r, first + k * stride, length] for r in range(regions) for k in range(count)]


@pytest.mark.parametrize("path", list(_PATHS))
@pytest.mark.parametrize("shuffle", [False, True])
def test_zero_rows_strided_tails_and_a_region_of_mixed_lengths(
    path: str, shuffle: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # 12 regions of 8 equally strided tails (one host write for all of them), one region with tails of
    # three lengths (one write per length, a memset for the odd one), one byte-unaligned, one empty region
    _force(monkeypatch, path)
    size = 40000
    rows = _strided_tails(12, 8, 1024, 4096, 3072)
    rows += [[12, o, 100] for o in range(5, 2005, 400)] + [[12, o, 7] for o in range(3001, 9001, 600)]
    rows += [[12, 20000, 5000], [13, 1, 4095], [13, 8193, 4095], [13, 16385, 4095], [13, 24577, 4095]]
    arr = np.asarray(rows, dtype=np.int64)
    if shuffle:
        arr = arr[np.random.default_rng(1).permutation(len(arr))]
    tensors = [torch.full((size,), 0xA5, dtype=torch.uint8) for _ in range(15)]
    writes: list[tuple[int, int]] = []
    real = zeroing._zero_windows

    def spy(addr: np.ndarray, length: int) -> bool:
        done = real(addr, length)
        if done:
            writes.append((addr.size, length))
        return done

    monkeypatch.setattr(zeroing, "_zero_windows", spy)
    assert _zero_rows(tensors, arr) == int(arr[:, 2].sum())
    for t, w in zip(tensors, _reference([size] * 15, arr)):
        assert np.array_equal(t.numpy(), np.where(w == 0, 0, 0xA5))
    if path == "as-is":  # one write per length, across regions; the 5000-byte run alone is a memset
        assert sorted(writes) == [(4, 4095), (5, 100), (10, 7), (96, 1024)]


@pytest.mark.parametrize("chunks", [4, 0])
@pytest.mark.parametrize("many", [False, True])
def test_zero_rows_on_tensors_that_are_not_contiguous(
    chunks: int, many: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # every other byte of a storage (a view, not a copy): merged runs go through torch, by numpy chunks
    # of a [-1, g] view or (runs needing more chunks than _MAX_CHUNKS_PER_RUN each) one zero_() per run;
    # the contiguous region beside them is zeroed directly
    monkeypatch.setattr(zeroing, "_MAX_CHUNKS_PER_RUN", chunks)
    monkeypatch.setattr(zeroing, "_VEC_MIN_RUNS", 4)
    base = torch.full((8192, 2), 7, dtype=torch.uint8)
    tensors = [base[:, 0], torch.full((8192,), 7, dtype=torch.uint8)]
    assert not tensors[0].is_contiguous()
    rows = [[0, o, 64] for o in range(0, 8192, 512)] + [[0, 100, 3], [1, 0, 64], [1, 64, 64]]
    rows += _strided_tails(2, 40, 16, 128, 0) if many else []
    arr = np.asarray(rows, dtype=np.int64)
    assert _zero_rows(tensors, arr) == int(arr[:, 2].sum())
    want = _reference([8192, 8192], arr)
    assert np.array_equal(tensors[0].numpy(), want[0]) and np.array_equal(tensors[1].numpy(), want[1])
    assert (base[:, 1] == 7).all()


def test_zero_rows_host_write_stays_within_numpy_size_limit() -> None:
    # runs too far apart for one view (span x length past numpy's limit) are refused before any write
    assert not zeroing._zero_windows(np.asarray([1 << 12, 1 << 51, 1 << 52, 1 << 53]), 4096)
    assert not zeroing._zero_windows(np.asarray([4096, 8192, 12288]), 16)  # fewer than _WINDOW_MIN_RUNS
    t = torch.full((1 << 21,), 7, dtype=torch.uint8)
    addr = t.data_ptr() + np.asarray([0, 4096, 8192, 1 << 20], dtype=np.int64)
    assert zeroing._zero_windows(addr, 4096)
    want = np.full(1 << 21, 7, dtype=np.uint8)
    for o in (0, 4096, 8192, 1 << 20):
        want[o : o + 4096] = 0
    assert np.array_equal(t.numpy(), want)


@pytest.mark.parametrize("seed", range(20))
def test_zero_runs_are_the_rows_bytes_as_the_fewest_runs(seed: int) -> None:
    rng = np.random.default_rng(100 + seed)
    sizes = [int(rng.integers(1, 5)) * 1000 + int(rng.integers(0, 3)) for _ in range(3)]
    rows = _random_rows(rng, sizes, int(rng.integers(1, 200)))
    region, start, end, total = zero_runs(rows, sizes)
    assert total == int(rows[:, 2].sum())
    covered = [np.zeros(n, dtype=bool) for n in sizes]
    for r, o, n in rows.tolist():
        covered[r][o : o + n] = True
    got = [np.zeros(n, dtype=bool) for n in sizes]
    for r, s, e in zip(region.tolist(), start.tolist(), end.tolist()):
        assert 0 <= s < e <= sizes[r]
        got[r][s:e] = True
    assert all(np.array_equal(a, b) for a, b in zip(got, covered))
    # the fewest: sorted, disjoint and not touching within a region
    key = np.stack([region, start], axis=1).tolist()
    assert key == sorted(key)
    same = region[1:] == region[:-1]
    assert (start[1:][same] > end[:-1][same]).all()
    # as many runs as maximal stretches of covered bytes
    stretches = sum(
        int(np.count_nonzero(np.diff(np.concatenate([[0], c.astype(np.int8), [0]])) == 1)) for c in covered
    )
    assert region.size == stretches


@pytest.mark.parametrize(
    "rows",
    [
        [[0, 60, 5]],  # past the region's end
        [[0, -1, 2]],
        [[0, 4, -1]],
        [[2, 0, 1]],  # no such region
        [[-1, 0, 1]],
    ],
)
@pytest.mark.parametrize("many", [False, True])
def test_zero_rows_outside_a_region_are_refused_before_any_write(rows: list, many: bool) -> None:
    tensors = [torch.full((64,), 7, dtype=torch.uint8), torch.full((32,), 7, dtype=torch.uint8)]
    arr = np.asarray([[0, 0, 8]] * (100 if many else 1) + rows, dtype=np.int64)  # a good row first
    with pytest.raises(PlanError) as err:
        _zero_rows(tensors, arr)
    assert isinstance(err.value, ValueError)
    assert all((t == 7).all() for t in tensors)


@pytest.mark.parametrize("path", ["as-is", "few rows, merged in Python", "torch only, few rows"])
def test_zero_rows_few_rows_out_of_order_overlapping_and_empty(
    path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the Python path sorts rows out of order, joins overlapping and touching ones, skips empty ones
    _force(monkeypatch, path)
    tensors = [torch.full((64,), 7, dtype=torch.uint8), torch.full((32,), 7, dtype=torch.uint8)]
    arr = np.asarray([[1, 8, 4], [0, 10, 6], [0, 4, 8], [1, 0, 0], [0, 16, 2], [0, 40, 0], [1, 31, 1]])
    assert _zero_rows(tensors, arr) == 21
    for t, w in zip(tensors, _reference([64, 32], arr)):
        assert np.array_equal(t.numpy(), w)


@pytest.mark.parametrize("rows", [[[-1, 0, 0]], [[0, 0, 0], [-1, 0, 0]], [[1, 0, 4], [0, 70, 0]]])
def test_zero_rows_refuse_a_missing_region_or_an_empty_row_outside_even_when_nothing_is_written(
    rows: list,
) -> None:
    tensors = [torch.full((64,), 7, dtype=torch.uint8), torch.full((32,), 7, dtype=torch.uint8)]
    with pytest.raises(PlanError) as err:
        _zero_rows(tensors, np.asarray(rows, dtype=np.int64))
    assert isinstance(err.value, ValueError)
    assert all((t == 7).all() for t in tensors)


def test_zero_rows_refuse_rows_that_are_not_triples() -> None:
    with pytest.raises(PlanError):
        _zero_rows([torch.zeros(8, dtype=torch.uint8)], np.zeros((100, 2), dtype=np.int64))
    assert _zero_rows([torch.zeros(8, dtype=torch.uint8)], np.zeros((0, 3), dtype=np.int64)) == 0


def test_block_rows_every_region_every_block() -> None:
    # the rows a failed request zeroes: one per (region, block), region-major, whole block strides
    from kvgeom.tools.scenario import Scenario

    sc = Scenario.from_json(
        {
            "model": "nemotron-h-8b",
            "mode": "pull",
            "prefill": {"tp_size": 2, "block_size": 1056, "kernel_block_size": 16, "num_blocks": 40},
            "decode": {"tp_size": 1, "block_size": 1056, "kernel_block_size": 32, "num_blocks": 20},
        }
    )
    geom = sc.cards("decode")[0].geometry
    req = sc.request(5000, seed=3)
    rows = block_rows(geom, req.decode)
    blocks = np.unique(rows[rows[:, 0] == 0, 1]) // geom.regions[0].block_stride
    assert blocks.size > 0
    want = np.concatenate(
        [
            np.stack(
                [
                    np.full(blocks.size, r.index),
                    blocks * r.block_stride,
                    np.full(blocks.size, r.block_stride),
                ],
                1,
            )
            for r in geom.regions
        ]
    )
    assert np.array_equal(rows, want)
