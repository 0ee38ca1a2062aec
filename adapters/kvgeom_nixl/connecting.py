"""The handshake side of :class:`~kvgeom_nixl.kvrank.KVRank`: fetching the peer ranks' payloads (side channel or etcd), checking every field, card and region, pairing, adding the peers' agents and preparing their tables (:meth:`Connecting.connect`); the engines that talk to us without our connecting (:meth:`Connecting.watch`) and the check of their cards (:meth:`Connecting.check_peers`)."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import numpy as np

from kvgeom import GeometryCard, KvgeomError, Pairing, check_pair

from .errors import AdapterError, HandshakeTimeout, ProtocolError, TransferError
from .rankrecords import PeerLink
from .sidechannel import fetch


class Connecting:
    """Handshakes with remote engines (mixed into :class:`~kvgeom_nixl.kvrank.KVRank`, whose state it uses)."""

    # -- handshake -------------------------------------------------------------------------------------
    def connect(
        self,
        engine_id: str,
        ports: Mapping[int, Any] | None = None,
        mode: str = "pull",
        compat: str = "kvgeom",
        timeout_s: float | None = None,
    ) -> Pairing:
        """Handshake with every rank of a remote engine this rank talks to; validate; prepare tables.

        ``ports`` maps each rank of the engine to its side channel: a port on our own ``host``, or a
        ``(host, port)`` pair. Without ``ports`` (``discovery="etcd"``) every rank's payload is read from
        etcd (waiting, within the deadline, until all ranks of the engine are registered).

        Everything a peer sends is checked before use, within ``timeout_s`` (default
        ``handshake_timeout_s``) as a whole: payload fields, the seal, the card (limits first, then its
        own consistency, then the pair's rules), the card's region sizes against the advertised regions
        and those against the peer's NIXL registrations. A refusal is a typed error (an
        :class:`AdapterError`, or a :class:`KvgeomError` for a card or pair kvgeom refuses); nothing of
        the failed handshake is kept. Connecting again to a connected engine replaces its links and
        releases the old handles."""
        timeout = timeout_s if timeout_s is not None else self.config.handshake_timeout_s
        deadline = time.monotonic() + timeout
        try:
            return self._connect(
                engine_id, None if ports is None else dict(ports), mode, compat, deadline, timeout
            )
        except (AdapterError, KvgeomError):
            raise
        except Exception as exc:  # anything else a hostile payload provokes is still a typed refusal
            raise ProtocolError(
                f"handshake with {engine_id} refused: {type(exc).__name__}: {str(exc)[:200]}",
                stage="handshake",
                peer=engine_id,
            ) from exc

    def _left(self, deadline: float, timeout: float, what: str, engine_id: str) -> float:
        left = deadline - time.monotonic()
        if left <= 0:
            raise HandshakeTimeout(
                f"handshake with {engine_id} did not finish within {timeout:.3g}s ({what})",
                stage="handshake",
                peer=engine_id,
            )
        return left

    def _addr(self, value: Any) -> tuple[str, int]:
        if isinstance(value, int) and not isinstance(value, bool):
            return self.host, value
        host, port = value
        return str(host), int(port)

    def _connect(
        self,
        engine_id: str,
        ports: dict[int, Any] | None,
        mode: str,
        compat: str,
        deadline: float,
        timeout: float,
    ) -> Pairing:
        payloads, addrs, via = self._fetch_payloads(engine_id, ports, deadline, timeout)
        cards = self._peer_cards(engine_id, payloads, addrs)
        self._left(deadline, timeout, "checking cards", engine_id)
        try:
            pairing = Pairing.create(self.card, cards, mode=mode, compat=compat)
        except KvgeomError as exc:
            self.rejected[engine_id] = str(exc)
            raise
        self._drop_engine(engine_id)
        links = self._link_ranks(engine_id, pairing, payloads, addrs, cards, via, (deadline, timeout))
        for r, link in links.items():
            self._agents[(engine_id, r)] = link.agent
            self._watch[(engine_id, r)] = (link.host, link.port)
            self._know_incarnation((engine_id, r), payloads[r])
        self.pairings[engine_id], self.links[engine_id] = pairing, links
        self.rejected.pop(engine_id, None)
        return pairing

    def _fetch_payloads(
        self, engine_id: str, ports: dict[int, Any] | None, deadline: float, timeout: float
    ) -> tuple[dict[int, dict[str, Any]], dict[int, tuple[str, int]], str]:
        """Every rank's payload, its side channel's address, and where they came from (etcd without
        ``ports``, else each rank's side channel), within the deadline."""
        payloads: dict[int, dict[str, Any]] = {}
        if ports is None:
            if self.directory is None:
                raise ValueError(
                    f"connect({engine_id!r}): no side-channel ports given and discovery is "
                    f"{self.config.discovery!r}, not 'etcd'"
                )
            self._left(deadline, timeout, "reading etcd", engine_id)
            payloads = self.directory.engine(engine_id, deadline)
            addrs = {r: (p["sidechannel"][0], p["sidechannel"][1]) for r, p in payloads.items()}
            return payloads, addrs, "etcd"
        addrs = {int(r): self._addr(v) for r, v in ports.items()}
        for r, (host, port) in addrs.items():
            left = self._left(deadline, timeout, f"fetching rank {r}", engine_id)
            payloads[r] = fetch(
                host,
                port,
                self.payload(),
                timeout_s=left,
                auth=self.auth,
                max_bytes=self.config.max_message_bytes,
            )
        return payloads, addrs, "sidechannel"

    def _peer_cards(
        self, engine_id: str, payloads: Mapping[int, Mapping[str, Any]], addrs: Mapping[int, tuple[str, int]]
    ) -> dict[int, GeometryCard]:
        """The ranks' cards from their payloads, checked: the identity each answers as, then the engine's
        cards parsed at once (``GeometryCard.from_json_many``: what its ranks share is parsed and checked
        once; limits and consistency), then each card's identity, regions and agent name."""
        for r, p in payloads.items():
            if p["engine_id"] != engine_id or p["rank"] != r:
                where = f"{engine_id} rank {r} ({addrs[r][0]}:{addrs[r][1]})"
                raise ProtocolError(
                    f"{where} answered as engine {p['engine_id']!r} rank {p['rank']}",
                    stage="handshake",
                    peer=where,
                )
        try:
            parsed = GeometryCard.from_json_many([p["card"] for p in payloads.values()], self.card_limits)
        except KvgeomError as exc:
            self.rejected[engine_id] = str(exc)
            raise
        return {
            r: self._peer_card(engine_id, r, p, addrs[r], card)
            for (r, p), card in zip(payloads.items(), parsed)
        }

    def _peer_card(
        self, engine_id: str, r: int, p: Mapping[str, Any], addr: tuple[str, int], card: GeometryCard
    ) -> GeometryCard:
        """Rank ``r``'s parsed card, checked: its identity and regions, and an agent name no other rank of
        ours uses."""
        where = f"{engine_id} rank {r} ({addr[0]}:{addr[1]})"
        if card.engine_id != engine_id or card.engine.tp_rank != r:
            raise ProtocolError(
                f"{where} sent the card of engine {card.engine_id!r} rank {card.engine.tp_rank}",
                stage="handshake",
                peer=where,
            )
        self._check_regions(card, p["regions"], where)
        owner = next(
            (k for k, a in self._agents.items() if a == p["agent_name"] and k != (engine_id, r)), None
        )
        if owner is not None:
            raise ProtocolError(
                f"{where} uses agent name {p['agent_name']!r}, which belongs to engine "
                f"{owner[0]!r} rank {owner[1]}",
                stage="handshake",
                peer=where,
            )
        return card

    def _link_ranks(
        self,
        engine_id: str,
        pairing: Pairing,
        payloads: Mapping[int, Mapping[str, Any]],
        addrs: Mapping[int, tuple[str, int]],
        cards: Mapping[int, GeometryCard],
        via: str,
        bound: tuple[float, float],
    ) -> dict[int, PeerLink]:
        """A link (its agent added, its regions checked against its NIXL metadata, its table prepared) to
        every rank the pairing reads or writes; on any failure, everything added here is released."""
        links: dict[int, PeerLink] = {}
        added: list[str] = []
        try:
            for r in pairing.targets:
                p = payloads[r]
                agent = p["agent_name"]
                if agent not in self.ep.peers:
                    added.append(agent)
                self.ep.add_peer(agent, p["agent_metadata"])
                link = PeerLink(
                    r,
                    addrs[r][0],
                    addrs[r][1],
                    agent,
                    p["generation"],
                    cards[r],
                    tuple(x[0] for x in p["regions"]),
                    p["device_id"],
                    via=via,
                )
                self._check_registered(link, p["regions"], f"{engine_id} rank {r}")
                link.prepped = self.ep.prep_remote(
                    agent, pairing.remote_table(r).bind_strided(link.bases, link.device), self.mem_type
                )
                links[r] = link
                self._left(*bound, "preparing tables", engine_id)
        except BaseException:
            for link in links.values():
                if link.prepped is not None:
                    link.prepped.release()
            for agent in added:
                try:
                    self.ep.remove_peer(agent)
                except AdapterError:
                    pass
            raise
        return links

    def _check_regions(self, card: GeometryCard, regions: list[list[int]], where: str) -> None:
        """The card's regions (count, sizes) are the advertised ones, and no two overlap."""
        want = [r.nbytes for r in card.geometry.regions]
        if len(regions) != len(want):
            raise ProtocolError(
                f"{where} advertises {len(regions)} regions, its card has {len(want)}",
                stage="handshake",
                peer=where,
            )
        for i, (n_card, (_, n_adv, _)) in enumerate(zip(want, regions)):
            if n_adv != n_card:
                raise ProtocolError(
                    f"{where} region {i}: advertised {n_adv} bytes, its card implies {n_card}",
                    stage="handshake",
                    peer=where,
                )
        spans = sorted((a, a + n, i) for i, (a, n, _) in enumerate(regions))
        for (a0, e0, i0), (a1, _, i1) in zip(spans, spans[1:]):
            if a1 < e0:
                raise ProtocolError(
                    f"{where} regions {i0} and {i1} overlap ([{a0:#x}, {e0:#x}) and {a1:#x})",
                    stage="handshake",
                    peer=where,
                )

    def _check_registered(self, link: PeerLink, regions: list[list[int]], where: str) -> None:
        """Every advertised region lies inside what the peer's NIXL metadata registers (prep checks it)."""
        descs = np.asarray(regions, dtype=np.uint64).reshape(-1, 3)
        try:
            probe = self.ep.prep_remote(link.agent, descs, self.mem_type)
        except TransferError as exc:
            raise ProtocolError(
                f"{where}: its card's regions are not all registered in its NIXL metadata ({exc.status})",
                stage="handshake",
                peer=where,
            ) from exc
        probe.release()

    def _drop_engine(self, engine_id: str) -> None:
        """Release what a previous connection to ``engine_id`` prepared (reconnecting must not leak)."""
        for link in self.links.pop(engine_id, {}).values():
            if link.prepped is not None and not any(x.live for x in self.ep.live_transfers(link.agent)):
                link.prepped.release()
            session = self._sessions.pop((link.host, link.port), None)
            if session is not None:
                session.close()
        for key in [k for k in self._local if k[0] == engine_id]:
            handle = self._local.pop(key)
            if not self.ep.live_transfers():
                handle.release()
        self.pairings.pop(engine_id, None)

    def check_peers(self, mode: str = "pull", compat: str = "kvgeom") -> dict[str, str]:
        """Validate the cards of every peer that handshook with us (the other side's checks, run here
        too): ``{agent name: error}`` for each refused one. Both sides reach the same verdict."""
        out = {}
        seen = dict(self.server.peers())
        for ranks in self._watched.values():
            seen.update({p["agent_name"]: p for p in ranks.values()})
        for name, payload in seen.items():
            try:
                peer = GeometryCard.from_json(payload["card"], self.card_limits)
                if mode == "pull":  # the peer (D) reads us (P): check from its side
                    check_pair(peer.geometry, self.card.geometry, "pull", compat)
                else:
                    check_pair(self.card.geometry, peer.geometry, "push", compat)
            except KvgeomError as exc:
                out[name] = str(exc)
        self.rejected.update(out)
        return out

    def watch(
        self, engine_id: str, ports: Mapping[int, Any] | None = None, timeout_s: float | None = None
    ) -> None:
        """Remember the side channels of an engine that talks to us without our connecting to it (the
        producers that write to us in push; with etcd, also the consumers that read from us in pull), so
        that the fence can learn when one of its ranks is gone. Without ``ports`` (etcd) its ranks'
        records are read and kept: their agent names identify the senders of notices, and
        :meth:`check_peers` checks their cards."""
        if ports is not None:
            for r, v in ports.items():
                self._watch[(engine_id, int(r))] = self._addr(v)
            return
        if self.directory is None:
            raise ValueError(f"watch({engine_id!r}): no ports given and discovery is not 'etcd'")
        t = timeout_s if timeout_s is not None else self.config.handshake_timeout_s
        payloads = self.directory.engine(engine_id, time.monotonic() + t)
        self._watched[engine_id] = payloads
        for r, p in payloads.items():
            self._watch[(engine_id, r)] = (p["sidechannel"][0], p["sidechannel"][1])
            self._know_incarnation((engine_id, r), p)

    def _know_incarnation(self, key: tuple[str, int], payload: Mapping[str, Any]) -> None:
        """Remember the incarnation a peer's sealed payload names (16 bytes in hex; older peers' shorter
        ones are not a server incarnation and are not kept)."""
        try:
            inc = bytes.fromhex(str(payload.get("incarnation", "")))
        except ValueError:
            return
        if len(inc) == 16:
            self._incarnations[key] = inc
