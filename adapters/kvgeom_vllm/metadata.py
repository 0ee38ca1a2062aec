"""vLLM's NIXL agent metadata with kvgeom's geometry card, and the counters of ranks that registered
without one (the test report's).

The lowest layer of the handshake: the registration answer (:mod:`kvgeom_vllm.answers.registration`)
builds this metadata and the handshake (:mod:`kvgeom_vllm.handshake`) reads it, neither importing the other.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, fields
from typing import Any

__all__ = ["CARDLESS", "CARDLESS_EXAMPLE", "KvgeomAgentMetadata", "PlainAgentMetadata", "plain_fields"]

#: why ranks registered without a card, by the field kvgeom refused (for the test report)
CARDLESS: Counter[str] = Counter()
#: one example refusal per field (for the test report)
CARDLESS_EXAMPLE: dict[str, str] = {}


def _metadata_module() -> Any:
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import metadata

    return metadata


_META = _metadata_module()
PlainAgentMetadata = _META.NixlAgentMetadata


@dataclass
class KvgeomAgentMetadata(PlainAgentMetadata):
    """vLLM's agent metadata plus this rank's geometry card (JSON; ``None`` from plain vLLM peers)."""

    kvgeom_card: str | None = None


def plain_fields() -> tuple[str, ...]:
    return tuple(f.name for f in fields(PlainAgentMetadata))
