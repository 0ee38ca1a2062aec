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
    with pytest.raises(SpecError, match="CSA-linear"):
        discover_regions([ple], RegistrationLayout())


def test_refusals_name_the_layer() -> None:
    with pytest.raises(SpecError, match="'odd'.*segments"):
        discover_regions(
            [layer("odd", 1 << 20, nbytes=12 * PAGE + 1, storage_bytes=20 * PAGE)], RegistrationLayout()
        )
    with pytest.raises(SpecError, match="'short'.*3 blocks"):
        discover_regions([layer("short", 1 << 20, rows=3)], RegistrationLayout())
    with pytest.raises(UnsupportedError, match="requires MLA"):
        discover_regions([layer("a", 1 << 20)], RegistrationLayout(block_outermost=True, route_by_layer=True))
    with pytest.raises(SpecError, match="kind must be one of"):
        layer("x", 0, kind="lightning")
