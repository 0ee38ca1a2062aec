"""Network namespaces as hosts: a small virtual network for running P and D ranks as if on separate
machines, with the faults networks have (a link down, delay and loss, an address that changes).

:class:`VirtualNet` creates one network namespace per host, each with one interface (``kvh0``, its own
IPv4 address) joined through a bridge that lives in a namespace of its own (the *switch*): nothing is
added to the machine's own network. Rank processes enter a host with :func:`enter_netns` (``procs.spawn``
does it for ``netns=...``); tools run there with :meth:`VirtualNet.popen`; the parent talks to a host's
addresses from a thread that entered it (:func:`call_in`). Everything it creates is removed by
:meth:`VirtualNet.close`, which also runs at interpreter exit and on SIGTERM/SIGINT (see
:func:`install_cleanup`); :func:`leftovers` finds what a run that died without cleaning left behind.

Namespaces are isolated networks: the same addresses can be used by two runs at once. Names carry the
creating process's pid (``kvgh-<pid>-<n>-<host>``), which is how leftovers are recognised. Needs root
(``CAP_SYS_ADMIN`` and ``CAP_NET_ADMIN``) and iproute2 (``ip``, ``tc``).

Facts this module relies on (Linux, iproute2 6.1): a thread's network namespace is its own (``setns``
affects only the calling thread), so a helper thread can open sockets inside a host; sysfs shows the
network namespace of whoever mounted it, and UCX enumerates network devices through ``/sys/class/net``,
so a rank entering a host also mounts a private sysfs (in a private mount namespace, as ``ip netns
exec`` does); deleting a namespace deletes the interfaces in it (a veth pair goes with either end).
"""

from __future__ import annotations

import atexit
import ctypes
import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvgeom_nixl.errors import AdapterError

__all__ = [
    "Host",
    "VirtualNet",
    "EtcdServer",
    "enter_netns",
    "call_in",
    "leftovers",
    "remove_leftovers",
    "install_cleanup",
    "measure_capacity",
    "PREFIX",
    "DEVICE",
    "missing_tools",
]

PREFIX = "kvgh"
DEVICE = "kvh0"  # the interface of every host, inside its namespace
_NETNS_DIR = "/var/run/netns"
_CLONE_NEWNET = 0x40000000
_CLONE_NEWNS = 0x00020000
_MS_REC, _MS_SLAVE, _MNT_DETACH = 0x4000, 1 << 19, 2
_NAME = re.compile(rf"^{PREFIX}-(\d+)-(\d+)-([A-Za-z0-9_.]+)$")
_COUNTER = itertools.count(1)


class NetError(AdapterError):
    """A namespace, interface or tool could not be set up or driven."""


def _libc() -> Any:
    return ctypes.CDLL(None, use_errno=True)


def _setns_net(name: str) -> None:
    fd = os.open(os.path.join(_NETNS_DIR, name), os.O_RDONLY | os.O_CLOEXEC)
    try:
        if _libc().setns(fd, _CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise NetError(f"setns into network namespace {name!r} failed: {os.strerror(err)}", stage="netns")
    finally:
        os.close(fd)


def enter_netns(name: str) -> None:
    """Move the calling process into network namespace ``name`` for good, with a private sysfs that shows
    that namespace's interfaces (what ``ip netns exec`` does). Call it first thing in a fresh,
    single-threaded process (a ``spawn`` child): the mount namespace cannot be unshared once threads run."""
    _setns_net(name)
    libc = _libc()
    if libc.unshare(_CLONE_NEWNS) != 0:
        raise NetError(f"unshare(CLONE_NEWNS) failed: {os.strerror(ctypes.get_errno())}", stage="netns")
    if libc.mount(b"none", b"/", None, _MS_REC | _MS_SLAVE, None) != 0:  # our mounts stay ours
        raise NetError(f"making / a slave mount failed: {os.strerror(ctypes.get_errno())}", stage="netns")
    libc.umount2(b"/sys", _MNT_DETACH)
    if libc.mount(b"sysfs", b"/sys", b"sysfs", 0, None) != 0:
        raise NetError(
            f"mounting sysfs for {name!r} failed: {os.strerror(ctypes.get_errno())}", stage="netns"
        )


def call_in(netns: str, fn: Callable[..., Any], *args: Any, timeout_s: float = 30.0, **kwargs: Any) -> Any:
    """Run ``fn(*args, **kwargs)`` in a helper thread that entered network namespace ``netns`` (sockets it
    opens live there; the caller's namespace is untouched). Returns its value or raises its exception;
    :class:`NetError` if it does not finish within ``timeout_s`` (the thread is a daemon)."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            _setns_net(netns)
            box["value"] = fn(*args, **kwargs)
        except BaseException as e:  # handed to the caller
            box["error"] = e

    t = threading.Thread(target=run, name=f"netns:{netns}", daemon=True)
    t.start()
    t.join(timeout_s)
    if t.is_alive():
        raise NetError(f"call in {netns} did not finish within {timeout_s:.3g}s", stage="netns")
    if "error" in box:
        raise box["error"]
    return box.get("value")


def missing_tools() -> list[str]:
    """The programs a virtual network and its tests need that are not installed (``ip``, ``tc``,
    ``ethtool``, ``etcd``, ``iperf3``), plus ``root`` when not running as root."""
    out = [t for t in ("ip", "tc", "ethtool", "etcd", "iperf3") if shutil.which(t) is None]
    if os.geteuid() != 0:
        out.append("root")
    return out


_NETEM: dict[str, bool] = {}


def _has_netem(netns: str) -> bool:
    """Whether the kernel has ``sch_netem`` (tried once on ``netns``'s loopback)."""
    if "v" not in _NETEM:
        res = _run(
            ["tc", "-n", netns, "qdisc", "add", "dev", "lo", "root", "netem", "delay", "0ms"], check=False
        )
        _NETEM["v"] = res.returncode == 0
        if _NETEM["v"]:
            _run(["tc", "-n", netns, "qdisc", "del", "dev", "lo", "root"], check=False)
    return _NETEM["v"]


def _run(argv: Sequence[str], timeout_s: float = 10.0, check: bool = True) -> subprocess.CompletedProcess:
    try:
        res = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise NetError(f"{' '.join(argv)} did not finish within {timeout_s:.3g}s", stage="netns") from None
    except FileNotFoundError:
        raise NetError(
            f"{argv[0]} is not installed (Debian: apt-get install iproute2)", stage="netns"
        ) from None
    if check and res.returncode != 0:
        raise NetError(
            f"{' '.join(argv)} failed ({res.returncode}): {res.stderr.strip()[:300]}", stage="netns"
        )
    return res


def _netns_names() -> list[str]:
    try:
        return sorted(os.listdir(_NETNS_DIR))
    except FileNotFoundError:
        return []


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def leftovers() -> list[str]:
    """Namespaces of this kind whose creating process is gone: left behind by a run that did not clean up."""
    out = []
    for name in _netns_names():
        m = _NAME.match(name)
        if m and not _alive(int(m.group(1))):
            out.append(name)
    return out


def _kill_inside(ns: str) -> int:
    """SIGKILL whatever still runs inside namespace ``ns`` (only processes a virtual network started live
    there). Returns how many."""
    res = _run(["ip", "netns", "pids", ns], check=False)
    n = 0
    for tok in res.stdout.split():
        if tok.isdigit() and int(tok) != os.getpid():
            try:
                os.kill(int(tok), signal.SIGKILL)
                n += 1
            except ProcessLookupError:
                pass
    return n


def _delete_netns(ns: str) -> None:
    _kill_inside(ns)
    _run(["ip", "netns", "delete", ns], check=False)


def remove_leftovers() -> list[str]:
    """Delete :func:`leftovers` (and kill what still runs in them); returns their names."""
    names = leftovers()
    for ns in names:
        _delete_netns(ns)
    return names


# ------------------------------------------------------------------------------------------- cleanup
_LIVE: set[VirtualNet] = set()
_LIVE_LOCK = threading.Lock()
_INSTALLED = False


def _close_all() -> None:
    with _LIVE_LOCK:
        nets = list(_LIVE)
    for net in nets:
        try:
            net.close()
        except Exception:
            pass


def _on_signal(signum: int, frame: Any) -> None:
    _close_all()
    previous = _PREVIOUS.get(signum)
    if callable(previous):
        previous(signum, frame)
        return
    if signum == signal.SIGINT and previous in (None, signal.default_int_handler):
        raise KeyboardInterrupt
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


_PREVIOUS: dict[int, Any] = {}


def install_cleanup() -> None:
    """Remove every live :class:`VirtualNet` at interpreter exit and on SIGTERM / SIGINT (then the previous
    handler runs, or the default action). Idempotent; only from the main thread."""
    global _INSTALLED
    if _INSTALLED or threading.current_thread() is not threading.main_thread():
        return
    _INSTALLED = True
    atexit.register(_close_all)
    for sig in (signal.SIGTERM, signal.SIGINT):
        prev = signal.getsignal(sig)
        if prev is _on_signal:
            continue
        _PREVIOUS[sig] = prev
        signal.signal(sig, _on_signal)


# ------------------------------------------------------------------------------------------- network
@dataclass
class Host:
    """One host of a :class:`VirtualNet`: its namespace, its interface (:data:`DEVICE`) and address, and
    the name of its port on the switch."""

    name: str
    netns: str
    addr: str
    port: str
    index: int

    @property
    def device(self) -> str:
        return DEVICE


class VirtualNet:
    """Hosts (network namespaces) on one virtual switch; see the module docstring.

    >>> with VirtualNet(["p", "d"]) as net:               # doctest: +SKIP
    ...     net["p"].addr, net["d"].addr                 # ('10.77.0.1', '10.77.0.2')
    ...     net.link_down("p"); net.link_up("p")
    ...     net.netem("d", delay_ms=100, loss_pct=5)
    """

    def __init__(
        self, hosts: Sequence[str], *, subnet: str = "10.77.0", mtu: int = 1500, impairable: bool = True
    ) -> None:
        missing = [
            t for t in missing_tools() if t in ("ip", "tc", "root") + (("ethtool",) if impairable else ())
        ]
        if missing:
            raise NetError(
                f"a virtual network needs {missing} (Debian: apt-get install iproute2; run as root)",
                stage="netns",
            )
        if len(set(hosts)) != len(hosts) or not hosts:
            raise ValueError(f"hosts: need distinct names, got {list(hosts)!r}")
        for h in hosts:
            if not re.fullmatch(r"[A-Za-z0-9_.]{1,24}", h):
                raise ValueError(f"hosts: {h!r} is not a name of 1..24 letters, digits, '_' or '.'")
        self.tag = f"{PREFIX}-{os.getpid()}-{next(_COUNTER)}"
        self.subnet = subnet
        self.hosts: dict[str, Host] = {}
        self.switch = f"{self.tag}-sw"
        self.impairable = impairable
        self._procs: list[subprocess.Popen] = []
        self._impaired: dict[str, Any] = {}
        self._bridged: set[str] = set()
        self._closed = False
        self._tmp = tempfile.mkdtemp(prefix=self.tag + "-")
        install_cleanup()
        with _LIVE_LOCK:
            _LIVE.add(self)
        try:
            self._create(list(hosts), mtu)
        except BaseException:
            self.close()
            raise

    # -- construction
    def _create(self, hosts: list[str], mtu: int) -> None:
        _run(["ip", "netns", "add", self.switch])
        _run(["ip", "-n", self.switch, "link", "set", "lo", "up"])
        _run(["ip", "-n", self.switch, "link", "add", "br0", "type", "bridge"])
        _run(["ip", "-n", self.switch, "link", "set", "br0", "up"])
        for i, name in enumerate(hosts, start=1):
            ns = f"{self.tag}-{name}"
            host = Host(name, ns, f"{self.subnet}.{i}", f"p{i}", i)
            _run(["ip", "netns", "add", ns])
            self.hosts[name] = host
            _run(
                [
                    "ip",
                    "link",
                    "add",
                    DEVICE,
                    "netns",
                    ns,
                    "mtu",
                    str(mtu),
                    "type",
                    "veth",
                    "peer",
                    "name",
                    host.port,
                    "netns",
                    self.switch,
                    "mtu",
                    str(mtu),
                ]
            )
            _run(["ip", "-n", self.switch, "link", "set", host.port, "master", "br0", "up"])
            if self.impairable:  # checksummed frames of at most the MTU on the wire (see kvgeom_lab.impair)
                _run(["ip", "netns", "exec", ns, "ethtool", "-K", DEVICE, "tx", "off"])
            _run(["ip", "-n", ns, "addr", "add", f"{host.addr}/24", "dev", DEVICE])
            _run(["ip", "-n", ns, "link", "set", DEVICE, "up"])
            _run(["ip", "-n", ns, "link", "set", "lo", "up"])

    def __getitem__(self, name: str) -> Host:
        return self.hosts[name]

    @property
    def namespaces(self) -> list[str]:
        return [h.netns for h in self.hosts.values()] + [self.switch]

    @property
    def workdir(self) -> str:
        """A temporary directory removed with the network (logs, etcd data)."""
        return self._tmp

    def _ip(self, host: str, *args: str) -> None:
        _run(["ip", "-n", self.hosts[host].netns, *args])

    # -- faults
    def link_down(self, host: str) -> None:
        """Pull ``host``'s cable: its switch port goes down (its own interface loses carrier; packets to
        and from it are dropped, nobody is told)."""
        _run(["ip", "-n", self.switch, "link", "set", self.hosts[host].port, "down"])

    def link_up(self, host: str) -> None:
        _run(["ip", "-n", self.switch, "link", "set", self.hosts[host].port, "up"])

    def netem(
        self,
        host: str,
        *,
        delay_ms: float = 0.0,
        jitter_ms: float = 0.0,
        loss_pct: float = 0.0,
        rate_mbit: float | None = None,
        both: bool = False,
        seed: int = 0,
    ) -> str:
        """Impair what ``host`` sends, as ``tc qdisc replace dev kvh0 root netem delay <d>ms loss <l>%``
        on the host would (``both``: what it receives too; ``rate_mbit`` caps the rate). Uses ``tc netem``
        when the kernel has it, else the userspace impairer (:mod:`kvgeom_lab.impair`, which needs the
        network created ``impairable``). Returns which: ``"tc-netem"`` or ``"impair"``."""
        self.clear_netem(host)
        h = self.hosts[host]
        if _has_netem(self.switch):
            args = ["netem"]
            if delay_ms or jitter_ms:
                args += ["delay", f"{delay_ms}ms"] + ([f"{jitter_ms}ms"] if jitter_ms else [])
            if loss_pct:
                args += ["loss", f"{loss_pct}%"]
            if rate_mbit:
                args += ["rate", f"{rate_mbit}mbit"]
            _run(["tc", "-n", h.netns, "qdisc", "replace", "dev", DEVICE, "root", *args])
            if both:
                _run(["tc", "-n", self.switch, "qdisc", "replace", "dev", h.port, "root", *args])
            self._impaired[host] = "tc-netem"
            return "tc-netem"
        if not self.impairable:
            raise NetError(
                "this kernel has no sch_netem and the network was not created impairable", stage="netns"
            )
        q, r = f"q{h.index}", f"r{h.index}"
        if q not in self._bridged:
            _run(["ip", "-n", self.switch, "link", "add", q, "type", "veth", "peer", "name", r])
            self._bridged.add(q)
        _run(["ip", "-n", self.switch, "link", "set", h.port, "nomaster"])
        _run(["ip", "-n", self.switch, "link", "set", r, "master", "br0", "up"])
        _run(["ip", "-n", self.switch, "link", "set", q, "up"])
        _run(["ip", "-n", self.switch, "link", "set", h.port, "up"])
        pkg = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        argv = (
            [
                sys.executable,
                "-m",
                "kvgeom_lab.impair",
                "--netns",
                self.switch,
                "--host-port",
                h.port,
                "--bridge-port",
                q,
                "--delay-ms",
                str(delay_ms),
                "--jitter-ms",
                str(jitter_ms),
                "--loss-pct",
                str(loss_pct),
                "--seed",
                str(seed),
            ]
            + (["--rate-mbit", str(rate_mbit)] if rate_mbit else [])
            + (["--both"] if both else [])
        )
        env = dict(
            os.environ, PYTHONPATH=os.pathsep.join([pkg] + [p for p in [os.environ.get("PYTHONPATH")] if p])
        )
        log = os.path.join(self._tmp, f"impair-{host}-{len(self._procs)}.log")
        with open(log, "ab") as out:
            proc = subprocess.Popen(
                argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env
            )
        proc.log_path = log  # type: ignore[attr-defined]
        self._procs.append(proc)
        self._impaired[host] = proc
        time.sleep(0.2)  # its sockets are open before frames are sent its way
        if proc.poll() is not None:
            raise NetError(
                f"the impairer exited with {proc.returncode}: {open(log).read()[-400:]}", stage="netns"
            )
        return "impair"

    def clear_netem(self, host: str) -> None:
        """Remove ``host``'s impairment (the link is as created again)."""
        how = self._impaired.pop(host, None)
        h = self.hosts[host]
        if how == "tc-netem":
            _run(["tc", "-n", h.netns, "qdisc", "del", "dev", DEVICE, "root"], check=False)
            _run(["tc", "-n", self.switch, "qdisc", "del", "dev", h.port, "root"], check=False)
        elif how is not None:
            self.stop(how, grace_s=2.0)
            _run(["ip", "-n", self.switch, "link", "set", f"r{h.index}", "nomaster"], check=False)
            _run(["ip", "-n", self.switch, "link", "set", h.port, "master", "br0", "up"])

    def readdress(self, host: str, addr: str | None = None) -> str:
        """Give ``host`` a new address (the old one is removed: connections to it are cut); returns it.
        Default: the host's index + 100 in the same subnet."""
        h = self.hosts[host]
        new = addr or f"{self.subnet}.{h.index + 100}"
        # removed first: deleting a subnet's primary address also deletes the secondaries in it
        self._ip(host, "addr", "del", f"{h.addr}/24", "dev", DEVICE)
        self._ip(host, "addr", "add", f"{new}/24", "dev", DEVICE)
        h.addr = new
        return new

    # -- processes
    def popen(
        self, host: str, argv: Sequence[str], *, log: str | None = None, **kwargs: Any
    ) -> subprocess.Popen:
        """Start ``argv`` inside ``host`` (``ip netns exec``: the pid is the program's own). Output goes to
        ``log`` (a file under :attr:`workdir` by default). Ended by :meth:`stop` or :meth:`close`."""
        if self._closed:
            raise NetError("the virtual network is closed", stage="netns")
        path = log or os.path.join(self._tmp, f"{host}-{os.path.basename(argv[0])}-{len(self._procs)}.log")
        with open(path, "ab") as out:
            p = subprocess.Popen(
                ["ip", "netns", "exec", self.hosts[host].netns, *argv],
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                **kwargs,
            )
        p.log_path = path  # type: ignore[attr-defined]
        self._procs.append(p)
        return p

    def run(self, host: str, argv: Sequence[str], timeout_s: float = 30.0) -> subprocess.CompletedProcess:
        """Run ``argv`` inside ``host`` to completion (bounded); raises :class:`NetError` on failure."""
        return _run(["ip", "netns", "exec", self.hosts[host].netns, *argv], timeout_s=timeout_s)

    @staticmethod
    def stop(proc: subprocess.Popen, grace_s: float = 3.0, sig: int = signal.SIGTERM) -> int | None:
        """``sig``, then SIGKILL after ``grace_s``; returns the exit code."""
        if proc.poll() is None:
            try:
                proc.send_signal(sig)
                proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                try:
                    proc.wait(grace_s)
                except subprocess.TimeoutExpired:
                    pass
        return proc.poll()

    def call(
        self, host: str, fn: Callable[..., Any], *args: Any, timeout_s: float = 30.0, **kwargs: Any
    ) -> Any:
        """:func:`call_in` ``host``'s namespace."""
        return call_in(self.hosts[host].netns, fn, *args, timeout_s=timeout_s, **kwargs)

    # -- lifetime
    def close(self) -> None:
        """End the processes started here, anything else still inside the hosts, then delete every
        namespace (their interfaces go with them) and the work directory. Idempotent, never raises."""
        if self._closed:
            return
        self._closed = True
        for p in self._procs:
            try:
                self.stop(p, grace_s=2.0)
            except Exception:
                pass
        for ns in self.namespaces:
            try:
                _delete_netns(ns)
            except Exception:
                pass
        shutil.rmtree(self._tmp, ignore_errors=True)
        with _LIVE_LOCK:
            _LIVE.discard(self)

    def remaining(self) -> list[str]:
        """This network's namespaces that still exist (empty after :meth:`close`)."""
        names = set(_netns_names())
        return [ns for ns in self.namespaces if ns in names]

    def __enter__(self) -> VirtualNet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        hosts = ", ".join(f"{h.name}={h.addr}" for h in self.hosts.values())
        return f"VirtualNet({self.tag}: {hosts}{', closed' if self._closed else ''})"


# ------------------------------------------------------------------------------------------- etcd
class EtcdServer:
    """One etcd member (Debian's ``etcd-server``) serving clients on ``http://<host addr>:<port>`` inside a
    host of ``net``; its data directory lives in the network's work directory, so a :meth:`stop` then
    :meth:`start` keeps the data (as a restarted member does)."""

    def __init__(self, net: VirtualNet, host: str, port: int = 2379) -> None:
        self.net, self.host, self.port = net, host, port
        self.addr = net[host].addr
        self.data_dir = os.path.join(net.workdir, f"etcd-{host}-{port}")
        self.proc: subprocess.Popen | None = None
        self.starts = 0

    @property
    def endpoint(self) -> str:
        return f"http://{self.addr}:{self.port}"

    def start(self, timeout_s: float = 20.0, wipe: bool = False) -> EtcdServer:
        """Start the member and wait until it answers ``/health`` (bounded). ``wipe``: without its data
        (a member that lost its disk: a new cluster, every key and lease gone)."""
        if shutil.which("etcd") is None:
            raise NetError("etcd is not installed (Debian: apt-get install etcd-server)", stage="etcd")
        if self.proc is not None and self.proc.poll() is None:
            return self
        if wipe:
            shutil.rmtree(self.data_dir, ignore_errors=True)
        peer = f"http://127.0.0.1:{self.port + 1}"
        self.starts += 1
        self.proc = self.net.popen(
            self.host,
            [
                "etcd",
                "--name",
                "kvgeom",
                "--data-dir",
                self.data_dir,
                "--listen-client-urls",
                self.endpoint,
                "--advertise-client-urls",
                self.endpoint,
                "--listen-peer-urls",
                peer,
                "--initial-advertise-peer-urls",
                peer,
                "--initial-cluster",
                f"kvgeom={peer}",
                "--logger",
                "zap",
                "--log-level",
                "error",
            ],
            log=os.path.join(self.net.workdir, f"etcd-{self.host}-{self.starts}.log"),
        )
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise NetError(f"etcd exited with {self.proc.returncode}: {self.log()[-500:]}", stage="etcd")
            try:
                if self.net.call(self.host, _health, self.endpoint, timeout_s=3.0):
                    return self
            except Exception:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise NetError(f"etcd did not become healthy within {timeout_s:.3g}s", stage="etcd")
            time.sleep(0.1)

    def stop(self, sig: int = signal.SIGTERM) -> None:
        """Stop the member (SIGTERM; ``sig=SIGKILL`` for a crash). Its data stays for the next start."""
        if self.proc is not None:
            VirtualNet.stop(self.proc, grace_s=5.0, sig=sig)

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log(self) -> str:
        path = getattr(self.proc, "log_path", None)
        try:
            with open(path or "", errors="replace") as f:
                return f.read()
        except OSError:
            return ""


def _health(endpoint: str) -> bool:
    import urllib.request

    with urllib.request.urlopen(endpoint + "/health", timeout=1.0) as r:
        return json.loads(r.read()).get("health") == "true"


# ------------------------------------------------------------------------------------------- capacity
def measure_capacity(
    net: VirtualNet, server: str, client: str, seconds: float = 2.0, reverse: bool = False, port: int = 5201
) -> float:
    """The link's capacity from ``client`` to ``server`` (or back, ``reverse``) in bytes per second: one
    TCP stream of ``iperf3`` for ``seconds`` (what a single UCX TCP connection can hope for)."""
    if shutil.which("iperf3") is None:
        raise NetError("iperf3 is not installed (Debian: apt-get install iperf3)", stage="iperf3")
    srv = net.popen(server, ["iperf3", "-s", "-1", "-B", net[server].addr, "-p", str(port)])
    try:
        deadline = time.monotonic() + 10.0
        while True:
            res = subprocess.run(
                [
                    "ip",
                    "netns",
                    "exec",
                    net[client].netns,
                    "iperf3",
                    "-c",
                    net[server].addr,
                    "-p",
                    str(port),
                    "-t",
                    f"{seconds:g}",
                    "-J",
                ]
                + (["-R"] if reverse else []),
                capture_output=True,
                text=True,
                timeout=seconds + 20,
            )
            try:
                data = json.loads(res.stdout)
                return float(data["end"]["sum_received"]["bits_per_second"]) / 8.0
            except (ValueError, KeyError, TypeError):
                pass  # not listening yet, or a failed run: retried until the deadline
            if time.monotonic() > deadline:
                raise NetError(f"iperf3 failed: {res.stdout[-300:]} {res.stderr[-300:]}", stage="iperf3")
            time.sleep(0.2)
    finally:
        VirtualNet.stop(srv, grace_s=2.0)
