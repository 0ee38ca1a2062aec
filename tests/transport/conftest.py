"""tests/transport: the end-to-end and fault cases of kvgeom's plans, written once and run over both
transports (``transport``: ``nixl``, kvgeom_nixl over UCX's TCP; ``mooncake``, kvgeom_mooncake over
Mooncake's transfer engine), every rank a separate process. A transport that does not load here fails its
cases with the install line; they are not skipped (docs/testing.md)."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

_ROOT = Path(__file__).resolve().parents[2]
for _p in (str(Path(__file__).resolve().parent), str(_ROOT / "adapters"), str(_ROOT)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

from _transport_pair import TransportPair  # noqa: E402


def _loads(transport: str) -> str | None:
    """Why ``transport`` cannot run here (``None``: it can)."""
    if transport == "mooncake":
        from kvgeom_mooncake import available

        return available()
    try:
        import nixl  # noqa: F401
        import torch  # noqa: F401
    except ImportError as exc:
        return f"the NIXL transport needs nixl and torch ({exc}): pip install -c constraints-dev.txt -e '.[nixl]'"
    return None


@pytest.fixture(
    params=[
        pytest.param("nixl", marks=pytest.mark.nixl),
        pytest.param("mooncake", marks=pytest.mark.mooncake),
    ]
)
def transport(request: pytest.FixtureRequest) -> str:
    why = _loads(request.param)
    if why is not None:
        pytest.fail(why, pytrace=False)
    return request.param


@pytest.fixture
def make_pair(transport: str) -> Iterator[Callable[..., TransportPair]]:
    """``make_pair(scenario, max_tokens, hosts=None)``: a :class:`TransportPair` over the test's
    transport; every pair it made is ended after the test."""
    made: list[TransportPair] = []

    def make(scenario: dict, max_tokens: int, hosts: dict | None = None) -> TransportPair:
        made.append(TransportPair(transport, scenario, max_tokens, hosts))
        return made[-1]

    try:
        yield make
    finally:
        for p in made:
            p.end()
