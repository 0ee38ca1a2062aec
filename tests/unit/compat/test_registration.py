"""kvgeom.compat.vllm.registration: the regions a rank registers, from its cache tensors' facts."""

from __future__ import annotations

import pytest

from kvgeom.compat.vllm.registration import CacheTensor, RegistrationLayout, discover_regions
from kvgeom.errors import SpecError, UnsupportedError
from kvgeom.layout.view import SHARED_GROUP

PAGE = 4096


def layer(
    name: str, address: int, kind: str = "attention", group: int = 0, blocks: int = 8, **kw: object
) -> CacheTensor:
    """A layer owning its own storage of ``blocks`` pages (the common case)."""
    values: dict[str, object] = dict(
        group=group,
        address=address,
        nbytes=blocks * PAGE,
        storage_address=address,
        storage_bytes=blocks * PAGE,
        block_stride=PAGE,
        first_block_bytes=PAGE,
        rows=blocks,
        page_bytes=PAGE,
        pool_blocks=blocks,
    )
    values.update(kw)
    return CacheTensor(name, kind, **values)  # type: ignore[arg-type]


def test_one_region_per_layer_with_its_page_stride_and_pool() -> None:
    reg = discover_regions([layer("l0", 1 << 20), layer("l1", 2 << 20)], RegistrationLayout())
    assert reg.bases == (1 << 20, 2 << 20) and reg.block_lens == (PAGE, PAGE) and reg.num_blocks == (8, 8)
    assert (
        reg.group_ids == (0, 0)
        and reg.names == ("l0", "l1")
        and reg.ranges[0] == (1 << 20, 8 * PAGE, 0, "VRAM")
    )


def test_kernel_blocks_cut_the_page() -> None:
    # the cache holds 4 x 8 kernel blocks of a quarter page each
    reg = discover_regions(
        [layer("l0", 1 << 20, block_stride=PAGE // 4, first_block_bytes=PAGE // 4, rows=32)],
        RegistrationLayout(ppl=4),
    )
    assert reg.block_lens == (PAGE // 4,) and reg.num_blocks == (32,)


def test_a_tensor_two_groups_view_is_one_shared_region_and_mla_sets_its_geometry() -> None:
    a = layer("attn", 1 << 20, group=0)
    m = layer(
        "mla",
        1 << 20,
        kind="mla",
        group=1,
        page_bytes=PAGE // 2,
        block_stride=PAGE // 2,
        nbytes=8 * PAGE,
        first_block_bytes=PAGE // 2,
        blocks=16,
    )
    reg = discover_regions([a, m], RegistrationLayout(mla=True))
    assert reg.num_regions == 1 and reg.group_ids == (SHARED_GROUP,) and reg.is_mla == (True,)
    assert reg.block_lens == (PAGE // 2,) and reg.num_blocks == (16,)


def test_packed_mla_rows_register_once_with_each_layers_offset() -> None:
    row, base = 3 * 512, 1 << 24
    tensors = [
        CacheTensor(
            f"l{i}",
            "mla",
            address=base + i * 512,
            nbytes=8 * row - i * 512,
            storage_address=base,
            storage_bytes=8 * row,
            block_stride=row,
            first_block_bytes=None,
            rows=8,
            page_bytes=512,
            pool_blocks=8,
        )
        for i in range(3)
    ]
    reg = discover_regions(tensors, RegistrationLayout(mla=True, block_outermost=True))
    assert reg.bases == (base,) and reg.block_lens == (row,) and reg.block_strides == (row,)
    assert reg.packed_layouts == {"l0": (0, 512), "l1": (512, 512), "l2": (1024, 512)}
    routed = discover_regions(
        tensors, RegistrationLayout(mla=True, block_outermost=True, route_by_layer=True, pp_size=2)
    )
    assert routed.bases == (base, base + 512, base + 1024) and routed.block_lens == (512,) * 3


def test_a_view_of_a_larger_storage_is_cut_into_segments() -> None:
    t = layer("l0", 1 << 20, nbytes=16 * PAGE, storage_bytes=16 * PAGE)  # K and V halves, 8 blocks each
    reg = discover_regions([t], RegistrationLayout())
    assert reg.bases == (1 << 20, (1 << 20) + 8 * PAGE) and reg.block_lens == (PAGE, PAGE)


def test_states_register_their_view_and_every_region_counts_kernel_blocks() -> None:
    attn = layer("attn", 1 << 20, group=0, block_stride=PAGE // 2, first_block_bytes=PAGE // 2, rows=16)
    state = layer("ssm", 1 << 20, kind="state", group=1, blocks=8)
    reg = discover_regions([attn, state], RegistrationLayout(ppl=2, has_ssm=True, kernel_blocks=16))
    assert reg.num_regions == 1 and reg.ssm_region_indices == (0,) and reg.num_blocks == (16,)
    assert reg.group_ids == (SHARED_GROUP,)


def test_the_replicated_state_page_of_csa_linear_models() -> None:
    ple = layer("ple", 3 << 20, kind="replicated_state")
    reg = discover_regions([layer("attn", 1 << 20), ple], RegistrationLayout(csa_linear=True))
    assert reg.ple_region_index == 1 and reg.ple_block_len == PAGE
    with pytest.raises(SpecError) as exc:
        discover_regions([ple], RegistrationLayout())
    assert exc.value.field == "kind" and exc.value.values == {"value": 0, "expected": None}


def test_refusals_name_the_layer() -> None:
    with pytest.raises(SpecError) as exc:
        discover_regions(
            [layer("odd", 1 << 20, nbytes=12 * PAGE + 1, storage_bytes=20 * PAGE)], RegistrationLayout()
        )
    assert exc.value.field == "nbytes" and exc.value.values == {"value": 49153, "expected": 32768}
    with pytest.raises(SpecError) as exc:
        discover_regions([layer("short", 1 << 20, rows=3)], RegistrationLayout())
    assert exc.value.field == "rows" and exc.value.values == {"value": 3, "expected": 8}
    with pytest.raises(UnsupportedError) as exc:
        discover_regions([layer("a", 1 << 20)], RegistrationLayout(block_outermost=True, route_by_layer=True))
    assert exc.value.field == "kind" and exc.value.values == {"value": ["attention"]}
    with pytest.raises(SpecError) as exc:
        layer("x", 0, kind="lightning")
    assert exc.value.field == "kind" and exc.value.values == {"value": "lightning"}


# Exact regions and refusals of kvgeom.compat.vllm.registration on small hand-derived tensors: each rule
# of discover_regions at both sides of its boundary.


S = 0x10000  # a storage address


def _raises(cls, fn, *args, **kwargs):
    with pytest.raises(cls) as info:
        fn(*args, **kwargs)
    assert type(info.value) is cls
    return info.value


def attn(name="a", address=S, storage_bytes=1024, page=256, stride=256, first=256, **kw):
    """An attention tensor of 4 blocks viewing storage S."""
    base = dict(
        name=name,
        kind="attention",
        address=address,
        nbytes=storage_bytes,
        storage_address=S,
        storage_bytes=storage_bytes,
        block_stride=stride,
        first_block_bytes=first,
        rows=4,
        page_bytes=page,
        pool_blocks=4,
    )
    base.update(kw)
    return CacheTensor(**base)


def regions(reg):
    return list(zip(reg.bases, reg.block_lens, reg.block_strides, reg.num_blocks))


def test_cache_tensor_kind():
    err = _raises(SpecError, CacheTensor, "x", "kv")
    assert err.field == "kind" and err.values == {"value": "kv"}
    assert CacheTensor("x", "none").kind == "none"


def test_block_major_contiguous_page():
    reg = discover_regions([attn()], RegistrationLayout())
    assert regions(reg) == [(S, 256, 256, 4)]
    assert reg.group_ids == (0,) and reg.names == ("a",) and reg.is_mla == (False,)
    assert reg.mem_types == ("VRAM",) and reg.ranges == ((S, 1024, 0, "VRAM"),) and reg.device is None
    assert reg.ssm_region_indices == () and reg.scratch_region_indices == () and reg.members == ()
    assert reg.ple_region_index is None and reg.ple_block_len is None and reg.packed_layouts == {}
    assert reg.num_regions == 1


def test_block_major_boundary_non_contiguous():
    # page 128 in a 256-byte block, block 0 not one run: block-major storage registers whole rows
    for pad in (0, 255):
        t = attn(storage_bytes=1024 + pad, nbytes=1024, page=128, first=None)
        assert regions(discover_regions([t], RegistrationLayout())) == [(S, 256, 256, 4)]
    # 256 bytes of padding (a whole block) or fewer than 4 blocks: a view, cut into one segment: its page
    for size in (1024 + 256, 1023):
        t = attn(storage_bytes=size, nbytes=1024, page=128, first=None)
        assert regions(discover_regions([t], RegistrationLayout())) == [(S, 128, 256, 4)]
    # a CSA-linear model registers the page of a non-contiguous block-major row
    t = attn(page=128, first=None)
    assert regions(discover_regions([t], RegistrationLayout(csa_linear=True))) == [(S, 128, 256, 4)]
    # block 0 of another size than the page is not contiguous either
    t = attn(page=128, first=256)
    assert regions(discover_regions([t], RegistrationLayout())) == [(S, 256, 256, 4)]


def test_segments_of_a_larger_view():
    # storage 4x the view's 4 blocks x 256: not block-major; a 2-segment view registers 2 whole-row regions
    t = attn(storage_bytes=4096, nbytes=2048, page=128, first=None)
    assert regions(discover_regions([t], RegistrationLayout())) == [(S, 256, 256, 4), (S + 1024, 256, 256, 4)]
    t = attn(storage_bytes=4096, nbytes=3072, page=128, first=None)
    assert [r[0] for r in regions(discover_regions([t], RegistrationLayout()))] == [S, S + 1024, S + 2048]
    err = _raises(SpecError, discover_regions, [attn(storage_bytes=4096, nbytes=1500)], RegistrationLayout())
    assert err.field == "nbytes" and err.values == {"value": 1500, "expected": 1024}
    err = _raises(
        SpecError, discover_regions, [attn(storage_bytes=4096, pool_blocks=0)], RegistrationLayout()
    )
    assert err.field == "nbytes" and err.values == {"value": 4096, "expected": 0}


def test_flat_view_blocks_abut():
    # a flat byte view: stride := page (128), never contiguous: 4 x 128 = 512 bytes, block-major
    t = attn(storage_bytes=512, nbytes=512, page=128, stride=999, flat=True, first=128)
    assert regions(discover_regions([t], RegistrationLayout())) == [(S, 128, 128, 4)]


def test_rows_check():
    err = _raises(SpecError, discover_regions, [attn(rows=3)], RegistrationLayout())
    assert err.field == "rows" and err.values == {"value": 3, "expected": 4}
    # ppl 2: 4 logical blocks are 8 kernel blocks of 128; the row count is not checked
    reg = discover_regions(
        [attn(rows=3, page=256, stride=128, first=128, storage_bytes=1024)], RegistrationLayout(ppl=2)
    )
    assert regions(reg) == [(S, 128, 128, 8)]


def test_ppl_attention_pages():
    # ppl 2: page 256 -> kernel page 128, 8 kernel blocks
    reg = discover_regions([attn(stride=128, first=128)], RegistrationLayout(ppl=2))
    assert regions(reg) == [(S, 128, 128, 8)]


def test_shared_regions_and_groups():
    a = attn("a", group=0)
    b = attn("b", group=1)
    c = attn("c", group=0)
    reg = discover_regions([a, b], RegistrationLayout())
    assert regions(reg) == [(S, 256, 256, 4)] and reg.group_ids == (SHARED_GROUP,) and reg.names == ("a",)
    reg = discover_regions([a, c], RegistrationLayout(track_members=True))
    assert reg.group_ids == (0,) and reg.members == (("a", "c"),)
    other = attn("d", address=S + 4096, storage_address=S + 4096)
    reg = discover_regions([a, other, c], RegistrationLayout(track_members=True))
    assert reg.members == (("a", "c"), ("d",)) and reg.names == ("a", "d")
    err = _raises(SpecError, discover_regions, [a, attn("e", mem_type="DRAM")], RegistrationLayout())
    assert err.field == "mem_type" and err.values == {"local": "VRAM", "remote": "DRAM"}


def test_mla_joins_a_region():
    # an MLA view of the same base sets the region's length, stride and count
    a = attn("a")
    m = attn("m", kind="mla", page=512, stride=512, first=512, storage_bytes=2048, nbytes=2048)
    reg = discover_regions([a, m], RegistrationLayout())
    assert regions(reg) == [(S, 512, 512, 4)] and reg.is_mla == (True,)
    # a non-MLA view joining keeps the MLA numbers
    reg = discover_regions([m, a], RegistrationLayout())
    assert regions(reg) == [(S, 512, 512, 4)] and reg.is_mla == (True,)


def test_host_resident_ranges_and_devices():
    h = attn("h", address=S + 64, nbytes=1024, storage_bytes=8192, host_resident=True, mem_type="DRAM")
    reg = discover_regions([h], RegistrationLayout())
    assert reg.ranges == ((S + 64, 1024, 0, "DRAM"),)
    assert regions(reg) == [(S + 64, 256, 256, 4)]
    a = attn("a", device=3)
    b = attn("b", address=S + 4096, storage_address=S + 4096, device=5)
    reg = discover_regions([a, b, attn("c")], RegistrationLayout())
    assert reg.device == 5
    assert reg.ranges == ((S, 1024, 3, "VRAM"), (S + 4096, 1024, 5, "VRAM"))
    assert discover_regions([attn("a", device=0)], RegistrationLayout()).device == 0


def test_none_kind_is_skipped():
    reg = discover_regions(
        [CacheTensor("n", "none", address=5, storage_address=5, nbytes=9), attn()], RegistrationLayout()
    )
    assert reg.names == ("a",) and reg.ranges == ((S, 1024, 0, "VRAM"),)


def state(name="s", kind="state", page=400, stride=1000, **kw):
    base = dict(
        name=name,
        kind=kind,
        address=S + 8192,
        storage_address=S + 8192,
        nbytes=4000,
        storage_bytes=4000,
        block_stride=stride,
        page_bytes=page,
        pool_blocks=4,
        rows=4,
    )
    base.update(kw)
    return CacheTensor(**base)


def test_state_pages():
    # ppl 2: page 400 -> (address, 200, 200), logical pool blocks
    reg = discover_regions([state()], RegistrationLayout(ppl=2))
    assert regions(reg) == [(S + 8192, 200, 200, 4)] and reg.ssm_region_indices == (0,)
    # CSA-linear: the tensor's block stride (unless flat)
    reg = discover_regions([state()], RegistrationLayout(ppl=2, csa_linear=True))
    assert regions(reg) == [(S + 8192, 200, 500, 4)]
    reg = discover_regions([state(flat=True)], RegistrationLayout(ppl=2, csa_linear=True))
    assert regions(reg) == [(S + 8192, 200, 200, 4)]
    err = _raises(SpecError, discover_regions, [state(page=401)], RegistrationLayout(ppl=2))
    assert err.field == "block_stride" and err.values == {"value": 401, "expected": 2}
    err = _raises(
        SpecError, discover_regions, [state(stride=1001)], RegistrationLayout(ppl=2, csa_linear=True)
    )
    assert err.field == "block_stride" and err.values == {"value": 1001, "expected": 2}
    # with SSM every region counts the engine's kernel blocks
    reg = discover_regions(
        [attn(stride=128, first=128), state()], RegistrationLayout(ppl=2, has_ssm=True, kernel_blocks=9)
    )
    assert reg.num_blocks == (9, 9) and reg.ssm_region_indices == (1,)
    # a state and its attention view of one page: one region, listed once
    reg = discover_regions([state("s1"), state("s2")], RegistrationLayout(ppl=2))
    assert reg.ssm_region_indices == (0,)


def test_scratch_and_replicated_state():
    s1 = attn("x1", kind="scratch", address=S + 4096, storage_address=S + 4096)
    s0 = attn("x0", kind="scratch")
    reg = discover_regions([s1, s0, attn("x2", kind="scratch")], RegistrationLayout())
    assert reg.scratch_region_indices == (0, 1)
    ple = state("p", kind="replicated_state")
    reg = discover_regions([attn(stride=128, first=128), ple], RegistrationLayout(ppl=2, csa_linear=True))
    assert reg.ple_region_index == 1 and reg.ple_block_len == 200 and reg.ssm_region_indices == ()
    # the same page listed twice is one region
    reg = discover_regions(
        [ple, state("p2", kind="replicated_state")], RegistrationLayout(ppl=2, csa_linear=True)
    )
    assert reg.ple_region_index == 0
    err = _raises(SpecError, discover_regions, [ple], RegistrationLayout(ppl=2))
    assert err.field == "kind" and err.values == {"value": 0, "expected": None}
    other = state("q", kind="replicated_state", address=S + 99999)
    err = _raises(SpecError, discover_regions, [ple, other], RegistrationLayout(ppl=2, csa_linear=True))
    assert err.field == "kind" and err.values == {"value": 1, "expected": 0}


def mla(name, offset, page=256, first=256, **kw):
    base = dict(
        name=name,
        kind="mla",
        address=S + offset,
        nbytes=4096,
        storage_address=S,
        storage_bytes=4096,
        block_stride=1024,
        first_block_bytes=first,
        rows=4,
        page_bytes=page,
        pool_blocks=4,
    )
    base.update(kw)
    return CacheTensor(**base)


PACKED = RegistrationLayout(mla=True, block_outermost=True)


def test_packed_rows():
    reg = discover_regions([mla("a", 0), mla("b", 256)], PACKED)
    assert regions(reg) == [(S, 1024, 1024, 4)] and reg.is_mla == (True,)
    assert reg.packed_layouts == {"a": (0, 256), "b": (256, 256)}
    # the last page of the row fits exactly; one byte further escapes it
    assert discover_regions([mla("a", 768)], PACKED).packed_layouts == {"a": (768, 256)}
    err = _raises(SpecError, discover_regions, [mla("a", 769)], PACKED)
    assert err.field == "address" and err.values == {"value": 769, "expected": 1024}
    err = _raises(SpecError, discover_regions, [mla("a", -1)], PACKED)
    assert err.field == "address" and err.values == {"value": -1, "expected": 1024}


def test_packed_rows_need_every_condition():
    two = [mla("a", 0), mla("b", 256)]
    # PP producer with contiguous pages: each layer's page is its own region
    reg = discover_regions(two, RegistrationLayout(mla=True, block_outermost=True, pp_size=2))
    assert regions(reg) == [(S, 256, 1024, 4), (S + 256, 256, 1024, 4)] and reg.packed_layouts == {}
    # ... but a non-contiguous page still registers the packed row
    reg = discover_regions(
        [mla("a", 0, first=None)], RegistrationLayout(mla=True, block_outermost=True, pp_size=2)
    )
    assert reg.packed_layouts == {"a": (0, 256)}
    # not block-outermost, not MLA, or with SSM: no packed row
    for layout in (
        RegistrationLayout(mla=True),
        RegistrationLayout(block_outermost=True),
        RegistrationLayout(mla=True, block_outermost=True, has_ssm=True, kernel_blocks=4),
    ):
        assert discover_regions(two, layout).packed_layouts == {}
    # storages that differ: no packed row
    moved = mla("b", 256, storage_address=S + 8192, address=S + 8192 + 256)
    assert discover_regions([mla("a", 0), moved], PACKED).packed_layouts == {}
    # an attention tensor in the packed storage is no packed row
    reg = discover_regions(
        [attn("x", storage_bytes=4096, nbytes=4096, stride=1024, first=256, page=256)], PACKED
    )
    assert reg.packed_layouts == {} and regions(reg) == [(S, 256, 1024, 4)]


def test_packed_rows_routed_by_layer():
    routed = RegistrationLayout(mla=True, block_outermost=True, route_by_layer=True)
    reg = discover_regions([mla("a", 0), mla("b", 0)], routed)
    # one region per layer, never merged, even at one base
    assert regions(reg) == [(S, 256, 1024, 4), (S, 256, 1024, 4)] and reg.names == ("a", "b")
    err = _raises(
        UnsupportedError, discover_regions, [mla("a", 0), attn("x"), attn("y", kind="scratch")], routed
    )
    assert err.field == "kind" and err.values == {"value": ["attention", "mla", "scratch"]}
    none = CacheTensor("n", "none")
    assert discover_regions([mla("a", 0), none], routed).names == ("a",)
    # routing by layer without block-outermost: plain regions, merged at one base
    reg = discover_regions([attn("a"), attn("b")], RegistrationLayout(route_by_layer=True))
    assert reg.names == ("a",)


def test_int_lengths_and_ranges():
    reg = discover_regions([state()], RegistrationLayout(ppl=2))
    assert all(isinstance(x, int) for x in reg.block_lens + reg.block_strides)
    reg = discover_regions([attn(stride=128, first=128)], RegistrationLayout(ppl=2))
    assert all(isinstance(x, int) for x in reg.block_lens + reg.block_strides)
    # the registered memory is the storage, not the view
    t = attn(address=S + 64, storage_bytes=2048, nbytes=1024, first=None)
    assert discover_regions([t], RegistrationLayout()).ranges == ((S, 2048, 0, "VRAM"),)


def test_host_resident_whole_rows_start_at_the_view():
    # a host-resident view registers from its own address, also when it registers whole rows
    h = attn("h", address=S + 64, nbytes=1024, storage_bytes=1024, page=128, first=None, host_resident=True)
    assert regions(discover_regions([h], RegistrationLayout())) == [(S + 64, 256, 256, 4)]
    g = attn("g", address=S + 64, nbytes=1024, storage_bytes=1024, page=128, first=None)
    assert regions(discover_regions([g], RegistrationLayout())) == [(S, 256, 256, 4)]


def test_csa_linear_whole_rows_only_for_packed_mla():
    # CSA-linear: a non-contiguous block-major row is registered whole only for MLA in a packed storage
    csa_mla = RegistrationLayout(mla=True, csa_linear=True)
    t = attn(page=128, first=None)
    assert regions(discover_regions([t], csa_mla)) == [(S, 128, 256, 4)]  # packed storage, not MLA
    m = attn(kind="mla", page=128, first=None)
    assert regions(discover_regions([m], RegistrationLayout(csa_linear=True))) == [
        (S, 128, 256, 4)
    ]  # MLA, not packed
    assert regions(discover_regions([m], csa_mla)) == [(S, 256, 256, 4)]  # both


def test_one_byte_segments():
    # 1 block of 1 byte: segments of 1 byte cut any view
    t = attn(storage_bytes=100, nbytes=1, page=1, stride=1, first=None, pool_blocks=1, rows=1)
    assert regions(discover_regions([t], RegistrationLayout())) == [(S, 1, 1, 1)]
