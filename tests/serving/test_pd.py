"""Real vLLM engines serve tokens as a P/D pair, in vLLM's toy-proxy flow (docs/serving.md).

Each connector configuration (stock NixlConnector; kvgeom_vllm's KvgeomNixlConnector in vLLM-compatible
and in kvgeom mode; a dense and a Mamba2-hybrid model) starts three engines as OpenAI API server processes
(``tests/serving/_servers.py``), once for all its cases: A (block 32), B (block 32) and C (block 64), every
one ``kv_both``. P 32 -> D 32 is A -> B, P 32 -> D 64 is A -> C, and (kvgeom mode) P 64 -> D 32 is C -> B.
``KVGEOM_SERVING_MODES`` (a comma list of ``stock``, ``vllm``, ``kvgeom``; all by default) picks the
configurations. Per prompt: P completes it with ``max_tokens=1`` and ``kv_transfer_params:
{"do_remote_decode": true}``; D completes it with the ``kv_transfer_params`` P returned, pulling P's KV
cache (and SSM state) over NIXL instead of computing the prompt. D's greedy fp32 token ids must equal those
of one engine computing the prompt alone (D itself, before any transfer to it, without
``kv_transfer_params``; the first D of a model fixes the reference and every later D must agree with it),
D's ``/metrics`` must show bytes moved and no failed transfer -- except where a case documents otherwise
(P 32 -> D 64 on stock vLLM, which corrupts; on vLLM-compatible kvgeom_vllm, which refuses; kvgeom mode
serves it).
"""

from __future__ import annotations

import json
import os
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
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
    """One connector configuration of a model: three engines (A and B of block 32, C of block 64) serve
    every case of it, so each engine starts once."""

    model: str
    connector: str  # "NixlConnector", "KvgeomNixlConnector" or "KvgeomNixlPushConnector"
    mode: str  # "stock" for vLLM's connector, else kvgeom_vllm's compat mode ("-push": the push connector)

    @property
    def compat(self) -> str:
        return self.mode.removesuffix("-push")

    @property
    def push(self) -> bool:
        """P writes D's blocks (vLLM's push connector): P posts the transfers, so P's metrics count them."""
        return self.mode.endswith("-push")

    @property
    def name(self) -> str:
        return f"{self.model} {self.connector if self.compat == 'stock' else 'kvgeom_vllm ' + self.mode}"

    def kv_transfer_config(self) -> dict[str, Any]:
        cfg: dict[str, Any] = {
            "kv_connector": self.connector,
            "kv_role": "kv_both",
            "kv_buffer_device": "cpu",
            # a read that fails (a dead P) makes D compute the prompt itself instead of failing the request
            # (vLLM's default is "fail"); failed reads still count in D's metrics, which every case checks
            "kv_load_failure_policy": "recompute",
        }
        if self.compat != "stock":
            cfg["kv_connector_module_path"] = "kvgeom_vllm"
            # NIXL's progress threads wait for events (1 ms at most) instead of spinning, and one UCX worker:
            # three engines share two cores here; with vLLM's agent (4 threads, no delay) a P 32 -> D 64 read
            # took 35-110 s, with these 0.1-0.6 s (docs/vllm.md, docs/serving.md)
            # vLLM's workers call their agent from several threads (the handshake executor, the engine's
            # thread, push's writer): NIXL's reader-writer lock serialises the metadata calls (docs/vllm.md)
            cfg["kv_connector_extra_config"] = {
                "compat": self.compat, "num_threads": 0, "nixl_progress_delay_us": 1000, "nixl_sync_mode": "rw",
                **json.loads(os.environ.get("KVGEOM_SERVING_EXTRA") or "{}"),
            }  # fmt: skip
        return cfg


KVGEOM = "KvgeomNixlConnector"
MODES = ("stock", "vllm", "kvgeom", "stock-push", "kvgeom-push")


def selected_modes(value: str | None) -> tuple[str, ...]:
    """The configurations ``KVGEOM_SERVING_MODES`` asks for (all when unset); an unknown name is an error,
    so a typo cannot select nothing and pass."""
    if not value:
        return MODES
    names = tuple(m.strip() for m in value.split(",") if m.strip())
    unknown = [m for m in names if m not in MODES]
    if unknown or not names:
        raise ValueError(f"KVGEOM_SERVING_MODES={value!r}: unknown {unknown}; choose from {list(MODES)}")
    return names


_CONNECTOR = {
    "stock": "NixlConnector",
    "vllm": KVGEOM,
    "kvgeom": KVGEOM,
    "stock-push": "NixlPushConnector",
    "kvgeom-push": "KvgeomNixlPushConnector",
}
CONFIGS = [
    Config(model, _CONNECTOR[mode], mode)
    for mode in selected_modes(os.environ.get("KVGEOM_SERVING_MODES"))
    for model in ("dense", "nemotron_h")
]


@dataclass
class Engines:
    """A (block 32: P of the block-32 cases), ``d[32]`` = B and ``d[64]`` = C (the D engines; C is also
    the P of block 64 for P 64 -> D 32)."""

    config: Config
    p: Server
    d: dict[int, Server]  # block size -> D
    start_s: float
    own: dict[int, dict[str, list[int]]] = field(default_factory=dict)  # D block -> its own completions

    def stop(self) -> None:
        for s in (self.p, *self.d.values()):
            s.stop()


@pytest.fixture(scope="module", params=CONFIGS, ids=[c.name for c in CONFIGS])
def engines(request: pytest.FixtureRequest, model_dirs: dict[str, Path], logs_dir: Path) -> Iterator[Engines]:
    config: Config = request.param
    tag = config.name.replace(" ", "_")
    cfg = config.kv_transfer_config()
    model = model_dirs[config.model]
    t0 = time.monotonic()

    def server(role: str, core: int, block: int, prefix_caching: bool = False) -> Server:
        return Server(f"{role}{block}[{config.name}]", model, logs_dir / f"{tag}.{role}{block}.log", core=core,
                      block_size=block, kv_transfer_config=cfg, prefix_caching=prefix_caching)  # fmt: skip

    b = server("B", 1, 32, prefix_caching=config.model in PREFIX_MODELS)
    running = Engines(config, server("A", 0, 32), {32: b, 64: server("C", 0, 64)}, 0.0)
    servers = (running.p, *running.d.values())
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


# B32 serves with prefix caching for these models (a D's prefix-cache hit, test_prefix_hit_on_d_...); every D
# request carries a salt, so other cases never hit each other's blocks
PREFIX_MODELS = ("dense",)
HITS = "vllm:prefix_cache_hits_total"


def reference(
    engines: Engines, d_block: int, references: dict[str, dict[str, list[int]]], case: str
) -> dict[str, list[int]]:
    """One engine computing each prompt alone: D before any transfer to it (once per D engine, salted apart
    from the cases), checked against the model's reference (the first D's)."""
    d = engines.d[d_block]
    if d_block not in engines.own:
        own = {
            prompt: d.complete(prompt, MAX_TOKENS, cache_salt="reference")["token_ids"] for prompt in PROMPTS
        }
        assert all(len(t) == MAX_TOKENS for t in own.values()), own
        engines.own[d_block] = own
    ref = references.setdefault(engines.config.model, engines.own[d_block])
    assert engines.own[d_block] == ref, f"{case}: D's own completions differ from the model's reference"
    return ref


def serve(
    engines: Engines,
    d_block: int,
    references: dict[str, dict[str, list[int]]],
    case: str,
    p: Server | None = None,
) -> Served:
    """Every prompt through the toy-proxy flow, P (default: A, block 32) -> D(d_block); D's greedy tokens
    against the reference."""
    t0 = time.monotonic()
    p, d = p or engines.p, engines.d[d_block]
    ref = reference(engines, d_block, references, case)
    mover = p if engines.config.push else d  # the engine that posts the transfers counts them
    before = mover.metrics()
    out = Served(0, [], 0.0, 0.0, [])
    for prompt in PROMPTS:
        rid = request_id()  # one id for P and D, as a P/D router gives them
        first = p.complete(prompt, 1, {"do_remote_decode": True}, request_id=rid)
        params = first["kv_transfer_params"]
        assert params and params.get("remote_engine_id"), f"P returned no kv_transfer_params: {first}"
        try:  # a salt of the case's own: D's prefix cache (B32) never serves one case's blocks to another
            got = d.complete(prompt, MAX_TOKENS, params, cache_salt=case, request_id=rid)["token_ids"]
        except ServerError as exc:
            out.errors.append(str(exc).splitlines()[0])
            continue
        if got == ref[prompt]:
            out.equal += 1
        else:
            out.mismatches.append((prompt[:30], got, ref[prompt]))
    b0, f0 = before.get(BYTES, 0.0), before.get(FAILED, 0.0)
    out.moved = wait_metric(mover, BYTES, lambda v: v > b0, timeout=20.0) - b0
    out.failed = mover.metrics().get(FAILED, 0.0) - f0
    record(engines, case, len(PROMPTS), out, t0)
    return out


def request_id() -> str:
    """A fresh request id for one prompt's P and D requests (vLLM's toy proxy gives both the same uuid: the
    push connector pairs D's registration with P's finished blocks by it; pull reads by P's id in
    ``kv_transfer_params`` and does not need it)."""
    return f"kvgeom-{uuid.uuid4().hex}"


def record(engines: Engines, case: str, prompts: int, out: Served, t0: float) -> None:
    """One row of the results table (tests/serving/conftest.py prints it)."""
    c = engines.config
    RESULTS.append(
        {
            "case": case, "connector": c.connector, "mode": c.mode, "prompts": prompts,
            "equal": out.equal, "bytes": int(out.moved), "failed": int(out.failed),
            "errors": len(out.errors), "time_s": time.monotonic() - t0, "engines_start_s": engines.start_s,
        }
    )  # fmt: skip


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


# A block-size ratio on the CPU page: pulls only. kvgeom mode cuts the page by its token runs in pulls and refuses
# a push at a block-size ratio on it at handshake (UnsupportedError, field "mode"), so the push configurations
# serve the equal-blocks case alone (a ratio push waits for P's lease on D: not a case to time out in CI)
RATIO_CASES = [c for c in CONFIGS if not c.push]


@pytest.mark.parametrize("engines", RATIO_CASES, ids=[c.name for c in RATIO_CASES], indirect=True)
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
    if c.compat == "stock":  # vLLM 0.32.0 (and 0.33.0: the same post-process) corrupts silently
        assert not out.errors, out.errors
        assert out.moved > 0 and out.failed == 0, (out.moved, out.failed)
        assert out.equal < len(PROMPTS), f"{case}: stock vLLM served the CPU page right (fixed upstream?)"
    elif c.compat == "vllm":  # refused, never wrong tokens
        assert out.moved == 0, f"{case}: {out.moved} bytes moved into a pair kvgeom refuses"
        assert not out.mismatches, f"{case}: wrong tokens served: {out.mismatches}"
    else:  # kvgeom mode: the right bytes
        assert not out.errors, out.errors
        assert out.moved > 0, f"{case}: D's /metrics shows no bytes transferred"
        assert out.failed == 0, f"{case}: {out.failed} failed transfers"
        assert out.equal == len(PROMPTS), f"{case}: {out.equal} of {len(PROMPTS)} equal; {out.mismatches}"


KVGEOM_MODE = [c for c in RATIO_CASES if c.compat == "kvgeom"]


@pytest.mark.parametrize("engines", KVGEOM_MODE, ids=[c.name for c in KVGEOM_MODE], indirect=True)
def test_p64_to_d32_on_the_cpu_page_in_kvgeom_mode(
    engines: Engines, references: dict[str, dict[str, list[int]]]
) -> None:
    """P block 64 -> D block 32 (stock vLLM asserts; vLLM-compatible kvgeom_vllm refuses): kvgeom mode
    reads each 32-token half of P's CPU pages by its token runs and D serves the single engine's tokens."""
    c = engines.config
    case = f"{c.model} 64->32"
    out = serve(engines, 32, references, case, engines.d[64])
    assert not out.errors, out.errors
    assert out.moved > 0, f"{case}: D's /metrics shows no bytes transferred"
    assert out.failed == 0, f"{case}: {out.failed} failed transfers"
    assert out.equal == len(PROMPTS), f"{case}: {out.equal} of {len(PROMPTS)} equal; {out.mismatches}"


PREFIX_CASES = [c for c in CONFIGS if c.model in PREFIX_MODELS and not c.push]


@pytest.mark.parametrize("engines", PREFIX_CASES, ids=[c.name for c in PREFIX_CASES], indirect=True)
def test_prefix_hit_on_d_pulls_only_the_blocks_after_it(
    engines: Engines, references: dict[str, dict[str, list[int]]]
) -> None:
    """P block 32 -> D block 32 where D (prefix caching on) already holds the prompt's first two blocks,
    having computed them alone: D pulls only the blocks after them (fewer bytes than the same prompt with
    nothing cached, under another salt) and serves the single engine's tokens."""
    c = engines.config
    case = f"{c.model} 32->32 prefix hit"
    p, d = engines.p, engines.d[32]
    prompt = PROMPTS[3]  # 5 blocks of 32
    ref = reference(engines, 32, references, case)[prompt]
    t0 = time.monotonic()
    ids = d.complete(prompt, 1, cache_salt="tokens")["prompt_token_ids"]
    assert len(ids) > 96, ids
    d.complete(ids[:64], 1, cache_salt=case)  # D computes the first two blocks alone: now in its cache

    def pull(salt: str) -> tuple[list[int], float, float]:
        before = d.metrics()
        rid = request_id()
        params = p.complete(prompt, 1, {"do_remote_decode": True}, request_id=rid)["kv_transfer_params"]
        got = d.complete(prompt, MAX_TOKENS, params, cache_salt=salt, request_id=rid)["token_ids"]
        b0 = before.get(BYTES, 0.0)
        moved = wait_metric(d, BYTES, lambda v: v > b0, timeout=20.0) - b0
        after = d.metrics()
        assert after.get(FAILED, 0.0) == before.get(FAILED, 0.0), f"{case}: a failed transfer"
        return got, moved, after.get(HITS, 0.0) - before.get(HITS, 0.0)

    cold, cold_moved, cold_hits = pull(case + " cold")  # nothing of this salt cached on D
    hit, hit_moved, hit_hits = pull(case)
    record(
        engines, case, 2, Served(int(cold == ref) + int(hit == ref), [], cold_moved + hit_moved, 0.0, []), t0
    )
    assert cold == ref and hit == ref, (cold, hit, ref)
    assert cold_hits == 0 and hit_hits >= 64, (cold_hits, hit_hits)  # the two blocks D computed, hit
    assert 0 < hit_moved < cold_moved, (hit_moved, cold_moved)  # only the blocks after them were pulled


PULL_CASES = [c for c in CONFIGS if not c.push]


@pytest.mark.parametrize("engines", PULL_CASES, ids=[c.name for c in PULL_CASES], indirect=True)
def test_p_killed_after_its_prefill_d_recomputes_the_single_engine_tokens(
    engines: Engines, references: dict[str, dict[str, list[int]]], model_dirs: dict[str, Path], logs_dir: Path
) -> None:
    """A P of its own computes the prompt, hands D its ``kv_transfer_params`` and is SIGKILLed (its whole
    process group, as a crash ends it) before D reads: D's read of the dead P fails, no byte reaches D, and D
    computes the prompt itself (``kv_load_failure_policy`` "recompute") and serves the single engine's
    tokens, within the request's bounded wait."""
    c = engines.config
    case = f"{c.model} 32->32 P killed"
    d = engines.d[32]
    prompt = PROMPTS[3]
    ref = reference(engines, 32, references, case)[prompt]
    tag = c.name.replace(" ", "_")
    doomed = Server(f"K32[{c.name}]", model_dirs[c.model], logs_dir / f"{tag}.K32.log", core=0, block_size=32,
                    kv_transfer_config=c.kv_transfer_config())  # fmt: skip
    try:
        doomed.start()
        doomed.wait_ready()
        rid = request_id()
        params = doomed.complete(prompt, 1, {"do_remote_decode": True}, request_id=rid)["kv_transfer_params"]
        assert params and params.get("remote_engine_id"), params
        doomed.kill()
        t0 = time.monotonic()
        before = d.metrics()
        got = d.complete(prompt, MAX_TOKENS, params, cache_salt=case, request_id=rid)["token_ids"]
        after = d.metrics()
    finally:
        doomed.stop()
    moved = after.get(BYTES, 0.0) - before.get(BYTES, 0.0)
    failed = after.get(FAILED, 0.0) - before.get(FAILED, 0.0)
    record(engines, case, 1, Served(int(got == ref), [], moved, failed, []), t0)
    assert got == ref, f"{case}: D served {got}, the single engine {ref}"
    assert moved == 0, f"{case}: {moved} bytes counted as read from a dead P"
