"""kvgeom.testing.content on host arrays: a rank filled with a request's known content checks clean; a
changed byte, a byte outside the request, and a dirty freed block are each counted where they are."""

from __future__ import annotations

import numpy as np

from kvgeom import card_of, presets
from kvgeom.layout.engine import EngineConfig
from kvgeom.testing import CoordSpace
from kvgeom.testing.content import POISON_BYTE, check_request, fill_source, verify_report

MODEL = presets.load("nemotron-h-8b")
ENGINE = EngineConfig(tp_size=1, block_size=2080, kernel_block_size=32, num_blocks=8)
CARD = card_of("decode", MODEL, ENGINE)
SPACE = CoordSpace(MODEL, 4 * 2080)
IDS = [[1, 2] if not g.is_ssm else [3 + g.index % 4] for g in CARD.geometry.groups]


def _filled() -> tuple[list[np.ndarray], int]:
    tensors = [np.full(r.nbytes, POISON_BYTE, dtype=np.uint8) for r in CARD.geometry.regions]
    return tensors, fill_source(tensors, CARD, SPACE, IDS, 3000, salt=7)


def test_a_rank_holding_its_requests_content_checks_clean() -> None:
    tensors, written = _filled()
    assert written > 0
    report = verify_report(tensors, CARD, SPACE, [(IDS, 0, 3000, True, 7)])
    assert (report.bad_bytes, report.bad_outside, report.skipped_bytes) == (0, 0, 0)
    assert report.checked_bytes == sum(t.size for t in tensors)
    assert check_request(tensors, CARD, SPACE, IDS, 3000, salt=7) == 0
    assert check_request(tensors, CARD, SPACE, IDS, 3000, salt=8) > 0  # another request's bytes differ


def test_changed_and_stray_bytes_are_counted_where_they_are() -> None:
    tensors, _ = _filled()
    region = CARD.geometry.regions[0]
    inside = 1 * region.block_stride * CARD.geometry.ppl  # the first byte of logical block 1
    tensors[0][inside] ^= 0xFF
    tensors[0][-1] = 0  # the last block (7) is no request's: it keeps the poison
    report = verify_report(tensors, CARD, SPACE, [(IDS, 0, 3000, True, 7)])
    assert (report.bad_bytes, report.bad_outside) == (2, 1)
    assert sorted((m.region, m.offset, m.length) for m in report.mismatches) == [
        (0, inside, 1),
        (0, region.nbytes - 1, 1),
    ]


def test_freed_blocks_may_hold_zero_or_poison_and_quarantined_ones_are_skipped() -> None:
    tensors = [np.full(r.nbytes, POISON_BYTE, dtype=np.uint8) for r in CARD.geometry.regions]
    last = [[7] if not g.is_ssm else [] for g in CARD.geometry.groups]
    region = CARD.geometry.regions[0]
    start = 7 * CARD.geometry.ppl * region.block_stride
    tensors[0][start : start + 4] = 0
    assert verify_report(tensors, CARD, SPACE, [], free_ids=last).bad_bytes == 0
    assert verify_report(tensors, CARD, SPACE, []).bad_bytes == 4
    skipped = verify_report(tensors, CARD, SPACE, [], skip_ids=last)
    assert skipped.bad_bytes == 0
    assert skipped.skipped_bytes == sum(CARD.geometry.ppl * r.block_stride for r in CARD.geometry.regions)
