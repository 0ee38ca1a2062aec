"""kvgeom against vLLM 0.33.0's own NIXL geometry functions, on inputs hypothesis draws.

Every test draws inputs past the recorded golden ranges (TP up to 64, up to 64 regions, odd block sizes,
prefix hits, the N-1 flow, DCP, layer-name routing, packed rows, scratch and replicated state pages) and
calls both vLLM's real function and kvgeom's equivalent. The outputs must be equal; where vLLM raises,
kvgeom must refuse with a typed :class:`~kvgeom.errors.KvgeomError`; where kvgeom refuses and vLLM does not,
the test must show that vLLM's output is wrong (:mod:`_e2e` runs whole requests through the byte oracle
for that); a refusal of a clean vLLM result fails the test. The examples are derandomized; the example
counts per test (``EXAMPLES``) add up to more than 5,000 per run.

Run (vLLM 0.33.0's reference venv, with this checkout on the path; about two minutes on 2 cores)::

    PYTHONPATH=$PWD:$PWD/adapters KVGEOM_VLLM_TESTS=1 /path/to/vllm-venv/bin/python -m pytest tests/vllm

(``make test-vllm`` does it in its own venv; ``tests/vllm/conftest.py`` sets vLLM's CPU/offline/DS-layout
environment.)
"""

from __future__ import annotations

import math
from typing import Any

import _vllm as V
import numpy as np
import pytest
from hypothesis import assume, event, given, settings
from hypothesis import strategies as st

from kvgeom.blocks import apply_prefix_caching, logical_to_kernel, map_block_ids_for_block_size_ratio
from kvgeom.errors import KvgeomError
from kvgeom.pair.dcp import apply_dcp_prefix_caching, dcp_consumer_count
from kvgeom.pair.layerroute import RegionTable, align_regions_by_layer, split_packed_rows
from kvgeom.pair.rules import check_csa_linear_tp_layout
from kvgeom.pair.tp import compute_tp_mapping, dcp_handshake_targets
from kvgeom.plan.descids import compute_desc_ids
from kvgeom.plan.exchange import clip_ssm_state_blocks, exchange_clipped_blocks
from kvgeom.plan.regionmap import apply_prefix_caching_by_region, block_ids_by_region
from kvgeom.plan.splits import build_local_splits
from kvgeom.plan.strided import fa_local_rows, fa_remote_rows, mamba_local_rows, mamba_remote_rows

EXAMPLES = {
    "tp_mapping": 1500,
    "desc_ids": 1200,
    "splits": 400,
    "strided": 500,
    "block_ids": 800,
    "dcp": 500,
    "regions": 300,
    "routing": 300,
}

TP = (1, 2, 4, 8, 16, 32, 64)
KINDS = (
    ("fa",),
    ("fa", "ssm"),
    ("mla", "ssm", "ssm"),
    ("fa", "swa"),
    ("mla",),
    ("fa", "swa", "ssm"),
    ("mla", "mla"),
    ("swa", "fa", "fa"),
)


def kv(result: Any) -> Any:
    """kvgeom's result, or ``V.Raised`` for a typed refusal (any other exception propagates)."""
    try:
        return result()
    except KvgeomError as exc:
        return V.Raised(type(exc).__name__, str(exc))


def same(vllm: Any, ours: Any, plain: Any = lambda x: x) -> None:
    """Equal outputs, or both refused (``--hypothesis-show-statistics`` shows how often each)."""
    if isinstance(vllm, V.Raised):
        assert isinstance(ours, V.Raised), f"vLLM raised {vllm}, kvgeom returned {ours!r}"
        event(f"both refused: vLLM {vllm.kind}, kvgeom {ours.kind}")
        return
    assert not isinstance(ours, V.Raised), f"kvgeom refused {ours} a result vLLM computes: {vllm!r}"
    assert plain(ours) == plain(vllm), f"kvgeom {plain(ours)!r} != vLLM {plain(vllm)!r}"
    event("equal")


def arrays(x: Any) -> Any:
    if isinstance(x, np.ndarray):
        return x.tolist()
    if isinstance(x, (list, tuple)):
        return [arrays(v) for v in x]
    return x


# -- TP mapping, DCP ------------------------------------------------------------------------------------
@st.composite
def mapping_inputs(draw: st.DrawFn) -> dict[str, Any]:
    tp = draw(st.sampled_from(TP + (3, 6)))
    remote_tp = draw(st.sampled_from(TP + (3, 12)))
    kinds = draw(st.sampled_from(KINDS))
    is_mla = draw(st.booleans())
    heads = 1 if is_mla else draw(st.sampled_from((1, 2, 4, 8, 16, 32, 64)))
    dcp = remote_dcp = 1
    draft = None
    if is_mla and draw(st.booleans()):
        dcp, remote_dcp = draw(st.sampled_from((1, tp))), draw(st.sampled_from((1, remote_tp)))
        assume(dcp % remote_dcp == 0 or remote_dcp % dcp == 0)
    elif is_mla and draw(st.integers(0, 3)) == 0:
        draft = draw(st.sampled_from((1, 2, 4, 8, 16)))
    return dict(
        rank=draw(st.integers(0, tp - 1)),
        tp=tp,
        remote_tp=remote_tp,
        heads=heads,
        is_mla=is_mla,
        kinds=kinds,
        dcp=dcp,
        remote_dcp=remote_dcp,
        draft=draft,
    )


@settings(max_examples=EXAMPLES["tp_mapping"])
@given(mapping_inputs())
def test_tp_mapping(i: dict[str, Any]) -> None:
    vllm = V.tp_mapping(
        i["rank"],
        i["tp"],
        i["remote_tp"],
        i["heads"],
        i["is_mla"],
        i["kinds"],
        i["dcp"],
        i["remote_dcp"],
        i["draft"],
    )
    ours = kv(
        lambda: compute_tp_mapping(
            i["rank"],
            i["tp"],
            i["remote_tp"],
            i["heads"],
            i["is_mla"],
            [k == "ssm" for k in i["kinds"]],
            i["dcp"],
            i["remote_dcp"],
            i["draft"],
        ).to_json()
    )
    if isinstance(ours, V.Raised) and not isinstance(vllm, V.Raised):
        # vLLM's mapping of a DCP remote never computes the TP ratio; its handshake does, and refuses the pair
        assert isinstance(
            V.call(lambda: V.topology(0, i["tp"], 1, True).tp_ratio(i["remote_tp"])), V.Raised
        ), ours
        return
    same(vllm, ours)
    if isinstance(vllm, V.Raised):
        return
    if i["is_mla"]:
        same(
            V.handshake_targets(i["rank"], i["tp"], i["remote_tp"], i["dcp"], i["remote_dcp"]),
            kv(
                lambda: list(
                    dcp_handshake_targets(i["rank"], i["tp"], i["dcp"], i["remote_tp"], i["remote_dcp"])
                )
            ),
        )
    same(
        V.consumer_count(i["tp"], i["dcp"], i["remote_tp"], i["remote_dcp"]),
        kv(lambda: dcp_consumer_count(i["tp"], i["dcp"], i["remote_tp"], i["remote_dcp"])),
    )


# -- descriptor ids -------------------------------------------------------------------------------------
def _ids(draw: st.DrawFn, limit: int, most: int) -> list[int]:
    if limit <= 0:
        return []
    n = draw(st.integers(0, min(most, limit)))
    how = draw(st.sampled_from(("run", "sparse", "shuffled")))
    if how == "run":
        start = draw(st.integers(0, limit - n))
        return list(range(start, start + n))
    ids = draw(st.lists(st.integers(0, limit - 1), min_size=n, max_size=n, unique=True))
    return sorted(ids) if how == "sparse" else ids


@st.composite
def desc_inputs(draw: st.DrawFn) -> dict[str, Any]:
    path = draw(st.sampled_from(("attention", "routing", "hybrid")))
    ppl = draw(st.integers(1, 4))
    nb = ppl * draw(st.integers(1, 40))
    bsr = draw(st.sampled_from((None, 2, 4, 3)))
    ratio = bsr or 1
    regions = draw(st.integers(1, 64))
    out: dict[str, Any] = dict(
        dst_num_blocks=nb,
        bsr=bsr,
        ppl=ppl,
        num_regions=regions,
        ssm_regions=[],
        pieces=3,
        routing=(),
        scratch_regions=(),
        ple_group=None,
        region_group_ids=None,
    )
    if path == "hybrid":
        n_attn = draw(st.integers(1, 2))
        n_ssm = draw(st.integers(1, 3))
        ring = draw(st.booleans())
        kinds = (
            ["mla" if draw(st.booleans()) else "fa"] * n_attn + (["ring"] if ring else []) + ["ssm"] * n_ssm
        )
        out["ssm_regions"] = sorted(
            draw(st.sets(st.integers(0, regions - 1), min_size=1, max_size=min(regions, 8)))
        )
        out["pieces"] = draw(st.sampled_from((1, 3)))
        if ring:
            out["scratch_regions"] = sorted(
                draw(st.sets(st.integers(0, regions - 1), min_size=1, max_size=min(regions, 4)))
            )
        if n_ssm > 1 and draw(st.booleans()):
            out["ple_group"] = len(kinds) - 1
        caps = draw(st.sampled_from((None, [nb] * regions)))
        block_ids = [_ids(draw, nb // ppl if k == "ssm" else nb * ratio, 6) for k in kinds]
        own = [0] * regions
    else:
        n_groups = draw(st.integers(1, 4))
        kinds = [draw(st.sampled_from(("fa", "swa", "mla", "ring"))) for _ in range(n_groups)]
        count = draw(st.integers(1, 12)) if path == "routing" else regions
        caps = draw(st.sampled_from((None, "varied")))
        caps = None if caps is None else [draw(st.integers(1, nb)) for _ in range(count)]
        if path == "routing":
            out["routing"] = tuple(
                draw(st.lists(st.integers(0, n_groups - 1), min_size=count, max_size=count))
            )
            own = [0] * regions
            per_group = {
                g: min(
                    [(caps[k] if caps else nb) for k, gg in enumerate(out["routing"]) if gg == g], default=0
                )
                * ratio
                for g in range(n_groups)
            }
        else:
            own = draw(st.sampled_from(("one", "mapped")))
            own = (
                [0] * regions
                if own == "one"
                else [draw(st.integers(-1, n_groups - 1)) for _ in range(regions)]
            )
            out["region_group_ids"] = draw(st.sampled_from((None, own)))
            gids = own
            mapped = len(set(gids)) > 1

            def cap(r: int) -> int:
                return (caps[r] if caps else nb) * ratio

            per_group = {
                g: min([cap(r) for r in range(regions) if not mapped or gids[r] in (g, -1)], default=0)
                for g in range(n_groups)
            }
        block_ids = [_ids(draw, per_group[g], 6) for g in range(len(kinds))]
    out.update(kinds=kinds, block_ids=block_ids, region_num_blocks=caps, own_group_ids=own)
    return out


@settings(max_examples=EXAMPLES["desc_ids"])
@given(desc_inputs())
def test_desc_ids(i: dict[str, Any]) -> None:
    vllm = V.desc_ids(
        i["block_ids"],
        i["dst_num_blocks"],
        i["bsr"],
        i["ppl"],
        kinds=i["kinds"],
        num_regions=i["num_regions"],
        ssm_regions=i["ssm_regions"],
        pieces=i["pieces"],
        region_num_blocks=i["region_num_blocks"],
        region_group_ids=i["region_group_ids"],
        own_group_ids=i["own_group_ids"],
        routing=i["routing"],
        scratch_regions=i["scratch_regions"],
        ple_group=i["ple_group"],
    )
    kinds = i["kinds"]
    gids = i["region_group_ids"] if i["region_group_ids"] is not None else i["own_group_ids"]
    ours = kv(
        lambda: compute_desc_ids(
            i["block_ids"],
            i["dst_num_blocks"],
            i["num_regions"],
            i["bsr"],
            i["ppl"],
            [k == "ssm" for k in kinds],
            i["ssm_regions"] if "ssm" in kinds else None,
            i["pieces"],
            i["region_num_blocks"],
            gids,
            transfer_layer_group_ids=i["routing"],
            scratch_groups=[g for g, k in enumerate(kinds) if k == "ring"],
            scratch_region_indices=i["scratch_regions"],
            ple_group=i["ple_group"],
        )
    )
    same(vllm, ours, arrays)


# -- split handles and strided rows ---------------------------------------------------------------------
@st.composite
def split_inputs(draw: st.DrawFn) -> dict[str, Any]:
    kinds = draw(
        st.sampled_from((("fa", "ssm"), ("mla", "ssm", "ssm"), ("fa",), ("mla", "ssm", "ssm", "ssm")))
    )
    is_mla = kinds[0] == "mla"
    tp = draw(st.sampled_from((1, 2, 4)))
    remote_tp = tp * draw(st.sampled_from((2, 4, 8)))
    heads = 1 if is_mla else draw(st.sampled_from((1, 2, 4, 8, 16, 32)))
    mapping = compute_tp_mapping(
        draw(st.integers(0, tp - 1)), tp, remote_tp, heads, is_mla, [k == "ssm" for k in kinds]
    )
    regions = draw(st.integers(1, 24))
    bsr = draw(st.sampled_from((1, 1, 2, 4)))
    nbl = draw(st.integers(1, 12))
    ppl = draw(st.integers(1, 3))
    unit = remote_tp * bsr * 4
    lens = [unit * draw(st.integers(1, 4)) for _ in range(regions)]
    pad = draw(st.sampled_from((0, 0, unit)))
    strides = [x + pad for x in lens]
    region_is_mla = [is_mla and draw(st.integers(0, 4)) > 0 for _ in range(regions)]
    bases = [(r + 1) << 24 for r in range(regions)]
    caps = [nbl * ppl] * regions
    rows = fa_local_rows(bases, lens, strides, caps, bsr)
    num_fa = int(rows[:, 4].sum())
    ple = len(kinds) == 4
    if "ssm" in kinds:
        ssm_regions = sorted(draw(st.sets(st.integers(0, regions - 1), min_size=1, max_size=regions)))
        piece = remote_tp * 2
        conv = [(0, piece), (piece, piece), (2 * piece, 2 * piece)]
        rows = np.concatenate(
            [
                rows,
                mamba_local_rows(
                    bases,
                    strides,
                    ssm_regions,
                    conv,
                    (4 * piece, 4 * piece),
                    ppl,
                    nbl,
                    ple_region=0 if ple else None,
                    ple_block_len=lens[0],
                ),
            ]
        )
    return dict(
        kinds=kinds,
        mapping=mapping,
        rows=rows,
        num_fa=num_fa,
        bsr=bsr,
        region_is_mla=region_is_mla,
        caps=caps,
        ple=ple,
        nbl=nbl,
    )


@settings(max_examples=EXAMPLES["splits"])
@given(split_inputs())
def test_local_splits(i: dict[str, Any]) -> None:
    vllm = V.local_splits(
        i["mapping"],
        i["rows"],
        i["num_fa"],
        i["bsr"],
        kinds=i["kinds"],
        region_is_mla=i["region_is_mla"],
        region_num_blocks=i["caps"],
        ple=i["ple"],
        logical_num_blocks=i["nbl"],
    )
    ours = kv(
        lambda: build_local_splits(
            i["rows"],
            i["mapping"],
            i["num_fa"],
            i["bsr"],
            [k == "ssm" for k in i["kinds"]],
            i["region_is_mla"],
            i["caps"],
            num_replicated_tail=i["nbl"] if i["ple"] else 0,
        )
    )
    same(vllm, ours, arrays)


@st.composite
def strided_inputs(draw: st.DrawFn) -> dict[str, Any]:
    regions = draw(st.integers(1, 64))
    bsr = draw(st.sampled_from((1, 2, 3, 4)))
    unit = 8 * bsr
    lens = [unit * draw(st.integers(1, 6)) for _ in range(regions)]
    strides = [x + draw(st.sampled_from((0, 0, 8, unit, x))) for x in lens]
    caps = [draw(st.integers(1, 50)) for _ in range(regions)]
    bases = [(r + 1) << 28 for r in range(regions)]
    routing = draw(st.sampled_from(((), "layers")))
    if routing:
        routing = tuple(draw(st.lists(st.integers(0, regions - 1), min_size=1, max_size=12)))
    return dict(regions=regions, bsr=bsr, lens=lens, strides=strides, caps=caps, bases=bases, routing=routing)


@settings(max_examples=EXAMPLES["strided"])
@given(strided_inputs(), st.data())
def test_strided_rows(i: dict[str, Any], data: st.DataObject) -> None:
    same(
        V.fa_local(i["bases"], i["lens"], i["strides"], i["caps"], i["bsr"], i["routing"]),
        kv(
            lambda: fa_local_rows(
                i["bases"],
                i["lens"],
                i["strides"],
                i["caps"],
                i["bsr"],
                device=0,
                region_indices=i["routing"],
            )
        ),
        arrays,
    )
    # remote rows: this rank's share of every (routed) remote region
    draw = data.draw
    tp, remote_tp = draw(st.sampled_from(((1, 2), (2, 1), (4, 2), (1, 4), (2, 2), (8, 1), (16, 2), (1, 64))))
    heads = draw(st.sampled_from((1, 2, 4, 8)))
    is_mla = draw(st.booleans())
    rank = draw(st.integers(0, tp - 1))
    mapping = compute_tp_mapping(rank, tp, remote_tp, 1 if is_mla else heads, is_mla, [False])
    n_remote = len(i["routing"]) or i["regions"]
    local_of = list(i["routing"]) or list(range(i["regions"]))
    remote_bases = [(r + 1) << 32 for r in range(n_remote)]
    remote_strides = [i["strides"][local_of[r]] for r in range(n_remote)]
    caps = draw(st.sampled_from((None, [draw(st.integers(1, 40)) for _ in range(n_remote)])))
    region_is_mla = [is_mla and draw(st.booleans()) for _ in range(i["regions"])]
    draft = (
        [r for r in range(i["regions"]) if draw(st.integers(0, 5)) == 0] if is_mla and tp >= remote_tp else []
    )
    draft_mapping = (
        compute_tp_mapping(rank, tp, remote_tp, 1, True, [False], head_sharded_kv_heads=heads)
        if draft
        else None
    )
    reads = len(mapping.source_ranks_per_group[0])
    vllm = V.fa_remote(
        mapping,
        remote_bases=remote_bases,
        remote_strides=remote_strides,
        remote_caps=caps,
        remote_num_blocks=17,
        local_lens=i["lens"],
        region_is_mla=region_is_mla,
        kinds=["fa"],
        bsr=i["bsr"],
        routing_regions=i["routing"],
        draft_mapping=draft_mapping,
        draft_regions=draft,
    )
    ours = kv(
        lambda: fa_remote_rows(
            remote_bases,
            remote_strides,
            caps if caps is not None else [17] * n_remote,
            i["lens"],
            region_is_mla,
            i["bsr"],
            reads,
            mapping.rank_offset_factor,
            local_region_of=i["routing"] or None,
            draft_regions=draft,
            draft_reads=len(draft_mapping.source_ranks_per_group[0]) if draft_mapping else 1,
            draft_offset_factor=draft_mapping.rank_offset_factor if draft_mapping else 0,
        )
    )
    same(vllm, ours, arrays)


@settings(max_examples=EXAMPLES["strided"])
@given(st.data())
def test_mamba_rows(data: st.DataObject) -> None:
    draw = data.draw
    regions = draw(st.integers(1, 32))
    ppl, rppl = draw(st.integers(1, 4)), draw(st.integers(1, 4))
    nbl = draw(st.integers(1, 30))
    strides = [8 * draw(st.integers(4, 40)) for _ in range(regions)]
    bases = [(r + 1) << 28 for r in range(regions)]
    ssm_regions = sorted(draw(st.sets(st.integers(0, regions - 1), min_size=1, max_size=regions)))
    sizes = [2 * draw(st.integers(1, 8)) for _ in range(draw(st.sampled_from((1, 3))))]
    conv = [(sum(sizes[:k]), s) for k, s in enumerate(sizes)]
    ssm_sizes = (sum(sizes), 4 * draw(st.integers(1, 8)))
    ple = draw(st.sampled_from((None, 0, regions - 1)))
    ple_len = draw(st.integers(1, 64)) if ple is not None else None
    same(
        V.mamba_local(bases, strides, ssm_regions, conv, ssm_sizes, ppl, nbl, ple, ple_len),
        kv(lambda: mamba_local_rows(bases, strides, ssm_regions, conv, ssm_sizes, ppl, nbl, 0, ple, ple_len)),
        arrays,
    )
    ratio = draw(st.sampled_from((1, 2, 4, -2, -4)))
    rank = draw(st.integers(0, max(ratio, 1) * 2 - 1))
    remote_sizes = (ssm_sizes[0] * 2, ssm_sizes[1] * 2)
    reads = [(o // 2, s // 2) for o, s in conv]
    remote_ple = draw(st.sampled_from((ple_len, 2 * (ple_len or 1)))) if ple is not None else None
    rnb = rppl * draw(st.integers(1, 30))
    vllm = V.mamba_remote(
        remote_bases=bases,
        remote_strides=strides,
        remote_num_blocks=rnb,
        remote_ppl=rppl,
        remote_ssm_sizes=remote_sizes,
        ssm_regions=ssm_regions,
        conv_reads=reads,
        local_ssm_sizes=ssm_sizes,
        tp_ratio=ratio,
        rank=rank,
        local_ppl=ppl,
        ple_region=ple,
        local_ple=ple_len,
        remote_ple=remote_ple,
    )
    ours = kv(
        lambda: mamba_remote_rows(
            bases,
            strides,
            rnb,
            rppl,
            remote_sizes,
            ssm_regions,
            reads,
            ssm_sizes[1],
            ratio,
            rank,
            0,
            ple,
            None if ple is None else ple_len * ppl,
            None if ple is None else remote_ple * rppl,
        )
    )
    same(vllm, ours, arrays)


# -- block ids -------------------------------------------------------------------------------------------
@st.composite
def prefix_inputs(draw: st.DrawFn) -> dict[str, Any]:
    kinds = list(draw(st.sampled_from(KINDS)))
    dppl, pppl = draw(st.integers(1, 6)), draw(st.integers(1, 6))
    block_d, block_p = dppl * draw(st.sampled_from((4, 8, 16))), pppl * draw(st.sampled_from((4, 8, 16)))
    n = draw(st.integers(1, 200))
    backoff = draw(st.sampled_from((0, 1, 1, 3)))
    computed = n - backoff if n > backoff else n
    hit = draw(st.integers(0, max(0, math.ceil(n / block_d) - 1))) if draw(st.booleans()) else 0
    pool = iter(draw(st.permutations(range(400))))
    dec, pre = [], []
    for k in kinds:
        if k == "ssm":
            dec.append([next(pool) for _ in range(draw(st.integers(0, 2)))])
            pre.append([next(pool) for _ in range(draw(st.integers(0, 2)))])
            continue
        dk = math.ceil(n / block_d) - hit
        pk = math.ceil(computed / block_p)
        dec.append([next(pool) * dppl + j for _ in range(dk) for j in range(dppl)][: dk * dppl])
        pre.append([next(pool) * pppl + j for _ in range(pk) for j in range(pppl)][: pk * pppl])
    return dict(kinds=kinds, dec=dec, pre=pre, dppl=dppl, pppl=pppl)


@settings(max_examples=EXAMPLES["block_ids"])
@given(prefix_inputs(), st.data())
def test_block_id_algebra(i: dict[str, Any], data: st.DataObject) -> None:
    kinds = i["kinds"]
    ssm = [k == "ssm" for k in kinds]
    same(
        V.prefix_caching(i["dec"], i["pre"], i["dppl"], i["pppl"], kinds),
        kv(
            lambda: tuple(
                arrays(x) for x in apply_prefix_caching(i["dec"], i["pre"], i["dppl"], i["pppl"], ssm)
            )
        ),
    )
    ratio = data.draw(st.integers(1, 6))
    same(
        V.map_ratio(i["dec"], i["pre"], ratio, kinds),
        kv(
            lambda: tuple(
                arrays(x) for x in map_block_ids_for_block_size_ratio(i["dec"], i["pre"], ratio, ssm)
            )
        ),
    )
    same(
        V.logical_to_kernel(i["pre"], ratio, kinds),
        kv(lambda: arrays(logical_to_kernel(i["pre"], ratio, ssm))),
    )


@settings(max_examples=EXAMPLES["dcp"])
@given(st.data())
def test_dcp_page_matching(data: st.DataObject) -> None:
    draw = data.draw
    ld, rd = draw(st.sampled_from((1, 2, 4, 8, 16))), draw(st.sampled_from((1, 2, 4, 8, 16)))
    d = draw(st.integers(0, ld - 1))
    remote_tp = rd
    remote_rank = draw(st.integers(0, remote_tp - 1))
    cached = draw(st.integers(0, 6))
    total = draw(st.integers(0, 80))
    local = list(range(100, 100 + draw(st.integers(0, 24))))
    remote = list(range(500, 500 + draw(st.integers(0, 24))))
    count = draw(st.sampled_from((None, total)))
    same(
        V.dcp_prefix(local, remote, remote_rank, ld, d, rd, cached, count),
        kv(
            lambda: tuple(
                arrays(x)
                for x in apply_dcp_prefix_caching(local, remote, remote_rank, ld, d, rd, cached, count)
            )
        ),
    )


@settings(max_examples=EXAMPLES["regions"])
@given(st.data())
def test_region_mapping_and_clipping(data: st.DataObject) -> None:
    draw = data.draw
    groups = draw(st.integers(1, 4))
    pool = iter(draw(st.permutations(range(300))))
    block_ids = [[next(pool) for _ in range(draw(st.integers(0, 8)))] for _ in range(groups)]
    gids = [draw(st.integers(-1, groups - 1)) for _ in range(draw(st.integers(1, 12)))]
    same(V.by_region(block_ids, gids), kv(lambda: arrays(block_ids_by_region(block_ids, gids))))
    regions = len(gids)
    dec = [[next(pool) for _ in range(draw(st.integers(0, 6)))] for _ in range(regions)]
    pre = [[next(pool) for _ in range(draw(st.integers(0, 8)))] for _ in range(regions)]
    dcp, rdcp = draw(st.sampled_from((1, 2, 4))), draw(st.sampled_from((1, 2, 4, 8)))
    counted = draw(st.booleans())
    computed = [draw(st.integers(0, 3)) for _ in range(regions)] if counted else None
    total = draw(st.integers(0, 40)) if counted else None
    rank, d = draw(st.integers(0, rdcp - 1)), draw(st.integers(0, dcp - 1))
    same(
        V.prefix_by_region(dec, pre, computed, total, rank, dcp, d, rdcp),
        kv(
            lambda: tuple(
                arrays(x)
                for x in apply_prefix_caching_by_region(dec, pre, computed, total, rank, dcp, d, rdcp)
            )
        ),
    )
    blocks = [next(pool) for _ in range(draw(st.integers(0, 6)))]
    spec = draw(st.integers(0, 4))
    same(V.clip_ssm(blocks, spec), kv(lambda: arrays(clip_ssm_state_blocks(blocks, spec))))
    kinds = [draw(st.sampled_from(("fa", "swa", "ssm"))) for _ in range(groups)]
    windows = [draw(st.integers(1, 4)) if k == "swa" else 0 for k in kinds]
    specs = [draw(st.integers(0, 3)) if k == "ssm" else None for k in kinds]
    clip = draw(st.booleans())
    same(
        V.exchange_clipped(block_ids, windows, specs, clip),
        kv(lambda: arrays(exchange_clipped_blocks(block_ids, windows, specs, clip))),
    )


# -- layer routing, packed rows, CSA ----------------------------------------------------------------------
@st.composite
def packed_tables(draw: st.DrawFn) -> tuple[RegionTable, list[str], list[int], list[int]]:
    """A remote (PP 1) with per-layer regions and at most one packed row; a P stage's transfer layers."""
    layers = [f"layers.{k}.attn" for k in range(draw(st.integers(1, 10)))]
    packed_layers = draw(st.sets(st.sampled_from(layers), max_size=len(layers)))
    rest = [n for n in layers if n not in packed_layers]
    members, lens, packed, names, gids = [], [], {}, [], []
    row, offset = [], 0
    for n in sorted(packed_layers):
        page = 16 * draw(st.integers(1, 8))
        packed[n] = (offset, page)
        offset += page
        row.append(n)
    if row:
        members.append(tuple(row))
        lens.append(offset)
        names.append(row[0])
        gids.append(draw(st.integers(0, 2)))
    for n in rest:
        members.append((n,))
        lens.append(16 * draw(st.integers(1, 8)))
        names.append(n)
        gids.append(draw(st.integers(0, 2)))
    table = RegionTable(
        bases=tuple((r + 1) << 20 for r in range(len(members))),
        block_lens=tuple(lens),
        block_strides=tuple(x + draw(st.sampled_from((0, 16))) for x in lens),
        num_blocks=tuple(draw(st.integers(1, 9)) for _ in members),
        group_ids=tuple(gids),
        names=tuple(names),
        members=tuple(members),
        packed=packed,
    )
    stage = draw(st.lists(st.sampled_from(layers + ["layers.99.attn"]), min_size=1, max_size=6, unique=True))
    local_regions = [k for k in range(len(stage))]
    local_lens = [
        packed[n][1] if n in packed and draw(st.integers(0, 9)) else 16 * draw(st.integers(1, 8))
        for n in stage
    ]
    return table, stage, local_regions, local_lens


def _fields(t: RegionTable) -> dict[str, Any]:
    return {
        "bases": list(t.bases),
        "block_lens": list(t.block_lens),
        "block_strides": list(t.block_strides),
        "num_blocks": None if t.num_blocks is None else list(t.num_blocks),
        "group_ids": None if t.group_ids is None else list(t.group_ids),
        "names": None if t.names is None else list(t.names),
        "members": [list(m) for m in t.members],
    }


@settings(max_examples=EXAMPLES["routing"])
@given(packed_tables(), st.data())
def test_layer_routing_and_packed_rows(case: tuple, data: st.DataObject) -> None:
    table, stage, regions, local_lens = case
    same(
        V.align_by_layer(table, stage, regions, local_lens),
        kv(lambda: _fields(align_regions_by_layer(table, stage, regions, local_lens))),
    )
    if table.packed:
        local_names = data.draw(
            st.lists(
                st.sampled_from(sorted(table.packed) + list(table.names)), min_size=1, max_size=5, unique=True
            )
        )
        same(V.split_packed(table, local_names), kv(lambda: _fields(split_packed_rows(table, local_names))))
    heads = data.draw(st.sampled_from((1, 2, 4, 8, 64)))
    local_tp, remote_tp = data.draw(st.sampled_from(TP)), data.draw(st.sampled_from(TP))
    same(
        V.csa_layout(local_tp, remote_tp, heads),
        kv(lambda: check_csa_linear_tp_layout(local_tp, remote_tp, heads)),
    )


def test_the_example_budget_is_at_least_5000() -> None:
    from test_e2e_differential import E2E_EXAMPLES

    assert sum(EXAMPLES.values()) + 4 * E2E_EXAMPLES >= 5000  # four e2e tests: pull and push, two modes


pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
