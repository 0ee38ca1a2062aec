"""CSA-linear models (docs/vllm-behaviour.md B.6.14): the specs, explicit tensor sharing in the geometry, the
tables and descriptor ids of vLLM mode, kvgeom mode's single read of the replicated page, and every refusal.

Expected values are derived by hand from the default ``csa_linear_model()`` at block 16 (8 logical blocks):
MLA page 16 tokens x 8 x 2 B = 256 B; ring 4 rows x 8 x 2 B = 64 B; GDN(2, 4, 2, 4) at TP1: conv pieces of
8 channels x 3 rows x 2 B = 48 B each (144 B), temporal 2 x 16 x 2 B = 64 B; PLE 8 x 3 x 2 B = 48 B."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest

from kvgeom import ConfigError, EngineConfig, IncompatiblePairError, Pairing
from kvgeom.cli import main
from kvgeom.errors import SpecError, UnsupportedError
from kvgeom.layout.allocate import rank_geometry
from kvgeom.layout.view import EngineView
from kvgeom.model.csa import csa_linear_model, ring_capacity
from kvgeom.model.layers import (
    AttentionSpec,
    CircularBufferSpec,
    Layer,
    LayerKind,
    MambaSpec,
    MLASpec,
    ReplicatedStateSpec,
)
from kvgeom.model.spec import ModelSpec
from kvgeom.pair.handshake import check_pair
from kvgeom.plan.dlist import local_dlist, remote_dlist
from kvgeom.plan.request import plan_request
from kvgeom.testing import CoordSpace, Request, run
from kvgeom.testing._layout import LayoutError, rank_image

MODEL = csa_linear_model()
MLA, RING = MLASpec(8), CircularBufferSpec(4, 8)
GDN = MambaSpec.gdn(2, 4, 2, 4)


def eng(tp: int = 1, block: int = 16, **kw: int) -> EngineConfig:
    return EngineConfig(tp_size=tp, block_size=block, num_blocks=8, **kw)


def geoms(tp: int, **kw: int) -> list:
    return [rank_geometry(MODEL, eng(tp, **kw).with_rank(r)) for r in range(tp)]


def test_specs_and_ring_capacity() -> None:
    assert ring_capacity(4) == 4 and ring_capacity(4, 1) == 8 and ring_capacity(4, 5) == 12
    assert RING.page_bytes(1) == RING.page_bytes(8) == 64 and RING.kind is LayerKind.CIRCULAR_BUFFER
    ple = ReplicatedStateSpec(8)
    assert ple.state_bytes(1) == ple.state_bytes(4) == 48 and ple.conv_rows == 3
    assert LayerKind.REPLICATED_STATE.is_ssm and LayerKind.REPLICATED_STATE.one_block
    assert LayerKind.CIRCULAR_BUFFER.one_block and not LayerKind.CIRCULAR_BUFFER.is_ssm
    assert not LayerKind.MLA.one_block and LayerKind.GDN.one_block
    assert MODEL.is_csa_linear and MODEL.overlays and not MODEL.layers[0].shares
    assert ModelSpec.from_json(MODEL.to_json()) == MODEL
    assert (
        MODEL.to_json()["layers"][1]["shares"] == "layers.0.attn"
        and "shares" not in MODEL.to_json()["layers"][0]
    )
    with pytest.raises(SpecError) as e:
        ring_capacity(0)
    assert e.value.field == "compress_ratio" and e.value.values["value"] == 0


@pytest.mark.parametrize(
    ("spec", "field", "value"),
    [
        (lambda: CircularBufferSpec(0, 8), "capacity", 0),
        (lambda: CircularBufferSpec(4, 0), "entry_size", 0),
        (lambda: ReplicatedStateSpec(0), "channels", 0),
        (lambda: ReplicatedStateSpec(8, 1), "conv_kernel", 1),
    ],
)
def test_new_specs_refuse_bad_sizes(spec, field: str, value: int) -> None:
    with pytest.raises(SpecError) as e:
        spec()
    assert e.value.field == field and e.value.values["value"] == value


def _model(*layers: Layer) -> ModelSpec:
    return ModelSpec("m", tuple(layers))


@pytest.mark.parametrize(
    ("layers", "field", "value"),
    [
        # a share names a layer that does not exist, or one that shares itself
        ((Layer("a", 0, MLA), Layer("r", 0, RING, shares="nope")), "r.shares", "nope"),
        (
            (Layer("a", 0, MLA), Layer("r", 0, RING, shares="a"), Layer("g", 1, GDN, shares="r")),
            "g.shares",
            "r",
        ),
        # a ring with no tensor to overlay, or on a head-sharded attention layer
        ((Layer("a", 0, MLA), Layer("r", 0, RING)), "r.shares", None),
        ((Layer("a", 0, AttentionSpec(2, 8)), Layer("r", 0, RING, shares="a")), "r.shares", "a"),
        # a state of a CSA-linear model with a tensor of its own
        ((Layer("a", 0, MLA), Layer("r", 0, RING, shares="a"), Layer("g", 1, GDN)), "g.shares", None),
        # a CSA-linear model's own tensors are MLA pages or full attention, not a sliding window
        (
            (
                Layer("a", 0, MLA),
                Layer("r", 0, RING, shares="a"),
                Layer("b", 1, AttentionSpec(2, 8, sliding_window=4)),
            ),
            "b.kind",
            "sliding_window",
        ),
        # a replicated page without a ring, or two of them
        ((Layer("a", 0, MLA), Layer("p", 0, ReplicatedStateSpec(8), shares="a")), "layers", 1),
        (
            (
                Layer("a", 0, MLA),
                Layer("r", 0, RING, shares="a"),
                Layer("g", 1, GDN, shares="a"),
                Layer("p", 0, ReplicatedStateSpec(8), shares="a"),
                Layer("q", 0, ReplicatedStateSpec(4), shares="a"),
            ),
            "layers",
            2,
        ),
        # a replicated page next to a ring but without a sharded SSM state
        (
            (
                Layer("a", 0, MLA),
                Layer("r", 0, RING, shares="a"),
                Layer("p", 0, ReplicatedStateSpec(8), shares="a"),
            ),
            "layers",
            1,
        ),
    ],
)
def test_sharing_rules_name_the_layer(layers: tuple[Layer, ...], field: str, value: object) -> None:
    with pytest.raises(SpecError) as e:
        _model(*layers)
    assert e.value.field == field and e.value.values["value"] == value


def test_geometry_overlays_every_cache_on_the_owners_tensor() -> None:
    g = rank_geometry(MODEL, eng())
    assert [(x.kind.value, x.layers) for x in g.groups] == [
        ("mla", ("layers.0.attn", "layers.2.attn")),
        ("circular_buffer", ("layers.0.ring", "layers.2.ring")),
        ("gdn", ("layers.1.gdn", "layers.3.gdn")),
        ("replicated_state", ("ple",)),
    ]
    assert [(r.name, r.block_len, r.block_stride, r.num_blocks, r.is_mla) for r in g.regions] == [
        ("layers.0.attn", 256, 256, 8, True),
        ("layers.2.attn", 256, 256, 8, True),
    ]
    assert g.regions[0].members == (
        (0, "layers.0.attn"),
        (1, "layers.0.ring"),
        (2, "layers.1.gdn"),
        (3, "ple"),
    )
    assert g.scratch_region_indices == (0, 1) and g.scratch_groups == (1,)
    assert g.ssm is not None and g.ssm.region_indices == (0, 1) and g.ssm.sizes == (144, 64)
    assert g.ple is not None and (g.ple.group, g.ple.region, g.ple.length) == (3, 0, 48)
    assert g.group_is_ssm == (False, False, True, True) and g.group_one_block == (False, True, True, True)
    assert g.page_bytes == 256
    text = g.describe()
    assert "ring (scratch) regions: [0, 1]" in text and "replicated state page: 48 B" in text
    # TP2: the sharded state halves, the ring and the replicated page do not
    g2 = rank_geometry(MODEL, eng(2))
    assert g2.ssm is not None and g2.ssm.sizes == (72, 32) and g2.ple is not None and g2.ple.length == 48
    view = EngineView.of(g)
    assert (view.scratch_region_indices, view.ple_region, view.ple_len) == ((0, 1), 0, 48)


def test_geometry_refusals() -> None:
    with pytest.raises(ConfigError) as e:  # the 208-byte GDN state does not fit a 64-byte page (block 4)
        rank_geometry(MODEL, eng(block=4))
    assert e.value.field == "block_size" and e.value.values == {"value": 4, "expected": 208}
    two = _model(
        Layer("a", 0, MLA),
        Layer("r", 0, RING, shares="a"),
        Layer("g", 1, GDN, shares="a"),
        Layer("h", 2, GDN, shares="a"),
    )
    with pytest.raises(ConfigError) as e:
        rank_geometry(two, eng())
    assert e.value.field == "layers" and e.value.values["value"] == ["a", "r", "g", "h"]
    for kw in ({"pp_size": 2}, {"kv_split": True}):
        with pytest.raises(ConfigError) as e:
            rank_geometry(MODEL, eng(**kw))
        assert e.value.field == "engine" and e.value.values == {"value": eng(**kw).to_json()}
    odd = csa_linear_model(ple_channels=7)  # 42 B cannot be cut into 4 kernel blocks
    with pytest.raises(ConfigError) as e:
        rank_geometry(odd, eng(kernel_block_size=4))
    assert e.value.field == "kernel_block_size" and e.value.values == {"value": 4, "expected": 16}


def test_vllm_mode_pull_ids_and_moves() -> None:
    d, (p,) = rank_geometry(MODEL, eng()), geoms(1)
    pairing = Pairing.create(d, [p], "pull", "vllm")
    ids = [[1, 2, 3], [4], [5], [6]]
    plan = plan_request(pairing, ids, ids, num_tokens=40)
    (t,) = plan.transfers
    # MLA r*8 + b over both regions; the ring over its scratch regions; GDN 16 + s*8 + 5 over 8 streams;
    # the replicated page is stream 8: 16 + 64 + 6
    want = [1, 2, 3, 9, 10, 11, 4, 12, *(16 + s * 8 + 5 for s in range(8)), 86]
    assert t.local_ids.tolist() == want and t.remote_ids.tolist() == want
    m = plan.moves(pairing)
    ring = m[6:8]
    assert ring[:, [1, 2, 4, 5, 6]].tolist() == [[0, 1024, 0, 1024, 256], [1, 1024, 1, 1024, 256]]
    assert m[-1].tolist() == [0, 0, 6 * 256, 0, 0, 6 * 256, 48]
    assert plan.zero.shape == (0, 3)


def test_vllm_mode_split_tables_keep_the_replicated_page_whole() -> None:
    d = rank_geometry(MODEL, eng(1))
    pairing = Pairing.create(d, geoms(2), "pull", "vllm")
    assert pairing.needs_split
    ple_row = [0, 48, 256, 8]  # (offset in region 0, length, stride, count) per source rank
    for src in (0, 1):
        rows = pairing.local_table((1, src)).runs
        assert [int(rows[-1, 0]) & ((1 << 44) - 1), *rows[-1, [1, 3, 4]].tolist()] == ple_row
        # the temporal state before it is halved per source: 64 B -> 32 B at 144 + src * 32
        assert rows[-2, 1] == 32 and int(rows[-2, 0]) & ((1 << 44) - 1) == 144 + src * 32
    plan = plan_request(pairing, [[1, 2, 3], [4], [5], [6]], [[1, 2, 3], [4], [5], [6]], num_tokens=40)
    ple = [t.local_ids[-1] for t in plan.transfers]
    assert ple == [86, 86]  # vLLM reads the page from both sources, into the same bytes


def test_kvgeom_mode_reads_the_replicated_page_once() -> None:
    d = rank_geometry(MODEL, eng(1))
    pairing = Pairing.create(d, geoms(2), "pull", "kvgeom")
    assert [pairing.group_mask(r)[3] for r in (0, 1)] == [True, False]
    plan = plan_request(pairing, [[1, 2, 3], [4], [5], [6]], [[1, 2, 3], [4], [5], [6]], num_tokens=40)
    m = plan.moves(pairing)
    ple = m[(m[:, 1] == 0) & (m[:, 2] == 6 * 256) & (m[:, 6] == 48)]
    assert ple[:, 0].tolist() == [0]


@pytest.mark.parametrize("compat", ["vllm", "kvgeom"])
def test_pair_refusals(compat: str) -> None:
    (p,) = geoms(1)
    for kw, field, local, remote in (
        ({"block": 32}, "block_size", (32, 32), (16, 16)),
        ({"kernel_block_size": 8}, "block_size", (16, 8), (16, 16)),
    ):
        d = rank_geometry(MODEL, eng(**kw))
        with pytest.raises(UnsupportedError) as e:
            check_pair(d, p, "pull", compat)
        assert e.value.field == field and e.value.values == {"local": local, "remote": remote}
    d2 = rank_geometry(MODEL, eng(2, dcp_size=2))
    with pytest.raises(UnsupportedError) as e:
        check_pair(d2, p, "pull", compat)
    assert e.value.field == "dcp_size" and e.value.values == {"local": 2, "remote": 1}


def test_replicated_pages_of_different_lengths_are_refused() -> None:
    view = EngineView.of(rank_geometry(MODEL, eng()))
    with pytest.raises(IncompatiblePairError) as e:
        remote_dlist(view, replace(view, ple_len=24), 1, 1, 0, [(0, 48), (48, 48), (96, 48), (144, 64)])
    assert e.value.field == "ple_block_len" and e.value.values == {"local": 48, "remote": 24}
    with pytest.raises(IncompatiblePairError) as e:
        remote_dlist(view, replace(view, ple_region=None), 1, 1, 0, [(0, 48), (48, 48), (96, 48), (144, 64)])
    assert e.value.values == {"local": 48, "remote": None}
    rows = local_dlist(view).runs
    assert rows[-1, 1:].tolist() == [48, 0, 256, 8] and len(local_dlist(view)) == 16 + 8 * 8 + 8
    assert np.array_equal(
        remote_dlist(view, view, 1, 1, 0, [(0, 48), (48, 48), (96, 48), (144, 64)]).runs[-1], rows[-1]
    )


def test_explicit_sharing_without_a_ring() -> None:
    """``Layer.shares`` is general: an MLA + GDN hybrid with each state on an MLA layer's tensor plans in both
    modes; 3 MLA blocks x 2 regions x 256 B + 2 GDN states of 208 B = 1952 B."""
    model = _model(
        Layer("a", 0, MLA), Layer("g", 1, GDN, shares="a"), Layer("b", 2, MLA), Layer("h", 3, GDN, shares="b")
    )
    g = rank_geometry(model, eng())
    assert [r.members for r in g.regions] == [((0, "a"), (1, "g")), ((0, "b"), (1, "h"))]
    assert g.scratch_region_indices == () and g.ple is None and not model.is_csa_linear
    for compat in ("vllm", "kvgeom"):
        for p, d in ((eng(1), eng(1)), (eng(2), eng(1))):
            report = run(model, p, d, Request.simple(model, p, d, 40), compat=compat)
            assert report.ok and report.bytes_moved == 1952, report


def test_a_tensor_is_owned_by_a_token_cache() -> None:
    with pytest.raises(SpecError) as e:
        csa_linear_model(num_csa_layers=0)
    assert e.value.field == "num_csa_layers" and e.value.values["value"] == 0
    model = _model(Layer("g", 0, GDN), Layer("a", 1, MLA, shares="g"))
    with pytest.raises(ConfigError) as c:
        rank_geometry(model, eng())
    assert c.value.field == "g.shares" and c.value.values["value"] == "gdn"


def test_the_oracle_refuses_a_ring_past_its_page() -> None:
    """The oracle's layout model checks a ring against its page itself (here a geometry lying about it)."""
    g = rank_geometry(MODEL, eng())
    small = replace(g, regions=tuple(replace(r, block_stride=32) for r in g.regions))
    with pytest.raises(LayoutError, match="64-byte page does not fit its 32-byte slot"):
        rank_image(small, CoordSpace(MODEL, 16), [[], [4], [], []], 0, 16)  # the ring block only


def test_vllm_push_writes_every_group_to_every_written_rank() -> None:
    """vLLM push, D TP2 > P TP1: every group goes to both D ranks (the replicated page included, whole: 48 B
    at slot 6 of region 0 on each)."""
    (p,) = geoms(1)
    pairing = Pairing.create(p, geoms(2), "push", "vllm")
    assert pairing.tp_ratio < 0 and pairing.transfer_ranks == (0, 1)
    assert [pairing.group_mask(r) for r in (0, 1)] == [(True, True, True, True)] * 2
    plan = plan_request(pairing, [[1, 2, 3], [4], [5], [6]], [[1, 2, 3], [4], [5], [6]], num_tokens=40)
    m = plan.moves(pairing)
    ple = m[(m[:, 4] == 0) & (m[:, 5] == 6 * 256)]
    assert ple[:, [3, 6]].tolist() == [[0, 48], [1, 48]]


def test_cli_plans_a_csa_linear_scenario(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    """``kvgeom plan`` on a scenario of the default model (P TP2 -> D TP1, 40 tokens): the ring and the
    replicated slot are one block each, so the request moves 2512 B (see the module docstring)."""
    scenario = {
        "model": MODEL.to_json(),
        "prefill": {"tp_size": 2, "block_size": 16, "num_blocks": 16},
        "decode": {"tp_size": 1, "block_size": 16, "num_blocks": 16},
    }
    path = tmp_path / "csa.json"
    path.write_text(json.dumps(scenario))
    assert main(["plan", str(path), "--tokens", "40"]) == 0
    out = capsys.readouterr().out
    assert "25 byte moves (2512 B)" in out and "rank 1: 8 descs" in out


def test_a_ring_without_ssm_state_uses_the_shared_region() -> None:
    """No Mamba state: vLLM's path 3. Region 0 (MLA ``a`` with the ring overlaid) is shared (group -1), region 1
    (``b``) is group 0's: MLA ids ``r*8 + b`` over both, the ring's only over region 0; 7 x 256 B move."""
    model = _model(Layer("a", 0, MLA), Layer("r", 0, RING, shares="a"), Layer("b", 1, MLA))
    g = rank_geometry(model, eng())
    assert g.scratch_region_indices == (0,) and g.ssm is None and g.group_one_block == (False, True)
    pairing = Pairing.create(g, [g], "pull", "vllm")
    assert pairing.local_view.group_ids == (-1, 0)
    plan = plan_request(pairing, [[1, 2, 3], [4]], [[1, 2, 3], [4]], num_tokens=40)
    assert plan.transfers[0].local_ids.tolist() == [1, 2, 3, 9, 10, 11, 4]
    report = run(model, eng(), eng(), Request.simple(model, eng(), eng(), 40), compat="vllm")
    assert report.ok and report.bytes_moved == 7 * 256, report


def test_csa_linear_model_names_its_replicated_page_ple() -> None:
    from kvgeom.model.csa import csa_linear_model

    ple = [la for la in csa_linear_model().layers if la.spec.kind.value == "replicated_state"]
    assert [(la.name, la.index, la.shares) for la in ple] == [("ple", 0, "layers.0.attn")]
