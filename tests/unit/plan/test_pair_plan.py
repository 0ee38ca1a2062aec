"""kvgeom.plan.pairplan: the per-pair plan Pairing.create computes once, and what requests read from it."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from kvgeom import Pairing, PlanError, plan_request
from kvgeom.plan.descids import desc_segments
from kvgeom.tools.scenario import Scenario

EXAMPLE = "kvgeom/examples/nemotron-h-8b_p2_d1_pull.json"
DEMO = "kvgeom/examples/demo-mamba2-hybrid_p2_d1_pull.json"  # vLLM 0.33.0 pairs it too


def _pairing(compat: str = "kvgeom", example: str = EXAMPLE) -> Pairing:
    sc = Scenario.load(example)
    p = next(iter(sc.pairings.values()))
    return Pairing.create(p.local, list(p.remotes.values()), p.mode, compat)


def test_create_computes_one_rank_table_per_remote_rank() -> None:
    p = _pairing()
    assert p.plan is not None
    assert sorted(p.plan.ranks) == sorted(p.targets)
    for rank, rt in p.plan.ranks.items():
        assert rt.keep == p.group_mask(rank)
        assert rt.local_rows == len(p.local_table(p.local_key(rank)))
        assert rt.remote_rows == len(p.remote_table(rank))
        v = p.remote_view(rank)
        want = desc_segments(
            len(p.local.groups),
            v.num_blocks,
            v.num_regions,
            None,
            v.ppl,
            p.local.group_is_ssm,
            v.ssm_region_indices or None,
            v.num_conv_pieces or 3,
            region_group_ids=v.group_ids or None,
            transfer_layer_group_ids=v.transfer_groups,
            scratch_groups=p.local.scratch_groups,
            scratch_region_indices=v.scratch_region_indices,
            ple_group=p.local.ple.group if p.local.ple else None,
            group_streams=v.group_streams,
        )
        assert np.array_equal(rt.remote.offset, want.offset) and np.array_equal(rt.remote.group, want.group)
    assert p.plan.sent_groups == tuple(
        any(p.plan.ranks[r].keep[g] for r in p.transfer_ranks) for g in range(len(p.local.groups))
    )


def test_a_pull_keeps_the_pages_its_rule_zeroes() -> None:
    kv, vl = _pairing("kvgeom", DEMO), _pairing("vllm", DEMO)
    groups = len(kv.local.groups)
    # kvgeom mode zeroes what the pairing fills and no source wrote; vLLM's rule reads every page of a group
    assert kv.plan is not None and (len(kv.plan.filled_pages), len(kv.plan.zero_pages)) == (groups, 0)
    assert vl.plan is not None and (len(vl.plan.filled_pages), len(vl.plan.zero_pages)) == (0, groups)
    assert [ps.pages for ps in vl.plan.zero_pages] == [tuple(vl.tables.group_pages[g]) for g in range(groups)]
    assert vl.plan.push_writers == {}  # only vLLM's push with DCP needs them


def test_the_plan_is_printed_with_the_pairing() -> None:
    p = _pairing()
    text = p.describe()
    assert "per-pair plan:" in text
    assert sum(line.strip().startswith("rank ") for line in text.splitlines()) == len(p.targets)


def test_a_pairing_built_without_create_has_no_plan_to_plan_with() -> None:
    p = _pairing()
    bare = replace(p, plan=None)
    ids = [[g] for g in range(len(p.local.groups))]
    with pytest.raises(PlanError) as e:
        plan_request(bare, ids, ids, num_tokens=1)
    assert e.value.field == "pairing"
