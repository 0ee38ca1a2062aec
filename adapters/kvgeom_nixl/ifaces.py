"""Which network interface a rank's UCX may use, derived from the address its side channel binds.

UCX's TCP transport listens on every usable interface unless ``UCX_NET_DEVICES`` names some (measured
with NIXL 1.5.1: one listener per agent on ``127.0.0.1`` and one on the external ``eth0`` address, in a
run that only ever talks over loopback). :func:`ucx_net_devices` turns ``TransportConfig.net_devices``
and the rank's host into the value of ``UCX_NET_DEVICES`` for its agent; :func:`with_env` sets it only
while the agent is created (UCX reads it when the backend starts).

The environment is process-wide: :func:`with_env` holds one process-wide lock for its whole block, and
every agent is created inside it (:class:`~kvgeom_nixl.agent.Endpoint`), with or without a value, so two
threads creating agents at once never see each other's ``UCX_NET_DEVICES``.

An agent made without a host (an :class:`~kvgeom_nixl.agent.Endpoint` used on its own) gets loopback
only under ``"auto"``: nothing was configured, so nothing is exposed; ``net_devices="all"``, a device
list, ``host="0.0.0.0"`` or the operator's ``UCX_NET_DEVICES`` open more.
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import os
import socket
import struct
import threading
from collections.abc import Iterator, Mapping

from .errors import AdapterError

__all__ = ["interfaces", "interface_of", "ucx_net_devices", "with_env"]

_SIOCGIFADDR = 0x8915
_SIOCGIFNETMASK = 0x891B
_ANY = ("", "0.0.0.0")
LOOPBACK = "127.0.0.1"  # where an agent without a host listens under "auto"
_ENV_LOCK = threading.RLock()  # held while an agent is created: the environment is the process's


def _ioctl_addr(sock: socket.socket, name: str, request: int) -> str | None:
    try:
        raw = fcntl.ioctl(sock.fileno(), request, struct.pack("256s", name.encode()[:15]))
    except OSError:
        return None  # no IPv4 address on this interface
    return socket.inet_ntoa(raw[20:24])


def interfaces() -> dict[str, ipaddress.IPv4Interface]:
    """``{name: address/netmask}`` of this network namespace's interfaces that have an IPv4 address."""
    out: dict[str, ipaddress.IPv4Interface] = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            addr = _ioctl_addr(s, name, _SIOCGIFADDR)
            mask = _ioctl_addr(s, name, _SIOCGIFNETMASK)
            if addr is not None and mask is not None:
                out[name] = ipaddress.IPv4Interface(f"{addr}/{mask}")
    return out


def interface_of(host: str) -> str | None:
    """The interface that holds ``host`` (an IPv4 address or a name): the one with exactly that address,
    else the one whose network contains it (``127.0.0.2`` is on ``lo``); ``None`` if none does."""
    addr = ipaddress.IPv4Address(socket.gethostbyname(host))
    found = interfaces()
    for name, iface in found.items():
        if iface.ip == addr:
            return name
    for name, iface in found.items():
        if addr in iface.network:
            return name
    return None


def ucx_net_devices(setting: str, host: str | None, env: Mapping[str, str] | None = None) -> str | None:
    """The ``UCX_NET_DEVICES`` an agent gets (``None``: leave the environment as it is).

    ``setting`` is ``TransportConfig.net_devices``: ``"all"`` (UCX's default: every interface), a UCX
    device list (used as given), or ``"auto"``: the operator's ``UCX_NET_DEVICES`` if set, else the
    interface holding ``host`` (every interface for ``0.0.0.0``; the loopback interface for no host)."""
    env = os.environ if env is None else env
    if setting == "all":
        return None
    if setting != "auto":
        return setting
    if "UCX_NET_DEVICES" in env or host in _ANY:
        return None
    if host is None:
        host = LOOPBACK
    try:
        name = interface_of(host)
    except (OSError, ValueError) as e:
        raise AdapterError(
            f"net_devices='auto': cannot resolve host {host!r} to an IPv4 address ({e})", stage="config"
        ) from None
    if name is None:
        raise AdapterError(
            f"net_devices='auto': no interface holds host {host!r} (interfaces: {sorted(interfaces())}); "
            "set TransportConfig.net_devices or UCX_NET_DEVICES",
            stage="config",
        )
    return name


@contextlib.contextmanager
def with_env(name: str, value: str | None) -> Iterator[None]:
    """``os.environ[name] = value`` inside the block (nothing changes for ``None``), restored after; the
    block runs under the process-wide lock either way, so a block without a value never sees another
    thread's."""
    with _ENV_LOCK:
        if value is None:
            yield
            return
        old = os.environ.get(name)
        os.environ[name] = value
        try:
            yield
        finally:
            if old is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = old
