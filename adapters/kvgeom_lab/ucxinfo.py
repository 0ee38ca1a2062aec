"""Which transport UCX chose, read from UCX's own report rather than from the configuration we gave it.

With ``UCX_PROTO_INFO=y`` UCX prints, for every endpoint configuration it builds, one table per operation:
the endpoint's kind (``self``, ``intra-node`` for a peer on the same machine, ``inter-node`` for one
reached over a network), the operation (``remote memory read by ucp_get*...`` is what a NIXL READ
becomes, ``remote memory write by ucp_put*...`` a WRITE) and, per message-size range, the protocol and
the transport/device that carries it (``tcp/kvh0``, ``cma/memory``, ``sysv/memory``, ...).
``UCX_LOG_FILE=<path>.%p`` sends that report to a file per process. :func:`proto_tables` parses it.

Measured with NIXL 1.5.1's UCX between two network namespaces of one machine: without ``UCX_TLS`` UCX
sees the same machine (same boot id) and moves the bytes with CMA (``intra-node``, ``cma/memory``), not
over the veth; with ``UCX_TLS=tcp`` and ``UCX_NET_DEVICES=kvh0`` the peer is ``inter-node`` and every
range of a READ is ``tcp/kvh0`` ("software emulation": UCX's TCP transport has no RMA, the target's
worker serves the get, which is why a target must drive progress).
"""

from __future__ import annotations

import glob
import re
from dataclasses import dataclass

__all__ = ["ProtoTable", "proto_tables", "read_logs", "transports"]

_PREFIX = re.compile(r"^\[[^\]]*\]\s+\[[^\]]*\]\s+")
_TITLE = re.compile(r"^\|\s*(\S+)\s+(self|intra-node|inter-node)\s+cfg#(\d+)\s*\|$")
_ROW = re.compile(r"^\|\s*([^|]+?)\s*\|\s*([^|]+?)\s*\|\s*([^|]+?)\s*\|$")


@dataclass(frozen=True)
class ProtoTable:
    """One table of UCX's protocol report: ``worker`` (the UCX worker's name: NIXL's agent name),
    ``kind`` (``self`` | ``intra-node`` | ``inter-node``), ``operation`` and ``rows`` of
    ``(size range, protocol, transport/device)``."""

    worker: str
    kind: str
    operation: str
    rows: tuple[tuple[str, str, str], ...]

    @property
    def transports(self) -> set[str]:
        return {cfg for _, _, cfg in self.rows}


def proto_tables(text: str) -> list[ProtoTable]:
    """Every table in a UCX log (``UCX_PROTO_INFO=y``)."""
    lines = [_PREFIX.sub("", ln).strip() for ln in text.splitlines()]
    out: list[ProtoTable] = []
    i = 0
    while i < len(lines):
        m = _TITLE.match(lines[i])
        if not m or i + 1 >= len(lines):
            i += 1
            continue
        op = lines[i + 1].strip("|").strip()
        rows: list[tuple[str, str, str]] = []
        j = i + 2
        header_seen = False
        while j < len(lines) and (lines[j].startswith("|") or lines[j].startswith("+")):
            row = _ROW.match(lines[j])
            if row and not _TITLE.match(lines[j]):
                cells = tuple(c.strip() for c in row.groups())
                if cells[0] == "Range":
                    header_seen = True
                elif header_seen:
                    rows.append(cells)  # type: ignore[arg-type]
            j += 1
            if j < len(lines) and _TITLE.match(lines[j]):
                break
        out.append(ProtoTable(m.group(1), m.group(2), op, tuple(rows)))
        i = j
    return out


def read_logs(pattern: str) -> str:
    """The concatenated text of every file matching ``pattern`` (e.g. ``<dir>/ucx-decode.*.log``)."""
    parts = []
    for path in sorted(glob.glob(pattern)):
        with open(path, errors="replace") as f:
            parts.append(f.read())
    return "\n".join(parts)


def transports(text: str, operation: str, kind: str | None = None) -> dict[str, set[str]]:
    """``{kind: {transport/device, ...}}`` of the tables whose operation starts with ``operation`` (e.g.
    ``"remote memory read"``), restricted to ``kind`` if given."""
    out: dict[str, set[str]] = {}
    for t in proto_tables(text):
        if t.operation.startswith(operation) and (kind is None or t.kind == kind):
            out.setdefault(t.kind, set()).update(t.transports)
    return out
