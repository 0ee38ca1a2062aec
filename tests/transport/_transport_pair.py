"""The one interface the transport tests are written against: :class:`TransportPair`, a P/D pair of rank
processes (:class:`_transport_ranks.Pair`) of either transport with the same methods. Where the two
transports differ by design, the difference lives here, named: how a producer is stalled, how a push
consumer learns that a writer is gone, and the error each reports (:data:`FAILURES`)."""

from __future__ import annotations

import signal
import threading
import time
from typing import Any

from _transport_ranks import STEP_S, Blocks, Pair, wait_dead

# The typed failure each transport reports, as (error type, status) where a status says more:
#   killed: a producer killed with its transfer in flight;  late: a transfer still running at the deadline;
#   notif: push, a writer's notice missing at the deadline;  held: ids of an attempt still quarantined.
FAILURES: dict[str, dict[str, set[tuple[str, Any]]]] = {
    "mooncake": {
        "killed": {("TransferFailed", None)},  # one status per batch (docs/mooncake.md)
        "late": {("TransferTimeout", "PENDING")},
        "notif": {("NotifTimeout", "TIMEOUT")},
        "held": {("QuarantinedBlockError", None)},
    },
    "nixl": {
        "killed": {("PeerGone", "NIXL_ERR_REMOTE_DISCONNECT")},
        "late": {("TransferError", "TIMEOUT")},
        "notif": {("NotifTimeout", "TIMEOUT")},
        "held": {("QuarantinedBlockError", None)},
    },
}


class Failed(AssertionError):
    """A rank answered a command with an error: its type name and fields (``field``, ``stage``,
    ``status``)."""

    def __init__(self, name: str, fields: dict, message: str, tb: str) -> None:
        super().__init__(f"{name}: {message}\n{tb}")
        self.name, self.fields = name, fields

    def kind(self, transport: str) -> str | None:
        """Which of :data:`FAILURES` this is for ``transport`` (``None``: none of them)."""
        for kind, ways in FAILURES[transport].items():
            for name, status in ways:
                if self.name == name and (status is None or self.fields.get("status") == status):
                    return kind
        return None


class TransportPair:
    """P TP ranks and D ranks of ``scenario`` over ``transport`` (``nixl`` | ``mooncake``), each rank its
    own process, with requests, transfers, faults and the byte check as methods. Pull: D connects to P;
    push: D watches P and P connects to D (:meth:`connect`)."""

    def __init__(
        self, transport: str, scenario: dict, max_tokens: int, hosts: dict | None = None, seed: int = 7
    ) -> None:
        self.transport = transport
        self.pair = Pair(scenario, max_tokens, hosts, transport)
        self.sc = self.pair.sc
        self.mode = self.sc.mode
        self.p, self.d = self.pair.p, self.pair.d
        self.blocks = Blocks(self.sc, seed)
        self._salt = 0
        self._timers: list[threading.Timer] = []

    def end(self) -> None:
        for t in self._timers:
            t.cancel()
        self.pair.end()

    def served_at(self, side: str = "prefill") -> set[str]:
        """The addresses ``side``'s ranks serve on (their handshake payloads')."""
        if self.transport == "mooncake":
            return {str(a["session"]).rsplit(":", 1)[0] for a in self.pair.payloads(side).values()}
        return {str(a[0]) for a in self.pair.payloads(side).values()}

    # -- requests --------------------------------------------------------------------------------------
    def requests(self, tokens: list[int], prefix: int = 0) -> list[dict]:
        """One request per entry, with disjoint blocks on both sides; ``prefix``: D already holds that many
        of its blocks (a prefix hit: D's lists skip them, the bytes land after them)."""
        out = []
        for n in tokens:
            out.append(
                {
                    "id": f"r{self._salt}",
                    "tokens": n,
                    "salt": self._salt,
                    "p_ids": self.blocks.take("prefill", n),
                    "d_ids": self.blocks.take("decode", n, skip=prefix),
                    "first": prefix * self.sc.decode.block_size,
                    "ok": True,
                }
            )
            self._salt += 1
        return out

    def fill(self, reqs: list[dict]) -> None:
        for p in self.p:
            assert p.call("fill", reqs) > 0

    def connect(self) -> None:
        if self.mode == "pull":
            for d in self.d:
                d.call("connect", {"engine": "prefill", "addrs": self.pair.payloads("prefill")})
            return
        for d in self.d:
            d.call("watch", {"engine": "prefill", "addrs": self.pair.payloads("prefill")})
        for p in self.p:
            p.call("connect", {"engine": "decode", "addrs": self.pair.payloads("decode")})

    # -- transfers -------------------------------------------------------------------------------------
    @staticmethod
    def _outcome(rank: Any, timeout: float = STEP_S) -> dict:
        got = rank.answer(timeout)
        if got[0] != "ok":
            raise Failed(*got[1:])
        return got[1]

    def start_pull(self, r: dict, d: int = 0, **kw: Any) -> None:
        self.d[d].send(
            "pull",
            {
                "engine_id": "prefill",
                "local_ids": r["d_ids"],
                "remote_ids": r["p_ids"],
                "request_id": r["id"],
                "num_tokens": r["tokens"],
                **kw,
            },
        )

    def outcome(self, d: int = 0, timeout: float = STEP_S) -> dict:
        """D rank ``d``'s answer to its last pull or wait (raises :class:`Failed`)."""
        return self._outcome(self.d[d], timeout)

    def pull(self, r: dict, **kw: Any) -> dict:
        self.start_pull(r, **kw)
        return self.outcome()

    def start_wait(self, r: dict, d: int = 0, **kw: Any) -> None:
        self.d[d].send(
            "wait_received",
            {
                "producer_engine": "prefill",
                "local_ids": r["d_ids"],
                "producer_ids": r["p_ids"],
                "request_id": r["id"],
                "num_tokens": r["tokens"],
                **kw,
            },
        )

    def push_from(self, p: int, r: dict, wait: bool = True, **kw: Any) -> dict | None:
        """P rank ``p`` writes ``r``; its result (``wait=False``: sent only, see :meth:`pushed`)."""
        self.p[p].send(
            "push",
            {
                "engine_id": "decode",
                "local_ids": r["p_ids"],
                "remote_ids": r["d_ids"],
                "request_id": r["id"],
                "num_tokens": r["tokens"],
                **kw,
            },
        )
        return self.pushed(p) if wait else None

    def pushed(self, p: int, timeout: float = STEP_S) -> dict:
        """P rank ``p``'s answer to its last push (raises :class:`Failed`)."""
        return self._outcome(self.p[p], timeout)

    def push(self, r: dict) -> tuple[list[dict], dict]:
        """Push: D waits, every P rank writes; (P ranks' results, D's)."""
        self.start_wait(r)
        pushed = [self.push_from(p, r) for p in range(len(self.p))]
        return pushed, self.outcome()  # type: ignore[return-value]

    # -- faults ----------------------------------------------------------------------------------------
    def stall(self, p: int, seconds: float = 120.0) -> None:
        """P rank ``p`` moves no byte and takes no command for ``seconds`` (or until killed): Mooncake's is
        stopped (SIGSTOP: its engine's threads too; SIGCONT after ``seconds``); NIXL's stops driving NIXL
        (over UCX's TCP a READ then waits) while its side channel still answers (a stopped process's
        would not: D's freshness check, before any READ is posted, would fail instead)."""
        if self.transport == "mooncake":
            self.p[p].signal(signal.SIGSTOP)
            timer = threading.Timer(seconds, self._resume, (p,))
            timer.daemon = True
            timer.start()
            self._timers.append(timer)
        else:
            self.p[p].send("busy", seconds)

    def _resume(self, p: int) -> None:
        try:
            self.p[p].signal(signal.SIGCONT)
        except ProcessLookupError:
            pass  # killed meanwhile

    def kill(self, p: int) -> None:
        self.p[p].signal(signal.SIGKILL)
        wait_dead(self.p[p].proc)
        assert not self.p[p].proc.is_alive()

    # -- the fence -------------------------------------------------------------------------------------
    def quarantined(self, d: int = 0) -> list[list]:
        return self.d[d].call("quarantined")

    def settle(self, d: int = 0) -> list[list]:
        return self.d[d].call("settle")

    def settle_until(self, token: list, bound_s: float = 30.0, d: int = 0) -> list[list]:
        """Settle until ``token`` comes back (bounded); what came back."""
        end, got = time.monotonic() + bound_s, []
        while token not in got and time.monotonic() < end:
            got += self.settle(d)
            time.sleep(0.05)
        return got

    def stats(self, d: int = 0) -> dict:
        """D rank ``d``'s counters (probes refused, unknown, ...): what a failed wait prints."""
        return self.d[d].call("stats")

    def writer_gone(self, token: list, bound_s: float = 30.0) -> list[list]:
        """Push, D: a writer that never wrote is gone; its attempt's blocks come back (Mooncake: the
        deployment releases them; NIXL: the fence sees the writer's side channel refuse, and settles)."""
        end, got = time.monotonic() + bound_s, []
        while token not in got and time.monotonic() < end:
            got += self.d[0].call("writer_gone", {"request_id": token[0], "attempt": token[1]})
            time.sleep(0.05)
        return got

    # -- the bytes -------------------------------------------------------------------------------------
    def verify(self, reqs: list[dict], d: int = 0) -> dict:
        """Every byte of D rank ``d``'s regions: content where a request put it, zero where the plan zeroes
        (and where a failed request's blocks are), poison everywhere else."""
        rep = self.d[d].call("verify", {"requests": reqs}, timeout=120)
        assert rep["mismatches"] == [] and rep["bad"] == 0, rep
        assert rep["checked"] == rep["total"]  # every byte of D's regions, nothing skipped
        return rep
