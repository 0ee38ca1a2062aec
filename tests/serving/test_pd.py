"""Real vLLM engines serve tokens as a P/D pair, in vLLM's toy-proxy flow (docs/serving.md).

Each connector configuration (stock NixlConnector; kvgeom_vllm's KvgeomNixlConnector in vLLM-compatible
and in kvgeom mode; a dense and a Mamba2-hybrid model) starts P (block 32) and two D engines (block 32 and
block 64) as OpenAI API server processes (``tests/serving/_servers.py``), once for all its cases. Per prompt: P completes it with ``max_tokens=1`` and ``kv_transfer_params: {"do_remote_decode":
true}``; D completes it with the ``kv_transfer_params`` P returned, pulling P's KV cache (and SSM state)
over NIXL instead of computing the prompt. D's greedy fp32 token ids must equal those of one engine
computing the prompt alone (D itself, before any transfer, without ``kv_transfer_params``; the first pair
of a model fixes the reference and every later D must agree with it), D's ``/metrics`` must show bytes moved
and no failed transfer -- except where a case documents otherwise (P 32 -> D 64 on stock vLLM, which
corrupts; on vLLM-compatible kvgeom_vllm, which refuses; kvgeom mode serves it).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from _models import PROMPTS
from _servers import RESULTS, Server, ServerError, wait_metric

MAX_TOKENS = 12
BYTES = "vllm:nixl_bytes_transferred_sum"
FAILED = "vllm:nixl_num_failed_transfers_total"


@dataclass(frozen=True)
class Config:
    """One connector configuration of a model: P (block 32) and two D engines (block 32 and block 64)
    serve every case of it, so each engine starts once."""

    model: str
    connector: str  # "NixlConnector" or "KvgeomNixlConnector"
    mode: str  # "stock" for vLLM's connector, else kvgeom_vllm's compat mode

    @property
    def name(self) -> str:
        return f"{self.model} {self.connector if self.mode == 'stock' else 'kvgeom_vllm ' + self.mode}"

    def kv_transfer_config(self) -> dict[str, Any]:
        cfg: dict[str, Any] = {
            "kv_connector": self.connector,
            "kv_role": "kv_both",
            "kv_buffer_device": "cpu",
        }
        if self.connector != "NixlConnector":
            cfg["kv_connector_module_path"] = "kvgeom_vllm"
            cfg["kv_connector_extra_config"] = {"compat": self.mode}
        return cfg


KVGEOM = "KvgeomNixlConnector"
CONFIGS = [
    Config(model, connector, mode)
    for connector, mode in (("NixlConnector", "stock"), (KVGEOM, "vllm"), (KVGEOM, "kvgeom"))
    for model in ("dense", "nemotron_h")
]


@dataclass
class Engines:
    config: Config
    p: Server
    d: dict[int, Server]  # D block size -> D
    start_s: float
    p64: Server | None = None  # kvgeom mode: a P of block 64 too (P 64 -> D 32)

    def stop(self) -> None:
        for s in (self.p, *self.d.values(), *([self.p64] if self.p64 else [])):
            s.stop()


@pytest.fixture(scope="module", params=CONFIGS, ids=[c.name for c in CONFIGS])
def engines(request: pytest.FixtureRequest, model_dirs: dict[str, Path], logs_dir: Path) -> Iterator[Engines]:
    config: Config = request.param
    tag = config.name.replace(" ", "_")
    cfg = config.kv_transfer_config()
    model = model_dirs[config.model]
    t0 = time.monotonic()
    p = Server(f"P[{config.name}]", model, logs_dir / f"{tag}.P32.log", core=0, block_size=32,
               kv_transfer_config=cfg)  # fmt: skip
    d = {
        b: Server(
            f"D{b}[{config.name}]",
            model,
            logs_dir / f"{tag}.D{b}.log",
            core=1 if b == 32 else 0,
            block_size=b,
            kv_transfer_config=cfg,
        )  # fmt: skip
        for b in (32, 64)
    }
    p64 = None
    if config.mode == "kvgeom":  # the ratio the other way; stock vLLM asserts on it, vllm mode refuses it
        p64 = Server(f"P64[{config.name}]", model, logs_dir / f"{tag}.P64.log", core=1, block_size=64,
                     kv_transfer_config=cfg)  # fmt: skip
    running = Engines(config, p, d, 0.0, p64)
    servers = (p, *d.values(), *([p64] if p64 else []))
    try:
        for s in servers:
            s.start()
        for s in servers:
            s.wait_ready()
        running.start_s = time.monotonic() - t0
        yield running
    finally:
        running.stop()


@dataclass
class Served:
    equal: int
    mismatches: list[tuple[str, list[int], list[int]]]
    moved: float
    failed: float
    errors: list[str]


def serve(
    engines: Engines,
    d_block: int,
    references: dict[str, dict[str, list[int]]],
    case: str,
    p: Server | None = None,
) -> Served:
    """Every prompt through the toy-proxy flow, P (default: block 32) -> D(d_block); D's greedy tokens
    against the reference."""
    t0 = time.monotonic()
    p, d = p or engines.p, engines.d[d_block]
    # one engine computing each prompt alone: D before any transfer
    own = {prompt: d.complete(prompt, MAX_TOKENS)["token_ids"] for prompt in PROMPTS}
    assert all(len(t) == MAX_TOKENS for t in own.values()), own
    ref = references.setdefault(engines.config.model, own)
    assert own == ref, f"{case}: D's own completions differ from the model's reference"
    before = d.metrics()
    out = Served(0, [], 0.0, 0.0, [])
    for prompt in PROMPTS:
        first = p.complete(prompt, 1, {"do_remote_decode": True})
        params = first["kv_transfer_params"]
        assert params and params.get("remote_engine_id"), f"P returned no kv_transfer_params: {first}"
        try:
            got = d.complete(prompt, MAX_TOKENS, params)["token_ids"]
        except ServerError as exc:
            out.errors.append(str(exc).splitlines()[0])
            continue
        if got == ref[prompt]:
            out.equal += 1
        else:
            out.mismatches.append((prompt[:30], got, ref[prompt]))
    b0, f0 = before.get(BYTES, 0.0), before.get(FAILED, 0.0)
    out.moved = wait_metric(d, BYTES, lambda v: v > b0, timeout=20.0) - b0
    out.failed = d.metrics().get(FAILED, 0.0) - f0
    c = engines.config
    RESULTS.append(
        {
            "case": case, "connector": c.connector, "mode": c.mode, "prompts": len(PROMPTS),
            "equal": out.equal, "bytes": int(out.moved), "failed": int(out.failed),
            "errors": len(out.errors), "time_s": time.monotonic() - t0, "engines_start_s": engines.start_s,
        }
    )  # fmt: skip
    return out


def test_equal_blocks_serve_the_single_engine_tokens(
    engines: Engines, references: dict[str, dict[str, list[int]]]
) -> None:
    """P block 32 -> D block 32: every connector and mode serves D the single engine's tokens."""
    case = f"{engines.config.model} 32->32"
    out = serve(engines, 32, references, case)
    assert not out.errors, out.errors
    assert out.moved > 0, f"{case}: D's /metrics shows no bytes transferred"
    assert out.failed == 0, f"{case}: {out.failed} failed transfers"
    assert out.equal == len(PROMPTS), f"{case}: {out.equal} of {len(PROMPTS)} equal; {out.mismatches}"


def test_p32_to_d64_on_the_cpu_page(engines: Engines, references: dict[str, dict[str, list[int]]]) -> None:
    """P block 32 -> D block 64 on vLLM's CPU attention page (per head K transposed, [head_size, tokens],
    then V rows: tests/serving/test_cpu_page.py): stock vLLM regroups it as [heads, tokens, head_size],
    reports success and serves wrong tokens (the documented regression, kept so that a fix in vLLM shows
    here); kvgeom_vllm in vLLM-compatible mode refuses the pair at handshake (no byte moved, nothing wrong
    served); in kvgeom mode it cuts both pages by their token runs (kvgeom/layout/tokenruns.py) and D serves
    the single engine's tokens."""
    c = engines.config
    case = f"{c.model} 32->64"
    out = serve(engines, 64, references, case)
    if c.mode == "stock":  # vLLM 0.32.0 (and 0.33.0: the same post-process) corrupts silently
        assert not out.errors, out.errors
        assert out.moved > 0 and out.failed == 0, (out.moved, out.failed)
        assert out.equal < len(PROMPTS), f"{case}: stock vLLM served the CPU page right (fixed upstream?)"
    elif c.mode == "vllm":  # refused, never wrong tokens
        assert out.moved == 0, f"{case}: {out.moved} bytes moved into a pair kvgeom refuses"
        assert not out.mismatches, f"{case}: wrong tokens served: {out.mismatches}"
    else:  # kvgeom mode: the right bytes
        assert not out.errors, out.errors
        assert out.moved > 0, f"{case}: D's /metrics shows no bytes transferred"
        assert out.failed == 0, f"{case}: {out.failed} failed transfers"
        assert out.equal == len(PROMPTS), f"{case}: {out.equal} of {len(PROMPTS)} equal; {out.mismatches}"


KVGEOM_MODE = [c for c in CONFIGS if c.mode == "kvgeom"]


@pytest.mark.parametrize("engines", KVGEOM_MODE, ids=[c.name for c in KVGEOM_MODE], indirect=True)
def test_p64_to_d32_on_the_cpu_page_in_kvgeom_mode(
    engines: Engines, references: dict[str, dict[str, list[int]]]
) -> None:
    """P block 64 -> D block 32 (stock vLLM asserts; vLLM-compatible kvgeom_vllm refuses): kvgeom mode
    reads each 32-token half of P's CPU pages by its token runs and D serves the single engine's tokens."""
    c = engines.config
    assert engines.p64 is not None, f"{c.name}: no P of block 64 started"
    case = f"{c.model} 64->32"
    out = serve(engines, 32, references, case, engines.p64)
    assert not out.errors, out.errors
    assert out.moved > 0, f"{case}: D's /metrics shows no bytes transferred"
    assert out.failed == 0, f"{case}: {out.failed} failed transfers"
    assert out.equal == len(PROMPTS), f"{case}: {out.equal} of {len(PROMPTS)} equal; {out.mismatches}"
