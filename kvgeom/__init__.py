"""kvgeom: KV-cache and SSM-state transfer geometry for disaggregated (P/D) LLM serving.

Data flows one way: model spec -> rank geometry -> TP mapping -> plan -> descriptors -> transport.

>>> from kvgeom import presets, EngineConfig, card_of, Pairing, plan_request
>>> model = presets.load("nemotron-h-8b")
>>> d = card_of("decode", model, EngineConfig(tp_size=1, block_size=2080, kernel_block_size=32, num_blocks=64))
>>> p = [card_of("prefill", model, EngineConfig(tp_size=2, tp_rank=r, block_size=1040, kernel_block_size=16,
...                                             num_blocks=64)) for r in range(2)]
>>> pairing = Pairing.create(d, p, mode="pull")          # handshake: validated, tables built lazily
>>> plan = plan_request(pairing, [[0], [1], [2], [3], [4], [5], [6]], [[0, 1], [2], [3], [4], [5], [6], [7]],
...                     num_tokens=2080)  # the tokens D holds blocks for: required for attention blocks
>>> [t.remote_rank for t in plan.transfers]
[0, 1]
"""

from typing import Any

from kvgeom.errors import (
    BlockIdError,
    CardError,
    ConfigError,
    GroupMismatchError,
    IncompatiblePairError,
    KvgeomError,
    PlanError,
    RatioError,
    SpecError,
    TokenCountError,
    UnsupportedError,
)
from kvgeom.layout.allocate import rank_geometry
from kvgeom.layout.card import CARD_VERSION, GeometryCard, card_of
from kvgeom.layout.engine import ConvLayout, EngineConfig, KVLayout
from kvgeom.layout.geometry import (
    Group,
    RankGeometry,
    Region,
    ReplicatedLayout,
    SSMLayout,
    align_hybrid_block_size,
)
from kvgeom.layout.runs import Runs, coalesce_moves
from kvgeom.layout.view import EngineView
from kvgeom.model.layers import (
    AttentionSpec,
    CircularBufferSpec,
    Layer,
    LayerKind,
    MambaSpec,
    MLASpec,
    ReplicatedStateSpec,
    Shard,
)
from kvgeom.model.spec import ModelSpec
from kvgeom.modes import Compat, Policy, policy_of
from kvgeom.pair.handshake import PairShape, check_pair
from kvgeom.pair.tp import TPMapping, compute_tp_mapping, tp_ratio
from kvgeom.plan.blockrows import block_rows, block_runs, zero_runs
from kvgeom.plan.dlist import Dlist
from kvgeom.plan.pairing import Pairing, push_writers
from kvgeom.plan.receive import post_receive, receive_step
from kvgeom.plan.request import plan_request
from kvgeom.plan.requestplan import MOVE_COLUMNS, Regroup, RequestPlan, Transfer, check_writes

__version__ = "0.1.0"

__all__ = [
    "AttentionSpec",
    "BlockIdError",
    "CARD_VERSION",
    "CardError",
    "CircularBufferSpec",
    "Compat",
    "ConfigError",
    "ConvLayout",
    "Dlist",
    "EngineConfig",
    "EngineView",
    "GeometryCard",
    "Group",
    "GroupMismatchError",
    "IncompatiblePairError",
    "KVLayout",
    "KvgeomError",
    "Layer",
    "LayerKind",
    "MLASpec",
    "MOVE_COLUMNS",
    "MambaSpec",
    "ModelSpec",
    "PairShape",
    "Pairing",
    "PlanError",
    "Policy",
    "RankGeometry",
    "RatioError",
    "Region",
    "Regroup",
    "ReplicatedLayout",
    "ReplicatedStateSpec",
    "RequestPlan",
    "Runs",
    "SSMLayout",
    "Shard",
    "SpecError",
    "TPMapping",
    "TokenCountError",
    "Transfer",
    "UnsupportedError",
    "align_hybrid_block_size",
    "block_rows",
    "block_runs",
    "card_of",
    "check_pair",
    "check_writes",
    "coalesce_moves",
    "compute_tp_mapping",
    "plan_request",
    "policy_of",
    "post_receive",
    "presets",
    "push_writers",
    "rank_geometry",
    "receive_step",
    "tp_ratio",
    "zero_runs",
]


def __getattr__(name: str) -> Any:  # presets load lazily (they read JSON files)
    if name == "presets":
        import importlib

        return importlib.import_module("kvgeom.model.presets")
    raise AttributeError(name)
