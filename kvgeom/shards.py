"""Where this rank's slice of each SSM piece lies in a remote rank's page, from the sharding rule alone.

vLLM scales every conv piece by the TP ratio (``remote_conv_offsets``), which is wrong when a piece is
replicated across ranks (Mamba2 with ``n_groups < TP``: every rank holds the whole B and C; vLLM issue
55208). kvgeom derives each piece's offsets from :class:`~kvgeom.spec.Shard` instead:

* one source (D_TP >= P_TP): this rank's units ``[lu0, lu0 + ln)`` lie inside the source's
  ``[ru0, ru0 + rn)``; read ``ln * unit_bytes`` at ``(lu0 - ru0) * unit_bytes`` in the remote piece;
* ``n`` sources (P_TP > D_TP): source ``p`` fills local chunk ``p`` (bytes ``[p*c, (p+1)*c)`` of the
  local piece, ``c = local piece / n``), read at ``lu0 * unit_bytes + p*c - ru0(p) * unit_bytes`` in the
  source's piece. A replicated piece is read in ``n`` chunks from ``n`` identical copies.

Offsets are relative to the start of the state page: conv pieces first, then the temporal state.
"""

from __future__ import annotations

from .dtypes import dtype_size
from .errors import UnsupportedError
from .spec import MambaSpec, Shard

__all__ = ["ssm_piece_reads"]


def _piece_read(shard: Shard, elem_bytes: int, local_rank: int, local_tp: int, remote_rank: int,
                remote_tp: int, source_index: int, num_sources: int, name: str) -> tuple[int, int]:
    ub = shard.unit_elems * elem_bytes
    lu0, ln = shard.first_unit(local_rank, local_tp), shard.units_per_rank(local_tp)
    ru0, rn = shard.first_unit(remote_rank, remote_tp), shard.units_per_rank(remote_tp)
    local_bytes = ln * ub
    if local_bytes % num_sources:
        raise UnsupportedError(name, f"{local_bytes} B cannot be gathered in {num_sources} equal chunks",
                               value=local_bytes, expected=num_sources)
    chunk = local_bytes // num_sources
    offset = lu0 * ub + source_index * chunk - ru0 * ub
    if offset < 0 or offset + chunk > rn * ub:
        raise UnsupportedError(name, f"local units [{lu0}, {lu0 + ln}) are not held by remote rank {remote_rank} "
                               f"(units [{ru0}, {ru0 + rn}))", local=(lu0, ln), remote=(ru0, rn))
    return offset, chunk


def ssm_piece_reads(spec: MambaSpec, local_rank: int, local_tp: int, remote_rank: int, remote_tp: int,
                    source_index: int, num_sources: int) -> tuple[tuple[int, int], ...]:
    """``(offset, length)`` in remote rank ``remote_rank``'s state page of what it sends this rank, for
    every conv piece then the temporal state. ``source_index``/``num_sources``: this source's position
    among the ranks the local rank gathers the state from (0 / 1 when there is one)."""
    row = spec.conv_rows * dtype_size(spec.conv_dtype)
    out, base = [], 0
    for name, piece in zip(spec.piece_names, spec.conv_pieces):
        off, n = _piece_read(piece, row, local_rank, local_tp, remote_rank, remote_tp, source_index, num_sources,
                             f"conv piece {name}")
        out.append((base + off, n))
        base += piece.units_per_rank(remote_tp) * piece.unit_elems * row
    off, n = _piece_read(spec.temporal, dtype_size(spec.ssm_dtype), local_rank, local_tp, remote_rank, remote_tp,
                         source_index, num_sources, "temporal state")
    out.append((base + off, n))
    return tuple(out)
