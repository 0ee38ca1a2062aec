"""Issue 22's side-channel attacks, measured (the rows of docs/reliability.md's fault matrix for them).

    .venv/bin/python bench/probe_exposure.py [--trials 10] [--flood-trials 3]

* replay to another server: a genuine ``exchange`` captured on its way to server A, replayed to server B
  that shares the secret (and to A on a new connection); outcome, time from sending the replay to the
  typed refusal, payloads B kept (bytes damaged: a stale payload kept as a peer);
* replay after a restart: the same, to a new server on A's port;
* flood and slow drip: a rank (real NIXL, its own process) under ``test_exposure._Attack`` (a 4 s flood of
  wrong-secret connections announcing 1 MiB bodies, 200 reconnecting slow drips), while this process runs
  authenticated generation queries (1 s deadline) and fetches (2 s deadline): how many succeed, the worst
  latency, the server's peak buffered bytes and peak RSS growth;
* listeners: the rank's listening sockets outside the configured interface (loopback).

Run from a checkout with the dev venv (it imports the test helpers).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for p in (ROOT, ROOT / "adapters", ROOT / "tests" / "adapter"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

from kvgeom_nixl import ReplayError, SideChannelServer, seal_payload  # noqa: E402
from kvgeom_nixl.sidechannel import _check_reply  # noqa: E402
from kvgeom_nixl.wire import PREAMBLE_BYTES, parse_preamble  # noqa: E402
from test_sidechannel import AUTH, HOST, _capture, _payload, _replay  # noqa: E402


def _refusal(port: int, data: bytes) -> tuple[str, float]:
    t0 = time.monotonic()
    tag, body = _replay(port, data)
    try:
        _check_reply(f"{HOST}:{port}", parse_preamble(data[:PREAMBLE_BYTES]).nonce_hex, tag, body, AUTH)
        outcome = "accepted"
    except ReplayError as e:
        outcome = f"ReplayError({e.field})"
    except Exception as e:  # noqa: BLE001 - what the probe reports
        outcome = type(e).__name__
    return outcome, time.monotonic() - t0


def _exchange(port: int) -> bytes:
    data, reply = _capture(port, "exchange", {"payload": seal_payload(_payload("D"), AUTH)})
    assert reply["ok"] is True, reply
    return data


def replay_other(trials: int) -> tuple[Counter, list[float], int]:
    out, times, kept = Counter(), [], 0
    for _ in range(trials):
        with (
            SideChannelServer(HOST, 0, _payload("A"), auth=AUTH) as a,
            SideChannelServer(HOST, 0, _payload("B"), auth=AUTH) as b,
        ):
            data = _exchange(a.port)
            for port in (b.port, a.port):
                outcome, dt = _refusal(port, data)
                out[outcome] += 1
                times.append(dt)
            kept += len(b.peers())
    return out, times, kept


def replay_restart(trials: int) -> tuple[Counter, list[float], int]:
    out, times, kept = Counter(), [], 0
    for _ in range(trials):
        old = SideChannelServer(HOST, 0, _payload("A"), auth=AUTH).start()
        try:
            data = _exchange(old.port)
        finally:
            old.close()
        with SideChannelServer(HOST, old.port, _payload("A"), auth=AUTH) as new:
            outcome, dt = _refusal(new.port, data)
            out[outcome] += 1
            times.append(dt)
            kept += len(new.peers())
    return out, times, kept


def _row(name: str, trials: int, out: Counter, times: list[float], damaged: int) -> str:
    outcome = ", ".join(f"{k} {v}" for k, v in sorted(out.items()))
    med, top = statistics.median(times), max(times)
    return f"| {name} | {trials} | {outcome} | {med:.4f} (max {top:.4f}) | - | - | {damaged} |"


def flood(trials: int) -> list[str]:
    import ipaddress

    from _exposed import exposed_rank  # noqa: F401  (spawned by _rank)
    from _inproc import AUTH as RANK_AUTH  # the rank's secret
    from kvgeom_lab import ProcGroup
    from kvgeom_nixl import fetch, query_generation
    from test_exposure import _Attack, _event, _rank

    rows = []
    for _ in range(trials):
        with ProcGroup() as g:
            ready, (events, inbox) = _rank(g, "rank")
            port, ok, failed, worst = ready["port"], 0, Counter(), 0.0
            with _Attack(port) as attack:
                time.sleep(0.5)
                t_end = time.monotonic() + 3.5
                while time.monotonic() < t_end:
                    for call in (
                        lambda port=port: query_generation(HOST, port, timeout_s=1.0, auth=RANK_AUTH),
                        lambda port=port: fetch(HOST, port, timeout_s=2.0, auth=RANK_AUTH),
                    ):
                        t0 = time.monotonic()
                        try:
                            call()
                            ok += 1
                        except Exception as e:  # noqa: BLE001 - what the probe reports
                            failed[type(e).__name__] += 1
                        worst = max(worst, time.monotonic() - t0)
                    time.sleep(0.1)
                inbox.put(("parent", "stats", None))
                stats = _event(g, events, "stats")
            inbox.put(("parent", "exit", None))
            g.collect(30.0)
        outside = [a for a, _ in ready["listening"] if not ipaddress.ip_address(a).is_loopback]
        rows.append(
            f"ok {ok}/{ok + sum(failed.values())} {dict(failed) or ''} worst {worst * 1e3:.0f} ms; "
            f"flood {attack.flooded} conns, drips cut {stats['dropped_slow']}; peak pending "
            f"{stats['peak_pending']} conns / {stats['peak_pending_bytes']} B; peak RSS +"
            f"{stats['VmHWM'] - ready['VmHWM']} KiB; listeners {len(ready['listening'])}, outside lo {len(outside)}"
        )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=10)
    ap.add_argument("--flood-trials", type=int, default=3)
    args = ap.parse_args()
    out, times, kept = replay_other(args.trials)
    print(_row("request replayed to another server / same server", 2 * args.trials, out, times, kept))
    out, times, kept = replay_restart(args.trials)
    print(_row("request replayed after a server restart", args.trials, out, times, kept))
    for line in flood(args.flood_trials):
        print("flood + 200 slow drips:", line)


if __name__ == "__main__":
    main()
