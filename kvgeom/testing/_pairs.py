"""P/D pairs of the property tests: :class:`PDPair` (a model, both engines, mode, compat), the handshake
check of every local rank (:func:`check_geometries`), and :func:`plannable_class`, the classes of pairs
kvgeom must always accept. :mod:`kvgeom.testing.strategies` draws them (import them from there)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvgeom.errors import KvgeomError
from kvgeom.layout.allocate import rank_geometry
from kvgeom.layout.engine import ConvLayout, EngineConfig, KVLayout
from kvgeom.layout.geometry import RankGeometry
from kvgeom.model.layers import AttentionSpec, LayerKind, MLASpec
from kvgeom.model.spec import ModelSpec
from kvgeom.modes import policy_of
from kvgeom.pair.streams import packed_streams
from kvgeom.plan.pairing import Pairing
from kvgeom.testing._report import Report
from kvgeom.testing.oracle import Request, engine_geometries, run

__all__ = ["PDPair", "check_geometries", "plannable_class"]


def check_geometries(
    p_geoms: Sequence[RankGeometry],
    d_geoms: Sequence[RankGeometry],
    mode: str,
    compat: str,
    prefix_caching: bool = False,
) -> None:
    """Pair every local rank (D's in pull, P's in push) with every pipeline stage of the other engine's
    ranks (:func:`~kvgeom.testing.engine_geometries`); raise the first refusal. The two sides may run
    different models: what a misconfigured or lying peer looks like."""
    local, remote = (d_geoms, p_geoms) if mode == "pull" else (p_geoms, d_geoms)
    tp = remote[0].tp_size
    for g in local:
        for s in range(0, len(remote), tp):
            Pairing.create(g, list(remote[s : s + tp]), mode, compat, prefix_caching)


@dataclass(frozen=True)
class PDPair:
    """A model with a P and a D engine that kvgeom pairs in ``mode`` under ``compat``."""

    model: ModelSpec
    p_engine: EngineConfig
    d_engine: EngineConfig
    mode: str = "pull"
    compat: str = "kvgeom"
    prefix_caching: bool = False

    def run(self, request: Request, tell_num_tokens: bool = True) -> Report:
        return run(
            self.model,
            self.p_engine,
            self.d_engine,
            request,
            self.mode,
            self.compat,
            self.prefix_caching,
            tell_num_tokens=tell_num_tokens,
        )

    def check(self) -> None:
        """Raise the :class:`~kvgeom.errors.KvgeomError` of the first local rank kvgeom refuses to pair (with
        any pipeline stage of the other engine)."""
        check_geometries(
            engine_geometries(self.model, self.p_engine),
            engine_geometries(self.model, self.d_engine),
            self.mode,
            self.compat,
            self.prefix_caching,
        )

    def __str__(self) -> str:
        def eng(e: EngineConfig) -> str:
            return (
                f"TP{e.tp_size}{f' DCP{e.dcp_size}' if e.dcp_size > 1 else ''}"
                f"{f' PP{e.pp_size}' if e.pp_size > 1 else ''}{' packed' if e.packed_rows else ''} "
                f"block {e.block_size}/kernel "
                f"{e.kernel} x{e.num_blocks}"
                f"{' ' + e.kv_layout.value if e.kv_layout is not KVLayout.HEAD_MAJOR else ''}"
                f"{' kv_split' if e.kv_split else ''}{' SD' if e.conv_layout is ConvLayout.SD else ''}"
                f"{' permute' if e.permute_local_kv else ''}"
            )

        kinds = ",".join(la.kind.value for la in self.model.layers)
        pc = " prefix-caching" if self.prefix_caching else ""
        return f"{self.mode}/{self.compat}{pc} {kinds}: P {eng(self.p_engine)} -> D {eng(self.d_engine)}"


def _permutable(model: ModelSpec) -> bool:
    """A model whose pages vLLM's LBHNC-into-LBNHC permute may cover: head-sharded full attention only (no
    MLA, no SSM state, no sliding window: no hybrid memory allocator)."""
    return bool(model.layers) and all(
        isinstance(la.spec, AttentionSpec) and not la.spec.sliding_window for la in model.layers
    )


def _packed_alike(model: ModelSpec, p: EngineConfig, d: EngineConfig) -> bool:
    """Both sides' packed CSA-linear rows can be built and register regions viewed by the same groups, of the
    same kinds."""
    try:
        streams = [
            [(s.region, s.group, s.kind) for s in packed_streams(rank_geometry(model, e))] for e in (p, d)
        ]
    except KvgeomError:
        return False
    return streams[0] == streams[1]


def _permuted(pair: PDPair) -> bool:
    """Head-major P pages moved into a token-major D with ``permute_local_kv``: pulled, or pushed in kvgeom
    mode."""
    p, d = pair.p_engine, pair.d_engine
    return (
        (pair.mode == "pull" or not policy_of(pair.compat).engine_refusals)
        and d.permute_local_kv
        and p.kv_layout is KVLayout.HEAD_MAJOR
        and d.kv_layout is KVLayout.TOKEN_MAJOR
    )


def plannable_class(pair: PDPair) -> str | None:
    """The class of pairs kvgeom must always accept that ``pair`` belongs to, or ``None``: one attention
    spec (no sliding window, no KV head replicated at either TP) or MLA only, or an SSM hybrid at equal TP
    with one conv layout; head-major pages, equal logical and kernel blocks, no DCP, pipeline stages,
    packed rows or separate groups; vllm mode pushes only at equal TP; or dense attention moved from head-major
    P pages into a token-major D that permutes them on receive (pulled; pushed in kvgeom mode). The property tests treat a refusal
    of such a pair as a failure, not a discard."""
    model, p, d = pair.model, pair.p_engine, pair.d_engine
    if _permuted(pair):  # one layout each side, D permutes on receive: dense attention, as below
        return _permuted_class(pair)
    engines_plain = all(
        e.kv_layout is KVLayout.HEAD_MAJOR
        and not e.kv_split
        and e.dcp_size == 1
        and e.pp_size == 1
        and not e.packed_rows
        and not e.separate_group
        for e in (p, d)
    )
    same_blocks = p.block_size == d.block_size and p.kernel == d.kernel
    if model.is_csa_linear:  # MLA pages: any KV layout (a main KV: below); equal blocks and conv layouts
        return _csa_linear_class(pair, same_blocks)
    if not engines_plain or not same_blocks:
        return None
    if policy_of(pair.compat).engine_refusals and pair.mode == "push" and p.tp_size != d.tp_size:
        return None
    attn = [la.spec for la in model.layers if not la.kind.is_ssm]
    if model.has_ssm:
        if p.tp_size != d.tp_size or p.conv_layout is not d.conv_layout or not attn or len(set(attn)) != 1:
            return None
        if not isinstance(attn[0], AttentionSpec) or attn[0].sliding_window or pair.prefix_caching:
            return None
        return "ssm hybrid, equal TP"
    if attn and all(isinstance(a, MLASpec) and not a.sliding_window for a in attn):
        return "MLA"
    if (
        len(set(attn)) == 1
        and isinstance(attn[0], AttentionSpec)
        and not attn[0].sliding_window
        and attn[0].num_kv_heads % max(p.tp_size, d.tp_size) == 0
    ):
        return "dense attention"
    return None


def _permuted_class(pair: PDPair) -> str | None:
    """A permuted pair's class: dense attention, no DCP, pipeline stages or separate group, equal blocks."""
    model, p, d = pair.model, pair.p_engine, pair.d_engine
    plain = p.dcp_size == d.dcp_size == 1 and p.pp_size == d.pp_size == 1 and not d.separate_group
    heads = model.attention_spec.num_kv_heads if model.attention_spec is not None else 0
    same = p.block_size == d.block_size and p.kernel == d.kernel and p.kv_split == d.kv_split
    dense = _permutable(model) and len({la.spec for la in model.layers}) == 1
    ok = plain and same and dense and heads % max(p.tp_size, d.tp_size) == 0
    return "dense attention, permuted" if ok else None


def _csa_linear_class(pair: PDPair, same_blocks: bool) -> str | None:
    """A CSA-linear pair's class: equal blocks and conv layouts, packed rows on both sides or neither, both
    TP sizes on one side of the KV-head count, no head slices of token-major pages in vllm mode, no
    replicated SSM units across TP sizes."""
    model, p, d = pair.model, pair.p_engine, pair.d_engine
    ssm = model.ssm_spec
    replicated = ssm is not None and any(  # replicated SSM units across TP sizes: vllm mode refuses them,
        any(ssm.replicated_pieces(t)) or ssm.temporal.replicated(t) for t in (p.tp_size, d.tp_size)
    )  # kvgeom mode gathers them in equal chunks where they divide
    packed = p.packed_rows and d.packed_rows
    plain = (
        same_blocks and p.conv_layout is d.conv_layout and (packed or not (p.packed_rows or d.packed_rows))
    )
    if packed:  # rows kvgeom builds (one kernel block per block), their regions viewed alike on both sides;
        # across TP sizes vLLM's copies through every region land on other layers' pages: vllm mode refuses
        plain = (
            plain
            and _packed_alike(model, p, d)
            and (p.tp_size == d.tp_size or not policy_of(pair.compat).engine_refusals)
        )
    k = model.num_kv_heads  # vLLM's rule: both TP sizes on one side of the KV-head count
    one_side = (p.tp_size < k) == (d.tp_size < k)
    # a head-sharded main KV across TP sizes: vllm mode cuts head slices, which needs head-major pages
    main_kv = any(la.kind is LayerKind.ATTENTION for la in model.layers)
    sliced = (
        policy_of(pair.compat).engine_refusals
        and main_kv
        and p.tp_size != d.tp_size
        and any(e.kv_layout is not KVLayout.HEAD_MAJOR for e in (p, d))
    )
    ok = plain and one_side and not sliced and not (p.tp_size != d.tp_size and replicated)
    return "csa-linear" if ok else None
