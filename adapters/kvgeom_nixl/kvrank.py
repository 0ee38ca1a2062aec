"""One engine rank's KV cache on NIXL: kvgeom plans turned into registered tensors, prepared dlists and
READ/WRITE transfers.

``KVRank(card)`` allocates the rank's regions as torch tensors laid out as its :class:`RankGeometry`
says (one tensor per region: hybrid regions are shared by one layer of every group), registers them
(DRAM for CPU tensors, VRAM for CUDA), serves its handshake payload on the side channel, and then:

* ``connect(engine_id, ports)`` — fetches the peer ranks' payloads, validates their cards and the pair
  with kvgeom's handshake rules (a refused pair raises the readable kvgeom error, and the peer sees the
  same verdict when it checks our card), adds the peers and prepares every remote table;
* ``pull(...)`` (D) / ``push(...)`` (P) — plans a request, checks that every write lands in the
  request's own blocks, checks the peers' metadata generation, posts one transfer per source rank,
  sends the notify-only notifications and waits, bounded; on D applies the post-receive step
  (regroup, zero ranges). A failed request zeroes its destination blocks and raises;
* ``wait_released(...)`` (P in pull) / ``wait_received(...)`` (D in push) — count notifications.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvgeom import GeometryCard, KvgeomError, Pairing, RequestPlan, check_pair, plan_request
from kvgeom.blocks import as_group_ids, logical_to_kernel
from kvgeom.plan import Regroup, check_writes, contiguous_runs, receive_step

from .agent import Endpoint, Prepped, Telemetry
from .config import TransportConfig
from .errors import AdapterError
from .sidechannel import SideChannelServer, check_generation, fetch, make_payload

__all__ = ["KVRank", "PeerLink", "RequestResult", "allocate", "apply_post_receive", "request_block_rows"]


def allocate(card: GeometryCard, device: str = "cpu") -> list[Any]:
    """One zeroed uint8 tensor per region of the card's geometry (``region.nbytes`` each)."""
    import torch

    return [torch.zeros(r.nbytes, dtype=torch.uint8, device=device) for r in card.geometry.regions]


def _zero_rows(tensors: Sequence[Any], rows: np.ndarray) -> int:
    """Zero ``(region, offset, length)`` rows; vectorised per (region, length) bucket."""
    import torch

    total = 0
    if not len(rows):
        return 0
    for region in np.unique(rows[:, 0]):
        sel = rows[rows[:, 0] == region]
        t = tensors[int(region)]
        for length in np.unique(sel[:, 2]):
            offs = sel[sel[:, 2] == length, 1]
            idx = (offs[:, None] + np.arange(int(length))[None, :]).ravel()
            t[torch.from_numpy(idx).to(t.device)] = 0
            total += idx.size
    return total


def _regroup(tensors: Sequence[Any], card: GeometryCard, step: Regroup) -> None:
    """``[bsr, heads, tokens/bsr, head_bytes] -> [heads, tokens, head_bytes]`` per listed block."""
    import torch

    geom = card.geometry
    blocks = torch.from_numpy(np.asarray(step.blocks, dtype=np.int64))
    n = step.tokens // step.bsr
    for region in step.regions:
        r = geom.regions[region]
        view = tensors[region].view(r.num_blocks, r.block_stride)
        page = view[blocks.to(view.device), : r.block_len]
        page = page.view(-1, step.bsr, step.heads, n, step.head_bytes).permute(0, 2, 1, 3, 4).reshape(len(blocks), -1)
        view[blocks.to(view.device), : r.block_len] = page


def apply_post_receive(tensors: Sequence[Any], card: GeometryCard, regroups: Sequence[Regroup],
                       zero: np.ndarray) -> int:
    """The consumer's post-receive step on its tensors: regroups, then zero ranges. Returns bytes zeroed."""
    for step in regroups:
        _regroup(tensors, card, step)
    return _zero_rows(tensors, zero)


def request_block_rows(card: GeometryCard, ids: Sequence[Sequence[int]]) -> np.ndarray:
    """``(region, offset, length)`` rows covering every block of a request on this rank (all regions,
    whole pages): what a failed request zeroes so that no stale or partial bytes are ever read."""
    geom = card.geometry
    kinds = geom.group_is_ssm
    kernel = logical_to_kernel(as_group_ids(ids, kinds, "ids"), geom.ppl, kinds)
    blocks = np.unique(np.concatenate([np.zeros(0, np.int64)] + [
        k if not ssm else (k[:, None] * geom.ppl + np.arange(geom.ppl)).ravel() for k, ssm in zip(kernel, kinds)]))
    rows = [np.stack([np.full(blocks.size, r.index), blocks * r.block_stride, np.full(blocks.size, r.block_stride)],
                     axis=1) for r in geom.regions]
    return np.concatenate(rows).astype(np.int64) if rows else np.zeros((0, 3), np.int64)


@dataclass
class PeerLink:
    """A remote rank as this rank sees it: its payload, its agent and our prepared table for it."""

    rank: int
    host: str
    port: int
    agent: str
    generation: int
    card: GeometryCard
    bases: tuple[int, ...]
    device: int
    prepped: Prepped | None = None


@dataclass
class RequestResult:
    """What one request did on this rank."""

    request_id: str
    ok: bool
    descriptors: int = 0
    bytes_moved: int = 0
    bytes_zeroed: int = 0
    nixl_desc_count: int = 0
    runs: int = 0
    seconds: float = 0.0
    transfer_seconds: float = 0.0  # posted -> every transfer observed done (the NIXL part of ``seconds``)
    error: str | None = None
    telemetry: list[Telemetry] = field(default_factory=list)


class KVRank:
    """One engine rank with its KV cache registered on a NIXL agent (see the module docstring)."""

    def __init__(self, card: GeometryCard, config: TransportConfig | None = None, device: str = "cpu",
                 host: str = "127.0.0.1") -> None:
        self.card = card
        self.config = config or TransportConfig()
        self.host = host
        self.tensors = allocate(card, device)
        self.ep = Endpoint(f"{card.engine_id}-{card.engine.tp_rank}", self.config)
        self.regions = self.ep.register_tensors(self.tensors)
        self.mem_type = self.regions[0].mem_type
        self.server = SideChannelServer(host, 0, self.payload()).start()
        self.pairings: dict[str, Pairing] = {}
        self.links: dict[str, dict[int, PeerLink]] = {}
        self._local: dict[tuple[str, tuple[int, int]], Prepped] = {}
        self.rejected: dict[str, str] = {}

    # -- handshake -------------------------------------------------------------------------------------
    @property
    def rank(self) -> int:
        return self.card.engine.tp_rank

    @property
    def port(self) -> int:
        return self.server.port

    def payload(self) -> dict[str, Any]:
        return make_payload(engine_id=self.card.engine_id, rank=self.rank, agent_name=self.ep.name,
                            agent_metadata=self.ep.metadata(), card=self.card.to_json(),
                            regions=[(r.addr, r.nbytes, r.device_id) for r in self.regions],
                            device_id=self.regions[0].device_id, generation=self.ep.generation)

    def connect(self, engine_id: str, ports: Mapping[int, int], mode: str = "pull", compat: str = "kvgeom",
                timeout_s: float | None = None) -> Pairing:
        """Handshake with every rank of a remote engine this rank talks to; validate; prepare tables."""
        timeout = timeout_s if timeout_s is not None else self.config.handshake_timeout_s
        payloads = {r: fetch(self.host, p, self.payload(), timeout_s=timeout) for r, p in ports.items()}
        try:
            cards = {r: GeometryCard.from_json(p["card"]) for r, p in payloads.items()}
            pairing = Pairing.create(self.card, cards, mode=mode, compat=compat)
        except KvgeomError as exc:
            self.rejected[engine_id] = str(exc)
            raise
        links = {}
        for r in pairing.targets:
            p = payloads[r]
            agent = self.ep.add_peer(p["agent_name"], p["agent_metadata"])
            link = PeerLink(r, self.host, ports[r], agent, int(p["generation"]), cards[r],
                            tuple(int(x[0]) for x in p["regions"]), int(p["device_id"]))
            link.prepped = self.ep.prep_remote(agent, pairing.remote_table(r).bind(link.bases, link.device),
                                               self.mem_type)
            links[r] = link
        self.pairings[engine_id], self.links[engine_id] = pairing, links
        return pairing

    def check_peers(self, mode: str = "pull", compat: str = "kvgeom") -> dict[str, str]:
        """Validate the cards of every peer that handshook with us (the other side's checks, run here
        too): ``{agent name: error}`` for each refused one. Both sides reach the same verdict."""
        out = {}
        for name, payload in self.server.peers().items():
            try:
                peer = GeometryCard.from_json(payload["card"])
                if mode == "pull":  # the peer (D) reads us (P): check from its side
                    check_pair(peer.geometry, self.card.geometry, "pull", compat)
                else:
                    check_pair(self.card.geometry, peer.geometry, "push", compat)
            except KvgeomError as exc:
                out[name] = str(exc)
        self.rejected.update(out)
        return out

    def _local_handle(self, engine_id: str, key: tuple[int, int]) -> Prepped:
        if (engine_id, key) not in self._local:
            rows = self.pairings[engine_id].local_table(key)
            bases = [r.addr for r in self.regions]
            self._local[(engine_id, key)] = self.ep.prep_local(rows.bind(bases, self.regions[0].device_id),
                                                               self.mem_type)
        return self._local[(engine_id, key)]

    # -- transfers -------------------------------------------------------------------------------------
    def plan(self, engine_id: str, local_ids, remote_ids, request_id: str, remote_request_id: str,
             num_tokens: int | None = None) -> RequestPlan:
        return plan_request(self.pairings[engine_id], local_ids, remote_ids, request_id, remote_request_id,
                            num_tokens)

    def _execute(self, engine_id: str, plan: RequestPlan, dst_ids, timeout_s: float | None) -> RequestResult:
        pairing, links = self.pairings[engine_id], self.links[engine_id]
        check_writes(plan, pairing, dst_ids)  # untrusted remote geometry never writes outside the request
        deadline = time.monotonic() + (timeout_s if timeout_s is not None else self.config.transfer_timeout_s)
        t0 = time.monotonic()
        for t in plan.transfers:
            link = links[t.remote_rank]
            check_generation(link.host, link.port, link.generation, timeout_s=max(0.1, deadline - time.monotonic()))
        t_post = time.monotonic()  # CMA transfers complete inside post(): time from the first post
        posted = [self.ep.post(plan.op, self._local_handle(engine_id, t.local_table), t.local_ids,
                               links[t.remote_rank].prepped, t.remote_ids, t.notif.encode())
                  for t in plan.transfers]
        notif = plan.transfers[0].notif if plan.transfers else None
        for r in plan.notify_only:
            self.ep.send_notif(links[r].agent, (notif or f"{plan.request_id}:{plan.expected_notifications}").encode())
        tels = [x.wait(deadline) for x in posted]
        t_done = time.monotonic()
        moves = plan.moves(pairing)
        return RequestResult(plan.request_id, True, plan.num_descriptors, int(moves[:, 6].sum()) if len(moves) else 0,
                             0, sum(t.desc_count or 0 for t in tels), contiguous_runs(moves), time.monotonic() - t0,
                             t_done - t_post, None, tels)

    def pull(self, engine_id: str, local_ids, remote_ids, request_id: str, remote_request_id: str,
             timeout_s: float | None = None, num_tokens: int | None = None) -> RequestResult:
        """Read a request's blocks from the remote engine into ours, then regroup and zero. On any
        failure the request's blocks are zeroed and the error is raised (bounded by ``timeout_s``)."""
        try:
            plan = self.plan(engine_id, local_ids, remote_ids, request_id, remote_request_id, num_tokens)
            result = self._execute(engine_id, plan, local_ids, timeout_s)
            result.bytes_zeroed = apply_post_receive(self.tensors, self.card, plan.regroup, plan.zero)
            return result
        except (AdapterError, KvgeomError):
            self.invalidate(local_ids)
            raise

    def push(self, engine_id: str, local_ids, remote_ids, request_id: str, remote_request_id: str,
             timeout_s: float | None = None, num_tokens: int | None = None) -> RequestResult:
        """Write a request's blocks into the remote (D) engine's blocks ``remote_ids``."""
        plan = self.plan(engine_id, local_ids, remote_ids, request_id, remote_request_id, num_tokens)
        return self._execute(engine_id, plan, remote_ids, timeout_s)

    def wait_received(self, producer: GeometryCard, local_ids, producer_ids, request_id: str, expected: int,
                      timeout_s: float | None = None, num_tokens: int | None = None) -> RequestResult:
        """D in push mode: wait for ``expected`` write notifications of ``request_id``, then apply
        kvgeom's post-receive step (vLLM never zeroes in push). Zeroes the blocks on timeout."""
        t0 = time.monotonic()
        try:
            self.ep.wait_notifications(None, f"{request_id}:".encode(), expected,
                                       timeout_s=timeout_s if timeout_s is not None else self.config.notif_timeout_s)
        except AdapterError:
            self.invalidate(local_ids)
            raise
        regroups, zero = receive_step(self.card.geometry, producer.geometry, local_ids, producer_ids, num_tokens)
        zeroed = apply_post_receive(self.tensors, self.card, regroups, zero)
        return RequestResult(request_id, True, bytes_zeroed=zeroed, seconds=time.monotonic() - t0)

    def invalidate(self, ids) -> int:
        """Zero every block of a request on this rank (a failed receive must leave no partial or stale
        bytes behind). Returns bytes zeroed."""
        return _zero_rows(self.tensors, request_block_rows(self.card, ids))

    def wait_released(self, request_id: str, expected: int, timeout_s: float | None = None) -> int:
        """P in pull mode: wait until ``expected`` consumers said they are done with ``request_id``."""
        got = self.ep.wait_notifications(None, f"{request_id}:".encode(), expected,
                                         timeout_s=timeout_s if timeout_s is not None else self.config.notif_timeout_s)
        return len(got)

    def reregister(self) -> None:
        """Re-register fresh tensors (e.g. after a cache resize): bumps the generation that peers check."""
        old = self.tensors
        self.ep.deregister_all()
        self.tensors = allocate(self.card, old[0].device.type if old else "cpu")
        self.regions = self.ep.register_tensors(self.tensors)
        self._local.clear()
        self.server.update(self.payload())

    def close(self) -> None:
        try:
            self.server.close()
        finally:
            self.ep.close()

    def __enter__(self) -> KVRank:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
