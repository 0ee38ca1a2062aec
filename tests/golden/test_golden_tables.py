"""Replay every golden case recorded from vLLM 0.33.0 against kvgeom's vLLM-compatible functions.

One test per table; the cases of a table are looped inside it (thousands of cases in a few seconds).
A case with ``output`` must be reproduced exactly (after a JSON round trip); a case with ``error`` (vLLM
raised) must be refused with a :class:`kvgeom.errors.KvgeomError`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from kvgeom.blocks import (
    apply_prefix_caching,
    get_mapped_blocks,
    logical_to_kernel,
    map_block_ids_for_block_size_ratio,
)
from kvgeom.errors import GroupMismatchError, KvgeomError, PlanError, SpecError, UnsupportedError
from kvgeom.layout.conv import derive_conv_split, physical_blocks_per_logical, remote_conv_offsets
from kvgeom.pair.tp import TPMapping, compute_tp_mapping, head_offset, needs_split_local_handles, tp_ratio
from kvgeom.plan.descids import compute_desc_ids
from kvgeom.plan.splits import build_local_splits, expand_strided

Input = dict[str, Any]


def plain(value: Any) -> Any:
    """What the value looks like after a JSON round trip (arrays and tuples become lists)."""
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, np.integer):
        return int(value)
    return value


def is_ssm(kinds: list[str]) -> list[bool]:
    return [k == "ssm" for k in kinds]


def run_tp_mapping(i: Input) -> Any:
    mapping = compute_tp_mapping(
        i["local_rank"],
        i["local_tp"],
        i["remote_tp"],
        i["num_kv_heads"],
        i["is_mla"],
        is_ssm(i["group_kinds"]),
    )
    assert TPMapping.from_json(mapping.to_json()) == mapping
    return {
        "mapping": mapping.to_json(),
        "tp_ratio": tp_ratio(i["local_tp"], i["remote_tp"]),
        "head_offset": head_offset(i["local_rank"], i["local_tp"], i["remote_tp"], i["num_kv_heads"]),
    }


def run_needs_split(i: Input) -> Any:
    f = i["plan_from"]
    mapping = compute_tp_mapping(
        f["local_rank"],
        f["local_tp"],
        f["remote_tp"],
        f["num_kv_heads"],
        f["is_mla"],
        is_ssm(f["group_kinds"]),
    )
    assert mapping.to_json() == i["plan"]
    return needs_split_local_handles(i["tp_ratio"], TPMapping.from_json(i["plan"]), i["use_mla"])


def run_desc_ids(i: Input) -> Any:
    return compute_desc_ids(
        i["block_ids"],
        i["dst_num_blocks"],
        i["num_regions"],
        i["block_size_ratio"],
        i["physical_blocks_per_logical"],
        is_ssm(i["group_kinds"]),
        ssm_region_indices=i["ssm_region_indices"],
        num_conv_pieces=i["num_conv_pieces"],
        region_num_blocks=i["region_num_blocks"],
        region_group_ids=i["region_group_ids"],
    )


def run_logical_to_kernel(i: Input) -> Any:
    return logical_to_kernel(i["block_ids"], i["ratio"], is_ssm(i["group_kinds"]))


def run_map_ratio(i: Input) -> Any:
    local, remote = map_block_ids_for_block_size_ratio(
        i["local_block_ids"], i["remote_block_ids"], i["ratio"], is_ssm(i["group_kinds"])
    )
    return {"local": local, "remote": remote}


def run_get_mapped(i: Input) -> Any:
    return get_mapped_blocks(i["block_ids"], i["ratio"])


def run_prefix(i: Input) -> Any:
    decode, prefill = apply_prefix_caching(
        i["decode_block_ids"],
        i["prefill_block_ids"],
        i["decode_ppl"],
        i["prefill_ppl"],
        is_ssm(i["group_kinds"]),
        has_mamba=i["has_mamba"],
    )
    return {"decode": decode, "prefill": prefill}


def run_local_splits(i: Input) -> Any:
    f = i["plan_from"]
    kinds = is_ssm(i["group_kinds"])
    mapping = compute_tp_mapping(
        f["local_rank"], f["local_tp"], f["remote_tp"], f["num_kv_heads"], f["is_mla"], kinds
    )
    assert mapping.to_json() == i["plan"]
    splits = build_local_splits(
        i["src_descs"],
        mapping,
        i["num_fa_descs"],
        i["block_size_ratio"],
        kinds,
        region_is_mla=i["region_is_mla"],
        region_num_blocks=i["region_num_blocks"],
    )
    return [{"strided": s, "expanded": expand_strided(s)} for s in splits]


def run_conv_split(i: Input) -> Any:
    split = derive_conv_split(
        i["mamba_type"], i["conv_shape"], i["temporal_shape"], i["local_tp"], i["conv_dtype"], i["ssm_dtype"]
    )
    return {
        "local_proj_dims": split.local_proj_dims,
        "proj_bytes": split.proj_bytes,
        "local_conv_offsets": split.local_conv_offsets,
        "ssm_sizes": split.ssm_sizes,
        "conv_rows": split.conv_rows,
        "conv_dtype_size": split.conv_dtype_size,
    }


def run_remote_conv(i: Input) -> Any:
    return remote_conv_offsets(
        i["local_proj_dims"], i["conv_rows"], i["conv_dtype_size"], i["local_rank_offset"], i["tp_ratio"]
    )


def run_ppl(i: Input) -> Any:
    return physical_blocks_per_logical(i["ssm_sizes"], i["block_len"])


TABLES: dict[tuple[str, str], Callable[[Input], Any]] = {
    ("tp_mapping", "tp_mapping"): run_tp_mapping,
    ("tp_mapping", "needs_split_local_xfer_handles"): run_needs_split,
    ("desc_ids", "desc_ids"): run_desc_ids,
    ("block_ids", "logical_to_kernel_block_ids"): run_logical_to_kernel,
    ("block_ids", "map_block_ids_for_block_size_ratio"): run_map_ratio,
    ("block_ids", "get_mapped_blocks"): run_get_mapped,
    ("prefix_caching", "apply_prefix_caching"): run_prefix,
    ("local_splits", "build_local_splits"): run_local_splits,
    ("conv", "conv_split"): run_conv_split,
    ("conv", "remote_conv_offsets"): run_remote_conv,
    ("conv", "physical_blocks_per_logical"): run_ppl,
}

# Replayed elsewhere (end-to-end pull, needs a full worker model).
NOT_HERE = {("e2e_pull", "run_mla_kda_pull")}


def split_error(message: str) -> type[KvgeomError]:
    """The kvgeom error expected for each of vLLM's three ``_build_local_splits_from_plan`` asserts."""
    if message.startswith("Head-sharded attention reads"):
        return UnsupportedError
    if message.startswith("FA region blocks"):
        return GroupMismatchError
    return PlanError  # bare ``assert num_fa_descs <= sharded_desc_end``


# The typed error kvgeom must raise where vLLM raised, by table (from vLLM's error message).
EXPECTED_ERROR: dict[str, Callable[[str], type[KvgeomError]]] = {
    "desc_ids": lambda message: GroupMismatchError,
    "apply_prefix_caching": lambda message: PlanError,
    "build_local_splits": split_error,
    "conv_split": lambda message: SpecError,
}


def replay(table: str, cases: list[dict[str, Any]], run: Callable[[Input], Any]) -> list[str]:
    """Run every case; return one line per mismatch (empty when all agree)."""
    failures: list[str] = []
    for case in cases:
        cid, inp = case["id"], case["input"]
        try:
            got = run(inp)
        except KvgeomError as exc:
            if "error" not in case:
                failures.append(f"id {cid}: raised {type(exc).__name__}: {exc}")
            else:
                expected = EXPECTED_ERROR.get(table, lambda message: KvgeomError)(case["error"]["message"])
                if not isinstance(exc, expected):
                    failures.append(
                        f"id {cid}: raised {type(exc).__name__} ({exc}), expected {expected.__name__}"
                    )
            continue
        except Exception as exc:  # noqa: BLE001 - report, don't stop the loop
            failures.append(f"id {cid}: raised {type(exc).__name__} (not a KvgeomError): {exc}")
            continue
        if "error" in case:
            failures.append(
                f"id {cid}: vLLM raised {case['error']['type']} {case['error']['message']!r}, kvgeom did not"
            )
        elif plain(got) != case["output"]:
            failures.append(f"id {cid}: got {str(plain(got))[:300]} expected {str(case['output'])[:300]}")
    return failures


@pytest.mark.parametrize("stem, table", sorted(TABLES), ids=lambda x: str(x))
def test_golden_table(golden: Callable[[str, str], list[dict[str, Any]]], stem: str, table: str) -> None:
    cases = golden(stem, table)
    assert cases, f"{stem}/{table} has no cases"
    failures = replay(table, cases, TABLES[(stem, table)])
    assert not failures, f"{len(failures)}/{len(cases)} cases differ:\n" + "\n".join(failures[:20])


def test_every_golden_table_is_replayed(golden_tables: set[tuple[str, str]]) -> None:
    assert golden_tables == set(TABLES) | NOT_HERE
