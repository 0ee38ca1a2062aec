"""The adapter's zeroing (post-receive ranges, failed requests) against a byte-by-byte reference."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from kvgeom_nixl.kvrank import _zero_rows


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
        [sys.executable, str(root / "bench" / "bench_zero.py"), "--tokens", "16", "--reps", "1", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=root,
    )
    assert out.returncode == 0, out.stderr
    cases = json.loads(out.stdout.strip().splitlines()[-1])["cases"]
    assert [c["case"] for c in cases] == ["failure (invalidate)", "post-receive"]
    assert all(c["bytes"] > 0 and c["kvgeom_s"] > 0 for c in cases)
